// HF config.json -> a plain, validated struct for the DeepSeek-V2/V3 family (DeepSeek-V2,
// V2-Lite, V3, Kimi K2) and the Kimi Linear hybrid (KimiLinearForCausalLM: KDA layers among MLA
// layers; ../shared/K3.md). Kimi Linear's own key names (num_experts, num_experts_per_token,
// moe_renormalize, ...) are read into the DeepSeek-named fields they mean, so the rest of moat
// sees one vocabulary. Every other module reads model facts only from here.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "config/quantization_config.h"

namespace moat {

struct RopeScaling {
  std::string type;  // "yarn" (the only kind these checkpoints use)
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

// Kimi Linear's linear_attn_config: the Kimi Delta Attention layers and their sizes.
struct LinearAttentionConfig {
  int64_t num_heads = 0;
  int64_t head_dim = 0;                // K = V per head
  int64_t short_conv_kernel_size = 4;  // depthwise causal conv width on q, k, v
  std::vector<int64_t> kda_layers;        // 1-based, as config.json writes them
  std::vector<int64_t> full_attn_layers;  // 1-based; the MLA layers
  // Kimi K3: decay g = gate_lower_bound * sigmoid(exp(A_log[h]) * (raw + dt_bias)) when < 0, else
  // Kimi Linear's -exp(A_log[h]) * softplus(raw + dt_bias); the output gate full rank (g_proj)
  // instead of g_b(g_a(x)).
  double gate_lower_bound = 0.0;
  bool use_full_rank_gate = false;
};

struct ModelConfig {
  std::string architecture;  // "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiLinearForCausalLM"
  std::string model_type;    // "deepseek_v3", "kimi_k2", "deepseek_v2", "kimi_linear"

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // each routed and shared expert
  int64_t num_hidden_layers = 0;
  int64_t num_nextn_predict_layers = 0;  // MTP layers stored after the main ones; skipped
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;

  // MLA
  std::optional<int64_t> q_lora_rank;  // null: q = q_proj(x)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  // MoE
  int64_t n_routed_experts = 0;  // 0: every layer is dense
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = false;
  std::string topk_method = "greedy";  // "noaux_tc", "greedy", "group_limited_greedy"
  std::string scoring_func = "softmax";  // "sigmoid" (V3) or "softmax" (V2)

  int64_t max_position_embeddings = 4096;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  std::optional<RopeScaling> rope_scaling;
  std::optional<QuantizationConfig> quantization;

  // Kimi Linear: KDA layers (absent: every layer is MLA) and MLA without rotary embedding (the
  // rope-width slice of q and of the shared key is used unrotated).
  std::optional<LinearAttentionConfig> linear_attn;
  bool mla_use_nope = false;

  // Kimi K3's text model (KimiK3ForConditionalGeneration: text_config, weights under
  // "language_model."; ../shared/K3.md).
  std::string weight_prefix;                // "" or "language_model." before every tensor name
  bool mla_use_output_gate = false;         // attention output * sigmoid(g_proj(x)) before o_proj
  int64_t attn_res_block_size = 0;          // attention residuals (AttnRes) when > 0
  int64_t routed_expert_hidden_size = 0;    // latent MoE: routed experts in this width when > 0
  bool latent_moe_use_norm = false;         // RMSNorm on the latent expert sum
  std::string hidden_act = "silu";          // "silu" or "situ"
  double situ_beta = 4.0, situ_linear_beta = 25.0;  // situ: b*tanh(g/b)*sigmoid(g) * l*tanh(u/l)

  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // config's eos_token_id, int or list
  DType torch_dtype = DType::BF16;

  // Derived facts.
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Values cached per token per layer: the normed latent plus the shared rope key.
  int64_t kv_cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }
  // Layer `layer` (0-based) is Kimi Delta Attention iff layer + 1 is in kda_layers.
  bool is_kda_layer(int64_t layer) const;
  int64_t num_kda_layers() const;
  int64_t num_mla_layers() const { return num_hidden_layers - num_kda_layers(); }
  // Recurrent state one request keeps across all KDA layers, in fp32: per layer the conv inputs
  // of q, k and v (3 x (width - 1) x heads x head_dim) and the state (heads x head_dim^2).
  int64_t kda_state_floats_per_layer() const;
  int64_t state_bytes_per_request() const { return num_kda_layers() * kda_state_floats_per_layer() * 4; }
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace &&
           layer % moe_layer_freq == 0;
  }
  // (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.
  double softmax_scale() const;
};

// YaRN's attention-magnitude correction: 0.1 * mscale * ln(factor) + 1 when factor > 1, else 1.
double yarn_get_mscale(double factor, double mscale);

// Parses and validates. Errors name the field and the expected value.
Result<ModelConfig> parse_model_config(const nlohmann::json& json);
// Reads DIR/config.json (or the file itself when given a .json path).
Result<ModelConfig> load_model_config(const std::filesystem::path& dir_or_file);

}  // namespace moat
