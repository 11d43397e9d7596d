// Roofline probes shared by the benchmarks: memory read bandwidth, bf16 (vdpbf16ps) and fp32 FMA
// peaks, measured on the current thread pool in the same run as the numbers they bound.
#pragma once

#include <immintrin.h>

// GCC 12's _mm512_reduce_add_ps starts from an _mm512_undefined value: a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>

#include "base/huge_pages.h"
#include "base/thread_pool.h"
#include "kernels/cpu/amx_tiles.h"

namespace moat::bench {

using Clock = std::chrono::steady_clock;

// n zero-initialized T in anonymous memory advised MADV_HUGEPAGE, 2 MiB-aligned: the pages decode
// weights sit in (a mapped checkpoint's 2 MiB folios, or the --no-mmap copy). Probes and weight
// sets in plain std::vectors get 4 KiB pages under THP "madvise" mode, which read ~10% slower.
template <typename T>
class HugeBuffer {
 public:
  // Always its own mapping, whatever the size (HugePageAllocator puts small arrays on the heap).
  explicit HugeBuffer(size_t n) : n_(n) {
    const size_t bytes = std::max<size_t>(1, (n * sizeof(T) + kHugePageBytes - 1) / kHugePageBytes) * kHugePageBytes;
    void* p = mmap_huge_aligned(bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, bytes, MADV_HUGEPAGE);
    std::fill_n(static_cast<char*>(p), bytes, 0);  // faults the pages in before any timing
    p_ = std::unique_ptr<T, Unmap>(static_cast<T*>(p), Unmap{bytes});
  }
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_.get()[i]; }

 private:
  struct Unmap {
    size_t bytes;
    void operator()(T* p) const { munmap(p, bytes); }
  };
  std::unique_ptr<T, Unmap> p_;
  size_t n_;
};

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs fn repeatedly for about `budget` seconds after one warm-up call; returns seconds per call
// (the best of 3 rounds, so a stray interruption does not count).
template <typename Fn>
inline double time_per_call(Fn&& fn, double budget = 0.4) {
  fn();
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    int64_t calls = 0;
    const auto t0 = Clock::now();
    double elapsed = 0;
    do {
      fn();
      ++calls;
      elapsed = seconds_since(t0);
    } while (elapsed < budget / 3);
    best = std::min(best, elapsed / calls);
  }
  return best;
}

// Bandwidth probes. No single access pattern reads at the memory's full speed on every x86-64:
// some cores need several streams in flight per thread (each stream gets its own hardware
// prefetcher), some run best on one stream with software prefetch, some without it. Each probe
// sums one thread's range [p, p + n) (n a multiple of 4096 floats) with 512-bit loads (256-bit
// on CPUs without AVX-512: kReadPatternsAvx2); the
// bandwidth figure is the best of them. Every loop over streams and accumulators is unrolled
// explicitly (`#pragma GCC unroll`): at -O2 GCC 12 left such loops rolled, the accumulators in
// memory, and the probes read 2-3x low (issue 12). tests/ops/no_spill_test.cpp checks them.

// S streams side by side (stream s reads [s n/S, (s+1) n/S)), two cache lines per stream a step,
// optionally prefetched 2 KiB ahead into L1 like the matmul tiles.
template <int S, bool kPrefetch>
__attribute__((target("avx512f"))) inline float sum_streams(const float* p, int64_t n) {
  static_assert(S >= 1 && S <= 8);
  const int64_t len = n / S / 32 * 32;
  __m512 acc[S][2];
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s) acc[s][0] = acc[s][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 32) {
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const float* q = p + s * len + i;
      if constexpr (kPrefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(q + 512), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + 528), _MM_HINT_T0);
      }
      acc[s][0] = _mm512_add_ps(acc[s][0], _mm512_loadu_ps(q));
      acc[s][1] = _mm512_add_ps(acc[s][1], _mm512_loadu_ps(q + 16));
    }
  }
  __m512 t = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s) t = _mm512_add_ps(t, _mm512_add_ps(acc[s][0], acc[s][1]));
  return _mm512_reduce_add_ps(t);
}

// One stream, eight accumulators (enough for any add latency x ports at one load per cycle),
// optionally prefetched: the STREAM-like reference.
template <bool kPrefetch>
__attribute__((target("avx512f"))) inline float sum_range(const float* p, int64_t n) {
  __m512 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i + 128 <= n; i += 128) {
    if constexpr (kPrefetch) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)  // each of the 8 lines, 2 KiB ahead like the kernels
        _mm_prefetch(reinterpret_cast<const char*>(p + i + 512 + 16 * j), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(p + i + 16 * j));
  }
#pragma GCC unroll 8
  for (int j = 1; j < 8; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  return _mm512_reduce_add_ps(acc[0]);
}

// The same two probes with 256-bit loads, for CPUs without AVX-512 (Zen 2 / 3, Intel client
// cores): 16 ymm registers hold S x 2 accumulators up to 8 streams.
template <int S, bool kPrefetch>
__attribute__((target("avx2"))) inline float sum_streams_avx2(const float* p, int64_t n) {
  static_assert(S >= 1 && S <= 8);
  const int64_t len = n / S / 16 * 16;
  __m256 acc[S][2];
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s) acc[s][0] = acc[s][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; i += 16) {
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const float* q = p + s * len + i;
      if constexpr (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(q + 512), _MM_HINT_T0);
      acc[s][0] = _mm256_add_ps(acc[s][0], _mm256_loadu_ps(q));
      acc[s][1] = _mm256_add_ps(acc[s][1], _mm256_loadu_ps(q + 8));
    }
  }
  __m256 t = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s) t = _mm256_add_ps(t, _mm256_add_ps(acc[s][0], acc[s][1]));
  alignas(32) float v[8];
  _mm256_store_ps(v, t);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

template <bool kPrefetch>
__attribute__((target("avx2"))) inline float sum_range_avx2(const float* p, int64_t n) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i + 64 <= n; i += 64) {
    if constexpr (kPrefetch) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)  // each of the 4 lines, 2 KiB ahead like the kernels
        _mm_prefetch(reinterpret_cast<const char*>(p + i + 512 + 16 * j), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_add_ps(acc[j], _mm256_loadu_ps(p + i + 8 * j));
  }
#pragma GCC unroll 8
  for (int j = 1; j < 8; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  alignas(32) float v[8];
  _mm256_store_ps(v, acc[0]);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

using SumFn = float (*)(const float*, int64_t);
struct ReadPattern {
  const char* name;
  SumFn fn;
};
inline constexpr ReadPattern kReadPatterns[] = {
    {"1 stream", &sum_range<false>},
    {"1 stream + prefetch", &sum_range<true>},
    {"4 streams", &sum_streams<4, false>},
    {"4 streams + prefetch", &sum_streams<4, true>},
    {"8 streams", &sum_streams<8, false>},
};
inline constexpr ReadPattern kReadPatternsAvx2[] = {
    {"1 stream (avx2)", &sum_range_avx2<false>},
    {"1 stream + prefetch (avx2)", &sum_range_avx2<true>},
    {"4 streams (avx2)", &sum_streams_avx2<4, false>},
    {"4 streams + prefetch (avx2)", &sum_streams_avx2<4, true>},
    {"8 streams (avx2)", &sum_streams_avx2<8, false>},
};
inline bool has_avx512() { return __builtin_cpu_supports("avx512f"); }
inline bool has_avx512bf16() { return __builtin_cpu_supports("avx512bf16"); }
// The patterns this CPU runs (an AVX2-only core faults on the 512-bit ones).
inline std::span<const ReadPattern> read_patterns() {
  if (has_avx512()) return kReadPatterns;
  return kReadPatternsAvx2;
}

struct Bandwidth {
  double gbs;           // the best pattern's GB/s
  const char* pattern;  // which one
};

// GB/s summing the float regions {pointer, count} in turn (any readable memory: a fresh buffer,
// or the weights' own mappings), split over the pool's threads in 16 KiB blocks; the best of
// kReadPatterns.
using Regions = std::vector<std::pair<const float*, int64_t>>;
inline double region_bytes(const Regions& regions) {
  double bytes = 0;
  for (const auto& [p, n] : regions) bytes += static_cast<double>(n / 4096 * 4096) * 4.0;
  return bytes;
}
// One pass of pattern `pat` over the regions.
inline void sum_regions(const Regions& regions, const ReadPattern& pat) {
  std::vector<float> sink(64);
  for (const auto& [p, n] : regions)
    thread_pool().parallel_for(
        n / 4096, [&, p = p](int64_t b, int64_t e) { sink[b % 64] += pat.fn(p + b * 4096, (e - b) * 4096); }, 1);
}
inline Bandwidth read_bandwidth(const Regions& regions, double budget = 0.6) {
  const double bytes = region_bytes(regions);
  Bandwidth best{0, ""};
  for (const ReadPattern& pat : read_patterns()) {
    const double s = time_per_call([&] { sum_regions(regions, pat); }, budget);
    if (bytes / s / 1e9 > best.gbs) best = {bytes / s / 1e9, pat.name};
  }
  return best;
}
// One pass of each pattern, the best: quick enough (about 1 s over 8 GiB) to run between a
// benchmark's repetitions, so that a run's limit is read in the same minute as the run. This VM's
// bandwidth drifts 10-30% from minute to minute: model_bench's bf16 and fp8 decode, set against one
// probe taken after the run, read 72-91% of it in runs a few minutes apart (2026-12-03, Zen 5).
inline Bandwidth read_bandwidth_one_pass(const Regions& regions) {
  const double bytes = region_bytes(regions);
  Bandwidth best{0, ""};
  for (const ReadPattern& pat : read_patterns()) {
    const auto t0 = Clock::now();
    sum_regions(regions, pat);
    const double gbs = bytes / seconds_since(t0) / 1e9;
    if (gbs > best.gbs) best = {gbs, pat.name};
  }
  return best;
}
inline double read_bandwidth_gbs(const Regions& regions) {
  return read_bandwidth(regions).gbs;
}
inline double read_bandwidth_gbs(const HugeBuffer<float>& buf) {
  return read_bandwidth_gbs({{buf.data(), static_cast<int64_t>(buf.size())}});
}

// Peak probes: kChains independent accumulators per thread, so that neither the latency of the
// longest-latency core nor the number of ports limits the rate (Zen 5: 2 ports x ~6 cycles of
// vdpbf16ps latency = 12 in flight; 24 leaves room and still fits 32 zmm registers with the
// two operands).
inline constexpr int kChains = 24;

// GFLOPS of vdpbf16ps (2 flops per bf16 pair: 32 multiply-adds per instruction).
__attribute__((target("avx512f,avx512bf16"))) inline float dpbf16_loop(int64_t iters) {
  __m512 acc[kChains];
#pragma GCC unroll 32
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));  // equal chains would be merged
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 32
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
#pragma GCC unroll 32
  for (int j = 1; j < kChains; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  return _mm512_reduce_add_ps(acc[0]);
}

// GFLOPS of fp32 FMAs (32 flops per 512-bit vfmadd), the roofline of fp32 attention.
__attribute__((target("avx512f"))) inline float fma_loop(int64_t iters) {
  __m512 acc[kChains];
#pragma GCC unroll 32
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));  // equal chains would be merged
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 32
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
  }
#pragma GCC unroll 32
  for (int j = 1; j < kChains; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  return _mm512_reduce_add_ps(acc[0]);
}

// The fp32 FMA loop in ymm registers for AVX2-only CPUs: 12 chains (16 registers; Zen 3 needs
// 2 ports x 4 cycles = 8 in flight, Haswell 2 x 5 = 10).
inline constexpr int kChainsAvx2 = 12;
__attribute__((target("avx2,fma"))) inline float fma_loop_avx2(int64_t iters) {
  __m256 acc[kChainsAvx2];
#pragma GCC unroll 16
  for (int j = 0; j < kChainsAvx2; ++j) acc[j] = _mm256_set1_ps(static_cast<float>(j));  // equal chains would be merged
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.001f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChainsAvx2; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  }
#pragma GCC unroll 16
  for (int j = 1; j < kChainsAvx2; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  alignas(32) float v[8];
  _mm256_store_ps(v, acc[0]);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

// One call of loop(iters) per thread of the pool, timed; GFLOPS at flops_per_iter per call.
template <typename Loop>
inline double peak_gflops(Loop loop, double flops_per_iter) {
  const int64_t iters = 1 << 20;
  std::vector<float> sink(64);
  const int threads = thread_pool().num_threads();
  const double s = time_per_call([&] {
    thread_pool().parallel_for(threads, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sink[i % 64] += loop(iters);
    }, 1);
  }, 0.6);
  return threads * iters * flops_per_iter / s / 1e9;
}
// 256-bit FMAs alone (cpu.matmul_avx2fma's packed GEMM), on any CPU.
inline double fp32_ymm_peak_gflops() { return peak_gflops(fma_loop_avx2, kChainsAvx2 * 16.0); }
inline double fp32_peak_gflops() {
  return has_avx512() ? peak_gflops(fma_loop, kChains * 32.0) : fp32_ymm_peak_gflops();
}
inline const char* fp32_peak_probe() { return has_avx512() ? "vfmadd231ps zmm x24 chains" : "vfmadd231ps ymm x12 chains"; }
inline double bf16_peak_gflops() { return peak_gflops(dpbf16_loop, kChains * 64.0); }

// GFLOPS of AMX tdpbf16ps: four independent 16 x 16 accumulators (tiles 0-3) against two A and two
// B tiles, 16 x 16 x 32 multiply-adds each, so four are in flight where one takes ~16 cycles of
// issue and longer to complete. Only where ops::cpu_has_isa("amx-bf16") (which has asked Linux
// for the tile state).
__attribute__((target("amx-tile,amx-bf16"))) inline float amx_bf16_loop(int64_t iters) {
  alignas(64) static const std::array<uint16_t, 16 * 32> ones = [] {
    std::array<uint16_t, 16 * 32> v{};
    v.fill(0x3c00);  // bf16 2^-7: sums stay finite
    return v;
  }();
  ops::amx::TileScope tiles;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones.data(), 64);
  _tile_loadd(5, ones.data(), 64);
  _tile_loadd(6, ones.data(), 64);
  _tile_loadd(7, ones.data(), 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  return out[0];
}
inline double amx_bf16_peak_gflops() { return peak_gflops(amx_bf16_loop, 4 * 16 * 16 * 32 * 2.0); }

}  // namespace moat::bench
