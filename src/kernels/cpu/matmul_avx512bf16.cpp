// The CPU matmul for machines with AVX-512 BF16 (Zen4, Sapphire Rapids and later): the kernel that
// decode time is made of. y[T, N] = x[T, K] . W[N, K]^T for W in bf16, f16, fp8 e4m3 with block
// scales, or MXFP4 / INT4_G32 (4-bit codes, a scale per 32 elements: decoded in registers for
// decode-sized calls, against x quantized to int16 per 32 elements by default (tile_q4_i16) or
// split into bf16 hi + lo in exact mode (tile_q4_split); dequantized to bf16 panels for longer
// calls).
//
// - The fp32 activations are converted to bf16 once per call (x_bf16: [T, Kp], Kp = K rounded up
//   to 64, zero padded; calls on packed panels round them straight into the panels' token-tile
//   layout instead, pack_x_f32), so the inner loop is vdpbf16ps (fp32 accumulate): normalized
//   error ~4e-3, as llama.cpp and GPU engines run. Calls of at most MatmulPrecision::split_max_tokens (0 by
//   default; every call in exact mode) split x into bf16 hi + lo instead and each weight vector
//   takes two dot products: as accurate as fp32 FMAs, at half the dot-product rate, and not free
//   even in decode (kernel_types.h has the measurement).
// - W streams from memory exactly once per call. Decode-sized calls (T <= 12 tokens for bf16, 16 for
//   fp8 and 4-bit; fp8 and 4-bit weights also in exact mode): each task splits its rows into 4
//   lanes and reads one row of each lane side by side (lane_tiles: 4 long sequential streams);
//   bf16 calls of 5-12 tokens run groups of up to 8 tokens in one pass each (kWideTiles, 3 or 4
//   lanes); fp8 calls of 3-16 tokens scale x by each row block's scales and decode every code once
//   per group of up to 4 tokens (tile_fp8_wide). fp8 calls of 17-64 tokens dequantize chunks of
//   rows to bf16 once and run the bf16 tiles on them.
//   Exact-mode prefill: each task owns a range of 4-row groups, walks it in chunks of rows that
//   stay in L2 (~128 KiB), and runs every token against a chunk before the next; the microkernel
//   (tile_bf16) keeps 4 rows x up to 4 tokens of dot-product accumulators in registers. Longer calls that round x to bf16 (batched
//   decode and prefill) repack 64 weight rows x 256 columns at a time into column pairs
//   (pack_panel, 32 KiB in L1) and run outer products over them (tile_packed: 64 rows x 6 tokens,
//   no horizontal sums). Measured against the 4x4 dot-product tiles it replaced there (Zen 5, one
//   run each, best of 2, machine shared with builds: load ~5 on 2 cores, so 1-thread rows are
//   the trustworthy ones; bf16 peak probe ~326 GFLOPS at 1 thread in that run): bf16 T = 64
//   x1.34-1.52 (53-65% -> 81-93% of the peak), T = 16 x1.15-1.22, T = 8 x0.96-1.37 (the repack
//   costs about as much as the dot products there); T = 512 2048x2048: ~90% of the probe in the
//   same process. At 2 threads kernel_bench's mean times read 0.6-1.0x while a best-of-N driver
//   read 1.2-2x: inconclusive under that load. engine_bench, 64 streams: ITL p50 1248 -> 1160 ms.
// - fp8 weights round x to bf16 (W8A16, as GPU engines serve fp8 checkpoints), because here the
//   split does not come free: decoding 64 e4m3 codes (two vpermt2b byte-table lookups, exact) plus
//   four dot products instead of two makes the decode GEMV compute-bound at ~65% of the memory
//   bandwidth on a Sapphire Rapids core, against ~85-90% with two. The error this adds (2^-9
//   relative per activation) is 1/32 of the weights' own e4m3 rounding (2^-4).
//   MatmulPrecision::fp8_split restores the split (fp32-accurate on the dequantized weights).
//   Decode (T <= 2, and exact mode) decodes weights in registers and multiplies each 128x128
//   block's scale into its fp32 partial sum; batched decode (T = 3-16) folds the scale into x
//   instead (bf16(x * scale) per block of rows); prefill (and f16 always) dequantizes a chunk of
//   rows once to bf16 (scale folded in, one more bf16 rounding) and reuses it for every token.
// Compiled with a per-region target pragma (no global -march); usable only where the CPU has
// AVX-512 BF16, VBMI and VNNI (Constraints::cpu_isa "avx512bf16": Zen4, Sapphire Rapids and later).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "base/aligned_vector.h"
#include "base/check.h"
#include "base/thread_pool.h"
#include "kernels/cpu/amx_tiles.h"
#include "kernels/cpu/cpu_kernels.h"

// GCC 12's _mm512_reduce_add_ps starts from an _mm512_undefined value: a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx512vnni,fma,bmi2")
#include "kernels/cpu/avx512_helpers.h"

namespace moat::ops::cpu_avx512bf16 {
namespace {
using avx512::pack_x_vnni16;
using avx512::transpose16;

constexpr int64_t kChunkBytes = 128 * 1024;  // weight rows kept in L2 while tokens sweep them
// 4-bit weights run calls of up to this many tokens on the register-decoding tiles (token pairs
// share a decoded block), longer ones on dequantized bf16 panels: measured on Zen 5 (1 thread,
// 3072 x 3584 MXFP4, a loaded machine) the tiles ran 190-210 GFLOPS from T = 5 to 16 against
// 77-180 for the panels, which win from T ~ 24 (250-300 GFLOPS at T = 32-64).
constexpr int64_t kQ4DirectMaxTokens = 16;
// fp8 and bf16 calls of up to this many tokens run without packed panels: on the decode tiles (rows
// in lanes, each weight streamed from memory once; token groups re-read a tile's rows from L1/L2)
// or, fp8 past kFp8TileMaxTokens, on dequantized chunks; longer ones on packed panels. Zen 5, 1
// thread, kernel_bench --batched-only, same process (token-pair fp8 tiles then): fp8 on the tiles
// 137-154 GFLOPS at T = 8 against 35 on the panels (which dequantize every weight to bf16 and
// repack it: at T = 8 that costs more than the dot products), 142-158 vs 64 at T = 16, 161-168 vs
// 104 at T = 32, equal at T = 64 (~165). bf16 on the token-quad tiles at T = 8: 1.0-1.3x the
// panels, at T = 16 0.85-1.1x (noise): they stopped at 8 until the wide tiles. Batched decode with
// few streams per expert and speculative verification (k + 1 tokens) are made of these calls.
constexpr int64_t kFp8DirectMaxTokens = 64;
// bf16 since the wide tiles (kWideTokens: two passes at T = 9-16): Zen 5, alternating calls, their
// time over the panels' 0.58-0.79 at T = 10-17 (1 thread, 2048 x 1408), 0.80-0.90 at T = 12-14
// and 0.87-1.06 at 16 (2 threads, the bench model's dense shapes and the lm_head), 1.0-1.36 at
// T = 17-32. Inside the model (engine_bench, 2 threads, alternating runs) the dense matmuls of a
// 12-stream step took 30-32 ms on the tiles against 35 on the panels, but of a 16-stream step
// 43-49 against 40-44: the tiles stop at 12.
constexpr int64_t kBf16DirectMaxTokens = 12;
// Split calls (exact mode) keep their token quads (a wide split tile would not fit the registers)
// and run on the decode tiles to 8 tokens, as before the wide tiles; longer ones block K (run_rows).
constexpr int64_t kBf16SplitDirectMaxTokens = 8;
// Split calls (exact mode) of at least this many tokens run on fp32 FMAs instead: the 512-bit packed
// GEMM of cpu.matmul_avx512fma (fp32-accurate as well, one FMA per weight and token where the split
// takes two dot products of half the width). Zen 5, alternating calls, 1408 x 2048 and 2048 x 2048,
// 1 and 2 threads, fp32 GEMM's time over the split tiles': bf16 0.91-1.08 at T = 24, 0.87-0.89 at
// 32, 0.77-0.99 at 48-64, 0.80 at 512; fp8 (whose split tiles decode every code per token pair)
// 1.31 at T = 2, 0.87-1.37 at 4, 0.82-0.84 at 8, 0.26 at 512; MXFP4 / INT4 1.35-1.40 at 16, 1.02-1.10
// at 24, 0.90-0.98 at 32, 0.57 at 512. AMX has no split: exact mode ran these on the split tiles too.
int64_t exact_fp32_min_tokens(DType dtype) {
  return dtype == DType::F8_E4M3 ? 8 : dtype == DType::BF16 ? 25 : 32;
}
// Within kFp8DirectMaxTokens, fp8 calls of up to this many tokens decode the codes in registers
// (tile_fp8 to 2 tokens, tile_fp8_wide from 3: a decode per group of up to 4 tokens); longer ones
// dequantize a chunk of rows to bf16 once and run the bf16 dot-product tiles over it (run_rows).
// When the tiles still decoded per token pair the chunks won from ~12 tokens (Zen 5, chunks' time /
// tiles' 0.96-1.1 at 12, 0.83-1.02 at 16, 0.60-0.75 at 64). tile_fp8_wide against the chunks, same
// machine, alternating runs, 2048 x 1408, 1408 x 2048, 3072 x 2048 (and 2048 x 10944 at 16), 1 and
// 2 threads: T = 16 0.60-1.03 of their time, T = 24 0.91-0.93 (2048 x 1408 alone), T = 32
// 0.95-1.07, T = 64 0.82-1.12: the tiles to 16. The chunks lose to the panels from T ~ 80
// (1.03-1.13x their time at T = 80-128).
constexpr int64_t kFp8TileMaxTokens = 16;
// f16 weights are dequantized to bf16 chunks at every T; calls of more tokens run on packed panels.
constexpr int64_t kF16DirectMaxTokens = 4;
// With AMX the panels multiply at tile rate and win from fewer tokens. Crossovers measured on a
// 2-core Intel Xeon VM with AMX (Granite Rapids-class, 480 MiB L3), 2048 x 2048, the decode tiles
// against AMX panels at T = 2..64, 1 and 2 threads, best of 5: bf16 0.97-1.04x at T = 6, 1.2-1.4x
// at 8, 2.2x at 12; fp8 (whose panels dequantize every weight first) 0.98-0.99x at 12, 1.3x at 16;
// MXFP4 0.92-0.96x at 6, 1.23-1.26x at 8. At T = 64 the panels ran 4.2-5.2x the tiles.
// 4-bit with the int16-activation tiles (same VM, 3072 x 3584, best of 3, tiles' time / AMX's):
// MXFP4 0.66-0.68 at T = 7, 0.69-0.73 at 8, 0.85-0.89 at 10, 1.01-1.08 at 12, 1.36-1.41 at 16 (1 and
// 2 threads); INT4 0.66 / 0.81 / 0.95 / 1.29 at 7 / 10 / 12 / 16. fp8 again after its panels'
// dequantization got faster (table decode, codes prefetched; 1408 x 2048, 1 and 2 threads, tiles'
// time / panels'): 0.86 at T = 6, 1.04-1.06 at 7, 1.14-1.15 at 8, 1.40-1.42 at 10.
// Again on an Emerald Rapids-class Xeon VM (2026-12-05, 300 MiB L3, ~14 GB/s a core; decode tiles
// and AMX calls alternating in one process, weights from memory, median of 11, tiles' time /
// AMX's; bf16 on the strips below, fp8 on the panels): bf16 T = 5 0.97-1.03 (1 thread), 1.10 (2),
// T = 6 1.22-1.23 (1), 1.02-1.20 (2), T = 7 1.28 / 1.41; fp8 (1408 x 2048, 2048 x 1408) T = 7
// 1.00 / 0.85, T = 8 0.89-0.90 / 0.92-0.98, T = 9 1.26 / 1.05, T = 10 1.21-1.38 / 1.20-1.29
// (1 / 2 threads): bf16's tiles keep T <= 5 and fp8's T <= 8. MXFP4 against its strips (below;
// 1408 x 2048 and 2048 x 1408, median of 9, AMX's rate / the tiles'): T = 7 1.04 / 0.83, T = 8
// 1.27 / 1.02, T = 9 1.29 / 1.30, T = 10-12 1.0-1.6. The 4-bit tiles keep T <= 11 all the same:
// their int16 activations are the accuracy decode-sized calls promise on every kernel
// (quant_matmul_test.cpp, kInt16Tokens), and AMX would round x to bf16.
constexpr int64_t kAmxBf16DirectMaxTokens = 5;
constexpr int64_t kAmxFp8DirectMaxTokens = 8;
constexpr int64_t kAmxQ4DirectMaxTokens = 11;
// On AMX, bf16 and fp8 calls past the decode tiles run on strips of W as the A operand
// (matmul_amx_strips), not on packed panels: a panel transposes every weight into the B layout per
// call, a strip reads 16 rows as they lie. bf16 calls of up to this many tokens (K % 32 == 0) read
// the strips in place, 16 rows K * 2 bytes apart; longer ones, fp8 at every T and bf16 with a
// ragged K stage each strip first (copied, or dequantized, into bf16 rows 4160 bytes apart at K =
// 2048, so a tile's rows spread over the L1 sets) and run two strips against two token blocks at
// a time, every loaded tile feeding two multiplies. Emerald Rapids-class VM (2026-12-05), weights
// from memory, variants alternating in one process, median of 7-11, 1 / 2 threads, results
// bitwise equal: bf16 in place against the panels (1408 x 2048 unless said) T = 32 1.85 / 1.66,
// T = 48 2.16 / 1.41, T = 64 1.71 / 1.45, T = 96 1.41, T = 128 1.28 / 1.25, T = 256 1.47 / 1.03;
// staged against in place T = 32-96 0.68-0.88, T = 128-256 0.90-0.98 / 0.97-1.03, T = 512
// (2048 x 10944, 2048 x 2048) 1.26-1.33 / 1.21-1.33. fp8 staged against the panels (which
// dequantize and then transpose): T = 10 (2048 x 2048) 1.19 / 1.39, T = 16-64 1.0-1.5, T = 128
// 1.44 / 1.26, T = 256 1.47 / 1.34, T = 512 1.20-1.23 / 1.32-1.36, T = 2048 1.45 / 1.95. The
// panels remain AMX's path for f16 weights.
constexpr int64_t kAmxStripMaxTokens = 256;
// 4-bit calls of up to this many tokens run on staged strips too (rows dequantized in the panels'
// column order, x permuted to match), longer ones on the panels. MXFP4, same VM, strips' rate /
// panels' (1 / 2 threads, 1408 x 2048 unless said): T = 12 1.61 / 1.46, T = 16 1.24, T = 48 1.30, T = 64 1.16 / 1.56,
// T = 128 1.14, T = 256 1.14 / 0.90, T = 512 0.89-1.08 / 1.31 (best of 3: 0.98).
constexpr int64_t kAmxQ4StripMaxTokens = 128;
// Narrow bf16 matrices: at most this many columns (a strip <= 8 KiB, rows sharing 4 KiB pages).
// Their strips prefetch the next strip into L1 while they compute: the hardware prefetcher did not
// follow their row-interleaved reads. Xeon VM, 1 thread, 2048 x 256, T = 1-3: 103-129 -> 81-87 us from memory,
// 384 x 256 in L3 11 -> 8 us; at K = 1024-2048 the same prefetches cost 15-60% (each row is its
// own stream there, which the hardware follows), into L2 as well.
constexpr int64_t kAmxNarrowMaxK = 256;
// Wider strips of rows up to this many columns bring the next strip into L2 while they compute,
// the lines under the columns each step reads, where the matrix is too large to stay in cache.
// The hardware prefetcher follows a strip's 16 rows poorly when rows end mid-page (same VM as the
// crossovers above, from memory, alternating, median of 11, 1 / 2 threads): 2048 x 1408 T = 8
// 1.23x / 1.16x the rate, T = 24 1.47x / 1.53x, T = 40 1.07x / 1.60x; 1408 x 2048 1.00-1.06x /
// 0.90-1.07x, 2048 x 2048 1.01-1.09x / 1.04-1.06x; rows of 21 KiB (K = 10944) lost (0.94x at 2
// threads: long rows are streams the hardware follows), and a 1 MiB matrix in L2 lost ~10%.
constexpr int64_t kAmxStripPrefetchMaxK = 2048;
constexpr int64_t kAmxStripPrefetchMinBytes = 4 << 20;
// Such narrow bf16 matrices leave the decode tiles from 5 tokens. The strips run flat from T = 2 to
// 6 (2048 x 256, 1 thread, us per call: in L3 35-38 against the tiles' 36 / 51 / 52 / 67 / 76 at
// T = 2..6; from memory 76-82 against 63 / 82 / 85 / 80 / 86), but in a model at 2 threads the
// tiles kept T = 3-4 (k3-nano's verification forward, alternating runs, all matmuls: T = 4 0.27-0.28
// ms on the tiles against 0.31-0.33 on strips; 1 thread 0.45 against 0.39; T = 5 strips won at
// both, 0.43 against 0.57 at 1 thread). At K = 512-1024 the tiles won to T = 4-6 from memory, and
// the strips of K >= 1024 (rows a page apart) ran at ~16 GB/s from L3.
constexpr int64_t kAmxBf16NarrowDirectMaxTokens = 4;

inline __mmask32 tail_mask(int64_t n) { return n >= 32 ? ~0u : static_cast<__mmask32>((1u << n) - 1u); }

// x[T, K] fp32 -> xb[T, Kp] bf16 (round to nearest even), zero padded to Kp. With xl, also the
// residual xl = bf16(x - xb): hi + lo carries 16 significant bits, and bf16 x bf16 products are
// exact in vdpbf16ps's fp32 accumulator, so the split costs a second dot product and keeps the
// result as accurate as an fp32 GEMV.
void convert_x(const float* x, int64_t T, int64_t K, int64_t Kp, uint16_t* xb, uint16_t* xl) {
  const __m512i round_bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  // x rounded to bf16 (RNE), as an fp32 value
  auto round_bf16 = [&](__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(round_bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, hi_mask));
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * K;
    for (int64_t k = 0; k < Kp; k += 32) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, K - k));
      const __mmask16 m0 = static_cast<__mmask16>(tail_mask(std::min<int64_t>(n, 16)));
      const __mmask16 m1 = static_cast<__mmask16>(tail_mask(std::max<int64_t>(0, n - 16)));
      const __m512 lo = _mm512_maskz_loadu_ps(m0, xr + k);
      const __m512 hi = _mm512_maskz_loadu_ps(m1, xr + k + 16);
      _mm512_storeu_si512(xb + t * Kp + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      if (xl) {
        const __m512 rlo = _mm512_sub_ps(lo, round_bf16(lo)), rhi = _mm512_sub_ps(hi, round_bf16(hi));
        _mm512_storeu_si512(xl + t * Kp + k, (__m512i)_mm512_cvtne2ps_pbh(rhi, rlo));
      }
    }
  }
}

// fp8 decode for decode-time matmul (T <= 2), where it is the bottleneck: 64 e4m3 codes become
// 64 exact bf16 values in 5 instructions. Two 128-entry byte tables (vpermt2b indexes with the low
// 7 bits, i.e. the magnitude) give the low and high bytes of bf16(|value|); the code's sign bit is
// already bit 7 of the high byte; unpacking lo/hi bytes yields two vectors of 32 bf16, in a
// lane-split order (vector A: k = 16L + 0..7, vector B: k = 16L + 8..15 for 128-bit lane L), so
// the activations are laid out in the same order once per call (permute_x64). Values are exact
// and normal, which vdpbf16ps needs: it treats bf16 denormals as zero.
// At one thread on Zen 5 this decode is what bounds fp8 decode: 4 rows x 64 codes and their 8
// vdpbf16ps from L1 or L2 ran at 52-57 GB/s of codes (the same loop without the decode: 85-89,
// the decode without the dot products: 65), against ~40 GB/s of memory per core, so the two only
// partly overlap (a 1408 x 2048 GEMV from memory: ~35 GB/s). Cheaper-looking decodes measured no
// better there (2026-12-03, same loop): the low byte by shift and mask and the high byte by one
// 64-entry vpermb, 53-54; both bytes by shifts and adds, 33-34; 16-bit words built in place
// without the unpacks (shifts, vpermt2b, ternlog selects), 48-56.
struct Fp8Tables {
  __m512i lo0, lo1, hi0, hi1;  // bytes of bf16(magnitude m): m = 0..63 in *0, 64..127 in *1
};

// Built once (~6 us, a few % of a decode call), shared by the decode tiles and dequantize_rows.
const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables = [] {
    alignas(64) uint8_t lo[128], hi[128];
    for (int m = 0; m < 128; ++m) {
      const uint16_t b = f32_to_bf16(fp8_e4m3_to_f32(static_cast<uint8_t>(m)));
      lo[m] = static_cast<uint8_t>(b & 0xff);
      hi[m] = static_cast<uint8_t>(b >> 8);
    }
    return Fp8Tables{_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi),
                     _mm512_load_si512(hi + 64)};
  }();
  return tables;
}

inline void fp8x64_to_bf16(const uint8_t* p, __mmask64 mask, const Fp8Tables& t, __m512i& a, __m512i& b) {
  const __m512i codes = _mm512_maskz_loadu_epi8(mask, p);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, codes, t.hi1), codes,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // hi | sign
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

inline __mmask64 tail_mask64(int64_t n) { return n >= 64 ? ~0ull : ((1ull << n) - 1ull); }

// permute_x64's two vpermt2w index vectors: the first and second 32 of the lane-split order.
struct LaneSplitOrder {
  __m512i first, second;
};
inline LaneSplitOrder lane_split_order() {
  static const std::array<std::array<uint16_t, 32>, 2> order = [] {
    std::array<std::array<uint16_t, 32>, 2> o{};
    for (int half = 0; half < 2; ++half)
      for (int lane = 0; lane < 4; ++lane)
        for (int i = 0; i < 8; ++i) o[half][lane * 8 + i] = static_cast<uint16_t>(lane * 16 + 8 * half + i);
    return o;
  }();
  return {_mm512_loadu_si512(order[0].data()), _mm512_loadu_si512(order[1].data())};
}
// xb[T, Kp] (natural order, Kp % 64 == 0) -> xp[T, Kp] in fp8x64_to_bf16's lane-split order: per 64
// values, dst[8 L + i] = src[16 L + i] and dst[32 + 8 L + i] = src[16 L + 8 + i] (lane L < 4, i < 8),
// two vpermt2w (every fp8 decode call runs it; the scalar loop it replaces, inlined in matmul_impl,
// was up to 0.6% of an fp8 decode token under perf).
void permute_x64(const uint16_t* xb, int64_t T, int64_t Kp, uint16_t* xp) {
  const LaneSplitOrder order = lane_split_order();
  for (int64_t i = 0; i < T * Kp; i += 64) {
    const __m512i a = _mm512_loadu_si512(xb + i), b = _mm512_loadu_si512(xb + i + 32);
    _mm512_storeu_si512(xp + i, _mm512_permutex2var_epi16(a, order.first, b));
    _mm512_storeu_si512(xp + i + 32, _mm512_permutex2var_epi16(a, order.second, b));
  }
}

// Decode-sized tiles (T <= 4) read their NR rows from NR separate lanes of the task's rows (see
// lane_tiles), so each row of a tile is one long sequential stream: the next row of a lane
// follows the current one in memory. Each stream is prefetched a fixed distance ahead of its
// own read position, straight on into the lane's next row. (The 4 rows of a tile used to be 4
// consecutive rows: then every stream ended after one row, 4-22 KiB, and the prefetchers had to
// find 4 new streams per tile.)
struct Prefetch {
  int64_t l1_bytes, l2_bytes;  // distance ahead of the read position into L1 / L2; 0: none
};
// Issues the L1 and L2 prefetches for NR rows `stride_bytes` apart, `at` the first row's read
// position. always_inline: left out of line, GCC finds the function free of side effects
// (prefetches do not count) and deletes the call (it did, for NR >= 2).
template <int NR>
__attribute__((always_inline)) inline void prefetch_rows(const void* at, int64_t stride_bytes, const Prefetch& pf) {
  const char* p = static_cast<const char*>(at);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    if (pf.l1_bytes > 0) _mm_prefetch(p + r * stride_bytes + pf.l1_bytes, _MM_HINT_T0);
    if (pf.l2_bytes > 0) _mm_prefetch(p + r * stride_bytes + pf.l2_bytes, _MM_HINT_T1);
  }
}
// 2 KiB ahead into L1, nothing into L2. kernel_bench --decode-only on Zen 5 (1 and 2 threads,
// several runs on a noisy VM; % of the bandwidth probe in the same run): bf16 and fp8 T = 1 at
// 85-96% with 2 KiB, 768 B-1 KiB about the same, 4 KiB a few % lower; an L2 prefetch 4-8 KiB
// ahead as well cost 20-35% at 1 thread; without any, fp8 decode fell to ~30% (bf16 and 4-bit
// kept ~75%): its decode work per byte is high enough that the hardware prefetcher falls behind.
inline constexpr Prefetch kDecodePrefetch{2048, 0};

// Rows [begin, end) of one task as decode tiles: `lanes` (4, or 3 for the widest batched tiles)
// lanes of L = (end - begin) / lanes rows read side by side (tile i: rows begin + i + q L, q <
// lanes: 4 long sequential streams), then the rows left over as one tile of consecutive rows.
// The tiles write their sums (they do not add to y) into a staging block rather than y itself:
// tile i of a run of kStageTiles puts token t's sums at stage[t][i][row] (one 16-byte vector per
// token), and every kStageTiles tiles they reach y as whole vectors per lane and token.
// Written straight to y, a lane tile's sums landed in lanes x T lines of y, L rows apart, which the
// weights streaming through L1 evicted before the next tile wrote the next float of each. Zen 5,
// in-process alternating calls, bf16 from memory, 1 thread: T = 1 / 3 / 6 0.94 / 0.96 / 0.90 of the
// time, 2048 x 1408 at T = 8 0.73; 2 threads: T = 4 0.90, the 102400 x 2048 lm_head at T = 4 0.87.
// fn(n0, nr, rs, yp, yn): the tile of rows n0 + r rs, r < nr, whose token t, row r sum goes to
// yp[t * yn + r]. The block (256 B a token) is on the stack up to kMaxStageTokens tokens.
constexpr int64_t kStageTiles = 16;
constexpr int64_t kMaxStageTokens = 16;
template <class Fn>
inline void lane_tiles(int64_t begin, int64_t end, int64_t T, float* y, int64_t N, Fn&& fn, int64_t lanes = 4) {
  const int64_t L = (end - begin) / lanes;
  constexpr int64_t kTokenStride = kStageTiles * 4;
  alignas(64) float stage_block[kMaxStageTokens * kTokenStride];
  thread_local AlignedVector<float> stage_big;  // exact mode's split calls run any T on these tiles
  if (T > kMaxStageTokens) stage_big.resize(static_cast<size_t>(T * kTokenStride));
  float* stage = T > kMaxStageTokens ? stage_big.data() : stage_block;
  // lane q of 16 tiles: stage positions 4 i + q, i < 16, of one token's 64 floats (4 vectors)
  // (indexes 0-7 of each pick the first 8 tiles from two vectors; the rest go unused)
  alignas(64) static constexpr int32_t kPick[4][16] = {
      {0, 4, 8, 12, 16, 20, 24, 28}, {1, 5, 9, 13, 17, 21, 25, 29}, {2, 6, 10, 14, 18, 22, 26, 30},
      {3, 7, 11, 15, 19, 23, 27, 31}};
  for (int64_t i0 = 0; i0 < L; i0 += kStageTiles) {
    const int64_t count = std::min(kStageTiles, L - i0);
    for (int64_t i = 0; i < count; ++i) fn(begin + i0 + i, lanes, L, stage + 4 * i, kTokenStride);
    const __mmask16 m = static_cast<__mmask16>(tail_mask(count));
    for (int64_t t = 0; t < T; ++t) {
      const float* st = stage + t * kTokenStride;
      const __m512 v0 = _mm512_loadu_ps(st), v1 = _mm512_loadu_ps(st + 16), v2 = _mm512_loadu_ps(st + 32),
                   v3 = _mm512_loadu_ps(st + 48);
      for (int64_t q = 0; q < lanes; ++q) {
        const __m512i pick = _mm512_load_si512(kPick[q]);
        const __m512 lo = _mm512_permutex2var_ps(v0, pick, v1), hi = _mm512_permutex2var_ps(v2, pick, v3);
        _mm512_mask_storeu_ps(y + t * N + begin + q * L + i0, m, _mm512_shuffle_f32x4(lo, hi, 0x44));
      }
    }
  }
  if (begin + lanes * L < end) fn(begin + lanes * L, end - begin - lanes * L, int64_t{1}, y + begin + lanes * L, N);
}

// Writes (or adds to) the NR values v[r] at y[r].
template <int NR>
__attribute__((always_inline)) inline void store_rows(const float* v, float* y, bool accumulate) {
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) y[r] = (accumulate ? y[r] : 0.0f) + v[r];
}

// The four horizontal sums of a0..a3 as one vector {sum a0, sum a1, sum a2, sum a3}: 13 shuffles
// and adds instead of four separate reductions (the tile epilogue, once per 4 rows x token).
inline __m256 half(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The epilogue of every dot-product tile (bf16, fp8, 4-bit): y[t * N + r] (+)= the horizontal sum
// of acc[r][t] (a tile's rows are in order in y: lane_tiles hands the tiles of rows from lanes a
// staging block). always_inline, so acc stays in the tile's registers. Every row count sums
// through reduce4, in the same order: which tile a row lands in depends on how a call's rows are
// split (3 lanes of the wide tiles leave 0-2 rows over, depending on the task's range), and a
// group of matrices must equal its separate calls bit for bit (_mm512_reduce_add_ps, which the
// 1-3 row tiles used, adds the lanes in another order).
template <int NR, int NT>
__attribute__((always_inline)) inline void store_tile(const __m512 (&acc)[NR][NT], float* y, int64_t N,
                                                      bool accumulate) {
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    if constexpr (NR == 4) {
      __m128 v = reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]);
      if (accumulate) v = _mm_add_ps(v, _mm_loadu_ps(y + t * N));
      _mm_storeu_ps(y + t * N, v);
    } else {  // 1-3 rows: the first NR sums of one reduce4
      alignas(16) float sums[4];
      _mm_store_ps(sums, reduce4(acc[0][t], acc[NR > 1 ? 1 : 0][t], acc[NR > 2 ? 2 : 0][t], acc[0][t]));
      store_rows<NR>(sums, y + t * N, accumulate);
    }
  }
}

// acc[r][t] over K for NR weight rows (bf16, row stride ws) x NT tokens (xb rows, stride Kp);
// writes y[t * N + r].
// kSplit: x is hi + lo (xb and xb + lo_off), two dot products per weight vector. Decode-sized
// tiles (NT <= 2) sum the lo products in accumulators of their own: with one shared accumulator
// per row the two products are dependent, 2 x ~6 cycles per 32 columns, which capped a 4-row T=1
// tile near 80 GB/s per core, within 2x of one Zen 5 core's DRAM bandwidth; separate, the split
// costs no latency. Wider tiles already have NR x NT >= 12 independent chains, and 2 x NR x NT
// accumulators would not fit the registers there.
// Every loop over r and t carries `#pragma GCC unroll`: only fully unrolled do acc[][] and wv[]
// have constant indices, and only then does GCC keep them in zmm registers. -O3 unrolls them on
// its own, -O2 does not (then every vdpbf16ps loads and stores its accumulator: 2.5-4.5x slower
// on Zen 5). tests/ops/no_spill_test.cpp disassembles these tiles and fails on such code.
template <int NR, int NT, bool kSplit>
void tile_bf16(const uint16_t* w, int64_t ws, const uint16_t* xb, int64_t lo_off, int64_t Kp, int64_t K, float* y,
               int64_t N, bool accumulate, const Prefetch& pf) {
  constexpr bool kLoAcc = kSplit && NT <= 2;
  __m512 acc[NR][NT], lo[NR][kLoAcc ? NT : 1];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t] = lo[r][kLoAcc ? t : 0] = _mm512_setzero_ps();
  // the dot products of one 32-column step against the NR weight vectors wv
  auto step = [&](const __m512i (&wv)[NR], int64_t k) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const __m512i xv = _mm512_loadu_si512(xb + t * Kp + k);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
      if constexpr (kSplit) {
        const __m512i xl = _mm512_loadu_si512(xb + lo_off + t * Kp + k);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          __m512& a = kLoAcc ? lo[r][kLoAcc ? t : 0] : acc[r][t];
          a = _mm512_dpbf16_ps(a, (__m512bh)wv[r], (__m512bh)xl);
        }
      }
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_si512(w + r * ws + k);
    // Decode-sized calls stream the rows from memory (kDecodePrefetch), the tiles of 3-4 tokens
    // too: without prefetches they read 2048 x 1408 .. 102400 x 2048 at 0.82-0.89x the speed at
    // T = 3-4 and 0.80-0.85x at T = 8 (Zen 5, 1 and 2 threads, alternating calls). Prefill's rows
    // sit in L2 already (run_rows passes no prefetch): there they would take load slots.
    prefetch_rows<NR>(w + k, 2 * ws, pf);
    step(wv, k);
  }
  if (k < K) {  // ragged K: masked weight loads (x is zero padded to Kp)
    const __mmask32 m = tail_mask(K - k);
    __m512i wv[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_maskz_loadu_epi16(m, w + r * ws + k);
    step(wv, k);
  }
  if constexpr (kLoAcc) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_add_ps(acc[r][t], lo[r][t]);
  }
  store_tile<NR, NT>(acc, y, N, accumulate);
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, float*, int64_t, bool,
                        const Prefetch&);
template <int NR, bool S>
constexpr TileFn kTileRow[4] = {&tile_bf16<NR, 1, S>, &tile_bf16<NR, 2, S>, &tile_bf16<NR, 3, S>, &tile_bf16<NR, 4, S>};
constexpr const TileFn* kTiles[2][4] = {{kTileRow<1, false>, kTileRow<2, false>, kTileRow<3, false>, kTileRow<4, false>},
                                        {kTileRow<1, true>, kTileRow<2, true>, kTileRow<3, true>, kTileRow<4, true>}};
// Batched decode (x rounded to bf16) runs each group of up to 8 tokens in one pass over the rows:
// 4 rows x 5-6 tokens or 3 rows x 7-8 (20-24 accumulators), instead of token quads that re-read a
// tile's rows from L1 while the memory sat idle. Zen 5, alternating calls, the wide tiles' time
// over the quads': T = 7-8 0.80-0.88 (1 thread), 0.74-0.86 (2 threads; the lm_head 0.79), T = 5-6
// 0.87-1.0 / 0.77-1.0.
constexpr int64_t kWideTokens = 8;
// [nt - 5][nr - 1]; no 4-row tiles of 7-8 tokens (28-32 accumulators would spill)
constexpr TileFn kWideTiles[4][4] = {
    {&tile_bf16<1, 5, false>, &tile_bf16<2, 5, false>, &tile_bf16<3, 5, false>, &tile_bf16<4, 5, false>},
    {&tile_bf16<1, 6, false>, &tile_bf16<2, 6, false>, &tile_bf16<3, 6, false>, &tile_bf16<4, 6, false>},
    {&tile_bf16<1, 7, false>, &tile_bf16<2, 7, false>, &tile_bf16<3, 7, false>, nullptr},
    {&tile_bf16<1, 8, false>, &tile_bf16<2, 8, false>, &tile_bf16<3, 8, false>, nullptr}};
// nr rows (4 only for nt <= 6) x nt <= 8 tokens, x rounded to bf16
inline TileFn wide_tile(int64_t nr, int64_t nt) {
  return nt <= 4 ? kTiles[0][nr - 1][nt - 1] : kWideTiles[nt - 5][nr - 1];
}
// T tokens in balanced groups of at most kWideTokens (T = 10 as 5 + 5): fn(t0, nt) per group.
template <class Fn>
inline void wide_token_groups(int64_t T, Fn&& fn) {
  const int64_t groups = (T + kWideTokens - 1) / kWideTokens;
  for (int64_t g = 0; g < groups; ++g) fn(T * g / groups, T * (g + 1) / groups - T * g / groups);
}
// Rows per wide tile for T tokens: 4, or 3 where a group has 7-8 tokens.
inline int64_t wide_rows(int64_t T) {
  const int64_t groups = (T + kWideTokens - 1) / kWideTokens;
  return (T + groups - 1) / groups <= 6 ? 4 : 3;
}

// All T tokens against `rows` bf16 weight rows (row stride ws); y points at column n0 of row 0.
// lo_off > 0: x is split hi/lo (convert_x), at xb and xb + lo_off. The rows sit in L2 here
// (chunks of rows that every token tile sweeps): no prefetch.
void run_rows(const uint16_t* w, int64_t ws, int64_t rows, const uint16_t* xb, int64_t lo_off, int64_t T, int64_t Kp,
              int64_t K, float* y, int64_t N, bool accumulate) {
  // x rounded to bf16 (fp8's dequantized chunks, f16): groups of up to 8 tokens on the wide tiles,
  // 0.90-0.95x the token quads' time at T = 16-64 (fp8, Zen 5, 1 and 2 threads, alternating calls)
  if (lo_off == 0) {
    const int64_t step_rows = wide_rows(T);
    wide_token_groups(T, [&](int64_t t0, int64_t nt) {
      for (int64_t r0 = 0; r0 < rows; r0 += step_rows) {
        const int64_t nr = std::min<int64_t>(step_rows, rows - r0);
        wide_tile(nr, nt)(w + r0 * ws, ws, xb + t0 * Kp, 0, Kp, K, y + t0 * N + r0, N, accumulate, Prefetch{0, 0});
      }
    });
    return;
  }
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const int64_t nt = std::min<int64_t>(4, T - t0);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      kTiles[lo_off > 0][nr - 1][nt - 1](w + r0 * ws, ws, xb + t0 * Kp, lo_off, Kp, K, y + t0 * N + r0, N,
                                         accumulate, Prefetch{0, 0});
    }
  }
}

// fp8 rows n0 + r rs (r < NR; rs > 1: rows from lanes, lane_tiles) decoded in registers, NT <= 2
// tokens (xp in lane-split order); writes y[t * N + r]. The block scale multiplies each
// block's fp32 partial sum once (looked up per row). Each row is decoded right before
// its dot products, so only one row's two weight vectors are live at a time: NR x NT x 2 (acc
// and tot) + 5 (tables) + 2 x NT (x, twice when split) + 2 + temporaries must fit in 32 zmm
// registers. 4x2 split does not (40+), so matmul runs split pairs of tokens as 2-row tiles.
template <int NR, int NT, bool kSplit>
void tile_fp8(const WeightMatrix& w, int64_t n0, int64_t rs, const uint16_t* xp, int64_t lo_off, int64_t Kp, float* y,
              int64_t N, const Fp8Tables& tables, const Prefetch& pf) {
  static_assert(!(kSplit && NT == 2 && NR > 2), "spills: run split token pairs as 2-row tiles");
  const int64_t K = w.in_features, bi = w.block_in, stride = rs * K;
  const uint8_t* rows = static_cast<const uint8_t*>(w.data) + n0 * K;
  const int64_t sc = w.scale_cols();
  const float* srow[NR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) srow[r] = w.scale_inv + (n0 + r * rs) / w.block_out * sc;
  __m512 tot[NR][NT];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) tot[r][t] = _mm512_setzero_ps();
  for (int64_t kb = 0, block = 0; kb < K; kb += bi, ++block) {
    const int64_t kend = std::min(K, kb + bi);
    // T=1: the b half of each 64-code step goes to accumulators of its own (accb), so a row's
    // dot products form two chains instead of one chain of 2 (4 when split) dependent
    // vdpbf16ps per step; two tokens have 2 x NR chains already and no registers to spare.
    constexpr bool kTwoChains = NT == 1;
    __m512 acc[NR][NT], accb[NR][NT];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) acc[r][t] = accb[r][t] = _mm512_setzero_ps();
    for (int64_t k = kb; k < kend; k += 64) {
      const __mmask64 m = tail_mask64(kend - k);
      prefetch_rows<NR>(rows + k, stride, pf);
      __m512i xa[NT], xb[NT], la[NT], lb[NT];
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) {
        xa[t] = _mm512_loadu_si512(xp + t * Kp + k);
        xb[t] = _mm512_loadu_si512(xp + t * Kp + k + 32);
        if constexpr (kSplit) {
          la[t] = _mm512_loadu_si512(xp + lo_off + t * Kp + k);
          lb[t] = _mm512_loadu_si512(xp + lo_off + t * Kp + k + 32);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        __m512i wa, wb;
        fp8x64_to_bf16(rows + r * stride + k, m, tables, wa, wb);
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t) {
          __m512& b = kTwoChains ? accb[r][t] : acc[r][t];
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wa, (__m512bh)xa[t]);
          b = _mm512_dpbf16_ps(b, (__m512bh)wb, (__m512bh)xb[t]);
          if constexpr (kSplit) {
            acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wa, (__m512bh)la[t]);
            b = _mm512_dpbf16_ps(b, (__m512bh)wb, (__m512bh)lb[t]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(srow[r][block]);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t)
        tot[r][t] = _mm512_fmadd_ps(kTwoChains ? _mm512_add_ps(acc[r][t], accb[r][t]) : acc[r][t], s, tot[r][t]);
    }
  }
  store_tile<NR, NT>(tot, y, N, false);
}

using Fp8TileFn = void (*)(const WeightMatrix&, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t,
                           const Fp8Tables&, const Prefetch&);
template <int NR, bool S>
constexpr Fp8TileFn fp8_pair_tile() {
  if constexpr (S && NR > 2) return nullptr;  // would spill (tile_fp8): matmul runs 2-row tiles
  else return &tile_fp8<NR, 2, S>;
}
template <int NR, bool S>
constexpr Fp8TileFn kFp8Row[2] = {&tile_fp8<NR, 1, S>, fp8_pair_tile<NR, S>()};
constexpr const Fp8TileFn* kFp8Tiles[2][4] = {{kFp8Row<1, false>, kFp8Row<2, false>, kFp8Row<3, false>, kFp8Row<4, false>},
                                              {kFp8Row<1, true>, kFp8Row<2, true>, kFp8Row<3, true>, kFp8Row<4, true>}};

// ---- fp8 batched decode (3-16 tokens): each code decoded once per group of up to 4 tokens ------
//
// tile_fp8 keeps a block's partial sums apart from the running totals (acc and tot) to multiply the
// block scale in once per block and row; at more than two tokens that needs too many registers, so
// those calls ran token pairs that re-decoded every code T / 2 times, and the decode is most of an
// fp8 tile's work (Zen 5, 1 thread, 2048 x 1408: 140-160 GFLOPS flat from T = 4 to 16, the decode's
// rate, against the bf16 wide tiles' 200+ from twice the bytes). Here the scale goes into x
// instead: for each block_out rows of weights, x times that row block's scales (xs[t, k] =
// bf16(x[t, k] * scale[k / block_in]), in the lane-split order), so the accumulators run over all
// of K and each row's 64 codes are decoded once for a group of up to 4 tokens (kFp8WideTokens: why
// not more there). The rounding is the one x already takes (bf16 of the product instead of bf16 of
// x, relative 2^-9), and each row's sums depend only on its row block's xs: grouped calls equal
// their separate calls.
//
// x[T, K] fp32 (row stride K) times one row block's scales (scales[k / block_in]) -> xs[T, Kp] bf16
// in fp8x64_to_bf16's lane-split order (permute_x64's), zero past K.
void scale_x_fp8(const float* x, int64_t T, int64_t K, int64_t Kp, const float* scales, int64_t block_in,
                 uint16_t* xs) {
  const LaneSplitOrder order = lane_split_order();
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * K;
    uint16_t* dst = xs + t * Kp;
    for (int64_t k = 0; k < Kp; k += 64) {
      const __m512 s = _mm512_set1_ps(k < K ? scales[k / block_in] : 0.0f);
      __m512 v[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const auto m = static_cast<__mmask16>(tail_mask(std::clamp<int64_t>(K - k - 16 * j, 0, 16)));
        v[j] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xt + k + 16 * j), s);
      }
      // natural order: a = x[k .. k + 31], b = x[k + 32 .. k + 63] (cvtne2ps: second operand low)
      const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]), b = (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]);
      _mm512_storeu_si512(dst + k, _mm512_permutex2var_epi16(a, order.first, b));
      _mm512_storeu_si512(dst + k + 32, _mm512_permutex2var_epi16(a, order.second, b));
    }
  }
}

// NR fp8 rows (n0 + r rs: `codes` points at row n0's first column of this call, `stride` = the
// rows' distance in bytes) x NT tokens of xs (one row block's scaled x from the same column, row
// stride Kp) over K columns; writes (or with `accumulate` adds to) y[t * N + r] (rows in order:
// lane_tiles stages them). Per 64 columns the NR rows are decoded first (2 NR vectors), then each
// token's two x vectors meet all of them.
template <int NR, int NT>
void tile_fp8_wide(const uint8_t* codes, int64_t stride, int64_t K, const uint16_t* xs, int64_t Kp, float* y,
                   int64_t N, bool accumulate, const Fp8Tables& tables, const Prefetch& pf) {
  __m512 acc[NR][NT];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask64 m) __attribute__((always_inline)) {
    __m512i wa[NR], wb[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) fp8x64_to_bf16(codes + r * stride + k, m, tables, wa[r], wb[r]);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const __m512i xa = _mm512_loadu_si512(xs + t * Kp + k);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wa[r], (__m512bh)xa);
      const __m512i xb = _mm512_loadu_si512(xs + t * Kp + k + 32);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wb[r], (__m512bh)xb);
    }
  };
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    prefetch_rows<NR>(codes + k, stride, pf);
    step(k, ~0ull);
  }
  if (k < K) step(k, tail_mask64(K - k));  // xs is zero past the matrix's K
  store_tile<NR, NT>(acc, y, N, accumulate);
}

using Fp8WideTileFn = void (*)(const uint8_t*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t, bool,
                               const Fp8Tables&, const Prefetch&);
// Tokens per pass: a call's tokens run in balanced groups of at most 4 (T = 7 as 3 + 4), each
// group one pass of 4-row tiles over the rows (4 lanes); a tile's rows stay in L1 between its
// groups, so memory is read once and the codes are decoded once per group. Wider tiles decode
// less but stream fewer rows side by side, and from memory they lost: Zen 5, 1 thread, 2048 x 1408
// from memory, alternating runs, us: T = 6 as one pass of 3-row tiles 193-200 against 164-183 as
// 3 + 3 on 4 rows; T = 8 as 2-row x 8-token tiles 296-346 against 198-228 as 4 + 4 (the same
// tiles from L3: 179 / 156). Two streams per row (each row's halves side by side) did not help
// the 2-row tiles (T = 8: 340 us), nor did prefetch distances of 1-8 KiB.
constexpr int64_t kFp8WideTokens = 4;
// Calls of two or more groups whose scaled x (T x K bf16) is larger than this run the groups over
// K in chunks of columns whose x fits it (each chunk's sums added to the last): a tile's rows of
// codes stay in L1 between its groups only while all of x fits beside them. Zen 5, in-process
// alternating calls, 1408 x 2048 and 3072 x 2048 (x of 24-32 KiB at T = 6-8): 2 threads T = 8
// 1.30-1.35x the rate, T = 6 1.05-1.17x, T = 12 1.09x; 1 thread T = 8 1.34-1.39x in three runs and
// 0.96x in a fourth, T = 5 1.21x; K = 1408 (T = 8) and 10944 (T = 6) unchanged. 4 and 8 KiB did no
// better, and padding x's rows off 4 KiB strides added nothing. Only where K <= kFp8WideChunkMaxK
// and the chunks are at least kFp8WideMinChunk columns: 2048 x 10944 at 2 threads ran T = 6 / 8 /
// 12 at 0.95 / 0.83 / 0.78x the rate chunked, and T = 16 (chunks of 384) at 0.72x; 2048 x 2048 at
// T = 16 0.99x.
constexpr int64_t kFp8WideXBytes = 12 * 1024;
constexpr int64_t kFp8WideChunkMaxK = 4096;
constexpr int64_t kFp8WideMinChunk = 512;
// [nt - 1][nr - 1] (nt = 1 only in theory; T = 5 runs as 2 + 3)
constexpr Fp8WideTileFn kFp8WideTiles[4][4] = {
    {&tile_fp8_wide<1, 1>, &tile_fp8_wide<2, 1>, &tile_fp8_wide<3, 1>, &tile_fp8_wide<4, 1>},
    {&tile_fp8_wide<1, 2>, &tile_fp8_wide<2, 2>, &tile_fp8_wide<3, 2>, &tile_fp8_wide<4, 2>},
    {&tile_fp8_wide<1, 3>, &tile_fp8_wide<2, 3>, &tile_fp8_wide<3, 3>, &tile_fp8_wide<4, 3>},
    {&tile_fp8_wide<1, 4>, &tile_fp8_wide<2, 4>, &tile_fp8_wide<3, 4>, &tile_fp8_wide<4, 4>}};

// ---- 4-bit weights (MXFP4, INT4_G32) decoded in registers: decode-sized calls ------------------
//
// A 128-element block of a row is 64 bytes: 32 little-endian 16-bit words, word j holding the
// codes of elements 4j..4j+3 in its four nibbles (both formats: MXFP4 packs element 2j into the
// low nibble of byte j; INT4's int32 words, 8 codes low nibble first, are the same bytes). Four
// vpermw lookups turn one 64-byte load into four vectors of 32 exact bf16 code values, V_n word j
// = code of element 4j + n: vpermw reads the low 5 bits of each index word, so the 16-entry table
// is stored twice (entries 16..31 = 0..15) and W >> 4n needs no mask. The activations are laid out
// to match once per call (permute_x_q4: X_n word j = x[4j + n]). vdpbf16ps sums word pairs, so
// fp32 lane i holds elements of words 2i and 2i+1: group i / 4 of the block's four 32-element
// groups. The group scales are applied to these fp32 partial sums (lane i times the scale of group
// 4b + i/4), exactly as tile_fp8 applies its block scales: the codes are exact in bf16, and an
// MXFP4 scale of 2^-127 never has to exist as a bf16 subnormal (vdpbf16ps flushes those).
// Per 128 elements and row: 1 load, 3 shifts, 4 vpermw, 1 vpshufb for the scales, then per token
// 8 vdpbf16ps (x split, exact mode: tile_q4_split) or 4 vpdpwssd (x in int16, the default:
// tile_q4_i16) and the scale multiplies: 0.5 byte per weight plus its scale, decoded once.

// The 16 code values as bf16, twice (vpermw index bits 0-4).
__m512i q4_table(DType dtype) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = f32_to_bf16(int4_code_table(dtype)[i & 15]);
  return _mm512_load_si512(t);
}

// xb[rows, Kp] (natural order, zero past K) -> xq[rows, Kq] (Kq = K rounded up to 128) in the
// nibble order of the 4-bit tiles: block b, vector n, word j = x[128b + 4j + n].
void permute_x_q4(const uint16_t* xb, int64_t rows, int64_t Kp, int64_t Kq, uint16_t* xq) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < Kq; b += 128)
      for (int n = 0; n < 4; ++n)
        for (int j = 0; j < 32; ++j) {
          const int64_t k = b + 4 * j + n;
          xq[r * Kq + b + 32 * n + j] = k < Kp ? xb[r * Kp + k] : 0;
        }
}

// The fp32 scales of the four groups of a 128-element block, each in 4 consecutive lanes (the
// lanes vdpbf16ps fills from that group). e8m0: byte s -> bits s << 23 (2^(s-127)), s = 0 ->
// 0x00400000 (2^-127, subnormal); bf16: the bits shifted to an fp32's top half. `bytes` holds the
// four scales (4 or 8 bytes, broadcast to every 32/64-bit lane by the caller).
template <bool kBf16Scale>
inline __m512 q4_block_scales(__m512i bytes) {
  // Lanes 4L..4L+3 are the 128-bit lane L, where vpshufb picks scale L for every dword.
  if constexpr (kBf16Scale) {
    // bf16 L into each dword's high half: bytes {zero, zero, 2L, 2L + 1}
    const __m512i ctrl = _mm512_set_epi32(0x07068080, 0x07068080, 0x07068080, 0x07068080, 0x05048080, 0x05048080,
                                          0x05048080, 0x05048080, 0x03028080, 0x03028080, 0x03028080, 0x03028080,
                                          0x01008080, 0x01008080, 0x01008080, 0x01008080);
    return _mm512_castsi512_ps(_mm512_shuffle_epi8(bytes, ctrl));
  } else {
    // byte L, zero extended: bytes {L, zero, zero, zero}
    const int l0 = static_cast<int>(0x80808000u), l1 = l0 | 1, l2 = l0 | 2, l3 = l0 | 3;
    const __m512i ctrl = _mm512_set_epi32(l3, l3, l3, l3, l2, l2, l2, l2, l1, l1, l1, l1, l0, l0, l0, l0);
    const __m512i s = _mm512_slli_epi32(_mm512_shuffle_epi8(bytes, ctrl), 23);
    return _mm512_castsi512_ps(_mm512_max_epu32(s, _mm512_set1_epi32(0x00400000)));
  }
}

// The 128-bit-lane-repeated pattern q4_block_scales reads, for the four scales at p (masked: the
// last block of a row may have fewer than four groups, and the scale tensor can end right there).
template <bool kBf16Scale>
inline __m512i q4_scale_bytes(const uint8_t* p, int64_t groups) {
  if (groups >= 4) {
    if constexpr (kBf16Scale) {
      int64_t v;
      std::memcpy(&v, p, 8);
      return _mm512_set1_epi64(v);
    } else {
      int32_t v;
      std::memcpy(&v, p, 4);
      return _mm512_set1_epi32(v);
    }
  }
  const __m128i v = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (groups * (kBf16Scale ? 2 : 1))) - 1u), p);
  return kBf16Scale ? _mm512_broadcastq_epi64(v) : _mm512_broadcastd_epi32(v);
}

// One 128-element block of a row (codes: its 64 bytes, masked: m; scales: its `groups` scales):
// v_n word j = the table entry of element 4j + n's code (the bf16 values for tile_q4_split, the
// integers for tile_q4_i16); returns the fp32 scale per lane (q4_block_scales).
template <bool kBf16Scale>
__attribute__((always_inline)) inline __m512 decode_q4_block(const uint8_t* codes, __mmask64 m, const uint8_t* scales,
                                                             int64_t groups, const __m512i& table, __m512i& v0,
                                                             __m512i& v1, __m512i& v2, __m512i& v3) {
  const __m512i wd = _mm512_maskz_loadu_epi8(m, codes);
  v0 = _mm512_permutexvar_epi16(wd, table);
  v1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 4), table);
  v2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 8), table);
  v3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 12), table);
  return q4_block_scales<kBf16Scale>(q4_scale_bytes<kBf16Scale>(scales, groups));
}

// The 128-element blocks of NR 4-bit rows of K codes (rows `stride` bytes apart), in order:
// block(b, byte mask, groups) for each, the rows prefetched ahead of the whole ones; a ragged last
// block (32, 64 or 96 elements) gets its byte mask and group count.
template <int NR, class Block>
__attribute__((always_inline)) inline void for_each_q4_block(int64_t K, const uint8_t* rows, int64_t stride,
                                                             const Prefetch& pf, Block&& block) {
  const int64_t full = K / 128;
  for (int64_t b = 0; b < full; ++b) {
    prefetch_rows<NR>(rows + 64 * b, stride, pf);
    block(b, ~0ull, int64_t{4});
  }
  if (full * 128 < K) block(full, tail_mask64(K / 2 - 64 * full), K / 32 - 4 * full);
}

// Exact mode (x split into bf16 hi + lo): rows n0 + r rs (r < NR; rs > 1: rows from lanes,
// lane_tiles) of a 4-bit matrix x one token (xq: permute_x_q4's layout, row stride Kq, the lo
// halves lo_off later); writes y[r]. kBf16Scale: INT4_G32 (bf16 scales), else MXFP4 (e8m0).
// The default precision runs tile_q4_i16 below.
template <int NR, bool kBf16Scale>
void tile_q4_split(const WeightMatrix& w, int64_t n0, int64_t rs, const uint16_t* xq, int64_t lo_off, int64_t Kq,
                   float* y, int64_t N, const __m512i& table, const Prefetch& pf) {
  constexpr int NT = 1;
  const int64_t K = w.in_features, Kh = K / 2, G = K / 32, sb = kBf16Scale ? 2 : 1;
  const int64_t stride = rs * Kh, scale_stride = rs * G * sb;
  const uint8_t* rows = static_cast<const uint8_t*>(w.data) + n0 * Kh;
  const uint8_t* scales = static_cast<const uint8_t*>(w.group_scales) + n0 * G * sb;
  __m512 tot[NR][NT];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) tot[r][t] = _mm512_setzero_ps();
  // one 128-element block (mask: its bytes; groups: its scales, 4 but in a ragged last block)
  auto block = [&](int64_t b, __mmask64 m, int64_t groups) __attribute__((always_inline)) {
    const int64_t k = 128 * b;
    __m512i xv[NT][4], lv[NT][4];
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
      for (int n = 0; n < 4; ++n) {
        xv[t][n] = _mm512_loadu_si512(xq + t * Kq + k + 32 * n);
        lv[t][n] = _mm512_loadu_si512(xq + lo_off + t * Kq + k + 32 * n);
      }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m512i v0, v1, v2, v3;
      const __m512 s = decode_q4_block<kBf16Scale>(rows + r * stride + 64 * b, m, scales + r * scale_stride + 4 * b * sb,
                                                   groups, table, v0, v1, v2, v3);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) {
        // two chains per token, restarted every block: only tot carries across blocks
        __m512 pa = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)v0, (__m512bh)xv[t][0]);
        __m512 pb = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)v2, (__m512bh)xv[t][2]);
        pa = _mm512_dpbf16_ps(pa, (__m512bh)v1, (__m512bh)xv[t][1]);
        pb = _mm512_dpbf16_ps(pb, (__m512bh)v3, (__m512bh)xv[t][3]);
        pa = _mm512_dpbf16_ps(pa, (__m512bh)v0, (__m512bh)lv[t][0]);
        pb = _mm512_dpbf16_ps(pb, (__m512bh)v2, (__m512bh)lv[t][2]);
        pa = _mm512_dpbf16_ps(pa, (__m512bh)v1, (__m512bh)lv[t][1]);
        pb = _mm512_dpbf16_ps(pb, (__m512bh)v3, (__m512bh)lv[t][3]);
        tot[r][t] = _mm512_fmadd_ps(_mm512_add_ps(pa, pb), s, tot[r][t]);
      }
    }
  };
  for_each_q4_block<NR>(K, rows, stride, pf, block);
  store_tile<NR, NT>(tot, y, N, false);
}

// ---- 4-bit decode with 16-bit integer activations (the default precision) -------------------
//
// vdpbf16ps is a slow instruction on Intel cores: the probe measures it at a quarter of the
// vfmadd231ps rate on the Xeon VM (half the multiply-adds per second), and the four of them per
// 128 codes and row kept the bf16 tile at ~14 GB/s even with the weights in L2, under the memory's ~18.
// vpdpwssd (AVX512-VNNI: 16-bit integer pairs summed into int32) issues at twice its rate there,
// and the codes are small integers: 2 x e2m1 for MXFP4 ({0, 1, 2, 3, 4, 6, 8, 12} and negatives),
// the int4 value itself for INT4_G32. So the activations are quantized once per call to int16
// with one fp32 scale per 32-element group (x ~ q * s, |q| <= 32767): an error of at most s / 2 =
// max|x of the group| / 65534 per element, which is smaller than rounding to bf16 (2^-9 of the
// element) for every element above 1/128 of its group's largest, and immaterial below it; the
// dot product is then exact in int32 (8 products of |12 x 32767| per lane and block) and scaled
// once per block and lane: by x's group scale, then the weights'. The lanes of vpdpwssd line up
// with the groups as vdpbf16ps' did (lane i: words 2i, 2i + 1 = elements 8i + n, 8i + 4 + n of the
// block, group i / 4), so the same code layout, nibble lookups and scale vectors serve both.

// The 16 codes as int16 (2 x e2m1 for MXFP4, whose scale is halved to match), twice (vpermw).
__m512i q4_int_table(DType dtype) {
  alignas(64) int16_t t[32];
  const float multiple = dtype == DType::MXFP4 ? 2.0f : 1.0f;
  for (int i = 0; i < 32; ++i) t[i] = static_cast<int16_t>(int4_code_table(dtype)[i & 15] * multiple);
  return _mm512_load_si512(t);
}

// x[T, K] (fp32) -> xq[T, Kq] int16 in permute_x_q4's nibble order, and xs[T, Kq / 128, 16] fp32:
// lane i of block b holds the scale of group i / 4 (the lanes vpdpwssd sums that group into),
// times `code_scale` (1/2 for MXFP4's doubled codes). Zero past K. Once per call: the 128-element
// blocks are vectorized (a scalar loop cost ~5% of an expert's GEMV), a ragged last block is not.
void quantize_x_q4_i16(const float* x, int64_t T, int64_t K, int64_t Kq, int16_t* xq, float* xs, float code_scale) {
  // below this a group's 32767 / max overflows fp32 (its scale, max / 32767, is then an fp32
  // subnormal with fewer bits: groups of activations under 1e-33 only)
  constexpr float kTinyGroup = 1e-33f;
  // word j of output vector n is natural element 4j + n: j < 16 from words 0-63, j >= 16 from 64-127
  alignas(64) static const auto kIndex = [] {
    std::array<std::array<uint16_t, 32>, 4> idx{};
    for (int n = 0; n < 4; ++n)
      for (int j = 0; j < 32; ++j) idx[n][j] = static_cast<uint16_t>(4 * (j % 16) + n);
    return idx;
  }();
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * K;
    for (int64_t b = 0; b < Kq; b += 128) {
      int16_t* dst = xq + t * Kq + b;
      float* scale_lanes = xs + (t * Kq + b) / 8;
      if (b + 128 <= K) {
        __m512i q[8];
        for (int g = 0; g < 4; ++g) {
          const __m512 lo = _mm512_loadu_ps(xt + b + 32 * g), hi = _mm512_loadu_ps(xt + b + 32 * g + 16);
          const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
          if (m < kTinyGroup && m > 0.0f) {  // 32767 / m would overflow fp32: in double
            alignas(64) int32_t qs[32];
            for (int i = 0; i < 32; ++i) qs[i] = static_cast<int32_t>(std::nearbyint(xt[b + 32 * g + i] * (32767.0 / m)));
            q[2 * g] = _mm512_load_si512(qs);
            q[2 * g + 1] = _mm512_load_si512(qs + 16);
          } else {
            const __m512 inv = _mm512_set1_ps(m > 0.0f ? 32767.0f / m : 0.0f);
            q[2 * g] = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // nearest even, as nearbyint
            q[2 * g + 1] = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
          }
          _mm_storeu_ps(scale_lanes + 4 * g, _mm_set1_ps(m / 32767.0f * code_scale));
        }
        __m512i words[4];  // natural order, 32 int16 each
        for (int i = 0; i < 4; ++i)
          words[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(q[2 * i])),
                                        _mm512_cvtsepi32_epi16(q[2 * i + 1]), 1);
        for (int n = 0; n < 4; ++n) {
          const __m512i idx = _mm512_load_si512(kIndex[n].data());
          const __m512i first = _mm512_permutex2var_epi16(words[0], idx, words[1]);
          const __m512i second = _mm512_permutex2var_epi16(words[2], idx, words[3]);
          _mm512_storeu_si512(dst + 32 * n, _mm512_mask_blend_epi16(0xffff0000u, first, second));
        }
        continue;
      }
      double inv[4];
      for (int g = 0; g < 4; ++g) {
        float m = 0.0f;
        for (int64_t k = b + 32 * g; k < std::min(K, b + 32 * g + 32); ++k) m = std::max(m, std::fabs(xt[k]));
        inv[g] = m > 0.0f ? 32767.0 / m : 0.0;
        for (int l = 0; l < 4; ++l) scale_lanes[4 * g + l] = m / 32767.0f * code_scale;
      }
      for (int n = 0; n < 4; ++n)
        for (int j = 0; j < 32; ++j) {
          const int64_t k = b + 4 * j + n;
          dst[32 * n + j] = k < K ? static_cast<int16_t>(std::nearbyint(xt[k] * inv[(4 * j + n) / 32])) : 0;
        }
    }
  }
}

// tile_q4_split with int16 activations (quantize_x_q4_i16's xq / xs, row stride Kq): per 128 codes and
// row 1 load, 3 shifts, 4 vpermw, the scale vector, then per token 4 vpdpwssd, a conversion and
// two multiplies. Measured and not kept (Xeon VM, MXFP4 T = 1): widening 4 blocks' 16 scales at
// once and spreading them with a permute per block instead of the per-block shuffle, shift and
// max: 19.1-19.3 GB/s from L2 against 19.5, no change from memory.
template <int NR, int NT, bool kBf16Scale>
void tile_q4_i16(const WeightMatrix& w, int64_t n0, int64_t rs, const int16_t* xq, const float* xs, int64_t Kq,
                 float* y, int64_t N, const __m512i& table, const Prefetch& pf) {
  const int64_t K = w.in_features, Kh = K / 2, G = K / 32, sb = kBf16Scale ? 2 : 1;
  const int64_t stride = rs * Kh, scale_stride = rs * G * sb, xs_stride = Kq / 8;
  const uint8_t* rows = static_cast<const uint8_t*>(w.data) + n0 * Kh;
  const uint8_t* scales = static_cast<const uint8_t*>(w.group_scales) + n0 * G * sb;
  __m512 tot[NR][NT];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) tot[r][t] = _mm512_setzero_ps();
  auto block = [&](int64_t b, __mmask64 m, int64_t groups) __attribute__((always_inline)) {
    const int64_t k = 128 * b;
    __m512i xv[NT][4];
    __m512 sx[NT];
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) {
#pragma GCC unroll 4
      for (int n = 0; n < 4; ++n) xv[t][n] = _mm512_loadu_si512(xq + t * Kq + k + 32 * n);
      sx[t] = _mm512_loadu_ps(xs + t * xs_stride + 16 * b);
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m512i v0, v1, v2, v3;
      const __m512 s = decode_q4_block<kBf16Scale>(rows + r * stride + 64 * b, m, scales + r * scale_stride + 4 * b * sb,
                                                   groups, table, v0, v1, v2, v3);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) {
        // one chain per row and token, restarted every block: the rows and the next block's
        // chains overlap it
        __m512i acc = _mm512_dpwssd_epi32(_mm512_setzero_si512(), v0, xv[t][0]);
        acc = _mm512_dpwssd_epi32(acc, v1, xv[t][1]);
        acc = _mm512_dpwssd_epi32(acc, v2, xv[t][2]);
        acc = _mm512_dpwssd_epi32(acc, v3, xv[t][3]);
        // x's scale first: the weights' alone can be 2^-127, and times x's a product with
        // no significant bits left (the e8m0 edge rows of the quant fixture)
        tot[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), sx[t]), s, tot[r][t]);
      }
    }
  };
  for_each_q4_block<NR>(K, rows, stride, pf, block);
  store_tile<NR, NT>(tot, y, N, false);
}

using Q4I16TileFn = void (*)(const WeightMatrix&, int64_t, int64_t, const int16_t*, const float*, int64_t, float*,
                             int64_t, const __m512i&, const Prefetch&);
template <bool B>
constexpr Q4I16TileFn kQ4I16Tiles[4][2] = {{&tile_q4_i16<1, 1, B>, &tile_q4_i16<1, 2, B>},
                                           {&tile_q4_i16<2, 1, B>, &tile_q4_i16<2, 2, B>},
                                           {&tile_q4_i16<3, 1, B>, &tile_q4_i16<3, 2, B>},
                                           {&tile_q4_i16<4, 1, B>, &tile_q4_i16<4, 2, B>}};

using Q4SplitTileFn = void (*)(const WeightMatrix&, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*,
                               int64_t, const __m512i&, const Prefetch&);
// [rows - 1]
template <bool B>
constexpr Q4SplitTileFn kQ4SplitTiles[4] = {&tile_q4_split<1, B>, &tile_q4_split<2, B>, &tile_q4_split<3, B>,
                                            &tile_q4_split<4, B>};

// The batched path (T > 4, x rounded to bf16): rows [n0, n0 + rows) x columns [k0, k0 + width)
// of a 4-bit matrix dequantized to bf16 with the group scale folded in (exact for MXFP4 unless the
// product is a bf16 subnormal; one bf16 rounding for INT4), in the panel order below, into
// dst[rows, width] (row stride ds); k0 and width are multiples of 128. Decoded as in tile_q4_split
// (four vpermw per 128 codes), then per vector V_n its even and its odd words, widened to fp32,
// times the lane's group scale, back to bf16. Panel order of a 128-column block: for n = 0..3,
// 16 values of elements 8i + n, then 16 of elements 8i + 4 + n (i = 0..15): the activations are
// laid out to match (permute_x_q4_panel), and every token reuses the chunk.
void dequantize_q4_panel(const WeightMatrix& w, int64_t n0, int64_t rows, int64_t k0, int64_t width, uint16_t* dst,
                         int64_t ds, const __m512i& table) {
  const int64_t K = w.in_features, Kh = K / 2, G = K / 32;
  const bool bf16_scales = w.group_scale_kind == GroupScaleKind::bf16;
  const __m512i hi_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = static_cast<const uint8_t*>(w.data) + (n0 + r) * Kh;
    const uint8_t* scales = static_cast<const uint8_t*>(w.group_scales) + (n0 + r) * G * (bf16_scales ? 2 : 1);
    uint16_t* out = dst + r * ds - k0;
    for (int64_t k = k0; k < k0 + width; k += 128) {
      if (k >= K) {
        for (int n = 0; n < 4; ++n) _mm512_storeu_si512(out + k + 32 * n, _mm512_setzero_si512());
        continue;
      }
      const int64_t b = k / 128, groups = std::min<int64_t>(4, G - 4 * b);
      // rows are read a chunk at a time, row after row: without this the loads of each new row
      // waited on memory (74% of the function's samples at T = 16)
      _mm_prefetch(reinterpret_cast<const char*>(src + 2 * Kh + 64 * b), _MM_HINT_T0);
      const __m512i wd = _mm512_maskz_loadu_epi8(tail_mask64(Kh - 64 * b), src + 64 * b);
      const __m512 s = bf16_scales ? q4_block_scales<true>(q4_scale_bytes<true>(scales + 8 * b, groups))
                                   : q4_block_scales<false>(q4_scale_bytes<false>(scales + 4 * b, groups));
#pragma GCC unroll 4
      for (int n = 0; n < 4; ++n) {
        const __m512i v = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 4 * n), table);
        const __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), s);
        const __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, hi_half)), s);
        _mm512_storeu_si512(out + k + 32 * n, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
      }
    }
  }
}

// xb[T, Kp] (natural order, zero past K) -> xp[T, Kq] in dequantize_q4_panel's column order.
void permute_x_q4_panel(const uint16_t* xb, int64_t T, int64_t Kp, int64_t Kq, uint16_t* xp) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < Kq; b += 128)
      for (int n = 0; n < 4; ++n)
        for (int i = 0; i < 16; ++i)
          for (int odd = 0; odd < 2; ++odd) {
            const int64_t k = b + 8 * i + 4 * odd + n;
            xp[t * Kq + b + 32 * n + 16 * odd + i] = k < Kp ? xb[t * Kp + k] : 0;
          }
}

// Dequantizes rows [n0, n0 + rows) x columns [k0, k0 + width) of an fp8 or f16 matrix into
// dst[rows, width] bf16 (row stride ds, block scale folded in, zero past K), for prefill where
// every token reuses the chunk. k0 and width are multiples of 64.
inline __m512 bf16x16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Halves of fp8x64_to_bf16's outputs (a: codes {0-7, 16-23} of 32, b: {8-15, 24-31}) times s,
// rounded to bf16 and stored as 32 values in natural order at out.
inline void store_scaled_bf16x32(uint16_t* out, __m256i a, __m256i b, __m512 s) {
  const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(bf16x16_to_f32(b), s), _mm512_mul_ps(bf16x16_to_f32(a), s));
  _mm512_storeu_si512(out, _mm512_shuffle_i64x2(v, v, 0xd8));  // 128-bit lanes [0-7, 16-23, 8-15, 24-31] -> in order
}

void dequantize_rows(const WeightMatrix& w, int64_t n0, int64_t rows, int64_t k0, int64_t width, uint16_t* dst,
                     int64_t ds) {
  const int64_t K = w.in_features;
  if (w.dtype == DType::F16) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      uint16_t* out = dst + r * ds - k0;
      for (int64_t k = k0; k < k0 + width; k += 32) {
        const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(32, K - k));
        const __mmask16 m0 = static_cast<__mmask16>(tail_mask(std::min<int64_t>(cnt, 16)));
        const __mmask16 m1 = static_cast<__mmask16>(tail_mask(std::max<int64_t>(0, cnt - 16)));
        const uint16_t* src = static_cast<const uint16_t*>(w.data) + n * K + k;
        const __m512 lo = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m0, src));
        const __m512 hi = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m1, src + 16));
        _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
    return;
  }
  // fp8: 64 codes to exact bf16 by table (fp8x64_to_bf16, the decode tiles' conversion), widened
  // to fp32, times the block scale, rounded to bf16 once. The block scale is looked up once per
  // block_in columns (block_in % 64 == 0): three 64-bit divisions per 32 weights (row, scale
  // columns, column block) had cost more than the decode, and the arithmetic decode it replaces
  // took twice the instructions. bench-fp8 prefill of 512 tokens (Xeon VM, alternating runs):
  // 182-184 -> 198-209 tok/s at 1 thread, 287-315 -> 328-345 at 2. An L2 prefetch of the next raw
  // block during the tiles gained nothing measurable (+0.5-1%).
  const Fp8Tables& tables = fp8_tables();
  const int64_t scale_cols = w.scale_cols();
  // The codes are read 2 KiB ahead: without it the loads waited on memory (perf: most of the
  // samples on the instruction after them) and a 1408 x 2048 panel call ran at ~2.5 GB/s of
  // weights whatever T. Xeon VM, 1 thread, T = 16 / 64 / 512: 1064 -> 705, 1244 -> 963, 4003 ->
  // 3675 us (256 B ahead: 886, 512: 821, 1 KiB: 751, 4 KiB: 731 at T = 16).
  constexpr int64_t kDequantPrefetchBytes = 2048;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    uint16_t* out = dst + r * ds - k0;
    const uint8_t* src = static_cast<const uint8_t*>(w.data) + n * K;
    const float* scale_row = w.scale_inv + (n / w.block_out) * scale_cols;
    int64_t block_end = k0;  // where the current scale's columns end
    __m512 s = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + width; k += 64) {
      if (k >= block_end && k < K) {  // (columns past K are masked off)
        s = _mm512_set1_ps(scale_row[k / w.block_in]);
        block_end = (k / w.block_in + 1) * w.block_in;
      }
      _mm_prefetch(reinterpret_cast<const char*>(src + k + kDequantPrefetchBytes), _MM_HINT_T0);
      __m512i a, b;  // bf16 of codes {0-7, 16-23, 32-39, 48-55} and {8-15, 24-31, 40-47, 56-63}
      fp8x64_to_bf16(src + k, tail_mask64(std::max<int64_t>(0, K - k)), tables, a, b);
      store_scaled_bf16x32(out + k, _mm512_castsi512_si256(a), _mm512_castsi512_si256(b), s);
      if (k + 32 >= k0 + width) break;  // a width of 32 past the last whole 64
      store_scaled_bf16x32(out + k + 32, _mm512_extracti64x4_epi64(a, 1), _mm512_extracti64x4_epi64(b, 1), s);
    }
  }
}

// ---- batched decode and prefill (T > split threshold): packed weights, outer products --------
//
// The dot-product tiles above keep lanes along k: each 32-column step loads NR weight and NT token
// vectors (64 B each) for NR x NT vdpbf16ps, and a 4x4 tile sweeping a chunk that lives in L2
// needs ~32 B/cycle from it: on Zen 5 that capped T = 512 at ~50% of the bf16 peak. Here lanes run
// along output rows instead: a panel of 64 weight rows is repacked per call into pairs of columns
// ([k/2][64 rows][2], the layout vdpbf16ps multiplies against a broadcast pair of activations), so
// one step loads 4 weight vectors and broadcasts 4 bytes per token: 4 x NT dot products with no
// horizontal sums, and y[t, n0..n0+64) comes out as 4 contiguous vectors. The repack (a 16x16
// dword transpose per 16 rows x 32 columns) is the price, paid once per weight element and per
// call, whatever T; weights stay where the checkpoint mmap put them.
constexpr int kPanelRows = 64;  // 4 zmm of 16 rows: 4 x 6 accumulators + 4 weights + 1 broadcast
constexpr int kTokTile = 6;     // tokens per microkernel (at most; xq rows are padded to 6)
constexpr int64_t kPackCols = 2048;  // f16 / fp8 columns dequantized at once: 64 x 2048 bf16 = 256 KiB, in L2
constexpr int64_t kSubCols = 256;    // columns per microkernel call: 32 KiB of packed panel, in L1

// Token tile i of a call covers tokens [T*i/n, T*(i+1)/n), n = ceil(T/6): balanced, so T = 8 runs
// as 4 + 4 rather than 6 + 2 (a 2-token tile loads 4 weight vectors per 8 dot products).
inline int64_t token_tiles(int64_t T) { return (T + kTokTile - 1) / kTokTile; }
inline int64_t tile_start(int64_t T, int64_t i) { return T * i / token_tiles(T); }

// xb[T, Kp] bf16 -> xq[tiles, Kp/2, 6] bf16 pairs (as uint32), zero past a tile's tokens: a token
// tile's broadcasts for one column pair sit side by side.
void pack_x(const uint16_t* xb, int64_t T, int64_t Kp, uint32_t* xq) {
  const int64_t pairs = Kp / 2, tiles = token_tiles(T);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    uint32_t* dst = xq + tile * pairs * kTokTile;
    const int64_t t0 = tile_start(T, tile), nt = tile_start(T, tile + 1) - t0;
    for (int t = 0; t < kTokTile; ++t) {
      if (t >= nt) {
        for (int64_t j = 0; j < pairs; ++j) dst[j * kTokTile + t] = 0;
        continue;
      }
      const uint32_t* src = reinterpret_cast<const uint32_t*>(xb + (t0 + t) * Kp);
      for (int64_t j = 0; j < pairs; ++j) dst[j * kTokTile + t] = src[j];
    }
  }
}

// x[T, K] fp32 -> xq as pack_x lays it out, in one pass: convert_x's bf16 values (the same RNE
// rounding), without the [T, Kp] bf16 copy in between. Per token tile, 32 columns at a time: each
// token's 16 column pairs (one cvtne2ps), interleaved token by token by 18 permutes (three pairs of
// tokens zipped, then each output vector drawn from the three zips) into 6 x 16 dwords stored
// whole, where convert_x + pack_x made two passes over x and its copy and pack_x stored one dword
// at a time. Token tiles [tile0, tile1) only: calls of many tokens split the tiles across the pool
// (before, the calling thread prepared x alone). Zen 5, in-process alternating calls against
// convert_x + pack_x, weights in L3: 1 thread 0.96-0.99 of the time at T = 16-512; 2 threads, from
// memory, T = 48 / 512 / 64 (2048 x 10944) 0.93 / 0.87 / 0.89.
struct PackXPermutes {
  alignas(64) int32_t zip_lo[16], zip_hi[16];  // (a, b) -> a0 b0 a1 b1 .. a7 b7 / a8 b8 .. a15 b15
  alignas(64) int32_t pair[6][16];  // output v from zips 01 (index < 16) and 23 (index >= 16)
  alignas(64) int32_t third[6][16];  // output v's lanes from zip 45
  __mmask16 third_mask[6];
};
constexpr PackXPermutes make_pack_x_permutes() {
  PackXPermutes p{};
  for (int l = 0; l < 16; ++l) {
    p.zip_lo[l] = l / 2 + (l % 2) * 16;
    p.zip_hi[l] = 8 + l / 2 + (l % 2) * 16;
  }
  for (int v = 0; v < 6; ++v) {
    p.third_mask[v] = 0;
    for (int l = 0; l < 16; ++l) {
      const int e = 16 * v + l, j = e / kTokTile, t = e % kTokTile;  // dword e of 96: pair j, token t
      const int pos = 2 * (j % 8) + t % 2;                           // its place in the zip of t's pair
      p.pair[v][l] = pos + (t / 2 == 1 ? 16 : 0);
      p.third[v][l] = pos;
      if (t / 2 == 2) p.third_mask[v] = static_cast<__mmask16>(p.third_mask[v] | (1u << l));
    }
  }
  return p;
}
constexpr PackXPermutes kPackXPermutes = make_pack_x_permutes();
static_assert(kTokTile == 6, "pack_x_f32 interleaves six tokens");

void pack_x_f32(const float* x, int64_t T, int64_t K, int64_t Kp, uint32_t* xq, int64_t tile0, int64_t tile1) {
  const PackXPermutes& P = kPackXPermutes;
  const __m512i zip_lo = _mm512_load_si512(P.zip_lo), zip_hi = _mm512_load_si512(P.zip_hi);
  const int64_t pairs = Kp / 2;
  for (int64_t tile = tile0; tile < tile1; ++tile) {
    uint32_t* dst = xq + tile * pairs * kTokTile;
    const int64_t t0 = tile_start(T, tile), nt = tile_start(T, tile + 1) - t0;
    for (int64_t k = 0; k < Kp; k += 32) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, K - k));
      const __mmask16 m0 = static_cast<__mmask16>(tail_mask(std::min<int64_t>(n, 16)));
      const __mmask16 m1 = static_cast<__mmask16>(tail_mask(std::max<int64_t>(0, n - 16)));
      __m512i v[kTokTile];  // token t's 16 column pairs [k, k + 32) as bf16 pairs; zero past the tile
#pragma GCC unroll 6
      for (int t = 0; t < kTokTile; ++t) {
        if (t < nt) {
          const float* xr = x + (t0 + t) * K + k;
          v[t] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, xr + 16), _mm512_maskz_loadu_ps(m0, xr));
        } else {
          v[t] = _mm512_setzero_si512();
        }
      }
      __m512i zip[3][2];  // tokens 2i, 2i + 1: pairs 0-7 and 8-15
#pragma GCC unroll 3
      for (int i = 0; i < 3; ++i) {
        zip[i][0] = _mm512_permutex2var_epi32(v[2 * i], zip_lo, v[2 * i + 1]);
        zip[i][1] = _mm512_permutex2var_epi32(v[2 * i], zip_hi, v[2 * i + 1]);
      }
      uint32_t* out = dst + (k / 2) * kTokTile;
#pragma GCC unroll 6
      for (int o = 0; o < kTokTile; ++o) {
        const int h = o / 3;  // outputs 0-2 hold pairs 0-7, 3-5 pairs 8-15
        __m512i r = _mm512_permutex2var_epi32(zip[0][h], _mm512_load_si512(P.pair[o]), zip[1][h]);
        r = _mm512_mask_permutexvar_epi32(r, P.third_mask[o], _mm512_load_si512(P.third[o]), zip[2][h]);
        _mm512_storeu_si512(out + 16 * o, r);
      }
    }
  }
}

// pack_panel for a whole panel (64 rows, every column inside the matrix): unmasked loads through
// four row pointers and three stride registers. The general loop kept 16 row pointers and their
// masks on the stack (reloaded, cmov'd and moved to k registers per row and 32 columns): perf put
// it at 39% of a 16-token call with the weights in L3, the tiles at ~90% of the bf16 peak.
__attribute__((noinline)) void pack_panel_full(const uint16_t* src, int64_t ss, int64_t k0, int64_t width, int64_t Kr,
                                               bool prefetch, uint16_t* wp) {
  const int64_t s1 = ss, s2 = 2 * ss, s3 = 3 * ss;
  for (int v = 0; v < kPanelRows / 16; ++v) {
    const uint16_t* b[4];
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) b[g] = src + (v * 16 + 4 * g) * ss;
    for (int64_t k = k0; k < k0 + width; k += 32) {
      const int64_t ka = k + kSubCols, ahead = ka < Kr ? ka : kPanelRows * ss + ka - Kr;
      __m512i r[16];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const uint16_t* p = b[g] + k;
        if (prefetch) {
          const uint16_t* q = b[g] + ahead;
          _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(q + s1), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(q + s2), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(q + s3), _MM_HINT_T0);
        }
        r[4 * g + 0] = _mm512_loadu_si512(p);
        r[4 * g + 1] = _mm512_loadu_si512(p + s1);
        r[4 * g + 2] = _mm512_loadu_si512(p + s2);
        r[4 * g + 3] = _mm512_loadu_si512(p + s3);
      }
      transpose16(r);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_store_si512(wp + (((k - k0) / 2 + j) * kPanelRows + v * 16) * 2, r[j]);
    }
  }
}

// Rows [0, rows) x columns [k0, k0 + width) of src (bf16, row stride ss, K columns; columns
// past K read as zero) -> wp[width/2][64][2]: the panel layout. Rows past `rows` are zero.
// width % 32 == 0. Called once per kSubCols columns, right before the tiles use them. With
// `prefetch` it issues prefetches kSubCols columns ahead in each row (on into the next panel's
// rows after the last block), in flight while the tiles compute: the AMX panels and the
// dequantized chunks (in L2) take them so; run_panel spreads its own over the tiles instead.
void pack_panel(const uint16_t* src, int64_t ss, int64_t rows, int64_t k0, int64_t width, int64_t K, bool prefetch,
                uint16_t* wp) {
  const int64_t Kr = (K + 63) / 64 * 64;  // where a row's packing ends (the next row's begins)
  if (rows == kPanelRows && k0 + width <= K) {
    pack_panel_full(src, ss, k0, width, Kr, prefetch, wp);
    return;
  }
  for (int v = 0; v < kPanelRows / 16; ++v) {
    const uint16_t* rp[16];  // rows past `rows` read row 0 under a zero mask
    uint32_t live = 0;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const int64_t row = v * 16 + i;
      rp[i] = src + (row < rows ? row : 0) * ss;
      live |= (row < rows ? 1u : 0u) << i;
    }
    for (int64_t k = k0; k < k0 + width; k += 32) {
      const __mmask32 m = tail_mask(std::max<int64_t>(0, K - k));
      const int64_t ka = k + kSubCols, ahead = ka < Kr ? ka : kPanelRows * ss + ka - Kr;
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(rp[i] + ahead), _MM_HINT_T0);
        r[i] = _mm512_maskz_loadu_epi16((live >> i) & 1 ? m : 0, rp[i] + k);
      }
      transpose16(r);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_store_si512(wp + (((k - k0) / 2 + j) * kPanelRows + v * 16) * 2, r[j]);
    }
  }
}

// Cache lines of the weights to bring into L1 while a token tile computes, a few per column pair
// step: `count` lines from `first`, `per_row` consecutive lines per row, rows `stride` bytes apart.
// run_panel hands each tile its share of the next block's lines. Issued in a burst (pack_panel
// prefetching the whole next block, 512 lines, with its loads) most of them did nothing: the
// pack still waited on memory (perf: 47% of a 16-token call from memory, 33% from L3), and a
// pack without them read at 17 against 21 GB/s.
struct LinePrefetch {
  const char* first = nullptr;
  int64_t count = 0, per_step = 0, per_row = 8, stride = 0;
  int64_t in_row = 0;  // the line of its row `first` is
};

// y[t, 0..64) (+)= sum over `pairs` column pairs of wp[j][.][2] . xq[j][t] for NT <= 6 tokens.
// Lanes past the panel's rows are masked off (m[v]: vector v's valid lanes).
template <int NT>
void tile_packed(const uint16_t* wp, const uint32_t* xq, int64_t pairs, float* y, int64_t N, const __mmask16 (&m)[4],
                 bool accumulate, const LinePrefetch& pf) {
  const char* line = pf.first;
  int64_t lines_left = pf.count, in_row = pf.in_row;
  __m512 acc[NT][4];
#pragma GCC unroll 6
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      acc[t][v] = accumulate ? _mm512_maskz_loadu_ps(m[v], y + t * N + 16 * v) : _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* w = wp + j * kPanelRows * 2;
    const __m512i w0 = _mm512_load_si512(w), w1 = _mm512_load_si512(w + 32), w2 = _mm512_load_si512(w + 64),
                  w3 = _mm512_load_si512(w + 96);
    for (int64_t q = 0; q < pf.per_step && lines_left > 0; ++q, --lines_left) {
      _mm_prefetch(line, _MM_HINT_T0);
      line += 64;
      if (++in_row == pf.per_row) {
        in_row = 0;
        line += pf.stride - 64 * pf.per_row;
      }
    }
#pragma GCC unroll 6
    for (int t = 0; t < NT; ++t) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(xq[j * kTokTile + t]));
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], (__m512bh)w0, b);
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], (__m512bh)w1, b);
      acc[t][2] = _mm512_dpbf16_ps(acc[t][2], (__m512bh)w2, b);
      acc[t][3] = _mm512_dpbf16_ps(acc[t][3], (__m512bh)w3, b);
    }
  }
#pragma GCC unroll 6
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(y + t * N + 16 * v, m[v], acc[t][v]);
}

using PackedTileFn = void (*)(const uint16_t*, const uint32_t*, int64_t, float*, int64_t, const __mmask16 (&)[4], bool,
                              const LinePrefetch&);
constexpr PackedTileFn kPackedTiles[kTokTile] = {&tile_packed<1>, &tile_packed<2>, &tile_packed<3>,
                                                 &tile_packed<4>, &tile_packed<5>, &tile_packed<6>};

// Calls of more tokens prefetch in pack_panel's burst after all: their x (T x 256 columns, 24 B a
// column pair per 6 tokens) streams through L1 between the prefetch and the pack and evicts the
// lines. Alternating runs, 1 thread, spread / burst time: 2048 x 10944 0.90-0.95 at T = 64-192,
// 0.97-1.0 at 256, 0.97-1.06 at 512; 1408 x 2048 0.89-0.97 at 64-192, 0.98-1.03 at 256, 1.03-1.04
// at 512.
constexpr int64_t kSpreadPrefetchMaxTokens = 192;

// All T tokens (xq: pack_x) against rows [n0, n0 + rows) of src (bf16, row stride ss, K columns:
// the weights, or a block of them dequantized, whose column 0 is column k0 of the matrix); y
// points at column n0 of token 0. Columns go in blocks of kSubCols, packed (wp: 32 KiB, in L1)
// right before every token tile sweeps them. `from_memory` (src is the weights themselves), at
// most kSpreadPrefetchMaxTokens tokens: the tiles bring the next block's lines (after the last
// block, the next panel's first) into L1 a few per step (LinePrefetch). Zen 5, bf16 from memory, alternating runs, time against
// pack_panel's burst: 2048 x 1408 at 1 thread T = 16 0.85, 32 0.87, 64 0.92; 3072 x 2048 and
// 2048 x 10944 0.81-0.94 at T = 16-64; 2 threads 0.71-0.92 (the lm_head 0.72-0.92).
void run_panel(const uint16_t* src, int64_t ss, int64_t rows, int64_t K, int64_t k0, const uint32_t* xq, int64_t T,
               int64_t Kp, float* y, int64_t N, uint16_t* wp, bool from_memory) {
  __mmask16 m[4];
  for (int v = 0; v < 4; ++v) m[v] = static_cast<__mmask16>(tail_mask(std::clamp<int64_t>(rows - 16 * v, 0, 16)));
  const int64_t tiles = token_tiles(T);
  const bool spread = from_memory && T <= kSpreadPrefetchMaxTokens;
  for (int64_t kc = 0; kc < K; kc += kSubCols) {
    const int64_t width = std::min<int64_t>(kSubCols, (K - kc + 31) / 32 * 32);
    pack_panel(src, ss, rows, kc, width, K, !spread, wp);
    LinePrefetch next;
    if (spread) {  // the next block: this panel's columns [kc + kSubCols, ..) or the next panel's first
      const bool last = kc + kSubCols >= K;
      const int64_t nk = last ? 0 : kc + kSubCols, nw = std::min<int64_t>(kSubCols, K - nk);
      next.first = reinterpret_cast<const char*>(src + (last ? kPanelRows * ss : 0) + nk);
      next.per_row = (nw * 2 + 63) / 64;
      next.stride = ss * 2;
    }
    const int64_t lines = spread ? kPanelRows * next.per_row : 0, steps = width / 2;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t t0 = tile_start(T, tile), nt = tile_start(T, tile + 1) - t0;
      LinePrefetch share;
      if (spread) {  // lines [l0, l1) of the next block, over this tile's steps
        const int64_t l0 = lines * tile / tiles, l1 = lines * (tile + 1) / tiles;
        share = next;
        share.first += (l0 / next.per_row) * next.stride + (l0 % next.per_row) * 64;
        share.in_row = l0 % next.per_row;
        share.count = l1 - l0;
        share.per_step = (share.count + steps - 1) / steps;
      }
      kPackedTiles[nt - 1](wp, xq + (tile * Kp / 2 + (k0 + kc) / 2) * kTokTile, steps, y + t0 * N, N, m,
                           k0 + kc > 0, share);
    }
  }
}

// ---- AMX (Sapphire Rapids and later): the same panels, multiplied by tile instructions ------------
//
// The packed panel wp[k/2][64][2] is already AMX's B operand layout: a B tile (16 rows of 64 bytes)
// is 16 consecutive column pairs of 16 panel rows, rows 256 bytes apart. An A tile is 16 tokens x 32
// columns of x[T, K] bf16, copied once per call into 1 KiB tiles (pack_x_tiles). One tdpbf16ps
// does 16 x 16 x 32 multiply-adds (8192, against 32 for a vdpbf16ps), so prefill becomes bound by
// how fast the panels are packed and the tiles loaded rather than by the dot products.
// Tiles: 0-3 accumulate 16 tokens x 64 panel rows (one C tile per 16 rows), 4 holds A, 5-7 B.
constexpr int kAmxTokens = 16;  // tokens per A / C tile

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
// Rows of weights to bring into L2 while the tiles run (the next chunk's): at tile rate, packing
// a chunk straight from memory left the core waiting on it (perf, bench checkpoint prefill:
// pack_panel 4x the tile loop's samples); spread over the token blocks, the reads overlap the
// multiplies instead.
// Only calls of at least this many 16-token blocks prefetch: with fewer, a chunk's 512 lines go
// out in a burst or two and stall the loads they were meant to speed up. 1408 x 2048 bf16 from
// memory (160 copies, 1 thread, same machine, one run each way): T = 512 +4-12%, 256 +2%, 128
// equal; prefetching at every T cost T = 16 7% and T = 48 13%, and spreading the lines over every
// tile step instead of every block gained nothing at T = 16-48 and lost 12% at T = 128.
constexpr int64_t kAmxPrefetchMinBlocks = 8;
struct AmxPrefetch {
  const char* first = nullptr;  // row 0 of what to prefetch; nullptr: nothing
  int64_t rows = 0, stride_bytes = 0, row_bytes = 0;
};

// One A tile against the panel's four B tiles per step. Tried on the Xeon above (2048 x 2048, T = 512,
// 1 thread, one run each): 2 A x 2 B tiles per step (each tile feeding two multiplies) 766 GFLOPS
// against this scheme's 882, and 512- or 1024-column chunks the same as 256: the A tiles, 2 MiB of
// x re-read for every 64-row panel at T = 512 (twice with 2 x 2), stream from beyond L2, which
// bounds the tile loop rather than the multiplies (17-23% of the AMX peak probe in the kernel table).
// Tried on another Xeon VM (old and new code alternating in one process, 1 thread, bitwise equal
// results): four panels per x chunk (columns outer, panels inner, x's tiles stored chunk by chunk so
// a chunk is one contiguous run, read from beyond L2 once per four panels) ran 1.20-1.25x where x
// is larger than L2 (T = 2048 at K = 2048; T = 512 at K = 10944), even at T = 512, K = 2048, but
// 0.88x at T = 128-256 even with those calls left panel by panel (an A/A run of two copies of this
// file read 0.95x); not kept until that loss is understood. On that VM the tile loads' rate itself
// moved 4-5x from minute to minute (an L1-resident 1 A x 4 B loop: 15 or 70 TSC cycles per
// tdpbf16ps), so only same-process alternation separates such changes.
// acc[Tp/16][16][64] (+)= x columns [kc, kc + width) . panel^T, for every 16-token block. xt is x
// as A tiles (pack_x_tiles), at column 0 of block 0; wp holds the panel's columns [kc, kc + width)
// (width % 32 == 0). The tile intrinsics take only constant tile numbers, hence the spelled-out
// unroll.
__attribute__((noinline)) void amx_panel_tiles(const uint16_t* xt, int64_t Kx, int64_t kc, int64_t width,
                                               int64_t blocks, const uint16_t* wp, float* acc, bool accumulate,
                                               const AmxPrefetch& pf) {
  const int64_t steps = width / 32;
  const int64_t pf_rows = pf.first ? pf.rows : 0, rows_per_block = (pf_rows + blocks - 1) / blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t r = b * rows_per_block; r < std::min(pf_rows, (b + 1) * rows_per_block); ++r)
      for (int64_t off = 0; off < pf.row_bytes; off += 64) _mm_prefetch(pf.first + r * pf.stride_bytes + off, _MM_HINT_T1);
    float* c = acc + b * kAmxTokens * kPanelRows;  // [16 tokens][64 rows] fp32, rows 256 B apart
    if (accumulate) {
      _tile_loadd(0, c, 256);
      _tile_loadd(1, c + 16, 256);
      _tile_loadd(2, c + 32, 256);
      _tile_loadd(3, c + 48, 256);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    const uint16_t* a = xt + (b * Kx + kc) * kAmxTokens;  // block b's tiles, from column kc
    for (int64_t j = 0; j < steps; ++j) {
      const uint16_t* bt = wp + j * 16 * kPanelRows * 2;  // 16 column pairs x 64 rows x 2
      _tile_loadd(4, a + j * kAmxTokens * 32, 64);
      _tile_loadd(5, bt, 256);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, bt + 32, 256);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, bt + 64, 256);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, bt + 96, 256);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, 256);
    _tile_stored(1, c + 16, 256);
    _tile_stored(2, c + 32, 256);
    _tile_stored(3, c + 48, 256);
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
// Short calls, weights as the A operand: a 16-row strip of W straight from where it lies (rows ws
// elements apart: no panel packing, no transpose) against up to 4 token blocks of x (xv:
// pack_x_vnni16, the B layout), C tiles 0-3 = [16 rows][16 tokens]; A alternates between tiles 4
// and 5 and B between 6 and 7, so a step's loads need not wait for the previous step's multiplies.
// acc[g][16][16] receives the sums. From memory (1408 x 2048 bf16, 160 copies, 1 thread, one run
// each, against the panels): T = 8 +36%, 16 +32%, 24 +25%, 32 +24%, 48 +6%, 56-64 even, 128 -25%,
// 512 -43% (more than 4 token blocks re-read each strip, whose rows 4 KiB apart share an L1 set;
// software prefetches of the rows 0.5-4 KiB ahead only cost there). Since the strips write y
// through a register transpose and bring the next strip into L2, they win to T = 256 (the
// measurements at kAmxStripMaxTokens). Calls of up to
// kAmxStripMaxTokens run here: batched decode's experts, speculative verification, prefill's
// routed experts (~48 rows each at 512 tokens x 6 of 64). next: the following strip, to prefetch
// into L1 (narrow matrices only, kAmxNarrowMaxK), or nullptr.
__attribute__((noinline)) void amx_strip_tiles(const uint16_t* wrow, int64_t ws, int64_t steps, const uint32_t* xv,
                                               int64_t Kx, int64_t groups, float* acc, const char* next) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t wstride = ws * 2, block = (Kx / 2) * kAmxTokens;  // uint32 per token block
  for (int64_t s = 0; s < steps; s += 2) {
    const uint32_t* b = xv + s * 16 * kAmxTokens;
    if (next && ws <= kAmxNarrowMaxK) {  // this iteration's share of the next strip's lines, into L1
      const int64_t lines = ws / 2, l0 = s * lines / steps, l1 = std::min<int64_t>(lines, (s + 2) * lines / steps);
      for (int64_t l = l0; l < l1; ++l) _mm_prefetch(next + l * 64, _MM_HINT_T0);
    } else if (next) {  // the next strip's lines under these columns, into L2
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        _mm_prefetch(next + r * wstride + 64 * s, _MM_HINT_T1);
        _mm_prefetch(next + r * wstride + 64 * s + 64, _MM_HINT_T1);
      }
    }
    _tile_loadd(4, wrow + 32 * s, wstride);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (groups > 1) { _tile_loadd(7, b + block, 64); _tile_dpbf16ps(1, 4, 7); }
    if (groups > 2) { _tile_loadd(6, b + 2 * block, 64); _tile_dpbf16ps(2, 4, 6); }
    if (groups > 3) { _tile_loadd(7, b + 3 * block, 64); _tile_dpbf16ps(3, 4, 7); }
    if (s + 1 == steps) break;
    b += 16 * kAmxTokens;
    _tile_loadd(5, wrow + 32 * (s + 1), wstride);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 5, 6);
    if (groups > 1) { _tile_loadd(7, b + block, 64); _tile_dpbf16ps(1, 5, 7); }
    if (groups > 2) { _tile_loadd(6, b + 2 * block, 64); _tile_dpbf16ps(2, 5, 6); }
    if (groups > 3) { _tile_loadd(7, b + 3 * block, 64); _tile_dpbf16ps(3, 5, 7); }
  }
  _tile_stored(0, acc, 64);
  if (groups > 1) _tile_stored(1, acc + 256, 64);
  if (groups > 2) _tile_stored(2, acc + 512, 64);
  if (groups > 3) _tile_stored(3, acc + 768, 64);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
// Rows of weights to bring into L2 while a pair of staged strips computes: the next pair's source
// rows, spread over the steps (staging them had waited on memory between pairs).
struct StripPrefetch {
  const char* first = nullptr;  // nullptr: nothing
  int64_t rows = 0, stride_bytes = 0, row_bytes = 0;
};

// Two strips (32 rows, the second 16 * ws elements after the first) against one or two token
// blocks: C0 / C1 = strip 0 x blocks 0 / 1, C2 / C3 = strip 1 x blocks 0 / 1. Each loaded tile feeds
// two multiplies, where a strip against up to 4 blocks loads 1 + 4 tiles for 4 (and 1 + 2 for 2).
// acc[4][16][16] receives C0-C3 in that order.
__attribute__((noinline)) void amx_strip_pair_tiles(const uint16_t* wrow, int64_t ws, int64_t steps,
                                                    const uint32_t* xv, int64_t Kx, bool two_blocks, float* acc,
                                                    const StripPrefetch& pf) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t wstride = ws * 2, block = (Kx / 2) * kAmxTokens, strip = 16 * ws;
  const int64_t pf_lines = pf.first ? (pf.row_bytes + 63) / 64 : 0;  // per row
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t l = s * pf_lines / steps; l < (s + 1) * pf_lines / steps; ++l)
      for (int64_t r = 0; r < pf.rows; ++r) _mm_prefetch(pf.first + r * pf.stride_bytes + 64 * l, _MM_HINT_T1);
    const uint32_t* b = xv + s * 16 * kAmxTokens;
    _tile_loadd(4, wrow + 32 * s, wstride);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, wrow + strip + 32 * s, wstride);
    _tile_dpbf16ps(2, 5, 6);
    if (two_blocks) {
      _tile_loadd(7, b + block, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 64);
  _tile_stored(2, acc + 512, 64);
  if (two_blocks) {
    _tile_stored(1, acc + 256, 64);
    _tile_stored(3, acc + 768, 64);
  }
}
#pragma GCC pop_options

// 32 columns [k, k + 32) of the fp32 row xr (K columns) as 32 bf16, rounded as convert_x
// rounds, zero past K.
inline __m512i bf16_row32(const float* xr, int64_t k, int64_t K) {
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, K - k));
  const __mmask16 m0 = static_cast<__mmask16>(tail_mask(std::min<int64_t>(n, 16)));
  const __mmask16 m1 = static_cast<__mmask16>(tail_mask(std::max<int64_t>(0, n - 16)));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, xr + k + 16), _mm512_maskz_loadu_ps(m0, xr + k));
}

// fp32 x[T, K] -> xt[Tp/16][Kx/32][16][32] bf16 (pack_x_tiles' A tiles), token blocks [b0, b1);
// tokens past T and columns past K are zero. One pass, split across the pool: convert_x and then
// pack_x_tiles had read and written x twice on the calling thread while the others waited.
void pack_x_tiles_f32(const float* x, int64_t T, int64_t K, int64_t Kx, uint16_t* xt, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t r = 0; r < kAmxTokens; ++r) {
      const int64_t tok = b * kAmxTokens + r;
      uint16_t* dst = xt + (b * (Kx / 32) * kAmxTokens + r) * 32;
      for (int64_t s = 0; s < Kx / 32; ++s)
        _mm512_storeu_si512(dst + s * kAmxTokens * 32,
                            tok < T ? bf16_row32(x + tok * K, 32 * s, K) : _mm512_setzero_si512());
    }
}

// fp32 x[T, K] -> xv[Tp/16][Kx/2][16] (pack_x_vnni16's B tiles), groups [g0, g1) of 16 column
// pairs in every token block; tokens past T and columns past K are zero. One pass, split across
// the pool, as pack_x_tiles_f32.
void pack_x_vnni16_f32(const float* x, int64_t T, int64_t Tp, int64_t K, int64_t Kx, uint32_t* xv, int64_t g0,
                       int64_t g1) {
  for (int64_t b = 0; b < Tp / 16; ++b)
    for (int64_t g = g0; g < g1; ++g) {
      __m512i r[16];  // token t's 16 column pairs, then (transposed) pair j's 16 tokens
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) {
        const int64_t tok = b * 16 + t;
        r[t] = tok < T ? bf16_row32(x + tok * K, 32 * g, K) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* dst = xv + (b * (Kx / 2) + 16 * g) * 16;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + j * 16, r[j]);
    }
}

// y[T, N] = x . W^T on AMX by strips of W as A tiles: x is fp32 [T, K], Tp = T rounded up to 16,
// Kx = K rounded up to 64 (4-bit: to 128, with xq4 = x in bf16 permuted to the dequantized rows'
// column order, permute_x_q4_panel, and q4_codes its decode table); parallel over 16-row strips.
// Staged strips (fp8 and 4-bit always, bf16 with `staged`) are first written as bf16 rows ds apart
// (dequantized, or copied and zero-padded to Kx) and run two at a time (amx_strip_pair_tiles);
// bf16 read in place (K % 32 == 0) runs strip by strip (amx_strip_tiles), each strip's 16 rows
// K * 2 bytes apart.
void matmul_amx_strips(const WeightMatrix& w, const float* x, const uint16_t* xq4, const __m512i& q4_codes, int64_t T,
                       int64_t Tp, int64_t Kx, bool staged, float* y) {
  const int64_t N = w.out_features, K = w.in_features;
  const bool fp8 = w.dtype == DType::F8_E4M3, q4 = w.is_4bit();
  thread_local AlignedVector<uint32_t> xv_buf;  // [Tp/16, Kx/2, 16] (pack_x_vnni16_f32)
  xv_buf.resize(static_cast<size_t>(Tp * Kx / 2));
  uint32_t* const xv_out = xv_buf.data();
  if (q4) {
    pack_x_vnni16(xq4, T, Tp, Kx, xv_out);
  } else {
    thread_pool().parallel_for(Kx / 32, [&](int64_t g0, int64_t g1) {
      pack_x_vnni16_f32(x, T, Tp, K, Kx, xv_out, g0, g1);
    }, grain_for_bytes(static_cast<double>(Tp * 32) * sizeof(float)));
  }
  const uint32_t* xv = xv_buf.data();
  staged = staged || fp8 || q4;
  MOAT_CHECK(staged || K % 32 == 0, "cpu.matmul_amx_bf16: in-place strips need K % 32 == 0, not {}", K);
  // staged rows ds apart: not a multiple of 4 KiB, so a tile's 16 rows spread over the L1 sets
  const int64_t blocks = Tp / kAmxTokens, steps = staged ? Kx / 32 : K / 32, ds = Kx + 32;
  const uint16_t* wb = static_cast<const uint16_t*>(w.data);
  const uint8_t* w8 = static_cast<const uint8_t*>(w.data);
  const int64_t src_row_bytes = q4 ? K / 2 : fp8 ? K : 2 * K;
  const bool strip_prefetch_l2 = !fp8 && K <= kAmxStripPrefetchMaxK && w.bytes() >= kAmxStripPrefetchMinBytes;
  thread_pool().parallel_for((N + 15) / 16, [&](int64_t s0, int64_t s1) {
    amx::TileScope tiles;
    alignas(64) float acc[4 * 256];  // [4 token blocks][16 rows][16 tokens], or the pair's C0-C3
    thread_local AlignedVector<uint16_t> stage;  // [32][ds] bf16: staged rows; [16][K]: a ragged strip in place
    // rows [n0, n0 + rows) as bf16 rows ds apart, zero past K, then zero rows to `padded`
    auto stage_rows = [&](int64_t n0, int64_t rows, int64_t padded) {
      stage.resize(static_cast<size_t>(32 * ds));
      uint16_t* dst = stage.data();
      if (q4) {
        dequantize_q4_panel(w, n0, rows, 0, Kx, dst, ds, q4_codes);
      } else if (fp8) {
        dequantize_rows(w, n0, rows, 0, Kx, dst, ds);
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(dst + r * ds, wb + (n0 + r) * K, sizeof(uint16_t) * K);
          std::fill(dst + r * ds + K, dst + r * ds + Kx, uint16_t{0});
        }
      }
      std::fill(dst + rows * ds, dst + padded * ds, uint16_t{0});
      return static_cast<const uint16_t*>(dst);
    };
    // each block's [16 rows][16 tokens] sums transposed in registers, then token by token 16 rows
    // wide into y (element by element, the scatter had cost ~10% of a 48-token call)
    auto write_block = [&](const float* c, int64_t n0, int64_t rows, int64_t tok0) {
      const __mmask16 row_mask = static_cast<__mmask16>(tail_mask(rows));
      __m512i v[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) v[r] = _mm512_load_si512(c + r * 16);
      transpose16(v);
      const int64_t ntok = std::min<int64_t>(kAmxTokens, T - tok0);
      for (int64_t t = 0; t < ntok; ++t) _mm512_mask_storeu_ps(y + (tok0 + t) * N + n0, row_mask, _mm512_castsi512_ps(v[t]));
    };
    for (int64_t st = s0; st < s1; ++st) {
      const int64_t n0 = st * 16;
      if (staged && st + 1 < s1 && n0 + 32 <= N) {  // two whole strips
        const uint16_t* wrow = stage_rows(n0, 32, 32);
        // the next pair's source rows, into L2 during this pair's first pass over the blocks
        const int64_t next_rows = std::clamp<int64_t>(std::min(s1 * 16, N) - (n0 + 32), 0, 32);
        const StripPrefetch pf{next_rows > 0 ? reinterpret_cast<const char*>(w8 + (n0 + 32) * src_row_bytes) : nullptr,
                               next_rows, src_row_bytes, src_row_bytes};
        for (int64_t b = 0; b < blocks; b += 2) {
          const bool two = b + 1 < blocks;
          amx_strip_pair_tiles(wrow, ds, steps, xv + b * (Kx / 2) * kAmxTokens, Kx, two, acc, b == 0 ? pf : StripPrefetch{});
          write_block(acc, n0, 16, b * kAmxTokens);
          write_block(acc + 512, n0 + 16, 16, b * kAmxTokens);
          if (two) {
            write_block(acc + 256, n0, 16, (b + 1) * kAmxTokens);
            write_block(acc + 768, n0 + 16, 16, (b + 1) * kAmxTokens);
          }
        }
        ++st;
        continue;
      }
      const int64_t rows = std::min<int64_t>(16, N - n0);
      const uint16_t* wrow = wb + n0 * K;
      int64_t ws = K;
      if (staged) {
        wrow = stage_rows(n0, rows, 16);
        ws = ds;
      } else if (rows < 16) {  // in place, K % 32 == 0: the ragged last strip zero padded to 16 rows
        stage.assign(static_cast<size_t>(16 * K), 0);
        std::memcpy(stage.data(), wrow, sizeof(uint16_t) * rows * K);
        wrow = stage.data();
      }
      for (int64_t g0 = 0; g0 < blocks; g0 += 4) {
        const int64_t groups = std::min<int64_t>(4, blocks - g0);
        const bool prefetch_next = !staged && (K <= kAmxNarrowMaxK || strip_prefetch_l2) && g0 == 0 && st + 1 < s1;
        amx_strip_tiles(wrow, ws, steps, xv + g0 * (Kx / 2) * kAmxTokens, Kx, groups, acc,
                        prefetch_next ? reinterpret_cast<const char*>(wb + (n0 + 16) * K) : nullptr);
        for (int64_t g = 0; g < groups; ++g) write_block(acc + g * 256, n0, rows, (g0 + g) * kAmxTokens);
      }
    }
  });
}

// x[Tp, Kx] bf16 (Tp % 16 == 0, Kx % 32 == 0) -> xt[Tp/16][Kx/32][16][32]: each A tile (16 tokens x
// 32 columns) 1 KiB contiguous. Loaded from x itself, a tile's 16 rows lie Kx * 2 bytes apart
// (4 KiB at K = 2048: all in one L1 set) and the multiply waited on them: perf put ~35% of the
// tile loop's samples on the instruction after the A load.
void pack_x_tiles(const uint16_t* x, int64_t Tp, int64_t Kx, uint16_t* xt) {
  for (int64_t b = 0; b < Tp / kAmxTokens; ++b)
    for (int64_t s = 0; s < Kx / 32; ++s)
      for (int64_t r = 0; r < kAmxTokens; ++r)
        _mm512_storeu_si512(xt + ((b * (Kx / 32) + s) * kAmxTokens + r) * 32,
                            _mm512_loadu_si512(x + (b * kAmxTokens + r) * Kx + 32 * s));
}

// run_panel on AMX: xt is x as A tiles (pack_x_tiles, in the panel's column order; Tp = T
// rounded up to 16, the padding rows zero), acc is the task's [Tp, 64] fp32 scratch. The panel's
// rows past `rows` are zero (pack_panel), and only valid tokens and rows reach y.
// next_rows: where the rows after this panel's begin in src (the next panel of a bf16 matrix, to
// prefetch during the last chunk), or nullptr.
void run_panel_amx(const uint16_t* src, int64_t ss, int64_t rows, int64_t K, int64_t k0, const uint16_t* xs,
                   int64_t T, int64_t Kx, float* y, int64_t N, uint16_t* wp, float* acc, bool accumulate_y,
                   const uint16_t* next_rows, int64_t next_count) {
  const int64_t blocks = (T + kAmxTokens - 1) / kAmxTokens;
  for (int64_t kc = 0; kc < K; kc += kSubCols) {
    const int64_t width = std::min<int64_t>(kSubCols, (K - kc + 31) / 32 * 32);
    pack_panel(src, ss, rows, kc, width, K, true, wp);
    AmxPrefetch pf;
    if (blocks < kAmxPrefetchMinBlocks) {
      // nothing: see kAmxPrefetchMinBlocks
    } else if (kc + kSubCols < K) {
      pf = {reinterpret_cast<const char*>(src + kc + kSubCols), rows, ss * 2, 2 * std::min<int64_t>(kSubCols, K - kc - kSubCols)};
    } else if (next_rows) {
      pf = {reinterpret_cast<const char*>(next_rows), next_count, ss * 2, 2 * std::min<int64_t>(kSubCols, K)};
    }
    amx_panel_tiles(xs, Kx, k0 + kc, width, blocks, wp, acc, kc > 0, pf);
  }
  __mmask16 m[4];
  for (int v = 0; v < 4; ++v) m[v] = static_cast<__mmask16>(tail_mask(std::clamp<int64_t>(rows - 16 * v, 0, 16)));
  for (int64_t t = 0; t < T; ++t)
    for (int v = 0; v < 4; ++v) {
      __m512 r = _mm512_loadu_ps(acc + t * kPanelRows + 16 * v);
      if (accumulate_y) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m[v], y + t * N + 16 * v));
      _mm512_mask_storeu_ps(y + t * N + 16 * v, m[v], r);
    }
}

// y_i = x . W_i^T for `count` weights that share x (same dtype and K; count <= kMaxGroup): x is
// prepared once, and decode-sized calls run every matrix's rows in one pool dispatch (one barrier
// instead of count; MatmulGroupFn). Batched calls run the matrices in turn.
void matmul_impl(const float* x, int64_t T, const WeightMatrix* const* ws, float* const* ys, int64_t count,
                 const MatmulPrecision& precision, bool amx) {
  MOAT_CHECK(count >= 1 && count <= kMaxMatmulGroup, "cpu.matmul_avx512bf16: {} weights in one group (1..{})",
             count, kMaxMatmulGroup);
  const WeightMatrix& w = *ws[0];
  float* const y = ys[0];
  const int64_t N = w.out_features, K = w.in_features;
  for (int64_t i = 1; i < count; ++i)
    MOAT_CHECK(ws[i]->dtype == w.dtype && ws[i]->in_features == K,
               "cpu.matmul_avx512bf16: a group's weights share x: {} [{}, {}] next to {} [{}, {}]",
               dtype_name(ws[i]->dtype), ws[i]->out_features, ws[i]->in_features, dtype_name(w.dtype), N, K);
  const int64_t Kp = (K + 63) / 64 * 64;  // x rows padded with zeros to whole 64-blocks
  MOAT_CHECK(w.dtype == DType::BF16 || w.dtype == DType::F16 || w.dtype == DType::F8_E4M3 || w.is_4bit(),
             "cpu.matmul_avx512bf16: weight dtype {}", dtype_name(w.dtype));
  MOAT_CHECK(!w.is_4bit() || (K % 32 == 0 && w.group_scale_kind == (w.dtype == DType::MXFP4 ? GroupScaleKind::e8m0
                                                                                                : GroupScaleKind::bf16)),
             "cpu.matmul_avx512bf16: {} weight [{}, {}] needs K % 32 == 0 and its scale kind", dtype_name(w.dtype), N, K);
  MOAT_CHECK(w.dtype != DType::F8_E4M3 || w.block_in % 64 == 0,
             "cpu.matmul_avx512bf16: fp8 block_in {} must be a multiple of 64", w.block_in);
  // x is split into bf16 hi + lo (as accurate as fp32 FMAs) for calls within the precision's split
  // threshold (none by default, all in exact mode), else rounded to bf16 once. fp8 and 4-bit weights
  // round x to bf16 at every T (W8A16; 4-bit: W4A16 in batched calls, x in int16 in decode-sized
  // ones) unless the precision splits them too.
  const bool fp8 = w.dtype == DType::F8_E4M3, q4 = w.is_4bit();
  const bool split = T <= precision.split_max_tokens && (!(fp8 || q4) || precision.fp8_split);
  // (fp8 scale blocks of a multiple of 16 rows: what the packed GEMM's panels take)
  if (split && w.dtype != DType::F16 && (!fp8 || w.block_out % 16 == 0) && T >= exact_fp32_min_tokens(w.dtype)) {
    cpu_avx2_fma::matmul_group_wide(x, T, ws, ys, count, precision);
    return;
  }
  const int64_t direct_max_tokens = q4    ? kQ4DirectMaxTokens
                                    : fp8 ? kFp8DirectMaxTokens
                                          : (w.dtype == DType::BF16 ? kBf16DirectMaxTokens : kF16DirectMaxTokens);
  const bool narrow_bf16 = w.dtype == DType::BF16 && K <= kAmxNarrowMaxK && K % 32 == 0;
  const int64_t amx_direct_max_tokens = q4                         ? kAmxQ4DirectMaxTokens
                                        : fp8                        ? kAmxFp8DirectMaxTokens
                                        : w.dtype != DType::BF16     ? kF16DirectMaxTokens
                                        : narrow_bf16                ? kAmxBf16NarrowDirectMaxTokens
                                                                     : kAmxBf16DirectMaxTokens;
  const bool panels = !split && T > (amx ? amx_direct_max_tokens : direct_max_tokens);
  if (panels && count > 1) {
    for (int64_t i = 0; i < count; ++i) matmul_impl(x, T, ws + i, ys + i, 1, precision, amx);
    return;
  }
  const bool amx_panels = amx && panels;
  // AMX reads x in whole 16-token tiles: rows up to Tp are allocated and zeroed.
  const int64_t Tp = amx_panels ? (T + kAmxTokens - 1) / kAmxTokens * kAmxTokens : T;
  // fp8 calls of 3 tokens or more on the decode tiles run on tile_fp8_wide: x scaled per row
  // block in the tasks (scale_x_fp8). They and 4-bit decode with int16 activations read x itself,
  // not its bf16 copy.
  const bool fp8_wide = fp8 && !split && !panels && T >= 3 && T <= kFp8TileMaxTokens;
  // bf16 / fp8 / f16 panels pack x straight from fp32 (pack_x_f32; on AMX pack_x_tiles_f32, or
  // pack_x_vnni16_f32 for strips)
  const bool packs_from_f32 = panels && !q4;
  const bool reads_xb = !fp8_wide && !(q4 && !split && !panels) && !packs_from_f32;
  thread_local AlignedVector<uint16_t> xb_buf;  // [T, Kp] hi, then [T, Kp] lo when split ([Tp, Kp] on AMX)
  if (reads_xb) {
    xb_buf.resize(static_cast<size_t>((split ? 2 : 1) * Tp * Kp));
    convert_x(x, T, K, Kp, xb_buf.data(), split ? xb_buf.data() + T * Kp : nullptr);
    if (Tp > T) std::fill(xb_buf.begin() + T * Kp, xb_buf.begin() + Tp * Kp, uint16_t{0});
  }
  const uint16_t* xb = xb_buf.data();
  const int64_t lo_off = split ? T * Kp : 0;
  const int64_t Kq = (K + 127) / 128 * 128;  // 4-bit weights: whole 128-column blocks
  static const __m512i mxfp4_table = q4_table(DType::MXFP4), int4_table = q4_table(DType::INT4_G32);
  const __m512i& q4_codes = w.dtype == DType::INT4_G32 ? int4_table : mxfp4_table;
  if (panels) {
    // batched decode and prefill: packed panels, outer products (tile_packed). 4-bit weights are
    // dequantized in their own column order, and x is laid out to match.
    const int64_t Kx = q4 ? Kq : Kp;
    const uint16_t* xs = xb;
    thread_local AlignedVector<uint16_t> xperm_buf;  // [T, Kq] (permute_x_q4_panel), 4-bit only
    if (q4) {
      xperm_buf.resize(static_cast<size_t>(Tp * Kq));
      permute_x_q4_panel(xb, Tp, Kp, Kq, xperm_buf.data());
      xs = xperm_buf.data();
    }
    // AMX: strips of W (bf16 read in place up to kAmxStripMaxTokens; 4-bit up to kAmxQ4StripMaxTokens)
    if (amx_panels && (fp8 || (q4 && T <= kAmxQ4StripMaxTokens) || w.dtype == DType::BF16)) {
      const bool in_place = w.dtype == DType::BF16 && K % 32 == 0 && T <= kAmxStripMaxTokens;
      matmul_amx_strips(w, x, xs, q4_codes, T, Tp, Kx, !in_place, y);
      return;
    }
    thread_local AlignedVector<uint32_t> xq_buf;  // [tiles, Kx/2, 6] (pack_x)
    thread_local AlignedVector<uint16_t> xt_buf;  // [Tp/16, Kx/32, 16, 32] (pack_x_tiles), AMX only
    if (amx_panels) {
      xt_buf.resize(static_cast<size_t>(Tp * Kx));
      uint16_t* const xt = xt_buf.data();
      if (q4) {
        pack_x_tiles(xs, Tp, Kx, xt);
      } else {
        thread_pool().parallel_for(Tp / kAmxTokens, [&](int64_t b0, int64_t b1) {
          pack_x_tiles_f32(x, T, K, Kx, xt, b0, b1);
        }, grain_for_bytes(static_cast<double>(kAmxTokens * K) * sizeof(float)));
      }
      xs = xt;
    } else {
      xq_buf.resize(static_cast<size_t>(token_tiles(T) * Kx / 2 * kTokTile));
      if (packs_from_f32) {
        uint32_t* xq = xq_buf.data();
        thread_pool().parallel_for(token_tiles(T), [&](int64_t tile0, int64_t tile1) {
          pack_x_f32(x, T, K, Kx, xq, tile0, tile1);
        }, grain_for_bytes(static_cast<double>(kTokTile * K) * sizeof(float)));
      } else {
        pack_x(xs, T, Kx, xq_buf.data());
      }
    }
    const uint32_t* xq = xq_buf.data();
    thread_pool().parallel_for((N + kPanelRows - 1) / kPanelRows, [&](int64_t p0, int64_t p1) {
      struct alignas(64) Line {
        uint16_t v[32];
      };
      thread_local std::vector<Line> wp_buf;  // [kSubCols/2, 64, 2] bf16: one packed block (aligned loads)
      // [64, kDeqStride] bf16: f16 / fp8 rows dequantized. Rows 4 KiB apart would all map to one
      // L1 set, and pack_panel reads 16 of them side by side: fp8 T = 8..64 on K = 2048 ran at
      // 0.6-0.7x the 4x4 tiles with that stride.
      constexpr int64_t kDeqStride = kPackCols + 32;
      thread_local AlignedVector<uint16_t> deq;
      wp_buf.resize(static_cast<size_t>(kSubCols * kPanelRows / 32));
      uint16_t* wp = wp_buf.data()->v;
      thread_local AlignedVector<float> acc;  // [Tp, 64]: AMX accumulators of one panel
      std::optional<amx::TileScope> tiles;
      if (amx_panels) {
        acc.resize(static_cast<size_t>(Tp * kPanelRows));
        tiles.emplace();
      }
      const bool src_is_weights = w.dtype == DType::BF16;  // else a dequantized chunk, in L2
      auto panel = [&](const uint16_t* src, int64_t ss, int64_t rows, int64_t width, int64_t k0, float* yp,
                       const uint16_t* next_rows = nullptr, int64_t next_count = 0) {
        if (amx_panels)
          run_panel_amx(src, ss, rows, width, k0, xs, T, Kx, yp, N, wp, acc.data(), k0 > 0, next_rows, next_count);
        else run_panel(src, ss, rows, width, k0, xq, T, Kx, yp, N, wp, src_is_weights);
      };
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanelRows, rows = std::min<int64_t>(kPanelRows, N - n0);
        if (w.dtype == DType::BF16) {
          const uint16_t* wb = static_cast<const uint16_t*>(w.data);
          const int64_t next_count = p + 1 < p1 ? std::min<int64_t>(kPanelRows, N - n0 - kPanelRows) : 0;
          panel(wb + n0 * K, K, rows, K, 0, y + n0, next_count > 0 ? wb + (n0 + kPanelRows) * K : nullptr, next_count);
          continue;
        }
        for (int64_t kb = 0; kb < Kx; kb += kPackCols) {
          const int64_t width = std::min(kPackCols, Kx - kb);
          deq.resize(static_cast<size_t>(kPanelRows * kDeqStride));
          if (q4) dequantize_q4_panel(w, n0, rows, kb, width, deq.data(), kDeqStride, q4_codes);
          else dequantize_rows(w, n0, rows, kb, width, deq.data(), kDeqStride);
          panel(deq.data(), kDeqStride, rows, width, kb, y + n0);
        }
      }
    });
    return;
  }
  // Prefill blocks K so that a 4-token x tile (4 x 2048 bf16 = 16 KiB) stays in L1 and a chunk of
  // rows x 2048 stays in L2 while all T tokens sweep it; otherwise each 4-row chunk of a wide
  // matrix (K = 10944) would stream all of x again. Decode (T <= 4) reads whole rows.
  const int64_t Kb = T <= 4 ? Kp : std::min<int64_t>(Kp, 2048);
  const int64_t chunk_rows = std::clamp<int64_t>(kChunkBytes / (2 * Kb) / 4 * 4, 4, 128);
  // fp8 calls of up to kFp8TileMaxTokens, and every fp8 call in exact mode: weights decoded in
  // registers, block scale on fp32 partial sums. Otherwise (batched calls of up to
  // kFp8DirectMaxTokens past that): chunks dequantized once to bf16 with the scale folded in
  // (W * scale rounded) and reused by every token.
  const bool fp8_direct = fp8 && (split || T <= kFp8TileMaxTokens);
  const Fp8Tables& tables = fp8_tables();
  thread_local AlignedVector<uint16_t> xp_buf;  // [T, Kp] hi (+ [T, Kp] lo) in lane-split order, fp8 only
  if (fp8_direct && !fp8_wide) {
    xp_buf.resize(static_cast<size_t>((split ? 2 : 1) * T * Kp));
    permute_x64(xb, (split ? 2 : 1) * T, Kp, xp_buf.data());
  }
  const uint16_t* xp = xp_buf.data();
  // 4-bit weights here (decode, or exact mode): decoded in registers, x in nibble order: int16
  // with group scales by default (tile_q4_i16), bf16 hi + lo in exact mode (tile_q4_split).
  thread_local AlignedVector<uint16_t> xq4_buf;  // [T, Kq] hi (+ [T, Kq] lo): permute_x_q4 (exact)
  thread_local AlignedVector<int16_t> xi16_buf;  // [T, Kq]: quantize_x_q4_i16 (default)
  thread_local AlignedVector<float> xs16_buf;    // [T, Kq / 128, 16]
  const Q4SplitTileFn* q4_split_tiles = nullptr;
  const Q4I16TileFn(*q4_i16_tiles)[2] = nullptr;
  static const __m512i mxfp4_ints = q4_int_table(DType::MXFP4), int4_ints = q4_int_table(DType::INT4_G32);
  const bool int4 = w.dtype == DType::INT4_G32;
  if (q4 && split) {
    xq4_buf.resize(static_cast<size_t>(2 * T * Kq));
    permute_x_q4(xb, 2 * T, Kp, Kq, xq4_buf.data());
    q4_split_tiles = int4 ? kQ4SplitTiles<true> : kQ4SplitTiles<false>;
  } else if (q4) {
    xi16_buf.resize(static_cast<size_t>(T * Kq));
    xs16_buf.resize(static_cast<size_t>(T * Kq / 8));
    quantize_x_q4_i16(x, T, K, Kq, xi16_buf.data(), xs16_buf.data(), int4 ? 1.0f : 0.5f);
    q4_i16_tiles = int4 ? kQ4I16Tiles<true> : kQ4I16Tiles<false>;
  }
  // pointers, not the thread_local buffers: the tiles run on pool workers, which have their own
  const uint16_t* xq4 = xq4_buf.data();
  const int16_t* xi16 = xi16_buf.data();
  const float* xs16 = xs16_buf.data();
  // Decode-sized calls stream each weight once: rows in lanes (lane_tiles), all tokens per tile.
  const bool bf16_direct = w.dtype == DType::BF16 && T <= (split ? kBf16SplitDirectMaxTokens : kBf16DirectMaxTokens);
  // rows [n_begin, n_end) of one matrix of the group
  auto run_rows_of = [&](const WeightMatrix& w, float* y, int64_t n_begin, int64_t n_end) {
    const int64_t N = w.out_features;
    thread_local AlignedVector<uint16_t> scratch;  // [chunk_rows, Kb] dequantized rows
    if (q4) {
      // token pairs share each decoded block; split calls run token by token
      lane_tiles(n_begin, n_end, T, y, N, [&](int64_t n0, int64_t nr, int64_t rs, float* yp, int64_t yn) {
        for (int64_t t = 0; t < T;) {
          const int64_t nt = split ? 1 : std::min<int64_t>(2, T - t);
          if (split) {
            q4_split_tiles[nr - 1](w, n0, rs, xq4 + t * Kq, T * Kq, Kq, yp + t * yn, yn, q4_codes, kDecodePrefetch);
          } else {
            const __m512i& ints = int4 ? int4_ints : mxfp4_ints;
            q4_i16_tiles[nr - 1][nt - 1](w, n0, rs, xi16 + t * Kq, xs16 + t * Kq / 8, Kq,
                                         yp + t * yn, yn, ints, kDecodePrefetch);
          }
          t += nt;
        }
      });
      return;
    }
    if (fp8_wide) {
      // each row block's rows (one scale per block_in columns) against x scaled by those scales
      thread_local AlignedVector<uint16_t> xs_buf;  // [T, Kp]: scale_x_fp8
      xs_buf.resize(static_cast<size_t>(T * Kp));
      uint16_t* xs = xs_buf.data();
      const uint8_t* codes = static_cast<const uint8_t*>(w.data);
      const int64_t groups = (T + kFp8WideTokens - 1) / kFp8WideTokens;
      const int64_t x_step = kFp8WideXBytes / (2 * T) / 64 * 64;  // columns whose x fits kFp8WideXBytes
      const bool chunked = groups > 1 && T * K * 2 > kFp8WideXBytes && K <= kFp8WideChunkMaxK &&
                           x_step >= kFp8WideMinChunk;
      const int64_t k_step = chunked ? x_step : K;
      for (int64_t s0 = n_begin; s0 < n_end;) {
        const int64_t block = s0 / w.block_out, s1 = std::min(n_end, (block + 1) * w.block_out);
        scale_x_fp8(x, T, K, Kp, w.scale_inv + block * w.scale_cols(), w.block_in, xs);
        lane_tiles(s0, s1, T, y, N, [&](int64_t n0, int64_t nr, int64_t rs, float* yp, int64_t yn) {
          for (int64_t kc = 0; kc < K; kc += k_step)
            for (int64_t g = 0; g < groups; ++g) {
              const int64_t t0 = T * g / groups, nt = T * (g + 1) / groups - t0;
              kFp8WideTiles[nt - 1][nr - 1](codes + n0 * K + kc, rs * K, std::min(k_step, K - kc), xs + t0 * Kp + kc,
                                            Kp, yp + t0 * yn, yn, kc > 0, tables, kDecodePrefetch);
            }
        });
        s0 = s1;
      }
      return;
    }
    if (fp8_direct) {
      lane_tiles(n_begin, n_end, T, y, N, [&](int64_t n0, int64_t nr, int64_t rs, float* yp, int64_t yn) {
        for (int64_t t = 0; t < T; t += 2) {
          const int64_t nt = std::min<int64_t>(2, T - t);
          // split token pairs: 2-row tiles (a 4x2 split tile needs more than 32 zmm registers)
          const int64_t step = split && nt == 2 ? 2 : 4;
          for (int64_t r1 = 0; r1 < nr; r1 += step)
            kFp8Tiles[split][std::min(step, nr - r1) - 1][nt - 1](w, n0 + r1 * rs, rs, xp + t * Kp, lo_off, Kp,
                                                                  yp + t * yn + r1, yn, tables, kDecodePrefetch);
        }
      });
      return;
    }
    if (bf16_direct) {
      const uint16_t* wb = static_cast<const uint16_t*>(w.data);
      if (!split && T > 4) {
        // 5-12 tokens: one pass over the rows per group of at most 8 tokens (wide_tile), rows
        // from as many lanes as the tiles have rows
        lane_tiles(n_begin, n_end, T, y, N, [&](int64_t n0, int64_t nr, int64_t rs, float* yp, int64_t yn) {
          wide_token_groups(T, [&](int64_t t0, int64_t nt) {
            wide_tile(nr, nt)(wb + n0 * K, rs * K, xb + t0 * Kp, 0, Kp, K, yp + t0 * yn, yn, false,
                              kDecodePrefetch);
          });
        }, wide_rows(T));
        return;
      }
      lane_tiles(n_begin, n_end, T, y, N, [&](int64_t n0, int64_t nr, int64_t rs, float* yp, int64_t yn) {
        for (int64_t t = 0; t < T; t += 4)
          kTiles[split][nr - 1][std::min<int64_t>(4, T - t) - 1](wb + n0 * K, rs * K, xb + t * Kp, lo_off, Kp, K,
                                                                  yp + t * yn, yn, false, kDecodePrefetch);
      });
      return;
    }
    for (int64_t n0 = n_begin; n0 < n_end; n0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, n_end - n0);
      for (int64_t kb = 0; kb < K; kb += Kb) {
        const int64_t kn = std::min(Kb, K - kb);
        if (w.dtype == DType::BF16) {
          run_rows(static_cast<const uint16_t*>(w.data) + n0 * K + kb, K, rows, xb + kb, lo_off, T, Kp, kn, y + n0, N,
                   kb > 0);
        } else {
          scratch.resize(static_cast<size_t>(chunk_rows * Kb));
          dequantize_rows(w, n0, rows, kb, Kb, scratch.data(), Kb);
          run_rows(scratch.data(), Kb, rows, xb + kb, lo_off, T, Kp, kn, y + n0, N, kb > 0);
        }
      }
    }
  };
  // The pool splits the group's 4-row groups, matrix after matrix, as if they were one matrix;
  // a group's work is its weight bytes once per token (small calls stay on one thread).
  std::array<int64_t, kMaxMatmulGroup + 1> first{};  // first[i]: matrix i's first 4-row group
  for (int64_t i = 0; i < count; ++i) first[i + 1] = first[i] + (ws[i]->out_features + 3) / 4;
  const double group_bytes = 4.0 * static_cast<double>(w.bytes()) / static_cast<double>(w.out_features);
  thread_pool().parallel_for(first[count], [&](int64_t g0, int64_t g1) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t lo = std::max(g0, first[i]), hi = std::min(g1, first[i + 1]);
      if (lo < hi)
        run_rows_of(*ws[i], ys[i], (lo - first[i]) * 4, std::min(ws[i]->out_features, (hi - first[i]) * 4));
    }
  }, grain_for_bytes(group_bytes * static_cast<double>(T)));
}

}  // namespace

void matmul(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision) {
  const WeightMatrix* ws[] = {&w};
  float* ys[] = {y};
  matmul_impl(x, T, ws, ys, 1, precision, false);
}

void matmul_amx(const float* x, int64_t T, const WeightMatrix& w, float* y, const MatmulPrecision& precision) {
  const WeightMatrix* ws[] = {&w};
  float* ys[] = {y};
  matmul_impl(x, T, ws, ys, 1, precision, true);
}

void matmul_group(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                  const MatmulPrecision& precision) {
  matmul_impl(x, T, w, y, count, precision, false);
}

void matmul_group_amx(const float* x, int64_t T, const WeightMatrix* const* w, float* const* y, int64_t count,
                      const MatmulPrecision& precision) {
  matmul_impl(x, T, w, y, count, precision, true);
}

}  // namespace moat::ops::cpu_avx512bf16

#pragma GCC pop_options
