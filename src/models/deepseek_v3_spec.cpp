// The weight table of DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (DeepSeek-V3, V3.1, Kimi K2,
// DeepSeek-V2, V2-Lite): every layer is MLA; the first first_k_dense_replace layers (and those off
// moe_layer_freq) have a dense MLP, the rest a MoE. MTP layers (index >= num_hidden_layers) are
// stored in the checkpoints but not run, so not listed.
#include "models/weight_spec.h"

namespace moat {

WeightSpec empty_spec(const ModelConfig& c) {
  WeightSpec spec;
  spec.config = c;
  spec.routed_experts = c.n_routed_experts;
  spec.experts_per_token = c.n_routed_experts > 0 ? c.num_experts_per_tok : 0;
  return spec;
}

WeightSpec deepseek_v3_weight_spec(const ModelConfig& c) {
  WeightSpec spec = empty_spec(c);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  auto& t = spec.tensors;
  t.push_back({"model.embed_tokens.weight", {V, H}, TensorStorage::matrix_no_quant, -1, Part::embedding, Role::weight,
               -1, TpSplit::vocab});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerSpec layer{i, AttentionKind::mla, c.is_moe_layer(i) ? FfnKind::moe : FfnKind::dense};
    spec.layers.push_back(layer);
    const std::string prefix = "model.layers." + std::to_string(i) + ".";
    add_layer_norms(spec, i, prefix);
    add_mla_attention(spec, i, prefix);
    if (layer.ffn == FfnKind::moe) {
      add_moe(spec, i, prefix);
    } else {
      add_dense_mlp(spec, i, prefix);
    }
  }
  t.push_back({"model.norm.weight", {H}, TensorStorage::vector, -1, Part::final_norm, Role::weight});
  if (!c.tie_word_embeddings)
    t.push_back({"lm_head.weight", {V, H}, TensorStorage::matrix_no_quant, -1, Part::lm_head, Role::weight, -1,
                 TpSplit::vocab});
  return spec;
}

Result<WeightSpec> deepseek_v3_mtp_weight_spec(const ModelConfig& c) {
  if (c.num_nextn_predict_layers <= 0)
    return make_error("this checkpoint has no MTP layer (config.json num_nextn_predict_layers is {}); "
                      "--speculative mtp needs one",
                      c.num_nextn_predict_layers);
  WeightSpec spec = empty_spec(c);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const std::string p = "model.layers." + std::to_string(c.num_hidden_layers) + ".";
  using S = TensorStorage;
  auto& t = spec.tensors;
  t.push_back({p + "embed_tokens.weight", {V, H}, S::matrix_no_quant, -1, Part::embedding, Role::weight, -1, TpSplit::vocab});
  t.push_back({p + "enorm.weight", {H}, S::vector, -1, Part::mtp_input, Role::mtp_enorm});
  t.push_back({p + "hnorm.weight", {H}, S::vector, -1, Part::mtp_input, Role::mtp_hnorm});
  t.push_back({p + "eh_proj.weight", {H, 2 * H}, S::matrix, -1, Part::mtp_input, Role::mtp_eh_proj});
  const LayerSpec layer{0, AttentionKind::mla, c.n_routed_experts > 0 ? FfnKind::moe : FfnKind::dense};
  spec.layers.push_back(layer);
  add_layer_norms(spec, 0, p);
  add_mla_attention(spec, 0, p);
  if (layer.ffn == FfnKind::moe) add_moe(spec, 0, p);
  else add_dense_mlp(spec, 0, p);
  t.push_back({p + "shared_head.norm.weight", {H}, S::vector, -1, Part::final_norm, Role::weight});
  t.push_back({p + "shared_head.head.weight", {V, H}, S::matrix_no_quant, -1, Part::lm_head, Role::weight, -1,
               TpSplit::vocab});
  return spec;
}

}  // namespace moat
