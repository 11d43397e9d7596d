// The one thread pool. Kernels split work with parallel_for; the calling thread takes part, so a
// pool of N threads runs N-1 workers. Nested parallel_for calls run serially on the caller.
//
// Decode issues a few hundred parallel_for calls per token, each only tens of microseconds long,
// so dispatch latency matters: workers spin briefly on an atomic generation counter before
// sleeping on a condition variable, and the caller spins for the (short) tail of the others.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moat {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls fn(begin, end) over disjoint ranges covering [0, n), at least `grain` items per call.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 1);

 private:
  void worker_loop(int index);
  void run_chunk(int chunk);

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex caller_mutex_;  // one job at a time, whichever thread submits it
  std::mutex sleep_mutex_;
  std::condition_variable wake_cv_;
  std::atomic<uint64_t> generation_{0};  // bumped once per job; publishes the job fields below
  std::atomic<int> pending_{0};          // workers still inside the current job
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int job_chunks_ = 0;
};

// The process-wide pool. Size it once at startup (CLI --threads); defaults to hardware threads.
ThreadPool& thread_pool();
void set_num_threads(int num_threads);

}  // namespace moat
