// Which pool kernels reach through thread_pool(): the ScopedThreadPool installed on the calling
// thread (models install theirs around forward), a pool's own workers their pool, else the
// default. No process-wide setting decides it, so two models with different thread counts can
// alternate on one thread, or run on two threads at once.
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <mutex>
#include <thread>

#include "base/thread_pool.h"

namespace moat {
namespace {

TEST(ScopedThreadPool, InstallsNestsAndRestores) {
  ThreadPool* outside = &thread_pool();
  ThreadPool a(2), b(3);
  {
    ScopedThreadPool sa(a);
    EXPECT_EQ(&thread_pool(), &a);
    {
      ScopedThreadPool sb(b);
      EXPECT_EQ(&thread_pool(), &b);
      EXPECT_EQ(thread_pool().num_threads(), 3);
    }
    EXPECT_EQ(&thread_pool(), &a);
  }
  EXPECT_EQ(&thread_pool(), outside);
}

TEST(ScopedThreadPool, IsPerThread) {
  ThreadPool a(2), b(4);
  ScopedThreadPool sa(a);
  std::atomic<ThreadPool*> seen{nullptr};
  std::thread other([&] {
    ScopedThreadPool sb(b);
    seen = &thread_pool();
  });
  other.join();
  EXPECT_EQ(seen.load(), &b);
  EXPECT_EQ(&thread_pool(), &a);
}

// A kernel that runs on a worker and asks thread_pool() for its split must see the pool it runs
// on: its num_threads() decides how work is divided, and the default pool must not be created by
// (or leak into) a model's forward.
TEST(ScopedThreadPool, WorkersSeeTheirOwnPool) {
  ThreadPool pool(4);
  ScopedThreadPool scope(pool);
  std::mutex m;
  std::set<ThreadPool*> seen;
  std::atomic<int> inner_total{0};
  for (int rep = 0; rep < 50; ++rep)
    pool.parallel_for(64, [&](int64_t b, int64_t e) {
      {
        std::lock_guard<std::mutex> lock(m);
        seen.insert(&thread_pool());
      }
      // nested: runs inline on whichever thread runs this chunk
      thread_pool().parallel_for(e - b, [&](int64_t x, int64_t y) { inner_total += static_cast<int>(y - x); });
    });
  EXPECT_EQ(seen, std::set<ThreadPool*>{&pool});
  EXPECT_EQ(inner_total.load(), 50 * 64);
}

TEST(SharedThreadPool, OnePoolPerSizeWhileHeld) {
  auto a = shared_thread_pool(2), b = shared_thread_pool(2), c = shared_thread_pool(3);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(a.get(), c.get());
  EXPECT_EQ(a->num_threads(), 2);
  EXPECT_EQ(c->num_threads(), 3);
  EXPECT_EQ(shared_thread_pool(0)->num_threads(), resolve_num_threads(0));
  EXPECT_GE(resolve_num_threads(0), 1);
}

}  // namespace
}  // namespace moat
