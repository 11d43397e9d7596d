// Every cuda kernel against the reference kernel, on a GPU when one exists; without one (the
// build machines: "CUDA driver version is insufficient") each test says so and skips.
// Same inputs and tolerances as ops_test.cpp: kExact 1e-5 for fp32 arithmetic, kBf16 1e-2 for
// cuBLAS on activations rounded to bf16; sampling outputs must match exactly.
#ifdef MOAT_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <memory>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "kernels/cuda/cuda_backend.h"
#include "ops/dispatch.h"
#include "ops/registry.h"
#include "parity.h"

namespace moat::ops {
namespace {

constexpr double kExact = 1e-5;
constexpr double kBf16 = 1e-2;
// MLA attention in fp32 on both sides, summed in another order: the cache's 1e3-scaled row gives
// scores near 1e3, where fp32 rounding moves a score by ~1e-4 and the softmax weights with it.
// The first H200 run read 3.5e-5 (bf16 cache, 12 heads padded to 16, block size 1); a wrong head,
// row or block reads O(1).
constexpr double kAttention = 1e-4;

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

using testing::normalized_error;
using testing::randn;

TEST(CudaOpsRegistry, EveryOpHasACudaKernel) {
  for (int i = 0; i < kNumOps; ++i)
    EXPECT_FALSE(Registry::global().kernels(static_cast<OpId>(i), Backend::cuda).empty()) << kOpNames[i];
  for (DType kv : {DType::F32, DType::BF16, DType::F8_E4M3}) {
    const Resolution r = Registry::global().resolve(OpId::mla_attention, Backend::cuda,
                                                    OpShape{.heads_per_rank = 12, .head_dim = 576, .kv_dtype = kv});
    EXPECT_EQ(r.kind, Resolution::Kind::pad_heads) << dtype_name(kv);
    EXPECT_EQ(r.pad_to, 16);
    EXPECT_EQ(Registry::global().resolve(OpId::store_latent, Backend::cuda, OpShape{.head_dim = 576, .kv_dtype = kv}).kind,
              Resolution::Kind::kernel);
  }
}

TEST_F(CudaOps, Matmul) {
  std::mt19937 rng(1);
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3})
    // K = 64, 528 and 2048 take the decode GEMV at T <= 8 (bf16, fp8; 528: a partial fp8 scale
    // block, 130: a partial pair of rows; 64 and 130 rows split K over 2-8 warps, 1000 rows of 64
    // do not); 7 and 300 do not divide into its 16-byte chunks.
    for (auto [N, K] : {std::pair<int64_t, int64_t>{5, 7}, {130, 300}, {64, 2048}, {130, 528}, {1000, 64}})
      for (int64_t T : {1, 3, 8, 9, 17}) {
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
        ref_fn<MatmulFn>(OpId::matmul)(x.data(), T, hw, ref.data(), MatmulPrecision::exact());
        Dev<uint8_t> dbytes(bytes);
        Dev<float> dscales(scales), dx(x), dy(std::vector<float>(T * N));
        WeightMatrix dw = hw;
        dw.data = dbytes.p;
        dw.scale_inv = dtype == DType::F8_E4M3 ? dscales.p : nullptr;
        cuda_fn<MatmulFn>(OpId::matmul)(dx.p, T, dw, dy.p, MatmulPrecision::exact());
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

// A paged cache of `num_blocks` blocks of B rows [D], NaN in every slot nobody writes (fp32 NaN,
// bf16 0xffff, fp8 0x7f with a NaN row scale): reading one fails the comparison.
struct HostPages {
  std::vector<uint8_t> bytes;  // [num_blocks * B, D] in dtype
  std::vector<float> scales;   // [num_blocks * B]
  HostPages(DType dtype, int64_t slots, int64_t D) : bytes(slots * D * dtype_size(dtype)), scales(slots, NAN) {
    if (dtype == DType::F32) {
      const float nan = NAN;
      for (int64_t i = 0; i < slots * D; ++i) std::memcpy(&bytes[4 * i], &nan, 4);
    } else {
      std::fill(bytes.begin(), bytes.end(), dtype == DType::BF16 ? 0xff : 0x7f);
    }
  }
};

// Sequences of the given lengths in a paged cache of block size B: block ids shuffled over `spare`
// more blocks than the sequences use (never written), each sequence's row of the block table
// (unused entries name the last shuffled block) and the slot of each of its rows, in order.
struct PagedLayout {
  int64_t max_blocks = 0, num_blocks = 0;
  std::vector<int32_t> tables;  // [S, max_blocks]
  std::vector<int64_t> slots;   // sequence by sequence
};
PagedLayout paged_layout(const std::vector<int32_t>& seq_len, int64_t B, int64_t spare, std::mt19937& rng) {
  PagedLayout p;
  const int64_t S = static_cast<int64_t>(seq_len.size());
  int64_t used = 0;
  for (int32_t L : seq_len) {
    p.max_blocks = std::max<int64_t>(p.max_blocks, (L + B - 1) / B);
    used += (L + B - 1) / B;
  }
  p.num_blocks = used + spare;
  std::vector<int32_t> ids(p.num_blocks);
  for (int64_t i = 0; i < p.num_blocks; ++i) ids[i] = static_cast<int32_t>(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.tables.assign(S * p.max_blocks, ids.back());
  size_t next = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0; b < (seq_len[s] + B - 1) / B; ++b) p.tables[s * p.max_blocks + b] = ids[next++];
    for (int64_t j = 0; j < seq_len[s]; ++j) p.slots.push_back(int64_t{p.tables[s * p.max_blocks + j / B]} * B + j % B);
  }
  return p;
}

// store_latent writes the same bytes and scales as the reference (scattered slots, one skipped,
// a zero row, rows of very different magnitudes), then mla_attention over the paged cache
// (shuffled block ids, several sequences, lengths ending mid-block, length 1) matches the
// reference reading the same cache, through an OpTable so 12 heads take the PadHeads path.
TEST_F(CudaOps, PagedLatentCacheStoreAndMlaAttentionIncludingPadHeads) {
  std::mt19937 rng(4);
  const int64_t C = 512, R = 64, D = C + R;
  for (DType dtype : {DType::F32, DType::BF16, DType::F8_E4M3})
    for (int64_t B : {1, 16, 64}) {
      const std::vector<int32_t> seq_len = {17, 1, 300, 100};
      const int64_t S = static_cast<int64_t>(seq_len.size());
      const auto [max_blocks, num_blocks, tables, slots] = paged_layout(seq_len, B, 3, rng);
      const int64_t slots_total = num_blocks * B;
      const int64_t rows_total = static_cast<int64_t>(slots.size());
      auto rows = randn(rows_total * D, rng);
      for (int64_t d = 0; d < D; ++d) rows[D + d] = 0.0f, rows[2 * D + d] *= 1e-4f, rows[3 * D + d] *= 1e3f;
      auto store_slots = slots;
      store_slots.push_back(-1);  // a skipped row
      rows.resize((rows_total + 1) * D, 1.0f);

      HostPages ref_pages(dtype, slots_total, D);
      const LatentPages host_cache{ref_pages.bytes.data(), ref_pages.scales.data(), dtype, B};
      ref_fn<StoreLatentFn>(OpId::store_latent)(StoreLatentArgs{rows.data(), rows_total + 1, D, store_slots.data(), host_cache});
      HostPages blank(dtype, slots_total, D);
      Dev<uint8_t> dbytes(blank.bytes);
      Dev<float> dscales(blank.scales), drows(rows);
      Dev<int64_t> dslots(store_slots);
      const LatentPages dev_cache{dbytes.p, dscales.p, dtype, B};
      cuda_fn<StoreLatentFn>(OpId::store_latent)(StoreLatentArgs{drows.p, rows_total + 1, D, dslots.p, dev_cache});
      EXPECT_TRUE(dbytes.host() == ref_pages.bytes) << "store_latent " << dtype_name(dtype) << " block " << B;
      const auto got_scales = dscales.host();
      EXPECT_EQ(std::memcmp(got_scales.data(), ref_pages.scales.data(), sizeof(float) * got_scales.size()), 0)
          << "store_latent scales " << dtype_name(dtype) << " block " << B;

      for (int64_t heads : {4, 8, 12, 16}) {
        const int64_t T = 6;
        std::vector<int32_t> token_seq(T), kv_len(T);
        for (int64_t t = 0; t < T; ++t) {
          token_seq[t] = static_cast<int32_t>(t % S);
          kv_len[t] = std::max(1, seq_len[t % S] - 5 * static_cast<int32_t>(t / S));
        }
        const auto q = randn(T * heads * D, rng);
        const float scale = 1.0f / std::sqrt(static_cast<float>(D));
        std::vector<float> ref(T * heads * C);
        ref_fn<MlaAttentionFn>(OpId::mla_attention)(MlaAttentionArgs{q.data(), T, heads, C, R, host_cache, tables.data(),
                                                                     max_blocks, token_seq.data(), kv_len.data(), scale,
                                                                     ref.data()});
        // the device reads the reference's cache, so the comparison is of attention alone
        Dev<uint8_t> dref_bytes(ref_pages.bytes);
        Dev<float> dref_scales(ref_pages.scales), dq(q), dout(std::vector<float>(ref.size(), NAN));
        Dev<int32_t> dtables(tables), dseq(token_seq), dlens(kv_len);
        auto table = OpTable::resolve(Backend::cuda, ModelOpNeeds{.matmul_dtypes = {DType::BF16},
                                                                  .heads_per_rank = heads,
                                                                  .attention_head_dim = D,
                                                                  .kv_dtype = dtype});
        ASSERT_TRUE(table.ok()) << table.error().message;
        table->mla_attention(MlaAttentionArgs{dq.p, T, heads, C, R, LatentPages{dref_bytes.p, dref_scales.p, dtype, B},
                                              dtables.p, max_blocks, dseq.p, dlens.p, scale, dout.p});
        EXPECT_LE(normalized_error(dout.host(), ref), kAttention)
            << "heads=" << heads << " kv=" << dtype_name(dtype) << " block=" << B;
      }
    }
}

// Decode over many sequences of different lengths (1 to 1500 rows), the shape of a batched decode
// step: the kernel cuts each sequence's rows into splits that depend on the device's size and the
// batch, so this covers splits of the 64-row minimum and longer ones crossing block boundaries,
// empty splits (a 1-row sequence), and 128 heads (8 head groups a token). A latent of 128 + 32
// takes the generic kernel (the split kernel is built for DeepSeek-V3 / Kimi's 512 + 64).
TEST_F(CudaOps, MlaAttentionBatchedDecodeLongSequences) {
  std::mt19937 rng(41);
  const int64_t S = 32;
  for (auto [C, R] : {std::pair<int64_t, int64_t>{512, 64}, {128, 32}})
    for (DType dtype : {DType::BF16, DType::F8_E4M3})
      for (int64_t B : {16, 64}) {
        const int64_t D = C + R;
        std::vector<int32_t> seq_len(S);
        std::uniform_int_distribution<int32_t> len(2, 1500);
        for (int32_t& L : seq_len) L = len(rng);
        seq_len[0] = 1, seq_len[1] = 1500, seq_len[2] = static_cast<int32_t>(B);
        const auto [max_blocks, used, tables, slots] = paged_layout(seq_len, B, 0, rng);
        const auto rows = randn(static_cast<int64_t>(slots.size()) * D, rng);
        HostPages pages(dtype, used * B, D);
        const LatentPages host_cache{pages.bytes.data(), pages.scales.data(), dtype, B};
        ref_fn<StoreLatentFn>(OpId::store_latent)(
            StoreLatentArgs{rows.data(), static_cast<int64_t>(slots.size()), D, slots.data(), host_cache});
        Dev<uint8_t> dbytes(pages.bytes);
        Dev<float> dscales(pages.scales);
        Dev<int32_t> dtables(tables);
        for (int64_t heads : {16, 128}) {
          if (heads == 128 && (B != 64 || C != 512)) continue;  // the double-precision reference is slow
          // one decode token per sequence, in shuffled order
          std::vector<int32_t> token_seq(S), kv_len(S);
          for (int64_t t = 0; t < S; ++t) token_seq[t] = static_cast<int32_t>(t);
          std::shuffle(token_seq.begin(), token_seq.end(), rng);
          for (int64_t t = 0; t < S; ++t) kv_len[t] = seq_len[token_seq[t]];
          const auto q = randn(S * heads * D, rng);
          const float scale = 1.0f / std::sqrt(192.0f);
          std::vector<float> ref(S * heads * C);
          ref_fn<MlaAttentionFn>(OpId::mla_attention)(MlaAttentionArgs{q.data(), S, heads, C, R, host_cache, tables.data(),
                                                                       max_blocks, token_seq.data(), kv_len.data(), scale,
                                                                       ref.data()});
          Dev<float> dq(q), dout(std::vector<float>(ref.size(), NAN));
          Dev<int32_t> dseq(token_seq), dlens(kv_len);
          cuda_fn<MlaAttentionFn>(OpId::mla_attention)(MlaAttentionArgs{dq.p, S, heads, C, R,
                                                                        LatentPages{dbytes.p, dscales.p, dtype, B}, dtables.p,
                                                                        max_blocks, dseq.p, dlens.p, scale, dout.p});
          EXPECT_LE(normalized_error(dout.host(), ref), kAttention)
              << "heads=" << heads << " kv=" << dtype_name(dtype) << " block=" << B << " latent=" << C << "+" << R;
        }
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

// A bf16 weight on the host and its device copy (composite ops' weights).
struct DevWeight {
  std::vector<uint16_t> host_bits;
  WeightMatrix host, dev;
  std::unique_ptr<Dev<uint16_t>> bytes;
  DevWeight(int64_t N, int64_t K, std::mt19937& rng) {
    const auto vals = randn(N * K, rng, 0.3f);
    for (float v : vals) host_bits.push_back(f32_to_bf16(v));
    host = WeightMatrix{.dtype = DType::BF16, .data = host_bits.data(), .out_features = N, .in_features = K};
    bytes = std::make_unique<Dev<uint16_t>>(host_bits);
    dev = host;
    dev.data = bytes->p;
  }
};

// The cuda op table's kernels, as the composite ops run them inside.
InnerOps cuda_inner(std::array<MatmulFn, 16>& by_dtype) {
  by_dtype.fill(cuda_fn<MatmulFn>(OpId::matmul));
  return InnerOps{by_dtype.data(), MatmulPrecision::exact(), cuda_fn<SiluMulFn>(OpId::silu_mul),
                  cuda_fn<AddScaledFn>(OpId::add_scaled), cuda_fn<SituMulFn>(OpId::situ_mul)};
}

TEST_F(CudaOps, MoeExperts) {
  std::mt19937 rng(7);
  const int64_t H = 40, I = 24, E = 8, K = 3;
  std::vector<std::unique_ptr<DevWeight>> owned;
  std::vector<MlpWeights> host_experts(E), dev_experts(E);
  for (int64_t e = 0; e < E; ++e) {
    for (int m = 0; m < 3; ++m) owned.push_back(std::make_unique<DevWeight>(m == 2 ? H : I, m == 2 ? I : H, rng));
    const auto& g = *owned[3 * e];
    const auto& u = *owned[3 * e + 1];
    const auto& d = *owned[3 * e + 2];
    host_experts[e] = {g.host, u.host, d.host};
    dev_experts[e] = {g.dev, u.dev, d.dev};
  }
  std::array<MatmulFn, 16> by_dtype;
  const InnerOps inner = cuda_inner(by_dtype);
  // Experts of 1-8 rows run grouped by row count, larger ones a matmul each (T = 17: 8-9 rows);
  // T = 5: each token's last choice is an expert on another rank (-1), skipped.
  for (int64_t T : {1, 3, 5, 17}) {
    const auto x = randn(T * H, rng), base = randn(T * H, rng);
    std::vector<int32_t> ids(T * K);
    std::vector<float> w(T * K);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        ids[t * K + k] = static_cast<int32_t>((t * 5 + k * 2) % 6);  // distinct per token; experts 6, 7 idle
        if (T == 5 && k == K - 1) ids[t * K + k] = -1;
        w[t * K + k] = 0.1f + 0.3f * static_cast<float>(k);
      }
    std::vector<float> want = base;
    MoeExpertsArgs a{x.data(), T, H, K, ids.data(), w.data(), host_experts.data(), E, I, want.data()};
    ref_fn<MoeExpertsFn>(OpId::moe_experts)(a, inner);
    Dev<float> dx(x), dw(w), dout(base);
    Dev<int32_t> dids(ids);
    a.x = dx.p;
    a.topk_ids = dids.p;
    a.topk_weights = dw.p;
    a.experts = dev_experts.data();
    a.out = dout.p;
    cuda_fn<MoeExpertsFn>(OpId::moe_experts)(a, inner);
    EXPECT_LE(normalized_error(dout.host(), want), kBf16) << "T=" << T;
  }
}

TEST_F(CudaOps, HeadMatmulStridedWithPassThrough) {
  std::mt19937 rng(8);
  const int64_t in = 40, out = 24, pass = 8;
  std::array<MatmulFn, 16> by_dtype;
  const InnerOps inner = cuda_inner(by_dtype);
  for (int64_t heads : {1, 16})
    for (int64_t T : {1, 17}) {
      std::vector<std::unique_ptr<DevWeight>> owned;
      std::vector<WeightMatrix> host_w, dev_w;
      for (int64_t h = 0; h < heads; ++h) {
        owned.push_back(std::make_unique<DevWeight>(out, in, rng));
        host_w.push_back(owned.back()->host);
        dev_w.push_back(owned.back()->dev);
      }
      const int64_t xh = in + pass + 3, xt = heads * xh + 5, yh = out + pass + 2, yt = heads * yh + 7;
      const auto x = randn(T * xt, rng);
      std::vector<float> want(T * yt, 7.0f);
      HeadMatmulArgs a{x.data(), xt, xh, T, heads, host_w.data(), want.data(), yt, yh, pass};
      ref_fn<HeadMatmulFn>(OpId::head_matmul)(a, inner);
      Dev<float> dx(x), dy(std::vector<float>(T * yt, 7.0f));
      a.x = dx.p;
      a.weights = dev_w.data();
      a.y = dy.p;
      cuda_fn<HeadMatmulFn>(OpId::head_matmul)(a, inner);
      const auto got = dy.host();
      EXPECT_LE(normalized_error(got, want), kBf16) << "heads=" << heads << " T=" << T;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = out; i < yh; ++i) EXPECT_EQ(got[t * yt + h * yh + i], want[t * yt + h * yh + i]);
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

// ---- Kimi Delta Attention ops (kda_ops_test.cpp has the host side) ------------------------------

TEST(CudaOpsRegistry, KdaOpsResolveForRealShapes) {
  for (auto [heads, dim] : {std::pair<int64_t, int64_t>{12, 128}, {96, 128}, {32, 128}, {4, 16}})
    for (OpId op : {OpId::short_conv, OpId::kda_gate, OpId::kda_recurrent, OpId::kda_chunked, OpId::gated_rms_norm}) {
      const Resolution r =
          Registry::global().resolve(op, Backend::cuda, OpShape{.heads_per_rank = heads, .head_dim = dim});
      EXPECT_EQ(r.kind, Resolution::Kind::kernel) << op_name(op) << " " << r.describe();
    }
  // the recurrent kernels hold a thread's state rows in registers: head dims up to 256
  const OpShape too_wide{.heads_per_rank = 4, .head_dim = 512};
  EXPECT_FALSE(Registry::global().resolve(OpId::kda_chunked, Backend::cuda, too_wide).usable());
}

// Per-sequence device states and the device array of their pointers, as the ops take them.
struct DevStates {
  std::vector<std::unique_ptr<Dev<float>>> each;
  std::unique_ptr<Dev<float*>> ptrs;
  explicit DevStates(const std::vector<std::vector<float>>& host) {
    std::vector<float*> p;
    for (const auto& h : host) {
      each.push_back(std::make_unique<Dev<float>>(h));
      p.push_back(each.back()->p);
    }
    ptrs = std::make_unique<Dev<float*>>(p);
  }
  std::vector<float> host() const {
    std::vector<float> out;
    for (const auto& d : each) {
      const auto h = d->host();
      out.insert(out.end(), h.begin(), h.end());
    }
    return out;
  }
};

// Several sequences (one of length 1, one past several chunks) in two calls split mid-sequence,
// states carried; both KDA ops against the reference kda_recurrent.
TEST_F(CudaOps, KdaRecurrentAndChunked) {
  std::mt19937 rng(9);
  struct Shape {
    int64_t H, K, V;
    std::vector<int32_t> lens;
  };
  for (const Shape& sh : {Shape{12, 128, 128, {1, 40, 300}}, Shape{4, 16, 16, {1, 2, 17, 33}},
                          Shape{3, 20, 24, {7, 65}}, Shape{2, 256, 64, {20}}}) {
    const int64_t H = sh.H, K = sh.K, V = sh.V, S = static_cast<int64_t>(sh.lens.size());
    std::vector<int32_t> starts(S), first(S), second(S), starts2(S);
    int64_t T = 0;
    for (int64_t s = 0; s < S; ++s) {
      starts[s] = static_cast<int32_t>(T);
      first[s] = sh.lens[s] / 2;
      second[s] = sh.lens[s] - first[s];
      starts2[s] = starts[s] + first[s];
      T += sh.lens[s];
    }
    const auto q = randn(T * H * K, rng), k = randn(T * H * K, rng), v = randn(T * H * V, rng),
               beta = randn(T * H, rng, 2.0f);
    std::vector<float> g(T * H * K);
    std::normal_distribution<float> log_rate(-1.5f, 1.5f);
    for (float& x : g) x = -std::min(40.0f, std::exp(log_rate(rng)));
    std::vector<std::vector<float>> states;
    for (int64_t s = 0; s < S; ++s) states.push_back(randn(H * K * V, rng, 0.3f));

    auto args = [&](const float* dq, const float* dk, const float* dv, const float* dg, const float* db,
                     const int32_t* st, const int32_t* len, float* const* sp, float* out) {
      return KdaArgs{dq, dk, H * K, dv, H * V, dg, db, T, H, K, V, S, st, len, sp, out};
    };
    auto ref_states = states;
    std::vector<float*> ref_ptrs;
    for (auto& st : ref_states) ref_ptrs.push_back(st.data());
    std::vector<float> ref_out(T * H * V);
    for (const auto* part : {&first, &second})
      ref_fn<KdaFn>(OpId::kda_recurrent)(args(q.data(), k.data(), v.data(), g.data(), beta.data(),
                                              part == &first ? starts.data() : starts2.data(), part->data(),
                                              ref_ptrs.data(), ref_out.data()));
    std::vector<float> ref_state_all;
    for (const auto& st : ref_states) ref_state_all.insert(ref_state_all.end(), st.begin(), st.end());

    Dev<float> dq(q), dk(k), dv(v), dg(g), db(beta);
    Dev<int32_t> dstarts(starts), dstarts2(starts2), dfirst(first), dsecond(second);
    for (OpId op : {OpId::kda_recurrent, OpId::kda_chunked}) {
      DevStates dstates(states);
      Dev<float> dout(std::vector<float>(T * H * V, NAN));
      cuda_fn<KdaFn>(op)(args(dq.p, dk.p, dv.p, dg.p, db.p, dstarts.p, dfirst.p, dstates.ptrs->p, dout.p));
      cuda_fn<KdaFn>(op)(args(dq.p, dk.p, dv.p, dg.p, db.p, dstarts2.p, dsecond.p, dstates.ptrs->p, dout.p));
      EXPECT_LE(normalized_error(dout.host(), ref_out), kExact) << op_name(op) << " H=" << H << " K=" << K;
      EXPECT_LE(normalized_error(dstates.host(), ref_state_all), kExact) << op_name(op) << " states H=" << H;
    }
  }
}

// Step states (speculative verification): kda_recurrent and short_conv over sequences of lengths
// 1..9 (and an empty one) in one call, against the reference kernels' step states; asking for
// them changes neither the outputs nor the final states, and a sequence's last step state is its
// final state.
TEST_F(CudaOps, KdaStepStates) {
  std::mt19937 rng(12);
  const std::vector<int32_t> lens = {3, 1, 9, 5, 0, 2, 8, 4, 7, 6};
  const int64_t S = static_cast<int64_t>(lens.size());
  std::vector<int32_t> starts(S);
  int64_t T = 0;
  for (int64_t s = 0; s < S; ++s) {
    starts[s] = static_cast<int32_t>(T);
    T += lens[s];
  }
  Dev<int32_t> dstarts(starts), dlens(lens);
  auto step_buffers = [&](int64_t per_token) {  // [S][len, per_token], NaN until written
    std::vector<std::vector<float>> out;
    for (int32_t n : lens) out.emplace_back(static_cast<size_t>(n * per_token), NAN);
    return out;
  };
  auto ptrs_of = [](std::vector<std::vector<float>>& v) {
    std::vector<float*> p;
    for (auto& e : v) p.push_back(e.data());
    return p;
  };
  auto concat = [](const std::vector<std::vector<float>>& v) {
    std::vector<float> out;
    for (const auto& e : v) out.insert(out.end(), e.begin(), e.end());
    return out;
  };
  // Each sequence's last step state against its final state, exactly.
  auto last_steps_are_final = [&](const DevStates& steps, const DevStates& finals, int64_t per_token) {
    for (int64_t s = 0; s < S; ++s) {
      if (lens[s] == 0) continue;
      const auto st = steps.each[s]->host(), fin = finals.each[s]->host();
      if (!std::equal(fin.begin(), fin.end(), st.end() - per_token)) return false;
    }
    return true;
  };

  for (auto [H, K, V] : {std::tuple<int64_t, int64_t, int64_t>{4, 32, 40}, {12, 128, 128}}) {
    const int64_t HKV = H * K * V;
    const auto q = randn(T * H * K, rng), k = randn(T * H * K, rng), v = randn(T * H * V, rng),
               beta = randn(T * H, rng, 2.0f);
    std::vector<float> g(T * H * K);
    std::normal_distribution<float> log_rate(-1.5f, 1.5f);
    for (float& x : g) x = -std::min(40.0f, std::exp(log_rate(rng)));
    std::vector<std::vector<float>> states;
    for (int64_t s = 0; s < S; ++s) states.push_back(randn(HKV, rng, 0.3f));

    auto ref_states = states, ref_steps = step_buffers(HKV);
    auto ref_state_ptrs = ptrs_of(ref_states), ref_step_ptrs = ptrs_of(ref_steps);
    std::vector<float> ref_out(T * H * V);
    KdaArgs ra{q.data(), k.data(), H * K, v.data(), H * V, g.data(), beta.data(), T, H, K, V, S, starts.data(),
               lens.data(), ref_state_ptrs.data(), ref_out.data()};
    ra.step_states = ref_step_ptrs.data();
    ref_fn<KdaFn>(OpId::kda_recurrent)(ra);

    Dev<float> dq(q), dk(k), dv(v), dg(g), db(beta);
    DevStates plain_states(states), with_states(states), dsteps(step_buffers(HKV));
    Dev<float> plain_out(std::vector<float>(T * H * V, NAN)), with_out(std::vector<float>(T * H * V, NAN));
    KdaArgs da{dq.p, dk.p, H * K, dv.p, H * V, dg.p, db.p, T, H, K, V, S, dstarts.p, dlens.p, plain_states.ptrs->p,
               plain_out.p};
    cuda_fn<KdaFn>(OpId::kda_recurrent)(da);
    da.states = with_states.ptrs->p;
    da.out = with_out.p;
    da.step_states = dsteps.ptrs->p;
    cuda_fn<KdaFn>(OpId::kda_recurrent)(da);
    const std::string what = "kda_recurrent H=" + std::to_string(H) + " K=" + std::to_string(K);
    EXPECT_TRUE(with_out.host() == plain_out.host()) << what << " outputs changed by step states";
    EXPECT_TRUE(with_states.host() == plain_states.host()) << what << " final states changed by step states";
    EXPECT_LE(normalized_error(dsteps.host(), concat(ref_steps)), kExact) << what << " step states";
    EXPECT_LE(normalized_error(with_out.host(), ref_out), kExact) << what;
    EXPECT_TRUE(last_steps_are_final(dsteps, with_states, HKV)) << what;
  }

  // short_conv: step states are copies of inputs, so exactly the reference's
  const int64_t C = 389, W = 4, per_token = (W - 1) * C;
  const auto x = randn(T * C, rng, 2.0f), w = randn(C * W, rng, 0.5f);
  std::vector<std::vector<float>> states;
  for (int64_t s = 0; s < S; ++s) states.push_back(randn(per_token, rng));
  auto ref_states = states, ref_steps = step_buffers(per_token);
  auto ref_state_ptrs = ptrs_of(ref_states), ref_step_ptrs = ptrs_of(ref_steps);
  std::vector<float> ref_y(T * C);
  ShortConvArgs ra{x.data(), C, T, C, W, w.data(), S, starts.data(), lens.data(), ref_state_ptrs.data(),
                   ref_y.data(), C};
  ra.step_states = ref_step_ptrs.data();
  ref_fn<ShortConvFn>(OpId::short_conv)(ra);

  Dev<float> dx(x), dw(w);
  DevStates plain_states(states), with_states(states), dsteps(step_buffers(per_token));
  Dev<float> plain_y(std::vector<float>(T * C, NAN)), with_y(std::vector<float>(T * C, NAN));
  ShortConvArgs da{dx.p, C, T, C, W, dw.p, S, dstarts.p, dlens.p, plain_states.ptrs->p, plain_y.p, C};
  cuda_fn<ShortConvFn>(OpId::short_conv)(da);
  da.states = with_states.ptrs->p;
  da.y = with_y.p;
  da.step_states = dsteps.ptrs->p;
  cuda_fn<ShortConvFn>(OpId::short_conv)(da);
  EXPECT_TRUE(with_y.host() == plain_y.host()) << "short_conv outputs changed by step states";
  EXPECT_TRUE(with_states.host() == plain_states.host()) << "short_conv final states changed by step states";
  EXPECT_TRUE(dsteps.host() == concat(ref_steps)) << "short_conv step states";
  EXPECT_LE(normalized_error(with_y.host(), ref_y), kExact) << "short_conv";
  EXPECT_TRUE(last_steps_are_final(dsteps, with_states, per_token)) << "short_conv";
}

TEST_F(CudaOps, KdaShortConvGateAndGatedNorm) {
  std::mt19937 rng(10);
  // short_conv: three sequences in two calls (the second continues from the state)
  const int64_t C = 389, W = 4;
  const std::vector<int32_t> lens = {1, 2, 70}, first = {1, 1, 33}, second = {0, 1, 37};
  std::vector<int32_t> starts = {0, 1, 3}, starts2(3);
  for (int s = 0; s < 3; ++s) starts2[s] = starts[s] + first[s];
  const int64_t T = 73;
  const auto x = randn(T * C, rng, 2.0f), w = randn(C * W, rng, 0.5f);
  std::vector<std::vector<float>> states;
  for (int s = 0; s < 3; ++s) states.push_back(randn((W - 1) * C, rng));
  auto ref_states = states;
  std::vector<float*> ref_ptrs;
  for (auto& st : ref_states) ref_ptrs.push_back(st.data());
  std::vector<float> ref_y(T * C);
  for (int call = 0; call < 2; ++call)
    ref_fn<ShortConvFn>(OpId::short_conv)(ShortConvArgs{x.data(), C, T, C, W, w.data(), 3,
                                                        call == 0 ? starts.data() : starts2.data(),
                                                        call == 0 ? first.data() : second.data(), ref_ptrs.data(),
                                                        ref_y.data(), C});
  {
    Dev<float> dx(x), dw(w), dy(std::vector<float>(T * C, NAN));
    Dev<int32_t> ds(starts), ds2(starts2), df(first), dsec(second);
    DevStates dstates(states);
    for (int call = 0; call < 2; ++call)
      cuda_fn<ShortConvFn>(OpId::short_conv)(ShortConvArgs{dx.p, C, T, C, W, dw.p, 3, call == 0 ? ds.p : ds2.p,
                                                           call == 0 ? df.p : dsec.p, dstates.ptrs->p, dy.p, C});
    EXPECT_LE(normalized_error(dy.host(), ref_y), kExact) << "short_conv";
    std::vector<float> want_states;
    for (const auto& st : ref_states) want_states.insert(want_states.end(), st.begin(), st.end());
    EXPECT_EQ(dstates.host(), want_states) << "short_conv states";
  }
  // kda_gate, both forms, and gated_rms_norm
  const int64_t H = 12, K = 128, Tg = 5;
  auto raw = randn(Tg * H * K, rng, 8.0f);
  raw[0] = 30.0f;
  const auto dt_bias = randn(H * K, rng), a_log = randn(H, rng), gate = randn(Tg * H * K, rng, 3.0f),
             nw = randn(K, rng);
  Dev<float> draw(raw), dbias(dt_bias), dalog(a_log), dgate(gate), dnw(nw);
  for (float lb : {0.0f, -5.0f}) {
    std::vector<float> ref(raw.size());
    ref_fn<KdaGateFn>(OpId::kda_gate)(KdaGateArgs{raw.data(), Tg, H, K, a_log.data(), dt_bias.data(), lb, ref.data()});
    Dev<float> dg(std::vector<float>(raw.size(), NAN));
    cuda_fn<KdaGateFn>(OpId::kda_gate)(KdaGateArgs{draw.p, Tg, H, K, dalog.p, dbias.p, lb, dg.p});
    EXPECT_LE(normalized_error(dg.host(), ref), kExact) << "kda_gate lb=" << lb;
  }
  std::vector<float> ref(raw.size());
  ref_fn<GatedRmsNormFn>(OpId::gated_rms_norm)(GatedRmsNormArgs{raw.data(), gate.data(), nw.data(), Tg, H, K, 1e-5f,
                                                                ref.data()});
  Dev<float> dy(std::vector<float>(raw.size(), NAN));
  cuda_fn<GatedRmsNormFn>(OpId::gated_rms_norm)(GatedRmsNormArgs{draw.p, dgate.p, dnw.p, Tg, H, K, 1e-5f, dy.p});
  EXPECT_LE(normalized_error(dy.host(), ref), kExact) << "gated_rms_norm";
}

// ---- Kimi K3: situ_mul, sigmoid_mul, attn_res_mix, moe_experts with SiTU ----------------------
// Tolerances as tests/ops/k3_ops_test.cpp's for the host kernels: tanhf / expf are ~2 ulp, and
// attn_res_mix sums rows in double (k3_kernels.cu).

// Largest |out - ref| / max(|ref|, 1e-30) per element.
double k3_max_relative_error(const std::vector<float>& out, const std::vector<float>& ref) {
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(out[i]) != std::isnan(ref[i])) return INFINITY;
    worst = std::max(worst, std::fabs(static_cast<double>(out[i]) - ref[i]) /
                                std::max(std::fabs(static_cast<double>(ref[i])), 1e-30));
  }
  return worst;
}

TEST_F(CudaOps, K3SituMulAndSigmoidMul) {
  std::mt19937 rng(11);
  for (int64_t n : {16, 33, 128, 7168})
    for (int64_t T : {1, 3, 70}) {
      auto g = randn(T * n, rng, 4.0f);
      const float edges[] = {60.0f, -60.0f, 0.0f, 2.0f, -2.0f, 1e-7f, 30.0f, -45.0f};
      for (size_t i = 0; i < std::size(edges); ++i) g[i] = edges[i];
      auto u = randn(T * n, rng, 10.0f);
      u[T * n - 1] = 200.0f, u[T * n - 2] = -12.5f;
      Dev<float> dg(g), du(u), dy(std::vector<float>(T * n));
      std::vector<float> ref(T * n);
      ref_fn<SituMulFn>(OpId::situ_mul)(g.data(), u.data(), T, n, 4.0f, 25.0f, ref.data());
      cuda_fn<SituMulFn>(OpId::situ_mul)(dg.p, du.p, T, n, 4.0f, 25.0f, dy.p);
      EXPECT_LE(k3_max_relative_error(dy.host(), ref), 1e-5) << "situ_mul n=" << n << " T=" << T;
      Dev<float> dalias(g);  // y may alias gate
      cuda_fn<SituMulFn>(OpId::situ_mul)(dalias.p, du.p, T, n, 4.0f, 25.0f, dalias.p);
      EXPECT_LE(k3_max_relative_error(dalias.host(), ref), 1e-5) << "situ_mul aliased n=" << n;
      ref_fn<SigmoidMulFn>(OpId::sigmoid_mul)(u.data(), g.data(), T * n, ref.data());
      cuda_fn<SigmoidMulFn>(OpId::sigmoid_mul)(du.p, dg.p, T * n, dy.p);
      EXPECT_LE(k3_max_relative_error(dy.host(), ref), 1e-5) << "sigmoid_mul n=" << n << " T=" << T;
    }
}

TEST_F(CudaOps, K3AttnResMix) {
  std::mt19937 rng(12);
  for (int64_t D : {16, 33, 7168})
    for (int64_t T : {1, 3, 70})
      for (int64_t R : {1, 2, 5, 9, 40}) {  // 40: more rows than travel in the kernel's parameters
        if (R == 40 && D == 7168 && T == 70) continue;
        std::vector<std::vector<float>> rows;
        std::vector<std::unique_ptr<Dev<float>>> dev_rows;
        std::vector<const float*> host_ptrs, dev_ptrs;
        std::uniform_real_distribution<float> scale(0.1f, 30.0f);
        for (int64_t r = 0; r < R; ++r) {
          auto v = randn(T * D, rng);
          for (int64_t t = 0; t < T; ++t) {
            const float s = r == 0 && D == 33 ? 1e20f : scale(rng);  // D = 33: one huge row
            for (int64_t d = 0; d < D; ++d) v[t * D + d] *= s;
          }
          rows.push_back(std::move(v));
          dev_rows.push_back(std::make_unique<Dev<float>>(rows.back()));
          host_ptrs.push_back(rows.back().data());
          dev_ptrs.push_back(dev_rows.back()->p);
        }
        for (float wscale : {1.0f / std::sqrt(static_cast<float>(D)), 1.0f}) {
          const auto w = randn(D, rng, wscale);
          std::vector<float> ref(T * D);
          ref_fn<AttnResMixFn>(OpId::attn_res_mix)(AttnResMixArgs{host_ptrs.data(), R, T, D, w.data(), 1e-6f, ref.data()});
          Dev<float> dw(w), dout(std::vector<float>(T * D));
          cuda_fn<AttnResMixFn>(OpId::attn_res_mix)(AttnResMixArgs{dev_ptrs.data(), R, T, D, dw.p, 1e-6f, dout.p});
          const auto got = dout.host();
          for (int64_t t = 0; t < T; ++t)
            EXPECT_LE(normalized_error(std::vector<float>(got.begin() + t * D, got.begin() + (t + 1) * D),
                                       std::vector<float>(ref.begin() + t * D, ref.begin() + (t + 1) * D)),
                      kExact)
                << "attn_res_mix D=" << D << " T=" << T << " R=" << R << " t=" << t;
        }
      }
}

TEST_F(CudaOps, K3MoeExpertsSitu) {
  std::mt19937 rng(13);
  const int64_t H = 40, I = 24, E = 8, K = 3;
  std::vector<std::unique_ptr<DevWeight>> owned;
  std::vector<MlpWeights> host_experts(E), dev_experts(E);
  for (int64_t e = 0; e < E; ++e) {
    for (int m = 0; m < 3; ++m) owned.push_back(std::make_unique<DevWeight>(m == 2 ? H : I, m == 2 ? I : H, rng));
    host_experts[e] = {owned[3 * e]->host, owned[3 * e + 1]->host, owned[3 * e + 2]->host};
    dev_experts[e] = {owned[3 * e]->dev, owned[3 * e + 1]->dev, owned[3 * e + 2]->dev};
  }
  std::array<MatmulFn, 16> by_dtype;
  const InnerOps inner = cuda_inner(by_dtype);
  for (int64_t T : {1, 3, 17}) {
    const auto x = randn(T * H, rng, 3.0f), base = randn(T * H, rng);
    std::vector<int32_t> ids(T * K);
    std::vector<float> w(T * K);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        ids[t * K + k] = static_cast<int32_t>((t * 5 + k * 2) % 6);
        w[t * K + k] = 0.1f + 0.3f * static_cast<float>(k);
      }
    std::vector<float> want = base;
    MoeExpertsArgs a{x.data(), T, H, K, ids.data(), w.data(), host_experts.data(), E, I, want.data()};
    a.activation = GatedActivation::situ;
    ref_fn<MoeExpertsFn>(OpId::moe_experts)(a, inner);
    Dev<float> dx(x), dw(w), dout(base);
    Dev<int32_t> dids(ids);
    a.x = dx.p;
    a.topk_ids = dids.p;
    a.topk_weights = dw.p;
    a.experts = dev_experts.data();
    a.out = dout.p;
    cuda_fn<MoeExpertsFn>(OpId::moe_experts)(a, inner);
    EXPECT_LE(normalized_error(dout.host(), want), kBf16) << "SiTU T=" << T;
  }
}

}  // namespace
}  // namespace moat::ops

#endif  // MOAT_HAVE_CUDA
