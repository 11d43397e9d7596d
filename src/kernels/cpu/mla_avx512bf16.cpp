// Absorbed MLA decode attention on AVX-512 BF16 dot products, reading the bf16 paged cache in place.
//
// Why a second decode kernel: the avx512 one (cpu_generic.inc) converts each chunk of cache rows
// to fp32 and runs fp32 FMAs, 16 multiply-adds per instruction. vdpbf16ps does 32 from the bf16
// rows as they lie in the cache: no conversion pass, and half the instructions in P . V. On Zen 5
// at 1 thread that kernel ran 16 heads over a 4096-row context at ~38% of the FMA peak (1.7-2.0
// ms), this one in 0.7-0.9 ms (kernel_bench --mla-only).
//
// Precision (default mode only; args.exact calls and fp32 / fp8 caches go to the avx512 kernel), as
// the AMX prefill kernel: the queries are split into bf16 high + low parts, so the scores are as
// accurate as fp32 queries against the bf16 cache (queries rounded to bf16 alone flipped 3 of 36
// top-1 tokens of the tiny_qlora golden fixture, DefaultActivations.StayCloseToReference); the
// probabilities are rounded to bf16 for P . V as GPU flash attention does. Products accumulate in
// fp32; the online softmax runs in fp32. The split doubles the score pass's dot products: it
// runs at the fp32 FMA rate, without the conversion pass; P . V runs at twice that.
//
// Layouts. Scores of a chunk: [rows][G] fp32 (one head group), so 16 / G rows fill a vector and the
// softmax runs on whole vectors. P . V takes cache rows in pairs: vdpbf16ps sums adjacent bf16
// pairs, so rows j and j + 1 are interleaved (vpunpckl/hwd: 16 (row j, row j + 1) pairs of
// columns each) and dotted with the broadcast pair (p[j], p[j + 1]) of each head. The interleave
// puts columns 8b + m (block b of 4, m < 4) in lane 4b + m of the "lo" accumulator and 8b + 4 + m
// in that of the "hi" one; the span's output keeps that order per 32 columns until its end.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "base/aligned_vector.h"
#include "base/check.h"
#include "base/dtype.h"
#include "kernels/cpu/cpu_kernels.h"

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#include "kernels/cpu/avx512_helpers.h"

namespace moat::ops::cpu_avx512bf16 {
namespace {

using avx512::first_lanes;
using avx512::first_words;
using avx512::reduce16;
using avx512::split_bf16x32;
using avx512::vexp;

// Cache rows per online-softmax step: their scores ([256][8] fp32, 8 KiB) and probabilities stay in
// L1, the rows themselves (256 x 1152 bytes) in L2 between the score and output passes.
constexpr int64_t kChunkRows = 256;

// The first head group's score pass reads the chunk's rows from memory (the later passes from L2);
// each block of the paged cache is a short run of rows at a random address, which the hardware
// prefetchers pick up too late. Rows this far ahead are prefetched, a cache line of each of the 4
// rows per 32-column step of the score loop (~3 DRAM latencies ahead at 1 thread). Whole rows
// prefetched at once before each call (72 prefetches in a burst) ran 1.08-1.09x the time at 16
// heads x 4096 rows from memory, 1 thread (1.05x at 2; Zen 5, alternating calls); without any,
// 1.2x.
constexpr int64_t kAheadRows = 8;

// Per thread, reused across calls.
struct Scratch {
  // [groups of the task, Dp / 32, G, 2, 32] bf16 queries: per 32 dims, each head's high and low
  // parts side by side (zero past D), so the score loop reads them at constant offsets from one
  // pointer (16 pointers of their own took more registers than there are)
  AlignedVector<uint16_t> q;
  std::vector<const uint16_t*> rows;   // [kChunkRows + 4] the chunk's rows in the cache; padding: zero
  std::vector<const uint16_t*> ahead;  // [kChunkRows + 4] row j + kAheadRows of the span (prefetch)
  AlignedVector<uint16_t> zero_row;    // [Dp]
  AlignedVector<float> scores;         // [kChunkRows + 4, G]
  AlignedVector<uint32_t> pairs;       // [kChunkRows / 2 + 2, G] (p[j], p[j + 1]) as bf16 pairs
};

// Scores of 4 rows rp[0..4) against 4 of the G heads' queries, heads h_off..h_off + 3 of q [Dp / 32,
// G, 2, 32] (high, low): sc[r * G + h_off + h] = scale * q_h . row_r. 16 accumulators, each taking
// both parts; kFull: D % 32 == 0 (DeepSeek's 576), no masked loads in the loop. ahead (or nullptr):
// 4 rows prefetched a line per step, as far as the rows go (Dp columns). With G = 8 a call
// used to take 2 rows x all 8 heads: 2 row loads and 16 query loads per 32 dot products, and the
// pass ran at ~65% of the vdpbf16ps peak; 4 x 4 needs 4 + 8 loads for the same 32 and runs at
// ~90% (Zen 5, 1 thread, 16 and 128 heads over the same 4096 rows each call, from L3: the whole
// kernel 0.81-0.82x the time, alternating calls).
template <int G, bool kFull>
__attribute__((noinline)) void score_rows(const uint16_t* const* rp, const uint16_t* q, int64_t D, int64_t Dp,
                                          __m512 scale, float* sc, int h_off, const uint16_t* const* ahead) {
  static_assert(G == 4 || G == 8);
  __m512 acc[16];  // [4 rows][4 heads]
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < Dp; d += 32) {
    const __mmask32 m = kFull ? ~__mmask32(0) : first_words(D - d);
    __m512i c[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) c[r] = kFull ? _mm512_loadu_si512(rp[r] + d) : _mm512_maskz_loadu_epi16(m, rp[r] + d);
    if (ahead) {
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead[r] + d), _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      const uint16_t* qd = q + d * 2 * G + 64 * (h_off + h);  // [2, 32]
      const __m512i qh = _mm512_loadu_si512(qd), ql = _mm512_loadu_si512(qd + 32);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        acc[r * 4 + h] = _mm512_dpbf16_ps(acc[r * 4 + h], (__m512bh)c[r], (__m512bh)qh);
        acc[r * 4 + h] = _mm512_dpbf16_ps(acc[r * 4 + h], (__m512bh)c[r], (__m512bh)ql);
      }
    }
  }
  const __m512 v = _mm512_mul_ps(reduce16(acc), scale);  // lane 4 r + h: row r's 4 heads per 128 bits
  _mm_storeu_ps(sc + h_off, _mm512_extractf32x4_ps(v, 0));
  _mm_storeu_ps(sc + G + h_off, _mm512_extractf32x4_ps(v, 1));
  _mm_storeu_ps(sc + 2 * G + h_off, _mm512_extractf32x4_ps(v, 2));
  _mm_storeu_ps(sc + 3 * G + h_off, _mm512_extractf32x4_ps(v, 3));
}

// lane i of the result: heads[i % G] (the [rows][G] layout's per-head values across a vector)
template <int G>
inline __m512 per_head(const float* heads) {
  if constexpr (G == 8) return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(heads))));
  else return _mm512_broadcast_f32x4(_mm_loadu_ps(heads));
}
// lane i: the max over lanes i' with i' % G == i % G
template <int G>
inline __m512 max_per_head(__m512 v) {
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));      // swap 256-bit halves
  if constexpr (G == 4) v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));  // swap 128-bit blocks in halves
  return v;
}
template <int G>
inline __m512 sum_per_head(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  if constexpr (G == 4) v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
  return v;
}

// Word order that turns one vector of probabilities [16 / G rows][G] (as 16 bf16) into (row 2i,
// row 2i + 1) pairs per head: pair (i, h) = dword i * G + h.
template <int G>
inline __m256i pair_order() {
  alignas(32) uint16_t idx[16];
  for (int i = 0; i < 16 / G / 2; ++i)
    for (int h = 0; h < G; ++h) {
      idx[2 * (i * G + h)] = static_cast<uint16_t>(2 * i * G + h);
      idx[2 * (i * G + h) + 1] = static_cast<uint16_t>((2 * i + 1) * G + h);
    }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
}

// o[h] (32 columns from d, lo / hi order) = o[h] * corr[h] + sum over row pairs of (p, p') . (row, row')
// for NB blocks of 32 columns and G heads: 2 x NB x G = 16 accumulators.
template <int G>
__attribute__((always_inline)) inline void output_blocks(const uint16_t* const* rp, const uint32_t* pairs,
                                                         int64_t n_pairs, int64_t d, int64_t C, const float* corr,
                                                         float* o, int64_t Cp) {
  constexpr int NB = 8 / G;
  __m512 lo[G][NB], hi[G][NB];
  __mmask32 m[NB];
#pragma GCC unroll 2
  for (int b = 0; b < NB; ++b) m[b] = first_words(C - d - 32 * b);
#pragma GCC unroll 8
  for (int h = 0; h < G; ++h) {
    const __m512 c = _mm512_set1_ps(corr[h]);
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      lo[h][b] = _mm512_mul_ps(_mm512_loadu_ps(o + h * Cp + d + 32 * b), c);
      hi[h][b] = _mm512_mul_ps(_mm512_loadu_ps(o + h * Cp + d + 32 * b + 16), c);
    }
  }
  for (int64_t i = 0; i < n_pairs; ++i) {
    __m512i wl[NB], wh[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      const __m512i a = _mm512_maskz_loadu_epi16(m[b], rp[2 * i] + d + 32 * b);
      const __m512i a2 = _mm512_maskz_loadu_epi16(m[b], rp[2 * i + 1] + d + 32 * b);
      wl[b] = _mm512_unpacklo_epi16(a, a2);
      wh[b] = _mm512_unpackhi_epi16(a, a2);
    }
#pragma GCC unroll 8
    for (int h = 0; h < G; ++h) {
      const __m512i p = _mm512_set1_epi32(static_cast<int>(pairs[i * G + h]));
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) {
        lo[h][b] = _mm512_dpbf16_ps(lo[h][b], (__m512bh)wl[b], (__m512bh)p);
        hi[h][b] = _mm512_dpbf16_ps(hi[h][b], (__m512bh)wh[b], (__m512bh)p);
      }
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      _mm512_storeu_ps(o + h * Cp + d + 32 * b, lo[h][b]);
      _mm512_storeu_ps(o + h * Cp + d + 32 * b + 16, hi[h][b]);
    }
}

// The score pass over a chunk: n_quads groups of 4 rows (rows and ahead padded to whole quads),
// prefetching the rows `ahead` (or nothing: nullptr) during the quad's first call. score_rows and
// output_chunk are out of line so that tests/ops/no_spill_test.cpp can check their loops on their
// own (a call per 4 rows x 576 dims).
template <int G, bool kFull>
void score_chunk(const uint16_t* const* rows, const uint16_t* const* ahead, int64_t n_quads, const uint16_t* q,
                 int64_t D, int64_t Dp, __m512 scale, float* sc) {
  for (int64_t v = 0; v < n_quads; ++v) {
#pragma GCC unroll 2
    for (int h_off = 0; h_off < G; h_off += 4)
      score_rows<G, kFull>(rows + 4 * v, q, D, Dp, scale, sc + 4 * v * G, h_off,
                           ahead && h_off == 0 ? ahead + 4 * v : nullptr);
  }
}

// The P . V pass over a chunk for G heads, every block of 32 output columns.
template <int G>
__attribute__((noinline)) void output_chunk(const uint16_t* const* rows, const uint32_t* pairs, int64_t n_pairs,
                                            int64_t C, const float* corr, float* o, int64_t Cp) {
  for (int64_t d = 0; d < C; d += 32 * (8 / G)) output_blocks<G>(rows, pairs, n_pairs, d, C, corr, o, Cp);
}

// MlaSpanFn: context rows [r0, r1) of token t for heads [hb, he), G heads at a time.
template <int G, bool kFull>
void span_bf16(const MlaAttentionArgs& a, int64_t t, int64_t r0, int64_t r1, int64_t hb, int64_t he, int64_t Cp,
               const MlaSpanState& st) {
  constexpr int RV = 16 / G;  // rows per vector of scores
  const int64_t C = a.kv_lora, D = C + a.rope_dim, Dp = (D + 31) / 32 * 32, H = a.num_heads;
  const int64_t B = a.cache.block_size;
  const int32_t* blocks = a.block_tables + static_cast<int64_t>(a.token_seq[t]) * a.max_blocks_per_seq;
  const uint16_t* cache = static_cast<const uint16_t*>(a.cache.rows);
  thread_local Scratch w;
  w.q.assign(static_cast<size_t>((he - hb) * 2 * Dp), 0);  // (he - hb) / G groups of Dp / 32 x G x 2 x 32
  w.rows.resize(static_cast<size_t>(kChunkRows + 4));
  w.ahead.resize(static_cast<size_t>(kChunkRows + 4));
  if (static_cast<int64_t>(w.zero_row.size()) < Dp) w.zero_row.assign(static_cast<size_t>(Dp), 0);  // never written
  w.scores.resize(static_cast<size_t>((kChunkRows + 4) * G));
  w.pairs.resize(static_cast<size_t>((kChunkRows / 2 + 2) * G));
  for (int64_t h = hb; h < he; ++h) {  // queries to bf16 high + low parts (round to nearest even)
    const float* src = a.q + (t * H + h) * D;
    const int64_t g = (h - hb) / G, hg = (h - hb) % G;
    for (int64_t d = 0; d < D; d += 32) {
      uint16_t* hi = w.q.data() + g * 2 * G * Dp + d * 2 * G + 64 * hg;  // [2, 32]
      const __m512 x0 = _mm512_maskz_loadu_ps(first_lanes(D - d), src + d);
      const __m512 x1 = _mm512_maskz_loadu_ps(first_lanes(D - d - 16), src + d + 16);
      __m512i h16, l16;
      split_bf16x32(x0, x1, h16, l16);
      _mm512_mask_storeu_epi16(hi, first_words(D - d), h16);
      _mm512_mask_storeu_epi16(hi + 32, first_words(D - d), l16);
    }
  }
  for (int64_t h = hb; h < he; ++h) st.m[h] = -INFINITY, st.l[h] = 0.0f;
  std::fill(st.o + hb * Cp, st.o + he * Cp, 0.0f);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m256i order = pair_order<G>();

  for (int64_t c0 = r0; c0 < r1; c0 += kChunkRows) {
    const int64_t n = std::min(kChunkRows, r1 - c0);
    const int64_t n_vec = (n + RV - 1) / RV;  // score vectors; rows n.. of the last one are padding
    const int64_t n_quads = (n + 3) / 4;      // score_rows calls per 4 heads: rows n.. are padding
    auto row_at = [&](int64_t r) { return cache + (static_cast<int64_t>(blocks[r / B]) * B + r % B) * D; };
    for (int64_t j = 0; j < 4 * n_quads; ++j) {  // whole quads cover the score vectors (RV: 2 or 4)
      w.rows[j] = j < n ? row_at(c0 + j) : w.zero_row.data();
      // past the span's end a row of this chunk (already in L1 or L2) stands in, so the score loop
      // prefetches without testing for the end
      w.ahead[j] = c0 + j + kAheadRows < r1 ? row_at(c0 + j + kAheadRows) : w.rows[j];
    }
    const int64_t n_pairs = (n + 1) / 2;  // RV is even: the pairs' rows are among the vectors' rows
    for (int64_t h0 = hb; h0 < he; h0 += G) {
      const uint16_t* q = w.q.data() + (h0 - hb) * 2 * Dp;  // [Dp / 32, G, 2, 32]
      float* sc = w.scores.data();                       // [n_vec * RV, G]
      score_chunk<G, kFull>(w.rows.data(), h0 == hb ? w.ahead.data() : nullptr, n_quads, q, D, Dp, scale, sc);
      for (int64_t j = n; j < n_vec * RV; ++j)
        for (int h = 0; h < G; ++h) sc[j * G + h] = -INFINITY;
      // online softmax per head, on whole vectors of the [rows][G] scores
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int64_t v = 0; v < n_vec; ++v) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sc + v * 16));
      alignas(64) float cmax[16], corr[G], mnew[G];
      _mm512_store_ps(cmax, max_per_head<G>(vmax));
      for (int h = 0; h < G; ++h) {
        const float old = st.m[h0 + h];
        mnew[h] = std::max(old, cmax[h]);
        corr[h] = old == -INFINITY ? 0.0f : std::exp(old - mnew[h]);
      }
      const __m512 mv = per_head<G>(mnew);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t v = 0; v < n_vec; ++v) {
        const __m512 e = vexp(_mm512_sub_ps(_mm512_loadu_ps(sc + v * 16), mv));
        vsum = _mm512_add_ps(vsum, e);
        const __m256i pb = _mm256_permutexvar_epi16(order, (__m256i)_mm512_cvtneps_pbh(e));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.pairs.data() + v * RV / 2 * G), pb);
      }
      alignas(64) float sums[16];
      _mm512_store_ps(sums, sum_per_head<G>(vsum));
      for (int h = 0; h < G; ++h) {
        st.l[h0 + h] = st.l[h0 + h] * corr[h] + sums[h];
        st.m[h0 + h] = mnew[h];
      }
      output_chunk<G>(w.rows.data(), w.pairs.data(), n_pairs, C, corr, st.o + h0 * Cp, Cp);
    }
  }
  // lo / hi order back to columns: 8b + m <- lo lane 4b + m, 8b + 4 + m <- hi lane 4b + m
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = hb; h < he; ++h)
    for (int64_t d = 0; d < C; d += 32) {
      float* o = st.o + h * Cp + d;
      const __m512 lo = _mm512_loadu_ps(o), hi = _mm512_loadu_ps(o + 16);
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}

}  // namespace

void mla_attention_bf16(const MlaAttentionArgs& a) {
  if (a.exact || a.cache.dtype != DType::BF16 || a.num_heads % 4 != 0) {
    cpu_avx512::mla_attention(a);
    return;
  }
  const int64_t G = a.num_heads % 8 == 0 ? 8 : 4;
  const bool full = (a.kv_lora + a.rope_dim) % 32 == 0;
  cpu_avx512::mla_attention_spans(a, G,
                                  G == 8 ? (full ? &span_bf16<8, true> : &span_bf16<8, false>)
                                         : (full ? &span_bf16<4, true> : &span_bf16<4, false>));
}

}  // namespace moat::ops::cpu_avx512bf16

#pragma GCC pop_options
