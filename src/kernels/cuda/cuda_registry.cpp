// Registers the CUDA kernels (kernels.cu) with their constraints. No cuda op has a host fallback:
// reference kernels read host memory, so every op needs a cuda kernel, which the parity test
// (tests/ops) enforces.
#include "kernels/cuda/cuda_backend.h"
#include "ops/registry.h"

namespace moat::ops {

void register_cuda_kda_kernels(Registry& registry);  // kda.cu

void register_cuda_kernels(Registry& r) {
  auto add = [&](OpId op, const char* name, void* fn, Constraints c = {}) {
    r.add(KernelEntry{op, Backend::cuda, name, fn, std::move(c), 10, {}});
  };
  auto fn = [](auto f) { return reinterpret_cast<void*>(f); };
  add(OpId::embedding, "cuda.embedding", fn(&cuda::embedding),
      {.weight_dtypes = {DType::BF16, DType::F16, DType::F32}});
  add(OpId::matmul, "cuda.matmul_cublas", fn(&cuda::matmul_cublas),
      {.weight_dtypes = {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3}});
  add(OpId::matmul, "cuda.matmul_q4", fn(&cuda::matmul_q4), {.weight_dtypes = {DType::MXFP4, DType::INT4_G32}});
  add(OpId::rms_norm, "cuda.rms_norm", fn(&cuda::rms_norm));
  add(OpId::rope, "cuda.rope", fn(&cuda::rope));
  add(OpId::silu_mul, "cuda.silu_mul", fn(&cuda::silu_mul));
  add(OpId::add_scaled, "cuda.add_scaled", fn(&cuda::add_scaled));
  // The heads rule of the production MLA decode kernels (FlashMLA-style), declared here so a
  // 12-head rank pads to 16 on cuda exactly as on cpu. Both cache ops take every --kv-dtype.
  const std::vector<DType> kv_dtypes = {DType::F32, DType::BF16, DType::F8_E4M3};
  add(OpId::store_latent, "cuda.store_latent", fn(&cuda::store_latent), {.kv_dtypes = kv_dtypes});
  add(OpId::mla_attention, "cuda.mla_attention", fn(&cuda::mla_attention),
      {.heads = HeadsConstraint{.one_of = {4, 8}, .multiple_of = 16}, .max_head_dim = cuda::kMaxHeadDim,
       .kv_dtypes = kv_dtypes});
  add(OpId::moe_route, "cuda.moe_route", fn(&cuda::moe_route),
      {.max_experts = cuda::kMaxExperts, .max_top_k = cuda::kMaxTopK});
  const std::vector<DType> linear = {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3, DType::MXFP4, DType::INT4_G32};
  add(OpId::moe_experts, "cuda.moe_experts_grouped", fn(&cuda::moe_experts), {.weight_dtypes = linear});
  add(OpId::head_matmul, "cuda.head_matmul", fn(&cuda::head_matmul), {.weight_dtypes = linear});
  add(OpId::softmax, "cuda.softmax", fn(&cuda::softmax));
  add(OpId::top_k_renorm_prob, "cuda.top_k_renorm_prob", fn(&cuda::top_k_renorm_prob));
  add(OpId::top_p_renorm_prob, "cuda.top_p_renorm_prob", fn(&cuda::top_p_renorm_prob));
  add(OpId::min_p_renorm_prob, "cuda.min_p_renorm_prob", fn(&cuda::min_p_renorm_prob));
  add(OpId::sample_from_probs, "cuda.sample_from_probs", fn(&cuda::sample_from_probs));
  add(OpId::argmax, "cuda.argmax", fn(&cuda::argmax));
  register_cuda_kda_kernels(r);
  // Kimi K3 (k3_kernels.cu)
  add(OpId::situ_mul, "cuda.situ_mul", fn(&cuda::situ_mul));
  add(OpId::sigmoid_mul, "cuda.sigmoid_mul", fn(&cuda::sigmoid_mul));
  add(OpId::attn_res_mix, "cuda.attn_res_mix", fn(&cuda::attn_res_mix));
}

}  // namespace moat::ops
