// ProcessGroup over NCCL, on device memory (the contract is
// parallel/process_group.h). Built only with --config=cuda; without it,
// CreateNcclGroup returns FAILED_PRECONDITION. CI builds and links it; it
// runs on a lent GPU through scripts/gpu_run.sh (ddp1, fsdp1, fsdpspeed,
// ddpnccl2, ddpbench), on an H200 and an H100 on 2026-11-26.
//
// Bootstrap: rank 0 calls ncclGetUniqueId and publishes it in the store
// under "nccl_id"; the others read it (the store is scoped to the (job,
// round), so a restarted job never sees a stale id). The communicator is
// initialised non-blocking and polled until the timeout; on timeout or
// error it is aborted.
//
// Execution: operations run on the group's own CUDA stream, one at a time
// from the communication thread. Each waits for an event recorded on the
// issuing thread's compute stream at issue time, so it sees every kernel
// issued before it. A Work finishes when the GPU has finished the
// operation: the thread polls its event, yielding for 50 us and then
// sleeping from 20 us doubling to 200 us (parallel/poll_backoff.h), so a
// collective of tens of microseconds is not held up to a fixed sleep's
// length (it was 200 us, and 13 back-to-back gathers cost 3.4 ms a
// step); past the timeout the communicator is aborted and the Work
// fails with DEADLINE_EXCEEDED. ncclRemoteError / ncclSystemError (a peer
// or the network failed) are UNAVAILABLE.
//
// Health adds the communicator's asynchronous error (ncclCommGetAsyncError)
// to the queue's, so the watchdog, which asks every 100 ms, also sees a
// failure NCCL notices between operations.
//
// Abort (process_group.h) may come from another thread (the watchdog): every
// NCCL call on the communicator goes through one lock, and once aborted the
// communication thread's next poll returns the abort's cause. What the
// queued operations use lives in a shared object, so a thread the queue
// detached after a failure never touches freed memory.
//
// Differences from Gloo: Send/Recv tags are not transmitted (NCCL matches
// point-to-point operations by order); uneven ReduceScatter and AllGather
// are grouped ncclReduce / ncclBroadcast calls, even ones the native
// collectives. Every buffer is device memory, AllReduceInt64's (ncclInt64)
// and BroadcastBytes' (ncclUint8) too: the control plane
// (parallel/collectives.h) runs on the Gloo group instead.
//
// REQUIRES: the caller's current CUDA device is options.device when
// creating the group and when issuing operations.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/process_group.h"
#include "rendezvous/client/store.h"

namespace muster::parallel {

struct NcclOptions {
  int device = 0;
  // Bounds creating the communicator and then each operation.
  absl::Duration timeout = absl::Seconds(60);
  // What messages call the group and its ranks (process_group.h, "Names
  // in messages"): the default is the world's, "world" with group rank ==
  // global rank; a sub-group passes its name and members' global ranks.
  GroupMembers members;
  // The cudaStream_t the caller's kernels run on (nullptr: the legacy
  // default stream). Operations wait for it at issue time.
  void* compute_stream = nullptr;
};

// "NCCL 2.28.9" (the library loaded, from ncclGetVersion), or "NCCL
// (not built)" without --config=cuda.
std::string NcclVersionString();

// Every rank calls this with the same `size` and a distinct `rank`, and a
// store scoped to this group. Errors: INVALID_ARGUMENT for bad arguments
// (options.members too: CheckMembers);
// DEADLINE_EXCEEDED if the id or the peers did not arrive in time;
// UNAVAILABLE / INTERNAL from NCCL and CUDA; FAILED_PRECONDITION in a build
// without CUDA.
absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateNcclGroup(rdzv::Store* store, int rank,
                                                              int size,
                                                              const NcclOptions& options = {});

}  // namespace muster::parallel
