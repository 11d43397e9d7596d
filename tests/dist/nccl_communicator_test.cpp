// The NCCL communicator across GPUs: run under `mpirun -np 2 test_dist_nccl` (ctest does). Rank r
// uses CUDA device r % device count. Exits 77 (skipped) on every rank when any rank sees fewer than
// two CUDA devices or runs alone: the ranks agree through MPI first, so none waits in a collective
// for a rank that left.
//
// Checked on device buffers: all_reduce_sum (exact integer sums, and the same bits on every rank for
// sums that round), all_gather (separate and in place), broadcast_device from the last rank; on host
// memory: broadcast and broadcast_idle, which go through MPI.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/nccl_communicator.h"
#include "kernels/cuda/cuda_check.cuh"

namespace {

using moat::Communicator;

int g_rank = 0;
int g_failures = 0;

#define EXPECT(cond, ...)                                                                                      \
  do {                                                                                                         \
    if (!(cond)) {                                                                                             \
      ++g_failures;                                                                                            \
      fmt::print(stderr, "rank {}: {}:{}: {} is false: {}\n", g_rank, __FILE__, __LINE__, #cond,             \
                 fmt::format(__VA_ARGS__));                                                                    \
    }                                                                                                          \
  } while (0)

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { MOAT_CUDA_OK(cudaMalloc(&p_, sizeof(T) * n)); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() { return p_; }
  void upload(const std::vector<T>& host) {
    MOAT_CUDA_OK(cudaMemcpy(p_, host.data(), sizeof(T) * n_, cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    MOAT_CUDA_OK(cudaMemcpy(host.data(), p_, sizeof(T) * n_, cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

// Integers below 2^24 sum exactly in float, so every rank must hold exactly these values.
void all_reduce_exact(Communicator& comm) {
  const int64_t n = 4099;  // not a multiple of any chunk size NCCL picks
  const int size = comm.size();
  std::vector<float> host(n);  // [n]
  for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>((g_rank + 1) * (i % 1000));
  DeviceBuffer<float> data(n);
  data.upload(host);
  comm.all_reduce_sum(data.get(), n);
  const std::vector<float> sum = data.download();
  const int64_t ranks_total = int64_t{size} * (size + 1) / 2;  // sum of (r + 1) over the ranks
  int64_t wrong = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (sum[i] == static_cast<float>(ranks_total * (i % 1000))) continue;
    if (wrong++ == 0) first = i;
  }
  EXPECT(wrong == 0, "all_reduce_sum of {} integer floats: {} differ from the exact sum, the first at [{}]: {} vs {}", n,
         wrong, first, first >= 0 ? sum[first] : 0.0f, first >= 0 ? static_cast<float>(ranks_total * (first % 1000)) : 0.0f);
}

std::vector<float> random_input(int rank, int64_t n) {
  std::mt19937 rng(1234 + rank);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);  // [n]
  for (float& x : v) x = dist(rng);
  return v;
}

// Sums that round: close to the double-precision sum, and the same bits on every rank (the next
// MoE layer's routing depends on them).
void all_reduce_same_bits(Communicator& comm) {
  const int64_t n = (int64_t{1} << 20) + 3;  // several of NCCL's chunks, plus a ragged tail
  const int size = comm.size();
  DeviceBuffer<float> data(n);
  data.upload(random_input(g_rank, n));
  comm.all_reduce_sum(data.get(), n);
  std::vector<float> sum = data.download();  // [n]

  std::vector<double> expected(n, 0.0);  // [n]
  for (int r = 0; r < size; ++r) {
    const std::vector<float> in = random_input(r, n);
    for (int64_t i = 0; i < n; ++i) expected[i] += in[i];
  }
  double worst = 0.0;
  for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(sum[i] - expected[i]));
  EXPECT(worst < 1e-5 * size, "all_reduce_sum of {} random floats is off the double sum by up to {}", n, worst);

  std::vector<float> root = sum;  // [n]: rank 0's result, through MPI
  comm.broadcast(root.data(), static_cast<int64_t>(sizeof(float)) * n, 0);
  EXPECT(std::memcmp(root.data(), sum.data(), sizeof(float) * n) == 0,
         "all_reduce_sum gave this rank other bits than rank 0");
}

void all_gather(Communicator& comm) {
  const int64_t n = 1025;
  const int size = comm.size();
  std::vector<float> local(n);  // [n]
  for (int64_t i = 0; i < n; ++i) local[i] = static_cast<float>(g_rank * 100000 + i);
  std::vector<float> expected(size * n);  // [size, n]
  for (int r = 0; r < size; ++r)
    for (int64_t i = 0; i < n; ++i) expected[r * n + i] = static_cast<float>(r * 100000 + i);

  DeviceBuffer<float> in(n);
  DeviceBuffer<float> out(size * n);
  in.upload(local);
  comm.all_gather(in.get(), n, out.get());
  EXPECT(out.download() == expected, "all_gather of {} floats per rank differs from every rank's slice in order", n);

  // In place: this rank's slice of out is its input, as a caller writing straight into out does.
  std::vector<float> prefilled(size * n, -1.0f);  // [size, n]
  std::copy(local.begin(), local.end(), prefilled.begin() + g_rank * n);
  out.upload(prefilled);
  comm.all_gather(out.get() + g_rank * n, n, out.get());
  EXPECT(out.download() == expected, "in-place all_gather of {} floats per rank differs", n);
}

void broadcast_device(moat::NcclCommunicator& comm) {
  const int64_t bytes = 1000003;
  const int root = comm.size() - 1;  // not 0, so a root argument ignored would show
  std::vector<uint8_t> pattern(bytes);  // [bytes]
  for (int64_t i = 0; i < bytes; ++i) pattern[i] = static_cast<uint8_t>(i * 7 + 3);
  DeviceBuffer<uint8_t> data(bytes);
  data.upload(g_rank == root ? pattern : std::vector<uint8_t>(bytes, 0));
  comm.broadcast_device(data.get(), bytes, root);
  EXPECT(data.download() == pattern, "broadcast_device of {} bytes from rank {} differs", bytes, root);
}

// The step header's path: host memory through MPI.
void broadcast_host(Communicator& comm) {
  for (int root : {0, comm.size() - 1}) {
    int64_t header[4] = {0, 0, 0, 0};
    if (g_rank == root) {
      header[0] = 11;
      header[1] = root;
      header[2] = -3;
      header[3] = int64_t{1} << 40;
    }
    comm.broadcast_idle(header, sizeof(header), root);
    EXPECT(header[0] == 11 && header[1] == root && header[2] == -3 && header[3] == (int64_t{1} << 40),
           "broadcast_idle of a host header from rank {} gave {} {} {} {}", root, header[0], header[1], header[2],
           header[3]);
    std::vector<int64_t> packed(1000, g_rank == root ? root + 5 : 0);
    comm.broadcast(packed.data(), static_cast<int64_t>(sizeof(int64_t) * packed.size()), root);
    EXPECT(packed == std::vector<int64_t>(1000, root + 5), "broadcast of host memory from rank {} differs", root);
  }
  comm.barrier();
}

// The communicator lives only here, so it is destroyed before MPI_Finalize (atexit).
void run_checks(int device) {
  auto world = moat::nccl_world(device);
  if (!world.ok()) {
    ++g_failures;
    fmt::print(stderr, "rank {}: {}\n", g_rank, world.error().message);
    return;
  }
  auto nccl = std::dynamic_pointer_cast<moat::NcclCommunicator>(*world);
  EXPECT(nccl != nullptr, "nccl_world did not return an NcclCommunicator");
  if (!nccl) (*world)->abort("cannot test broadcast_device without an NcclCommunicator");
  auto mpi = *moat::mpi_world();
  EXPECT(nccl->name() == "nccl", "name() is {}", nccl->name());
  EXPECT(nccl->rank() == mpi->rank() && nccl->size() == mpi->size(), "rank {} of {}, MPI's is {} of {}", nccl->rank(),
         nccl->size(), mpi->rank(), mpi->size());
  EXPECT(nccl->device() == device, "device() is {}, asked for {}", nccl->device(), device);

  all_reduce_exact(*nccl);
  all_reduce_same_bits(*nccl);
  all_gather(*nccl);
  broadcast_device(*nccl);
  broadcast_host(*nccl);
}

}  // namespace

int main() {
  auto mpi_result = moat::mpi_world();
  if (!mpi_result.ok()) {
    fmt::print(stderr, "{}\n", mpi_result.error().message);
    return 1;
  }
  std::shared_ptr<Communicator> mpi = *mpi_result;
  g_rank = mpi->rank();

  int device_count = 0;
  const cudaError_t err = cudaGetDeviceCount(&device_count);
  std::string reason;  // empty when this rank can run the test
  if (err != cudaSuccess)
    reason = fmt::format("cudaGetDeviceCount failed: {}", cudaGetErrorString(err));
  else if (device_count < 2)
    reason = fmt::format("{} CUDA device(s), the test needs 2", device_count);
  else if (mpi->size() < 2)
    reason = "one rank: run it under mpirun -np 2";
  float skipping = reason.empty() ? 0.0f : 1.0f;  // the number of ranks that cannot run it
  mpi->all_reduce_sum(&skipping, 1);
  if (skipping > 0.0f) {
    fmt::print("SKIPPED rank {} of {}: {}\n", g_rank, mpi->size(),
               reason.empty() ? "another rank cannot run the test" : reason);
    return 77;
  }

  const int device = g_rank % device_count;
  run_checks(device);
  float failed_ranks = g_failures > 0 ? 1.0f : 0.0f;
  mpi->all_reduce_sum(&failed_ranks, 1);
  fmt::print("rank {} of {} on CUDA device {}: {} failed check(s) here, {} rank(s) with failures\n", g_rank,
             mpi->size(), device, g_failures, static_cast<int>(failed_ranks));
  return failed_ranks > 0.0f ? 1 : 0;
}
