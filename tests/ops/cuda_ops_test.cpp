// Every cuda kernel against the reference kernel, on a GPU when one exists; without one (the
// build machines: "CUDA driver version is insufficient") each test says so and skips.
// Same inputs and tolerances as ops_test.cpp: kExact 1e-5 for fp32 arithmetic, kBf16 1e-2 for
// cuBLAS on activations rounded to bf16; sampling outputs must match exactly.
#ifdef MOAT_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "kernels/cuda/cuda_backend.h"
#include "ops/dispatch.h"
#include "ops/registry.h"

namespace moat::ops {
namespace {

constexpr double kExact = 1e-5;
constexpr double kBf16 = 1e-2;

// Host vector mirrored on the device.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& host) : n(host.size()) {
    p = static_cast<T*>(cuda::device_alloc(sizeof(T) * std::max<size_t>(n, 1)));
    if (n) cuda::copy_to_device(p, host.data(), sizeof(T) * n);
  }
  ~Dev() { cuda::device_free(p); }
  Dev(const Dev&) = delete;
  std::vector<T> host() const {
    cuda::synchronize();
    std::vector<T> out(n);
    if (n) cuda::copy_to_host(out.data(), p, sizeof(T) * n);
    return out;
  }
};

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda::device_available(&why)) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
};

template <typename Fn>
Fn ref_fn(OpId op) {
  return reinterpret_cast<Fn>(Registry::global().kernels(op, Backend::reference).front()->fn);
}
template <typename Fn>
Fn cuda_fn(OpId op) {
  return reinterpret_cast<Fn>(Registry::global().kernels(op, Backend::cuda).front()->fn);
}

double normalized_error(const std::vector<float>& out, const std::vector<float>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(out[i]) != std::isnan(ref[i])) return INFINITY;
    d = std::max(d, std::fabs(static_cast<double>(out[i]) - ref[i]));
    m = std::max(m, std::fabs(static_cast<double>(ref[i])));
  }
  return m > 0 ? d / m : d;
}

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(CudaOpsRegistry, EveryOpHasACudaKernel) {
  for (int i = 0; i < kNumOps; ++i)
    EXPECT_FALSE(Registry::global().kernels(static_cast<OpId>(i), Backend::cuda).empty()) << kOpNames[i];
  const Resolution r = Registry::global().resolve(OpId::mla_attention, Backend::cuda,
                                                  OpShape{.heads_per_rank = 12, .head_dim = 576});
  EXPECT_EQ(r.kind, Resolution::Kind::pad_heads);
  EXPECT_EQ(r.pad_to, 16);
}

TEST_F(CudaOps, Matmul) {
  std::mt19937 rng(1);
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{5, 7}, {130, 300}, {64, 2048}})
      for (int64_t T : {1, 3, 17}) {
        std::vector<uint8_t> bytes(N * K * dtype_size(dtype));
        const auto vals = randn(N * K, rng, 0.5f);
        for (int64_t i = 0; i < N * K; ++i) {
          if (dtype == DType::F32) std::memcpy(&bytes[4 * i], &vals[i], 4);
          if (dtype == DType::BF16) { uint16_t b = f32_to_bf16(vals[i]); std::memcpy(&bytes[2 * i], &b, 2); }
          if (dtype == DType::F16) { uint16_t b = f32_to_f16(vals[i]); std::memcpy(&bytes[2 * i], &b, 2); }
          if (dtype == DType::F8_E4M3) { uint8_t c; do c = rng() & 0xff; while ((c & 0x7f) == 0x7f); bytes[i] = c; }
        }
        std::vector<float> scales(((N + 127) / 128) * ((K + 127) / 128));
        for (float& s : scales) s = 0.01f * (1 + (rng() % 100) / 100.0f);
        const auto x = randn(T * K, rng);
        WeightMatrix hw{.dtype = dtype, .data = bytes.data(), .out_features = N, .in_features = K,
                        .scale_inv = dtype == DType::F8_E4M3 ? scales.data() : nullptr};
        std::vector<float> ref(T * N);
        ref_fn<MatmulFn>(OpId::matmul)(x.data(), T, hw, ref.data());
        Dev<uint8_t> dbytes(bytes);
        Dev<float> dscales(scales), dx(x), dy(std::vector<float>(T * N));
        WeightMatrix dw = hw;
        dw.data = dbytes.p;
        dw.scale_inv = dtype == DType::F8_E4M3 ? dscales.p : nullptr;
        cuda_fn<MatmulFn>(OpId::matmul)(dx.p, T, dw, dy.p);
        EXPECT_LE(normalized_error(dy.host(), ref), dtype == DType::F32 ? 1e-4 : kBf16)
            << dtype_name(dtype) << " N=" << N << " K=" << K << " T=" << T;
      }
}

TEST_F(CudaOps, RowAndElementwiseOps) {
  std::mt19937 rng(2);
  for (int64_t n : {1, 33, 2048})
    for (int64_t T : {1, 3, 17}) {
      const auto x = randn(T * n, rng, 3.0f), w = randn(n, rng), u = randn(T * n, rng);
      std::vector<float> ref(T * n);
      Dev<float> dx(x), dw(w), du(u), dy(std::vector<float>(T * n));
      ref_fn<RmsNormFn>(OpId::rms_norm)(x.data(), w.data(), T, n, 1e-6f, ref.data());
      cuda_fn<RmsNormFn>(OpId::rms_norm)(dx.p, dw.p, T, n, 1e-6f, dy.p);
      EXPECT_LE(normalized_error(dy.host(), ref), kExact) << "rms_norm n=" << n;
      ref_fn<SiluMulFn>(OpId::silu_mul)(x.data(), u.data(), T, n, ref.data());
      cuda_fn<SiluMulFn>(OpId::silu_mul)(dx.p, du.p, T, n, dy.p);
      EXPECT_LE(normalized_error(dy.host(), ref), kExact) << "silu_mul n=" << n;
      for (float temp : {1.0f, 0.5f}) {
        ref_fn<SoftmaxFn>(OpId::softmax)(x.data(), T, n, temp, ref.data());
        cuda_fn<SoftmaxFn>(OpId::softmax)(dx.p, T, n, temp, dy.p);
        EXPECT_LE(normalized_error(dy.host(), ref), kExact) << "softmax n=" << n;
      }
      std::vector<int32_t> ref_i(T);
      Dev<int32_t> di{std::vector<int32_t>(T)};
      ref_fn<ArgmaxFn>(OpId::argmax)(x.data(), T, n, ref_i.data());
      cuda_fn<ArgmaxFn>(OpId::argmax)(dx.p, T, n, di.p);
      EXPECT_EQ(di.host(), ref_i) << "argmax n=" << n;
      auto y = u;
      Dev<float> dy2(u);
      ref_fn<AddScaledFn>(OpId::add_scaled)(y.data(), x.data(), 0.3f, T * n);
      cuda_fn<AddScaledFn>(OpId::add_scaled)(dy2.p, dx.p, 0.3f, T * n);
      EXPECT_LE(normalized_error(dy2.host(), y), kExact) << "add_scaled n=" << n;
    }
  // embedding
  const auto table = randn(50 * 64, rng);
  std::vector<uint16_t> tb(table.size());
  for (size_t i = 0; i < table.size(); ++i) tb[i] = f32_to_bf16(table[i]);
  const std::vector<int32_t> ids = {0, 49, 7};
  Dev<uint16_t> dtb(tb);
  Dev<int32_t> dids(ids);
  Dev<float> dout(std::vector<float>(3 * 64));
  std::vector<float> ref(3 * 64);
  WeightMatrix hw{.dtype = DType::BF16, .data = tb.data(), .out_features = 50, .in_features = 64};
  ref_fn<EmbeddingFn>(OpId::embedding)(hw, ids.data(), 3, ref.data());
  hw.data = dtb.p;
  cuda_fn<EmbeddingFn>(OpId::embedding)(hw, dids.p, 3, dout.p);
  EXPECT_EQ(normalized_error(dout.host(), ref), 0.0);
}

TEST_F(CudaOps, Rope) {
  std::mt19937 rng(3);
  const int64_t T = 5, heads = 3, rope_dim = 64, half = 32, max_pos = 16, hs = 192, ts = heads * hs;
  const auto cs = randn(max_pos * half, rng), sn = randn(max_pos * half, rng), x0 = randn(T * ts, rng);
  const std::vector<int32_t> pos = {0, 3, 15, 2, 2};
  auto ref = x0;
  ref_fn<RopeFn>(OpId::rope)(RopeArgs{ref.data() + 128, T, heads, ts, hs, rope_dim, pos.data(), cs.data(), sn.data()});
  Dev<float> dx(x0), dc(cs), ds(sn);
  Dev<int32_t> dp(pos);
  cuda_fn<RopeFn>(OpId::rope)(RopeArgs{dx.p + 128, T, heads, ts, hs, rope_dim, dp.p, dc.p, ds.p});
  EXPECT_LE(normalized_error(dx.host(), ref), kExact);
}

TEST_F(CudaOps, MlaAttentionIncludingPadHeads) {
  std::mt19937 rng(4);
  for (int64_t heads : {4, 8, 12, 16}) {
    const int64_t T = 3, C = 512, R = 64, D = C + R;
    const std::vector<int32_t> lens = {1, 17, 300};
    const auto q = randn(T * heads * D, rng);
    std::vector<std::vector<float>> caches;
    std::vector<const float*> host_ptrs;
    std::vector<std::unique_ptr<Dev<float>>> dcaches;
    std::vector<const float*> dev_ptrs;
    for (int32_t L : lens) {
      caches.push_back(randn(L * D, rng));
      host_ptrs.push_back(caches.back().data());
      dcaches.push_back(std::make_unique<Dev<float>>(caches.back()));
      dev_ptrs.push_back(dcaches.back()->p);
    }
    std::vector<float> ref(T * heads * C);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    ref_fn<MlaAttentionFn>(OpId::mla_attention)(
        MlaAttentionArgs{q.data(), T, heads, C, R, host_ptrs.data(), lens.data(), scale, ref.data()});
    Dev<float> dq(q), dout(std::vector<float>(ref.size()));
    Dev<int32_t> dlens(lens);
    std::vector<uintptr_t> ptr_bits(dev_ptrs.size());
    std::memcpy(ptr_bits.data(), dev_ptrs.data(), sizeof(uintptr_t) * dev_ptrs.size());
    Dev<uintptr_t> dptrs(ptr_bits);
    // through an OpTable, so 12 heads take the PadHeads path
    auto table = OpTable::resolve(Backend::cuda, ModelOpNeeds{.matmul_dtypes = {DType::BF16},
                                                              .heads_per_rank = heads,
                                                              .attention_head_dim = D});
    ASSERT_TRUE(table.ok()) << table.error().message;
    table->mla_attention(MlaAttentionArgs{dq.p, T, heads, C, R, reinterpret_cast<const float* const*>(dptrs.p),
                                          dlens.p, scale, dout.p});
    EXPECT_LE(normalized_error(dout.host(), ref), kExact) << "heads=" << heads;
  }
}

TEST_F(CudaOps, MoeRoute) {
  std::mt19937 rng(5);
  for (bool sigmoid : {true, false}) {
    const int64_t T = 4, E = 64, K = 6;
    const auto logits = randn(T * E, rng), bias = randn(E, rng, 0.1f);
    std::vector<int32_t> ref_ids(T * K);
    std::vector<float> ref_w(T * K);
    MoeRouteArgs a{logits.data(), sigmoid ? bias.data() : nullptr, T, E, K, 8, 3, sigmoid, true, sigmoid,
                   sigmoid, 2.5f, ref_ids.data(), ref_w.data()};
    ref_fn<MoeRouteFn>(OpId::moe_route)(a);
    Dev<float> dl(logits), db(bias), dw(std::vector<float>(T * K));
    Dev<int32_t> di(std::vector<int32_t>(T * K));
    a.logits = dl.p;
    a.bias = sigmoid ? db.p : nullptr;
    a.topk_ids = di.p;
    a.topk_weights = dw.p;
    cuda_fn<MoeRouteFn>(OpId::moe_route)(a);
    EXPECT_EQ(di.host(), ref_ids);
    EXPECT_LE(normalized_error(dw.host(), ref_w), kExact);
  }
}

TEST_F(CudaOps, SamplingWithTies) {
  std::mt19937 rng(6);
  for (int64_t n : {1, 7, 50, 1000}) {
    const int64_t T = 5;
    std::vector<float> p(T * n);
    for (float& v : p) v = static_cast<float>(1 + rng() % 6);
    for (int64_t t = 0; t < T; ++t) {
      float s = 0;
      for (int64_t i = 0; i < n; ++i) s += p[t * n + i];
      for (int64_t i = 0; i < n; ++i) p[t * n + i] /= s;
    }
    const std::vector<int32_t> ks = {1, 2, 5, static_cast<int32_t>(n), static_cast<int32_t>(n + 3)};
    const std::vector<float> tps = {0.1f, 0.5f, 0.9f, 1.0f, 0.0001f}, mps = {0.0f, 0.5f, 0.9f, 1.0f, 0.2f},
                             us = {0.0f, 0.3f, 0.5f, 0.999f, 0.7f};
    Dev<int32_t> dks(ks);
    Dev<float> dtps(tps), dmps(mps), dus(us);
    {
      auto ref = p;
      ref_fn<TopKRenormFn>(OpId::top_k_renorm_prob)(ref.data(), T, n, ks.data());
      Dev<float> dp(p);
      cuda_fn<TopKRenormFn>(OpId::top_k_renorm_prob)(dp.p, T, n, dks.p);
      EXPECT_LE(normalized_error(dp.host(), ref), kExact) << "top_k n=" << n;
    }
    {
      auto ref = p;
      ref_fn<TopPRenormFn>(OpId::top_p_renorm_prob)(ref.data(), T, n, tps.data());
      Dev<float> dp(p);
      cuda_fn<TopPRenormFn>(OpId::top_p_renorm_prob)(dp.p, T, n, dtps.p);
      EXPECT_LE(normalized_error(dp.host(), ref), kExact) << "top_p n=" << n;
    }
    {
      auto ref = p;
      ref_fn<MinPRenormFn>(OpId::min_p_renorm_prob)(ref.data(), T, n, mps.data());
      Dev<float> dp(p);
      cuda_fn<MinPRenormFn>(OpId::min_p_renorm_prob)(dp.p, T, n, dmps.p);
      EXPECT_LE(normalized_error(dp.host(), ref), kExact) << "min_p n=" << n;
    }
    {
      std::vector<int32_t> ref(T);
      ref_fn<SampleFromProbsFn>(OpId::sample_from_probs)(p.data(), T, n, us.data(), ref.data());
      Dev<float> dp(p);
      Dev<int32_t> dout(std::vector<int32_t>(T, -1));
      cuda_fn<SampleFromProbsFn>(OpId::sample_from_probs)(dp.p, T, n, dus.p, dout.p);
      EXPECT_EQ(dout.host(), ref) << "sample n=" << n;
    }
  }
}

}  // namespace
}  // namespace moat::ops

#endif  // MOAT_HAVE_CUDA
