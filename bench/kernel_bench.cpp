// Kernel microbenchmarks with their roofline next to them (STYLE.md: "a benchmark prints its
// roofline next to its result"). For each thread count it measures, in the same run:
//   - memory read bandwidth: a 512 MiB buffer summed with 512-bit loads, the best of a few access
//     patterns (one stream or several per thread, with and without software prefetch: roofline.h)
//     (the decode roofline);
//   - bf16 and fp32 peaks: 24 independent chains of vdpbf16ps / vfmadd231ps (the prefill roofline);
// then the matmul kernels the registry resolves on this CPU (bf16 and fp8 block-scaled weights) at
// T = 1 (GB/s of weights vs bandwidth), T = 512 (GFLOPS vs bf16 peak), batched decode T = 8, 16, 64
// on the expert, projection and lm_head shapes (vs the lower of the two), and MLA decode
// attention (GB/s of latent cache). Weight sets are replicated past the L3 size and cycled, so a
// small matrix is read from DRAM as it would be when decode walks 26 layers of experts.
// Kimi Delta Attention (kda_rows): kda_recurrent decode (GB/s of state vs bandwidth) and
// kda_chunked prefill at 1k, 8k and 32k tokens, 12 heads (K3 per rank at TP 8) and 32 (Kimi
// Linear) (tokens/s and us/token vs the fp32 peak); --kda-only runs just the probes and these.
// 4-bit routed experts (q4_rows): MXFP4 and INT4 (group 32) at Kimi K3's 3072 x 3584 gate/up and
// 3584 x 3072 down and Kimi K2-Thinking's 2048 x 7168 gate/up, T = 1 (GB/s of codes + scales vs
// bandwidth, default W4A16 and exact) and T = 16, 64 (vs the lower of the bf16 peak and streaming
// the weights once); --4bit-only runs just the probes and these. --decode-only: the probes and
// every T = 1 matmul row (bf16, fp8, 4-bit), the quick check of the decode GEMVs.
// Every timed kernel is first checked against the reference kernel.
//
//   kernel_bench [--threads 1,2] [--markdown] [--batched-only] [--kda-only] [--4bit-only] [--decode-only]
#include <immintrin.h>

// GCC 12's _mm512_reduce_add_ps starts from an _mm512_undefined value: a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "base/dtype.h"
#include "base/thread_pool.h"
#include "base/weight.h"
#include "kernels/cpu/cpu_kernels.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"
#include "matmul_peak.h"
#include "roofline.h"

namespace {

using namespace moat;
using namespace moat::ops;
using namespace moat::bench;

struct Weights {
  HugeBuffer<uint8_t> bytes{0};
  std::vector<float> scales;
  std::vector<WeightMatrix> copies;
};

// `copies` matrices [N, K] of random weights, enough to exceed the last-level cache.
Weights make_weights(DType dtype, int64_t N, int64_t K, int64_t min_total_bytes) {
  Weights w;
  const int64_t one = N * K * static_cast<int64_t>(dtype_size(dtype));
  const int64_t copies = std::max<int64_t>(1, (min_total_bytes + one - 1) / one);
  w.bytes = HugeBuffer<uint8_t>(static_cast<size_t>(copies * one));
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (int64_t i = 0; i < N * K; ++i) {
    if (dtype == DType::BF16) {
      const uint16_t b = f32_to_bf16(dist(rng));
      std::memcpy(&w.bytes[2 * i], &b, 2);
    } else {
      w.bytes[i] = static_cast<uint8_t>(rng() & 0x77);  // finite codes of moderate size
    }
  }
  // The other copies only keep the set out of cache: byte copies of the first (drawing every
  // weight took most of a run where the L3 is reported large: 512 MiB sets on a Zen 3 VM).
  for (int64_t c = 1; c < copies; ++c) std::memcpy(&w.bytes[c * one], &w.bytes[0], static_cast<size_t>(one));
  const int64_t srows = (N + 127) / 128, scols = (K + 127) / 128;
  w.scales.assign(static_cast<size_t>(srows * scols), 0.01f);
  for (int64_t c = 0; c < copies; ++c)
    w.copies.push_back(WeightMatrix{.dtype = dtype, .data = w.bytes.data() + c * one, .out_features = N,
                                    .in_features = K,
                                    .scale_inv = dtype == DType::F8_E4M3 ? w.scales.data() : nullptr});
  return w;
}

const KernelEntry* best_kernel(OpId op, const OpShape& shape) {
  const Resolution r = Registry::global().resolve(op, Backend::cpu, shape);
  return r.usable() ? r.kernel : nullptr;
}

double max_norm_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - ref[i]));
    m = std::max(m, std::fabs(static_cast<double>(ref[i])));
  }
  return d / std::max(m, 1e-30);
}

struct Row {
  std::string what, kernel;
  double value, roofline, pct;
  const char* unit;
};

// Kimi Delta Attention, K = V = 128 (Kimi Linear and Kimi K3), every kernel first checked against
// the reference:
//   decode   kda_recurrent, one token of one sequence, 12 heads (K3 at TP 8) and 96: each head's
//            state [K, V] fp32 is read and written once per token (2 x 64 KiB), cycled through
//            copies past the L3 as decode walks the layers; GB/s of state vs the read bandwidth
//            (writes cost more than reads on most machines, so this roofline is optimistic).
//   prefill  kda_chunked over 1024, 8192 and 32768 tokens of one sequence at 12 heads (K3 per rank
//            at TP 8) and 32 (Kimi Linear 48B at TP 1), and kda_recurrent at 12 heads over 1024
//            and 8192 for comparison: tokens/s and us/token; the roofline is the fp32 FMA peak
//            over the step's own arithmetic (7 K V flops per token and head: decay, S^T k, the
//            rank-1 update, S^T q). Flat per-token time from 1k to 32k is the point: no work
//            grows with the context. Inputs of the long calls tile one random block of 64 Ki
//            values (drawing 32k x 32 x 128 x 5 normals took longer than the timing).
// False when a kernel disagrees with the reference (reported on stderr).
bool kda_rows(std::vector<Row>& rows, const std::string& tt, double bw, double fp32_peak, bool check,
              int64_t llc_span) {
  const int64_t K = 128, V = 128, head_state = K * V;
  // The KDA kernels need AVX-512: elsewhere the ops fall back to the reference, which is not worth
  // timing (its 32k-token prefill alone runs for many minutes) and is no roofline comparison.
  for (OpId op : {OpId::kda_recurrent, OpId::kda_chunked}) {
    const KernelEntry* k = best_kernel(op, OpShape{.heads_per_rank = 12, .head_dim = K});
    if (k == nullptr || k->backend != Backend::cpu) {
      std::fprintf(stderr, "kernel_bench: no cpu kernel for the KDA ops on this CPU (reference fallback): KDA rows skipped\n");
      rows.push_back({"kda rows (" + tt + ")", "none on this CPU: the reference fallback, not timed", 0, 0, 0, "-"});
      return true;
    }
  }
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> decay(-0.5f, -0.01f);
  auto fill = [&](std::vector<float>& v, size_t n, bool is_g) {
    constexpr size_t kBlock = size_t{1} << 16;
    v.resize(n);
    for (size_t i = 0; i < std::min(n, kBlock); ++i) v[i] = is_g ? decay(rng) : dist(rng);
    for (size_t i = kBlock; i < n; i += kBlock) std::copy_n(v.begin(), std::min(kBlock, n - i), v.begin() + i);
  };
  const auto* rec_ref = Registry::global().kernels(OpId::kda_recurrent, Backend::reference).front();
  // Inputs of T tokens of one sequence over H heads, state `state`.
  struct Call {
    std::vector<float> q, k, v, g, beta, out;
    int32_t start = 0, len = 0;
    float* state = nullptr;
    KdaArgs args(int64_t H) {
      return KdaArgs{q.data(), k.data(), H * 128, v.data(), H * 128, g.data(), beta.data(), len, H, 128, 128, 1,
                     &start, &len, &state, out.data()};
    }
  };
  auto make_call = [&](int64_t T, int64_t H) {
    Call c;
    fill(c.q, T * H * K, false);
    fill(c.k, T * H * K, false);
    fill(c.v, T * H * V, false);
    fill(c.g, T * H * K, true);
    fill(c.beta, T * H, false);
    c.out.resize(T * H * V);
    c.len = static_cast<int32_t>(T);
    return c;
  };
  // kernel vs reference from the same state, on a copy
  auto agrees = [&](const KernelEntry* k, int64_t T, int64_t H) {
    Call c = make_call(T, H);
    std::vector<float> s0(H * head_state), s1;
    for (float& x : s0) x = 0.1f * dist(rng);
    s1 = s0;
    c.state = s0.data();
    reinterpret_cast<KdaFn>(k->fn)(c.args(H));
    const std::vector<float> out = c.out;
    c.state = s1.data();
    reinterpret_cast<KdaFn>(rec_ref->fn)(c.args(H));
    const double err = std::max(max_norm_err(out, c.out), max_norm_err(s0, s1));
    if (err > 1e-5)
      std::fprintf(stderr, "%s disagrees with the reference: normalized error %g\n", k->name.c_str(), err);
    return err <= 1e-5;
  };

  for (int64_t H : {12, 96}) {  // decode
    const KernelEntry* k = best_kernel(OpId::kda_recurrent, OpShape{.heads_per_rank = H, .head_dim = K});
    if (check && !agrees(k, 1, H)) return false;
    const int64_t one = H * head_state, copies = std::max<int64_t>(1, llc_span / (one * 4));
    HugeBuffer<float> states(static_cast<size_t>(copies * one));
    for (size_t i = 0; i < states.size(); ++i) states[i] = 0.01f * static_cast<float>(static_cast<int>(i % 199) - 99);
    Call c = make_call(1, H);
    int64_t copy = 0;
    const double sec = time_per_call([&] {
      c.state = states.data() + copy * one;
      reinterpret_cast<KdaFn>(k->fn)(c.args(H));
      copy = (copy + 1) % copies;
    }, 0.5);
    const double gbs = 2.0 * one * 4 / sec / 1e9;
    rows.push_back({"kda_recurrent decode T=1, " + std::to_string(H) + " heads x 128x128 state (" + tt + ")", k->name,
                    gbs, bw, 100 * gbs / bw, "GB/s"});
  }
  struct Prefill {
    OpId op;
    int64_t H;
    std::vector<int64_t> tokens;
  };
  const Prefill prefills[] = {{OpId::kda_chunked, 12, {1024, 8192, 32768}},
                              {OpId::kda_chunked, 32, {1024, 8192, 32768}},
                              {OpId::kda_recurrent, 12, {1024, 8192}}};
  for (const Prefill& p : prefills) {
    const int64_t H = p.H;
    const KernelEntry* k = best_kernel(p.op, OpShape{.heads_per_rank = H, .head_dim = K});
    if (check && !agrees(k, 100, H)) return false;
    Call c = make_call(p.tokens.back(), H);  // shorter calls read a prefix
    for (int64_t T : p.tokens) {
      c.len = static_cast<int32_t>(T);
      std::vector<float> state(H * head_state, 0.0f);
      c.state = state.data();
      // a 32k call takes seconds: one warm-up and the best of three
      const double budget = T > 8192 ? 0.0 : T > 1024 ? 1.0 : 0.5;
      const double sec = time_per_call([&] { reinterpret_cast<KdaFn>(k->fn)(c.args(H)); }, budget);
      const double tok_s = T / sec, roof = fp32_peak * 1e9 / (7.0 * K * V * H);
      rows.push_back({std::string(op_name(k->op)) + " T=" + std::to_string(T) + ", " + std::to_string(H) +
                          " heads x 128 (" + tt + "), " + fmt::format("{:.1f}", 1e6 * sec / T) + " us/tok",
                      k->name, tok_s, roof, 100 * tok_s / roof, "tok/s"});
    }
  }
  return true;
}

// `copies` 4-bit matrices [N, K] (MXFP4: e8m0 scales 2^-8..2^0; INT4: bf16 scales ~0.01), the codes
// and scales of each copy side by side, enough to exceed the last-level cache.
struct Q4Weights {
  HugeBuffer<uint8_t> bytes{0};
  std::vector<WeightMatrix> copies;
};
Q4Weights make_q4_weights(DType dtype, int64_t N, int64_t K, int64_t min_total_bytes) {
  Q4Weights w;
  const int64_t packed = N * K / 2, scale_bytes = N * K / 32 * (dtype == DType::MXFP4 ? 1 : 2);
  const int64_t one = (packed + scale_bytes + 63) / 64 * 64;
  const int64_t copies = std::max<int64_t>(1, (min_total_bytes + one - 1) / one);
  w.bytes = HugeBuffer<uint8_t>(static_cast<size_t>(copies * one));
  std::mt19937 rng(9);
  for (int64_t c = 0; c < copies; ++c) {
    uint8_t* p = w.bytes.data() + c * one;
    for (int64_t i = 0; i < packed; ++i) p[i] = static_cast<uint8_t>(rng());
    uint8_t* s = p + packed;
    for (int64_t g = 0; g < N * K / 32; ++g) {
      if (dtype == DType::MXFP4) {
        s[g] = static_cast<uint8_t>(119 + rng() % 9);
      } else {
        const uint16_t b = f32_to_bf16(0.005f + 0.01f * static_cast<float>(rng() % 100) / 100.0f);
        std::memcpy(s + 2 * g, &b, 2);
      }
    }
    w.copies.push_back(WeightMatrix::packed_4bit(dtype, p, s, N, K));
  }
  return w;
}

// The dot-product peak a matmul kernel's batched calls run against: AMX tiles' for
// cpu.matmul_amx_bf16, vdpbf16ps' for the rest.
double dot_peak(const KernelEntry* k, double peak, double amx_peak) {
  return k->name == "cpu.matmul_amx_bf16" ? amx_peak : peak;
}

// The 4-bit routed-expert rows: T = 1 at the default precision (x rounded to bf16, W4A16) and exact
// (x split into bf16 hi + lo), GB/s of codes + scales against the read bandwidth; batched decode
// T = 16 and 64 (x rounded to bf16) against the lower of the kernel's dot-product peak (dot_peak)
// and streaming the weights once. check: compare with the reference first. False when a kernel
// disagrees.
bool q4_rows(std::vector<Row>& rows, const std::string& tt, double bw, double peak, double amx_peak, bool check,
             int64_t llc_span, bool decode_only) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  struct Shape {
    int64_t N, K;
  };
  const Shape experts[] = {{3072, 3584}, {3584, 3072}, {2048, 7168}};  // K3 gate/up, K3 down, K2 gate/up
  const auto* ref = Registry::global().kernels(OpId::matmul, Backend::reference).front();
  for (DType dtype : {DType::MXFP4, DType::INT4_G32}) {
    const KernelEntry* k = best_kernel(OpId::matmul, OpShape{.weight_dtype = dtype});
    auto fn = reinterpret_cast<MatmulFn>(k->fn);
    for (const Shape& s : experts) {
      Q4Weights w = make_q4_weights(dtype, s.N, s.K, llc_span);
      struct Variant {
        int64_t T;
        bool exact;
      };
      for (auto [T, exact] : {Variant{1, false}, Variant{1, true}, Variant{16, false}, Variant{64, false}}) {
        if (decode_only && T > 1) continue;
        const MatmulPrecision precision = exact ? MatmulPrecision::exact() : MatmulPrecision{};
        std::vector<float> x(static_cast<size_t>(T * s.K)), y(static_cast<size_t>(T * s.N));
        for (float& v : x) v = dist(rng);
        if (check) {
          std::vector<float> yr(y.size());
          fn(x.data(), T, w.copies[0], y.data(), precision);
          reinterpret_cast<MatmulFn>(ref->fn)(x.data(), T, w.copies[0], yr.data(), precision);
          const double err = max_norm_err(y, yr);
          if (err > 1e-2) {
            std::fprintf(stderr, "%s (%s) disagrees with the reference: normalized error %g\n", k->name.c_str(),
                         std::string(dtype_name(dtype)).c_str(), err);
            return false;
          }
        }
        size_t c = 0;
        const double sec = time_per_call([&] {
          fn(x.data(), T, w.copies[c], y.data(), precision);
          c = (c + 1) % w.copies.size();
        }, T == 1 ? 0.5 : 1.0);
        const std::string what = "matmul " + std::string(dtype_name(dtype)) + " " + std::to_string(s.N) + "x" +
                                 std::to_string(s.K) + " T=" + std::to_string(T) + (exact ? " exact" : "") + " (" + tt +
                                 ")";
        const double bytes = static_cast<double>(w.copies[0].bytes());
        if (T == 1) {
          const double gbs = bytes / sec / 1e9;
          rows.push_back({what, k->name, gbs, bw, 100 * gbs / bw, "GB/s"});
        } else {
          const double flops = 2.0 * T * s.N * s.K, gflops = flops / sec / 1e9;
          const double roof = std::min(dot_peak(k, peak, amx_peak), bw * flops / bytes);
          rows.push_back({what, k->name, gflops, roof, 100 * gflops / roof, "GFLOPS"});
        }
      }
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> thread_counts = {1, 2};
  bool markdown = false;
  bool batched_only = false;  // only the probes and the batched-decode matmul rows (quick)
  bool kda_only = false;      // only the probes and the KDA rows (quick)
  bool q4_only = false;       // only the probes and the 4-bit matmul rows
  bool decode_only = false;   // only the probes and the T = 1 matmul rows (every weight type)
  bool mla_only = false;      // only the probes and the MLA attention rows
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) {
      thread_counts.clear();
      std::string list = argv[++i];
      for (size_t p = 0; p < list.size();) {
        size_t q = list.find(',', p);
        thread_counts.push_back(std::stoi(list.substr(p, q - p)));
        p = q == std::string::npos ? list.size() : q + 1;
      }
    } else if (a == "--markdown") {
      markdown = true;
    } else if (a == "--batched-only") {
      batched_only = true;
    } else if (a == "--kda-only") {
      kda_only = true;
    } else if (a == "--4bit-only") {
      q4_only = true;
    } else if (a == "--decode-only") {
      decode_only = true;
    } else if (a == "--mla-only") {
      mla_only = true;
    } else {
      std::fprintf(stderr, "usage: kernel_bench [--threads 1,2] [--markdown] [--batched-only] [--kda-only] [--4bit-only] [--decode-only] [--mla-only]\n");
      return 2;
    }
  }
  if (!cpu_has_isa("avx2")) {
    std::fprintf(stderr, "kernel_bench: this CPU lacks AVX2 + FMA + F16C; the roofline probes need it\n");
    return 1;
  }
  // Weights cycle through at least 256 MiB and twice the last-level cache (Granite Rapids-class
  // hosts report 480 MiB of L3), so decode rows read memory, not cache; the bandwidth probe reads
  // at least 512 MiB and as much.
  const int64_t l3 = std::max<int64_t>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
  const int64_t kLlcSpan = std::max<int64_t>(256ll << 20, 2 * l3);
  HugeBuffer<float> bw_buf(static_cast<size_t>(std::max<int64_t>(512ll << 20, 2 * l3) / 4));

  struct Shape {
    int64_t N, K;
  };
  const Shape shapes[] = {{2048, 10944}, {1408, 2048}};  // [out, in]: V2-Lite dense down; expert gate/up
  // --decode-only adds the rest of the bench checkpoint's decode GEMVs (V2-Lite shapes): expert down,
  // q_proj, kv_a_proj, o_proj, shared experts' gate/up and the lm_head
  const Shape decode_shapes[] = {{2048, 10944}, {1408, 2048}, {2048, 1408}, {3072, 2048}, {576, 2048},
                                 {2048, 2048},  {2816, 2048}, {102400, 2048}};
  std::vector<Row> rows;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);

  // MLA attention rows (decode at 4096 cached rows, a 1024-token prefill); false: a kernel disagreed with
  // the reference. check: compare against the reference (the first thread count).
  auto mla_rows = [&](const std::string& tt, double bw, double peak, double fp32_peak, double amx_peak,
                      bool check) -> bool {
    // MLA decode attention: one token, 16 heads, 4096 cached latents of 576 values in the paged
    // bf16 cache (blocks of 64 rows, shuffled over the pool as a serving engine leaves them), on the
    // best kernel and, where that one rounds to bf16 (cpu.mla_attention_avx512bf16), on the fp32
    // avx512 kernel as well (what --exact runs).
    for (const bool exact : {false, true}) {
      const int64_t heads = 16, L = 4096, C = 512, R = 64, D = C + R, B = 64, per_copy = L / B;
      const DType kv = DType::BF16;
      const KernelEntry* k =
          best_kernel(OpId::mla_attention, OpShape{.heads_per_rank = heads, .head_dim = D, .kv_dtype = kv});
      const bool rounds = k->name == "cpu.mla_attention_avx512bf16";
      if (exact && !rounds) break;
      const KernelEntry* store = best_kernel(OpId::store_latent, OpShape{.head_dim = D, .kv_dtype = kv});
      const int64_t copies = std::max<int64_t>(1, kLlcSpan / (L * D * 2));
      HugeBuffer<uint16_t> pool(static_cast<size_t>(copies * L * D));  // [copies * L, D] bf16
      const LatentPages pages{pool.data(), nullptr, kv, B};
      std::vector<int32_t> ids(static_cast<size_t>(copies * per_copy));  // [copies, per_copy] block tables
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
      std::shuffle(ids.begin(), ids.end(), rng);
      std::vector<float> latent(static_cast<size_t>(L * D)), q(heads * D), out(heads * C), ref(heads * C);
      for (float& v : latent) v = dist(rng) * 0.1f;
      for (float& v : q) v = dist(rng);
      std::vector<int64_t> slots(static_cast<size_t>(L));
      for (int64_t c = 0; c < copies; ++c) {
        for (int64_t j = 0; j < L; ++j) slots[j] = int64_t{ids[c * per_copy + j / B]} * B + j % B;
        reinterpret_cast<StoreLatentFn>(store->fn)(StoreLatentArgs{latent.data(), L, D, slots.data(), pages});
      }
      const int32_t len = static_cast<int32_t>(L);
      int32_t seq = 0;  // the copy read by the next call: a row of the block tables
      auto args = [&](float* o) {
        return MlaAttentionArgs{q.data(), 1, heads, C, R, pages, ids.data(), per_copy, &seq, &len, 0.04f, o, exact};
      };
      if (check) {  // correctness before speed
        reinterpret_cast<MlaAttentionFn>(k->fn)(args(out.data()));
        const auto* rk = Registry::global().kernels(OpId::mla_attention, Backend::reference).front();
        reinterpret_cast<MlaAttentionFn>(rk->fn)(args(ref.data()));
        const double err = max_norm_err(out, ref), bound = rounds && !exact ? 1e-2 : 1e-5;
        if (err > bound) {
          std::fprintf(stderr, "%s disagrees with the reference: normalized error %g\n", k->name.c_str(), err);
          return false;
        }
      }
      const double sec = time_per_call([&] {
        reinterpret_cast<MlaAttentionFn>(k->fn)(args(out.data()));
        seq = static_cast<int32_t>((seq + 1) % copies);
      });
      // scores: 2 flops per q.row element; output: 2 per latent element; per head, per cache row
      const double flops = 2.0 * heads * L * (D + C), bytes = L * D * 2.0;
      const double roof = std::min(rounds && !exact ? peak : fp32_peak, bw * flops / bytes);
      rows.push_back({"mla_attention 16 heads, 4096 x 576 bf16 paged cache (block 64), T=1" +
                          std::string(exact ? " exact" : "") + " (" + tt + ")",
                      rounds && exact ? "cpu.mla_attention_avx512" : k->name, flops / sec / 1e9, roof,
                      100 * flops / sec / 1e9 / roof, "GFLOPS"});
    }
    // MLA prefill attention: a 1024-token prompt from an empty cache (causal), 16 heads, on the best
    // kernel and, where that one rounds to bf16 (AMX tiles, avx512bf16 dot products), on the fp32
    // avx512 kernel too;
    // compute-bound: its roofline is the peak of the dot products each kernel uses.
    {
      const int64_t heads = 16, T = 1024, C = 512, R = 64, D = C + R, B = 64, blocks = T / B;
      const DType kv = DType::BF16;
      const OpShape shape{.heads_per_rank = heads, .head_dim = D, .kv_dtype = kv};
      const KernelEntry* best = best_kernel(OpId::mla_attention, shape);
      const KernelEntry* store = best_kernel(OpId::store_latent, OpShape{.head_dim = D, .kv_dtype = kv});
      HugeBuffer<uint16_t> pool(static_cast<size_t>(T * D));
      const LatentPages pages{pool.data(), nullptr, kv, B};
      std::vector<int32_t> table(static_cast<size_t>(blocks));
      for (int64_t i = 0; i < blocks; ++i) table[i] = static_cast<int32_t>(i);
      std::shuffle(table.begin(), table.end(), rng);
      std::vector<float> latent(static_cast<size_t>(T * D)), q(static_cast<size_t>(T * heads * D));
      for (float& v : latent) v = dist(rng) * 0.1f;
      for (float& v : q) v = dist(rng);
      std::vector<int64_t> slots(static_cast<size_t>(T));
      for (int64_t j = 0; j < T; ++j) slots[j] = int64_t{table[j / B]} * B + j % B;
      reinterpret_cast<StoreLatentFn>(store->fn)(StoreLatentArgs{latent.data(), T, D, slots.data(), pages});
      std::vector<int32_t> seq(static_cast<size_t>(T), 0), len(static_cast<size_t>(T));
      double flops = 0;  // scores and output: 2 flops per element, per head, per visible cache row
      for (int64_t t = 0; t < T; ++t) {
        len[t] = static_cast<int32_t>(t + 1);
        flops += 2.0 * heads * (t + 1) * (D + C);
      }
      std::vector<std::vector<float>> outs;
      const KernelEntry* avx512 = nullptr;
      for (const KernelEntry* k : Registry::global().kernels(OpId::mla_attention, Backend::cpu))
        if (k->name == "cpu.mla_attention_avx512") avx512 = k;
      const bool rounds = best->name == "cpu.mla_attention_amx" || best->name == "cpu.mla_attention_avx512bf16";
      for (const KernelEntry* k : {best, rounds ? avx512 : nullptr}) {
        if (!k) continue;
        std::vector<float> out(static_cast<size_t>(T * heads * C));
        const MlaAttentionArgs args{q.data(), T, heads, C, R, pages, table.data(), blocks, seq.data(), len.data(), 0.04f,
                                    out.data()};
        const double sec = time_per_call([&] { reinterpret_cast<MlaAttentionFn>(k->fn)(args); });
        const double roof = k->name == "cpu.mla_attention_amx"          ? amx_peak
                            : k->name == "cpu.mla_attention_avx512bf16" ? peak
                                                                        : fp32_peak;
        rows.push_back({"mla_attention prefill 16 heads, 1024 causal tokens, bf16 paged cache (" + tt + ")", k->name,
                        flops / sec / 1e9, roof, 100 * flops / sec / 1e9 / roof, "GFLOPS"});
        outs.push_back(std::move(out));
      }
      // the bf16 queries / probabilities against the avx512 kernel's fp32 ones
      if (outs.size() == 2 && max_norm_err(outs[0], outs[1]) > 1e-2) {
        std::fprintf(stderr, "%s disagrees with the avx512 kernel: %g\n", best->name.c_str(),
                     max_norm_err(outs[0], outs[1]));
        return false;
      }
    }
    return true;
  };

  for (int threads : thread_counts) {
    set_num_threads(threads);
    const Bandwidth bwp = read_bandwidth({{bw_buf.data(), static_cast<int64_t>(bw_buf.size())}}, 1.0);
    const double bw = bwp.gbs;
    // the matmul kernels' dot-product peak (matmul_peak.h): vdpbf16ps', or fp32 FMAs' where the CPU
    // lacks AVX-512 BF16 (or MOAT_DISABLE_ISA takes it away); AMX rows have their own (dot_peak)
    const bool amx = cpu_has_isa("amx-bf16");
    const MatmulPeak matmul_probe =
        kernel_peak(amx ? "cpu.matmul_avx512bf16" : best_kernel(OpId::matmul, OpShape{.weight_dtype = DType::BF16})->name);
    const double peak = matmul_probe.gflops;
    const double fp32_peak = fp32_peak_gflops();
    const std::string tt = std::to_string(threads) + "t";
    rows.push_back({"memory read bandwidth (" + tt + ")", std::string("512 MiB, best: ") + bwp.pattern, bw, bw, 100,
                    "GB/s"});
    if (cpu_has_isa("avx512bf16")) rows.push_back({"bf16 peak (" + tt + ")", matmul_probe.probe, peak, peak, 100, "GFLOPS"});
    else if (std::string_view(matmul_probe.probe) != fp32_peak_probe())
      rows.push_back({"matmul FMA peak (" + tt + ")", matmul_probe.probe, peak, peak, 100, "GFLOPS"});
    rows.push_back({"fp32 FMA peak (" + tt + ")", fp32_peak_probe(), fp32_peak, fp32_peak, 100, "GFLOPS"});
    // AMX tiles where the CPU has them: the roofline of cpu.matmul_amx_bf16's calls
    const double amx_peak = amx ? amx_bf16_peak_gflops() : 0;
    if (amx) rows.push_back({"AMX bf16 peak (" + tt + ")", "tdpbf16ps x4 tiles", amx_peak, amx_peak, 100, "GFLOPS"});

    if (q4_only) {
      if (!q4_rows(rows, tt, bw, peak, amx_peak, threads == thread_counts.front(), kLlcSpan, false)) return 1;
      continue;
    }
    if (kda_only) {
      if (!kda_rows(rows, tt, bw, fp32_peak, threads == thread_counts.front(), kLlcSpan)) return 1;
      continue;
    }
    if (mla_only) {
      if (!mla_rows(tt, bw, peak, fp32_peak, amx_peak, threads == thread_counts.front())) return 1;
      continue;
    }
    // With AMX, prefill rows of the avx512bf16 kernel too: the same run's measure of what AMX adds
    // (decode-sized calls run the same code in both).
    const KernelEntry* avx512bf16 = nullptr;
    for (const KernelEntry* e : Registry::global().kernels(OpId::matmul, Backend::cpu))
      if (e->name == "cpu.matmul_avx512bf16") avx512bf16 = e;
    for (DType dtype : {DType::BF16, DType::F8_E4M3})
    for (const KernelEntry* k : {best_kernel(OpId::matmul, OpShape{.weight_dtype = dtype}), amx ? avx512bf16 : nullptr}) {
      if (batched_only || k == nullptr) break;
      const bool second = k == avx512bf16 && amx;
      const auto* ref = Registry::global().kernels(OpId::matmul, Backend::reference).front();
      auto fn = reinterpret_cast<MatmulFn>(k->fn);
      for (const Shape& s : decode_only ? std::span<const Shape>(decode_shapes) : std::span<const Shape>(shapes)) {
        if (decode_only && dtype == DType::F8_E4M3 && s.N > 4096) continue;  // the lm_head stays bf16
        Weights w = make_weights(dtype, s.N, s.K, kLlcSpan);
        // T = 1 (decode) and 512 (prefill), each in the default precision (x rounded to bf16 for
        // the bf16 kernel's dot products: W16A16 / W8A16) and, for that kernel, exact (x split
        // into bf16 hi + lo: fp32-accurate, `moat --exact`). Other kernels are fp32-accurate always.
        struct Variant {
          int64_t T;
          bool exact;
        };
        for (auto [T, exact] : {Variant{1, false}, Variant{1, true}, Variant{512, false}, Variant{512, true}}) {
          const bool is_bf16_kernel = k->name == "cpu.matmul_avx512bf16" || k->name == "cpu.matmul_amx_bf16";
          if (exact && !is_bf16_kernel) continue;
          if (decode_only && T > 1) continue;
          if (second && (T == 1 || exact)) continue;
          const MatmulPrecision precision = exact ? MatmulPrecision::exact() : MatmulPrecision{};
          std::vector<float> x(static_cast<size_t>(T * s.K)), y(static_cast<size_t>(T * s.N));
          for (float& v : x) v = dist(rng);
          if (threads == thread_counts.front() && T == 1) {  // correctness before speed
            std::vector<float> yr(y.size());
            fn(x.data(), T, w.copies[0], y.data(), precision);
            reinterpret_cast<MatmulFn>(ref->fn)(x.data(), T, w.copies[0], yr.data(), precision);
            const double err = max_norm_err(y, yr);
            if (err > 1e-2) {
              std::fprintf(stderr, "%s disagrees with the reference: normalized error %g\n", k->name.c_str(), err);
              return 1;
            }
          }
          size_t c = 0;
          const double sec = time_per_call([&] {
            fn(x.data(), T, w.copies[c], y.data(), precision);
            c = (c + 1) % w.copies.size();
          }, T == 1 ? 0.5 : 1.5);
          const std::string what = std::string("matmul ") + std::string(dtype_name(dtype)) + " " +
                                   std::to_string(s.N) + "x" + std::to_string(s.K) + " T=" +
                                   std::to_string(T) + (exact ? " exact" : "") + " (" + tt + ")";
          if (T == 1) {
            const double gbs = static_cast<double>(w.copies[0].bytes()) / sec / 1e9;
            rows.push_back({what, k->name, gbs, bw, 100 * gbs / bw, "GB/s"});
          } else {
            const double gflops = 2.0 * T * s.N * s.K / sec / 1e9, roof = exact ? peak : dot_peak(k, peak, amx_peak);
            rows.push_back({what, k->name, gflops, roof, 100 * gflops / roof, "GFLOPS"});
          }
        }
      }
    }

    if (decode_only) {
      if (!q4_rows(rows, tt, bw, peak, amx_peak, threads == thread_counts.front(), kLlcSpan, true)) return 1;
      continue;
    }
    // Batched decode: each routed expert gets 5-16 rows in a 64-stream decode step, dense
    // projections and the lm_head get all 64. Default precision (x rounded to bf16 past
    // split_max_tokens). Roofline: the bf16 peak or streaming the weights once, whichever is lower.
    for (DType dtype : {DType::BF16, DType::F8_E4M3}) {
      const KernelEntry* k = best_kernel(OpId::matmul, OpShape{.weight_dtype = dtype});
      auto fn = reinterpret_cast<MatmulFn>(k->fn);
      const Shape batched[] = {{2048, 1408}, {1408, 2048}, {3072, 2048}, {102400, 2048}};  // experts, q_b/kv_b, lm_head
      for (const Shape& s : batched) {
        if (dtype == DType::F8_E4M3 && s.N > 4096) continue;  // the lm_head stays bf16
        Weights w = make_weights(dtype, s.N, s.K, kLlcSpan);
        for (int64_t T : {2, 4, 8, 16, 32, 64}) {
          std::vector<float> x(static_cast<size_t>(T * s.K)), y(static_cast<size_t>(T * s.N));
          for (float& v : x) v = dist(rng);
          size_t c = 0;
          const double sec = time_per_call([&] {
            fn(x.data(), T, w.copies[c], y.data(), MatmulPrecision{});
            c = (c + 1) % w.copies.size();
          }, 1.0);
          const double flops = 2.0 * T * s.N * s.K, gflops = flops / sec / 1e9;
          const double roof = std::min(dot_peak(k, peak, amx_peak), bw * flops / static_cast<double>(w.copies[0].bytes()));
          rows.push_back({"matmul " + std::string(dtype_name(dtype)) + " " + std::to_string(s.N) + "x" +
                              std::to_string(s.K) + " T=" + std::to_string(T) + " (" + tt + ")",
                          k->name, gflops, roof, 100 * gflops / roof, "GFLOPS"});
        }
      }
    }
    if (batched_only) continue;
    if (!q4_rows(rows, tt, bw, peak, amx_peak, threads == thread_counts.front(), kLlcSpan, false)) return 1;

    if (!mla_rows(tt, bw, peak, fp32_peak, amx_peak, threads == thread_counts.front())) return 1;
    if (!kda_rows(rows, tt, bw, fp32_peak, threads == thread_counts.front(), kLlcSpan)) return 1;
  }

  if (markdown) {
    std::printf("| measurement | kernel | achieved | roofline | %% of roofline |\n|---|---|---|---|---|\n");
    for (const Row& r : rows)
      std::printf("| %s | %s | %.1f %s | %.1f %s | %.0f%% |\n", r.what.c_str(), r.kernel.c_str(), r.value, r.unit,
                  r.roofline, r.unit, r.pct);
  } else {
    for (const Row& r : rows)
      std::printf("%-62s %-28s %8.1f %-6s roofline %8.1f  %5.1f%%\n", r.what.c_str(), r.kernel.c_str(), r.value,
                  r.unit, r.roofline, r.pct);
  }
  return 0;
}
