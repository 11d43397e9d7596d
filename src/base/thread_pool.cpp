#include "base/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <map>
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
// This thread's pool: set by ScopedThreadPool, and by a worker for its own pool.
thread_local ThreadPool* t_current_pool = nullptr;
// How long an idle worker spins before sleeping: longer than the gap between the kernels of one
// decode step, far shorter than the gap between requests.
constexpr auto kSpinBudget = std::chrono::microseconds(200);
// Pause iterations the caller spins for chunks others are running before it yields its core: the
// thread running one may be waiting for this very core.
constexpr int kCallerSpins = 4000;
// Chunk index of a claim value while the caller rewrites the job's fields: above any chunk count.
constexpr uint64_t kClaimsClosed = 0x7fffffff;
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
    // Pairs with the caller's fence after closing claims: fields of a newer job imply the CAS
    // below sees the closed claim value (or later) and fails.
    std::atomic_thread_fence(std::memory_order_acquire);
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
  // A kernel a worker runs asks thread_pool() for its splits; without this it would see (and
  // create) the default pool. Nested calls run inline anyway, but num_threads() must be ours.
  t_current_pool = this;
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
  // Close claiming before the fields change. Otherwise a worker holding the finished job's last
  // claim value (all chunks taken) could read this job's larger chunk count and function, and its
  // compare-exchange would still succeed against the old value: a chunk of this job run twice,
  // chunks_done_ counted past `chunks`, and the caller waiting forever (seen on a loaded 2-core
  // machine in ThreadPool.LateWorkersNeverRunAChunkOfTheNextJob).
  const uint32_t seq = ++job_seq_;
  claim_.store((static_cast<uint64_t>(seq) << 32) | kClaimsClosed, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  job_.store(&fn, std::memory_order_relaxed);
  job_n_.store(n, std::memory_order_relaxed);
  job_chunks_.store(chunks, std::memory_order_relaxed);
  chunks_done_.store(0, std::memory_order_relaxed);
  claim_.store(static_cast<uint64_t>(seq) << 32, std::memory_order_release);  // publishes the job
  generation_.fetch_add(1);  // seq_cst: wakes spinning workers and pairs with sleepers_ below
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    wake_cv_.notify_all();
  }
  t_inside_pool = true;
  run_claimed_chunks();
  t_inside_pool = false;
  // Every chunk is claimed; wait for the ones others are still running.
  if (chunks_done_.load(std::memory_order_acquire) != chunks) {
    const auto wait_start = std::chrono::steady_clock::now();
    for (int i = 0; chunks_done_.load(std::memory_order_acquire) != chunks; ++i) {
      MOAT_CPU_RELAX();
      if (i >= kCallerSpins) std::this_thread::yield();
    }
    const auto waited = std::chrono::steady_clock::now() - wait_start;
    caller_wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count(),
                              std::memory_order_relaxed);
  }
  jobs_.fetch_add(1, std::memory_order_relaxed);
}

namespace {
std::atomic<int64_t> g_min_parallel_chunk_bytes{kDefaultMinParallelChunkBytes};
}  // namespace
int64_t min_parallel_chunk_bytes() { return g_min_parallel_chunk_bytes.load(std::memory_order_relaxed); }
void set_min_parallel_chunk_bytes(int64_t bytes) {
  g_min_parallel_chunk_bytes.store(std::max<int64_t>(0, bytes), std::memory_order_relaxed);
}

int resolve_num_threads(int num_threads) {
  return num_threads > 0 ? num_threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

namespace {
std::mutex g_pool_mutex;
std::unique_ptr<ThreadPool>& default_pool_slot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}
}  // namespace

ThreadPool& thread_pool() {
  if (t_current_pool) return *t_current_pool;
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  auto& slot = default_pool_slot();
  if (!slot) slot = std::make_unique<ThreadPool>(resolve_num_threads(0));
  return *slot;
}

void set_num_threads(int num_threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  default_pool_slot() = std::make_unique<ThreadPool>(resolve_num_threads(num_threads));
}

ScopedThreadPool::ScopedThreadPool(ThreadPool& pool) : previous_(t_current_pool) { t_current_pool = &pool; }
ScopedThreadPool::~ScopedThreadPool() { t_current_pool = previous_; }

std::shared_ptr<ThreadPool> shared_thread_pool(int num_threads) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<ThreadPool>> pools;  // by size; expire with their last holder
  const int n = resolve_num_threads(num_threads);
  std::lock_guard<std::mutex> lock(mutex);
  if (auto pool = pools[n].lock()) return pool;
  auto pool = std::make_shared<ThreadPool>(n);
  pools[n] = pool;
  return pool;
}

}  // namespace moat
