#include "base/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <memory>

#if defined(__x86_64__)
#include <immintrin.h>
#define MOAT_CPU_RELAX() _mm_pause()
#else
#define MOAT_CPU_RELAX() std::this_thread::yield()
#endif

namespace moat {

namespace {
thread_local bool t_inside_pool = false;
// How long an idle worker spins before sleeping: longer than the gap between the kernels of one
// decode step, far shorter than the gap between requests.
constexpr auto kSpinBudget = std::chrono::microseconds(200);
// Pause iterations the caller spins for chunks others are running before it yields its core: the
// thread running one may be waiting for this very core.
constexpr int kCallerSpins = 4000;
}  // namespace

ThreadPool::ThreadPool(int num_threads) : num_threads_(std::max(1, num_threads)) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    stop_.store(true);
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_claimed_chunks() {
  uint64_t v = claim_.load(std::memory_order_acquire);
  for (;;) {
    const int chunks = job_chunks_.load(std::memory_order_relaxed);
    const auto chunk = static_cast<int>(v & 0xffffffffu);
    if (chunk >= chunks) return;
    const auto* fn = job_.load(std::memory_order_relaxed);
    const int64_t n = job_n_.load(std::memory_order_relaxed);
    // Succeeds only if the job these fields were read under is still the current one.
    if (!claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    const int64_t begin = n * chunk / chunks, end = n * (chunk + 1) / chunks;
    if (begin < end) (*fn)(begin, end);
    chunks_done_.fetch_add(1, std::memory_order_acq_rel);
    v = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker_loop() {
  t_inside_pool = true;
  uint64_t seen = 0;
  for (;;) {
    uint64_t current = generation_.load(std::memory_order_acquire);
    if (current == seen && !stop_.load(std::memory_order_relaxed)) {
      const auto spin_until = std::chrono::steady_clock::now() + kSpinBudget;
      for (int i = 0; (current = generation_.load(std::memory_order_acquire)) == seen; ++i) {
        if (stop_.load(std::memory_order_relaxed)) break;
        MOAT_CPU_RELAX();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > spin_until) {
          // Dekker pairing with parallel_for: we bump sleepers_ then re-read generation_, it bumps
          // generation_ then reads sleepers_ (both seq_cst), so one of us sees the other.
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1);
          wake_cv_.wait(lock, [&] { return generation_.load() != seen || stop_.load(); });
          sleepers_.fetch_sub(1);
          current = generation_.load(std::memory_order_acquire);
          break;
        }
      }
    }
    if (stop_.load()) return;
    seen = current;
    run_claimed_chunks();
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
  std::lock_guard<std::mutex> caller_lock(caller_mutex_);
  job_.store(&fn, std::memory_order_relaxed);
  job_n_.store(n, std::memory_order_relaxed);
  job_chunks_.store(chunks, std::memory_order_relaxed);
  chunks_done_.store(0, std::memory_order_relaxed);
  claim_.store(static_cast<uint64_t>(++job_seq_) << 32, std::memory_order_release);  // publishes the job
  generation_.fetch_add(1);  // seq_cst: wakes spinning workers and pairs with sleepers_ below
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    wake_cv_.notify_all();
  }
  t_inside_pool = true;
  run_claimed_chunks();
  t_inside_pool = false;
  // Every chunk is claimed; wait for the ones others are still running.
  for (int i = 0; chunks_done_.load(std::memory_order_acquire) != chunks; ++i) {
    MOAT_CPU_RELAX();
    if (i >= kCallerSpins) std::this_thread::yield();
  }
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
