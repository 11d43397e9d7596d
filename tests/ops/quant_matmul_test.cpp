// The 4-bit weight formats (MXFP4, INT4_G32) through every kernel that declares them:
//  - WeightMatrix::at() and every host matmul kernel against tests/golden/quant/quant_fixture.safetensors,
//    decoded by tools/make_quant_fixture.py with numpy from the published format descriptions
//    (compressed-tensors MXFP4 and INT4, gpt-oss blocks), e8m0 edge scales 0, 1, 126, 127, 128 and
//    254 included;
//  - parity of every host matmul kernel with the reference over shapes: T = 1..5, 8, 11 and 16 (on
//    cpu.matmul_avx512bf16, the register-decoding tiles; on AMX 12-64 are dequantized strips), 17,
//    64 and 129 (its dequantized panels; AMX's from 129); in =
//    32, 96, 160 (ragged 128-blocks), 2080 (column blocks past 2048), 3584 (Kimi K3's latent
//    width); out not a multiple of 16; exact and default precision;
//  - moe_experts with MXFP4 and INT4 experts through the cpu op table against the reference;
//  - the cuda kernel against the reference where a device exists (reported as skipped otherwise).
// Tolerances (normalized error, max|out - ref| / max|ref|): 1e-5 for fp32-accurate kernels (the
// reference, the f32 FMA kernels, cpu.matmul_avx512bf16 with x split into bf16 hi + lo); 2e-4 for
// its decode-sized calls at the default precision (x quantized to int16 per 32 elements: ~2e-5
// measured, where rounding x to bf16 measured ~2e-3, so going back to bf16 fails here); 1e-2 where
// x is rounded to bf16 (its batched calls: dequantized panels).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/thread_pool.h"
#include "base/weight.h"
#include "ops/dispatch.h"
#include "ops/registry.h"
#include "parity.h"

#ifdef MOAT_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace moat::ops {
namespace {

constexpr double kExact = 1e-5;
constexpr double kBf16Dot = 1e-2;
constexpr double kInt16Dot = 2e-4;
// Calls of at most this many tokens run the int16 tiles on every avx512bf16 / AMX kernel (the
// AMX kernel's register-decoding limit for 4-bit weights is 11, the avx512bf16 kernel's 16).
constexpr int64_t kInt16Tokens = 11;
constexpr DType kQ4[] = {DType::MXFP4, DType::INT4_G32};

using testing::normalized_error;
using testing::randn;
using testing::fn_of;

// Host matmul kernels (reference first) that accept `dtype` on this CPU; reports the others.
std::vector<const KernelEntry*> host_matmuls(DType dtype) {
  std::vector<const KernelEntry*> out;
  for (Backend b : {Backend::reference, Backend::cpu})
    for (const KernelEntry* k : Registry::global().kernels(OpId::matmul, b)) {
      const auto reasons = k->constraints.check(OpShape{.weight_dtype = dtype});
      if (reasons.empty()) out.push_back(k);
      else std::printf("  [not supported here] %s: %s\n", k->name.c_str(), reasons[0].c_str());
    }
  return out;
}

// cpu.matmul_avx512bf16 (and its AMX twin) splits x into bf16 hi + lo for 4-bit weights when the
// precision splits quantized weights (fp8_split) and T is within split_max_tokens; otherwise it
// quantizes x to int16 in decode-sized calls and rounds it to bf16 in batched ones.
// cpu.matmul_avx2fma quantizes x to int16 in its decode-sized calls (up to 10 tokens for MXFP4,
// 12 for INT4_G32; its 512-bit twin cpu.matmul_avx512fma 22 for both) unless the precision splits
// quantized weights; longer calls are fp32-accurate. Every other kernel is fp32-accurate.
bool is_fp32_fma_matmul(const KernelEntry* k) {
  return k->name == "cpu.matmul_avx2fma" || k->name == "cpu.matmul_avx512fma";
}
int64_t fma_int16_tokens(const KernelEntry* k, DType dtype) {
  if (k->name == "cpu.matmul_avx512fma") return 22;
  return dtype == DType::MXFP4 ? 10 : 12;
}
double tolerance(const KernelEntry* k, DType dtype, int64_t T, const MatmulPrecision& p) {
  if (is_fp32_fma_matmul(k)) return !p.fp8_split && T <= fma_int16_tokens(k, dtype) ? kInt16Dot : kExact;
  if (!testing::is_bf16_dot_matmul(k)) return kExact;
  if (p.fp8_split && T <= p.split_max_tokens) return kExact;
  return T <= kInt16Tokens ? kInt16Dot : kBf16Dot;
}

const MatmulPrecision kPrecisions[] = {MatmulPrecision::exact(), MatmulPrecision{}};

// ---- the fixture -------------------------------------------------------------------------------

// A safetensors file read whole (a few KiB): tensors by name.
struct Fixture {
  std::string bytes;
  nlohmann::json header;
  size_t data = 0;

  static Fixture load() {
    Fixture f;
    std::ifstream in(std::string(MOAT_SOURCE_DIR) + "/tests/golden/quant/quant_fixture.safetensors", std::ios::binary);
    EXPECT_TRUE(in) << "tests/golden/quant/quant_fixture.safetensors missing: run tools/make_quant_fixture.py";
    std::stringstream s;
    s << in.rdbuf();
    f.bytes = s.str();
    uint64_t n = 0;
    if (f.bytes.size() >= 8) std::memcpy(&n, f.bytes.data(), 8);
    f.header = nlohmann::json::parse(f.bytes.substr(8, n));
    f.data = 8 + n;
    return f;
  }
  const void* ptr(const std::string& name) const {
    EXPECT_TRUE(header.contains(name)) << name;
    return bytes.data() + data + header[name]["data_offsets"][0].get<size_t>();
  }
  std::vector<int64_t> shape(const std::string& name) const { return header[name]["shape"].get<std::vector<int64_t>>(); }
  std::vector<float> f32(const std::string& name) const {
    const auto& o = header[name]["data_offsets"];
    std::vector<float> v((o[1].get<size_t>() - o[0].get<size_t>()) / 4);
    std::memcpy(v.data(), ptr(name), v.size() * 4);
    return v;
  }
};

// The largest |out - ref| over [T, N] outputs, each row n of W measured against the size of its
// own products, max over t of sum_k |W[n, k] x[t, k]| (the fixture's rows span scales from 2^-127
// to 2^127, and one dot product can cancel to near zero, so neither max|ref| nor |ref| would do).
double per_row_error(const std::vector<float>& out, const std::vector<float>& ref, const std::vector<float>& w,
                     const std::vector<float>& x, int64_t T, int64_t N, int64_t K) {
  double worst = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    double size = 0.0, diff = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) s += std::fabs(static_cast<double>(w[n * K + k]) * x[t * K + k]);
      size = std::max(size, s);
      if (std::isnan(out[t * N + n])) return INFINITY;
      diff = std::max(diff, std::fabs(static_cast<double>(out[t * N + n]) - ref[t * N + n]));
    }
    worst = std::max(worst, size > 0 ? diff / size : diff);
  }
  return worst;
}

TEST(QuantFixture, AtDecodesLikeTheIndependentNumpyDecode) {
  const Fixture f = Fixture::load();
  const int64_t N = f.shape("mx.expected")[0], K = f.shape("mx.expected")[1];
  ASSERT_EQ(f.shape("mx.weight_packed"), (std::vector<int64_t>{N, K / 2}));
  const WeightMatrix mx = WeightMatrix::packed_4bit(DType::MXFP4, f.ptr("mx.weight_packed"), f.ptr("mx.weight_scale"), N, K);
  const WeightMatrix i4 =
      WeightMatrix::packed_4bit(DType::INT4_G32, f.ptr("int4.weight_packed"), f.ptr("int4.weight_scale"), N, K);
  const auto mx_want = f.f32("mx.expected"), i4_want = f.f32("int4.expected");
  int subnormal = 0, huge = 0;
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < K; ++c) {
      const float want = mx_want[r * K + c];
      ASSERT_EQ(mx.at(r, c), want) << "MXFP4 [" << r << ", " << c << "]";
      ASSERT_EQ(i4.at(r, c), i4_want[r * K + c]) << "INT4 [" << r << ", " << c << "]";
      subnormal += want != 0.0f && std::fabs(want) < std::numeric_limits<float>::min();
      huge += std::fabs(want) > 1e38f;
    }
  EXPECT_GT(subnormal, 0) << "the fixture should hold e8m0 scale 0 and 1 (fp32 subnormal values)";
  EXPECT_GT(huge, 0) << "the fixture should hold e8m0 scale 254";
  // bytes(): packed codes plus scales
  EXPECT_EQ(mx.bytes(), N * K / 2 + N * K / 32);
  EXPECT_EQ(i4.bytes(), N * K / 2 + N * K / 32 * 2);
  // rows(): a view of rows [3, 3 + 5)
  for (const auto& [w, want] : {std::pair{mx, &mx_want}, std::pair{i4, &i4_want}}) {
    const WeightMatrix v = w.rows(3, 5);
    for (int64_t r = 0; r < 5; ++r)
      for (int64_t c = 0; c < K; c += 7) EXPECT_EQ(v.at(r, c), (*want)[(3 + r) * K + c]) << dtype_name(w.dtype);
  }
}

TEST(QuantFixture, GptOssBlocksDecodeLikeNumpy) {
  const Fixture f = Fixture::load();
  const auto shape = f.shape("gptoss.w_blocks");  // [E, N, K/32, 16]
  ASSERT_EQ(shape.size(), 4u);
  const int64_t E = shape[0], N = shape[1], K = shape[2] * 32;
  const auto want = f.f32("gptoss.expected");
  const auto* blocks = static_cast<const uint8_t*>(f.ptr("gptoss.w_blocks"));
  const auto* scales = static_cast<const uint8_t*>(f.ptr("gptoss.w_scales"));
  for (int64_t e = 0; e < E; ++e) {
    // one expert's [N, K/32, 16] blocks are its [N, K/2] codes (what the loader's view takes)
    const WeightMatrix w =
        WeightMatrix::packed_4bit(DType::MXFP4, blocks + e * N * K / 2, scales + e * N * K / 32, N, K);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < K; ++c) ASSERT_EQ(w.at(r, c), want[(e * N + r) * K + c]) << e << " " << r << " " << c;
  }
}

TEST(QuantFixture, EveryHostMatmulKernelMatchesTheNumpyProduct) {
  const Fixture f = Fixture::load();
  const int64_t N = f.shape("mx.expected")[0], K = f.shape("mx.expected")[1], T = f.shape("x")[0];
  const auto x = f.f32("x");
  for (DType dtype : kQ4) {
    const std::string p = dtype == DType::MXFP4 ? "mx" : "int4";
    const WeightMatrix w =
        WeightMatrix::packed_4bit(dtype, f.ptr(p + ".weight_packed"), f.ptr(p + ".weight_scale"), N, K);
    const auto want = f.f32(p + ".y"), wf = f.f32(p + ".expected");
    for (const KernelEntry* k : host_matmuls(dtype))
      for (const MatmulPrecision& prec : kPrecisions)
        for (int64_t t : {int64_t{1}, int64_t{2}, T}) {  // decode tiles (1, 2 tokens) and the batched path (5)
          std::vector<float> out(static_cast<size_t>(t * N), NAN);
          fn_of<MatmulFn>(k)(x.data(), t, w, out.data(), prec);
          const std::vector<float> ref(want.begin(), want.begin() + t * N);
          EXPECT_LE(per_row_error(out, ref, wf, x, t, N, K), tolerance(k, dtype, t, prec))
              << k->name << " " << dtype_name(dtype) << " T=" << t << " fp8_split=" << prec.fp8_split;
        }
  }
}

// ---- random weights: parity with the reference ------------------------------------------------

struct Q4Weight {
  std::vector<uint8_t> packed, scales;
  WeightMatrix w;
};

// Random codes; MXFP4 scales 2^-9..2^3 (e8m0 118..130), INT4 scales |N(0, 0.02)| + 1e-3 in bf16.
Q4Weight make_q4(DType dtype, int64_t N, int64_t K, std::mt19937& rng) {
  Q4Weight q;
  q.packed.resize(static_cast<size_t>(N * K / 2));
  for (uint8_t& b : q.packed) b = static_cast<uint8_t>(rng());
  const int64_t groups = N * K / 32;
  if (dtype == DType::MXFP4) {
    std::uniform_int_distribution<int> s(118, 130);
    for (int64_t i = 0; i < groups; ++i) q.scales.push_back(static_cast<uint8_t>(s(rng)));
  } else {
    const auto v = randn(static_cast<size_t>(groups), rng, 0.02f);
    q.scales.resize(static_cast<size_t>(2 * groups));
    for (int64_t i = 0; i < groups; ++i) {
      const uint16_t b = f32_to_bf16(std::fabs(v[i]) + 1e-3f);
      std::memcpy(&q.scales[2 * i], &b, 2);
    }
  }
  q.w = WeightMatrix::packed_4bit(dtype, q.packed.data(), q.scales.data(), N, K);
  return q;
}

TEST(QuantMatmul, EveryHostKernelMatchesReference) {
  std::mt19937 rng(11);
  struct Shape {
    int64_t N, K;
  };
  // in = 32 (one group), 96 and 160 (ragged last 128-block), 2080 (the batched path's column blocks
  // past 2048), 3584 (Kimi K3's latent width: the routed experts' gate/up input); out 1, 5, 13, 37,
  // 70 (a 64-row panel + 6), 130: none a multiple of 16
  const Shape shapes[] = {{1, 32}, {5, 32}, {13, 96}, {37, 160}, {70, 2080}, {130, 3584}};
  for (DType dtype : kQ4) {
    const auto kernels = host_matmuls(dtype);
    ASSERT_GE(kernels.size(), 2u) << "reference and at least one cpu kernel";
    for (const Shape& s : shapes) {
      const Q4Weight q = make_q4(dtype, s.N, s.K, rng);
      std::vector<float> wf(static_cast<size_t>(s.N * s.K));  // decoded, for per_row_error's scale
      for (int64_t r = 0; r < s.N; ++r)
        for (int64_t c = 0; c < s.K; ++c) wf[r * s.K + c] = q.w.at(r, c);
      for (int64_t T : {1, 2, 3, 4, 5, 8, 10, 11, 12, 13, 16, 17, 64, 129}) {
        const auto x = randn(static_cast<size_t>(T * s.K), rng);
        std::vector<float> ref(static_cast<size_t>(T * s.N));
        fn_of<MatmulFn>(kernels[0])(x.data(), T, q.w, ref.data(), MatmulPrecision::exact());
        for (const KernelEntry* k : kernels)
          for (const MatmulPrecision& prec : kPrecisions) {
            std::vector<float> out(ref.size(), NAN);
            fn_of<MatmulFn>(k)(x.data(), T, q.w, out.data(), prec);
            // per row against the size of its products: one or five outputs of 32 products can
            // cancel to near zero, which max|ref| would divide by
            EXPECT_LE(per_row_error(out, ref, wf, x, T, s.N, s.K), tolerance(k, dtype, T, prec))
                << k->name << " " << dtype_name(dtype) << " N=" << s.N << " K=" << s.K << " T=" << T
                << " fp8_split=" << prec.fp8_split;
          }
      }
    }
  }
}

// The default 4-bit decode quantizes x to int16 per 32 values: on expert-sized rows its error is
// far below rounding x to bf16 (what batched calls and the exact reference with x rounded give),
// so a return to bf16 activations in decode-sized calls fails here.
TEST(QuantMatmul, DecodeActivationsAreMoreAccurateThanBf16) {
  std::mt19937 rng(15);
  const int64_t N = 256, K = 3584;
  const auto* ref_kernel = Registry::global().kernels(OpId::matmul, Backend::reference).front();
  for (DType dtype : kQ4) {
    const Q4Weight q = make_q4(dtype, N, K, rng);
    for (int64_t T : {1, 2, 8, 11}) {
      const auto x = randn(static_cast<size_t>(T * K), rng);
      std::vector<float> ref(static_cast<size_t>(T * N)), rounded(ref.size()), x_bf16(x.size());
      fn_of<MatmulFn>(ref_kernel)(x.data(), T, q.w, ref.data(), MatmulPrecision::exact());
      for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = bf16_to_f32(f32_to_bf16(x[i]));
      fn_of<MatmulFn>(ref_kernel)(x_bf16.data(), T, q.w, rounded.data(), MatmulPrecision::exact());
      const double bf16_error = normalized_error(rounded, ref);
      EXPECT_GT(bf16_error, 2.5 * kInt16Dot) << "x rounded to bf16 should fail the int16 bound: " << bf16_error;
      for (const KernelEntry* k : host_matmuls(dtype)) {
        if (!testing::is_bf16_dot_matmul(k) && !is_fp32_fma_matmul(k)) continue;
        std::vector<float> out(ref.size(), NAN);
        fn_of<MatmulFn>(k)(x.data(), T, q.w, out.data(), MatmulPrecision{});
        EXPECT_LE(normalized_error(out, ref), kInt16Dot)
            << k->name << " " << dtype_name(dtype) << " T=" << T << " (x rounded to bf16: " << bf16_error << ")";
      }
    }
  }
}

// A group of 4-bit weights sharing x (a KDA layer's or an expert's projections) equals one call per
// weight bit for bit: x is quantized once for all of them.
TEST(QuantMatmul, GroupsEqualSeparateCallsBitForBit) {
  std::mt19937 rng(14);
  for (DType dtype : kQ4) {
    std::vector<Q4Weight> weights;
    for (int64_t N : {37, 5, 64}) weights.push_back(make_q4(dtype, N, 160, rng));  // K: a ragged 128-block
    std::vector<const WeightMatrix*> ws;
    for (const Q4Weight& q : weights) ws.push_back(&q.w);
    for (const KernelEntry* k : host_matmuls(dtype)) {
      if (k->group_fn == nullptr) continue;
      for (int threads : {1, 2}) {
        ThreadPool pool(threads);
        ScopedThreadPool scope(pool);
        for (int64_t T : {1, 2, 5, 17})
          for (const MatmulPrecision& precision : kPrecisions) {
            const auto [grouped, separate] =
                testing::group_and_separate(k, randn(static_cast<size_t>(T * 160), rng), T, ws, precision);
            for (size_t i = 0; i < weights.size(); ++i)
              EXPECT_EQ(grouped[i], separate[i]) << k->name << " " << dtype_name(dtype) << " weight " << i << " T=" << T;
          }
      }
    }
  }
}

// A sub-view (rows()) multiplies like the same rows of the whole matrix, on every kernel: the
// offsets of the codes and of the scales move together.
TEST(QuantMatmul, RowViewsMatchTheWholeMatrix) {
  std::mt19937 rng(12);
  for (DType dtype : kQ4) {
    const Q4Weight q = make_q4(dtype, 40, 256, rng);
    const WeightMatrix view = q.w.rows(13, 20);
    const auto x = randn(3 * 256, rng);
    for (const KernelEntry* k : host_matmuls(dtype)) {
      std::vector<float> all(3 * 40), part(3 * 20);
      fn_of<MatmulFn>(k)(x.data(), 3, q.w, all.data(), MatmulPrecision::exact());
      fn_of<MatmulFn>(k)(x.data(), 3, view, part.data(), MatmulPrecision::exact());
      std::vector<float> same(3 * 20);
      for (int64_t t = 0; t < 3; ++t)
        for (int64_t n = 0; n < 20; ++n) same[t * 20 + n] = all[t * 40 + 13 + n];
      EXPECT_LE(normalized_error(part, same), 1e-6) << k->name << " " << dtype_name(dtype);
    }
  }
}

// ---- moe_experts with 4-bit experts ------------------------------------------------------------

OpTable q4_table(DType expert_dtype, bool exact) {
  auto t = OpTable::resolve(Backend::cpu, ModelOpNeeds{.matmul_dtypes = {DType::BF16, DType::F32, expert_dtype},
                                                       .heads_per_rank = 16,
                                                       .attention_head_dim = 576,
                                                       .num_experts = 8,
                                                       .top_k = 3,
                                                       .expert_dtype = expert_dtype});
  EXPECT_TRUE(t.ok()) << t.error().message;
  t->set_exact_activations(exact);
  return std::move(t).value();
}

TEST(QuantMoeExperts, CpuTableMatchesReference) {
  std::mt19937 rng(13);
  const int64_t H = 96, I = 64, E = 8, K = 3;
  const auto* ref = Registry::global().kernels(OpId::moe_experts, Backend::reference).front();
  for (DType dtype : kQ4) {
    OpTable exact = q4_table(dtype, true), fast = q4_table(dtype, false);
    for (const ResolvedOp& r : exact.resolved())
      if (r.op == OpId::moe_experts) {
        EXPECT_EQ(r.resolution.kind, Resolution::Kind::kernel) << r.use;
        EXPECT_EQ(r.resolution.kernel->backend, Backend::cpu) << r.use;
      }
    std::vector<Q4Weight> owned;
    owned.reserve(3 * E);
    std::vector<MlpWeights> experts(E);
    for (int64_t e = 0; e < E; ++e) {
      owned.push_back(make_q4(dtype, I, H, rng));
      experts[e].gate_proj = owned.back().w;
      owned.push_back(make_q4(dtype, I, H, rng));
      experts[e].up_proj = owned.back().w;
      owned.push_back(make_q4(dtype, H, I, rng));
      experts[e].down_proj = owned.back().w;
    }
    for (int64_t T : {1, 2, 3, 17, 40}) {
      const auto x = randn(static_cast<size_t>(T * H), rng), base = randn(static_cast<size_t>(T * H), rng);
      std::vector<int32_t> ids(static_cast<size_t>(T * K));
      std::vector<float> weights(ids.size());
      std::uniform_real_distribution<float> u(0.1f, 1.0f);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int32_t> pick = {0, 1, 2, 3, 4, 5};  // experts 6 and 7 get no rows
        std::shuffle(pick.begin(), pick.end(), rng);
        for (int64_t k = 0; k < K; ++k) {
          ids[t * K + k] = pick[k];
          weights[t * K + k] = u(rng);
        }
      }
      MoeExpertsArgs a{x.data(), T, H, K, ids.data(), weights.data(), experts.data(), E, I, nullptr};
      std::vector<float> want = base;
      a.out = want.data();
      fn_of<MoeExpertsFn>(ref)(a, exact.inner_ops());
      for (int threads : {1, 2}) {
        ThreadPool pool(threads);
        ScopedThreadPool scope(pool);
        for (const auto& [table, tol] : {std::pair<const OpTable*, double>{&exact, 1e-4}, {&fast, 2e-2}}) {
          std::vector<float> got = base;
          a.out = got.data();
          table->moe_experts(a);
          EXPECT_LE(normalized_error(got, want), tol)
              << dtype_name(dtype) << " T=" << T << " threads=" << threads << (table == &exact ? " exact" : " default");
        }
      }
    }
  }
}

// ---- registry ----------------------------------------------------------------------------------

TEST(QuantRegistry, FourBitMatmulsResolveOnEveryCompiledBackend) {
  for (DType dtype : kQ4)
    for (Backend b : Registry::global().compiled_backends()) {
      const Resolution r = Registry::global().resolve(OpId::matmul, b, OpShape{.weight_dtype = dtype});
      EXPECT_TRUE(r.usable()) << dtype_name(dtype) << " on " << backend_name(b) << ": " << r.describe();
      if (b == Backend::cpu && cpu_has_isa("avx512bf16")) {
        EXPECT_EQ(r.kernel->name, cpu_has_isa("amx-bf16") ? "cpu.matmul_amx_bf16" : "cpu.matmul_avx512bf16");
      }
      if (b == Backend::cuda) {
        EXPECT_EQ(r.kernel->name, "cuda.matmul_q4");
      }
      for (OpId op : {OpId::moe_experts, OpId::head_matmul})
        EXPECT_TRUE(Registry::global().resolve(op, b, OpShape{.weight_dtype = dtype, .num_experts = 8, .top_k = 3}).usable())
            << op_name(op) << " " << dtype_name(dtype) << " on " << backend_name(b);
    }
}

#ifdef MOAT_HAVE_CUDA
TEST(QuantCuda, MatmulMatchesReference) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << "no usable CUDA device: " << why;
  std::mt19937 rng(14);
  const auto* k = Registry::global().resolve(OpId::matmul, Backend::cuda, OpShape{.weight_dtype = DType::MXFP4}).kernel;
  ASSERT_NE(k, nullptr);
  const auto* ref = Registry::global().kernels(OpId::matmul, Backend::reference).front();
  auto upload = [](const void* p, size_t n) {
    void* d = cuda::device_alloc(n);
    cuda::copy_to_device(d, p, n);
    return d;
  };
  for (DType dtype : kQ4)
    for (auto [N, K] : {std::pair<int64_t, int64_t>{5, 32}, {37, 160}, {130, 3584}})
      for (int64_t T : {1, 3, 17}) {
        const Q4Weight q = make_q4(dtype, N, K, rng);
        const auto x = randn(static_cast<size_t>(T * K), rng);
        std::vector<float> want(static_cast<size_t>(T * N)), got(want.size());
        fn_of<MatmulFn>(ref)(x.data(), T, q.w, want.data(), MatmulPrecision::exact());
        WeightMatrix dw = q.w;
        dw.data = upload(q.packed.data(), q.packed.size());
        dw.group_scales = upload(q.scales.data(), q.scales.size());
        float* dx = static_cast<float*>(upload(x.data(), 4 * x.size()));
        float* dy = static_cast<float*>(cuda::device_alloc(4 * got.size()));
        fn_of<MatmulFn>(k)(dx, T, dw, dy, MatmulPrecision::exact());
        cuda::synchronize();
        cuda::copy_to_host(got.data(), dy, 4 * got.size());
        EXPECT_LE(normalized_error(got, want), kExact) << dtype_name(dtype) << " N=" << N << " K=" << K << " T=" << T;
        for (void* p : {const_cast<void*>(dw.data), const_cast<void*>(dw.group_scales), static_cast<void*>(dx),
                        static_cast<void*>(dy)})
          cuda::device_free(p);
      }
}
#endif

}  // namespace
}  // namespace moat::ops
