#include "dist/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "base/check.h"
#include "base/log.h"

#if MOAT_HAVE_MPI
// The C API only: OpenMPI's mpi.h would otherwise pull in its deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace moat {

namespace {

class SingleRank final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single"; }
  void all_reduce_sum(float*, int64_t) override {}
  void all_gather(const float* local, int64_t n, float* out) override {
    if (out != local) std::memmove(out, local, sizeof(float) * static_cast<size_t>(n));
  }
  void broadcast(void*, int64_t, int) override {}
  void barrier() override {}
  [[noreturn]] void abort(const std::string& why) override {
    MOAT_LOG(error, "{}", why);
    std::exit(1);
  }
};

#if MOAT_HAVE_MPI

// MPI counts are int: large buffers go in pieces of at most this many elements.
constexpr int64_t kMaxCount = int64_t{1} << 30;

class MpiWorld final : public Communicator {
 public:
  MpiWorld() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &node_size_);
    MPI_Comm_free(&node);
  }
  int ranks_on_this_node() const override { return node_size_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  // MPI_Allreduce gives every rank the same bits for these group sizes with OpenMPI's algorithms
  // (recursive doubling and ring both combine the same partial sums in a commutative order); the
  // tensor-parallel tests check the ranks' routing agrees.
  void all_reduce_sum(float* data, int64_t n) override {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t done = 0; done < n; done += kMaxCount)
      MPI_Allreduce(MPI_IN_PLACE, data + done, static_cast<int>(std::min(kMaxCount, n - done)), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    count(n, start);
  }
  void all_gather(const float* local, int64_t n, float* out) override {
    MOAT_CHECK(n <= kMaxCount, "all_gather of {} floats per rank", n);
    const auto start = std::chrono::steady_clock::now();
    MPI_Allgather(local, static_cast<int>(n), MPI_FLOAT, out, static_cast<int>(n), MPI_FLOAT, MPI_COMM_WORLD);
    count(n, start);
  }
  CommStats stats() const override { return stats_; }
  void broadcast(void* data, int64_t bytes, int root) override {
    auto* p = static_cast<char*>(data);
    for (int64_t done = 0; done < bytes; done += kMaxCount)
      MPI_Bcast(p + done, static_cast<int>(std::min(kMaxCount, bytes - done)), MPI_BYTE, root, MPI_COMM_WORLD);
  }
  void broadcast_idle(void* data, int64_t bytes, int root) override {
    MOAT_CHECK(bytes <= kMaxCount, "broadcast_idle of {} bytes", bytes);
    MPI_Request request;
    MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD, &request);
    // Poll tightly at first (a busy server's next step comes within milliseconds), then back off
    // to 1 ms sleeps: an idle worker costs nothing and the first step after idling waits <= 1 ms.
    auto sleep = std::chrono::microseconds(0);
    for (int spins = 0;; ++spins) {
      int done = 0;
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (spins > 2000) {
        sleep = std::min(std::chrono::microseconds(1000), sleep + std::chrono::microseconds(20));
        std::this_thread::sleep_for(sleep);
      }
    }
  }
  void barrier() override { MPI_Barrier(MPI_COMM_WORLD); }
  [[noreturn]] void abort(const std::string& why) override {
    MOAT_LOG(error, "rank {} of {}: {}", rank_, size_, why);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::exit(1);
  }

 private:
  void count(int64_t floats, std::chrono::steady_clock::time_point start) {
    ++stats_.calls;
    stats_.bytes += floats * static_cast<int64_t>(sizeof(float));
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  int rank_ = 0, size_ = 1, node_size_ = 1;
  CommStats stats_;  // the step thread alone makes these calls
};

void finalize_mpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

#endif

}  // namespace

std::shared_ptr<Communicator> single_rank_communicator() { return std::make_shared<SingleRank>(); }

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(var)) return true;
  return false;
}

Result<std::shared_ptr<Communicator>> mpi_world() {
#if MOAT_HAVE_MPI
  static std::mutex mutex;
  static std::shared_ptr<Communicator> world;
  std::lock_guard lock(mutex);
  if (!world) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
      if (provided < MPI_THREAD_SERIALIZED)
        return make_error("MPI provides thread level {}, moat needs MPI_THREAD_SERIALIZED ({})", provided,
                          MPI_THREAD_SERIALIZED);
      std::atexit(finalize_mpi);
    }
    world = std::make_shared<MpiWorld>();
  }
  return world;
#else
  return make_error("this moat was built without MPI (install libopenmpi-dev and rebuild) so it cannot run "
                    "tensor parallelism across processes");
#endif
}

}  // namespace moat
