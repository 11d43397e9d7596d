#include "models/weight_spec.h"

namespace moat {

namespace {

using S = TensorStorage;

// One SwiGLU MLP (gate, up: [inter, hidden]; down: [hidden, inter]) under `prefix` ("...mlp.",
// "...mlp.experts.7.", "...mlp.shared_experts.").
void add_mlp(WeightSpec& spec, int64_t layer, const std::string& prefix, Part part, int64_t inter,
             int64_t expert = -1, const MoeNames& names = {}, int64_t input_width = 0) {
  const int64_t H = input_width > 0 ? input_width : spec.config.hidden_size;
  const bool routed = part == Part::routed_expert;
  const TpSplit in_split = routed ? TpSplit::expert : TpSplit::column;
  const TpSplit out_split = routed ? TpSplit::expert : TpSplit::row;
  auto& t = spec.tensors;
  t.push_back({prefix + names.expert_gate + ".weight", {inter, H}, S::matrix, layer, part, Role::gate_proj, expert, in_split});
  t.push_back({prefix + names.expert_up + ".weight", {inter, H}, S::matrix, layer, part, Role::up_proj, expert, in_split});
  t.push_back({prefix + names.expert_down + ".weight", {H, inter}, S::matrix, layer, part, Role::down_proj, expert, out_split});
}

}  // namespace

const TensorSpec* WeightSpec::find(std::string_view name) const {
  for (const TensorSpec& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Status validate_checkpoint(const Checkpoint& ckpt, const WeightSpec& spec) {
  for (const TensorSpec& t : spec.tensors) MOAT_TRY(check_tensor(ckpt, t.name, t.shape, t.storage, spec.config));
  return ok_status();
}

void add_layer_norms(WeightSpec& spec, int64_t layer, const std::string& prefix) {
  const int64_t H = spec.config.hidden_size;
  spec.tensors.push_back({prefix + "input_layernorm.weight", {H}, S::vector, layer, Part::layer_norms, Role::input_norm});
  spec.tensors.push_back(
      {prefix + "post_attention_layernorm.weight", {H}, S::vector, layer, Part::layer_norms, Role::post_attention_norm});
}

void add_mla_attention(WeightSpec& spec, int64_t layer, const std::string& prefix) {
  const ModelConfig& c = spec.config;
  const int64_t H = c.hidden_size, heads = c.num_attention_heads;
  const int64_t qk = c.qk_head_dim(), kv_lora = c.kv_lora_rank, rope = c.qk_rope_head_dim;
  const int64_t nope_v = c.qk_nope_head_dim + c.v_head_dim;
  const std::string a = prefix + "self_attn.";
  auto add = [&](const char* suffix, std::vector<int64_t> shape, S storage, Role role,
                 TpSplit split = TpSplit::replicated, int64_t unit = 1) {
    spec.tensors.push_back({a + suffix, std::move(shape), storage, layer, Part::attention, role, -1, split, unit});
  };
  // q_a and kv_a are small and feed every head, so each rank keeps them whole (as vLLM's
  // ReplicatedLinear); the per-head projections split by head.
  if (c.q_lora_rank) {
    const int64_t q_lora = *c.q_lora_rank;
    add("q_a_proj.weight", {q_lora, H}, S::matrix, Role::q_a_proj);
    add("q_a_layernorm.weight", {q_lora}, S::vector, Role::q_a_norm);
    add("q_b_proj.weight", {heads * qk, q_lora}, S::matrix, Role::q_b_proj, TpSplit::column, qk);
  } else {
    add("q_proj.weight", {heads * qk, H}, S::matrix, Role::q_proj, TpSplit::column, qk);
  }
  add("kv_a_proj_with_mqa.weight", {kv_lora + rope, H}, S::matrix, Role::kv_a_proj);
  add("kv_a_layernorm.weight", {kv_lora}, S::vector, Role::kv_a_norm);
  add("kv_b_proj.weight", {heads * nope_v, kv_lora}, S::matrix, Role::kv_b_proj, TpSplit::column, nope_v);
  if (c.mla_use_output_gate)
    add("g_proj.weight", {heads * c.v_head_dim, H}, S::matrix, Role::attn_output_gate, TpSplit::column, c.v_head_dim);
  add("o_proj.weight", {H, heads * c.v_head_dim}, S::matrix, Role::o_proj, TpSplit::row, c.v_head_dim);
}

void add_dense_mlp(WeightSpec& spec, int64_t layer, const std::string& prefix) {
  add_mlp(spec, layer, prefix + "mlp.", Part::dense_mlp, spec.config.intermediate_size);
}

void add_moe(WeightSpec& spec, int64_t layer, const std::string& prefix, const MoeNames& names) {
  const ModelConfig& c = spec.config;
  const int64_t E = c.n_routed_experts;
  const std::string m = prefix + names.block;
  spec.tensors.push_back({m + "gate.weight", {E, c.hidden_size}, S::matrix_no_quant, layer, Part::router, Role::weight});
  // Only noaux_tc checkpoints carry the selection bias.
  if (c.topk_method == "noaux_tc")
    spec.tensors.push_back({m + "gate.e_score_correction_bias", {E}, S::vector, layer, Part::router, Role::score_bias});
  for (int64_t e = 0; e < E; ++e)
    add_mlp(spec, layer, m + "experts." + std::to_string(e) + ".", Part::routed_expert, c.moe_intermediate_size, e,
            names, c.routed_expert_hidden_size);  // K3's latent MoE: experts read the latent z
  if (c.routed_expert_hidden_size > 0) {
    const int64_t R = c.routed_expert_hidden_size;
    spec.tensors.push_back({m + "routed_expert_down_proj.weight", {R, c.hidden_size}, S::matrix, layer, Part::latent_moe,
                            Role::latent_down_proj});
    if (c.latent_moe_use_norm)
      spec.tensors.push_back({m + "routed_expert_norm.weight", {R}, S::vector, layer, Part::latent_moe, Role::latent_norm});
    spec.tensors.push_back({m + "routed_expert_up_proj.weight", {c.hidden_size, R}, S::matrix, layer, Part::latent_moe,
                            Role::latent_up_proj});
  }
  if (c.n_shared_experts > 0)
    add_mlp(spec, layer, m + "shared_experts.", Part::shared_experts, c.n_shared_experts * c.moe_intermediate_size);
}

void add_kda_attention(WeightSpec& spec, int64_t layer, const std::string& prefix) {
  const ModelConfig& c = spec.config;
  const int64_t H = c.hidden_size, heads = c.linear_attn->num_heads, K = c.linear_attn->head_dim;
  const int64_t width = heads * K, conv = c.linear_attn->short_conv_kernel_size;
  const std::string a = prefix + "self_attn.";
  auto add = [&](const char* suffix, std::vector<int64_t> shape, S storage, Role role,
                 TpSplit split = TpSplit::replicated, int64_t unit = 1) {
    spec.tensors.push_back({a + suffix, std::move(shape), storage, layer, Part::attention, role, -1, split, unit});
  };
  // Per-head tensors split by head (vLLM: column-parallel q/k/v/f_b/g_b/b and their convs,
  // row-parallel o_proj); the rank-K gate inputs f_a / g_a feed every head and stay whole.
  add("q_proj.weight", {width, H}, S::matrix, Role::kda_q_proj, TpSplit::column, K);
  add("k_proj.weight", {width, H}, S::matrix, Role::kda_k_proj, TpSplit::column, K);
  add("v_proj.weight", {width, H}, S::matrix, Role::kda_v_proj, TpSplit::column, K);
  add("q_conv1d.weight", {width, 1, conv}, S::vector, Role::kda_q_conv, TpSplit::column, K);
  add("k_conv1d.weight", {width, 1, conv}, S::vector, Role::kda_k_conv, TpSplit::column, K);
  add("v_conv1d.weight", {width, 1, conv}, S::vector, Role::kda_v_conv, TpSplit::column, K);
  add("f_a_proj.weight", {K, H}, S::matrix, Role::kda_f_a_proj);
  add("f_b_proj.weight", {width, K}, S::matrix, Role::kda_f_b_proj, TpSplit::column, K);
  // Kimi Linear stores A_log [1, 1, heads, 1]; K3 (lower-bounded gate) a [head_dim] vector whose
  // first `heads` entries are the heads' (../shared/K3.md).
  if (c.linear_attn->gate_lower_bound < 0) {
    add("A_log", {K}, S::vector, Role::kda_a_log);
  } else {
    add("A_log", {1, 1, heads, 1}, S::vector, Role::kda_a_log);
  }
  add("dt_bias", {width}, S::vector, Role::kda_dt_bias, TpSplit::column, K);
  add("b_proj.weight", {heads, H}, S::matrix, Role::kda_b_proj, TpSplit::column, 1);
  if (c.linear_attn->use_full_rank_gate) {
    add("g_proj.weight", {width, H}, S::matrix, Role::kda_g_proj, TpSplit::column, K);
  } else {
    add("g_a_proj.weight", {K, H}, S::matrix, Role::kda_g_a_proj);
    add("g_b_proj.weight", {width, K}, S::matrix, Role::kda_g_b_proj, TpSplit::column, K);
  }
  add("o_norm.weight", {K}, S::vector, Role::kda_o_norm);
  add("o_proj.weight", {H, width}, S::matrix, Role::o_proj, TpSplit::row, K);
}

}  // namespace moat
