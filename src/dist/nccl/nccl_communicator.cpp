// Host code only (NCCL launches its own kernels), so g++ compiles it against the CUDA runtime and
// NCCL headers. It lives in src/dist/nccl/ because moat_module(dist) globs src/dist/*.cpp into the
// CUDA-free moat_dist.
#include "dist/nccl_communicator.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nccl.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace moat {

namespace {

std::string cuda_error(const char* call, cudaError_t err) {
  return fmt::format("{} failed: {} ({})", call, cudaGetErrorString(err), cudaGetErrorName(err));
}

std::string nccl_error(const char* call, ncclResult_t result, ncclComm_t comm) {
  // The result code is only a category ("unhandled system error"); the last error's text names
  // the peer, transport or argument that caused it.
  const char* last = ncclGetLastError(comm);
  const bool has_last = last != nullptr && *last != '\0';
  return fmt::format("{} failed: {}{}{}", call, ncclGetErrorString(result), has_last ? ": " : "",
                     has_last ? last : "");
}

class NcclWorld final : public NcclCommunicator {
 public:
  NcclWorld(std::shared_ptr<Communicator> mpi, int device, cudaStream_t stream, ncclComm_t comm)
      : mpi_(std::move(mpi)), device_(device), stream_(stream), comm_(comm) {}

  ~NcclWorld() override {
    // Return codes ignored: at exit the CUDA runtime may already be unloading, and a failed
    // teardown leaves nothing for the caller to do.
    cudaSetDevice(device_);
    if (comm_) ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return mpi_->rank(); }
  int size() const override { return mpi_->size(); }
  std::string name() const override { return "nccl"; }
  int device() const override { return device_; }

  // NCCL's algorithms (ring, tree, NVLS) compute each element's sum once and copy it to every rank,
  // so all ranks hold the same bits, as the interface requires (the test checks it).
  void all_reduce_sum(float* data, int64_t n) override {
    begin();
    nccl_ok("ncclAllReduce",
            ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat, ncclSum, comm_, stream_));
    finish("ncclAllReduce");
  }
  void all_gather(const float* local, int64_t n, float* out) override {
    begin();
    nccl_ok("ncclAllGather", ncclAllGather(local, out, static_cast<size_t>(n), ncclFloat, comm_, stream_));
    finish("ncclAllGather");
  }
  void broadcast_device(void* data, int64_t bytes, int root) override {
    begin();
    nccl_ok("ncclBroadcast",
            ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclUint8, root, comm_, stream_));
    finish("ncclBroadcast");
  }

  void broadcast(void* data, int64_t bytes, int root) override { mpi_->broadcast(data, bytes, root); }
  void broadcast_idle(void* data, int64_t bytes, int root) override { mpi_->broadcast_idle(data, bytes, root); }
  void barrier() override { mpi_->barrier(); }
  [[noreturn]] void abort(const std::string& why) override {
    mpi_->abort(why);
    std::exit(1);  // not reached; [[noreturn]] does not carry through a virtual call
  }

 private:
  // The current device belongs to the host thread, and the engine's step thread is not the one
  // that called nccl_world.
  void begin() { cuda_ok("cudaSetDevice", cudaSetDevice(device_)); }

  void cuda_ok(const char* call, cudaError_t err) {
    if (err != cudaSuccess) abort(fmt::format("NCCL communicator on CUDA device {}: {}", device_, cuda_error(call, err)));
  }
  void nccl_ok(const char* call, ncclResult_t result) {
    if (result != ncclSuccess)
      abort(fmt::format("NCCL communicator on CUDA device {}: {}", device_, nccl_error(call, result, comm_)));
  }

  // Waits for the collective. Not cudaStreamSynchronize: that would wait forever on a collective
  // whose peer died or whose network failed; polling NCCL's asynchronous error ends the job with
  // NCCL's message instead.
  void finish(const char* call) {
    for (;;) {
      const cudaError_t err = cudaStreamQuery(stream_);
      if (err == cudaSuccess) return;
      if (err != cudaErrorNotReady)
        abort(fmt::format("NCCL communicator on CUDA device {}: {} (waiting for {})", device_,
                          cuda_error("cudaStreamQuery", err), call));
      ncclResult_t async = ncclSuccess;
      nccl_ok("ncclCommGetAsyncError", ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess) {
        std::string why =
            fmt::format("NCCL communicator on CUDA device {}: {} (asynchronous error)", device_, nccl_error(call, async, comm_));
        // NCCL's documented recovery: abort the communicator, which stops its kernels waiting on the
        // lost peer, so this process can exit.
        ncclCommAbort(comm_);
        comm_ = nullptr;
        abort(why);
      }
      std::this_thread::yield();
    }
  }

  std::shared_ptr<Communicator> mpi_;
  int device_;
  cudaStream_t stream_;
  ncclComm_t comm_;
};

// Collective over the MPI world: every rank learns which ranks failed `step`, so all of them return
// an error together instead of some waiting in the next step for ranks that gave up.
Status agree(Communicator& mpi, const std::string& failure, int device, const char* step) {
  std::vector<float> failed(static_cast<size_t>(mpi.size()), 0.0f);  // [size]: 1 for a rank that failed
  failed[static_cast<size_t>(mpi.rank())] = failure.empty() ? 0.0f : 1.0f;
  mpi.all_reduce_sum(failed.data(), static_cast<int64_t>(failed.size()));
  std::vector<int> ranks;
  for (size_t r = 0; r < failed.size(); ++r)
    if (failed[r] != 0.0f) ranks.push_back(static_cast<int>(r));
  if (ranks.empty()) return ok_status();
  if (!failure.empty())
    return make_error("nccl_world: rank {} of {} on CUDA device {}, {}: {} (ranks that failed: {})", mpi.rank(),
                      mpi.size(), device, step, failure, fmt::join(ranks, ", "));
  return make_error("nccl_world: rank(s) {} of {} failed {} (their own errors name the cause), so rank {} stops too",
                    fmt::join(ranks, ", "), mpi.size(), step, mpi.rank());
}

}  // namespace

Result<std::shared_ptr<Communicator>> nccl_world(int device) {
  MOAT_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> mpi, mpi_world());
  const int rank = mpi->rank();

  // What this rank has made so far, released on the error paths.
  struct Parts {
    cudaStream_t stream = nullptr;
    ncclComm_t comm = nullptr;
    ~Parts() {
      if (comm) ncclCommDestroy(comm);
      if (stream) cudaStreamDestroy(stream);
    }
  } parts;

  std::string failure;  // this rank's, empty while it succeeds
  ncclUniqueId id{};
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess)
    failure = cuda_error("cudaGetDeviceCount", err);
  else if (device < 0 || device >= count)
    failure = fmt::format("CUDA device {} does not exist (this process sees {} CUDA device(s))", device, count);
  else if (err = cudaSetDevice(device); err != cudaSuccess)
    failure = cuda_error("cudaSetDevice", err);
  // A blocking stream (not cudaStreamNonBlocking): it waits for the legacy default stream, where the
  // CUDA backend's kernels write the activations the collectives read.
  else if (err = cudaStreamCreate(&parts.stream); err != cudaSuccess)
    failure = cuda_error("cudaStreamCreate", err);
  else if (rank == 0) {
    if (ncclResult_t result = ncclGetUniqueId(&id); result != ncclSuccess)
      failure = nccl_error("ncclGetUniqueId", result, nullptr);
  }
  MOAT_TRY(agree(*mpi, failure, device, "preparing its CUDA device"));

  mpi->broadcast(&id, sizeof(id), 0);
  if (ncclResult_t result = ncclCommInitRank(&parts.comm, mpi->size(), id, rank); result != ncclSuccess) {
    failure = nccl_error("ncclCommInitRank", result, nullptr);
    parts.comm = nullptr;  // not a communicator to destroy
  }
  MOAT_TRY(agree(*mpi, failure, device, "joining the NCCL communicator"));

  return std::shared_ptr<Communicator>(std::make_shared<NcclWorld>(mpi, device, std::exchange(parts.stream, nullptr),
                                                                   std::exchange(parts.comm, nullptr)));
}

}  // namespace moat
