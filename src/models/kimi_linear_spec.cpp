// The weight table of KimiLinearForCausalLM (moonshotai/Kimi-Linear-48B-A3B) and of Kimi K3's text
// model (KimiK3ForConditionalGeneration, under "language_model."; ../shared/K3.md): layer i is
// Kimi Delta Attention when i + 1 is in linear_attn_config.kda_layers, else MLA. K3 adds the
// attention-residual mix weights per layer and at the output, MLA's output gate g_proj, KDA's
// full-rank output gate and 1-D A_log, and the latent MoE's down / norm / up projections. The first first_k_dense_replace layers have a dense MLP under "mlp.", the rest
// a MoE under "block_sparse_moe." whose experts are w1 (gate), w3 (up), w2 (down), as in the
// checkpoints vLLM and sglang load.
#include "models/weight_spec.h"

namespace moat {

WeightSpec kimi_linear_weight_spec(const ModelConfig& c) {
  WeightSpec spec = empty_spec(c);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  auto& t = spec.tensors;
  const MoeNames kimi_moe{.block = "block_sparse_moe.", .expert_gate = "w1", .expert_up = "w3", .expert_down = "w2"};
  // K3: "language_model.model.layers..." and "language_model.lm_head"
  const std::string model = c.weight_prefix + "model.";
  using S = TensorStorage;
  auto attn_res = [&](const std::string& prefix, int64_t layer, const char* site, Role norm, Role proj) {
    t.push_back({prefix + site + "_norm.weight", {H}, S::vector, layer, Part::attn_res, norm});
    t.push_back({prefix + site + "_proj.weight", {1, H}, S::vector, layer, Part::attn_res, proj});
  };
  t.push_back({model + "embed_tokens.weight", {V, H}, S::matrix_no_quant, -1, Part::embedding, Role::weight, -1,
               TpSplit::vocab});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerSpec layer{i, c.is_kda_layer(i) ? AttentionKind::kda : AttentionKind::mla,
                          c.is_moe_layer(i) ? FfnKind::moe : FfnKind::dense};
    spec.layers.push_back(layer);
    const std::string prefix = model + "layers." + std::to_string(i) + ".";
    add_layer_norms(spec, i, prefix);
    if (c.attn_res_block_size > 0) {
      attn_res(prefix, i, "self_attention_res", Role::res_attn_norm, Role::res_attn_proj);
      attn_res(prefix, i, "mlp_res", Role::res_mlp_norm, Role::res_mlp_proj);
    }
    if (layer.attention == AttentionKind::kda) {
      add_kda_attention(spec, i, prefix);
    } else {
      add_mla_attention(spec, i, prefix);
    }
    if (layer.ffn == FfnKind::moe) {
      add_moe(spec, i, prefix, kimi_moe);
    } else {
      add_dense_mlp(spec, i, prefix);
    }
  }
  if (c.attn_res_block_size > 0) attn_res(model, -1, "output_attn_res", Role::res_output_norm, Role::res_output_proj);
  t.push_back({model + "norm.weight", {H}, S::vector, -1, Part::final_norm, Role::weight});
  if (!c.tie_word_embeddings)
    t.push_back({c.weight_prefix + "lm_head.weight", {V, H}, S::matrix_no_quant, -1, Part::lm_head, Role::weight, -1,
                 TpSplit::vocab});
  return spec;
}

}  // namespace moat
