// The CPU matmul for x86 machines with AVX2 + FMA but no AVX-512 BF16 (Zen 2 / Zen 3, Haswell to
// Alder Lake client cores; and Skylake-SP to Ice Lake servers, as cpu.matmul_avx512fma):
// y[T, N] = x[T, K] . W[N, K]^T for W in bf16, f16, fp8 e4m3 with 128 x 128 block scales, f32,
// MXFP4 or INT4_G32, with fp32 FMAs on fp32 activations (fp32-accurate: without a bf16 dot
// product rounding x would save nothing, so --exact and the default compute the same), except
// 4-bit decode in the default precision, whose activations are quantized to int16 per 32 elements
// (tile_q4_i16; more accurate than rounding to bf16).
//
// - Decode-sized calls (T <= direct_max_tokens: 4-22) decode the weights in registers and stream each
//   byte of W from memory once: a task's rows are read in 4 lanes side by side (4 long sequential
//   streams, each prefetched 2 KiB ahead), 1-2 tokens against each 4-row tile (4-bit and the
//   512-bit F16C fp8 tile: 1; fp8 tiles read x times the block scales of their row block,
//   scale_x_fp8, and each row block's rows form lanes of their own). bf16 becomes
//   fp32 with one shift (even elements) and one mask (odd elements), so x is stored evens-then-odds
//   per 16 columns; fp8 becomes fp32 by integer shifts and masks into fp32's exponent field
//   (fp8x32_exponent; AMD's default) or fp16 with a sign-extend, a shift and a mask (e4m3 and fp16
//   differ only in the exponent bias, 2^8, which rides on the scaled x; subnormals stay exact),
//   then F16C converts it.
// - Longer calls (batched decode, verification, prefill) are a packed GEMM: W is decoded to fp32
//   and transposed 64 columns x 256 k at a time (pack_panel: 16-column panels of 16 KiB, in L1
//   beside x's 6 KiB), x is packed once per call as [T / 6][K][6], and the micro-kernel keeps a
//   6-token x 16-column tile in 12 ymm accumulators (6 broadcasts and 2 loads per 12 FMAs: FMA
//   bound, not load bound, on two FMA pipes). Registered a second time for AVX-512F CPUs
//   (cpu.matmul_avx512fma: matmul_wide), whose micro-kernel takes 12 tokens x 2 panels in 24 zmm
//   accumulators over the same panels (x as [T / 12][K][12]), and whose fp8 (F16C route) and 4-bit
//   decode tiles run in zmm registers (tile_fp8_f16c_wide, tile_q4_i16_wide).
// - MXFP4 / INT4_G32, one token at a time: by default each group's 16 bytes are widened to 32
//   int16 codes against int16 activations (vpmaddwd, tile_q4_i16); exact mode turns them into
//   int8 values with two byte shuffles, then fp32 (tile_q4). The packed path dequantizes to fp32.
// The portable cpu_avx2::matmul (cpu_generic.inc) keeps any fp8 layout whose scale blocks are not
// multiples of 16.
// NaN codes of fp8 (0x7f, 0xff) decode to +-480 here (the exponent trick has no NaN); a checkpoint
// holding NaN weights is broken either way.
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "base/aligned_vector.h"
#include "base/check.h"
#include "base/thread_pool.h"
#include "kernels/cpu/cpu_kernels.h"

// GCC 12's 512-bit conversions and reductions start from an _mm512_undefined value (the 512-bit
// regions below): a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace moat::ops::cpu_avx2_fma {
namespace {

// Calls of up to this many tokens run on the register-decoding tiles, longer ones packed. A
// tile reads its 4 rows from memory once and again from L1 for every token pair (F16C fp8, 4-bit:
// every token), decoding them each time, so its rate is flat in T; the packed path decodes and
// transposes every weight once per call, which small calls cannot amortize. Swept on Zen 3
// (2026-12-03, best of ~0.6 s of calls, 2816 x 2048 and 2048 x 1408, cache-cold weights, GFLOPS
// at 1 / 2 threads, tiles against packed): bf16 66-72 / 110-117 flat against 56-64 / 113-122 at
// T = 16 and 64-72 / 122-138 at 20-24; fp8 on the exponent route 44-46 / 84-90 against 48-51 /
// 90-101 at 10; MXFP4 40-42 / 78-81 against 41 / 79-82 at 10; INT4 48-50 / 92-96 against 45-47 /
// 88-91 at 12 and 52-55 / 102 at 16. (Before the packed panels were built in registers the
// crossovers sat at 32 / 16 / 16 / 16.) Slower decodes (fp8 through F16C, exact 4-bit) keep the
// unswept 4.
// wide: the 512-bit packed micro-kernel (twice the FMAs per instruction) takes over sooner. Swept
// on Zen 5 (2026-12-04, 2048 x 2048 and 1408 x 2048, 1 and 2 threads, alternating calls, packed
// time / tile time): bf16 T = 8 1.14 / 1.10, 10 - / 0.96, 12 0.90 / 0.85; f32 8 1.05, 12 0.87;
// fp8 exponent route 6 1.09 / 1.12, 8 0.92 / 0.92; fp8 through F16C 2 1.34, 4 0.74; MXFP4 (int16
// tiles) 6 1.14, 8 0.92; INT4 8 1.14, 10 0.96. fp8 through F16C has its own 512-bit tile there
// (tile_fp8_f16c_wide: 37.7-39.9 GFLOPS at 1 thread, flat in T) against the packed path's 40.2 at
// T = 4 and 59.7 at 6. 4-bit likewise (tile_q4_i16_wide, 3072 x 3584, 1 thread): MXFP4 83-87
// GFLOPS flat against the packed path's 54 / 63 / 78 / 87 at T = 12 / 16 / 20 / 24, INT4 95-101
// against 56 / 66 / 79 / 107.
int64_t direct_max_tokens(DType dtype, bool fp8_exponent, bool q4_int16, bool wide) {
  if (dtype == DType::F8_E4M3) return wide ? (fp8_exponent ? 7 : 4) : fp8_exponent ? 10 : 4;
  if (dtype == DType::MXFP4) return q4_int16 ? (wide ? 22 : 10) : 4;
  if (dtype == DType::INT4_G32) return q4_int16 ? (wide ? 22 : 12) : 4;
  return wide ? 10 : 20;
}
constexpr int kMR = 6;                  // packed micro-tile: tokens (broadcast from packed x)
constexpr int kNR = 16;                 // packed micro-tile: columns (two ymm of a packed panel)
constexpr int64_t kKC = 256;            // k per packed block: one panel is kKC x 16 fp32 = 16 KiB
constexpr int64_t kPanelsPerChunk = 4;  // a task's packed block: 64 columns x kKC (64 KiB, in any L2)
constexpr int64_t kPrefetchBytes = 2048;

// ---- weight decode -----------------------------------------------------------------------------

template <DType D>
constexpr int64_t elem_bytes() {
  return D == DType::F32 ? 4 : D == DType::F8_E4M3 ? 1 : 2;
}
template <DType D>
constexpr bool is_q4() {
  return D == DType::MXFP4 || D == DType::INT4_G32;
}

// 4-bit codes -> int8, one byte shuffle per 16 codes: MXFP4 as 2 x e2m1 (the halving rides on the
// group scale), INT4_G32 as nibble - 8.
template <DType D>
__attribute__((always_inline)) inline __m128i q4_table() {
  if constexpr (D == DType::MXFP4) return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  return _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
}
// The 16 bytes (32 codes) b as int8 values: even = elements 0, 2, .., 30 (low nibbles), odd =
// elements 1, 3, .., 31 (high nibbles).
template <DType D>
__attribute__((always_inline)) inline void q4_values(__m128i b, __m128i& even, __m128i& odd) {
  const __m128i low = _mm_set1_epi8(0x0F);
  even = _mm_shuffle_epi8(q4_table<D>(), _mm_and_si128(b, low));
  odd = _mm_shuffle_epi8(q4_table<D>(), _mm_and_si128(_mm_srli_epi16(b, 4), low));
}
// The scale of group g of row n, times MXFP4's 1/2 (inline: WeightMatrix::group_scale is a call).
template <DType D>
__attribute__((always_inline)) inline float q4_scale(const WeightMatrix& w, int64_t n, int64_t g) {
  const int64_t i = n * w.groups_per_row() + g;
  uint32_t bits;
  if constexpr (D == DType::MXFP4) {
    const uint32_t e = static_cast<const uint8_t*>(w.group_scales)[i];
    bits = e == 0 ? 0x00400000u : e == 255 ? 0x7FC00000u : e << 23;  // 2^-127 (subnormal), NaN, 2^(e-127)
  } else {
    bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w.group_scales)[i]) << 16;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return D == DType::MXFP4 ? 0.5f * f : f;
}

// e4m3 codes (16 in a 128-bit vector) -> their fp16 bit patterns, value / 2^8: the sign to bit 15,
// exponent and mantissa shifted under fp16's (5-bit exponent, bias 15 against e4m3's 7).
__attribute__((always_inline)) inline __m256i fp8x16_to_f16(__m128i codes) {
  const __m256i s = _mm256_cvtepi8_epi16(codes);  // bits 7-15: the sign
  return _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
}
__attribute__((always_inline)) inline __m128i fp8x8_to_f16(__m128i codes) {
  const __m128i s = _mm_cvtepi8_epi16(codes);
  return _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
}
// fp16 value of an fp8 code times this is the e4m3 value.
constexpr float kFp8FromF16 = 256.0f;

// e4m3 codes -> fp32 by integer ops alone (the exponent route, Fp8DecodeRoute::exponent): a code's
// sign, exponent and mantissa placed under fp32's with no rebias make the value times 2^-120 (the
// exponent field holds e4m3's biased exponent, 0-15, against fp32's bias of 127 instead of 7), and
// subnormal codes become fp32 subnormals with the same mantissa: exact. 32 codes per 32-byte load:
// out[j] holds byte j of every dword (elements j, j + 4, .., j + 28). Per 32 weights 3 shifts to
// split the bytes, 2 to align them and 4 masks, against F16C's 2 conversions per 16 on top of the
// sign-extend, shift and mask. The tiles scale x by 2^64 (kFp8ExponentX) and the block scale
// (scale_x_fp8), so that products stay normal (x s w 2^-56); kFp8ExponentScale takes
// the rest once per output.
__attribute__((always_inline)) inline void fp8x32_exponent(__m256i codes, __m256 out[4]) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0x87F00000u));  // sign, 4 exponent + 3 mantissa bits
  // each 16-bit word's high byte (bytes 1, 3) under the word's top, sign copied into the 4 bits above
  const __m256i odd = _mm256_srai_epi16(codes, 4);
  const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(codes, 8), 4);  // bytes 0, 2 likewise
  out[0] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(even, 16), mask));
  out[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(odd, 16), mask));
  out[2] = _mm256_castsi256_ps(_mm256_and_si256(even, mask));
  out[3] = _mm256_castsi256_ps(_mm256_and_si256(odd, mask));
}
constexpr float kFp8ExponentX = 0x1p64f;
constexpr float kFp8ExponentScale = 0x1p56f;  // 2^120 / kFp8ExponentX

// 16 consecutive elements of a row (p: the first) as two fp32 vectors: bf16 as (even, odd)
// elements, every other dtype in order (lo = elements 0-7, hi = 8-15). fp8 before its scale.
template <DType D>
__attribute__((always_inline)) inline void decode16(const uint8_t* p, __m256& lo, __m256& hi) {
  if constexpr (D == DType::BF16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (D == DType::F16) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  } else if constexpr (D == DType::F8_E4M3) {
    const __m256i h = fp8x16_to_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  } else {
    lo = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    hi = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8);
  }
}

// 8 consecutive elements in order (the packing path); fp8 before its scale.
template <DType D>
__attribute__((always_inline)) inline __m256 decode8(const uint8_t* p) {
  if constexpr (D == DType::BF16) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  } else if constexpr (D == DType::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (D == DType::F8_E4M3) {
    return _mm256_cvtph_ps(fp8x8_to_f16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

// 8 consecutive 4-bit elements (4 bytes at p: element 2j in byte j's low nibble) times scale.
template <DType D>
__attribute__((always_inline)) inline __m256 decode8_q4(const uint8_t* p, float scale) {
  int32_t word;
  std::memcpy(&word, p, 4);
  __m128i lo, hi;
  q4_values<D>(_mm_cvtsi32_si128(word), lo, hi);
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpacklo_epi8(lo, hi)));
  return _mm256_mul_ps(v, _mm256_set1_ps(scale));
}

__attribute__((always_inline)) inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// ---- decode-sized calls: weights decoded in registers ------------------------------------------

// x as the direct tiles read it: [T][Kp] fp32, Kp = K rounded up to 16, zero padded, in the order
// the weights decode: bf16 puts each 16 columns' 8 even ones, then the 8 odd ones (decode16's
// order); 4-bit each 32 columns' even ones, then the odd ones (low nibbles, then high); the rest
// keep x's order.
// fp8's exponent route: each 32 columns' elements 0, 4, .., 28, then 1, 5, .., 29, and so on
// (fp8x32_exponent's order), times kFp8ExponentX. (4-bit weights in the default precision read
// quantize_x_q4_i16's int16 copy instead.)
enum class XOrder { plain, even_odd16, even_odd32, fp8_exponent32 };
void prepare_x_direct(const float* x, int64_t T, int64_t K, XOrder order, float* out, int64_t Kp) {
  for (int64_t t = 0; t < T; ++t) {
    const float* src = x + t * K;
    float* dst = out + t * Kp;
    std::fill(dst + (K / 64) * 64, dst + Kp, 0.0f);
    switch (order) {
      case XOrder::plain: std::memcpy(dst, src, static_cast<size_t>(K) * sizeof(float)); break;
      case XOrder::fp8_exponent32:
        for (int64_t k0 = 0; k0 < K; k0 += 32)
          for (int64_t i = 0; i < 32 && k0 + i < K; ++i) dst[k0 + (i & 3) * 8 + i / 4] = src[k0 + i] * kFp8ExponentX;
        break;
      default: {
        const int64_t span = order == XOrder::even_odd32 ? 32 : 16, half = span / 2;
        for (int64_t k0 = 0; k0 < K; k0 += span)
          for (int64_t i = 0; i < span && k0 + i < K; ++i) dst[k0 + (i & 1) * half + i / 2] = src[k0 + i];
      }
    }
  }
}

struct DirectArgs {
  const WeightMatrix* w;
  const float* x;  // prepare_x_direct's layout
  int64_t Kp;
  float* y;  // [T, N]
  bool fp8_exponent = false;  // fp8 weights on tile_fp8_exponent
  bool wide = false;  // cpu.matmul_avx512fma: fp8 through F16C and 4-bit int16 tiles in zmm registers
  // 4-bit weights on tile_q4_i16 (the default precision): x as quantize_x_q4_i16 leaves it
  const int16_t* xq = nullptr;  // [T][Kp]
  const float* xs = nullptr;    // [T][Kp / 32]
};

// The epilogue of the ymm decode tiles: y[t * N + r * rs] = the sum of acc[r][t]'s C chains times
// `factor`. always_inline, so acc stays in the tile's registers.
template <int NR, int NT, int C>
__attribute__((always_inline)) inline void store_chains(const __m256 (&acc)[NR][NT][C], float* y, int64_t N,
                                                        int64_t rs, float factor) {
  static_assert(C == 1 || C == 2);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m256 v = acc[r][t][0];
      if constexpr (C == 2) v = _mm256_add_ps(v, acc[r][t][1]);
      y[t * N + r * rs] = hsum(v) * factor;
    }
}

// y[t][n0 + r rs] for r < NR, t < NT (tokens t0 ..; y already offset). NT == 1 keeps
// separate accumulators for the two halves of each 16 (each FMA chain one FMA per step: the
// latency of a 2-FMA chain would bound a 4-row, 1-token tile at half the FMA rate); two tokens
// have enough chains without. Three would need 12 accumulators beside the decoded halves, the
// bf16 mask and fp8's constants: more than AVX2's 16 ymm registers.
template <DType D, int NR, int NT>
void tile_direct(const DirectArgs& a, int64_t n0, int64_t rs, int64_t t0, float* y) {
  constexpr int64_t eb = elem_bytes<D>();
  const float* x = a.x + t0 * a.Kp;
  constexpr int kHalves = NT == 1 ? 2 : 1;
  const WeightMatrix& w = *a.w;
  const int64_t K = w.in_features, N = w.out_features, Kp = a.Kp;
  const int64_t row_bytes = K * eb;
  const uint8_t* base = static_cast<const uint8_t*>(w.data) + n0 * row_bytes;
  const uint8_t* rows[NR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) rows[r] = base + r * rs * row_bytes;
  // fp8: x arrives scaled by the row block's scales (and kFp8FromF16; run_direct), so fp8 rows
  // sum like any other dtype's (the tile used to fold each 128-column block's sums times its
  // scale into y: a horizontal sum per row and block, and one token per tile for lack of
  // registers for the totals)
  __m256 acc[NR][NT][kHalves];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 2
      for (int h = 0; h < kHalves; ++h) acc[r][t][h] = _mm256_setzero_ps();

  // one 16-column step: decode each row's 16 weights, multiply into every token
  auto step = [&](const uint8_t* const* src, int64_t k) __attribute__((always_inline)) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m256 lo, hi;
      decode16<D>(src[r], lo, hi);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const float* xt = x + t * Kp + k;
        if constexpr (kHalves == 2) {
          acc[r][t][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xt), acc[r][t][0]);
          acc[r][t][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xt + 8), acc[r][t][1]);
        } else {
          acc[r][t][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xt), acc[r][t][0]);
          acc[r][t][0] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xt + 8), acc[r][t][0]);
        }
      }
    }
  };

  const int64_t k_whole = K / 16 * 16;  // where the ragged tail, if any, starts
  int64_t k = 0;
  // a cache line of every row per iteration, each row prefetched kPrefetchBytes ahead
  constexpr int64_t kLine = 64 / eb;
  for (; k + kLine <= K; k += kLine) {
    const uint8_t* src[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      src[r] = rows[r] + k * eb;
      _mm_prefetch(reinterpret_cast<const char*>(src[r]) + kPrefetchBytes, _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int64_t j = 0; j < kLine; j += 16) {
      const uint8_t* sj[NR];
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) sj[r] = src[r] + j * eb;
      step(sj, k + j);
    }
  }
  for (; k + 16 <= K; k += 16) {
    const uint8_t* src[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) src[r] = rows[r] + k * eb;
    step(src, k);
  }
  // The rows' last 1-15 elements, zero padded as x is; outside the k loop, whose body must store
  // no vectors.
  if (k_whole < K) {
    alignas(32) uint8_t tail[NR][64] = {};
    const uint8_t* src[NR];
    for (int r = 0; r < NR; ++r) {
      std::memcpy(tail[r], rows[r] + k_whole * eb, static_cast<size_t>((K - k_whole) * eb));
      src[r] = tail[r];
    }
    step(src, k_whole);
  }
  store_chains(acc, y, N, rs, 1.0f);
}

// 4-bit weights, one token: per 32-column group each row's 16 bytes become 32 int8 values (two
// byte shuffles), then fp32; the group's two partial sums take the group scale in one FMA into
// the row's accumulator (a scale per weight vector would be 4 multiplies a group).
template <DType D, int NR>
void tile_q4(const DirectArgs& a, int64_t n0, int64_t rs, int64_t t0, float* y) {
  const WeightMatrix& w = *a.w;
  const float* x = a.x + t0 * a.Kp;
  const int64_t K = w.in_features, row_bytes = K / 2, groups = K / 32;
  const uint8_t* rows[NR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) rows[r] = static_cast<const uint8_t*>(w.data) + (n0 + r * rs) * row_bytes;
  __m256 acc[NR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * 32;
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = rows[r] + g * 16;
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      __m128i even, odd;
      q4_values<D>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), even, odd);
      const __m256 e0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(even));
      const __m256 e1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(even, even)));
      const __m256 o0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(odd));
      const __m256 o1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(odd, odd)));
      __m256 p0 = _mm256_mul_ps(e0, _mm256_loadu_ps(xg));
      __m256 p1 = _mm256_mul_ps(e1, _mm256_loadu_ps(xg + 8));
      p0 = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xg + 16), p0);
      p1 = _mm256_fmadd_ps(o1, _mm256_loadu_ps(xg + 24), p1);
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(q4_scale<D>(w, n0 + r * rs, g)), acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) y[r * rs] = hsum(acc[r]);
}

// fp8 on the exponent route: per 32 columns each row's 32 codes become 4 fp32 vectors
// (fp8x32_exponent), 4 FMAs per token. x arrives scaled by the block scales of the tile's row
// block (scale_x_fp8: every row of a tile lies in one block of rows), so the
// accumulators run over all of K and only kFp8ExponentScale is left for the end. The tile used
// to multiply each 128-column block's sums by the scale instead: a horizontal sum per row and
// block, ~10 shuffles and adds per 52 ops of decode and FMAs, on the shuffle pipes the decode's
// shifts need (Zen 3 at one thread is compute-bound here). One token keeps 2 accumulators per
// row (a single chain of 4 dependent FMAs per step would bound it by FMA latency); two tokens
// decode each code once for both and have 8 chains in one accumulator each.
template <int NR, int NT>
void tile_fp8_exponent(const DirectArgs& a, int64_t n0, int64_t rs, int64_t t0, float* y) {
  static_assert(NT == 1 || NT == 2);
  constexpr int kChains = NT == 1 ? 2 : 1;
  const WeightMatrix& w = *a.w;
  const int64_t Kp = a.Kp, N = w.out_features;
  const float* x = a.x + t0 * Kp;
  const int64_t K = w.in_features;
  const uint8_t* rows[NR];
  __m256 acc[NR][NT][kChains];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    rows[r] = static_cast<const uint8_t*>(w.data) + (n0 + r * rs) * K;
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c) acc[r][t][c] = _mm256_setzero_ps();
  }
  auto step = [&](const uint8_t* const* src, const float* xk) __attribute__((always_inline)) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m256 v[4];
      fp8x32_exponent(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r])), v);
      // each decoded vector into every token before the next: 4 live at once would spill beside
      // 8 accumulators
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t)
          acc[r][t][j % kChains] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xk + t * Kp + 8 * j), acc[r][t][j % kChains]);
      }
    }
  };
  const int64_t k_whole = K / 64 * 64;
  for (int64_t k = 0; k < k_whole; k += 64) {  // a cache line of every row, each prefetched ahead
    const uint8_t* src[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      src[r] = rows[r] + k;
      _mm_prefetch(reinterpret_cast<const char*>(src[r]) + kPrefetchBytes, _MM_HINT_T0);
    }
    step(src, x + k);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) src[r] += 32;
    step(src, x + k + 32);
  }
  // The rows' last 1-63 codes, zero padded as x is; outside the k loop, whose body must store no
  // vectors.
  if (k_whole < K) {
    alignas(32) uint8_t tail[NR][64] = {};
    const uint8_t* src[NR];
    for (int r = 0; r < NR; ++r) {
      std::memcpy(tail[r], rows[r] + k_whole, static_cast<size_t>(K - k_whole));
      src[r] = tail[r];
    }
    step(src, x + k_whole);
    for (int r = 0; r < NR; ++r) src[r] += 32;
    step(src, x + k_whole + 32);
  }
  store_chains(acc, y, N, rs, kFp8ExponentScale);
}

// xd[T, Kp] (prepare_x_direct's layout for fp8: plain for F16C, the exponent route's order times
// kFp8ExponentX) times one row block's scales times `factor` -> xs[T, Kp]: one fp32 rounding of
// x * scale, fp32-accurate still. Per 16 columns one scale: block_in is a multiple of 16
// (handled()), and the exponent route's order (block_in % 64 == 0 there) permutes within 32.
void scale_x_fp8(const float* xd, int64_t T, int64_t Kp, int64_t K, const float* scales, int64_t block_in, float factor,
                 float* xs) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < Kp; k += 16) {
      // past K: x is zero there, except that the exponent order moves x[K - 1]'s 32-column group
      // (one block) across it
      const __m256 s = _mm256_set1_ps(scales[std::min(k, K - 1) / block_in] * factor);
      _mm256_storeu_ps(xs + t * Kp + k, _mm256_mul_ps(_mm256_loadu_ps(xd + t * Kp + k), s));
      _mm256_storeu_ps(xs + t * Kp + k + 8, _mm256_mul_ps(_mm256_loadu_ps(xd + t * Kp + k + 8), s));
    }
}

// y[t0 .. t0 + NT)[n0 + r rs] for the tile's rows r (y already offset to token t0, row n0).
using DirectTile = void (*)(const DirectArgs&, int64_t n0, int64_t rs, int64_t t0, float* y);

// ---- 4-bit decode with int16 activations (the default precision) -------------------------------
// The fp32 tile (tile_q4, exact mode) turns each group's 32 int8 codes into 4 fp32 vectors (4
// widenings, 4 conversions) before its 4 FMAs: ~21 vector ops per group and row, compute-bound at
// a fifth of the bandwidth on Zen 3. With x quantized once per call to int16 per 32-element group
// (as cpu.matmul_avx512bf16's tile_q4_i16: q = round(x 32767 / max|x|), an error of at most
// max|x| / 65534 per element, below rounding x to bf16), a group is one widening to int16 lanes
// and 2 vpmaddwd, exact in int32 (4 products of at most |12 x 256 x 32767| per lane), then one
// conversion to fp32 (rounding MXFP4's sums, which carry the x 256, by 2^-24 at most) and one FMA
// with the two scales: ~11 ops.

// x[T, K] -> xq[T][Kp] int16, each 32 elements' even ones then odd ones (q4_values' order), and
// xs[T][Kp / 32] their fp32 scales. K % 32 == 0 (handled() for 4-bit weights).
void quantize_x_q4_i16(const float* x, int64_t T, int64_t K, int64_t Kp, int16_t* xq, float* xs) {
  // below this a group's 32767 / max overflows fp32: such groups are scaled in double
  constexpr float kTinyGroup = 1e-33f;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < K / 32; ++g) {
      const float* src = x + t * K + g * 32;
      __m256 v[4], m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      alignas(32) int32_t q[32];
      if (mx < kTinyGroup && mx > 0.0f) {
        for (int i = 0; i < 32; ++i) q[i] = static_cast<int32_t>(std::nearbyint(src[i] * (32767.0 / mx)));
      } else {
        const __m256 inv = _mm256_set1_ps(mx > 0.0f ? 32767.0f / mx : 0.0f);
        for (int i = 0; i < 4; ++i)  // nearest even, as nearbyint
          _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
      }
      int16_t* dst = xq + t * Kp + g * 32;
      for (int i = 0; i < 32; ++i) dst[(i & 1) * 16 + i / 2] = static_cast<int16_t>(q[i]);
      xs[t * (Kp / 32) + g] = mx / 32767.0f;
    }
}

// The 16 bytes (32 codes) at p as int16 lanes for vpmaddwd: even = elements 0, 2, .., 30 (low
// nibbles), odd = 1, 3, .., 31. One zero-extension per group instead of q4_values' two
// sign-extensions (lane-crossing, the tile's bottleneck: 7 -> 5 ops, +35% in L1 on Zen 3).
// INT4_G32 is nibble - 8. MXFP4's e2m1 values come from a byte shuffle placed in each lane's high
// byte (the index of the low byte is 0, and entry 0 of the table is 0): value x 256, undone by
// kQ4I16Unit on the scale.
template <DType D>
__attribute__((always_inline)) inline void q4_values_i16(const uint8_t* p, __m256i& even, __m256i& odd) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i low = _mm256_set1_epi16(0x0F);
  if constexpr (D == DType::INT4_G32) {
    even = _mm256_sub_epi16(_mm256_and_si256(b, low), _mm256_set1_epi16(8));
    odd = _mm256_sub_epi16(_mm256_srli_epi16(b, 4), _mm256_set1_epi16(8));
  } else {
    static_assert(D == DType::MXFP4);
    const __m256i table = _mm256_broadcastsi128_si256(q4_table<D>());
    even = _mm256_shuffle_epi8(table, _mm256_slli_epi16(_mm256_and_si256(b, low), 8));
    // b << 4: the high nibble in the high byte; the low byte's index is 0 or has bit 7 set: 0 either way
    odd = _mm256_shuffle_epi8(table, _mm256_slli_epi16(b, 4));
  }
}
template <DType D>
constexpr float kQ4I16Unit = D == DType::MXFP4 ? 1.0f / 256.0f : 1.0f;

// The scales of groups g0 .. g0 + 7 of row n times x's scales of those groups (xs8), as
// q4_scale would give them one by one: one at a time is ~5 ops per group and row (load, widen,
// move to a vector, multiply, broadcast), 8 at once and a lane permute per group ~1.5 (measured
// alone: +0-7%; the sign-extensions, not the scales, were what bound the tile).
template <DType D>
__attribute__((always_inline)) inline __m256 q4_scales8(const WeightMatrix& w, int64_t n, int64_t g0, __m256 xs8) {
  const int64_t i = n * w.groups_per_row() + g0;
  if constexpr (D == DType::MXFP4) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.group_scales) + i)));
    __m256i bits = _mm256_slli_epi32(e, 23);  // 2^(e-127); e = 0: 2^-127 (subnormal), e = 255: NaN
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f * kQ4I16Unit<D>)), xs8);
  } else {
    const __m256i b = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w.group_scales) + i)));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), xs8);
  }
}

// What a 4-bit int16 tile reads: rows n0 + r rs (r < NR) of the codes, and token t0's int16 x
// and per-group scales (quantize_x_q4_i16).
template <int NR>
struct Q4I16Operands {
  const uint8_t* rows[NR];
  const int16_t* xq;
  const float* xs;
};
template <int NR>
__attribute__((always_inline)) inline Q4I16Operands<NR> q4_i16_operands(const DirectArgs& a, int64_t n0, int64_t rs,
                                                                         int64_t t0) {
  Q4I16Operands<NR> o;
  const int64_t row_bytes = a.w->in_features / 2;
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) o.rows[r] = static_cast<const uint8_t*>(a.w->data) + (n0 + r * rs) * row_bytes;
  o.xq = a.xq + t0 * a.Kp;
  o.xs = a.xs + t0 * (a.Kp / 32);
  return o;
}
// Group g of row n's scale times x's (xs: the token's group scales), one at a time (the tiles'
// last 1-7 groups).
template <DType D>
__attribute__((always_inline)) inline float q4_i16_scale(const WeightMatrix& w, int64_t n, int64_t g, const float* xs) {
  return q4_scale<D>(w, n, g) * kQ4I16Unit<D> * xs[g];
}

// One token against NR rows: per group, each row's 16 bytes -> 2 x 16 int8 (q4_values) -> int16
// -> vpmaddwd with x's even and odd halves -> 8 int32 sums -> fp32, times the row's group scale
// and x's, into the row's accumulator. Groups 8 at a time, each row's 8 scales in a register.
template <DType D, int NR>
void tile_q4_i16(const DirectArgs& a, int64_t n0, int64_t rs, int64_t t0, float* y) {
  const WeightMatrix& w = *a.w;
  const int64_t groups = w.in_features / 32;
  const auto [rows, xq, xs] = q4_i16_operands<NR>(a, n0, rs, t0);
  __m256 acc[NR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  // group g of every row, its combined scale from `scale(r)`
  auto group = [&](int64_t g, auto scale) __attribute__((always_inline)) {
    const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32));
    const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32 + 16));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = rows[r] + g * 16;
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      __m256i even, odd;
      q4_values_i16<D>(p, even, odd);
      const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(even, xe), _mm256_madd_epi16(odd, xo));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale(r), acc[r]);
    }
  };
  const int64_t g8 = groups / 8 * 8;
  for (int64_t g0 = 0; g0 < g8; g0 += 8) {
    const __m256 xs8 = _mm256_loadu_ps(xs + g0);
    __m256 sv[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) sv[r] = q4_scales8<D>(w, n0 + r * rs, g0, xs8);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      group(g0 + j, [&](int r) __attribute__((always_inline)) {
        return _mm256_permutevar8x32_ps(sv[r], _mm256_set1_epi32(j));
      });
  }
  for (int64_t g = g8; g < groups; ++g)  // the last 1-7 groups (K % 256 != 0), a scale at a time
    group(g, [&](int r) __attribute__((always_inline)) {
      return _mm256_set1_ps(q4_i16_scale<D>(w, n0 + r * rs, g, xs));
    });
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) y[r * rs] = hsum(acc[r]);
}

template <DType D, int... R>
constexpr std::array<std::array<DirectTile, 2>, 4> direct_table(std::integer_sequence<int, R...>) {
  return {{{&tile_direct<D, R + 1, 1>, &tile_direct<D, R + 1, 2>}...}};
}
template <DType D>
constexpr auto kDirect = direct_table<D>(std::make_integer_sequence<int, 4>{});

template <DType D, int... R>
constexpr std::array<std::array<DirectTile, 2>, 4> q4_table_of_tiles(std::integer_sequence<int, R...>) {
  return {{{&tile_q4<D, R + 1>, nullptr}...}};
}
template <DType D>
constexpr auto kDirectQ4 = q4_table_of_tiles<D>(std::make_integer_sequence<int, 4>{});

template <DType D, int... R>
constexpr std::array<std::array<DirectTile, 2>, 4> q4_i16_tiles(std::integer_sequence<int, R...>) {
  return {{{&tile_q4_i16<D, R + 1>, nullptr}...}};
}
template <DType D>
constexpr auto kDirectQ4I16 = q4_i16_tiles<D>(std::make_integer_sequence<int, 4>{});

template <int... R>
constexpr std::array<std::array<DirectTile, 2>, 4> fp8_exponent_tiles(std::integer_sequence<int, R...>) {
  return {{{&tile_fp8_exponent<R + 1, 1>, &tile_fp8_exponent<R + 1, 2>}...}};
}
constexpr auto kDirectFp8Exponent = fp8_exponent_tiles(std::make_integer_sequence<int, 4>{});

// ---- fp8 through F16C on 512-bit vectors (cpu.matmul_avx512fma) -------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

// tile_direct's fp8 decode with zmm registers: 16 codes per conversion and FMA where the ymm tile
// takes 8. For AVX-512F CPUs without BF16 dot products, whose fp8 goes through F16C (Intel: the
// exponent route's subnormal inputs cost a microcode assist each). One token; four chains per row
// (one per 16 codes of a cache line); x arrives scaled by the row block's scales (run_direct).
template <int NR>
void tile_fp8_f16c_wide(const DirectArgs& a, int64_t n0, int64_t rs, int64_t t0, float* y) {
  const WeightMatrix& w = *a.w;
  const float* x = a.x + t0 * a.Kp;
  const int64_t K = w.in_features;
  const uint8_t* rows[NR];
  __m512 acc[NR][4];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    rows[r] = static_cast<const uint8_t*>(w.data) + (n0 + r * rs) * K;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  // 16 codes of every row from src[r] against x[k, k + 16), into chain c
  auto step = [&](const uint8_t* const* src, int64_t k, int c) __attribute__((always_inline)) {
    const __m512 xk = _mm512_loadu_ps(x + k);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 v = _mm512_cvtph_ps(fp8x16_to_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[r]))));
      acc[r][c] = _mm512_fmadd_ps(v, xk, acc[r][c]);
    }
  };
  const int64_t k_whole = K / 16 * 16;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {  // a cache line of every row, each prefetched ahead
    const uint8_t* src[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      src[r] = rows[r] + k;
      _mm_prefetch(reinterpret_cast<const char*>(src[r]) + kPrefetchBytes, _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const uint8_t* sc[NR];
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) sc[r] = src[r] + 16 * c;
      step(sc, k + 16 * c, c);
    }
  }
  for (; k + 16 <= K; k += 16) {
    const uint8_t* src[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) src[r] = rows[r] + k;
    step(src, k, 0);
  }
  // the rows' last 1-15 codes, zero padded as x is; outside the k loop, whose body stores nothing
  if (k_whole < K) {
    alignas(16) uint8_t tail[NR][16] = {};
    const uint8_t* src[NR];
    for (int r = 0; r < NR; ++r) {
      std::memcpy(tail[r], rows[r] + k_whole, static_cast<size_t>(K - k_whole));
      src[r] = tail[r];
    }
    step(src, k_whole, 0);
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
    y[r * rs] = _mm512_reduce_add_ps(sum);
  }
}

// tile_q4_i16 with zmm registers: two groups (32 bytes of every row) per step, each group's even
// and odd int16 codes in one half of a zmm against x's (two ymm loads per step, shared by the
// rows), each half times its own group's scales. 4-bit decode on AVX2 is compute-bound (~40% of
// the bandwidth at one thread on Zen 5 with BF16 taken away): twice the lanes per instruction.
template <DType D, int NR>
void tile_q4_i16_wide(const DirectArgs& a, int64_t n0, int64_t rs, int64_t t0, float* y) {
  const WeightMatrix& w = *a.w;
  const int64_t groups = w.in_features / 32;
  const auto [rows, xq, xs] = q4_i16_operands<NR>(a, n0, rs, t0);
  __m512 acc[NR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi16(0x0F);
  // groups g and g + 1 of every row (only g where !both: the row's last group, its neighbour's
  // bytes not read); scale(r): their combined scales, g's in the low half
  auto pair = [&](int64_t g, bool both, auto scale) __attribute__((always_inline)) {
    const __m512i xe = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32 + 32)), 1);
    const __m512i xo = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32 + 16))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32 + 48)), 1);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = rows[r] + g * 16;
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      // each group's 16 bytes widened to int16 lanes in one half (as q4_values_i16 does per group)
      const __m256i bytes = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                 : _mm256_maskz_loadu_epi8(0x0000FFFFu, p);
      const __m512i b = _mm512_cvtepu8_epi16(bytes);
      __m512i even, odd;
      if constexpr (D == DType::INT4_G32) {
        even = _mm512_sub_epi16(_mm512_and_si512(b, low), _mm512_set1_epi16(8));
        odd = _mm512_sub_epi16(_mm512_srli_epi16(b, 4), _mm512_set1_epi16(8));
      } else {
        const __m512i table = _mm512_broadcast_i32x4(q4_table<D>());
        even = _mm512_shuffle_epi8(table, _mm512_slli_epi16(_mm512_and_si512(b, low), 8));
        odd = _mm512_shuffle_epi8(table, _mm512_slli_epi16(b, 4));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_madd_epi16(even, xe), _mm512_madd_epi16(odd, xo));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale(r), acc[r]);
    }
  };
  const int64_t g8 = groups / 8 * 8;
  for (int64_t g0 = 0; g0 < g8; g0 += 8) {
    const __m256 xs8 = _mm256_loadu_ps(xs + g0);
    __m512 sv[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) sv[r] = _mm512_castps256_ps512(q4_scales8<D>(w, n0 + r * rs, g0, xs8));
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(j)), _mm256_set1_epi32(j + 1), 1);
      pair(g0 + j, true, [&](int r) __attribute__((always_inline)) { return _mm512_permutexvar_ps(idx, sv[r]); });
    }
  }
  // the last 1-7 groups (K % 256 != 0) in pairs, a scale at a time; an odd last group pairs with
  // zero codes and a zero scale (x is [T][Kp], Kp a multiple of 64: the phantom group's x is in
  // bounds, whatever it holds)
  for (int64_t g = g8; g < groups; g += 2) {
    const bool second = g + 1 < groups;
    pair(g, second, [&](int r) __attribute__((always_inline)) {
      const float s0 = q4_i16_scale<D>(w, n0 + r * rs, g, xs);
      const float s1 = second ? q4_i16_scale<D>(w, n0 + r * rs, g + 1, xs) : 0.0f;
      return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(s0)), _mm256_set1_ps(s1), 1);
    });
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) y[r * rs] = _mm512_reduce_add_ps(acc[r]);
}

template <DType D, int... R>
constexpr std::array<std::array<DirectTile, 2>, 4> q4_i16_wide_tiles(std::integer_sequence<int, R...>) {
  return {{{&tile_q4_i16_wide<D, R + 1>, nullptr}...}};
}
template <DType D>
constexpr auto kDirectQ4I16Wide = q4_i16_wide_tiles<D>(std::make_integer_sequence<int, 4>{});

template <int... R>
constexpr std::array<std::array<DirectTile, 2>, 4> fp8_f16c_wide_tiles(std::integer_sequence<int, R...>) {
  return {{{&tile_fp8_f16c_wide<R + 1>, nullptr}...}};
}
constexpr auto kDirectFp8F16cWide = fp8_f16c_wide_tiles(std::make_integer_sequence<int, 4>{});

#pragma GCC pop_options

const std::array<std::array<DirectTile, 2>, 4>& direct_tiles(DType d) {
  switch (d) {
    case DType::MXFP4: return kDirectQ4<DType::MXFP4>;
    case DType::INT4_G32: return kDirectQ4<DType::INT4_G32>;
    case DType::BF16: return kDirect<DType::BF16>;
    case DType::F16: return kDirect<DType::F16>;
    case DType::F8_E4M3: return kDirect<DType::F8_E4M3>;
    default: return kDirect<DType::F32>;
  }
}

// Rows [begin, end) of one task: 4 lanes of L rows read side by side (tile i: rows begin + i +
// q L), then the 0-3 rows left as one tile of consecutive rows.
void run_direct(DirectArgs a, int64_t T, int64_t begin, int64_t end) {
  const auto& tiles = a.fp8_exponent           ? kDirectFp8Exponent
                     : a.wide && a.w->dtype == DType::F8_E4M3 ? kDirectFp8F16cWide
                     : a.xq == nullptr          ? direct_tiles(a.w->dtype)
                     : a.w->dtype == DType::MXFP4 ? (a.wide ? kDirectQ4I16Wide<DType::MXFP4> : kDirectQ4I16<DType::MXFP4>)
                     : a.wide                   ? kDirectQ4I16Wide<DType::INT4_G32>
                                                : kDirectQ4I16<DType::INT4_G32>;
  const int64_t N = a.w->out_features;
  const int64_t tokens_per_tile = tiles[0][1] != nullptr ? 2 : 1;  // 512-bit F16C fp8 and 4-bit tiles take one
  auto tile = [&](int64_t n0, int64_t nr, int64_t rs) {
    for (int64_t t = 0; t < T;) {
      const int64_t nt = std::min(tokens_per_tile, T - t);
      tiles[nr - 1][nt - 1](a, n0, rs, t, a.y + t * N + n0);
      t += nt;
    }
  };
  auto lanes = [&](int64_t b, int64_t e) {
    const int64_t L = (e - b) / 4;
    for (int64_t i = 0; i < L; ++i) tile(b + i, 4, L);
    if (b + 4 * L < e) tile(b + 4 * L, e - b - 4 * L, 1);
  };
  const WeightMatrix& w = *a.w;
  if (w.dtype != DType::F8_E4M3) {
    lanes(begin, end);
    return;
  }
  // fp8: each block of rows against x scaled by that block's scales (and F16C's 2^8)
  thread_local AlignedVector<float> xs_buf;  // [T, Kp]
  xs_buf.resize(static_cast<size_t>(T * a.Kp));
  const float* xd = a.x;
  a.x = xs_buf.data();
  for (int64_t s0 = begin; s0 < end;) {
    const int64_t block = s0 / w.block_out, s1 = std::min(end, (block + 1) * w.block_out);
    scale_x_fp8(xd, T, a.Kp, w.in_features, w.scale_inv + block * w.scale_cols(), w.block_in,
                a.fp8_exponent ? 1.0f : kFp8FromF16, xs_buf.data());
    lanes(s0, s1);
    s0 = s1;
  }
}

// ---- longer calls: packed GEMM -----------------------------------------------------------------

// x as the micro-kernel reads it: [ceil(T / MR)][K][MR] fp32 (MR: kMR, or kMRWide for the 512-bit
// kernel), the last block's missing tokens zero. Token blocks [tb0, tb1) of it.
template <int MR>
void pack_x(const float* x, int64_t T, int64_t K, float* out, int64_t tb0, int64_t tb1) {
  for (int64_t tb = tb0; tb < tb1; ++tb) {
    float* dst = out + tb * K * MR;
    const int64_t t0 = tb * MR, nt = std::min<int64_t>(MR, T - t0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < MR; ++i) dst[k * MR + i] = i < nt ? x[(t0 + i) * K + k] : 0.0f;
  }
}

__attribute__((always_inline)) inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// pack_panel (below) for 4-bit weights: each 8 elements times their group's scale. kFull: all 16
// columns (the rows unrolled, the block in registers; a per-row check kept it on the stack).
template <DType D, bool kFull>
void pack_panel_q4(const WeightMatrix& w, int64_t c0, int64_t cols, int64_t k0, int64_t kc, float* dst) {
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  const int64_t row_bytes = w.in_features / 2;
  for (int64_t k = 0; k < kc; k += 8) {  // kc is a multiple of 32: so is K
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const int64_t c = half * 8 + i;
        r[i] = kFull || c < cols
                   ? decode8_q4<D>(base + (c0 + c) * row_bytes + (k0 + k) / 2, q4_scale<D>(w, c0 + c, (k0 + k) / 32))
                   : _mm256_setzero_ps();
      }
      transpose8(r);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (k + j) * kNR + half * 8, r[j]);
    }
  }
}

// pack_panel's edges: a panel of fewer than 16 columns (the matrix's last) and k past the last
// whole 8 (K % 8 != 0), from k on; zero fill beyond the columns. Rare: kept out of pack_panel,
// whose loop must store nothing on the stack.
template <DType D>
__attribute__((noinline)) void pack_panel_edge(const WeightMatrix& w, int64_t c0, int64_t cols, int64_t k0, int64_t k,
                                               int64_t kc, float* dst) {
  constexpr int64_t eb = elem_bytes<D>();
  const int64_t K = w.in_features;
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  const float* scale_row = nullptr;
  if constexpr (D == DType::F8_E4M3) scale_row = w.scale_inv + (c0 / w.block_out) * w.scale_cols();
  for (; k < kc; k += 8) {
    const int64_t kn = std::min<int64_t>(8, kc - k);
    __m256 s = _mm256_set1_ps(1.0f);
    if constexpr (D == DType::F8_E4M3) s = _mm256_set1_ps(scale_row[(k0 + k) / w.block_in] * kFp8FromF16);
    for (int half = 0; half < 2; ++half) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t c = half * 8 + i;
        if (c >= cols) {
          r[i] = _mm256_setzero_ps();
          continue;
        }
        const uint8_t* src = base + ((c0 + c) * K + k0 + k) * eb;
        if (kn == 8) {
          r[i] = decode8<D>(src);
        } else {
          alignas(32) uint8_t tail[32] = {};
          std::memcpy(tail, src, static_cast<size_t>(kn * eb));
          r[i] = decode8<D>(tail);
        }
        if constexpr (D == DType::F8_E4M3) r[i] = _mm256_mul_ps(r[i], s);
      }
      transpose8(r);
      for (int64_t j = 0; j < kn; ++j) _mm256_storeu_ps(dst + (k + j) * kNR + half * 8, r[j]);
    }
  }
}

// Columns [c0, c0 + cols) (cols <= 16; the rest of the panel zero) x k in [k0, k0 + kc) of W,
// decoded (fp8: block scale applied) and transposed into dst[kc][16]. A whole panel's 8 x 8
// blocks are decoded, transposed and stored in registers: with the rows' count and k's tail
// checked per element (as pack_panel_edge does), GCC kept the block on the stack and the pack
// took 12% of a 512-token fp8 prefill.
template <DType D>
void pack_panel(const WeightMatrix& w, int64_t c0, int64_t cols, int64_t k0, int64_t kc, float* dst) {
  if constexpr (is_q4<D>()) {
    if (cols == kNR)
      pack_panel_q4<D, true>(w, c0, cols, k0, kc, dst);
    else
      pack_panel_q4<D, false>(w, c0, cols, k0, kc, dst);
    return;
  }
  if (cols < kNR) {
    pack_panel_edge<D>(w, c0, cols, k0, 0, kc, dst);
    return;
  }
  constexpr int64_t eb = elem_bytes<D>();
  const int64_t K = w.in_features, stride = K * eb;
  const uint8_t* first = static_cast<const uint8_t*>(w.data) + (c0 * K + k0) * eb;
  const float* scale_row = nullptr;
  if constexpr (D == DType::F8_E4M3) scale_row = w.scale_inv + (c0 / w.block_out) * w.scale_cols();
  const int64_t k8 = kc / 8 * 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 s = _mm256_set1_ps(1.0f);
    if constexpr (D == DType::F8_E4M3) s = _mm256_set1_ps(scale_row[(k0 + k) / w.block_in] * kFp8FromF16);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        r[i] = decode8<D>(first + (half * 8 + i) * stride + k * eb);
        if constexpr (D == DType::F8_E4M3) r[i] = _mm256_mul_ps(r[i], s);
      }
      transpose8(r);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (k + j) * kNR + half * 8, r[j]);
    }
  }
  if (k8 < kc) pack_panel_edge<D>(w, c0, cols, k0, k8, kc, dst);
}

using PackPanel = void (*)(const WeightMatrix&, int64_t, int64_t, int64_t, int64_t, float*);
PackPanel pack_panel_for(DType d) {
  switch (d) {
    case DType::MXFP4: return &pack_panel<DType::MXFP4>;
    case DType::INT4_G32: return &pack_panel<DType::INT4_G32>;
    case DType::BF16: return &pack_panel<DType::BF16>;
    case DType::F16: return &pack_panel<DType::F16>;
    case DType::F8_E4M3: return &pack_panel<DType::F8_E4M3>;
    default: return &pack_panel<DType::F32>;
  }
}

// c[t][0..cols) (+)= a[kc][6] (tokens t < MR) . b[kc][16]; c rows ldc apart.
template <int MR>
void micro_kernel(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool accumulate, int64_t cols) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * kNR), b1 = _mm256_loadu_ps(b + k * kNR + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + k * kMR + i);
      acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
    }
  }
  if (cols == kNR) {
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      float* ci = c + i * ldc;
      if (accumulate) {
        acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_loadu_ps(ci));
        acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_loadu_ps(ci + 8));
      }
      _mm256_storeu_ps(ci, acc[i][0]);
      _mm256_storeu_ps(ci + 8, acc[i][1]);
    }
    return;
  }
#pragma GCC unroll 6  // constant indices into acc: anything else puts the array on the stack
  for (int i = 0; i < MR; ++i) {
    alignas(32) float v[kNR];
    _mm256_store_ps(v, acc[i][0]);
    _mm256_store_ps(v + 8, acc[i][1]);
    float* ci = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) ci[j] = accumulate ? ci[j] + v[j] : v[j];
  }
}

using MicroKernel = void (*)(const float*, const float*, int64_t, float*, int64_t, bool, int64_t);
constexpr MicroKernel kMicro[kMR] = {&micro_kernel<1>, &micro_kernel<2>, &micro_kernel<3>,
                                     &micro_kernel<4>, &micro_kernel<5>, &micro_kernel<6>};

struct PackedArgs {
  const WeightMatrix* w;
  const float* xp;  // pack_x's layout
  int64_t T;
  float* y;
  int64_t panels_per_chunk = kPanelsPerChunk;  // panels packed per k block (within one task's columns)
};

// x re-streams once per chunk of panels, from L3 or memory once it outgrows the L2: calls whose x
// passes this pack more panels at a time (large_chunk_panels), a quarter of the passes over x.
// 512-bit kernel, Zen 5, 1 thread, alternating calls, 16 panels' time over 4's: x of 3.7 MiB
// (2048 x 7168, T = 128) 1.06, 4.2 (K = 2048, T = 512) 0.99-1.04, 7.3 0.91, 8.4 0.94, 14.7 0.83,
// 22 (K = 10944, T = 512) 0.76 (2 threads 0.76); fp8 2048 x 2048 at T = 24 1.08. The ymm kernel
// (AVX2 CPUs) had kept 4 panels: with 16 (2026-12-05, Zen 5 with AVX-512 taken away, in-process
// A/B) 2048 x 10944 at T = 512 ran 77 -> 92 GFLOPS at 1 thread (86% of the ymm FMA peak; 8 panels
// 87, 32 95) and 122 -> 151 at 2, fp8 2048 x 7168 at T = 256 77 -> 93 and 128 -> 158.
constexpr int64_t kLargeChunkMinXBytes = int64_t{6} << 20;

// Panels a large-x call packs per k block: half the core's L2 (sysconf's, from CPUID), at most 16
// (256 KiB: the 512-bit kernel's measured setting; 32 gained 1-4% more on Zen 5's 1 MiB) and at
// least kPanelsPerChunk. 16 on Zen 2-5 and Ice Lake or newer, 8 on the 256 KiB L2 of Haswell to
// Skylake clients, where 16 panels would evict x's block between its panels; 8 when unknown.
int64_t large_chunk_panels() {
  static const int64_t panels = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    const int64_t panel_bytes = kKC * kNR * static_cast<int64_t>(sizeof(float));
    const int64_t fit = l2 > 0 ? static_cast<int64_t>(l2) / 2 / panel_bytes : 8;
    return std::clamp<int64_t>(fit, kPanelsPerChunk, 16);
  }();
  return panels;
}

// ---- the packed GEMM on 512-bit FMAs (AVX-512F CPUs without BF16 dot products) ----------------
// Skylake-SP to Ice Lake servers (and Zen 4 / 5 asked for fp32 weights) run two 512-bit FMA pipes
// (one on some Xeon Silver / Bronze parts): twice the multiply-adds per instruction of the 6 x 16
// ymm kernel, over the same packed panels. Only the micro-kernel and x's token blocks change; the
// decode-sized calls keep the ymm tiles, which are bound by the memory.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

constexpr int kMRWide = 12;  // tokens per micro-tile: 12 x 2 zmm accumulators of 32 columns

// c[t][0..cols) (+)= a[kc][12] (tokens t < MR) . the NP panels at b (each [kc][16], kKC x 16
// apart); c rows ldc apart, cols <= 16 NP. Per k: NP panel loads and MR broadcasts (folded into
// the FMAs as {1to16} operands) for MR x NP FMAs.
template <int MR, int NP>
void micro_kernel_wide(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool accumulate,
                       int64_t cols) {
  __m512 acc[MR][NP];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    __m512 bk[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) bk[j] = _mm512_loadu_ps(b + j * kKC * kNR + k * kNR);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a[k * kMRWide + i]);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(ai, bk[j], acc[i][j]);
    }
  }
  __mmask16 mask[NP];
#pragma GCC unroll 2
  for (int j = 0; j < NP; ++j) {
    const int64_t left = cols - j * kNR;
    mask[j] = left >= kNR ? __mmask16{0xFFFF} : left <= 0 ? __mmask16{0} : static_cast<__mmask16>((1u << left) - 1);
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      float* cij = c + i * ldc + j * kNR;
      __m512 v = acc[i][j];
      if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[j], cij));
      _mm512_mask_storeu_ps(cij, mask[j], v);
    }
  }
}

using MicroKernelWide = void (*)(const float*, const float*, int64_t, float*, int64_t, bool, int64_t);
template <int NP, int... MR>
constexpr std::array<MicroKernelWide, sizeof...(MR)> micro_wide_table(std::integer_sequence<int, MR...>) {
  return {&micro_kernel_wide<MR + 1, NP>...};
}
// [panels - 1][tokens - 1]
constexpr std::array<std::array<MicroKernelWide, kMRWide>, 2> kMicroWide = {
    micro_wide_table<1>(std::make_integer_sequence<int, kMRWide>{}),
    micro_wide_table<2>(std::make_integer_sequence<int, kMRWide>{})};

// Every 12-token block of x against the np packed panels of columns [cb, cb + 16 np) for k in
// [k0, k0 + kc), two panels per micro-tile.
void sweep_panels_wide(const PackedArgs& a, const float* panels, int64_t np, int64_t cb, int64_t ce, int64_t k0,
                       int64_t kc) {
  const int64_t K = a.w->in_features, N = a.w->out_features;
  for (int64_t t0 = 0; t0 < a.T; t0 += kMRWide) {
    const int64_t mr = std::min<int64_t>(kMRWide, a.T - t0);
    const float* xa = a.xp + (t0 / kMRWide) * K * kMRWide + k0 * kMRWide;
    for (int64_t p = 0; p < np; p += 2) {
      const int64_t pairs = std::min<int64_t>(2, np - p);
      kMicroWide[pairs - 1][mr - 1](xa, panels + p * kKC * kNR, kc, a.y + t0 * N + cb + p * kNR, N, k0 > 0,
                                    std::min<int64_t>(pairs * kNR, ce - cb - p * kNR));
    }
  }
}

#pragma GCC pop_options

// Columns [c_begin, c_end) of one task (a chunk of 16-column panels): per kKC block of k, the
// chunk's panels are packed once, then every token block of x sweeps them (kWide: 12-token blocks
// on the 512-bit micro-kernel, else 6-token blocks on the ymm one).
template <bool kWide>
void run_packed(const PackedArgs& a, int64_t c_begin, int64_t c_end) {
  const WeightMatrix& w = *a.w;
  const int64_t K = w.in_features, N = w.out_features;
  const PackPanel pack = pack_panel_for(w.dtype);
  thread_local AlignedVector<float> panels;
  const int64_t ppc = a.panels_per_chunk;
  panels.resize(static_cast<size_t>(ppc * kKC * kNR));
  for (int64_t cb = c_begin; cb < c_end; cb += ppc * kNR) {
    const int64_t ce = std::min(c_end, cb + ppc * kNR);
    const int64_t np = (ce - cb + kNR - 1) / kNR;
    for (int64_t k0 = 0; k0 < K; k0 += kKC) {
      const int64_t kc = std::min(kKC, K - k0);
      for (int64_t p = 0; p < np; ++p)
        pack(w, cb + p * kNR, std::min<int64_t>(kNR, ce - cb - p * kNR), k0, kc, panels.data() + p * kKC * kNR);
      if constexpr (kWide) {
        sweep_panels_wide(a, panels.data(), np, cb, ce, k0, kc);
        continue;
      }
      for (int64_t t0 = 0; t0 < a.T; t0 += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, a.T - t0);
        const float* xa = a.xp + (t0 / kMR) * K * kMR + k0 * kMR;
        for (int64_t p = 0; p < np; ++p)
          kMicro[mr - 1](xa, panels.data() + p * kKC * kNR, kc, a.y + t0 * N + cb + p * kNR, N, k0 > 0,
                         std::min<int64_t>(kNR, ce - cb - p * kNR));
      }
    }
  }
}

// ---- entry -------------------------------------------------------------------------------------

bool handled(const WeightMatrix& w) {
  switch (w.dtype) {
    case DType::BF16:
    case DType::F16:
    case DType::F32: return true;
    // the packed panels take 16 rows and 8 columns under one scale, the tiles 16 columns
    case DType::F8_E4M3:
      return w.scale_inv != nullptr && w.block_out % kNR == 0 && w.block_in % 16 == 0;
    case DType::MXFP4:
    case DType::INT4_G32: return w.group_scales != nullptr && w.in_features % 32 == 0;
    default: return false;
  }
}

// wide: the packed calls on the 512-bit micro-kernel (cpu.matmul_avx512fma; only where AVX-512F is).
void matmul_impl(const float* x, int64_t T, const WeightMatrix* const* ws, float* const* ys, int64_t count,
                 const MatmulPrecision& precision, bool wide) {
  if (T <= 0 || count == 0) return;
  const WeightMatrix& w0 = *ws[0];
  const int64_t K = w0.in_features;
  for (int64_t i = 0; i < count; ++i) {
    MOAT_CHECK(ws[i]->in_features == K && ws[i]->dtype == w0.dtype, "matmul group: weights must share K and dtype");
    if (!handled(*ws[i])) {
      for (int64_t j = 0; j < count; ++j) cpu_avx2::matmul(x, T, *ws[j], ys[j], precision);
      return;
    }
  }
  bool fp8_exponent = w0.dtype == DType::F8_E4M3 && fp8_decode_route() == Fp8DecodeRoute::exponent;
  for (int64_t i = 0; i < count && fp8_exponent; ++i) fp8_exponent = ws[i]->block_in % 64 == 0;
  // 4-bit weights in the default precision: x in int16 (exact mode keeps tile_q4 and fp32)
  const bool q4_int16 = w0.is_4bit() && !precision.fp8_split;
  if (T <= direct_max_tokens(w0.dtype, fp8_exponent, q4_int16, wide)) {
    const int64_t Kp = (K + 63) / 64 * 64;
    thread_local AlignedVector<float> xd;
    xd.resize(static_cast<size_t>(T * Kp));
    thread_local AlignedVector<int16_t> xq;
    thread_local AlignedVector<float> xs;
    if (q4_int16) {
      xq.resize(static_cast<size_t>(T * Kp));
      xs.resize(static_cast<size_t>(T * (Kp / 32)));
      quantize_x_q4_i16(x, T, K, Kp, xq.data(), xs.data());
    } else {
      const XOrder order = w0.dtype == DType::BF16 ? XOrder::even_odd16
                           : w0.is_4bit()          ? XOrder::even_odd32
                           : fp8_exponent          ? XOrder::fp8_exponent32
                                                   : XOrder::plain;
      prepare_x_direct(x, T, K, order, xd.data(), Kp);
    }
    const int16_t* xqp = q4_int16 ? xq.data() : nullptr;
    const float* xsp = xs.data();
    std::array<int64_t, kMaxMatmulGroup + 1> first{};  // first[i]: matrix i's first 4-row group
    for (int64_t i = 0; i < count; ++i) first[i + 1] = first[i] + (ws[i]->out_features + 3) / 4;
    const float* xdp = xd.data();
    thread_pool().parallel_for(first[count], [&](int64_t g0, int64_t g1) {
      for (int64_t i = 0; i < count; ++i) {
        const int64_t lo = std::max(g0, first[i]), hi = std::min(g1, first[i + 1]);
        if (lo >= hi) continue;
        const DirectArgs a{ws[i], xdp, Kp, ys[i], fp8_exponent, wide, xqp, xsp};
        run_direct(a, T, (lo - first[i]) * 4, std::min(ws[i]->out_features, (hi - first[i]) * 4));
      }
    }, grain_for_bytes(4.0 * static_cast<double>(w0.bytes()) / static_cast<double>(w0.out_features) * static_cast<double>(T)));
    return;
  }
  const int64_t mr = wide ? kMRWide : kMR;
  const auto pack_x_blocks = wide ? &pack_x<kMRWide> : &pack_x<kMR>;
  thread_local AlignedVector<float> xp;
  xp.resize(static_cast<size_t>((T + mr - 1) / mr * mr * K));
  // split over the pool where it is worth a dispatch (a 512-token call packs 4 MiB: ~1 ms alone)
  const int64_t token_blocks = (T + mr - 1) / mr;
  float* const xpp = xp.data();  // the caller's buffer (the workers' own thread_local xp is another)
  if (T * K >= (int64_t{1} << 16))
    thread_pool().parallel_for(token_blocks, [&](int64_t b0, int64_t b1) { pack_x_blocks(x, T, K, xpp, b0, b1); });
  else
    pack_x_blocks(x, T, K, xpp, 0, token_blocks);
  constexpr int64_t chunk_cols = kPanelsPerChunk * kNR;
  std::array<int64_t, kMaxMatmulGroup + 1> first{};  // first[i]: matrix i's first column chunk
  for (int64_t i = 0; i < count; ++i) first[i + 1] = first[i] + (ws[i]->out_features + chunk_cols - 1) / chunk_cols;
  thread_pool().parallel_for(first[count], [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t lo = std::max(c0, first[i]), hi = std::min(c1, first[i + 1]);
      if (lo >= hi) continue;
      const PackedArgs a{ws[i], xpp, T, ys[i], T * K * 4 > kLargeChunkMinXBytes ? large_chunk_panels() : kPanelsPerChunk};
      (wide ? &run_packed<true> : &run_packed<false>)(a, (lo - first[i]) * chunk_cols,
                                                      std::min(ws[i]->out_features, (hi - first[i]) * chunk_cols));
    }
  });
}

// Zen runs FMAs on subnormal inputs at full rate (Zen 3, weights all subnormal codes: 20 G weights
// per second per core, as with normal ones); Intel cores take a microcode assist per subnormal
// input unless DAZ is set (which would flush them: inexact), and real checkpoints hold a few
// subnormal codes per 10^4, so they keep F16C. MOAT_FP8_DECODE=f16c|exponent overrides.
std::atomic<Fp8DecodeRoute> g_fp8_route{[] {
  if (const char* env = std::getenv("MOAT_FP8_DECODE")) {
    if (std::strcmp(env, "f16c") == 0) return Fp8DecodeRoute::f16c;
    if (std::strcmp(env, "exponent") == 0) return Fp8DecodeRoute::exponent;
  }
  return __builtin_cpu_is("amd") ? Fp8DecodeRoute::exponent : Fp8DecodeRoute::f16c;
}()};

}  // namespace

Fp8DecodeRoute fp8_decode_route() { return g_fp8_route.load(std::memory_order_relaxed); }
void set_fp8_decode_route(Fp8DecodeRoute route) { g_fp8_route.store(route, std::memory_order_relaxed); }

void matmul_group(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                  const MatmulPrecision& precision) {
  matmul_impl(x, T, w, y, count, precision, false);
}

void matmul_group_wide(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                       const MatmulPrecision& precision) {
  matmul_impl(x, T, w, y, count, precision, true);
}

void matmul(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision) {
  const WeightMatrix* ws = &w;
  matmul_impl(x, T, &ws, &y, 1, precision, false);
}

void matmul_wide(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision) {
  const WeightMatrix* ws = &w;
  matmul_impl(x, T, &ws, &y, 1, precision, true);
}

}  // namespace moat::ops::cpu_avx2_fma

#pragma GCC pop_options
