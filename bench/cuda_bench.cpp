// The cuda backend's decode-path ops at DeepSeek-V3 / Kimi K2 shapes on one GPU, each against
// the device's own limits measured in the same run (STYLE.md: a benchmark prints its roofline):
//   - copy bandwidth: cudaMemcpy device-to-device of 2 GiB, bytes read + written (the decode
//     roofline; a read-only stream can run somewhat above it);
//   - bf16 matrix peak: the cuda matmul op itself at 8192 x 8192 x 8192 (cuBLAS after rounding x
//     to bf16, the way every bf16 matmul of the model runs);
// then the ops a decode step runs, with the bytes each must move:
//   - dense matmuls (fused q_a + kv_a, q_b, o_proj, lm_head) in bf16 and fp8 (128 x 128 block
//     scales) at T = 1 .. 4096: GB/s of weights against the copy probe, TFLOP/s against the peak;
//   - the routed experts of one MoE layer (256 experts of 7168 x 2048, top 8) at T = 1 .. 256:
//     GB/s of the distinct experts the tokens chose;
//   - absorbed MLA decode attention over the paged latent cache (576 values a row; 128 heads as
//     at TP 1 and 16 as at TP 8; bf16 and fp8 cache) at 4k and 32k of context, 1-64 sequences:
//     GB/s of the cache rows each step must read once.
// Weights are replicated past 4x the L2 size and cycled, so a small matrix comes from HBM as it
// would when decode walks 61 layers. Times are CUDA events around each call, median of the reps.
// Tensors hold random finite values (zeros run faster and hide nothing here).
//
//   cuda_bench [--quick]   (markdown to stdout; exits 77 without a usable device)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "base/dtype.h"
#include "base/weight.h"
#include "kernels/cuda/cuda_backend.h"
#include "ops/dispatch.h"
#include "ops/kernel_types.h"

namespace {

using namespace moat;
using namespace moat::ops;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "cuda_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// The cuda op table for these needs; a resolution failure ends the run, naming the op.
OpTable cuda_table(const ModelOpNeeds& needs) {
  auto table = OpTable::resolve(Backend::cuda, needs);
  if (!table.ok()) {
    std::fprintf(stderr, "cuda_bench: %s\n", table.error().message.c_str());
    std::exit(1);
  }
  return std::move(*table);
}

constexpr size_t kL2Rotation = size_t{256} << 20;  // > 4x the H200's 60 MB L2

// A device allocation filled from a host pattern of random finite values of one element kind.
enum class Fill { f32, bf16, fp8, scale };

// 64 MiB of random finite values of one kind, drawn once: 30 GB of experts drawn value by value
// on the host would take minutes, and timing needs finite, varied values, not distinct ones.
const std::vector<uint8_t>& pattern(Fill fill) {
  static std::vector<uint8_t> made[4];
  std::vector<uint8_t>& host = made[static_cast<int>(fill)];
  if (!host.empty()) return host;
  host.resize(size_t{64} << 20);
  std::mt19937 rng(static_cast<unsigned>(fill) + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t i = 0; i < host.size();) {
    switch (fill) {
      case Fill::f32: {
        const float v = normal(rng);
        std::memcpy(&host[i], &v, 4);
        i += 4;
        break;
      }
      case Fill::scale: {
        const float v = 0.01f + 0.001f * std::fabs(normal(rng));
        std::memcpy(&host[i], &v, 4);
        i += 4;
        break;
      }
      case Fill::bf16: {
        const uint16_t v = f32_to_bf16(0.05f * normal(rng));
        std::memcpy(&host[i], &v, 2);
        i += 2;
        break;
      }
      case Fill::fp8: {
        uint8_t v = static_cast<uint8_t>(byte(rng));
        if ((v & 0x7f) == 0x7f) v ^= 1;  // e4m3's NaN codes
        host[i++] = v;
        break;
      }
    }
  }
  return host;
}

struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  DeviceBuffer(size_t n, Fill fill) : bytes(n) {
    check(cudaMalloc(&p, std::max<size_t>(n, 16)), "cudaMalloc");
    const std::vector<uint8_t>& host = pattern(fill);
    for (size_t off = 0; off < n; off += host.size())
      check(cudaMemcpy(static_cast<uint8_t*>(p) + off, host.data(), std::min(host.size(), n - off), cudaMemcpyHostToDevice),
            "fill");
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// Median milliseconds of fn() over CUDA events: 2 warm-up calls, then reps until ~0.3 s or 25.
template <typename Fn>
double median_ms(Fn&& fn, int max_reps = 25) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  for (int i = 0; i < 2; ++i) fn(i);
  check(cudaDeviceSynchronize(), "warm-up");
  std::vector<float> ms;
  float total = 0;
  for (int i = 0; i < max_reps && (i < 3 || total < 300.0f); ++i) {
    check(cudaEventRecord(a, 0), "record");
    fn(i);
    check(cudaEventRecord(b, 0), "record");
    check(cudaEventSynchronize(b), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, a, b), "elapsed");
    ms.push_back(t);
    total += t;
  }
  check(cudaGetLastError(), "kernels");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Copies of one matrix, enough to cycle past the L2 (rotate), or one (a routed expert: the other
// 255 experts of the layer already keep it out of the L2).
struct MatrixSet {
  std::vector<std::unique_ptr<DeviceBuffer>> data, scales;
  std::vector<WeightMatrix> views;
  MatrixSet(DType dtype, int64_t out, int64_t in, bool rotate = true) {
    WeightMatrix w;
    w.dtype = dtype;
    w.out_features = out;
    w.in_features = in;
    const size_t bytes = static_cast<size_t>(out * in) * dtype_size(dtype);
    const size_t copies = rotate ? std::clamp<size_t>((kL2Rotation + bytes - 1) / bytes, 1, 16) : 1;
    for (size_t c = 0; c < copies; ++c) {
      data.push_back(std::make_unique<DeviceBuffer>(bytes, dtype == DType::F8_E4M3 ? Fill::fp8 : Fill::bf16));
      w.data = data.back()->p;
      if (dtype == DType::F8_E4M3) {
        scales.push_back(std::make_unique<DeviceBuffer>(sizeof(float) * ((out + 127) / 128) * ((in + 127) / 128),
                                                        Fill::scale));
        w.scale_inv = scales.back()->as<float>();
      }
      views.push_back(w);
    }
  }
  const WeightMatrix& at(int i) const { return views[static_cast<size_t>(i) % views.size()]; }
};

struct Limits {
  double copy_gbs = 0, bf16_tflops = 0;
};

Limits probe(const OpTable& table) {
  Limits lim;
  const size_t n = size_t{2} << 30;
  void *src, *dst;
  check(cudaMalloc(&src, n), "cudaMalloc");
  check(cudaMalloc(&dst, n), "cudaMalloc");
  check(cudaMemset(src, 0x3c, n), "memset");
  const double copy_ms = median_ms([&](int) { check(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice), "copy"); });
  lim.copy_gbs = 2.0 * n / (copy_ms * 1e-3) / 1e9;
  cudaFree(src);
  cudaFree(dst);
  const int64_t S = 8192;
  MatrixSet w(DType::BF16, S, S);
  DeviceBuffer x(sizeof(float) * S * S, Fill::f32), y(sizeof(float) * S * S, Fill::f32);
  const double gemm_ms = median_ms([&](int i) { table.matmul(x.as<float>(), S, w.at(i), y.as<float>()); });
  lim.bf16_tflops = 2.0 * S * S * S / (gemm_ms * 1e-3) / 1e12;
  return lim;
}

void dense_rows(const OpTable& table, const Limits& lim, bool quick) {
  struct Shape {
    const char* name;
    int64_t out, in;
    bool fp8;  // also in fp8 (the lm_head stays bf16 in DeepSeek-V3's checkpoints)
  };
  const Shape shapes[] = {{"q_a + kv_a (fused)", 1536 + 576, 7168, true},
                          {"q_b", 128 * 192, 1536, true},
                          {"o_proj", 7168, 128 * 128, true},
                          {"lm_head", 129280, 7168, false}};
  std::vector<int64_t> tokens = quick ? std::vector<int64_t>{1, 64, 4096} : std::vector<int64_t>{1, 16, 64, 512, 4096};
  fmt::print("| matmul | weights | T | us | GB/s of weights | % of copy | TFLOP/s | % of bf16 peak |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes)
    for (DType dtype : {DType::BF16, DType::F8_E4M3}) {
      if (dtype == DType::F8_E4M3 && !s.fp8) continue;
      MatrixSet w(dtype, s.out, s.in);
      const int64_t Tmax = tokens.back();
      DeviceBuffer x(sizeof(float) * Tmax * s.in, Fill::f32), y(sizeof(float) * Tmax * s.out, Fill::f32);
      for (int64_t T : tokens) {
        const double ms = median_ms([&](int i) { table.matmul(x.as<float>(), T, w.at(i), y.as<float>()); });
        const double gbs = w.views[0].bytes() / (ms * 1e-3) / 1e9;
        const double tflops = 2.0 * T * s.out * s.in / (ms * 1e-3) / 1e12;
        fmt::print("| {} [{} x {}] | {} | {} | {:.1f} | {:.0f} | {:.0f}% | {:.1f} | {:.0f}% |\n", s.name, s.out, s.in,
                   dtype_name(dtype), T, ms * 1e3, gbs, 100 * gbs / lim.copy_gbs, tflops,
                   100 * tflops / lim.bf16_tflops);
      }
    }
}

void expert_rows(const Limits& lim, bool quick, std::mt19937& rng) {
  const int64_t E = 256, H = 7168, I = 2048, K = 8;
  std::vector<int64_t> tokens = quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 4, 16, 64, 256};
  fmt::print("\n| routed experts (256 x [7168 x 2048], top 8) | weights | T | distinct experts | ms | GB/s of those experts | % of copy |\n");
  fmt::print("|---|---|---|---|---|---|---|\n");
  for (DType dtype : {DType::BF16, DType::F8_E4M3}) {
    const OpTable table = cuda_table(ModelOpNeeds{.matmul_dtypes = {dtype},
                                                  .heads_per_rank = 16,
                                                  .attention_head_dim = 576,
                                                  .num_experts = E,
                                                  .top_k = K,
                                                  .expert_dtype = dtype});
    std::vector<std::unique_ptr<MatrixSet>> owned;
    std::vector<MlpWeights> experts(E);
    for (int64_t e = 0; e < E; ++e) {
      owned.push_back(std::make_unique<MatrixSet>(dtype, I, H, false));
      experts[e].gate_proj = owned.back()->at(0);
      owned.push_back(std::make_unique<MatrixSet>(dtype, I, H, false));
      experts[e].up_proj = owned.back()->at(0);
      owned.push_back(std::make_unique<MatrixSet>(dtype, H, I, false));
      experts[e].down_proj = owned.back()->at(0);
    }
    const int64_t Tmax = tokens.back();
    DeviceBuffer x(sizeof(float) * Tmax * H, Fill::f32), out(sizeof(float) * Tmax * H, Fill::f32);
    for (int64_t T : tokens) {
      // Each token's 8 distinct experts, drawn uniformly (a trained router is less even).
      std::vector<int32_t> ids(T * K);
      std::vector<float> weights(T * K, 1.0f / K);
      std::vector<int32_t> all(E);
      for (int64_t e = 0; e < E; ++e) all[e] = static_cast<int32_t>(e);
      for (int64_t t = 0; t < T; ++t) {
        std::shuffle(all.begin(), all.end(), rng);
        std::copy(all.begin(), all.begin() + K, ids.begin() + t * K);
      }
      int32_t* d_ids = static_cast<int32_t*>(cuda::device_alloc(sizeof(int32_t) * T * K));
      float* d_w = static_cast<float*>(cuda::device_alloc(sizeof(float) * T * K));
      cuda::copy_to_device(d_ids, ids.data(), sizeof(int32_t) * T * K);
      cuda::copy_to_device(d_w, weights.data(), sizeof(float) * T * K);
      MoeExpertsArgs args{x.as<float>(), T, H, K, d_ids, d_w, experts.data(), E, I, out.as<float>()};
      MoeExpertsArgs host_args = args;
      host_args.topk_ids = ids.data();
      const double bytes = routed_expert_bytes(host_args);
      std::vector<bool> seen(E);
      int64_t distinct = 0;
      for (int32_t e : ids) distinct += !seen[e], seen[e] = true;
      const double ms = median_ms([&](int) { table.moe_experts(args); });
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      fmt::print("| | {} | {} | {} | {:.2f} | {:.0f} | {:.0f}% |\n", dtype_name(dtype), T, distinct, ms, gbs,
                 100 * gbs / lim.copy_gbs);
      cuda::device_free(d_ids);
      cuda::device_free(d_w);
    }
  }
}

void attention_rows(const Limits& lim, bool quick, std::mt19937& rng) {
  const int64_t C = 512, R = 64, D = C + R, block = 64;
  fmt::print("\n| MLA decode attention | cache | heads | context | sequences | ms | GB/s of cache rows | % of copy |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (DType kv : {DType::BF16, DType::F8_E4M3})
    for (int64_t heads : {int64_t{128}, int64_t{16}}) {
      const OpTable table = cuda_table(
          ModelOpNeeds{.matmul_dtypes = {DType::BF16}, .heads_per_rank = heads, .attention_head_dim = D, .kv_dtype = kv});
      for (int64_t ctx : {int64_t{4096}, int64_t{32768}})
        for (int64_t B : quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 16, 64}) {
          const int64_t blocks_per_seq = ctx / block, slots = B * ctx;
          const size_t row_bytes = static_cast<size_t>(D) * dtype_size(kv);
          DeviceBuffer rows(row_bytes * slots, kv == DType::F8_E4M3 ? Fill::fp8 : Fill::bf16);
          std::unique_ptr<DeviceBuffer> scales;
          if (kv == DType::F8_E4M3) scales = std::make_unique<DeviceBuffer>(sizeof(float) * slots, Fill::scale);
          // Each sequence's blocks in shuffled order, as a pool hands them out.
          std::vector<int32_t> ids(B * blocks_per_seq);
          for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
          std::shuffle(ids.begin(), ids.end(), rng);
          std::vector<int32_t> token_seq(B), kv_len(B, static_cast<int32_t>(ctx));
          for (int64_t t = 0; t < B; ++t) token_seq[t] = static_cast<int32_t>(t);
          DeviceBuffer q(sizeof(float) * B * heads * D, Fill::f32), out(sizeof(float) * B * heads * C, Fill::f32);
          auto* d_tables = static_cast<int32_t*>(cuda::device_alloc(sizeof(int32_t) * ids.size()));
          auto* d_seq = static_cast<int32_t*>(cuda::device_alloc(sizeof(int32_t) * B));
          auto* d_len = static_cast<int32_t*>(cuda::device_alloc(sizeof(int32_t) * B));
          cuda::copy_to_device(d_tables, ids.data(), sizeof(int32_t) * ids.size());
          cuda::copy_to_device(d_seq, token_seq.data(), sizeof(int32_t) * B);
          cuda::copy_to_device(d_len, kv_len.data(), sizeof(int32_t) * B);
          const MlaAttentionArgs args{q.as<float>(), B, heads, C, R,
                                      LatentPages{rows.p, scales ? scales->as<float>() : nullptr, kv, block},
                                      d_tables, blocks_per_seq, d_seq, d_len, 1.0f / std::sqrt(192.0f),
                                      out.as<float>()};
          const double ms = median_ms([&](int) { table.mla_attention(args); }, 10);
          const double bytes = static_cast<double>(slots) * (row_bytes + (kv == DType::F8_E4M3 ? 4 : 0));
          const double gbs = bytes / (ms * 1e-3) / 1e9;
          fmt::print("| | {} | {} | {} | {} | {:.3f} | {:.0f} | {:.0f}% |\n", dtype_name(kv), heads, ctx, B, ms, gbs,
                     100 * gbs / lim.copy_gbs);
          cuda::device_free(d_tables);
          cuda::device_free(d_seq);
          cuda::device_free(d_len);
        }
    }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: cuda_bench [--quick]\n");
      return 2;
    }
  }
  std::string why;
  if (!cuda::device_available(&why)) {
    std::fprintf(stderr, "cuda_bench: no usable CUDA device: %s\n", why.c_str());
    return 77;
  }
  std::mt19937 rng(2026);
  const OpTable table = cuda_table(
      ModelOpNeeds{.matmul_dtypes = {DType::BF16, DType::F8_E4M3}, .heads_per_rank = 16, .attention_head_dim = 576});
  const Limits lim = probe(table);
  fmt::print("Device: {}. Probes in this run: device-to-device copy {:.0f} GB/s (read + write), bf16 matmul op "
             "at 8192^3 {:.0f} TFLOP/s.\n\n",
             cuda::device_name(), lim.copy_gbs, lim.bf16_tflops);
  dense_rows(table, lim, quick);
  expert_rows(lim, quick, rng);
  attention_rows(lim, quick, rng);
  return 0;
}
