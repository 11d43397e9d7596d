#include "base/thread_pool.h"

#include <algorithm>
#include <memory>

namespace moat {

namespace {
thread_local bool t_inside_pool = false;
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(std::max(1, num_threads)) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunk(int chunk) {
  const int64_t begin = job_n_ * chunk / job_chunks_;
  const int64_t end = job_n_ * (chunk + 1) / job_chunks_;
  if (begin < end) (*job_)(begin, end);
}

void ThreadPool::worker_loop(int index) {
  t_inside_pool = true;
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    if (index < job_chunks_) run_chunk(index);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  const int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(1, grain));
  const int chunks = static_cast<int>(std::min<int64_t>(num_threads_, max_chunks));
  if (chunks <= 1 || t_inside_pool) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_n_ = n;
    job_chunks_ = chunks;
    pending_ = num_threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  t_inside_pool = true;
  run_chunk(0);
  t_inside_pool = false;
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

namespace {
std::unique_ptr<ThreadPool>& pool_slot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
std::mutex g_pool_mutex;
}  // namespace

ThreadPool& thread_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  auto& slot = pool_slot();
  if (!slot) slot = std::make_unique<ThreadPool>(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return *slot;
}

void set_num_threads(int num_threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  pool_slot() = std::make_unique<ThreadPool>(num_threads);
}

}  // namespace moat
