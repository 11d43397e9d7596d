// A model's weights as one table: for a config, every tensor the checkpoint must hold, with its
// HF name, shape, storage, the layer part and role it plays, and how tensor parallelism splits
// it. Each architecture writes its table once (models/deepseek_v3_spec.cpp) and every consumer
// reads it: validate_checkpoint, DeepseekModel::load_weights (which binds each entry to its slot),
// the model's active-weight counts and `moat plan`'s sizing (plan/model_size.cpp). A tensor's
// name or shape written anywhere else is a second source that can drift.
//
// Layers carry a kind per sublayer so a hybrid model (Kimi Linear / K3: KDA layers among MLA
// layers, a latent MoE) is a table whose layers mix kinds, built from the same part builders.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "config/model_config.h"
#include "loader/checkpoint.h"
#include "loader/weight_map.h"

namespace moat {

enum class AttentionKind { mla, kda };  // kda: Kimi Delta Attention (Kimi Linear / K3)
enum class FfnKind { dense, moe };      // moe with routed_expert_hidden_size: K3's latent MoE

struct LayerSpec {
  int64_t index = 0;
  AttentionKind attention = AttentionKind::mla;
  FfnKind ffn = FfnKind::dense;
};

// Where a tensor sits. Outside the decoder layers: embedding, lm_head, final_norm.
enum class Part {
  embedding,       // model.embed_tokens
  lm_head,
  final_norm,      // model.norm
  layer_norms,     // a layer's input_layernorm and post_attention_layernorm (around both sublayers)
  attention,       // self_attn.*
  dense_mlp,       // mlp.{gate,up,down}_proj of a dense layer
  router,          // mlp.gate.weight and its e_score_correction_bias
  routed_expert,   // mlp.experts.{expert}.*
  shared_experts,  // mlp.shared_experts.*: one MLP of width n_shared * moe_intermediate
  mtp_input,       // an MTP head's enorm, hnorm and eh_proj (models/deepseek_v3_spec.cpp)
  attn_res,        // Kimi K3's attention residuals: the mix weights before each sublayer and the output
  latent_moe,      // Kimi K3: routed_expert_down_proj / routed_expert_norm / routed_expert_up_proj
};

// What a tensor does inside its part.
enum class Role {
  weight,             // a part's one weight: embedding and lm_head [vocab, hidden], final norm
                      // [hidden], router gate [E, hidden]
  input_norm,         // [hidden]
  post_attention_norm,  // [hidden]
  // MLA
  q_a_proj,           // [q_lora, hidden]
  q_a_norm,           // [q_lora]
  q_b_proj,           // [heads * (nope + rope), q_lora]
  q_proj,             // [heads * (nope + rope), hidden] when q_lora_rank is null
  kv_a_proj,          // kv_a_proj_with_mqa [kv_lora + rope, hidden]
  kv_a_norm,          // [kv_lora]
  kv_b_proj,          // [heads * (nope + v), kv_lora]: per head W_UK then W_UV
  o_proj,             // [hidden, heads * v]
  // MLP (dense, routed expert, shared experts)
  gate_proj,          // [inter, hidden]
  up_proj,            // [inter, hidden]
  down_proj,          // [hidden, inter]
  score_bias,         // router e_score_correction_bias [E] (noaux_tc)
  // MTP input (Part::mtp_input)
  mtp_enorm,          // [hidden] on the next token's embedding
  mtp_hnorm,          // [hidden] on the main model's hidden state
  mtp_eh_proj,        // [hidden, 2 * hidden] over [enorm(embedding); hnorm(hidden)]
  // KDA (Part::attention of a kda layer; width = heads * head_dim, K = head_dim)
  kda_q_proj,         // [width, hidden]
  kda_k_proj,         // [width, hidden]
  kda_v_proj,         // [width, hidden]
  kda_q_conv,         // [width, 1, conv]: depthwise causal conv on q
  kda_k_conv,         // [width, 1, conv]
  kda_v_conv,         // [width, 1, conv]
  kda_f_a_proj,       // [K, hidden]: decay gate, low rank
  kda_f_b_proj,       // [width, K]
  kda_a_log,          // [1, 1, heads, 1] F32: per-head decay rate, log
  kda_dt_bias,        // [width] F32
  kda_b_proj,         // [heads, hidden]: beta logits
  kda_g_a_proj,       // [K, hidden]: output gate, low rank
  kda_g_b_proj,       // [width, K]
  kda_o_norm,         // [K]: per-head RMSNorm of the output
  kda_g_proj,         // [width, hidden]: K3's full-rank output gate (use_full_rank_gate)
  // o_proj [hidden, width] is Role::o_proj
  attn_output_gate,   // K3 MLA g_proj [heads * v, hidden]: attention output * sigmoid(g_proj(x))
  // AttnRes (Part::attn_res): per mix site a norm weight [hidden] and a projection [1, hidden];
  // only their product is used. Sites: before attention, before the FFN (per layer), and output.
  res_attn_norm, res_attn_proj, res_mlp_norm, res_mlp_proj, res_output_norm, res_output_proj,
  // Latent MoE (Part::latent_moe): x [hidden] -> z [latent] for the routed experts, and back
  latent_down_proj,   // [latent, hidden]
  latent_norm,        // [latent]
  latent_up_proj,     // [hidden, latent]
};

// How tensor parallelism splits a tensor across ranks (issue 15). Dimensions are the
// checkpoint's: dim 0 = output features (rows), dim 1 = input features.
enum class TpSplit {
  replicated,  // every rank holds all of it: norms, router, and q_a / kv_a, whose outputs every head reads
  column,      // dim 0 split, split_unit rows at a time (a head): each rank computes its heads / its slice of the intermediate
  row,         // dim 1 split, split_unit columns at a time: partial sums, one all-reduce after
  vocab,       // dim 0 split by token id: vocabulary-parallel embedding and lm_head
  expert,      // whole on the rank that owns the expert (EP); TP inside an expert would split
               // gate/up by column and down by row, as a dense MLP
};

struct TensorSpec {
  std::string name;             // HF name, e.g. "model.layers.3.self_attn.kv_b_proj.weight"
  std::vector<int64_t> shape;   // [n] or [out, in]
  TensorStorage storage = TensorStorage::matrix;
  int64_t layer = -1;           // -1 outside the decoder layers
  Part part = Part::attention;
  Role role = Role::o_proj;
  int64_t expert = -1;          // routed_expert only: 0..E-1
  TpSplit split = TpSplit::replicated;
  int64_t split_unit = 1;       // column/row: rows/columns that stay on one rank (a head's), else 1

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  bool is_matrix() const { return storage != TensorStorage::vector; }
};

struct WeightSpec {
  ModelConfig config;               // the table's source; validation reads its quantization
  std::vector<LayerSpec> layers;    // [num_hidden_layers]; MTP layers are not part of the model
  std::vector<TensorSpec> tensors;  // embedding, then layer by layer, then final norm and lm_head
  // Routed experts a token uses per MoE layer (num_experts_per_tok) and the count per layer.
  int64_t experts_per_token = 0;
  int64_t routed_experts = 0;

  // The tensor with this name, or nullptr.
  const TensorSpec* find(std::string_view name) const;
  // Does one decode token read this tensor? Everything but the routed experts it is not sent to;
  // which k experts is a routing decision, so the first k of every layer stand for them (all
  // experts of a layer share shapes and dtypes). The embedding is read one row per token.
  bool read_per_token(const TensorSpec& t) const {
    return t.part != Part::routed_expert || t.expert < experts_per_token;
  }
};

// Checks every tensor of the spec against the checkpoint (presence, shape, dtype for its storage,
// fp8 block scales); returns the first problem, naming the tensor and the shard. Tensors the spec
// does not list (MTP layers, rotary caches) are ignored.
Status validate_checkpoint(const Checkpoint& ckpt, const WeightSpec& spec);

// Part builders: an architecture's table is a sequence of these, one per part of each layer, so a
// hybrid model reuses them with a different kind per layer. `prefix` is the layer's name prefix
// ("model.layers.3.").
void add_layer_norms(WeightSpec& spec, int64_t layer, const std::string& prefix);
void add_mla_attention(WeightSpec& spec, int64_t layer, const std::string& prefix);
void add_dense_mlp(WeightSpec& spec, int64_t layer, const std::string& prefix);
// How a checkpoint names its MoE tensors: DeepSeek "mlp." with gate_proj / up_proj / down_proj
// experts; Kimi Linear "block_sparse_moe." with experts w1 (gate) / w3 (up) / w2 (down).
struct MoeNames {
  std::string block = "mlp.";
  std::string expert_gate = "gate_proj", expert_up = "up_proj", expert_down = "down_proj";
};
void add_moe(WeightSpec& spec, int64_t layer, const std::string& prefix, const MoeNames& names = {});
void add_kda_attention(WeightSpec& spec, int64_t layer, const std::string& prefix);

// What would stop this table from splitting over tp ranks (models/tp_split.cpp), one line per kind
// of tensor: a count the ranks do not divide in whole units (heads, widths), an fp8 scale block or
// a 4-bit scale group cut by a rank boundary, fewer experts than ranks under expert parallelism.
// Empty: it splits. DeepseekModel's load refuses with the first; `moat doctor --tp` lists them.
std::vector<std::string> tp_split_problems(const WeightSpec& spec, int tp, bool expert_parallel);

// The DeepSeek-V3 / V2 / Kimi K2 table (models/deepseek_v3_spec.cpp).
WeightSpec deepseek_v3_weight_spec(const ModelConfig& config);
// The first MTP head of such a checkpoint (model.layers.{num_hidden_layers}.*) as a one-layer
// model: its embed_tokens, the MTP input part, one decoder layer (MoE when the model has routed
// experts), shared_head.norm as the final norm and shared_head.head as lm_head. Errors when the
// config declares no MTP layer (num_nextn_predict_layers = 0).
Result<WeightSpec> deepseek_v3_mtp_weight_spec(const ModelConfig& config);
// KimiLinearForCausalLM (models/kimi_linear_spec.cpp): KDA or MLA per layer (linear_attn_config),
// MoE under block_sparse_moe.
WeightSpec kimi_linear_weight_spec(const ModelConfig& config);
// A table for this config with no tensors yet, its expert counts set.
WeightSpec empty_spec(const ModelConfig& config);

}  // namespace moat
