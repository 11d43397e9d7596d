// Kimi K3's ops (situ_mul, sigmoid_mul, attn_res_mix) and moe_experts with the SiTU activation on
// the host backends:
//   - each reference kernel against a double formula written here, with different identities
//     (tanh through expm1, a sign-split sigmoid, the softmax through log-sum-exp), so the oracle
//     itself is checked;
//   - every host kernel this CPU runs (every ISA variant) against the reference on random inputs
//     at T = 1, 3, 70 and n / dim = 16, 128, 7168 plus widths that leave vector tails, rows 1..9,
//     and the edges: |gate| up to 60, the vtanh switch points (|g / beta| = 0.5), saturating up,
//     all-equal rows, huge-magnitude rows (sums of squares beyond fp32's range), zero rows, a row
//     whose score dominates, pools of 1 and 3 threads;
//   - moe_experts with GatedActivation::situ (reference and the cpu composite through the cpu
//     op table's InnerOps) against a scalar composition here;
//   - resolution: the three ops are planned only with ModelOpNeeds::k3_ops, and then resolve to
//     cpu kernels (the registry-wide coverage check is ops_test.cpp's, over every op).
//
// Tolerances: kElem 4e-6 relative per element for the elementwise ops (vexp and vtanh are ~2
// ulp, a few roundings on top); kExact 1e-5 normalized error per token for attn_res_mix (row sums
// in double, the weighted sum in fp32); kOracle 2.5e-7 relative per element for the reference
// against the formula (one fp32 rounding of two double results); moe_experts as
// composite_ops_test.cpp: 1e-4 for fp32-accurate inner matmuls, 2e-2 where they round to bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "base/dtype.h"
#include "base/thread_pool.h"
#include "base/weight.h"
#include "ops/dispatch.h"
#include "ops/registry.h"
#include "parity.h"

namespace moat::ops {
namespace {

constexpr double kElem = 4e-6;
constexpr double kExact = 1e-5;
constexpr double kOracle = 2.5e-7;
constexpr double kMoeExact = 1e-4;
constexpr double kMoeBf16 = 2e-2;

using testing::normalized_error;
using testing::randn;
using testing::fn_of;

const Registry& reg() { return Registry::global(); }

// The reference kernel first, then every cpu kernel this CPU runs; reports the ones skipped.
std::vector<const KernelEntry*> host_kernels(OpId op) {
  std::vector<const KernelEntry*> out = testing::host_kernels(op, {});
  EXPECT_FALSE(out.empty());
  if (!out.empty()) {
    EXPECT_EQ(out.front()->backend, Backend::reference) << op_name(op);
  }
  return out;
}

// Largest |out - ref| / |ref| over the elements (|ref| floored at `floor`); NaN on one side only
// is infinite.
double max_relative_error(const std::vector<float>& out, const std::vector<float>& ref, double floor = 1e-30) {
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(out[i]) != std::isnan(ref[i])) return INFINITY;
    if (std::isnan(ref[i])) continue;
    const double d = std::fabs(static_cast<double>(out[i]) - ref[i]);
    worst = std::max(worst, d / std::max(std::fabs(static_cast<double>(ref[i])), floor));
  }
  return worst;
}

// ---- the formulas, in double, by other identities than the reference's ------------------------

double tanh_by_expm1(double x) {  // tanh x = expm1(2x) / (expm1(2x) + 2), by symmetry for x < 0
  const double e = std::expm1(2.0 * std::fabs(x));
  const double t = std::isinf(e) ? 1.0 : e / (e + 2.0);
  return x < 0 ? -t : t;
}
double sigmoid_split(double x) {  // never exp of a large positive argument
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}
double situ_formula(double g, double u, double beta, double linear_beta) {
  return beta * tanh_by_expm1(g / beta) * sigmoid_split(g) * linear_beta * tanh_by_expm1(u / linear_beta);
}

// gate values: N(0, 4) with the edges written over the first entries: +-60, the points where
// g / beta = +-0.5 (vtanh switches from its series to exp there), zeros, tiny, moderate.
std::vector<float> gate_values(size_t n, std::mt19937& rng, float beta) {
  auto g = randn(n, rng, 4.0f);
  const float edges[] = {60.0f, -60.0f, 0.0f, 0.5f * beta, -0.5f * beta, std::nextafter(0.5f * beta, 0.0f),
                         1e-7f, -1e-7f, 30.0f, -30.0f, 9.0f, -9.0f, 45.0f, -45.0f, 0.1f, -17.0f};
  for (size_t i = 0; i < std::min(n, std::size(edges)); ++i) g[i] = edges[i];
  if (n > 64) g[n - 1] = -60.0f, g[n / 2] = 60.0f;
  return g;
}
// up values: N(0, 10) with saturating (+-200), the series switch points of tanh(u / 25), zeros.
std::vector<float> up_values(size_t n, std::mt19937& rng, float linear_beta) {
  auto u = randn(n, rng, 10.0f);
  const float edges[] = {200.0f, -200.0f, 0.5f * linear_beta, -0.5f * linear_beta, 0.0f, 1e-6f, 1.0f, -3.0f};
  for (size_t i = 0; i < std::min(n, std::size(edges)); ++i) u[n - 1 - i] = edges[i];
  return u;
}

// ---- situ_mul ----------------------------------------------------------------------------------

TEST(K3SituMul, ReferenceIsTheDoubleFormula) {
  std::mt19937 rng(301);
  const auto* ref = reg().kernels(OpId::situ_mul, Backend::reference).front();
  for (auto [beta, linear_beta] : {std::pair{4.0f, 25.0f}, std::pair{1.0f, 3.0f}}) {
    const int64_t T = 3, n = 700;
    const auto g = gate_values(T * n, rng, beta), u = up_values(T * n, rng, linear_beta);
    std::vector<float> got(T * n), want(T * n);
    fn_of<SituMulFn>(ref)(g.data(), u.data(), T, n, beta, linear_beta, got.data());
    for (int64_t i = 0; i < T * n; ++i) want[i] = static_cast<float>(situ_formula(g[i], u[i], beta, linear_beta));
    EXPECT_LE(max_relative_error(got, want), kOracle) << "beta=" << beta;
    // the published values: g = u = 0 gives 0; large g gives the identity-like up branch
    EXPECT_EQ(got[2], 0.0f);
  }
}

TEST(K3SituMul, EveryHostKernelMatchesReference) {
  std::mt19937 rng(302);
  const auto kernels = host_kernels(OpId::situ_mul);
  for (auto [beta, linear_beta] : {std::pair{4.0f, 25.0f}, std::pair{2.0f, 5.0f}})
    for (int64_t n : {1, 15, 16, 33, 128, 7168})
      for (int64_t T : {1, 3, 70}) {
        const auto g = gate_values(T * n, rng, beta), u = up_values(T * n, rng, linear_beta);
        std::vector<float> ref(T * n);
        fn_of<SituMulFn>(kernels[0])(g.data(), u.data(), T, n, beta, linear_beta, ref.data());
        for (const KernelEntry* k : kernels) {
          std::vector<float> out(ref.size(), NAN);
          fn_of<SituMulFn>(k)(g.data(), u.data(), T, n, beta, linear_beta, out.data());
          EXPECT_LE(max_relative_error(out, ref), kElem) << k->name << " n=" << n << " T=" << T << " beta=" << beta;
          EXPECT_LE(normalized_error(out, ref), kExact) << k->name;
          auto alias = g;  // y may alias gate
          fn_of<SituMulFn>(k)(alias.data(), u.data(), T, n, beta, linear_beta, alias.data());
          EXPECT_LE(max_relative_error(alias, ref), kElem) << k->name << " aliased n=" << n << " T=" << T;
        }
      }
}

TEST(K3SituMul, SaturationAndNaN) {
  const auto kernels = host_kernels(OpId::situ_mul);
  // g = 60: tanh(15) and sigmoid(60) are 1 in fp32, so y = 4 * 25 * tanh(u / 25);
  // g = -60: sigmoid(-60) ~ 8.8e-27, a normal fp32 value the kernels must still get right.
  const std::vector<float> g = {60.0f, 60.0f, -60.0f, NAN, 1.0f, 0.0f};
  const std::vector<float> u = {1000.0f, -25.0f, 5.0f, 1.0f, NAN, 7.0f};
  for (const KernelEntry* k : kernels) {
    std::vector<float> y(g.size());
    fn_of<SituMulFn>(k)(g.data(), u.data(), 1, static_cast<int64_t>(g.size()), 4.0f, 25.0f, y.data());
    EXPECT_NEAR(y[0], 100.0f, 1e-4f) << k->name;
    EXPECT_NEAR(y[1], static_cast<float>(100.0 * std::tanh(-1.0)), 1e-4f) << k->name;
    EXPECT_NEAR(y[2] / static_cast<float>(situ_formula(-60.0, 5.0, 4.0, 25.0)), 1.0f, 1e-5f) << k->name;
    EXPECT_TRUE(std::isnan(y[3])) << k->name << " NaN gate";
    EXPECT_TRUE(std::isnan(y[4])) << k->name << " NaN up";
    EXPECT_EQ(y[5], 0.0f) << k->name;
  }
}

// ---- sigmoid_mul -------------------------------------------------------------------------------

TEST(K3SigmoidMul, ReferenceIsTheDoubleFormula) {
  std::mt19937 rng(303);
  const auto* ref = reg().kernels(OpId::sigmoid_mul, Backend::reference).front();
  const int64_t n = 2000;
  const auto x = randn(n, rng), gate = gate_values(n, rng, 4.0f);
  std::vector<float> got(n), want(n);
  fn_of<SigmoidMulFn>(ref)(x.data(), gate.data(), n, got.data());
  for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(x[i] * sigmoid_split(gate[i]));
  EXPECT_LE(max_relative_error(got, want), kOracle);
}

TEST(K3SigmoidMul, EveryHostKernelMatchesReference) {
  std::mt19937 rng(304);
  const auto kernels = host_kernels(OpId::sigmoid_mul);
  for (int64_t n : {1, 15, 16, 33, 128, 7168})
    for (int64_t T : {1, 3, 70}) {  // the model calls it on [T, heads * v] as one flat array
      const int64_t total = T * n;
      const auto x = randn(total, rng, 3.0f), gate = gate_values(total, rng, 4.0f);
      std::vector<float> ref(total);
      fn_of<SigmoidMulFn>(kernels[0])(x.data(), gate.data(), total, ref.data());
      for (const KernelEntry* k : kernels) {
        std::vector<float> out(total, NAN);
        fn_of<SigmoidMulFn>(k)(x.data(), gate.data(), total, out.data());
        EXPECT_LE(max_relative_error(out, ref), kElem) << k->name << " n=" << n << " T=" << T;
        auto alias = x;  // y may alias x
        fn_of<SigmoidMulFn>(k)(alias.data(), gate.data(), total, alias.data());
        EXPECT_LE(max_relative_error(alias, ref), kElem) << k->name << " aliased n=" << n << " T=" << T;
      }
    }
}

TEST(K3SigmoidMul, ExtremeGatesAndNaN) {
  const auto kernels = host_kernels(OpId::sigmoid_mul);
  const std::vector<float> x = {2.0f, 2.0f, 2.0f, 2.0f, 1.0f};
  const std::vector<float> gate = {100.0f, -100.0f, 0.0f, NAN, -60.0f};
  for (const KernelEntry* k : kernels) {
    std::vector<float> y(x.size());
    fn_of<SigmoidMulFn>(k)(x.data(), gate.data(), static_cast<int64_t>(x.size()), y.data());
    EXPECT_EQ(y[0], 2.0f) << k->name;
    EXPECT_GE(y[1], 0.0f) << k->name;
    EXPECT_LT(y[1], 1e-37f) << k->name;  // exp(-100): ~0 (the vector exp clamps at -87)
    EXPECT_EQ(y[2], 1.0f) << k->name;
    EXPECT_TRUE(std::isnan(y[3])) << k->name;
    EXPECT_NEAR(y[4] / static_cast<float>(sigmoid_split(-60.0)), 1.0f, 1e-5f) << k->name;
  }
}

// ---- attn_res_mix ------------------------------------------------------------------------------

// The mix written out in double with the softmax through log-sum-exp: out[t] = sum_r
// exp(score_r - lse) rows[r][t].
std::vector<float> attn_res_formula(const std::vector<std::vector<float>>& rows, const std::vector<float>& w,
                                    int64_t T, int64_t D, double eps) {
  const size_t R = rows.size();
  std::vector<float> out(static_cast<size_t>(T * D));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s(R);
    for (size_t r = 0; r < R; ++r) {
      double ss = 0.0, dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const double v = rows[r][t * D + d];
        ss += v * v;
        dot += v * w[d];
      }
      const double rms = std::sqrt(ss / D + eps);
      s[r] = dot / rms;
    }
    const double m = *std::max_element(s.begin(), s.end());
    double z = 0.0;
    for (double v : s) z += std::exp(v - m);
    const double lse = m + std::log(z);
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0.0;
      for (size_t r = 0; r < R; ++r) acc += std::exp(s[r] - lse) * rows[r][t * D + d];
      out[t * D + d] = static_cast<float>(acc);
    }
  }
  return out;
}

// Runs an attn_res_mix kernel on rows held as vectors.
std::vector<float> run_mix(const KernelEntry* k, const std::vector<std::vector<float>>& rows,
                           const std::vector<float>& w, int64_t T, int64_t D, float eps) {
  std::vector<const float*> ptrs;
  for (const auto& r : rows) ptrs.push_back(r.data());
  std::vector<float> out(static_cast<size_t>(T * D), NAN);
  fn_of<AttnResMixFn>(k)(AttnResMixArgs{ptrs.data(), static_cast<int64_t>(rows.size()), T, D, w.data(), eps,
                                        out.data()});
  return out;
}

// Worst per-token normalized error (each token's output row on its own scale).
double per_token_error(const std::vector<float>& out, const std::vector<float>& ref, int64_t T, int64_t D) {
  double worst = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> o(out.begin() + t * D, out.begin() + (t + 1) * D);
    const std::vector<float> r(ref.begin() + t * D, ref.begin() + (t + 1) * D);
    worst = std::max(worst, normalized_error(o, r));
  }
  return worst;
}

// Rows as in a K3 residual bank: each token's row at its own scale (0.1 .. 30).
std::vector<std::vector<float>> bank(int64_t R, int64_t T, int64_t D, std::mt19937& rng) {
  std::uniform_real_distribution<float> scale(0.1f, 30.0f);
  std::vector<std::vector<float>> rows;
  for (int64_t r = 0; r < R; ++r) {
    auto v = randn(static_cast<size_t>(T * D), rng);
    for (int64_t t = 0; t < T; ++t) {
      const float s = scale(rng);
      for (int64_t d = 0; d < D; ++d) v[t * D + d] *= s;
    }
    rows.push_back(std::move(v));
  }
  return rows;
}

TEST(K3AttnResMix, ReferenceIsTheDoubleFormula) {
  std::mt19937 rng(305);
  const auto* ref = reg().kernels(OpId::attn_res_mix, Backend::reference).front();
  for (int64_t R : {1, 4, 9}) {
    const int64_t T = 3, D = 300;
    const auto rows = bank(R, T, D, rng);
    const auto w = randn(D, rng, 0.2f);
    EXPECT_LE(max_relative_error(run_mix(ref, rows, w, T, D, 1e-6f), attn_res_formula(rows, w, T, D, 1e-6f), 1e-6),
              1e-6)
        << "R=" << R;
  }
}

TEST(K3AttnResMix, EveryHostKernelMatchesReference) {
  std::mt19937 rng(306);
  const auto kernels = host_kernels(OpId::attn_res_mix);
  for (int64_t D : {16, 33, 128, 7168})
    for (int64_t T : {1, 3, 70})
      for (int64_t R = 1; R <= 9; ++R) {
        if (D == 7168 && T == 70 && R % 4 != 1) continue;  // R = 1, 5, 9 at the largest size
        const auto rows = bank(R, T, D, rng);
        // weights of scale 1/sqrt(D): scores of order 1, soft mixes (K3's trained case); and of
        // scale 1: scores of order sqrt(D), nearly one-hot
        for (float wscale : {1.0f / std::sqrt(static_cast<float>(D)), 1.0f}) {
          const auto w = randn(D, rng, wscale);
          const auto ref = run_mix(kernels[0], rows, w, T, D, 1e-6f);
          for (const KernelEntry* k : kernels)
            for (int threads : {1, 3}) {
              ThreadPool pool(threads);
              ScopedThreadPool scope(pool);
              EXPECT_LE(per_token_error(run_mix(k, rows, w, T, D, 1e-6f), ref, T, D), kExact)
                  << k->name << " D=" << D << " T=" << T << " R=" << R << " wscale=" << wscale
                  << " threads=" << threads;
            }
        }
      }
}

TEST(K3AttnResMix, ExtremeRows) {
  std::mt19937 rng(307);
  const auto kernels = host_kernels(OpId::attn_res_mix);
  const int64_t T = 3, D = 7168;
  const auto w = randn(D, rng, 1.0f / std::sqrt(static_cast<float>(D)));
  for (int64_t R : {1, 2, 9}) {
    // all rows equal: uniform p, the output is the row itself
    {
      const auto one = randn(static_cast<size_t>(T * D), rng, 5.0f);
      const std::vector<std::vector<float>> rows(static_cast<size_t>(R), one);
      for (const KernelEntry* k : kernels)
        EXPECT_LE(max_relative_error(run_mix(k, rows, w, T, D, 1e-6f), one, 1e-3), 2e-6)
            << k->name << " equal rows R=" << R;
    }
    // huge magnitudes: one row at 1e15 among ordinary ones (per-token error on the huge scale),
    // and every row at ~1e20, where a sum of squares overflows fp32 (7168 * 1e40)
    for (float huge : {1e15f, 1e20f}) {
      auto rows = bank(R, T, D, rng);
      if (huge < 1e16f) {
        for (float& v : rows[0]) v *= huge;
      } else {
        for (auto& r : rows)
          for (float& v : r) v *= huge / 30.0f;
      }
      const auto ref = run_mix(kernels[0], rows, w, T, D, 1e-6f);
      EXPECT_LE(per_token_error(ref, attn_res_formula(rows, w, T, D, 1e-6), T, D), 1e-6) << "reference";
      for (const KernelEntry* k : kernels)
        EXPECT_LE(per_token_error(run_mix(k, rows, w, T, D, 1e-6f), ref, T, D), kExact)
            << k->name << " huge=" << huge << " R=" << R;
    }
    // a zero row (score 0: rsqrt(eps) times 0) among ordinary ones, and a row whose score
    // dominates (it lies along the weight: score |w|^2 / rms(w) ~ sqrt(D) = 85 against ~1 for the
    // others) so p is one-hot on it
    {
      auto rows = bank(R, T, D, rng);
      std::fill(rows[0].begin(), rows[0].end(), 0.0f);
      if (R > 1)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t d = 0; d < D; ++d) rows[R - 1][t * D + d] = w[d] * 1e3f;
      const auto ref = run_mix(kernels[0], rows, w, T, D, 1e-6f);
      for (const KernelEntry* k : kernels)
        EXPECT_LE(per_token_error(run_mix(k, rows, w, T, D, 1e-6f), ref, T, D), kExact)
            << k->name << " zero / dominant rows R=" << R;
      if (R > 1) {
        EXPECT_LE(max_relative_error(std::vector<float>(ref.begin(), ref.begin() + D),
                                     std::vector<float>(rows[R - 1].begin(), rows[R - 1].begin() + D), 1e-3),
                  1e-6)
            << "the dominant row wins";
      }
    }
  }
}

// ---- moe_experts with SiTU -----------------------------------------------------------------------

struct OwnedWeight {
  std::vector<uint8_t> bytes;
  WeightMatrix w;
};

OwnedWeight make_weight(DType dtype, int64_t N, int64_t K, std::mt19937& rng) {
  OwnedWeight t;
  const auto vals = randn(static_cast<size_t>(N * K), rng, 0.3f);
  t.bytes.resize(static_cast<size_t>(N * K) * dtype_size(dtype));
  for (int64_t i = 0; i < N * K; ++i) {
    if (dtype == DType::F32) std::memcpy(&t.bytes[4 * i], &vals[i], 4);
    if (dtype == DType::BF16) {
      const uint16_t b = f32_to_bf16(vals[i]);
      std::memcpy(&t.bytes[2 * i], &b, 2);
    }
  }
  t.w = WeightMatrix{.dtype = dtype, .data = t.bytes.data(), .out_features = N, .in_features = K};
  return t;
}

OpTable k3_cpu_table(bool exact, bool k3_ops = true) {
  auto t = OpTable::resolve(Backend::cpu, ModelOpNeeds{.matmul_dtypes = {DType::F32, DType::BF16},
                                                       .heads_per_rank = 16,
                                                       .attention_head_dim = 576,
                                                       .num_experts = 8,
                                                       .top_k = 3,
                                                       .k3_ops = k3_ops});
  EXPECT_TRUE(t.ok()) << t.error().message;
  t->set_exact_activations(exact);
  return std::move(t).value();
}

TEST(K3MoeExperts, SituMatchesAScalarCompositionOnReferenceAndCpu) {
  std::mt19937 rng(308);
  OpTable exact = k3_cpu_table(true), fast = k3_cpu_table(false);
  ASSERT_NE(exact.inner_ops().situ_mul, nullptr);
  const int64_t H = 40, I = 24, E = 8, K = 3;
  const auto* ref = reg().kernels(OpId::moe_experts, Backend::reference).front();
  const auto cpu = reg().kernels(OpId::moe_experts, Backend::cpu);
  ASSERT_FALSE(cpu.empty());
  for (DType dtype : {DType::F32, DType::BF16})
    for (auto [beta, linear_beta] : {std::pair{4.0f, 25.0f}, std::pair{2.0f, 3.0f}}) {
      std::vector<OwnedWeight> owned;
      std::vector<MlpWeights> experts(E);
      owned.reserve(3 * E);
      for (int64_t e = 0; e < E; ++e) {
        owned.push_back(make_weight(dtype, I, H, rng));
        experts[e].gate_proj = owned.back().w;
        owned.push_back(make_weight(dtype, I, H, rng));
        experts[e].up_proj = owned.back().w;
        owned.push_back(make_weight(dtype, H, I, rng));
        experts[e].down_proj = owned.back().w;
      }
      for (int64_t T : {1, 3, 17}) {
        // x of scale 3: gate values up to ~20, so tanh(g / beta) saturates for some
        const auto x = randn(static_cast<size_t>(T * H), rng, 3.0f);
        const auto base = randn(static_cast<size_t>(T * H), rng);
        std::vector<int32_t> ids(static_cast<size_t>(T * K));
        std::vector<float> weights(ids.size());
        std::uniform_real_distribution<float> uw(0.1f, 1.0f);
        for (int64_t t = 0; t < T; ++t) {
          std::vector<int32_t> pick = {0, 1, 2, 3, 4, 5};  // experts 6 and 7 get no rows
          std::shuffle(pick.begin(), pick.end(), rng);
          for (int64_t k = 0; k < K; ++k) ids[t * K + k] = pick[k], weights[t * K + k] = uw(rng);
        }
        // the scalar composition: out[t] += sum_k w * down(situ(gate x, up x))
        std::vector<float> want = base;
        for (int64_t t = 0; t < T; ++t) {
          std::vector<double> y(H, 0.0);
          for (int64_t k = 0; k < K; ++k) {
            const MlpWeights& w = experts[ids[t * K + k]];
            std::vector<double> act(I);
            for (int64_t i = 0; i < I; ++i) {
              double g = 0.0, u = 0.0;
              for (int64_t j = 0; j < H; ++j) {
                g += static_cast<double>(x[t * H + j]) * w.gate_proj.at(i, j);
                u += static_cast<double>(x[t * H + j]) * w.up_proj.at(i, j);
              }
              act[i] = situ_formula(g, u, beta, linear_beta);
            }
            for (int64_t j = 0; j < H; ++j) {
              double d = 0.0;
              for (int64_t i = 0; i < I; ++i) d += act[i] * w.down_proj.at(j, i);
              y[j] += weights[t * K + k] * d;
            }
          }
          for (int64_t j = 0; j < H; ++j) want[t * H + j] += static_cast<float>(y[j]);
        }
        MoeExpertsArgs a{x.data(), T, H, K, ids.data(), weights.data(), experts.data(), E, I, nullptr};
        a.activation = GatedActivation::situ;
        a.situ_beta = beta;
        a.situ_linear_beta = linear_beta;
        std::vector<float> got = base;
        a.out = got.data();
        fn_of<MoeExpertsFn>(ref)(a, exact.inner_ops());
        EXPECT_LE(normalized_error(got, want), 1e-6) << "reference " << dtype_name(dtype) << " T=" << T;
        // and SiLU (the default) still differs: the activation really is switched
        MoeExpertsArgs silu = a;
        silu.activation = GatedActivation::silu;
        std::vector<float> silu_out = base;
        silu.out = silu_out.data();
        fn_of<MoeExpertsFn>(ref)(silu, exact.inner_ops());
        EXPECT_GT(normalized_error(silu_out, want), 1e-2);
        for (const KernelEntry* k : cpu)
          for (const OpTable* table : {&exact, &fast})
            for (int threads : {1, 2, 3}) {
              ThreadPool pool(threads);
              ScopedThreadPool scope(pool);
              got = base;
              a.out = got.data();
              fn_of<MoeExpertsFn>(k)(a, table->inner_ops());
              EXPECT_LE(normalized_error(got, want), table == &exact ? kMoeExact : kMoeBf16)
                  << k->name << (table == &exact ? " exact" : " default") << " " << dtype_name(dtype)
                  << " T=" << T << " threads=" << threads;
            }
        // through the op table, as the model calls it
        got = base;
        a.out = got.data();
        exact.moe_experts(a);
        EXPECT_LE(normalized_error(got, want), kMoeExact) << "OpTable::moe_experts";
      }
    }
}

TEST(K3MoeExpertsDeathTest, SituWithoutK3OpsNamesTheField) {
  OpTable table = k3_cpu_table(true, /*k3_ops=*/false);
  EXPECT_EQ(table.inner_ops().situ_mul, nullptr);
  const float x[4] = {}, w[1] = {1.0f};
  const int32_t ids[1] = {0};
  MlpWeights experts[1];
  float out[4] = {};
  MoeExpertsArgs a{x, 1, 4, 1, ids, w, experts, 1, 4, out};
  a.activation = GatedActivation::situ;
  EXPECT_DEATH(table.moe_experts(a), "k3_ops");
}

// ---- resolution --------------------------------------------------------------------------------

TEST(K3Registry, PlannedOnlyWithK3OpsAndResolvedToCpuKernels) {
  const OpId k3[] = {OpId::situ_mul, OpId::sigmoid_mul, OpId::attn_res_mix};
  ModelOpNeeds needs{.matmul_dtypes = {DType::BF16}, .heads_per_rank = 16, .attention_head_dim = 576};
  for (Backend b : reg().compiled_backends()) {
    for (const ResolvedOp& r : OpTable::plan(b, needs))
      for (OpId op : k3) EXPECT_NE(r.op, op) << "planned without k3_ops: " << r.use;
  }
  needs.k3_ops = true;
  for (Backend b : reg().compiled_backends()) {
    const auto plan = OpTable::plan(b, needs);
    for (OpId op : k3) {
      const auto it = std::find_if(plan.begin(), plan.end(), [&](const ResolvedOp& r) { return r.op == op; });
      ASSERT_NE(it, plan.end()) << op_name(op) << " on " << backend_name(b);
      EXPECT_EQ(it->use, std::string(op_name(op)));
      EXPECT_TRUE(it->resolution.usable()) << it->resolution.describe();
      if (b == Backend::cpu && cpu_has_isa("avx2")) {
        EXPECT_EQ(it->resolution.kind, Resolution::Kind::kernel) << op_name(op);
        EXPECT_EQ(it->resolution.kernel->name,
                  fmt::format("cpu.{}_{}", op_name(op), cpu_has_isa("avx512") ? "avx512" : "avx2"));
      }
    }
  }
  auto table = OpTable::resolve(Backend::cpu, needs);
  ASSERT_TRUE(table.ok()) << table.error().message;
  // the table's methods run the resolved kernels
  const std::vector<float> g = {1.0f, -2.0f}, u = {3.0f, 4.0f};
  std::vector<float> y(2);
  table->situ_mul(g.data(), u.data(), 1, 2, 4.0f, 25.0f, y.data());
  EXPECT_NEAR(y[0], situ_formula(1.0, 3.0, 4.0, 25.0), 1e-6);
  table->sigmoid_mul(u.data(), g.data(), 2, y.data());
  EXPECT_NEAR(y[1], 4.0 * sigmoid_split(-2.0), 1e-6);
  EXPECT_NE(table->inner_ops().situ_mul, nullptr);
}

}  // namespace
}  // namespace moat::ops
