// CPU kernels of the Kimi Delta Attention ops (kernel_types.h: short_conv, kda_gate,
// kda_recurrent, kda_chunked, gated_rms_norm), written once (kda_cpu.inc) and compiled twice here
// under target pragmas: AVX-512 (registered with cpu_isa "avx512", priority 20) and AVX2 + FMA
// ("avx2", priority 15), so one binary runs anywhere and a CPU with neither resolves these ops to
// the reference kernels (their declared fallback). Before the AVX2 copy, Zen 3 and Intel client
// cores ran KDA on the reference: 87% of a k3-nano prefill (session 17, Zen 3). Any head dim:
// head vectors are zero-padded to whole vectors in scratch, state columns are taken a vector at a
// time with a mask on the last.
//
// Both KDA kernels split the pool over (sequence, head) pairs and walk the state [K, V] in
// column tiles: the columns of S evolve independently (S[:, v] only meets v[v] and u[v]), so a
// tile is all a step touches. kda_recurrent takes up to kTileVecs vectors of columns (AVX-512:
// whole rows at V = 128, so one decode token streams the state in order), kda_chunked one vector
// (K rows of 64 or 32 bytes) against the chunk's coefficients. kda_recurrent's step states
// (speculative verification) are stored by the pass that writes the state, in an instantiation
// of its own; kda_chunked refuses them.
//
// Numerics: fp32 throughout, the reference sums in double; tests/ops/kda_ops_test.cpp bounds the
// normalized error of both copies.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/thread_pool.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

// GCC 12's intrinsics headers start some conversions from an _mm*_undefined value: false positives.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace moat::ops {
namespace {

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace
}  // namespace moat::ops

// ---- AVX-512: 16 lanes, mask registers -----------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#include "kernels/cpu/avx512_helpers.h"

namespace moat::ops::kda_avx512 {
namespace {

using vf = __m512;
using vmask = __mmask16;
constexpr int64_t kW = 16;  // floats per vector
constexpr int kTileVecs = 8;  // 128 columns: u, o, kv are 24 of the 32 registers
constexpr int64_t kGroup = 8;  // tokens per pass over a chunk tile: 16 accumulators

inline vmask tail_mask(int64_t n) {
  return n >= kW ? static_cast<vmask>(0xffff) : static_cast<vmask>((1u << n) - 1);
}
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const float* p, vmask m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, vf v, vmask m) { _mm512_mask_storeu_ps(p, m, v); }
inline vf splat(float s) { return _mm512_set1_ps(s); }
inline vf zero() { return _mm512_setzero_ps(); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }

inline float hsum(vf v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  return _mm_cvtss_f32(s4);
}

using avx512::vexp;

// log(x) for normal x > 0: x = 2^e m with m in [sqrt(1/2), sqrt(2)) by getexp / getmant, then
// avx512::log_poly.
inline __m512 vlog(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 big = _mm512_cmp_ps_mask(m, splat(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, splat(0.5f));
  e = _mm512_mask_add_ps(e, big, e, splat(1.0f));
  return avx512::log_poly(_mm512_sub_ps(m, splat(1.0f)), e);
}

inline __m512 vsigmoid(__m512 x) {
  return _mm512_div_ps(splat(1.0f), _mm512_add_ps(splat(1.0f), vexp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// torch's softplus (threshold 20), evaluated as max(x, 0) + log1p(exp(-|x|)); log1p(y) as
// log(1 + y) * y / ((1 + y) - 1), exact to rounding even where 1 + y rounds to 1.
inline __m512 vsoftplus(__m512 x) {
  const __m512 y = vexp(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // (0, 1]
  const __m512 u = _mm512_add_ps(splat(1.0f), y);
  const __m512 d = _mm512_sub_ps(u, splat(1.0f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_EQ_OQ);
  __m512 l1p = _mm512_mul_ps(vlog(u), _mm512_div_ps(y, _mm512_mask_blend_ps(tiny, d, splat(1.0f))));
  l1p = _mm512_mask_blend_ps(tiny, l1p, y);
  const __m512 sp = _mm512_add_ps(_mm512_max_ps(x, _mm512_setzero_ps()), l1p);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, splat(20.0f), _CMP_GT_OQ), sp, x);
}

#include "kernels/cpu/kda_cpu.inc"
}  // namespace
}  // namespace moat::ops::kda_avx512

#pragma GCC pop_options

// ---- AVX2 + FMA: 8 lanes, masks as vectors -------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace moat::ops::kda_avx2 {
namespace {

using vf = __m256;
using vmask = __m256i;  // lane on: all ones
constexpr int64_t kW = 8;
constexpr int kTileVecs = 4;  // 32 columns: u and o are 8 of the 16 registers
constexpr int64_t kGroup = 4;  // tokens per pass over a chunk tile: 8 accumulators

inline vmask tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, kW))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const float* p, vmask m) { return _mm256_maskload_ps(p, m); }  // lanes off read nothing
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void store(float* p, vf v, vmask m) { _mm256_maskstore_ps(p, m, v); }
inline vf splat(float s) { return _mm256_set1_ps(s); }
inline vf zero() { return _mm256_setzero_ps(); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }

inline float hsum(vf v) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  return _mm_cvtss_f32(s4);
}

using poly_v = __m256;
inline __m256 poly_fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 poly_splat(float s) { return _mm256_set1_ps(s); }
#include "kernels/cpu/vec_poly.inc"

// exp(x) as avx512::vexp (exp_poly_reduced), 2^n applied as two factors 2^(n/2) built in the
// exponent field, so results below 2^-126 underflow gracefully to subnormals and 0 as vscalefps
// does.
inline vf vexp(vf x) {
  x = _mm256_min_ps(_mm256_max_ps(x, splat(-104.0f)), splat(88.7f));
  const vf n = _mm256_round_ps(mul(x, splat(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf p = exp_poly_reduced(x, n);
  const __m256i ni = _mm256_cvtps_epi32(n);  // [-150, 128]
  const __m256i half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const vf f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const vf f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return mul(mul(p, f1), f2);
}

// log(x) for normal x > 0, as the AVX-512 copy: x = 2^e m with m in [sqrt(1/2), sqrt(2)) (the
// exponent and mantissa split by integer ops instead of getexp / getmant), then log_poly.
inline vf vlog(vf x) {
  const __m256i bits = _mm256_castps_si256(x);
  vf e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  vf m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                                             _mm256_set1_epi32(0x3F800000)));  // [1, 2)
  const vf big = _mm256_cmp_ps(m, splat(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, mul(m, splat(0.5f)), big);
  e = _mm256_blendv_ps(e, add(e, splat(1.0f)), big);
  return log_poly(sub(m, splat(1.0f)), e);
}

inline vf vsigmoid(vf x) { return _mm256_div_ps(splat(1.0f), add(splat(1.0f), vexp(sub(zero(), x)))); }

// As the AVX-512 copy's vsoftplus.
inline vf vsoftplus(vf x) {
  const vf abs_x = _mm256_andnot_ps(splat(-0.0f), x);
  const vf y = vexp(sub(zero(), abs_x));  // (0, 1]
  const vf u = add(splat(1.0f), y);
  const vf d = sub(u, splat(1.0f));
  const vf tiny = _mm256_cmp_ps(d, zero(), _CMP_EQ_OQ);
  vf l1p = mul(vlog(u), _mm256_div_ps(y, _mm256_blendv_ps(d, splat(1.0f), tiny)));
  l1p = _mm256_blendv_ps(l1p, y, tiny);
  const vf sp = add(_mm256_max_ps(x, zero()), l1p);
  return _mm256_blendv_ps(sp, x, _mm256_cmp_ps(x, splat(20.0f), _CMP_GT_OQ));
}

#include "kernels/cpu/kda_cpu.inc"
}  // namespace
}  // namespace moat::ops::kda_avx2

#pragma GCC pop_options

namespace moat::ops {

// Called by register_cpu_kernels (cpu_kernels.cpp): AVX-512 at priority 20 as the other avx512
// kernels, AVX2 at 15 (the same code in narrower vectors).
void register_cpu_kda_kernels(Registry& r) {
  auto add = [&](OpId op, const char* name, void* fn, const char* isa, int priority) {
    r.add(KernelEntry{op, Backend::cpu, name, fn, Constraints{.cpu_isa = isa}, priority, {}});
  };
  add(OpId::short_conv, "cpu.short_conv_avx512", reinterpret_cast<void*>(&kda_avx512::short_conv_impl), "avx512", 20);
  add(OpId::kda_gate, "cpu.kda_gate_avx512", reinterpret_cast<void*>(&kda_avx512::kda_gate_impl), "avx512", 20);
  add(OpId::kda_recurrent, "cpu.kda_recurrent_avx512", reinterpret_cast<void*>(&kda_avx512::kda_recurrent_impl),
      "avx512", 20);
  add(OpId::kda_chunked, "cpu.kda_chunked_avx512",
      reinterpret_cast<void*>(&kda_avx512::kda_chunked_impl<kda_avx512::kChunk>), "avx512", 20);
  add(OpId::gated_rms_norm, "cpu.gated_rms_norm_avx512", reinterpret_cast<void*>(&kda_avx512::gated_rms_norm_impl),
      "avx512", 20);
  add(OpId::short_conv, "cpu.short_conv_avx2", reinterpret_cast<void*>(&kda_avx2::short_conv_impl), "avx2", 15);
  add(OpId::kda_gate, "cpu.kda_gate_avx2", reinterpret_cast<void*>(&kda_avx2::kda_gate_impl), "avx2", 15);
  add(OpId::kda_recurrent, "cpu.kda_recurrent_avx2", reinterpret_cast<void*>(&kda_avx2::kda_recurrent_impl), "avx2",
      15);
  add(OpId::kda_chunked, "cpu.kda_chunked_avx2",
      reinterpret_cast<void*>(&kda_avx2::kda_chunked_impl<kda_avx2::kChunk>), "avx2", 15);
  add(OpId::gated_rms_norm, "cpu.gated_rms_norm_avx2", reinterpret_cast<void*>(&kda_avx2::gated_rms_norm_impl),
      "avx2", 15);
}

}  // namespace moat::ops
