// CPU kernels by instruction set. register_cpu_kernels() (cpu_kernels.cpp) declares each with the
// ISA it needs; tests and bench/ may call them directly.
#pragma once

#include "ops/kernel_types.h"

namespace moat::ops {

// AVX-512 BF16 matmul for bf16 / f16 / fp8-block / MXFP4 / INT4_G32 weights (matmul_avx512bf16.cpp).
namespace cpu_avx512bf16 {
// precision (kernel_types.h): calls of more than split_max_tokens tokens round the activations to
// bf16 once (prefill, normalized error ~4e-3) instead of splitting them into bf16 hi + lo
// (fp32-accurate); fp8 and 4-bit weights round them (W8A16, W4A16; 4-bit decode: int16) unless
// fp8_split.
void matmul(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision);
// The same kernel with batched decode and prefill calls (the packed-panel path) on AMX-BF16 tiles:
// only where cpu_has_isa("amx-bf16") (which also asks Linux for the tile state).
void matmul_amx(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision);
// MatmulGroupFn of each: weights sharing x in one pool dispatch.
void matmul_group(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                  const MatmulPrecision& precision);
void matmul_group_amx(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                      const MatmulPrecision& precision);
// Absorbed MLA attention with runs of one sequence's tokens (prefill, verification) on AMX tiles,
// bf16 probabilities (mla_amx.cpp); exact calls and decode tokens go to
// cpu_avx512::mla_attention.
void mla_attention_amx(const MlaAttentionArgs& args);
// Absorbed MLA attention on vdpbf16ps over a bf16 cache read in place (mla_avx512bf16.cpp): bf16
// queries and probabilities; exact calls and other cache dtypes go to cpu_avx512::mla_attention.
void mla_attention_bf16(const MlaAttentionArgs& args);
}

// fp32-FMA matmul for CPUs with AVX2 + FMA + F16C (matmul_avx2.cpp): bf16 / f16 / f32 / fp8-block /
// MXFP4 / INT4_G32 weights decoded in registers for decode-sized calls, a packed 6 x 16 GEMM for
// longer ones; fp32-accurate whatever the precision asks, except 4-bit decode-sized calls in the
// default precision (int16 activations, as cpu.matmul_avx512bf16).
namespace cpu_avx2_fma {
// How decode-sized calls turn fp8 e4m3 into fp32 (both exact): F16C conversions, or integer
// shifts and masks into fp32's exponent field (faster where subnormal inputs cost nothing: AMD).
// Picked once per process from the CPU vendor or MOAT_FP8_DECODE=f16c|exponent; set by tests.
enum class Fp8DecodeRoute { f16c, exponent };
Fp8DecodeRoute fp8_decode_route();
void set_fp8_decode_route(Fp8DecodeRoute route);
void matmul(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision);
void matmul_group(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                  const MatmulPrecision& precision);
// The same with the packed calls on a 12 x 32 micro-kernel of 512-bit FMAs (cpu.matmul_avx512fma):
// only on CPUs with AVX-512F (+ BW, VL).
void matmul_wide(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision);
void matmul_group_wide(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                       const MatmulPrecision& precision);
}

// Absorbed MLA decode attention as spans of one token's context (flash-decoding): the driver
// (mla_attention_spans, cpu_generic.inc) splits each token's context into spans and its heads into
// blocks of whole groups, runs one span function per (span, head block) on the pool and merges the
// spans' partial softmax states; the span functions are the ISA's dot products.
struct MlaSpanState {
  float* m;  // [heads] running max of the scores
  float* l;  // [heads] running sum of exp(score - m)
  float* o;  // [heads, Cp] unnormalized output (Cp: kv_lora rounded up to 64)
};
// Context rows [r0, r1) of query token t for heads [hb, he) (whole groups); writes st's entries
// of those heads.
using MlaSpanFn = void (*)(const MlaAttentionArgs& a, int64_t t, int64_t r0, int64_t r1, int64_t hb, int64_t he,
                           int64_t Cp, const MlaSpanState& st);
// The portable-vector kernels (cpu_generic.inc), one copy per ISA.
#define MOAT_CPU_GENERIC_DECLS                                                          \
  void matmul(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision); \
  void embedding(const WeightMatrix& table, const int32_t* ids, int64_t T, float* out); \
  void rms_norm(const float* x, const float* weight, int64_t T, int64_t dim, float eps, float* y); \
  void rope(const RopeArgs& args);                                                       \
  void silu_mul(const float* gate, const float* up, int64_t T, int64_t n, float* y);                   \
  void add_scaled(float* y, const float* x, float alpha, int64_t n);                     \
  void softmax(const float* x, int64_t T, int64_t n, float temperature, float* probs);   \
  void argmax(const float* x, int64_t T, int64_t n, int32_t* out);                       \
  void store_latent(const StoreLatentArgs& args);                                        \
  void mla_attention(const MlaAttentionArgs& args);                                     \
  /* heads in groups of `group` (a divisor of args.num_heads) */                         \
  void mla_attention_spans(const MlaAttentionArgs& args, int64_t group, MlaSpanFn span);
namespace cpu_avx512 {
MOAT_CPU_GENERIC_DECLS
}
namespace cpu_avx2 {
MOAT_CPU_GENERIC_DECLS
}
#undef MOAT_CPU_GENERIC_DECLS

// Kimi K3's ops (k3_generic.inc), one copy per ISA.
#define MOAT_CPU_K3_DECLS                                                                                  \
  void situ_mul(const float* gate, const float* up, int64_t T, int64_t n, float beta, float linear_beta, float* y); \
  void sigmoid_mul(const float* x, const float* gate, int64_t n, float* y);                               \
  void attn_res_mix(const AttnResMixArgs& args);
namespace cpu_avx512 {
MOAT_CPU_K3_DECLS
}
namespace cpu_avx2 {
MOAT_CPU_K3_DECLS
}
#undef MOAT_CPU_K3_DECLS

}  // namespace moat::ops
