// The thread pool kernels split work on. Kernels call thread_pool().parallel_for; the calling
// thread takes part, so a pool of N threads runs N-1 workers. Nested parallel_for calls run
// serially on the caller.
//
// Which pool: no process-wide setting. Each model owns its pool (DeepseekModel::Options::threads)
// and installs it on the calling thread for the duration of its forward with a ScopedThreadPool,
// so a draft and a target model in one process each run at their own thread count without
// passing a pool through every kernel signature. Outside any scope, kernels use a default pool of
// hardware threads.
//
// Decode issues a few hundred parallel_for calls per token, each only tens of microseconds long,
// so dispatch latency matters: workers spin briefly on an atomic generation counter before
// sleeping on a condition variable. Chunks are claimed, not assigned: the caller and the workers
// take chunk indices from one atomic counter, so when a worker is descheduled (a busy machine, a
// server's own threads) the caller runs its chunks instead of waiting a whole time slice for it,
// and the caller only ever waits for chunks already being run.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
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

  // Jobs handed to the other threads so far, and the time their callers spent waiting, their own
  // chunks done, for chunks still running elsewhere: a thread streaming slower than the others,
  // or one that started late (model_bench --profile reports both per decode token).
  struct Stats {
    int64_t jobs = 0;
    double caller_wait_seconds = 0;
  };
  Stats stats() const {
    return {jobs_.load(std::memory_order_relaxed), 1e-9 * static_cast<double>(caller_wait_ns_.load(std::memory_order_relaxed))};
  }

 private:
  void worker_loop();
  // Claims and runs chunks of the current job until none is left.
  void run_claimed_chunks();

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex caller_mutex_;  // one job at a time, whichever thread submits it
  std::mutex sleep_mutex_;
  std::condition_variable wake_cv_;
  std::atomic<uint64_t> generation_{0};  // bumped once per job, to wake the workers
  // (job sequence << 32) | next chunk index. A chunk is claimed by a compare-exchange on the value
  // the claimer read the job's fields under, so a worker that read a finished job's fields can
  // never claim a chunk of the next one; the caller publishes a job with a release store.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> chunks_done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  // The current job, written by the caller before it publishes the job in claim_; atomic (relaxed)
  // only because a straggler may read them while the next job is being written, and then fails
  // its claim.
  std::atomic<const std::function<void(int64_t, int64_t)>*> job_{nullptr};
  std::atomic<int64_t> job_n_{0};
  std::atomic<int> job_chunks_{0};
  uint32_t job_seq_ = 0;  // caller only, under caller_mutex_
  std::atomic<int64_t> jobs_{0}, caller_wait_ns_{0};  // written under caller_mutex_; read by stats()
};

// The pool installed on this thread by the innermost ScopedThreadPool; a pool's own workers see
// their pool; anywhere else the default pool.
ThreadPool& thread_pool();

// Makes `pool` this thread's thread_pool() until destroyed, then restores the previous one.
// Models install theirs around forward; the engine around sampling (which runs outside forward).
class ScopedThreadPool {
 public:
  explicit ScopedThreadPool(ThreadPool& pool);
  ~ScopedThreadPool();
  ScopedThreadPool(const ScopedThreadPool&) = delete;
  ScopedThreadPool& operator=(const ScopedThreadPool&) = delete;

 private:
  ThreadPool* previous_;
};

// The least work a parallel_for chunk should carry, in bytes it streams: a split costs about
// 1 us whatever the work (the job's hand-off is four cache-line transfers between cores: 1.0 us
// for an empty 2-thread job on a 2-vCPU Zen 5 VM; 2.2 us for two chunks of 1024 floats that take
// 1.1 us on one thread), and 64 KiB takes 1-2 us on one core from L3 or memory, so smaller
// chunks lose more to the hand-off than they gain. k3-nano's decode (hidden 256: most matrices
// 64-384 KiB) ran slower on 2 threads than on 1 with 16 KiB chunks.
inline constexpr int64_t kDefaultMinParallelChunkBytes = 64 << 10;
int64_t min_parallel_chunk_bytes();
// Tests set 0, so that their small shapes still take every split path.
void set_min_parallel_chunk_bytes(int64_t bytes);
// parallel_for's grain for items of `bytes_per_item` bytes each: chunks of at least
// min_parallel_chunk_bytes().
inline int64_t grain_for_bytes(double bytes_per_item) {
  const double min_bytes = static_cast<double>(min_parallel_chunk_bytes());
  return bytes_per_item >= min_bytes ? 1 : static_cast<int64_t>(min_bytes / std::max(1.0, bytes_per_item));
}

// A pool of num_threads (0: hardware threads), shared by everyone holding one of that size: two
// models of one size (a draft and its target) run on one set of workers instead of two sets that
// spin against each other for the same cores.
std::shared_ptr<ThreadPool> shared_thread_pool(int num_threads);

// Threads a pool of size `num_threads` gets: 0 means hardware threads.
int resolve_num_threads(int num_threads);

// Resizes the default pool, the one kernels use outside any ScopedThreadPool. Only for
// benchmarks and tools that run kernels without a model (bench/kernel_bench.cpp); models never
// read it.
void set_num_threads(int num_threads);

}  // namespace moat
