// Absorbed MLA attention for prompt-sized calls on AMX-BF16 tiles: flash attention over the paged
// latent cache, one sequence's run of query tokens at a time.
//
// Why a second kernel: the avx512 one (cpu_generic.inc) walks each query token's context on its
// own, converting the cache rows to fp32 and doing fp32 FMAs per (token, head). That is right for
// decode, where a token's context streams from memory once, but prefill repeats the walk for every
// token: on the bench checkpoint (Xeon, 1 thread) a 512-token prompt spent 22% of its time there
// (~57 GFLOPS) and a 2048-token prompt 54%. Here a run's (token, head) query rows go 16 to a tile
// and the context's rows are packed once per call into the B-tile layouts: S = Q . K^T (A = Q
// [16 rows][32 dims], B = K^T as dim pairs) and O += P . V (A = P [16 rows][32 cache rows], B = V
// as cache-row pairs), each tdpbf16ps doing 16 x 16 x 32 multiply-adds.
//
// Precision: the cache rows are bf16 (the default cache dtype), the queries are split into bf16
// high + low parts (scores as accurate as fp32 queries against that cache), the probabilities are
// rounded to bf16 for O += P . V as GPU engines' flash attention does; products accumulate in fp32
// and the online softmax runs in fp32. args.exact (--exact) goes to the avx512 kernel, tokens
// without a long enough run of their sequence's tokens to the avx512bf16 decode kernel.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/aligned_vector.h"
#include "base/check.h"
#include "base/dtype.h"
#include "base/thread_pool.h"
#include "kernels/cpu/amx_tiles.h"
#include "kernels/cpu/cpu_kernels.h"

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")
#include "kernels/cpu/avx512_helpers.h"

namespace moat::ops::cpu_avx512bf16 {
namespace {

using avx512::first_lanes;
using avx512::pack_x_vnni16;
using avx512::split_bf16x32;
using avx512::vexp;

constexpr int64_t kTileRows = 16;   // rows of an A or C tile
constexpr int64_t kTileCols = 32;   // bf16 columns of an A tile: the K of one tdpbf16ps
constexpr int64_t kTileElems = kTileRows * kTileCols;  // bf16 per A / B tile (1 KiB)
// Query rows multiplied together: two row blocks, so each K or V tile loaded feeds two multiplies
// (four C tiles, two A, two B: all eight tile registers).
constexpr int64_t kPairRows = 2 * kTileRows;
// Query rows per task: four pairs take each chunk's K^T and V tiles in turn, from L2 after the
// first (with one pair per task the tiles streamed from L3 for every 32 rows: ~200 GFLOPS).
constexpr int64_t kTaskRows = 4 * kPairRows;
// Cache rows per online-softmax step: the scores [32][128] fp32 and probabilities stay in L1, and
// each O tile loaded from the task's accumulator takes 4 multiplies before it is stored again.
constexpr int64_t kChunkRows = 128;
// Cache rows packed at a time: K^T and V in B layouts, (576 + 512) x 2 bytes a row (8.9 MB here),
// shared by every task, whatever the context length.
constexpr int64_t kSpanRows = 4096;
// Runs of fewer query rows (tokens x heads) go to the decode kernel: packing costs a pass over the
// context per call, which a decode token (16 rows) or two would not win back.
constexpr int64_t kMinRunRows = 2 * kPairRows;

// One context row as bf16 [Dp] (dims D..Dp-1 zero), whatever the cache's dtype.
void latent_row_bf16(const LatentPages& c, int64_t slot, int64_t D, int64_t Dp, uint16_t* dst) {
  switch (c.dtype) {
    case DType::BF16:
      std::memcpy(dst, static_cast<const uint16_t*>(c.rows) + slot * D, sizeof(uint16_t) * D);
      break;
    case DType::F32: {
      const float* src = static_cast<const float*>(c.rows) + slot * D;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(D - d), src + d);
        const __m512 hi = _mm512_maskz_loadu_ps(first_lanes(D - d - 16), src + d + 16);
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        _mm512_mask_storeu_epi16(dst + d, d + 32 <= D ? ~__mmask32(0) : __mmask32((1ull << (D - d)) - 1), v);
      }
      break;
    }
    case DType::F8_E4M3: {  // a non-default cache dtype: converted once per call, O(context) work
      const uint8_t* src = static_cast<const uint8_t*>(c.rows) + slot * D;
      const float scale = c.row_scale[slot];
      for (int64_t d = 0; d < D; ++d) dst[d] = f32_to_bf16(fp8_e4m3_to_f32(src[d]) * scale);
      break;
    }
    default: MOAT_CHECK(false, "cpu mla_attention_amx: unsupported cache dtype {}", dtype_name(c.dtype));
  }
  std::fill(dst + D, dst + Dp, uint16_t{0});
}

// A span's context rows in the two B layouts. kt: K^T tiles [rows/16][Dp/32][16 dim pairs][16 rows]
// (pairs as dwords); vt: V tiles [rows/32][C/16][16 row pairs][16 dims][2].
struct PackedSpan {
  AlignedVector<uint16_t> kt, vt;  // rows: r1 - r0 rounded up to 32, zero past the context
};

// Rows [r0, r1) of the context whose block table is `blocks` -> span (rows r0 .. r0 + 32k).
void pack_span(const LatentPages& c, const int32_t* blocks, int64_t r0, int64_t r1, int64_t D, int64_t Dp,
               int64_t C, PackedSpan& span) {
  const int64_t rows = (r1 - r0 + 31) / 32 * 32, steps = Dp / kTileCols, dim_tiles = C / kTileRows;
  span.kt.resize(static_cast<size_t>(rows * Dp));
  span.vt.resize(static_cast<size_t>(rows * C));
  // vt row p of a tile: dims [16 d, 16 d + 16) of rows 2p and 2p + 1, interleaved
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo_idx = _mm512_load_si512(kLo), hi_idx = _mm512_load_si512(kHi);
  thread_pool().parallel_for(rows / 32, [&](int64_t k0, int64_t k1) {
    thread_local AlignedVector<uint16_t> buf;  // [32, Dp] the step's rows as bf16
    buf.resize(static_cast<size_t>(32 * Dp));
    for (int64_t ks = k0; ks < k1; ++ks) {
      for (int64_t j = 0; j < 32; ++j) {
        const int64_t r = r0 + ks * 32 + j;
        uint16_t* dst = buf.data() + j * Dp;
        if (r >= r1) {
          std::fill(dst, dst + Dp, uint16_t{0});
          continue;
        }
        const int64_t slot = static_cast<int64_t>(blocks[r / c.block_size]) * c.block_size + r % c.block_size;
        latent_row_bf16(c, slot, D, Dp, dst);
      }
      // the step's two K^T row tiles: [2][steps] B tiles, as x's in the AMX matmul
      pack_x_vnni16(buf.data(), 32, 32, Dp, reinterpret_cast<uint32_t*>(span.kt.data() + ks * 2 * steps * kTileElems));
      for (int64_t dp = 0; dp < C / 32; ++dp)
        for (int64_t p = 0; p < 16; ++p) {
          const __m512i a = _mm512_loadu_si512(buf.data() + (2 * p) * Dp + dp * 32);
          const __m512i b = _mm512_loadu_si512(buf.data() + (2 * p + 1) * Dp + dp * 32);
          uint16_t* tiles = span.vt.data() + (ks * dim_tiles + 2 * dp) * kTileElems + p * 32;
          _mm512_storeu_si512(tiles, _mm512_permutex2var_epi16(a, lo_idx, b));
          _mm512_storeu_si512(tiles + kTileElems, _mm512_permutex2var_epi16(a, hi_idx, b));
        }
    }
  });
}

// One sequence's run of query rows ((token, head), token-major) and its softmax state across spans.
struct Run {
  const float* q;    // [rows, D]
  float* out;        // [rows, C]: O accumulated unnormalized between spans, normalized at the end
  float* m;          // [tasks * kTaskRows] running max (scaled scores)
  float* l;          // [tasks * kTaskRows] running sum
  const int32_t* kv_len;  // [tokens]
  int64_t rows, heads;
};

// Leading dimensions of the task's buffers, padded so a tile's 16 rows do not share a few L1 sets
// (rows 2 KiB apart fall into two of the 64 sets).
constexpr int64_t kScoreLd = kChunkRows + 16;  // floats
constexpr int64_t kProbLd = kChunkRows + 32;   // bf16

// The task's working set: packed queries, one pair's scores and probabilities, the O accumulator.
struct TaskScratch {
  AlignedVector<uint16_t> qt;  // [kTaskRows / 16][Dp/32][hi, lo] A tiles
  alignas(64) float s[kPairRows * kScoreLd];
  alignas(64) uint16_t p[kPairRows * kProbLd];
  AlignedVector<float> o;      // [kTaskRows, C + 16]
};

// One pair of row blocks (NQ = 2, or 1 for a run's odd last block) against cache rows
// [c0, c0 + n) of the chunk whose K^T tiles start at kt and V tiles at vt: scores, online softmax,
// O += P . V. qt: the pair's A tiles; len, m, l: its 32 rows'; o: [32][ldo].
template <int NQ>
void pair_chunk(const uint16_t* qt, int64_t steps, const uint16_t* kt, const uint16_t* vt, int64_t dim_tiles,
                int64_t c0, int64_t n, const int32_t* len, float scale, float* m, float* l, float* o, int64_t ldo,
                TaskScratch& w) {
  const int64_t nk = (n + 31) / 32 * 32, C = dim_tiles * kTileRows;
  // S[32][nk] = Q . K^T, 32 cache rows (two C tiles per row block) at a time
  for (int64_t rp = 0; rp < nk / 32; ++rp) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* k0 = kt + 2 * rp * steps * kTileElems;
    const uint16_t* k1 = k0 + steps * kTileElems;
    for (int64_t st = 0; st < steps; ++st) {
      // the queries' bf16 high and low parts against the same K^T tiles; consecutive multiplies go
      // to different accumulators, so none waits on the one before (2 rows: the lows after both
      // blocks' highs)
      const uint16_t* a = qt + 2 * st * kTileElems;
      _tile_loadd(6, k0 + st * kTileElems, 64);
      _tile_loadd(7, k1 + st * kTileElems, 64);
      if constexpr (NQ == 2) {
        const uint16_t* a1 = a + 2 * steps * kTileElems;
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a1, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, a + kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + kTileElems, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);  // tiles 2 and 3 take the low parts; added to 0 and 1 after
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    float* sc = w.s + rp * 32;
    _tile_stored(0, sc, kScoreLd * 4);
    _tile_stored(1, sc + 16, kScoreLd * 4);
    _tile_stored(2, sc + kTileRows * kScoreLd, kScoreLd * 4);
    _tile_stored(3, sc + kTileRows * kScoreLd + 16, kScoreLd * 4);
    if constexpr (NQ == 1) {  // rows 16-31 hold the low parts' products: add them in
      for (int64_t i = 0; i < kTileRows; ++i)
        for (int64_t j = 0; j < 32; j += 16) {
          float* dst = sc + i * kScoreLd + j;
          _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_loadu_ps(dst + kTileRows * kScoreLd)));
        }
    }
  }
  // online softmax per row: probabilities as bf16, O rescaled where the max moved
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < NQ * kTileRows; ++i) {
    const float* srow = w.s + i * kScoreLd;
    uint16_t* prow = w.p + i * kProbLd;
    const int64_t lim = std::clamp<int64_t>(len[i] - c0, 0, n);
    if (lim == 0) {
      std::fill(prow, prow + nk, uint16_t{0});
      continue;
    }
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t v = 0; v * 16 < lim; ++v)
      vmax = _mm512_mask_max_ps(vmax, first_lanes(lim - v * 16), vmax, _mm512_mul_ps(_mm512_loadu_ps(srow + v * 16), vscale));
    const float m_new = std::max(m[i], _mm512_reduce_max_ps(vmax));
    const float corr = m[i] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[i] - m_new);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t v = 0; v < nk / 16; ++v) {
      const __m512 e = vexp(_mm512_fmsub_ps(_mm512_loadu_ps(srow + v * 16), vscale, vm));
      const __m512 pv = _mm512_maskz_mov_ps(first_lanes(lim - v * 16), e);
      vsum = _mm512_add_ps(vsum, pv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + v * 16), (__m256i)_mm512_cvtneps_pbh(pv));
    }
    l[i] = l[i] * corr + _mm512_reduce_add_ps(vsum);
    m[i] = m_new;
    if (corr != 1.0f) {
      float* orow = o + i * ldo;
      const __m512 vc = _mm512_set1_ps(corr);
      for (int64_t d = 0; d < C; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), vc));
    }
  }
  // O[32][C] += P[32][nk] . V[nk][C], two dim tiles per row block at a time
  for (int64_t dp = 0; dp < C / 32; ++dp) {
    float* oc = o + dp * 32;
    _tile_loadd(0, oc, ldo * 4);
    _tile_loadd(1, oc + 16, ldo * 4);
    if constexpr (NQ == 2) {
      _tile_loadd(2, oc + kTileRows * ldo, ldo * 4);
      _tile_loadd(3, oc + kTileRows * ldo + 16, ldo * 4);
    }
    for (int64_t kk = 0; kk < nk / 32; ++kk) {
      const uint16_t* v = vt + (kk * dim_tiles + 2 * dp) * kTileElems;
      _tile_loadd(4, w.p + kk * 32, kProbLd * 2);
      _tile_loadd(6, v, 64);
      _tile_loadd(7, v + kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (NQ == 2) {
        _tile_loadd(5, w.p + kTileRows * kProbLd + kk * 32, kProbLd * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, oc, ldo * 4);
    _tile_stored(1, oc + 16, ldo * 4);
    if constexpr (NQ == 2) {
      _tile_stored(2, oc + kTileRows * ldo, ldo * 4);
      _tile_stored(3, oc + kTileRows * ldo + 16, ldo * 4);
    }
  }
}

// Query rows [kTaskRows g, + kTaskRows) of the run against the span's rows [span0, span_end), each
// row up to its context length. A chunk's K^T and V tiles come from beyond L2 once and serve the
// task's pairs of row blocks in turn from L2.
void task_span(const Run& run, int64_t g, int64_t span0, const PackedSpan& span, int64_t span_end, int64_t D,
               int64_t Dp, int64_t C, float scale, TaskScratch& w) {
  const int64_t r0 = g * kTaskRows, nrows = std::min(kTaskRows, run.rows - r0);
  const int64_t blocks = (nrows + kTileRows - 1) / kTileRows, pairs = (blocks + 1) / 2;
  const int64_t steps = Dp / kTileCols, dim_tiles = C / kTileRows, ldo = C + 16;
  int32_t len[kTaskRows], pair_len[kTaskRows / kPairRows] = {};
  for (int64_t i = 0; i < kTaskRows; ++i) {
    // rows past the run attend to row 0 alone (never masked out entirely); their output is dropped
    len[i] = i < nrows ? run.kv_len[(r0 + i) / run.heads] : 1;
    pair_len[i / kPairRows] = std::max(pair_len[i / kPairRows], len[i]);
  }
  const int64_t task_len = *std::max_element(pair_len, pair_len + pairs);
  if (task_len <= span0) return;  // its contexts all ended in an earlier span: done
  const int64_t end = std::min<int64_t>(span_end, task_len);
  float* m = run.m + r0;
  float* l = run.l + r0;
  float* o = w.o.data();  // [kTaskRows][ldo]
  // queries as A tiles, each split into bf16 high and low parts (the scores as accurate as the
  // cache's bf16 allows: exp() turns a score's absolute error into the probability's relative one,
  // and rounding the queries alone flipped top-1 tokens of the sensitive golden fixtures):
  // [block][step][hi, lo][16 rows][32 dims], rows past the run and dims past D zero
  for (int64_t row = 0; row < blocks * kTileRows; ++row) {
    const float* src = run.q + (r0 + row) * D;
    uint16_t* dst = w.qt.data() + (row / kTileRows * steps * 2) * kTileElems + row % kTileRows * kTileCols;
    for (int64_t st = 0; st < steps; ++st) {
      const int64_t d = st * kTileCols;
      __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
      if (row < nrows) {
        lo = _mm512_maskz_loadu_ps(first_lanes(D - d), src + d);
        hi = _mm512_maskz_loadu_ps(first_lanes(D - d - 16), src + d + 16);
      }
      __m512i big, small;
      split_bf16x32(lo, hi, big, small);
      _mm512_storeu_si512(dst + 2 * st * kTileElems, big);
      _mm512_storeu_si512(dst + (2 * st + 1) * kTileElems, small);
    }
  }
  for (int64_t i = 0; i < kTaskRows; ++i) {
    float* orow = o + i * ldo;
    if (span0 == 0 || i >= nrows) std::fill(orow, orow + C, 0.0f);
    else std::memcpy(orow, run.out + (r0 + i) * C, sizeof(float) * C);
  }
  if (span0 == 0) {
    std::fill(m, m + kTaskRows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + kTaskRows, 0.0f);
  }

  for (int64_t c0 = span0; c0 < end; c0 += kChunkRows) {
    const int64_t n = std::min(kChunkRows, end - c0);
    const uint16_t* kt = span.kt.data() + (c0 - span0) / kTileRows * steps * kTileElems;
    const uint16_t* vt = span.vt.data() + (c0 - span0) / 32 * dim_tiles * kTileElems;
    for (int64_t pr = 0; pr < pairs; ++pr) {
      if (pair_len[pr] <= c0) continue;  // a causal prompt's earlier rows end before its later ones
      const int64_t b = 2 * pr, rows0 = b * kTileRows, pn = std::min<int64_t>(n, pair_len[pr] - c0);
      const uint16_t* qt = w.qt.data() + b * 2 * steps * kTileElems;
      if (b + 1 < blocks)
        pair_chunk<2>(qt, steps, kt, vt, dim_tiles, c0, pn, len + rows0, scale, m + rows0, l + rows0,
                      o + rows0 * ldo, ldo, w);
      else
        pair_chunk<1>(qt, steps, kt, vt, dim_tiles, c0, pn, len + rows0, scale, m + rows0, l + rows0,
                      o + rows0 * ldo, ldo, w);
    }
  }
  // the last span this task reads: normalize; else keep O unnormalized for the next span
  const bool last = end >= task_len;
  for (int64_t i = 0; i < nrows; ++i) {
    float* dst = run.out + (r0 + i) * C;
    const float* src = o + i * ldo;
    const __m512 inv = _mm512_set1_ps(last ? 1.0f / l[i] : 1.0f);
    for (int64_t d = 0; d < C; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(src + d), inv));
  }
}

// Tokens [t0, t1) of args, all of one sequence.
void run_amx(const MlaAttentionArgs& a, int64_t t0, int64_t t1) {
  const int64_t H = a.num_heads, C = a.kv_lora, D = C + a.rope_dim, Dp = (D + 31) / 32 * 32;
  const int64_t rows = (t1 - t0) * H, tasks = (rows + kTaskRows - 1) / kTaskRows;
  const int32_t* blocks = a.block_tables + static_cast<int64_t>(a.token_seq[t0]) * a.max_blocks_per_seq;
  int64_t context = 0;
  for (int64_t t = t0; t < t1; ++t) {
    MOAT_CHECK(a.kv_len[t] >= 1 && a.kv_len[t] <= a.max_blocks_per_seq * a.cache.block_size,
               "kv_len {} outside [1, {} blocks of {}]", a.kv_len[t], a.max_blocks_per_seq, a.cache.block_size);
    context = std::max<int64_t>(context, a.kv_len[t]);
  }
  thread_local AlignedVector<float> state;  // m and l, [tasks * kTaskRows] each
  state.resize(static_cast<size_t>(2 * tasks * kTaskRows));
  const Run run{a.q + t0 * H * D, a.out + t0 * H * C, state.data(), state.data() + tasks * kTaskRows,
                a.kv_len + t0, rows, H};
  thread_local PackedSpan span_storage;
  PackedSpan& span = span_storage;  // the caller's: a thread_local named in the lambda would be each worker's own
  const int64_t threads = thread_pool().num_threads();
  for (int64_t span0 = 0; span0 < context; span0 += kSpanRows) {
    const int64_t span_end = std::min(context, span0 + kSpanRows);
    pack_span(a.cache, blocks, span0, span_end, D, Dp, C, span);
    // Threads take tasks round-robin: a causal prompt's later rows read longer contexts, and
    // every thread gets early and late ones alike.
    thread_pool().parallel_for(threads, [&](int64_t i0, int64_t i1) {
      amx::TileScope tiles;
      thread_local TaskScratch w;
      w.qt.resize(static_cast<size_t>(2 * kTaskRows * Dp));
      w.o.resize(static_cast<size_t>(kTaskRows * (C + 16)));
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = i; g < tasks; g += threads) task_span(run, g, span0, span, span_end, D, Dp, C, a.scale, w);
    });
  }
}

}  // namespace

void mla_attention_amx(const MlaAttentionArgs& a) {
  const int64_t H = a.num_heads, C = a.kv_lora, D = C + a.rope_dim, T = a.num_tokens;
  if (a.exact || C % 32 != 0) {  // the tiles take the output 32 dims at a time
    cpu_avx512::mla_attention(a);
    return;
  }
  // Runs of one sequence's consecutive tokens long enough for the tiles; the tokens between them
  // (decode tokens of a mixed batch) go to the decode kernel in one call per stretch.
  auto decode_tokens = [&](int64_t t0, int64_t t1) {
    if (t0 >= t1) return;
    MlaAttentionArgs sub = a;
    sub.q = a.q + t0 * H * D;
    sub.out = a.out + t0 * H * C;
    sub.token_seq = a.token_seq + t0;
    sub.kv_len = a.kv_len + t0;
    sub.num_tokens = t1 - t0;
    mla_attention_bf16(sub);
  };
  int64_t short_from = 0;
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    while (e < T && a.token_seq[e] == a.token_seq[t]) ++e;
    if ((e - t) * H >= kMinRunRows) {
      decode_tokens(short_from, t);
      run_amx(a, t, e);
      short_from = e;
    }
    t = e;
  }
  decode_tokens(short_from, T);
}

}  // namespace moat::ops::cpu_avx512bf16

#pragma GCC pop_options
