// Every host kernel (reference and cpu backends, every ISA variant this CPU can run) against the
// reference kernel on random inputs over its declared shapes and the edges: T = 1, 3, 17;
// dimensions that are not multiples of the vector width; fp8 with ragged 128-blocks; heads
// 4/8/16/32 directly and 1/12 through PadHeads; the paged latent cache in fp32, bf16 and fp8 with
// blocks of 1, 16, 64 and 512 rows, scattered block ids and several sequences per call; sampling
// rows with ties.
//
// Error measure: normalized error = max|out - ref| / max|ref|. Tolerances:
//   kExact   1e-5  fp32 arithmetic in a different order than the reference's double sums (and
//                  cpu.matmul_avx512bf16 up to split_max_tokens, where x is split into bf16 hi + lo)
//   kBf16Dot 1e-2  kernels that round activations to bf16 (8 significant bits) before the dot
// A kernel the running CPU cannot execute is reported as "not supported here" (with its reasons)
// and skipped, never silently passed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/thread_pool.h"
#include "base/weight.h"
#include "kernels/cpu/cpu_kernels.h"
#include "ops/dispatch.h"
#include "ops/ops_table.h"
#include "ops/registry.h"
#include "parity.h"

namespace moat::ops {
namespace {

constexpr double kExact = 1e-5;
constexpr double kBf16Dot = 1e-2;

const Registry& reg() { return Registry::global(); }

using testing::normalized_error;
using testing::randn;
using testing::fn_of;
using testing::host_kernels;
using testing::is_bf16_dot_matmul;

const KernelEntry* reference_kernel(OpId op) {
  auto ks = reg().kernels(op, Backend::reference);
  EXPECT_EQ(ks.size(), 1u) << op_name(op);
  return ks.front();
}

double tolerance_for(const KernelEntry* k) {
  return k->name.find("bf16") != std::string::npos ? kBf16Dot : kExact;
}

// cpu.matmul_avx512bf16 splits x into bf16 hi + lo and applies fp8 scales in fp32 (fp32-accurate)
// unless fast prefill is on for T > split_max, or the weights are fp8 without exact activations
// (W8A16); f16 weights always round to bf16.
double matmul_tolerance(const KernelEntry* k, DType dtype, int64_t T, int64_t split_max, bool fp8_exact) {
  if (!is_bf16_dot_matmul(k)) return tolerance_for(k);
  if (T > split_max || dtype == DType::F16 || (dtype == DType::F8_E4M3 && !fp8_exact)) return kBf16Dot;
  return kExact;
}

// ---- weights in every stored dtype -------------------------------------------------------------

struct TestWeight {
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
  WeightMatrix w;
};

TestWeight make_weight(DType dtype, int64_t N, int64_t K, std::mt19937& rng) {
  TestWeight t;
  const auto vals = randn(static_cast<size_t>(N * K), rng, 0.5f);
  t.bytes.resize(static_cast<size_t>(N * K) * dtype_size(dtype) + 64);
  t.w = WeightMatrix{.dtype = dtype, .data = t.bytes.data(), .out_features = N, .in_features = K};
  for (int64_t i = 0; i < N * K; ++i) {
    switch (dtype) {
      case DType::F32: std::memcpy(t.bytes.data() + 4 * i, &vals[i], 4); break;
      case DType::BF16: {
        const uint16_t b = f32_to_bf16(vals[i]);
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
        break;
      }
      case DType::F16: {
        const uint16_t b = f32_to_f16(vals[i]);
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
        break;
      }
      case DType::F8_E4M3: {
        // Every finite code, subnormals and +-448 included: exercises the whole decode.
        uint8_t code;
        do code = static_cast<uint8_t>(rng() & 0xff);
        while ((code & 0x7f) == 0x7f);
        t.bytes[i] = code;
        break;
      }
      default: ADD_FAILURE() << "dtype";
    }
  }
  if (dtype == DType::F8_E4M3) {
    const int64_t rows = (N + 127) / 128, cols = (K + 127) / 128;
    std::uniform_real_distribution<float> u(0.5f, 2.0f);
    for (int64_t i = 0; i < rows * cols; ++i) t.scales.push_back(u(rng) * 1e-2f);
    t.w.scale_inv = t.scales.data();
  }
  return t;
}

// ---- matmul ------------------------------------------------------------------------------------

TEST(OpsMatmul, EveryHostKernelMatchesReference) {
  std::mt19937 rng(1);
  struct Shape {
    int64_t N, K;
  };
  // odd sizes, a partial 32-lane tail, ragged fp8 blocks (130 x 300: blocks of 128 + 2 rows,
  // 128 + 128 + 44 columns), one real-sized slab, and K > 2048 (prefill blocks K by 2048)
  // 70 x 2100: a panel of 64 rows and one of 6, and column blocks of 256 past a K of 2048 (the packed
  // kernel for T > split_max_tokens)
  // 37 x 256: whole 32-column steps with a ragged last 16-row strip (AMX's weights-as-A path, T <= 48)
  // 100 x 3200 at T = 512 alone: x past 6 MiB, so the packed GEMMs (ymm and 512-bit) pack up to 16 panels per
  // chunk (6 whole and a ragged one here)
  const Shape shapes[] = {{1, 1},       {5, 7},    {37, 200}, {37, 256},  {130, 300},
                          {64, 2048},   {260, 129}, {9, 4200}, {70, 2100}, {100, 3200}};
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3}) {
    const OpShape shape{.weight_dtype = dtype};
    const auto kernels = host_kernels(OpId::matmul, shape);
    ASSERT_FALSE(kernels.empty());
    for (const Shape& s : shapes) {
      TestWeight tw = make_weight(dtype, s.N, s.K, rng);
      // T = 5..64: batched decode (token tiles of up to 6, balanced); 512: prefill
      // 40: three 16-token blocks, the last partial
      for (int64_t T : {1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 40, 64, 512}) {
        if (s.N * s.K >= 320000 && T != 512) continue;  // the large-chunk shape: its reference costs seconds
        const auto x = randn(static_cast<size_t>(T * s.K), rng);
        std::vector<float> ref(static_cast<size_t>(T * s.N));
        fn_of<MatmulFn>(kernels[0])(x.data(), T, tw.w, ref.data(), MatmulPrecision::exact());
        for (const KernelEntry* k : kernels)
          // accurate, the default (x rounded to bf16 at every T), split up to 4 or 16 tokens
          for (int64_t split_max : {std::numeric_limits<int64_t>::max(), int64_t{0}, int64_t{4}, int64_t{16}})
            for (bool fp8_exact : {false, true}) {
              std::vector<float> out(ref.size(), NAN);
              fn_of<MatmulFn>(k)(x.data(), T, tw.w, out.data(), MatmulPrecision{split_max, fp8_exact});
              EXPECT_LE(normalized_error(out, ref), matmul_tolerance(k, dtype, T, split_max, fp8_exact))
                  << k->name << " " << dtype_name(dtype) << " N=" << s.N << " K=" << s.K << " T=" << T
                  << " split_max=" << split_max << " fp8_exact=" << fp8_exact;
            }
      }
    }
  }
}

// Calls whose packed x passes 6 MiB pack up to 16 panels per k block (large_chunk_panels in
// matmul_avx2.cpp; AMX and AVX-512 BF16 have their own chunking). On one thread one task holds
// every column, so 300 rows run as a group of 16 panels, then 2 whole panels and a ragged one of
// 12 rows: on more threads the tasks' column ranges would be too short to fill a group.
TEST(OpsMatmul, LargeActivationCallsPackManyPanelsPerBlock) {
  std::mt19937 rng(5);
  constexpr int64_t N = 300, K = 3200, T = 512;  // x: 6.25 MiB of fp32
  ThreadPool pool(1);
  ScopedThreadPool scope(pool);
  for (DType dtype : {DType::BF16, DType::F8_E4M3}) {
    const auto kernels = host_kernels(OpId::matmul, OpShape{.weight_dtype = dtype});
    TestWeight tw = make_weight(dtype, N, K, rng);
    const auto x = randn(static_cast<size_t>(T * K), rng);
    std::vector<float> ref(static_cast<size_t>(T * N));
    fn_of<MatmulFn>(kernels[0])(x.data(), T, tw.w, ref.data(), MatmulPrecision::exact());
    for (const KernelEntry* k : kernels)
      for (bool exact : {false, true}) {
        const MatmulPrecision precision = exact ? MatmulPrecision::exact() : MatmulPrecision{};
        std::vector<float> out(ref.size(), NAN);
        fn_of<MatmulFn>(k)(x.data(), T, tw.w, out.data(), precision);
        EXPECT_LE(normalized_error(out, ref),
                  matmul_tolerance(k, dtype, T, precision.split_max_tokens, precision.fp8_split))
            << k->name << " " << dtype_name(dtype) << " exact=" << exact;
      }
  }
}

// Batched decode's calls of 3-17 tokens (x rounded to bf16) against the reference, at every T of
// the range: on AVX-512 BF16 bf16 runs 5-12 as groups of up to 8 tokens, one pass over the rows
// each (4 rows x 5-6 tokens from 4 lanes, 3 x 7-8 from 3; T = 9 as 5 + 4, T = 12 as 6 + 6), then
// on packed panels; fp8 runs 3-16 on tile_fp8_wide (x scaled per block of rows, groups of up to 4
// tokens: T = 5 as 2 + 3, 13 as 3 + 3 + 3 + 4; each row block's rows in 4 lanes) and 17 on
// dequantized chunks. Row counts leave 1-3 rows outside the lanes; K = 300 a ragged last step,
// K = 2100 rows past 2048; fp8 also in blocks of 64 rows x 192 columns (130 rows: 3 row blocks,
// the last of 2 rows). 1 and 2 threads. Then 65-129 tokens, past the four 16-token blocks a strip
// of AMX's weights-as-A path multiplies at once: fp8 runs them on strips (to 128), each 16-row
// strip dequantized once and read again for each further group of blocks (130 rows: a last strip
// of 2; K = 300 zero-padded to 320), bf16 on panels.
TEST(OpsMatmul, BatchedDecodeCallsMatchReference) {
  std::mt19937 rng(31);
  struct Shape {
    int64_t N, K, block_out = 128, block_in = 128;
  };
  const Shape shapes[] = {{37, 300}, {130, 2048}, {66, 2100}, {130, 600, 64, 192}};
  for (DType dtype : {DType::BF16, DType::F8_E4M3}) {
    const auto kernels = host_kernels(OpId::matmul, OpShape{.weight_dtype = dtype});
    for (const Shape& s : shapes) {
      TestWeight tw = make_weight(dtype, s.N, s.K, rng);
      if (s.block_out != 128 || s.block_in != 128) {
        if (dtype != DType::F8_E4M3) continue;
        tw.w.block_out = s.block_out;
        tw.w.block_in = s.block_in;
        tw.scales.clear();
        std::uniform_real_distribution<float> u(0.5f, 2.0f);
        for (int64_t i = 0; i < (s.N + s.block_out - 1) / s.block_out * tw.w.scale_cols(); ++i)
          tw.scales.push_back(u(rng) * 1e-2f);
        tw.w.scale_inv = tw.scales.data();
      }
      std::vector<int64_t> token_counts = {65, 100, 128, 129};
      for (int64_t T = 3; T <= 17; ++T) token_counts.push_back(T);
      for (int64_t T : token_counts) {
        const auto x = randn(static_cast<size_t>(T * s.K), rng);
        std::vector<float> ref(static_cast<size_t>(T * s.N));
        fn_of<MatmulFn>(kernels[0])(x.data(), T, tw.w, ref.data(), MatmulPrecision::exact());
        for (int threads : {1, 2}) {
          ThreadPool pool(threads);
          ScopedThreadPool scope(pool);
          for (const KernelEntry* k : kernels) {
            std::vector<float> out(ref.size(), NAN);
            fn_of<MatmulFn>(k)(x.data(), T, tw.w, out.data(), MatmulPrecision{});
            EXPECT_LE(normalized_error(out, ref), matmul_tolerance(k, dtype, T, 0, false))
                << k->name << " " << dtype_name(dtype) << " N=" << s.N << " K=" << s.K << " blocks "
                << s.block_out << " x " << s.block_in << " T=" << T << " threads=" << threads;
          }
        }
      }
    }
  }
}

// The AVX2 kernel's two exact fp8 decodes (F16C; integer shifts into fp32's exponent field, with
// subnormal codes as fp32 subnormals) against the reference, whichever one this CPU picks by
// default: every finite code, ragged K (tails of 44, 54 and 40 columns), blocks of 128 and of 96
// (not a multiple of 64: the exponent route hands those to F16C), row blocks of 128 and of 48 (the
// exponent route scales x per block of rows: 130 rows in 3 blocks), 1-4 rows per tile, 1-4, 8, 9
// and 10 tokens (the exponent route's 2-token tiles and a last odd token; F16C's packed panels)
// and 11 and 17 (packed on both); on AVX-512 also through cpu.matmul_avx512fma's entry, whose F16C
// route runs 1-4 tokens on its 512-bit tile (tile_fp8_f16c_wide) and both routes pack from 5 / 8.
TEST(OpsMatmul, Avx2Fp8DecodeRoutesMatchReference) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
    GTEST_SKIP() << "no AVX2 + FMA + F16C";
  using moat::ops::cpu_avx2_fma::Fp8DecodeRoute;
  const Fp8DecodeRoute saved = moat::ops::cpu_avx2_fma::fp8_decode_route();
  const KernelEntry* reference = host_kernels(OpId::matmul, OpShape{.weight_dtype = DType::F8_E4M3})[0];
  std::mt19937 rng(5);
  struct Shape {
    int64_t N, K, block_in, block_out = 128;
  };
  const Shape shapes[] = {{7, 128, 128},  {37, 300, 128}, {130, 310, 128},    {9, 4200, 128},
                          {21, 240, 96}, {5, 1000, 96},  {130, 640, 128, 48}};
  for (const Shape& s : shapes) {
    TestWeight tw = make_weight(DType::F8_E4M3, s.N, s.K, rng);
    tw.w.block_in = s.block_in;
    tw.w.block_out = s.block_out;
    tw.scales.resize(static_cast<size_t>((s.N + s.block_out - 1) / s.block_out * tw.w.scale_cols()), 0.0f);
    std::uniform_real_distribution<float> u(0.5f, 2.0f);
    for (float& v : tw.scales) v = u(rng) * 1e-2f;
    tw.w.scale_inv = tw.scales.data();
    for (int64_t T : {1, 2, 3, 4, 8, 9, 10, 11, 17}) {
      const auto x = randn(static_cast<size_t>(T * s.K), rng);
      std::vector<float> ref(static_cast<size_t>(T * s.N));
      fn_of<MatmulFn>(reference)(x.data(), T, tw.w, ref.data(), MatmulPrecision::exact());
      for (Fp8DecodeRoute route : {Fp8DecodeRoute::f16c, Fp8DecodeRoute::exponent})
        for (bool wide : {false, true}) {
          if (wide && !cpu_has_isa("avx512")) continue;
          moat::ops::cpu_avx2_fma::set_fp8_decode_route(route);
          std::vector<float> out(ref.size(), NAN);
          (wide ? moat::ops::cpu_avx2_fma::matmul_wide : moat::ops::cpu_avx2_fma::matmul)(
              x.data(), T, tw.w, out.data(), MatmulPrecision::exact());
          EXPECT_LE(normalized_error(out, ref), kExact)
              << "route " << static_cast<int>(route) << (wide ? " (512-bit packed)" : "") << " N=" << s.N
              << " K=" << s.K << " blocks " << s.block_out << " x " << s.block_in << " T=" << T;
        }
    }
  }
  moat::ops::cpu_avx2_fma::set_fp8_decode_route(saved);
}

// A matmul group (weights that share x) equals one call per weight bit for bit, on every kernel
// that offers one, at 1 and 2 threads (the pool splits the group's rows across matrices),
// decode-sized and batched T, both precisions.
TEST(OpsMatmul, GroupsEqualSeparateCallsBitForBit) {
  std::mt19937 rng(21);
  const int64_t K = 300;                    // a ragged fp8 block and a partial 64-column step
  const int64_t outs[] = {37, 5, 130, 64};  // rows not a multiple of 4, one matrix of 5 rows
  for (DType dtype : {DType::BF16, DType::F16, DType::F8_E4M3}) {
    std::vector<TestWeight> weights;
    for (int64_t N : outs) weights.push_back(make_weight(dtype, N, K, rng));
    std::vector<const WeightMatrix*> ws;
    for (const TestWeight& t : weights) ws.push_back(&t.w);
    int grouped_kernels = 0;
    for (const KernelEntry* k : host_kernels(OpId::matmul, OpShape{.weight_dtype = dtype})) {
      if (k->group_fn == nullptr) continue;
      ++grouped_kernels;
      for (int threads : {1, 2}) {
        ThreadPool pool(threads);
        ScopedThreadPool scope(pool);
        for (int64_t T : {1, 3, 5, 17, 64})
          for (const MatmulPrecision& precision : {MatmulPrecision{}, MatmulPrecision::exact()}) {
            const auto [grouped, separate] =
                testing::group_and_separate(k, randn(static_cast<size_t>(T * K), rng), T, ws, precision);
            for (size_t i = 0; i < weights.size(); ++i)
              EXPECT_EQ(grouped[i], separate[i]) << k->name << " " << dtype_name(dtype) << " weight " << i
                                                 << " T=" << T << " threads=" << threads;
          }
      }
    }
    if (cpu_has_isa("avx512bf16")) {
      EXPECT_GT(grouped_kernels, 0) << "the avx512bf16 kernels offer a group entry";
    }
  }
}

// OpTable::matmul_group: one group call where the weights share a dtype, one matmul each where
// they do not (a bf16 and an f32 weight); the same products either way.
TEST(OpsMatmul, OpTableGroupsOrFallsBackWithTheSameResults) {
  std::mt19937 rng(22);
  auto table = OpTable::resolve(Backend::cpu, ModelOpNeeds{.matmul_dtypes = {DType::BF16, DType::F32},
                                                           .heads_per_rank = 16,
                                                           .attention_head_dim = 576});
  ASSERT_TRUE(table.ok()) << table.error().message;
  const int64_t K = 256, T = 2;
  const TestWeight a = make_weight(DType::BF16, 40, K, rng), b = make_weight(DType::BF16, 24, K, rng),
                   c = make_weight(DType::F32, 12, K, rng);
  const auto x = randn(static_cast<size_t>(T * K), rng);
  std::vector<float> ya(T * 40), yb(T * 24), yc(T * 12), wa(ya.size()), wb(yb.size()), wc(yc.size());
  table->matmul(x.data(), T, a.w, wa.data());
  table->matmul(x.data(), T, b.w, wb.data());
  table->matmul(x.data(), T, c.w, wc.data());
  table->matmul_group(x.data(), T, {{&a.w, ya.data()}, {&b.w, yb.data()}});
  EXPECT_EQ(ya, wa);
  EXPECT_EQ(yb, wb);
  std::fill(ya.begin(), ya.end(), NAN);
  table->matmul_group(x.data(), T, {{&a.w, ya.data()}, {&c.w, yc.data()}, {&b.w, yb.data()}});
  EXPECT_EQ(ya, wa);
  EXPECT_EQ(yb, wb);
  EXPECT_EQ(yc, wc);
}

// ---- elementwise / row ops ---------------------------------------------------------------------

TEST(OpsEmbedding, EveryHostKernelMatchesReference) {
  std::mt19937 rng(2);
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    const auto kernels = host_kernels(OpId::embedding, OpShape{.weight_dtype = dtype});
    for (int64_t H : {1, 17, 64}) {
      TestWeight tw = make_weight(dtype, 50, H, rng);
      const std::vector<int32_t> ids = {0, 49, 3, 3, 17};
      std::vector<float> ref(ids.size() * H);
      fn_of<EmbeddingFn>(kernels[0])(tw.w, ids.data(), ids.size(), ref.data());
      for (const KernelEntry* k : kernels) {
        std::vector<float> out(ref.size(), NAN);
        fn_of<EmbeddingFn>(k)(tw.w, ids.data(), ids.size(), out.data());
        EXPECT_EQ(normalized_error(out, ref), 0.0) << k->name << " " << dtype_name(dtype);
      }
    }
  }
}

TEST(OpsRmsNorm, EveryHostKernelMatchesReference) {
  std::mt19937 rng(3);
  const auto kernels = host_kernels(OpId::rms_norm, {});
  for (int64_t dim : {1, 7, 16, 100, 2048})
    for (int64_t T : {1, 3, 17}) {
      const auto x = randn(T * dim, rng, 3.0f), w = randn(dim, rng);
      std::vector<float> ref(x.size());
      fn_of<RmsNormFn>(kernels[0])(x.data(), w.data(), T, dim, 1e-6f, ref.data());
      for (const KernelEntry* k : kernels) {
        std::vector<float> out(x.size(), NAN);
        fn_of<RmsNormFn>(k)(x.data(), w.data(), T, dim, 1e-6f, out.data());
        EXPECT_LE(normalized_error(out, ref), kExact) << k->name << " dim=" << dim << " T=" << T;
        auto inplace = x;  // y may alias x
        fn_of<RmsNormFn>(k)(inplace.data(), w.data(), T, dim, 1e-6f, inplace.data());
        EXPECT_LE(normalized_error(inplace, ref), kExact) << k->name << " in place";
      }
    }
}

TEST(OpsRope, EveryHostKernelMatchesReference) {
  std::mt19937 rng(4);
  const auto kernels = host_kernels(OpId::rope, {});
  const int64_t rope_dim = 64, half = rope_dim / 2, max_pos = 40;
  std::vector<float> cos_t(max_pos * half), sin_t(max_pos * half);
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double a = p * std::pow(10000.0, -2.0 * i / rope_dim);
      cos_t[p * half + i] = static_cast<float>(std::cos(a));
      sin_t[p * half + i] = static_cast<float>(std::sin(a));
    }
  for (int64_t heads : {1, 3, 16})
    for (int64_t T : {1, 3, 17}) {
      const int64_t head_stride = 192, token_stride = heads * head_stride + 5;  // q_pe inside q rows
      const auto x0 = randn(T * token_stride, rng);
      std::vector<int32_t> pos(T);
      for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>((t * 7) % max_pos);
      auto run = [&](const KernelEntry* k) {
        auto x = x0;
        RopeArgs a{x.data() + 128, T, heads, token_stride, head_stride, rope_dim, pos.data(),
                   cos_t.data(), sin_t.data()};
        fn_of<RopeFn>(k)(a);
        return x;
      };
      const auto ref = run(kernels[0]);
      for (const KernelEntry* k : kernels)
        EXPECT_LE(normalized_error(run(k), ref), kExact) << k->name << " heads=" << heads << " T=" << T;
    }
}

TEST(OpsSiluMul, EveryHostKernelMatchesReference) {
  std::mt19937 rng(5);
  const auto kernels = host_kernels(OpId::silu_mul, {});
  for (int64_t n : {1, 15, 16, 33, 1408})
    for (int64_t T : {1, 3, 17}) {
      auto gate = randn(T * n, rng, 4.0f);
      gate[0] = -100.0f;  // exp overflow edge
      const auto up = randn(T * n, rng);
      std::vector<float> ref(T * n);
      fn_of<SiluMulFn>(kernels[0])(gate.data(), up.data(), T, n, ref.data());
      for (const KernelEntry* k : kernels) {
        std::vector<float> out(ref.size(), NAN);
        fn_of<SiluMulFn>(k)(gate.data(), up.data(), T, n, out.data());
        EXPECT_LE(normalized_error(out, ref), kExact) << k->name << " n=" << n << " T=" << T;
        auto alias = gate;  // y may alias gate
        fn_of<SiluMulFn>(k)(alias.data(), up.data(), T, n, alias.data());
        EXPECT_LE(normalized_error(alias, ref), kExact) << k->name << " aliased";
      }
    }
}

TEST(OpsAddScaled, EveryHostKernelMatchesReference) {
  std::mt19937 rng(6);
  for (const KernelEntry* k : host_kernels(OpId::add_scaled, {}))
    for (int64_t n : {1, 15, 16, 100, 7168}) {
      const auto x = randn(n, rng), y0 = randn(n, rng);
      auto ref = y0, out = y0;
      fn_of<AddScaledFn>(reference_kernel(OpId::add_scaled))(ref.data(), x.data(), 0.37f, n);
      fn_of<AddScaledFn>(k)(out.data(), x.data(), 0.37f, n);
      EXPECT_LE(normalized_error(out, ref), kExact) << k->name << " n=" << n;
    }
}

TEST(OpsSoftmax, EveryHostKernelMatchesReference) {
  std::mt19937 rng(7);
  const auto kernels = host_kernels(OpId::softmax, {});
  for (int64_t n : {1, 5, 16, 1000, 32003})
    for (float temp : {1.0f, 0.5f, 2.0f})
      for (int64_t T : {1, 3}) {
        auto x = randn(T * n, rng, 5.0f);
        x[0] = 80.0f;  // a dominant logit
        std::vector<float> ref(x.size());
        fn_of<SoftmaxFn>(kernels[0])(x.data(), T, n, temp, ref.data());
        for (const KernelEntry* k : kernels) {
          std::vector<float> out(x.size(), NAN);
          fn_of<SoftmaxFn>(k)(x.data(), T, n, temp, out.data());
          EXPECT_LE(normalized_error(out, ref), kExact) << k->name << " n=" << n << " temp=" << temp;
        }
      }
}

TEST(OpsArgmax, EveryHostKernelMatchesReferenceIncludingTies) {
  std::mt19937 rng(8);
  for (const KernelEntry* k : host_kernels(OpId::argmax, {}))
    for (int64_t n : {1, 7, 16, 33, 32000}) {
      const int64_t T = 3;
      auto x = randn(T * n, rng);
      // row 1: the max appears twice (lowest index wins); row 2: all equal
      if (n > 5) x[n + 2] = x[n + n - 1] = 50.0f;
      std::fill(x.begin() + 2 * n, x.end(), -1.0f);
      std::vector<int32_t> ref(T), out(T, -1);
      fn_of<ArgmaxFn>(reference_kernel(OpId::argmax))(x.data(), T, n, ref.data());
      fn_of<ArgmaxFn>(k)(x.data(), T, n, out.data());
      EXPECT_EQ(out, ref) << k->name << " n=" << n;
    }
}

// ---- paged latent cache: store_latent and MLA attention ----------------------------------------

// A pool of num_blocks blocks of B rows [D] in one cache dtype. Every slot starts as NaN (fp32
// NaN, bf16 0xffff, fp8 0x7f with a NaN row scale), so a kernel that reads a slot nobody wrote
// produces NaN and fails the comparison (normalized_error is infinite on a NaN mismatch).
struct TestPages {
  std::vector<uint8_t> bytes;  // [num_blocks * B, D] in dtype
  std::vector<float> scales;   // [num_blocks * B]: fp8 only
  LatentPages pages;

  TestPages(DType dtype, int64_t num_blocks, int64_t B, int64_t D) {
    const int64_t slots = num_blocks * B;
    bytes.resize(static_cast<size_t>(slots * D) * dtype_size(dtype));
    if (dtype == DType::F32) {
      const float nan = NAN;
      for (int64_t i = 0; i < slots * D; ++i) std::memcpy(&bytes[4 * i], &nan, 4);
    } else {
      std::fill(bytes.begin(), bytes.end(), dtype == DType::BF16 ? 0xff : 0x7f);
    }
    if (dtype == DType::F8_E4M3) scales.assign(static_cast<size_t>(slots), NAN);
    pages = LatentPages{bytes.data(), scales.empty() ? nullptr : scales.data(), dtype, B};
  }
};

// Several sequences in one paged cache with shuffled, non-consecutive block ids, and T query
// tokens spread over them: token t belongs to sequence t % S and attends to a prefix of it
// (the full length for the first S tokens, then shorter ones, as in a prefill chunk). Table
// entries past a sequence's blocks name a poison block that is never written (NaN).
struct PagedMla {
  int64_t T, heads, kv_lora, rope, D, B, max_blocks = 0;
  DType dtype;
  std::vector<int32_t> seq_len;       // [S]
  std::vector<int32_t> block_tables;  // [S, max_blocks]
  std::vector<int32_t> token_seq, kv_len;  // [T]
  std::vector<float> latent;          // [rows of all sequences, D] what was stored, fp32
  std::vector<int64_t> slots;         // [rows of all sequences]
  std::vector<float> q;               // [T, heads, D]
  std::unique_ptr<TestPages> cache;

  PagedMla(int64_t T_, int64_t heads_, int64_t kv_lora_, int64_t rope_, int64_t B_, DType dtype_,
           std::vector<int32_t> lengths, std::mt19937& rng)
      : T(T_), heads(heads_), kv_lora(kv_lora_), rope(rope_), D(kv_lora_ + rope_), B(B_), dtype(dtype_),
        seq_len(std::move(lengths)) {
    const int64_t S = static_cast<int64_t>(seq_len.size());
    int64_t used = 0;
    for (int32_t L : seq_len) {
      max_blocks = std::max<int64_t>(max_blocks, (L + B - 1) / B);
      used += (L + B - 1) / B;
    }
    const int64_t num_blocks = used + 3;  // spare blocks, one of them the poison block
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    for (int64_t i = 0; i < num_blocks; ++i) ids[i] = static_cast<int32_t>(i);
    std::shuffle(ids.begin(), ids.end(), rng);
    const int32_t poison = ids.back();
    block_tables.assign(static_cast<size_t>(S * max_blocks), poison);
    size_t next = 0;
    for (int64_t s = 0; s < S; ++s)
      for (int64_t b = 0; b < (seq_len[s] + B - 1) / B; ++b) block_tables[s * max_blocks + b] = ids[next++];
    for (int64_t s = 0; s < S; ++s)
      for (int64_t j = 0; j < seq_len[s]; ++j) slots.push_back(int64_t{block_tables[s * max_blocks + j / B]} * B + j % B);
    latent = randn(slots.size() * D, rng);
    cache = std::make_unique<TestPages>(dtype, num_blocks, B, D);
    fn_of<StoreLatentFn>(reference_kernel(OpId::store_latent))(
        StoreLatentArgs{latent.data(), static_cast<int64_t>(slots.size()), D, slots.data(), cache->pages});
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = t % S;
      token_seq.push_back(static_cast<int32_t>(s));
      kv_len.push_back(static_cast<int32_t>(std::max<int64_t>(1, seq_len[s] - 5 * (t / S))));
    }
    q = randn(T * heads * D, rng);
  }
  MlaAttentionArgs args(float* out) const {
    return MlaAttentionArgs{q.data(), T, heads, kv_lora, rope, cache->pages, block_tables.data(), max_blocks,
                            token_seq.data(), kv_len.data(), 1.0f / std::sqrt(static_cast<float>(D)), out};
  }
  // The reference reads the same stored cache, so bf16 and fp8 caches compare at kExact too.
  std::vector<float> reference() const {
    std::vector<float> ref(T * heads * kv_lora);
    fn_of<MlaAttentionFn>(reference_kernel(OpId::mla_attention))(args(ref.data()));
    return ref;
  }
  std::string describe() const {
    return fmt::format("heads={} D={} block={} kv={} T={} lengths={}", heads, D, B, dtype_name(dtype), T,
                       fmt::join(seq_len, ","));
  }
};

constexpr DType kKvDtypes[] = {DType::F32, DType::BF16, DType::F8_E4M3};

// Rows for store_latent: random at several magnitudes, an all-zero row (fp8 scale 1), a row
// whose max is 448 (fp8 scale exactly 1) holding exact rounding ties of e4m3 normals and
// subnormals, bf16 ties, and huge and tiny rows.
std::vector<float> store_rows(int64_t T, int64_t D, std::mt19937& rng) {
  std::vector<float> rows;
  for (int64_t t = 0; t < T; ++t) {
    auto r = randn(D, rng, std::pow(10.0f, static_cast<float>(t % 7) - 3.0f));
    if (t == 1) std::fill(r.begin(), r.end(), 0.0f);
    if (t == 2) {
      const float ties[] = {448.0f, 1.0625f, 1.1875f, -1.0625f, 0x1p-10f, 0x3p-10f, -0x5p-10f, 0x1.1p-6f,
                            0x1.ep-7f, 0x1.fp-7f, 0x1.fp-8f, 0.0f, -0.0f, 136.0f, 152.0f, 415.9f, 431.9f, 432.0f};
      for (int64_t d = 0; d < D; ++d) r[d] = d < 18 ? ties[d] : r[d];
      if (D < 18) r[0] = 448.0f;
    }
    if (t == 3)  // bf16 ties: the low 16 bits exactly half way, with odd and even upper halves
      for (int64_t d = 0; d < D; ++d) {
        const uint32_t u = 0x3f800000u + (static_cast<uint32_t>(d) << 16) + 0x8000u;
        std::memcpy(&r[d], &u, 4);
      }
    if (t == 4) r[D / 2] = 3e6f;
    rows.insert(rows.end(), r.begin(), r.end());
  }
  return rows;
}

TEST(OpsStoreLatent, EveryHostKernelMatchesReferenceBitForBit) {
  std::mt19937 rng(13);
  for (DType dtype : kKvDtypes)
    for (int64_t D : {576, 48, 7}) {
      const int64_t T = 9, B = 4;
      const auto rows = store_rows(T, D, rng);
      // scattered slots, one skipped (-1)
      const std::vector<int64_t> slot_mapping = {13, 2, 7, -1, 0, 22, 5, 18, 11};
      TestPages ref(dtype, 6, B, D);
      fn_of<StoreLatentFn>(reference_kernel(OpId::store_latent))(
          StoreLatentArgs{rows.data(), T, D, slot_mapping.data(), ref.pages});
      for (const KernelEntry* k : host_kernels(OpId::store_latent, OpShape{.head_dim = D, .kv_dtype = dtype})) {
        TestPages out(dtype, 6, B, D);
        fn_of<StoreLatentFn>(k)(StoreLatentArgs{rows.data(), T, D, slot_mapping.data(), out.pages});
        EXPECT_TRUE(out.bytes == ref.bytes) << k->name << " " << dtype_name(dtype) << " D=" << D;
        // bit for bit; bf16 and fp32 caches have no scales (memcmp of nothing: null pointers, UB)
        EXPECT_TRUE(out.scales.size() == ref.scales.size() &&
                    (ref.scales.empty() ||
                     std::memcmp(out.scales.data(), ref.scales.data(), sizeof(float) * ref.scales.size()) == 0))
            << k->name << " " << dtype_name(dtype) << " D=" << D;
      }
    }
}

// What the cache costs in accuracy: fp8 e4m3 keeps 3 mantissa bits, so a value rounds by at most
// 2^-4 of itself (normals) and far less than that of the row max (subnormals: 2^-10 x scale);
// bf16 by at most 2^-8 of itself.
TEST(OpsStoreLatent, RoundTripWithinTheCacheDtypePrecision) {
  std::mt19937 rng(14);
  const int64_t T = 12, D = 576;
  auto rows = store_rows(T, D, rng);
  const std::vector<int64_t> slots = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  for (DType dtype : {DType::BF16, DType::F8_E4M3})
    for (const KernelEntry* k : host_kernels(OpId::store_latent, OpShape{.head_dim = D, .kv_dtype = dtype})) {
      TestPages c(dtype, 3, 4, D);
      fn_of<StoreLatentFn>(k)(StoreLatentArgs{rows.data(), T, D, slots.data(), c.pages});
      for (int64_t t = 0; t < T; ++t) {
        float amax = 0.0f;
        for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(rows[t * D + d]));
        double worst = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          const float x = rows[t * D + d];
          const float back = dtype == DType::BF16
                                 ? bf16_to_f32(reinterpret_cast<const uint16_t*>(c.bytes.data())[t * D + d])
                                 : fp8_e4m3_to_f32(c.bytes[t * D + d]) * c.scales[t];
          const double bound = dtype == DType::BF16 ? 0x1p-8 * std::fabs(x) : 0x1p-4 * amax;
          worst = std::max(worst, std::fabs(static_cast<double>(back) - x) - bound);
        }
        EXPECT_LE(worst, 0.0) << k->name << " " << dtype_name(dtype) << " row " << t << " max " << amax;
      }
    }
}

// A kernel's output in both precisions: exact calls (--exact) at kExact, default ones at kBf16Dot
// (kernels may round the queries and probabilities to bf16 there: cpu.mla_attention_avx512bf16,
// the AMX one).
void expect_mla_matches(const KernelEntry* k, const PagedMla& c, const std::vector<float>& ref) {
  for (bool exact : {true, false}) {
    std::vector<float> out(ref.size(), NAN);
    MlaAttentionArgs args = c.args(out.data());
    args.exact = exact;
    fn_of<MlaAttentionFn>(k)(args);
    EXPECT_LE(normalized_error(out, ref), exact ? kExact : kBf16Dot)
        << k->name << (exact ? " exact " : " ") << c.describe();
  }
}

// Every (heads, D, block size, cache dtype): lengths 1 (a single row), 17 and 100 (ending mid-
// block for blocks of 16 and 64) and 600 (3 chunks of the cpu kernel), in one call.
TEST(OpsMlaAttention, EveryHostKernelMatchesReferenceOnPagedCache) {
  std::mt19937 rng(9);
  for (int64_t heads : {4, 8, 16, 32})
    for (DType dtype : kKvDtypes) {
      const OpShape shape{.heads_per_rank = heads, .head_dim = 576, .kv_dtype = dtype};
      const auto kernels = host_kernels(OpId::mla_attention, shape);
      for (auto [kv_lora, rope] : {std::pair<int64_t, int64_t>{512, 64}, {40, 8}, {33, 3}})
        for (int64_t B : {1, 16, 64}) {
          if (kv_lora != 512 && heads != 8) continue;  // small D: one head count is enough
          PagedMla c(6, heads, kv_lora, rope, B, dtype, {17, 1, 600, 100}, rng);
          const auto ref = c.reference();
          for (const KernelEntry* k : kernels) expect_mla_matches(k, c, ref);
        }
    }
}

// Long contexts are split into spans whose partial softmax states are merged (cpu kernel: spans
// of >= 1024 rows when tokens are fewer than twice the threads), with ragged span ends; blocks
// of 512 rows put whole chunks inside one block (the cpu kernel reads fp32 rows in place there).
TEST(OpsMlaAttention, LongPagedCachesSplitIntoSpansMatchReference) {
  std::mt19937 rng(10);
  struct Case {
    int64_t heads, T, B;
    DType dtype;
  };
  const Case cases[] = {{16, 2, 64, DType::BF16}, {16, 2, 64, DType::F8_E4M3}, {16, 1, 64, DType::F32},
                        {8, 1, 1, DType::BF16},   {8, 2, 512, DType::F32},     {16, 1, 16, DType::F8_E4M3}};
  for (const Case& cs : cases) {
    const OpShape shape{.heads_per_rank = cs.heads, .head_dim = 576, .kv_dtype = cs.dtype};
    PagedMla c(cs.T, cs.heads, 512, 64, cs.B, cs.dtype, {5001, 2049}, rng);
    const auto ref = c.reference();
    for (const KernelEntry* k : host_kernels(OpId::mla_attention, shape)) expect_mla_matches(k, c, ref);
  }
}

// Prompt-shaped calls: runs of one sequence's consecutive tokens with causal lengths, which the
// AMX kernel takes on tiles (bf16 probabilities: kBf16Dot), alone, between decode
// tokens of other sequences, across its 4096-row packing spans (a run whose first groups end
// before the second span), and with D not a multiple of 32; exact calls stay at kExact.
TEST(OpsMlaAttention, PromptRunsMatchReference) {
  std::mt19937 rng(11);
  struct Case {
    int64_t heads, kv_lora, rope, B;
    std::vector<int32_t> lengths;
    std::vector<std::pair<int32_t, int32_t>> tokens;  // (sequence, kv_len)
  };
  auto run_of = [](int32_t seq, int32_t last_len, int32_t n) {
    std::vector<std::pair<int32_t, int32_t>> t;
    for (int32_t i = 0; i < n; ++i) t.push_back({seq, last_len - n + 1 + i});
    return t;
  };
  auto cat = [](std::vector<std::vector<std::pair<int32_t, int32_t>>> parts) {
    std::vector<std::pair<int32_t, int32_t>> t;
    for (auto& p : parts) t.insert(t.end(), p.begin(), p.end());
    return t;
  };
  std::vector<Case> cases;
  for (int64_t heads : {4, 8, 16, 32}) {
    cases.push_back({heads, 512, 64, 16, {300}, run_of(0, 300, 40)});
    cases.push_back({heads, 512, 64, 64, {77, 200}, cat({{{0, 77}}, run_of(1, 200, 24), {{0, 70}, {1, 5}}})});
  }
  cases.push_back({8, 64, 8, 16, {150}, run_of(0, 150, 150)});       // D = 72: padded to 96 in the tiles
  cases.push_back({16, 32, 16, 16, {40}, run_of(0, 40, 36)});         // tiny_qlora's attention (12 heads padded)
  cases.push_back({16, 512, 64, 64, {49}, run_of(0, 49, 49)});      // a whole prompt from an empty cache
  cases.push_back({4, 512, 64, 64, {4119}, run_of(0, 4119, 40)});  // spans 0 and 1
  for (const Case& cs : cases)
    for (DType dtype : kKvDtypes) {
      if (cs.lengths[0] > 4096 && dtype != DType::BF16) continue;  // the spans: one dtype is enough
      const int64_t T = static_cast<int64_t>(cs.tokens.size());
      PagedMla c(T, cs.heads, cs.kv_lora, cs.rope, cs.B, dtype, cs.lengths, rng);
      for (int64_t t = 0; t < T; ++t) {
        c.token_seq[t] = cs.tokens[t].first;
        c.kv_len[t] = cs.tokens[t].second;
      }
      const auto ref = c.reference();
      const OpShape shape{.heads_per_rank = cs.heads, .head_dim = cs.kv_lora + cs.rope, .kv_dtype = dtype};
      for (const KernelEntry* k : host_kernels(OpId::mla_attention, shape))
        if (k->backend == Backend::cpu) expect_mla_matches(k, c, ref);  // (not the reference against itself)
    }
}

ModelOpNeeds needs_with_heads(int64_t heads_per_rank, DType kv_dtype = DType::BF16) {
  return ModelOpNeeds{.matmul_dtypes = {DType::BF16, DType::F8_E4M3},
                      .embedding_dtype = DType::BF16,
                      .heads_per_rank = heads_per_rank,
                      .attention_head_dim = 576,
                      .kv_dtype = kv_dtype,
                      .num_experts = 64,
                      .top_k = 6};
}

const ResolvedOp& find_use(const OpTable& table, OpId op) {
  for (const ResolvedOp& r : table.resolved())
    if (r.op == op) return r;
  throw std::runtime_error("op not resolved");
}

// The seeds' production failure: a 12-head rank against a kernel that takes 4, 8 or 16k heads.
TEST(OpsMlaAttention, TwelveHeadsResolveToPadHeadsOnCpuAndMatchReference) {
  // 12 heads on one rank, and Kimi K3's 96 heads at tp 8 (12 per rank again)
  for (auto [heads, tp] : {std::pair<int64_t, int64_t>{12, 1}, {96, 8}, {1, 1}})
    for (DType dtype : kKvDtypes) {
      const int64_t per_rank = heads / tp;
      auto table = OpTable::resolve(Backend::cpu, needs_with_heads(per_rank, dtype));
      ASSERT_TRUE(table.ok()) << table.error().message;
      const Resolution& res = find_use(*table, OpId::mla_attention).resolution;
      ASSERT_EQ(res.kind, Resolution::Kind::pad_heads) << res.describe();
      EXPECT_EQ(res.pad_from, per_rank);
      EXPECT_EQ(res.pad_to, per_rank == 12 ? 16 : 4);
      EXPECT_EQ(res.kernel->backend, Backend::cpu);
      EXPECT_NE(res.describe().find(fmt::format("PadHeads{{{}->{}}}", per_rank, res.pad_to)), std::string::npos);
      EXPECT_EQ(find_use(*table, OpId::store_latent).resolution.kind, Resolution::Kind::kernel);

      std::mt19937 rng(10 + heads);
      for (int64_t T : {1, 3, 17}) {
        PagedMla c(T, per_rank, 512, 64, 16, dtype, {1, 17, 600}, rng);
        const auto ref = c.reference();
        for (bool exact : {true, false}) {  // the table passes its precision to the padded call
          table->set_exact_activations(exact);
          std::vector<float> out(ref.size(), NAN);
          table->mla_attention(c.args(out.data()));
          EXPECT_LE(normalized_error(out, ref), exact ? kExact : kBf16Dot)
              << "tp=" << tp << (exact ? " exact " : " ") << c.describe();
        }
      }
    }
}

TEST(OpsMlaAttention, SupportedHeadCountsResolveToKernelWithoutPadding) {
  for (int64_t heads : {4, 8, 16, 32, 128}) {
    auto table = OpTable::resolve(Backend::cpu, needs_with_heads(heads));
    ASSERT_TRUE(table.ok());
    EXPECT_EQ(find_use(*table, OpId::mla_attention).resolution.kind, Resolution::Kind::kernel) << heads;
  }
}

// ---- sampling ops: every host kernel, rows with ties -------------------------------------------

std::vector<float> probs_with_ties(int64_t T, int64_t n, std::mt19937& rng) {
  std::vector<float> p(T * n);
  std::uniform_int_distribution<int> level(1, 6);  // few distinct values: many ties
  for (float& v : p) v = static_cast<float>(level(rng));
  for (int64_t t = 0; t < T; ++t) {
    float sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += p[t * n + i];
    for (int64_t i = 0; i < n; ++i) p[t * n + i] /= sum;
  }
  return p;
}

TEST(OpsSampling, RenormAndSampleKernelsMatchReferenceWithTies) {
  std::mt19937 rng(11);
  for (int64_t n : {1, 7, 50, 1000}) {
    const int64_t T = 5;
    const auto p0 = probs_with_ties(T, n, rng);
    const std::vector<int32_t> ks = {1, 2, 5, static_cast<int32_t>(n), static_cast<int32_t>(n + 3)};
    const std::vector<float> top_ps = {0.1f, 0.5f, 0.9f, 1.0f, 0.0001f};
    const std::vector<float> min_ps = {0.0f, 0.5f, 0.9f, 1.0f, 0.2f};
    const std::vector<float> us = {0.0f, 0.3f, 0.5f, 0.999f, 0.7f};
    for (const KernelEntry* k : host_kernels(OpId::top_k_renorm_prob, {})) {
      auto ref = p0, out = p0;
      fn_of<TopKRenormFn>(reference_kernel(OpId::top_k_renorm_prob))(ref.data(), T, n, ks.data());
      fn_of<TopKRenormFn>(k)(out.data(), T, n, ks.data());
      EXPECT_LE(normalized_error(out, ref), kExact) << k->name << " n=" << n;
    }
    for (const KernelEntry* k : host_kernels(OpId::top_p_renorm_prob, {})) {
      auto ref = p0, out = p0;
      fn_of<TopPRenormFn>(reference_kernel(OpId::top_p_renorm_prob))(ref.data(), T, n, top_ps.data());
      fn_of<TopPRenormFn>(k)(out.data(), T, n, top_ps.data());
      EXPECT_LE(normalized_error(out, ref), kExact) << k->name << " n=" << n;
    }
    for (const KernelEntry* k : host_kernels(OpId::min_p_renorm_prob, {})) {
      auto ref = p0, out = p0;
      fn_of<MinPRenormFn>(reference_kernel(OpId::min_p_renorm_prob))(ref.data(), T, n, min_ps.data());
      fn_of<MinPRenormFn>(k)(out.data(), T, n, min_ps.data());
      EXPECT_LE(normalized_error(out, ref), kExact) << k->name << " n=" << n;
    }
    for (const KernelEntry* k : host_kernels(OpId::sample_from_probs, {})) {
      std::vector<int32_t> ref(T), out(T, -1);
      fn_of<SampleFromProbsFn>(reference_kernel(OpId::sample_from_probs))(p0.data(), T, n, us.data(), ref.data());
      fn_of<SampleFromProbsFn>(k)(p0.data(), T, n, us.data(), out.data());
      EXPECT_EQ(out, ref) << k->name << " n=" << n;
    }
  }
}

TEST(OpsMoeRoute, EveryHostKernelMatchesReference) {
  std::mt19937 rng(12);
  for (const KernelEntry* k : host_kernels(OpId::moe_route, OpShape{.num_experts = 64, .top_k = 6}))
    for (bool sigmoid : {true, false}) {
      const int64_t T = 3, E = 64, K = 6;
      const auto logits = randn(T * E, rng), bias = randn(E, rng, 0.1f);
      std::vector<int32_t> ref_ids(T * K), ids(T * K);
      std::vector<float> ref_w(T * K), w(T * K);
      MoeRouteArgs a{logits.data(), sigmoid ? bias.data() : nullptr, T, E, K, 8, 3, sigmoid, true,
                     sigmoid, sigmoid, 2.5f, ref_ids.data(), ref_w.data()};
      fn_of<MoeRouteFn>(reference_kernel(OpId::moe_route))(a);
      a.topk_ids = ids.data();
      a.topk_weights = w.data();
      fn_of<MoeRouteFn>(k)(a);
      EXPECT_EQ(ids, ref_ids) << k->name;
      EXPECT_LE(normalized_error(w, ref_w), kExact) << k->name;
    }
}

// ---- registry: parity, fallbacks, reasons ------------------------------------------------------

// An op with a kernel on one compiled backend must have a kernel or a declared fallback on every
// other compiled backend: the seeds' sampling op that existed on CUDA but not on ROCm.
TEST(OpsRegistry, EveryOpOnEveryCompiledBackendHasAKernelOrDeclaredFallback) {
  const auto backends = reg().compiled_backends();
  ASSERT_GE(backends.size(), 2u);  // reference and cpu always
  for (int i = 0; i < kNumOps; ++i) {
    const OpId op = static_cast<OpId>(i);
    for (Backend has : backends) {
      if (reg().kernels(op, has).empty()) continue;
      for (Backend other : backends)
        EXPECT_TRUE(!reg().kernels(op, other).empty() || !reg().fallbacks(op, other).empty())
            << kOpNames[i] << " has a " << backend_name(has) << " kernel but neither a kernel nor a "
            << "declared fallback on " << backend_name(other);
    }
  }
}

TEST(OpsRegistry, CpuPicksTheFastestKernelThisCpuRuns) {
  auto table = OpTable::resolve(Backend::cpu, needs_with_heads(16));
  ASSERT_TRUE(table.ok());
  for (const ResolvedOp& r : table->resolved()) {
    ASSERT_TRUE(r.resolution.usable()) << r.use;
    if (r.op == OpId::matmul && r.shape.weight_dtype == DType::BF16 && cpu_has_isa("avx512bf16")) {
      EXPECT_EQ(r.resolution.kernel->name, cpu_has_isa("amx-bf16") ? "cpu.matmul_amx_bf16" : "cpu.matmul_avx512bf16");
    }
    // CPUs without AVX-512 BF16 (AVX2-only ones and AVX-512F-only servers; or MOAT_DISABLE_ISA=
    // amx-bf16,avx512bf16): the register-decoding kernel, not the portable ones that decode rows to
    // memory (the avx512 copy ran decode at ~10% of the bandwidth)
    if (r.op == OpId::matmul && !cpu_has_isa("avx512bf16") && cpu_has_isa("avx2")) {
      EXPECT_EQ(r.resolution.kernel->name, cpu_has_isa("avx512") ? "cpu.matmul_avx512fma" : "cpu.matmul_avx2fma")
          << r.use;
    }
    // every op has a cpu kernel now (sampling_kernels.cpp took the last fallbacks, paged-cache
    // ops included); the reference stays only as a declared fallback
    EXPECT_EQ(r.resolution.kind, Resolution::Kind::kernel) << r.use;
    EXPECT_EQ(r.resolution.kernel->backend, Backend::cpu) << r.use;
  }
}

TEST(OpsRegistry, UnsupportedNamesOpBackendAndReasons) {
  const Resolution res = reg().resolve(OpId::matmul, Backend::cpu, OpShape{.weight_dtype = DType::I8});
  EXPECT_EQ(res.kind, Resolution::Kind::unsupported);
  const std::string all = res.describe();
  EXPECT_NE(all.find("weight dtype I8"), std::string::npos) << all;
  EXPECT_NE(all.find("reference.matmul"), std::string::npos) << all;
  EXPECT_NE(all.find("cpu.matmul"), std::string::npos) << all;

  ModelOpNeeds needs = needs_with_heads(16);
  needs.matmul_dtypes.push_back(DType::I8);
  auto table = OpTable::resolve(Backend::cpu, needs);
  ASSERT_FALSE(table.ok());
  EXPECT_NE(table.error().message.find("matmul[I8] on cpu"), std::string::npos) << table.error().message;
}

TEST(OpsRegistry, ConstraintReasonsNameTheHeadsRule) {
  const HeadsConstraint h{.one_of = {4, 8}, .multiple_of = 16};
  EXPECT_EQ(h.describe(), "OneOf{4,8} | MultipleOf{16}");
  EXPECT_FALSE(h.allows(12));
  EXPECT_EQ(h.pad_target(12), 16);
  EXPECT_EQ(h.pad_target(5), 8);
  EXPECT_EQ(h.pad_target(17), 32);
  const Constraints c{.heads = h};
  const auto reasons = c.check(OpShape{.heads_per_rank = 12});
  ASSERT_EQ(reasons.size(), 1u);
  EXPECT_EQ(reasons[0], "heads per rank 12 not in OneOf{4,8} | MultipleOf{16}");
}

}  // namespace
}  // namespace moat::ops

namespace moat::ops {
namespace {

// docs/ops.md is generated (`moat doctor --ops-table --out docs/ops.md`); it must not drift from
// the registry. Builds without nvcc lack the cuda rows, so they only check that every kernel of
// theirs is listed.
TEST(OpsTable, DocsOpsMdIsCurrent) {
  std::ifstream f(std::string(MOAT_SOURCE_DIR) + "/docs/ops.md");
  ASSERT_TRUE(f) << "docs/ops.md missing: run moat doctor --ops-table --out docs/ops.md";
  const std::string doc((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto backends = Registry::global().compiled_backends();
  if (std::find(backends.begin(), backends.end(), Backend::cuda) != backends.end()) {
    EXPECT_EQ(doc, ops_table_markdown(Registry::global()))
        << "docs/ops.md is stale: run moat doctor --ops-table --out docs/ops.md";
  }
  for (const KernelEntry& k : Registry::global().all())
    EXPECT_NE(doc.find("`" + k.name + "`"), std::string::npos) << k.name << " missing from docs/ops.md";
}

}  // namespace
}  // namespace moat::ops
