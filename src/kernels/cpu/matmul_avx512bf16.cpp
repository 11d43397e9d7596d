// The CPU matmul for machines with AVX-512 BF16 (Zen4, Sapphire Rapids and later): the kernel that
// decode time is made of. y[T, N] = x[T, K] . W[N, K]^T for W in bf16, f16 or fp8 e4m3 with block
// scales.
//
// - The fp32 activations are rounded to bf16 once per call (x_bf16: [T, Kp], Kp = K rounded up to
//   32, zero padded), so the inner loop is one vdpbf16ps per 32 weights and token (fp32 accumulate).
// - W streams from memory exactly once per call: each task owns a range of 4-row groups, walks it
//   in chunks of rows that stay in L2 (~128 KiB), and runs every token against a chunk before the
//   next; the microkernel keeps 4 rows x up to 4 tokens of accumulators in registers.
// - fp8 at T <= 2 (decode): weights are decoded in registers (exact e4m3 -> bf16, subnormals via a
//   8-entry permute) and the 128x128 block scale multiplies the fp32 partial sum once per block.
//   fp8 and f16 at T >= 3 (prefill): a chunk of rows is dequantized once to bf16 (scale folded in)
//   and reused by all tokens, so decode cost is amortized.
// Compiled with a per-region target pragma (no global -march); registered only as usable where
// the CPU has avx512bf16 (Constraints::cpu_isa).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/check.h"
#include "base/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"

// GCC 12's _mm512_reduce_add_ps starts from an _mm512_undefined value: a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,bmi2")

namespace moat::ops::cpu_avx512bf16 {
namespace {

constexpr int64_t kChunkBytes = 128 * 1024;  // weight rows kept in L2 while tokens sweep them

inline __mmask32 tail_mask(int64_t n) { return n >= 32 ? ~0u : static_cast<__mmask32>((1u << n) - 1u); }

// x[T, K] fp32 -> xb[T, Kp] bf16 (round to nearest even), zero padded to Kp.
void convert_x(const float* x, int64_t T, int64_t K, int64_t Kp, uint16_t* xb) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * K;
    uint16_t* dst = xb + t * Kp;
    for (int64_t k = 0; k < Kp; k += 32) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, K - k));
      const __mmask16 m0 = static_cast<__mmask16>(tail_mask(std::min<int64_t>(n, 16)));
      const __mmask16 m1 = static_cast<__mmask16>(tail_mask(std::max<int64_t>(0, n - 16)));
      const __m512 lo = _mm512_maskz_loadu_ps(m0, xr + k);
      const __m512 hi = _mm512_maskz_loadu_ps(m1, xr + k + 16);
      _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// 32 e4m3 codes -> 32 exact bf16 values. Normal codes: the magnitude bits shifted into bf16's
// exponent/mantissa with the exponent rebiased by 127 - 7; subnormal codes (exponent 0, m * 2^-9)
// come from an 8-entry permute table. vdpbf16ps treats bf16 denormals as zero, so the value must
// be exact and normal, not a scaled denormal.
inline __m512i fp8_to_bf16(const uint8_t* p, __mmask32 mask, __m512i subnormals) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, p));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  const __m512i sub = _mm512_permutexvar_epi16(mag, subnormals);
  const __mmask32 is_sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i v = _mm512_mask_blend_epi16(is_sub, normal, sub);
  // sign: bit 7 of the code -> bit 15 of the bf16
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8), _mm512_set1_epi16(static_cast<short>(0x8000)), 0xf8);
}

__m512i subnormal_table() {
  alignas(64) uint16_t t[32] = {};
  for (int m = 0; m < 8; ++m) t[m] = f32_to_bf16(static_cast<float>(m) * 0x1p-9f);
  return _mm512_load_si512(t);
}

// acc[r][t] over K for NR weight rows (bf16, row stride ws) x NT tokens (xb rows, stride Kp);
// writes y[t * N + r].
template <int NR, int NT>
void tile_bf16(const uint16_t* w, int64_t ws, const uint16_t* xb, int64_t Kp, int64_t K, float* y, int64_t N) {
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_si512(w + r * ws + k);
    for (int t = 0; t < NT; ++t) {
      const __m512i xv = _mm512_loadu_si512(xb + t * Kp + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  if (k < K) {  // ragged K: masked weight loads (x is zero padded to Kp)
    const __mmask32 m = tail_mask(K - k);
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_maskz_loadu_epi16(m, w + r * ws + k);
    for (int t = 0; t < NT; ++t) {
      const __m512i xv = _mm512_loadu_si512(xb + t * Kp + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * N + r] = _mm512_reduce_add_ps(acc[r][t]);
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);
template <int NR>
constexpr TileFn kTileRow[4] = {&tile_bf16<NR, 1>, &tile_bf16<NR, 2>, &tile_bf16<NR, 3>, &tile_bf16<NR, 4>};
constexpr const TileFn* kTiles[4] = {kTileRow<1>, kTileRow<2>, kTileRow<3>, kTileRow<4>};

// All T tokens against `rows` bf16 weight rows (row stride ws); y points at column n0 of row 0.
void run_rows(const uint16_t* w, int64_t ws, int64_t rows, const uint16_t* xb, int64_t T, int64_t Kp,
              int64_t K, float* y, int64_t N) {
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const int64_t nt = std::min<int64_t>(4, T - t0);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      kTiles[nr - 1][nt - 1](w + r0 * ws, ws, xb + t0 * Kp, Kp, K, y + t0 * N + r0, N);
    }
  }
}

// fp8 rows [n0, n0 + NR) decoded in registers, NT <= 2 tokens; the block scale multiplies each
// 128-wide partial sum (rows of one 4-group share a 128-row scale block only when block_out % 4
// == 0, so the scale is looked up per row).
template <int NR, int NT>
void tile_fp8(const WeightMatrix& w, int64_t n0, const uint16_t* xb, int64_t Kp, float* y, int64_t N,
              __m512i subnormals) {
  const int64_t K = w.in_features, bi = w.block_in;
  const uint8_t* rows = static_cast<const uint8_t*>(w.data) + n0 * K;
  const float* srow[NR];
  for (int r = 0; r < NR; ++r) srow[r] = w.scale_inv + ((n0 + r) / w.block_out) * w.scale_cols();
  __m512 tot[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) tot[r][t] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < K; kb += bi) {
    const int64_t kend = std::min(K, kb + bi);
    __m512 acc[NR][NT];
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t k = kb; k < kend; k += 32) {
      const __mmask32 m = tail_mask(kend - k);
      __m512i wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = fp8_to_bf16(rows + r * K + k, m, subnormals);
      for (int t = 0; t < NT; ++t) {
        const __m512i xv = _mm512_maskz_loadu_epi16(m, xb + t * Kp + k);
        for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(srow[r][kb / bi]);
      for (int t = 0; t < NT; ++t) tot[r][t] = _mm512_fmadd_ps(acc[r][t], s, tot[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * N + r] = _mm512_reduce_add_ps(tot[r][t]);
}

using Fp8TileFn = void (*)(const WeightMatrix&, int64_t, const uint16_t*, int64_t, float*, int64_t, __m512i);
template <int NR>
constexpr Fp8TileFn kFp8Row[2] = {&tile_fp8<NR, 1>, &tile_fp8<NR, 2>};
constexpr const Fp8TileFn* kFp8Tiles[4] = {kFp8Row<1>, kFp8Row<2>, kFp8Row<3>, kFp8Row<4>};

// Dequantizes rows [n0, n0 + rows) of an fp8 or f16 matrix into dst[rows, Kp] bf16 (block scale
// folded in, zero padded), for prefill where every token reuses the chunk.
void dequantize_rows(const WeightMatrix& w, int64_t n0, int64_t rows, int64_t Kp, uint16_t* dst) {
  const int64_t K = w.in_features;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    uint16_t* out = dst + r * Kp;
    for (int64_t k = 0; k < Kp; k += 32) {
      const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(32, K - k));
      const __mmask16 m0 = static_cast<__mmask16>(tail_mask(std::min<int64_t>(cnt, 16)));
      const __mmask16 m1 = static_cast<__mmask16>(tail_mask(std::max<int64_t>(0, cnt - 16)));
      __m512 lo, hi;
      if (w.dtype == DType::F16) {
        const uint16_t* src = static_cast<const uint16_t*>(w.data) + n * K + k;
        lo = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m0, src));
        hi = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m1, src + 16));
      } else {
        // e4m3 bits -> fp32 bits scaled by 2^-120 (exact for subnormal codes too: MXCSR keeps
        // denormals), then one multiply by scale * 2^120.
        const uint8_t* src = static_cast<const uint8_t*>(w.data) + n * K + k;
        const float s = w.scale_inv[(n / w.block_out) * w.scale_cols() + k / w.block_in] * 0x1p120f;
        auto decode16 = [&](const uint8_t* p, __mmask16 m) {
          const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
          const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20);
          const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
          return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(mag, sign)), _mm512_set1_ps(s));
        };
        lo = decode16(src, m0);
        hi = decode16(src + 16, m1);
      }
      _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

}  // namespace

void matmul(const float* x, int64_t T, const WeightMatrix& w, float* y) {
  const int64_t N = w.out_features, K = w.in_features;
  const int64_t Kp = (K + 31) / 32 * 32;
  MOAT_CHECK(w.dtype == DType::BF16 || w.dtype == DType::F16 || w.dtype == DType::F8_E4M3,
             "cpu.matmul_avx512bf16: weight dtype {}", dtype_name(w.dtype));
  MOAT_CHECK(w.dtype != DType::F8_E4M3 || w.block_in % 32 == 0,
             "cpu.matmul_avx512bf16: fp8 block_in {} must be a multiple of 32", w.block_in);
  thread_local std::vector<uint16_t> xb_buf;
  xb_buf.resize(static_cast<size_t>(T * Kp));
  convert_x(x, T, K, Kp, xb_buf.data());
  const uint16_t* xb = xb_buf.data();
  const int64_t chunk_rows = std::clamp<int64_t>(kChunkBytes / (2 * Kp) / 4 * 4, 4, 128);
  const bool fp8_direct = w.dtype == DType::F8_E4M3 && T <= 2;
  const __m512i subnormals = subnormal_table();
  const int64_t groups = (N + 3) / 4;
  thread_pool().parallel_for(groups, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint16_t> scratch;  // [chunk_rows, Kp] dequantized rows
    const int64_t n_end = std::min(N, g1 * 4);
    for (int64_t n0 = g0 * 4; n0 < n_end; n0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, n_end - n0);
      if (w.dtype == DType::BF16) {
        run_rows(static_cast<const uint16_t*>(w.data) + n0 * K, K, rows, xb, T, Kp, K, y + n0, N);
      } else if (fp8_direct) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
          const int64_t nr = std::min<int64_t>(4, rows - r0);
          for (int64_t t = 0; t < T; t += 2)
            kFp8Tiles[nr - 1][std::min<int64_t>(2, T - t) - 1](w, n0 + r0, xb + t * Kp, Kp,
                                                                y + t * N + n0 + r0, N, subnormals);
        }
      } else {
        scratch.resize(static_cast<size_t>(chunk_rows * Kp));
        dequantize_rows(w, n0, rows, Kp, scratch.data());
        run_rows(scratch.data(), Kp, rows, xb, T, Kp, K, y + n0, N);
      }
    }
  }, std::max<int64_t>(1, 2048 / Kp));
}

}  // namespace moat::ops::cpu_avx512bf16

#pragma GCC pop_options
