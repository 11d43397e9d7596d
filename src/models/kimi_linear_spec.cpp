// The weight table of KimiLinearForCausalLM (moonshotai/Kimi-Linear-48B-A3B; the text model of
// Kimi K3 has the same layer kinds plus its own parts, ../shared/K3.md): layer i is Kimi Delta
// Attention when i + 1 is in linear_attn_config.kda_layers, else MLA (with q_proj: these models
// have no q_lora). The first first_k_dense_replace layers have a dense MLP under "mlp.", the rest
// a MoE under "block_sparse_moe." whose experts are w1 (gate), w3 (up), w2 (down), as in the
// checkpoints vLLM and sglang load.
#include "models/weight_spec.h"

namespace moat {

WeightSpec kimi_linear_weight_spec(const ModelConfig& c) {
  WeightSpec spec = empty_spec(c);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  auto& t = spec.tensors;
  const MoeNames kimi_moe{.block = "block_sparse_moe.", .expert_gate = "w1", .expert_up = "w3", .expert_down = "w2"};
  t.push_back({"model.embed_tokens.weight", {V, H}, TensorStorage::matrix_no_quant, -1, Part::embedding, Role::weight,
               -1, TpSplit::vocab});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerSpec layer{i, c.is_kda_layer(i) ? AttentionKind::kda : AttentionKind::mla,
                          c.is_moe_layer(i) ? FfnKind::moe : FfnKind::dense};
    spec.layers.push_back(layer);
    const std::string prefix = "model.layers." + std::to_string(i) + ".";
    add_layer_norms(spec, i, prefix);
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
  t.push_back({"model.norm.weight", {H}, TensorStorage::vector, -1, Part::final_norm, Role::weight});
  if (!c.tie_word_embeddings)
    t.push_back({"lm_head.weight", {V, H}, TensorStorage::matrix_no_quant, -1, Part::lm_head, Role::weight, -1,
                 TpSplit::vocab});
  return spec;
}

}  // namespace moat
