// Tensor parallelism across GPUs: NCCL collectives over the same MPI world as mpi_world() (one
// process per GPU, launched by mpirun). MPI carries what NCCL cannot: the NCCL id at startup, and
// the host-side step headers the ranks exchange between forwards.
//
// Where the data lives, per call:
//   all_reduce_sum, all_gather, broadcast_device  DEVICE pointers (on this communicator's device):
//                                                 the CUDA backend keeps activations on the GPU.
//   broadcast, broadcast_idle, barrier            HOST memory, through MPI: the step header of
//                                                 tp_step.cpp is built on the host.
// Every call returns with its result ready (its stream synchronized), as MpiWorld's do, so the
// model code needs no CUDA events. The collectives run on a stream that waits for the legacy
// default stream, where the CUDA kernels run, so their inputs are complete when they start.
//
// Built only on CUDA builds that find nccl.h (target moat_dist_nccl, MOAT_HAVE_NCCL=1).
#pragma once

#include <cstdint>
#include <memory>

#include "base/status.h"
#include "dist/communicator.h"

namespace moat {

class NcclCommunicator : public Communicator {
 public:
  // The CUDA device this rank's collectives run on.
  virtual int device() const = 0;
  // data[bytes] on the device: root's bytes to every rank, in place.
  virtual void broadcast_device(void* data, int64_t bytes, int root) = 0;
};

// Joins every rank of mpi_world() into one NCCL communicator on CUDA device `device` (each rank
// passes its own, e.g. its rank on the node modulo the device count). Collective over the MPI
// world: every rank must call it, and every rank returns an error when any rank fails, naming the
// ranks that failed (this one's own CUDA or NCCL message when it is one of them). The result is an
// NcclCommunicator (dynamic_pointer_cast for broadcast_device). Failures inside a collective later
// abort the job (MPI_Abort) with the CUDA or NCCL message, like any rank that cannot go on.
Result<std::shared_ptr<Communicator>> nccl_world(int device);

}  // namespace moat
