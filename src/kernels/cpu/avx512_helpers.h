// AVX-512 helpers shared by the kernel files: a 16 x 16 dword transpose and the packing of bf16 rows
// into B tiles (VNNI layout) built on it (the AMX kernels: matmul_avx512bf16.cpp, mla_amx.cpp), exp on 16
// lanes (kda_cpu.cpp, mla_amx.cpp) and 16 horizontal sums at once (the MLA score passes). Include it inside a region compiled for avx512f (a "#pragma GCC
// target" block).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace moat::ops::avx512 {

// Masks of the first n lanes (16 floats) or words (32 bf16): all for n past the vector, none for n <= 0.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}
inline __mmask32 first_words(int64_t n) {
  return n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1);
}

// 32 fp32 values (x0: the first 16, x1: the next 16) as bf16 high parts (round to nearest even) and
// low parts (the rounding residues x - float(high), rounded again): high + low carries ~16
// significant bits, so dot products against bf16 data are as accurate as with fp32 x (the MLA
// kernels' queries). Its own target: kda_cpu.cpp includes this file without AVX-512 BF16.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void split_bf16x32(__m512 x0, __m512 x1, __m512i& high, __m512i& low) {
  high = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
  const __m512 back0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(high)), 16));
  const __m512 back1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(high, 1)), 16));
  low = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, back1), _mm512_sub_ps(x0, back0));
}

// 16 rows of 32 bf16 (16 column pairs each, as dwords) -> 16 vectors, vector j = pair j of rows
// 0..15: a 16x16 dword transpose in 4 rounds of 16 shuffles.
__attribute__((always_inline)) inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // per 128-bit lane L: u[4g + c] holds element 4L + c of rows 4g..4g+3
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const int b = 4 * g;
    r[b + 0] = _mm512_unpacklo_epi64(t[b + 0], t[b + 2]);
    r[b + 1] = _mm512_unpackhi_epi64(t[b + 0], t[b + 2]);
    r[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
    r[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);       // element c
    t[c + 8] = _mm512_shuffle_i32x4(v0, v2, 0xdd);   // element c + 8
    t[c + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);   // element c + 4
    t[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xdd);  // element c + 12
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// x[T, Kx] bf16 -> xv[Tp/16][Kx/2][16] column pairs as uint32: a B tile of 16 pairs x 16 tokens is
// 1 KiB contiguous; tokens T..Tp-1 are zero. Kx % 32 == 0. 16 x 16 dword transposes: a scalar
// loop here was most of a small matrix's call (k3-nano's 384 x 256: ~1 us of 8).
inline void pack_x_vnni16(const uint16_t* x, int64_t T, int64_t Tp, int64_t Kx, uint32_t* xv) {
  for (int64_t b = 0; b < Tp / 16; ++b)
    for (int64_t p0 = 0; p0 < Kx / 2; p0 += 16) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) {
        const int64_t tok = b * 16 + t;
        r[t] = tok < T ? _mm512_loadu_si512(x + tok * Kx + 2 * p0) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* dst = xv + (b * (Kx / 2) + p0) * 16;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + j * 16, r[j]);
    }
}

using poly_v = __m512;
inline __m512 poly_fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 poly_splat(float s) { return _mm512_set1_ps(s); }
#include "kernels/cpu/vec_poly.inc"

// exp(x) = 2^n e^r, r = x - n ln2 (exp_poly_reduced); vscalefps applies 2^n, underflowing
// gracefully to denormals and 0.
inline __m512 vexp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_poly_reduced(x, n), n);
}

// The 16 horizontal sums of v[0..15] as one vector, lane i = sum of v[i]: four rounds of
// shuffles and adds (45 instructions for 16 sums, where 16 separate reductions take ~100).
__attribute__((always_inline)) inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 c[8], e[4], g[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // blocks [v_i: 2 of 4 partial blocks, v_{i+8}: 2]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xee));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // blocks [v_i, v_{i+8}, v_{i+4}, v_{i+12}], 4 partial lanes each
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xdd));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // per block: 2 partial lanes of e_i's quantity, 2 of e_{i+2}'s
    g[i] = _mm512_add_ps(_mm512_shuffle_ps(e[i], e[i + 2], 0x44), _mm512_shuffle_ps(e[i], e[i + 2], 0xee));
  // block k: [e_0's, e_2's, e_1's, e_3's] quantity k, so lane 4k + m holds v[{0, 8, 4, 12}[k] + {0, 2, 1, 3}[m]]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xdd));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), r);
}

}  // namespace moat::ops::avx512
