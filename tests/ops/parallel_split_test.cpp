// The ops tests' small shapes would fall under the pool's minimum chunk (min_parallel_chunk_bytes:
// small calls stay on one thread), and then their runs at 2 and 3 threads would test the serial
// path again. This binary's environment sets the minimum to 0, so every split path runs on them;
// models and benchmarks keep the default. The test below holds the grain rule itself.
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "base/thread_pool.h"

namespace moat {
namespace {

class SplitEverySize : public ::testing::Environment {
 public:
  void SetUp() override { set_min_parallel_chunk_bytes(0); }
  void TearDown() override { set_min_parallel_chunk_bytes(kDefaultMinParallelChunkBytes); }
};
[[maybe_unused]] ::testing::Environment* const kSplitEverySize =
    ::testing::AddGlobalTestEnvironment(new SplitEverySize);

// Runs a parallel_for of n items at the grain for `bytes` each and returns how many chunks ran.
int chunks_run(ThreadPool& pool, int64_t n, double bytes) {
  std::atomic<int> chunks{0};
  pool.parallel_for(n, [&](int64_t, int64_t) { chunks.fetch_add(1); }, grain_for_bytes(bytes));
  return chunks.load();
}

TEST(ParallelSplit, SmallWorkStaysOnOneThreadUnderTheDefault) {
  ThreadPool pool(2);
  set_min_parallel_chunk_bytes(kDefaultMinParallelChunkBytes);
  // 8 items of 4 KiB: 32 KiB in all, under one minimum chunk
  EXPECT_EQ(chunks_run(pool, 8, 4096), 1);
  // 64 items of 4 KiB: two chunks of 128 KiB
  EXPECT_EQ(chunks_run(pool, 64, 4096), 2);
  // items as large as the minimum split one each
  EXPECT_EQ(grain_for_bytes(static_cast<double>(kDefaultMinParallelChunkBytes)), 1);
  EXPECT_EQ(grain_for_bytes(1024), kDefaultMinParallelChunkBytes / 1024);
  set_min_parallel_chunk_bytes(0);
  EXPECT_EQ(chunks_run(pool, 8, 4096), 2) << "the tests' setting splits any size";
  EXPECT_EQ(grain_for_bytes(0), 1);
}

}  // namespace
}  // namespace moat
