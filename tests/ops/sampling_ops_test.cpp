// The cpu sampling kernels (top-k / top-p / min-p renorm, sample_from_probs) and moe_route against
// the reference kernels, every ISA variant this CPU runs: random rows (peaked softmax rows, flat
// ones, rows made of a few repeated values so ties sit on every threshold), k >= vocab, p = 1, and
// one call whose rows each carry different parameters. The kept set must be the reference's
// exactly (same zeros); kept values within kExact (sums in double in another order); token and
// expert ids equal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "ops/dispatch.h"
#include "ops/registry.h"
#include "parity.h"

namespace moat::ops {
namespace {

using testing::fn_of;

constexpr double kExact = 1e-5;

const KernelEntry* reference_of(OpId op) {
  auto ks = Registry::global().kernels(op, Backend::reference);
  EXPECT_EQ(ks.size(), 1u);
  return ks.front();
}

// The cpu kernels of `op` this CPU runs; the ones it cannot are reported, not passed.
std::vector<const KernelEntry*> cpu_kernels_of(OpId op) {
  std::vector<const KernelEntry*> out;
  for (const KernelEntry* k : Registry::global().kernels(op, Backend::cpu)) {
    auto reasons = k->constraints.check(OpShape{});
    if (reasons.empty())
      out.push_back(k);
    else
      std::printf("  [not supported here] %s: %s\n", k->name.c_str(), reasons[0].c_str());
  }
  EXPECT_FALSE(out.empty()) << "no cpu kernel for " << op_name(op) << " runs on this CPU";
  return out;
}

enum class RowKind { peaked, flat, ties, equal };

// Rows of probabilities [T, n] of the given kind (each row sums to 1 up to rounding).
std::vector<float> make_probs(int64_t T, int64_t n, RowKind kind, std::mt19937& rng) {
  std::vector<float> p(static_cast<size_t>(T * n));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> level(1, 6);
  for (int64_t t = 0; t < T; ++t) {
    float* row = p.data() + t * n;
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      switch (kind) {
        case RowKind::peaked: row[i] = std::exp(3.0f * normal(rng)); break;  // a long tail, a few large
        case RowKind::flat: row[i] = std::exp(0.05f * normal(rng)); break;   // high temperature
        case RowKind::ties: row[i] = static_cast<float>(level(rng)); break;
        case RowKind::equal: row[i] = 1.0f; break;
      }
      sum += row[i];
    }
    for (int64_t i = 0; i < n; ++i) row[i] = static_cast<float>(row[i] / sum);
  }
  return p;
}

// Same zeros as the reference (the kept set, ties included) and the kept values within kExact.
void expect_same_renorm(const std::vector<float>& out, const std::vector<float>& ref, const std::string& what) {
  ASSERT_EQ(out.size(), ref.size());
  double max_diff = 0.0, max_ref = 0.0;
  int64_t zeros_differ = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i) {
    if ((out[i] == 0.0f) != (ref[i] == 0.0f)) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++zeros_differ;
    }
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(out[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
  }
  EXPECT_EQ(zeros_differ, 0) << what << ": kept sets differ, first at " << first << " (out " << out[first]
                             << ", ref " << ref[first] << ")";
  EXPECT_LE(max_diff / max_ref, kExact) << what;
}

const char* kind_name(RowKind k) {
  switch (k) {
    case RowKind::peaked: return "peaked";
    case RowKind::flat: return "flat";
    case RowKind::ties: return "ties";
    case RowKind::equal: return "equal";
  }
  return "?";
}

constexpr RowKind kKinds[] = {RowKind::peaked, RowKind::flat, RowKind::ties, RowKind::equal};

TEST(OpsSamplingKernels, TopKMatchesReferenceWithTiesAndKBeyondVocab) {
  std::mt19937 rng(21);
  for (int64_t n : {1, 7, 16, 50, 1000, 4099, 160000})
    for (RowKind kind : kKinds) {
      // Per-row parameters in one call: off (0, -1), 1, small, around the group-bound limit n/16,
      // beyond it, n - 1, n, beyond n.
      const std::vector<int32_t> ks = {0, 1, 2, 50, static_cast<int32_t>(std::max<int64_t>(1, n / 16)),
                                       static_cast<int32_t>(n / 16 + 1), static_cast<int32_t>(n / 3 + 1),
                                       static_cast<int32_t>(std::max<int64_t>(1, n - 1)), static_cast<int32_t>(n),
                                       static_cast<int32_t>(n + 3), -1};
      const int64_t T = static_cast<int64_t>(ks.size());
      const auto p0 = make_probs(T, n, kind, rng);
      auto ref = p0;
      fn_of<TopKRenormFn>(reference_of(OpId::top_k_renorm_prob))(ref.data(), T, n, ks.data());
      for (const KernelEntry* k : cpu_kernels_of(OpId::top_k_renorm_prob)) {
        auto out = p0;
        fn_of<TopKRenormFn>(k)(out.data(), T, n, ks.data());
        expect_same_renorm(out, ref, k->name + " n=" + std::to_string(n) + " " + kind_name(kind));
      }
    }
}

TEST(OpsSamplingKernels, TopPMatchesReferenceWithTiesAndPOne) {
  std::mt19937 rng(22);
  const std::vector<float> ps = {0.0001f, 0.1f, 0.5f, 0.75f, 0.9f, 0.95f, 0.999f, 1.0f};
  for (int64_t n : {1, 7, 16, 50, 1000, 4099, 160000})
    for (RowKind kind : kKinds) {
      const int64_t T = static_cast<int64_t>(ps.size());
      const auto p0 = make_probs(T, n, kind, rng);
      auto ref = p0;
      fn_of<TopPRenormFn>(reference_of(OpId::top_p_renorm_prob))(ref.data(), T, n, ps.data());
      for (const KernelEntry* k : cpu_kernels_of(OpId::top_p_renorm_prob)) {
        auto out = p0;
        fn_of<TopPRenormFn>(k)(out.data(), T, n, ps.data());
        expect_same_renorm(out, ref, k->name + " n=" + std::to_string(n) + " " + kind_name(kind));
      }
    }
}

// Exact halves and quarters: the running sum hits top_p * total exactly, and the tie at the
// threshold must be kept whole.
TEST(OpsSamplingKernels, TopPBoundaryHitExactlyKeepsTheTie) {
  const std::vector<float> p0 = {0.25f, 0.5f, 0.125f, 0.125f};
  for (float top_p : {0.5f, 0.75f, 0.8f, 0.875f}) {
    auto ref = p0;
    fn_of<TopPRenormFn>(reference_of(OpId::top_p_renorm_prob))(ref.data(), 1, 4, &top_p);
    for (const KernelEntry* k : cpu_kernels_of(OpId::top_p_renorm_prob)) {
      auto out = p0;
      fn_of<TopPRenormFn>(k)(out.data(), 1, 4, &top_p);
      EXPECT_EQ(out, ref) << k->name << " top_p=" << top_p;
    }
  }
  // By hand: p = 0.75 stops at 0.25 (0.5 + 0.25 = 0.75 reaches it): {0.5, 0.25} kept.
  std::vector<float> out = p0;
  const float p = 0.75f;
  fn_of<TopPRenormFn>(cpu_kernels_of(OpId::top_p_renorm_prob).front())(out.data(), 1, 4, &p);
  EXPECT_FLOAT_EQ(out[0], 0.25f / 0.75f);
  EXPECT_FLOAT_EQ(out[1], 0.5f / 0.75f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_EQ(out[3], 0.0f);
}

TEST(OpsSamplingKernels, MinPMatchesReference) {
  std::mt19937 rng(23);
  const std::vector<float> min_ps = {0.0f, 0.01f, 0.1f, 0.5f, 1.0f, 0.2f};
  for (int64_t n : {1, 7, 50, 1000, 160000})
    for (RowKind kind : kKinds) {
      const int64_t T = static_cast<int64_t>(min_ps.size());
      const auto p0 = make_probs(T, n, kind, rng);
      auto ref = p0;
      fn_of<MinPRenormFn>(reference_of(OpId::min_p_renorm_prob))(ref.data(), T, n, min_ps.data());
      for (const KernelEntry* k : cpu_kernels_of(OpId::min_p_renorm_prob)) {
        auto out = p0;
        fn_of<MinPRenormFn>(k)(out.data(), T, n, min_ps.data());
        expect_same_renorm(out, ref, k->name + " n=" + std::to_string(n) + " " + kind_name(kind));
      }
    }
}

TEST(OpsSamplingKernels, SampleFromProbsMatchesReference) {
  std::mt19937 rng(24);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (int64_t n : {1, 7, 300, 1000, 160000})
    for (RowKind kind : kKinds) {
      const int64_t T = 16;
      auto p0 = make_probs(T, n, kind, rng);
      // Truncated rows too (zeros to skip), and the edges of u.
      fn_of<TopKRenormFn>(reference_of(OpId::top_k_renorm_prob))(
          p0.data(), T / 2, n, std::vector<int32_t>(T / 2, 5).data());
      std::vector<float> us(T);
      for (float& u : us) u = uni(rng);
      us[0] = 0.0f, us[1] = 0.999999f, us[2] = 1.0f, us[T / 2] = 0.0f, us[T / 2 + 1] = 1.0f;
      std::vector<int32_t> ref(T);
      fn_of<SampleFromProbsFn>(reference_of(OpId::sample_from_probs))(p0.data(), T, n, us.data(), ref.data());
      for (const KernelEntry* k : cpu_kernels_of(OpId::sample_from_probs)) {
        std::vector<int32_t> out(T, -1);
        fn_of<SampleFromProbsFn>(k)(p0.data(), T, n, us.data(), out.data());
        EXPECT_EQ(out, ref) << k->name << " n=" << n << " " << kind_name(kind);
      }
    }
}

struct RouteCase {
  int64_t T, E, K, n_group, topk_group;
  bool sigmoid, group_limited, top2, norm, with_bias, quantized;  // quantized: logits on a coarse grid, so scores tie
};

TEST(OpsSamplingKernels, MoeRouteMatchesReferenceIncludingTies) {
  std::mt19937 rng(25);
  const std::vector<RouteCase> cases = {
      {3, 64, 6, 8, 3, true, true, true, true, true, false},       // noaux_tc (V3-style)
      {3, 64, 6, 8, 3, false, true, false, true, false, false},    // V2 group_limited_greedy
      {100, 256, 8, 8, 4, true, true, true, true, true, false},    // V3 shape, prefill-sized (threads)
      {17, 64, 6, 8, 3, true, true, true, true, true, true},       // ties everywhere
      {17, 64, 6, 8, 3, false, false, false, false, false, true},  // greedy over all, ties, no norm
      {5, 16, 4, 4, 2, true, true, true, true, true, true},        // k3-nano
      {5, 16, 1, 1, 1, false, false, false, true, false, false},   // top-1, one group
      {4, 8, 8, 4, 1, true, true, true, true, true, true},         // k beyond the kept groups: -inf picks
      {3, 64, 6, 64, 3, true, true, true, true, true, false},      // one expert per group
  };
  for (const RouteCase& c : cases) {
    std::vector<float> logits(static_cast<size_t>(c.T * c.E)), bias(static_cast<size_t>(c.E));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : logits) x = c.quantized ? std::round(normal(rng) * 2.0f) / 2.0f : normal(rng);
    for (float& x : bias) x = c.quantized ? std::round(normal(rng)) * 0.25f : 0.1f * normal(rng);
    std::vector<int32_t> ref_ids(c.T * c.K, -1);
    std::vector<float> ref_w(c.T * c.K, NAN);
    MoeRouteArgs a{logits.data(), c.with_bias ? bias.data() : nullptr, c.T, c.E, c.K, c.n_group, c.topk_group,
                   c.sigmoid, c.group_limited, c.top2, c.norm, 2.5f, ref_ids.data(), ref_w.data()};
    fn_of<MoeRouteFn>(reference_of(OpId::moe_route))(a);
    for (const KernelEntry* k : cpu_kernels_of(OpId::moe_route)) {
      std::vector<int32_t> ids(c.T * c.K, -1);
      std::vector<float> w(c.T * c.K, NAN);
      a.topk_ids = ids.data();
      a.topk_weights = w.data();
      fn_of<MoeRouteFn>(k)(a);
      EXPECT_EQ(ids, ref_ids) << k->name << " E=" << c.E << " K=" << c.K;
      EXPECT_EQ(w, ref_w) << k->name << " E=" << c.E << " K=" << c.K;  // the same expressions: bit-identical
    }
  }
}

// The cpu kernels outrank the reference, so the cpu backend runs them (`moat doctor`: Kernel).
TEST(OpsSamplingKernels, CpuBackendResolvesSamplingOpsToCpuKernels) {
  if (!cpu_has_isa("avx2")) GTEST_SKIP() << "this CPU has neither avx2 nor avx512";
  for (OpId op : {OpId::top_k_renorm_prob, OpId::top_p_renorm_prob, OpId::min_p_renorm_prob,
                  OpId::sample_from_probs, OpId::moe_route}) {
    const Resolution res = Registry::global().resolve(op, Backend::cpu, OpShape{.num_experts = 256, .top_k = 8});
    EXPECT_EQ(res.kind, Resolution::Kind::kernel) << op_name(op) << ": " << res.describe();
    EXPECT_EQ(res.kernel->backend, Backend::cpu) << op_name(op);
    EXPECT_EQ(res.kernel->name, fmt::format("cpu.{}_{}", op_name(op), cpu_has_isa("avx512") ? "avx512" : "avx2"));
  }
}

}  // namespace
}  // namespace moat::ops
