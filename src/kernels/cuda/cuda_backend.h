// CUDA backend: the kernels (kernels.cu) and the host-side helpers tests and the engine use to
// move data. Plain C++ declarations, so callers need no CUDA headers.
//
// Device-pointer semantics: every pointer a cuda kernel receives is a device pointer. That
// includes WeightMatrix::data, ::scale_inv and ::group_scales, the per-row parameter arrays of the sampling ops
// (top_k, top_p, min_p, u), RopeArgs' positions and cos/sin tables, MoeRouteArgs' bias and
// outputs, MoeExpertsArgs' x, topk_ids, topk_weights and out (its experts array of weight views
// is on the host), HeadMatmulArgs' x and y (its weights array likewise), the paged cache
// (LatentPages::rows and ::row_scale), MlaAttentionArgs' block_tables, token_seq and kv_len, and
// StoreLatentArgs' rows and slot_mapping.
// Kernels are launched on the default stream and return before they finish; synchronize()
// before reading results on the host. The cuBLAS handle and the scratch buffers (activations
// rounded to bf16, dequantized fp8/f16 weights) are process-wide: one engine thread drives the
// device, as DESIGN.md has it.
#pragma once

#include <cstddef>
#include <string>

#include "ops/kernel_types.h"

namespace moat::ops::cuda {

// True when a CUDA device is usable; otherwise *why says what failed
// ("CUDA driver version is insufficient for CUDA runtime version" on machines without a GPU).
bool device_available(std::string* why);
std::string device_name();

void* device_alloc(size_t bytes);
void device_free(void* p);
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void synchronize();

// The kernels, one per op (signatures of kernel_types.h, device pointers).
void embedding(const WeightMatrix& table, const int32_t* ids, int64_t T, float* out);
void matmul_cublas(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision);
// MXFP4 / INT4_G32 weights decoded in registers, fp32 activations (matmul_q4.cu).
void matmul_q4(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision);
void rms_norm(const float* x, const float* weight, int64_t T, int64_t dim, float eps, float* y);
void rope(const RopeArgs& args);
void silu_mul(const float* gate, const float* up, int64_t T, int64_t n, float* y);
void add_scaled(float* y, const float* x, float alpha, int64_t n);
void store_latent(const StoreLatentArgs& args);
void mla_attention(const MlaAttentionArgs& args);
void moe_route(const MoeRouteArgs& args);
// Composite ops: they run the InnerOps they are given (the cuda op table's matmul, silu_mul, and
// situ_mul for MoeExpertsArgs::activation == situ).
// moe_experts reads topk_ids back to the host to group rows by expert (one synchronization per
// MoE layer); head_matmul gathers each head's strided rows with 2D copies around cuBLAS.
void moe_experts(const MoeExpertsArgs& args, const InnerOps& inner);
void head_matmul(const HeadMatmulArgs& args, const InnerOps& inner);
void softmax(const float* x, int64_t T, int64_t n, float temperature, float* probs);
void top_k_renorm_prob(float* probs, int64_t T, int64_t n, const int32_t* top_k);
void top_p_renorm_prob(float* probs, int64_t T, int64_t n, const float* top_p);
void min_p_renorm_prob(float* probs, int64_t T, int64_t n, const float* min_p);
void sample_from_probs(const float* probs, int64_t T, int64_t n, const float* u, int32_t* out);
void argmax(const float* x, int64_t T, int64_t n, int32_t* out);

// PadHeads on the device: q [T, heads, D] is zero-padded to [T, pad_to, D] in device scratch,
// `kernel` runs on pad_to heads, and the first `heads` of each token's output are copied back
// (OpTable::mla_attention calls this when the resolution is PadHeads on cuda).
void mla_attention_pad_heads(const MlaAttentionArgs& args, int64_t pad_to, MlaAttentionFn kernel);

// Kimi K3's ops (k3_kernels.cu). attn_res_mix: args.rows is a host array of device pointers.
void situ_mul(const float* gate, const float* up, int64_t T, int64_t n, float beta, float linear_beta, float* y);
void sigmoid_mul(const float* x, const float* gate, int64_t n, float* y);
void attn_res_mix(const AttnResMixArgs& args);

// Limits the kernels declare in their constraints (cuda_registry.cpp).
constexpr int64_t kMaxHeadDim = 1152;  // mla_attention: per-lane accumulators, 36 per lane
constexpr int64_t kMaxExperts = 1024;  // moe_route: one block per token, experts in shared memory
constexpr int64_t kMaxTopK = 32;

}  // namespace moat::ops::cuda
