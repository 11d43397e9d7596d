#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>

#include "base/aligned_vector.h"
#include "base/dtype.h"
#include "base/huge_pages.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "base/weight.h"

namespace moat {

TEST(DType, Bf16RoundTripsAndRoundsToNearestEven) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.5f)), 1.5f);
  // 1 + 2^-8 lies exactly between two bf16 values; ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
}

TEST(DType, Fp8E4M3DecodesKnownCodes) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x00), 0.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);     // exp 7, mant 0
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);   // largest finite
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
}

TEST(DType, Fp8E4M3EncodeIsInverseOnEveryFiniteCode) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    if (code == 0x80) continue;  // -0 encodes as 0x80 too, but compare values
    float v = fp8_e4m3_to_f32(static_cast<uint8_t>(code));
    EXPECT_EQ(f32_to_fp8_e4m3(v), code) << code;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(1000.0f), 0x7e);  // saturates
}

TEST(DType, F16RoundTrip) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f}) EXPECT_EQ(f16_to_f32(f32_to_f16(v)), v);
}

TEST(ThreadPool, CoversRangeExactlyOnce) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  for (int rep = 0; rep < 50; ++rep) {
    pool.parallel_for(1000, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
  }
  for (auto& h : hits) EXPECT_EQ(h.load(), 50);
}

// Workers spin, then sleep: jobs that arrive while they spin, just as they fall asleep, and long
// after must each run exactly once (a lost wake-up would hang this test; a double run would
// miscount).
TEST(ThreadPool, JobsRunExactlyOnceAcrossSpinAndSleep) {
  for (int threads : {2, 3, 4}) {
    ThreadPool pool(threads);
    std::atomic<int64_t> total{0};
    int64_t expected = 0;
    for (int rep = 0; rep < 300; ++rep) {
      const int64_t n = 1 + rep % 37;
      pool.parallel_for(n, [&](int64_t b, int64_t e) { total += e - b; });
      expected += n;
      if (rep % 50 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));   // workers asleep
      else if (rep % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(190));  // at the edge
    }
    EXPECT_EQ(total.load(), expected) << threads << " threads";
  }
}

// More pool threads than cores, and jobs of different sizes back to back: workers are often
// descheduled mid-job, the caller then runs their chunks itself, and a worker that wakes late
// must never run a chunk of the job after the one it woke for (each range is stamped with its
// job, so a chunk run under the wrong job or twice is counted).
TEST(ThreadPool, LateWorkersNeverRunAChunkOfTheNextJob) {
  ThreadPool pool(8);
  std::vector<int> stamp(64, -1);
  std::atomic<int64_t> wrong{0}, total{0};
  int64_t expected = 0;
  for (int job = 0; job < 20000; ++job) {
    const int64_t n = 1 + job % 64;
    pool.parallel_for(n, [&, job](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        if (stamp[i] == job) ++wrong;  // this index already ran in this job
        stamp[i] = job;
      }
      total += e - b;
    });
    for (int64_t i = 0; i < n; ++i) wrong += stamp[i] != job;
    expected += n;
  }
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(total.load(), expected);
}

TEST(ThreadPool, NestedCallsRunInline) {
  ThreadPool pool(2);
  std::atomic<int> inner{0};
  pool.parallel_for(4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) pool.parallel_for(10, [&](int64_t x, int64_t y) { inner += static_cast<int>(y - x); });
  });
  EXPECT_EQ(inner.load(), 40);
}

// stats() counts the jobs handed to other threads (not the ones run inline: one chunk, or nested)
// and the caller's wait for a chunk still running elsewhere.
TEST(ThreadPool, StatsCountHandedOffJobsAndTheCallersWait) {
  ThreadPool pool(2);
  const ThreadPool::Stats start = pool.stats();
  EXPECT_EQ(start.jobs, 0);
  pool.parallel_for(1, [](int64_t, int64_t) {});  // one chunk: inline
  EXPECT_EQ(pool.stats().jobs, 0);
  // Each chunk waits until both have started, so they run on the two threads; the worker's then
  // holds its chunk 20 ms, and the caller, its own done, waits for it: at least from its chunk's
  // end to the worker's, however either thread is scheduled.
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int> started{0};
  std::chrono::steady_clock::time_point caller_done, worker_done;
  const auto t0 = std::chrono::steady_clock::now();
  pool.parallel_for(2, [&](int64_t, int64_t) {
    ++started;
    while (started.load() < 2) std::this_thread::yield();
    if (std::this_thread::get_id() != caller) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      worker_done = std::chrono::steady_clock::now();
    } else {
      pool.parallel_for(8, [](int64_t, int64_t) {});  // nested: inline, not a job
      caller_done = std::chrono::steady_clock::now();
    }
  });
  const double job_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const ThreadPool::Stats after = pool.stats();
  EXPECT_EQ(after.jobs, 1);
  EXPECT_GE(after.caller_wait_seconds, std::chrono::duration<double>(worker_done - caller_done).count());
  EXPECT_LE(after.caller_wait_seconds, job_s);
}

Result<int> parse_positive(int v) {
  if (v <= 0) return make_error("value must be > 0, got {}", v);
  return v;
}
Result<int> doubled(int v) {
  MOAT_ASSIGN_OR_RETURN(int x, parse_positive(v));
  return 2 * x;
}

TEST(Status, PropagatesErrors) {
  EXPECT_EQ(doubled(4).value(), 8);
  auto r = doubled(-1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().message, "value must be > 0, got -1");
}

TEST(WeightMatrix, Fp8BlockScalesApplyPerTile) {
  // 3 x 3 matrix with 2 x 2 blocks: non-aligned edges.
  std::vector<uint8_t> q(9, 0x38);  // all 1.0
  std::vector<float> scales = {1.0f, 2.0f, 3.0f, 4.0f};
  WeightMatrix w{DType::F8_E4M3, q.data(), 3, 3, scales.data(), 2, 2};
  EXPECT_EQ(w.at(0, 0), 1.0f);
  EXPECT_EQ(w.at(1, 2), 2.0f);
  EXPECT_EQ(w.at(2, 0), 3.0f);
  EXPECT_EQ(w.at(2, 2), 4.0f);
  EXPECT_EQ(w.rows(2, 1).at(0, 2), 4.0f);
}


// Weights moat builds at load (the absorbed MLA matrices) sit in 2 MiB-aligned mappings marked for
// huge pages; small ones come from the heap. Both must behave as plain vectors.
TEST(HugePageAllocator, LargeVectorsAreHugePageAlignedAndHoldTheirValues) {
  HugePageVector<uint16_t> big(3 << 20);  // 6 MiB: three huge pages
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % kHugePageBytes, 0u);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint16_t>(i * 7);
  HugePageVector<uint16_t> copy = big;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(copy.data()) % kHugePageBytes, 0u);
  for (size_t i = 0; i < copy.size(); i += 4093) ASSERT_EQ(copy[i], static_cast<uint16_t>(i * 7)) << i;
  big.resize(big.size() * 2, 1);  // growth copies into a new mapping, the old one is unmapped
  EXPECT_EQ(big[(3 << 20) - 1], static_cast<uint16_t>(((3 << 20) - 1) * 7));
  EXPECT_EQ(big.back(), 1);
  HugePageVector<float> small(100, 2.5f);  // from the heap: a mapping would cost a whole huge page
  EXPECT_EQ(small[99], 2.5f);
  small.clear();
  small.shrink_to_fit();
  EXPECT_EQ(small.capacity(), 0u);
}

// The kernels' scratch buffers: every allocation on a cache line, whatever its size (std::vector's
// are 16-byte aligned: small ones from the heap, large ones 16 bytes into an mmap'd block) and
// after each growth, so 64-byte rows never straddle two lines.
TEST(AlignedVector, EveryAllocationStartsOnACacheLine) {
  for (size_t n : {1u, 3u, 17u, 100u, 4096u, 50000u, 300000u, 5000000u}) {
    AlignedVector<uint16_t> v(n, 7);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(v.data()) % kCacheLineBytes, 0u) << n;
    v.resize(n * 3 + 5, 9);  // growth moves the data into a new allocation
    ASSERT_EQ(reinterpret_cast<uintptr_t>(v.data()) % kCacheLineBytes, 0u) << n;
    EXPECT_EQ(v[n - 1], 7);
    EXPECT_EQ(v.back(), 9);
  }
  AlignedVector<float> copy = AlignedVector<float>(1000, 1.5f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(copy.data()) % kCacheLineBytes, 0u);
  EXPECT_EQ(copy[999], 1.5f);
}

}  // namespace moat
