#include "models/op_needs.h"

namespace moat {

Result<ops::ModelOpNeeds> model_op_needs(const ModelConfig& config, int64_t tp, DType kv_dtype) {
  if (tp <= 0) return make_error("tensor-parallel degree must be >= 1, got {}", tp);
  if (config.num_attention_heads % tp != 0)
    return make_error("tensor-parallel degree {} does not divide num_attention_heads {}", tp,
                      config.num_attention_heads);
  ops::ModelOpNeeds needs;
  const DType dense = config.torch_dtype == DType::F32 || config.torch_dtype == DType::F16
                          ? config.torch_dtype
                          : DType::BF16;
  // FP8 checkpoints keep embed_tokens, lm_head and the router in bf16.
  needs.matmul_dtypes = {dense};
  // FP8 checkpoints also get fp32 copies of the per-head W_UK^T / W_UV (absorbed MLA), since fp8
  // row slices of kv_b_proj would not start on a scale block.
  // compressed-tensors checkpoints: MXFP4 or INT4_G32 (the routed experts, in the published ones).
  if (config.quantization)
    needs.matmul_dtypes.insert(needs.matmul_dtypes.end(), {config.quantization->weight_dtype, DType::F32});
  needs.embedding_dtype = dense;
  needs.heads_per_rank = config.num_attention_heads / tp;
  if (config.linear_attn) {
    if (config.linear_attn->num_heads % tp != 0)
      return make_error("tensor-parallel degree {} does not divide linear_attn_config.num_heads {}", tp,
                        config.linear_attn->num_heads);
    needs.kda_heads_per_rank = config.linear_attn->num_heads / tp;
    needs.kda_head_dim = config.linear_attn->head_dim;
  }
  // Kimi K3's SiTU, MLA output gate and attention-residual mix
  needs.k3_ops = config.hidden_act == "situ" || config.mla_use_output_gate || config.attn_res_block_size > 0;
  needs.attention_head_dim = config.kv_cache_dim();
  needs.kv_dtype = kv_dtype;
  needs.num_experts = config.n_routed_experts;
  needs.top_k = config.num_experts_per_tok;
  needs.expert_dtype = config.quantization ? config.quantization->weight_dtype : dense;
  return needs;
}

}  // namespace moat
