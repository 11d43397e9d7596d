// The collectives tensor parallelism needs, behind one interface: an MPI implementation for CPU
// ranks (one process per rank, launched by mpirun, on one machine or many) and, on CUDA builds, an
// NCCL one. The model code calls these and nothing else, so the same forward runs on both.
//
// Every call is collective: all ranks of the group make the same calls in the same order with the
// same sizes. A rank that dies makes the others' next call fail, which ends the job (MPI's default
// error handler aborts it; mpirun names the rank) instead of hanging.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"

namespace moat {

// What a rank's collectives cost so far (all_reduce_sum and all_gather; not the step broadcasts).
struct CommStats {
  int64_t calls = 0;
  int64_t bytes = 0;     // payload per rank: the floats it contributed
  double seconds = 0.0;  // wall time inside the calls, waiting for the slowest rank included
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "single", "mpi" or "nccl"
  virtual std::string name() const = 0;
  // data[n] = the elementwise sum of every rank's data[n], the same bits on every rank (the
  // routing of the next MoE layer depends on it, so ranks must not drift apart).
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  // out[size * n] = every rank's local[n], rank 0's first.
  virtual void all_gather(const float* local, int64_t n, float* out) = 0;
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  // broadcast from root, for a rank that waits while idle: polls with growing sleeps instead of
  // spinning, so an idle worker rank of `moat serve` uses no CPU. Defaults to broadcast. The root
  // calls it too: MPI matches a nonblocking broadcast only with nonblocking ones.
  virtual void broadcast_idle(void* data, int64_t bytes, int root) { broadcast(data, bytes, root); }
  virtual void barrier() = 0;
  // Ends the whole job with this message (MPI_Abort): for a rank that cannot go on, so that the
  // others do not wait forever in their next collective.
  [[noreturn]] virtual void abort(const std::string& why) = 0;
  virtual CommStats stats() const { return {}; }
  // Ranks of this group on this machine (this one included): they share its cores.
  virtual int ranks_on_this_node() const { return 1; }
};

// The group of one: every collective is the identity.
std::shared_ptr<Communicator> single_rank_communicator();

// True when this process was started by mpirun / mpiexec (OpenMPI, MPICH or a PMI launcher).
bool launched_by_mpi();

// The MPI world, initialized on first use (MPI_THREAD_SERIALIZED: the engine's step thread makes
// the calls) and finalized at exit. An error when moat was built without MPI.
Result<std::shared_ptr<Communicator>> mpi_world();

}  // namespace moat
