// The one thread pool. Kernels split work with parallel_for; the calling thread takes part, so a
// pool of N threads runs N-1 workers. Nested parallel_for calls run serially on the caller.
#pragma once

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
  std::mutex mutex_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int job_chunks_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// The process-wide pool. Size it once at startup (CLI --threads); defaults to hardware threads.
ThreadPool& thread_pool();
void set_num_threads(int num_threads);

}  // namespace moat
