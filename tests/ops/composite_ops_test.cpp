// The composite ops (moe_experts, head_matmul) on the host backends against their reference
// kernels. A composite kernel multiplies through the InnerOps it is handed, so each is checked
// with the cpu op table's own (exact and default precision, what a model runs) and with every
// host matmul kernel this CPU runs as the inner matmul. Shapes cover both cpu schedules (experts
// side by side at decode, in turn at prefill; heads side by side, or in turn when fewer heads than
// threads) at pool sizes 1, 2 and 3, dims that are not multiples of the vector width, fp8 with
// ragged 128-blocks, strided head layouts with a pass-through tail, and experts no token chose.
//
// Tolerances (normalized error, max|out - ref| / max|ref|): kExact 1e-4 for fp32-accurate inner
// matmuls (three chained matmuls and a silu in fp32 against the reference's double); kBf16 2e-2
// where the inner matmul rounds activations to bf16 (twice, for moe_experts' down projection).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/thread_pool.h"
#include "base/weight.h"
#include "ops/dispatch.h"
#include "ops/registry.h"
#include "parity.h"

namespace moat::ops {
namespace {

constexpr double kExact = 1e-4;
constexpr double kBf16 = 2e-2;

using testing::normalized_error;
using testing::randn;
using testing::fn_of;

// A weight in its stored dtype; owns its bytes (the WeightMatrix points into them).
struct OwnedWeight {
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
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
    if (dtype == DType::F16) {
      const uint16_t b = f32_to_f16(vals[i]);
      std::memcpy(&t.bytes[2 * i], &b, 2);
    }
    if (dtype == DType::F8_E4M3) {
      uint8_t code;
      do code = static_cast<uint8_t>(rng() & 0xff);
      while ((code & 0x7f) == 0x7f);
      t.bytes[i] = code;
    }
  }
  t.w = WeightMatrix{.dtype = dtype, .data = t.bytes.data(), .out_features = N, .in_features = K};
  if (dtype == DType::F8_E4M3) {
    std::uniform_real_distribution<float> u(0.5f, 2.0f);
    for (int64_t i = 0; i < ((N + 127) / 128) * ((K + 127) / 128); ++i) t.scales.push_back(u(rng) * 4e-3f);
    t.w.scale_inv = t.scales.data();
  }
  return t;
}

// An inner-op set to run a composite kernel with, and the tolerance it earns.
struct Inner {
  std::string name;
  InnerOps ops;
  double tolerance;
};

// The cpu op table (exact, then default precision), then each host matmul kernel that takes
// `dtype` on this CPU, fp32-accurate, with the table's silu_mul and add_scaled.
std::vector<Inner> inner_sets(DType dtype, std::vector<std::array<MatmulFn, 16>>& storage, OpTable& exact,
                              OpTable& fast) {
  std::vector<Inner> out;
  // (cpu.matmul_avx512bf16 rounds f16 weights' activations to bf16 even when exact)
  out.push_back({"cpu table, exact", exact.inner_ops(), dtype == DType::F16 ? kBf16 : kExact});
  out.push_back({"cpu table, default", fast.inner_ops(), kBf16});
  const auto kernels = Registry::global().kernels(OpId::matmul, Backend::cpu);
  storage.reserve(storage.size() + kernels.size() + 1);
  for (const KernelEntry* k : kernels) {
    if (!k->constraints.check(OpShape{.weight_dtype = dtype}).empty()) continue;
    storage.emplace_back();
    storage.back().fill(nullptr);
    storage.back()[static_cast<int>(dtype)] = reinterpret_cast<MatmulFn>(k->fn);
    InnerOps ops = exact.inner_ops();
    ops.matmul_by_dtype = storage.back().data();
    // f16 and fp8 weights through the bf16 kernel: f16 rounds to bf16 always, fp8 exact here
    const bool rounds = testing::is_bf16_dot_matmul(k) && dtype == DType::F16;
    out.push_back({k->name, ops, rounds ? kBf16 : kExact});
  }
  return out;
}

OpTable cpu_table(bool exact) {
  auto t = OpTable::resolve(Backend::cpu, ModelOpNeeds{.matmul_dtypes = {DType::F32, DType::BF16, DType::F16,
                                                                         DType::F8_E4M3},
                                                       .heads_per_rank = 16,
                                                       .attention_head_dim = 576,
                                                       .num_experts = 8,
                                                       .top_k = 3});
  EXPECT_TRUE(t.ok()) << t.error().message;
  t->set_exact_activations(exact);
  return std::move(t).value();
}

std::vector<const KernelEntry*> host_composites(OpId op, DType dtype) {
  std::vector<const KernelEntry*> out;
  for (const KernelEntry* k : Registry::global().kernels(op, Backend::cpu)) {
    const auto reasons = k->constraints.check(OpShape{.weight_dtype = dtype, .num_experts = 8, .top_k = 3});
    if (reasons.empty()) out.push_back(k);
    else std::printf("  [not supported here] %s: %s\n", k->name.c_str(), reasons[0].c_str());
  }
  return out;
}

TEST(OpsMoeExperts, EveryHostKernelMatchesReference) {
  std::mt19937 rng(21);
  OpTable exact = cpu_table(true), fast = cpu_table(false);
  const int64_t H = 40, I = 24, E = 8, K = 3;
  const auto* ref = Registry::global().kernels(OpId::moe_experts, Backend::reference).front();
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3}) {
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
    std::vector<std::array<MatmulFn, 16>> storage;
    const auto inners = inner_sets(dtype, storage, exact, fast);
    const auto kernels = host_composites(OpId::moe_experts, dtype);
    ASSERT_FALSE(kernels.empty());
    for (int64_t T : {1, 2, 3, 17, 40}) {
      const auto x = randn(static_cast<size_t>(T * H), rng);
      const auto base = randn(static_cast<size_t>(T * H), rng);  // out is added into
      std::vector<int32_t> ids(static_cast<size_t>(T * K));
      std::vector<float> weights(ids.size());
      std::uniform_real_distribution<float> u(0.1f, 1.0f);
      for (int64_t t = 0; t < T; ++t) {
        // distinct experts per token, from the first 6 only: experts 6 and 7 get no rows
        std::vector<int32_t> pick = {0, 1, 2, 3, 4, 5};
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
      for (const KernelEntry* k : kernels)
        for (const Inner& inner : inners)
          for (int threads : {1, 2, 3}) {
            ThreadPool pool(threads);
            ScopedThreadPool scope(pool);
            std::vector<float> got = base;
            a.out = got.data();
            fn_of<MoeExpertsFn>(k)(a, inner.ops);
            EXPECT_LE(normalized_error(got, want), inner.tolerance)
                << k->name << " inner " << inner.name << " " << dtype_name(dtype) << " T=" << T
                << " threads=" << threads;
          }
    }
  }
}

// Expert parallelism: each rank passes -1 for the experts another rank holds. The two ranks'
// outputs (experts 0-3 and 4-7, a token's experts on either or both) sum to the whole layer's, on
// the reference and on every host kernel, at one token (decode) and at several.
TEST(OpsMoeExperts, ExpertsHeldByAnotherRankAreSkipped) {
  std::mt19937 rng(23);
  OpTable exact = cpu_table(true);
  const int64_t H = 40, I = 24, E = 8, K = 3;
  std::vector<OwnedWeight> owned;
  std::vector<MlpWeights> experts(E);
  owned.reserve(3 * E);
  for (int64_t e = 0; e < E; ++e) {
    owned.push_back(make_weight(DType::BF16, I, H, rng));
    experts[e].gate_proj = owned.back().w;
    owned.push_back(make_weight(DType::BF16, I, H, rng));
    experts[e].up_proj = owned.back().w;
    owned.push_back(make_weight(DType::BF16, H, I, rng));
    experts[e].down_proj = owned.back().w;
  }
  std::vector<const KernelEntry*> kernels = host_composites(OpId::moe_experts, DType::BF16);
  kernels.push_back(Registry::global().kernels(OpId::moe_experts, Backend::reference).front());
  for (int64_t T : {1, 5}) {
    const auto x = randn(static_cast<size_t>(T * H), rng);
    std::vector<int32_t> ids(static_cast<size_t>(T * K));
    std::vector<float> weights(ids.size());
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> pick = {0, 1, 2, 3, 4, 5, 6, 7};
      std::shuffle(pick.begin(), pick.end(), rng);
      for (int64_t k = 0; k < K; ++k) {
        ids[t * K + k] = pick[k];
        weights[t * K + k] = 0.1f + 0.3f * static_cast<float>(k);
      }
    }
    const auto* ref = Registry::global().kernels(OpId::moe_experts, Backend::reference).front();
    std::vector<float> whole(static_cast<size_t>(T * H), 0.0f);
    MoeExpertsArgs a{x.data(), T, H, K, ids.data(), weights.data(), experts.data(), E, I, whole.data()};
    fn_of<MoeExpertsFn>(ref)(a, exact.inner_ops());
    for (const KernelEntry* k : kernels) {
      std::vector<float> sum(whole.size(), 0.0f);
      for (int rank = 0; rank < 2; ++rank) {
        std::vector<int32_t> local = ids;
        for (int32_t& e : local)
          if (e / 4 != rank) e = -1;
        a.topk_ids = local.data();
        a.out = sum.data();  // each rank's share is added into out
        fn_of<MoeExpertsFn>(k)(a, exact.inner_ops());
      }
      EXPECT_LE(normalized_error(sum, whole), 1e-5) << k->name << " T=" << T;
    }
  }
}

TEST(OpsHeadMatmul, EveryHostKernelMatchesReferenceOnStridedHeads) {
  std::mt19937 rng(22);
  OpTable exact = cpu_table(true), fast = cpu_table(false);
  const auto* ref = Registry::global().kernels(OpId::head_matmul, Backend::reference).front();
  struct Shape {
    int64_t in, out, pass;
  };
  // MLA's two uses in miniature: nope -> kv_lora with the rope part passed through, and
  // kv_lora -> v; plus a width past 128 for fp8's ragged blocks.
  for (const Shape s : {Shape{40, 24, 8}, Shape{24, 17, 0}, Shape{130, 33, 0}})
    for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3}) {
      std::vector<std::array<MatmulFn, 16>> storage;
      const auto inners = inner_sets(dtype, storage, exact, fast);
      const auto kernels = host_composites(OpId::head_matmul, dtype);
      ASSERT_FALSE(kernels.empty());
      for (int64_t heads : {1, 3, 16}) {
        std::vector<OwnedWeight> owned;
        std::vector<WeightMatrix> w;
        owned.reserve(heads);
        for (int64_t h = 0; h < heads; ++h) {
          owned.push_back(make_weight(dtype, s.out, s.in, rng));
          w.push_back(owned.back().w);
        }
        for (int64_t T : {1, 2, 17}) {
          // heads padded apart and tokens padded apart: only the declared elements may be touched
          const int64_t xh = s.in + s.pass + 3, xt = heads * xh + 5, yh = s.out + s.pass + 2, yt = heads * yh + 7;
          const auto x = randn(static_cast<size_t>(T * xt), rng);
          std::vector<float> want(static_cast<size_t>(T * yt), 7.0f);
          HeadMatmulArgs a{x.data(), xt, xh, T, heads, w.data(), want.data(), yt, yh, s.pass};
          fn_of<HeadMatmulFn>(ref)(a, exact.inner_ops());
          for (const KernelEntry* k : kernels)
            for (const Inner& inner : inners)
              for (int threads : {1, 2, 3}) {
                ThreadPool pool(threads);
                ScopedThreadPool scope(pool);
                std::vector<float> got(want.size(), 7.0f);
                a.y = got.data();
                fn_of<HeadMatmulFn>(k)(a, inner.ops);
                EXPECT_LE(normalized_error(got, want), inner.tolerance)
                    << k->name << " inner " << inner.name << " " << dtype_name(dtype) << " in=" << s.in
                    << " heads=" << heads << " T=" << T << " threads=" << threads;
                // the pass-through copy and the untouched padding are exact
                for (int64_t t = 0; t < T; ++t)
                  for (int64_t h = 0; h < heads; ++h)
                    for (int64_t i = s.out; i < yh; ++i)
                      ASSERT_EQ(got[t * yt + h * yh + i], want[t * yt + h * yh + i])
                          << k->name << " t=" << t << " h=" << h << " i=" << i;
              }
        }
      }
    }
}

TEST(OpsComposite, ResolveToCpuKernelsForEveryLinearDtype) {
  OpTable t = cpu_table(false);
  int head_matmuls = 0, moe_experts = 0;
  for (const ResolvedOp& r : t.resolved()) {
    if (r.op != OpId::head_matmul && r.op != OpId::moe_experts) continue;
    (r.op == OpId::head_matmul ? head_matmuls : moe_experts) += 1;
    EXPECT_EQ(r.resolution.kind, Resolution::Kind::kernel) << r.use;
    EXPECT_EQ(r.resolution.kernel->backend, Backend::cpu) << r.use;
  }
  EXPECT_EQ(head_matmuls, 4);  // one per matmul dtype
  EXPECT_EQ(moe_experts, 1);
}

}  // namespace
}  // namespace moat::ops
