// Roofline probes shared by the benchmarks: memory read bandwidth, bf16 (vdpbf16ps) and fp32 FMA
// peaks, measured on the current thread pool in the same run as the numbers they bound.
#pragma once

#include <immintrin.h>

// GCC 12's _mm512_reduce_add_ps starts from an _mm512_undefined value: a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <vector>

#include "base/thread_pool.h"

namespace moat::bench {

using Clock = std::chrono::steady_clock;

// n zero-initialized T in anonymous memory advised MADV_HUGEPAGE, 2 MiB-aligned: the pages decode
// weights sit in (a mapped checkpoint's 2 MiB folios, or the --no-mmap copy). Probes and weight
// sets in plain std::vectors get 4 KiB pages under THP "madvise" mode, which read ~10% slower.
template <typename T>
class HugeBuffer {
 public:
  explicit HugeBuffer(size_t n) : n_(n) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t bytes = std::max<size_t>(kHuge, (n * sizeof(T) + kHuge - 1) / kHuge * kHuge);
    void* p = std::aligned_alloc(kHuge, bytes);
    if (!p) throw std::bad_alloc();
    madvise(p, bytes, MADV_HUGEPAGE);
    std::fill_n(static_cast<char*>(p), bytes, 0);
    p_.reset(static_cast<T*>(p));
  }
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> p_;
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

__attribute__((target("avx512f"))) inline float sum_range(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 64 <= n; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i + 512), _MM_HINT_T0);  // 2 KiB ahead, like the kernels
    _mm_prefetch(reinterpret_cast<const char*>(p + i + 528), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + i + 544), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + i + 560), _MM_HINT_T0);
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// GB/s reading a buffer far larger than the caches, split over the pool's threads.
// GB/s summing the float regions {pointer, count} in turn (any readable memory: a fresh buffer,
// or the weights' own mappings).
inline double read_bandwidth_gbs(const std::vector<std::pair<const float*, int64_t>>& regions) {
  std::vector<float> sink(64);
  double bytes = 0;
  for (const auto& [p, n] : regions) bytes += static_cast<double>(n / 4096 * 4096) * 4.0;
  const double s = time_per_call([&] {
    for (const auto& [p, n] : regions)
      thread_pool().parallel_for(
          n / 4096, [&, p = p](int64_t b, int64_t e) { sink[0] += sum_range(p + b * 4096, (e - b) * 4096); }, 1);
  }, 1.0);
  return bytes / s / 1e9;
}
inline double read_bandwidth_gbs(const HugeBuffer<float>& buf) {
  return read_bandwidth_gbs({{buf.data(), static_cast<int64_t>(buf.size())}});
}

// GFLOPS of vdpbf16ps (2 flops per bf16 pair: 32 multiply-adds per instruction), 12 independent
// accumulators per thread to cover the latency.
__attribute__((target("avx512f,avx512bf16"))) inline float dpbf16_loop(int64_t iters) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
  for (int64_t i = 0; i < iters; ++i)
    for (auto& x : acc) x = _mm512_dpbf16_ps(x, a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// GFLOPS of fp32 FMAs (32 flops per 512-bit vfmadd), the roofline of fp32 attention.
__attribute__((target("avx512f"))) inline float fma_loop(int64_t iters) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  for (int64_t i = 0; i < iters; ++i)
    for (auto& x : acc) x = _mm512_fmadd_ps(x, a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

inline double fp32_peak_gflops() {
  const int64_t iters = 1 << 20;
  std::vector<float> sink(64);
  const int threads = thread_pool().num_threads();
  const double s = time_per_call([&] {
    thread_pool().parallel_for(threads, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sink[i % 64] += fma_loop(iters);
    }, 1);
  }, 0.6);
  return threads * iters * 12.0 * 32.0 / s / 1e9;
}

inline double bf16_peak_gflops() {
  const int64_t iters = 1 << 20;
  std::vector<float> sink(64);
  const int threads = thread_pool().num_threads();
  const double s = time_per_call([&] {
    thread_pool().parallel_for(threads, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sink[i % 64] += dpbf16_loop(iters);
    }, 1);
  }, 0.6);
  return threads * iters * 12.0 * 64.0 / s / 1e9;
}

}  // namespace moat::bench
