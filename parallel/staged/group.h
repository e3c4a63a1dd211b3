// ProcessGroup on CUDA device memory over a host-memory group (Gloo): every
// device buffer is copied into pinned host memory, the inner group runs the
// operation there, and the result is copied back (the contract is
// parallel/process_group.h). This serves clusters without NCCL, and it lets
// two ranks share one GPU (in tests), which NCCL refuses. Built only with
// --config=cuda; without it, CreateHostStagedGroup returns
// FAILED_PRECONDITION.
//
// Buffers may be device memory (cudaMalloc; managed memory is treated the
// same) or host memory, told apart with cudaPointerGetAttributes at issue
// time: host spans (a float loss, say) go to the inner group as they are,
// with no copy. Device buffers must be on options.device. AllReduceInt64
// and BroadcastBytes (the control plane's: parallel/collectives.h) take
// host memory only, and device or managed memory is INVALID_ARGUMENT; they
// are ordered like the others (below), so a control message issued between
// two gradient buckets reaches inner between them on every rank.
//
// Ordering. Operations run one at a time, in issue order, on the staged
// group's own communication thread, and each is issued on `inner` from that
// thread only, so every rank hands its inner group the same sequence. At
// issue time an event is recorded on options.compute_stream (on the issuing
// thread), and the operation's copies wait for it: the operation sees every
// kernel issued on that stream before it, and host spans are read only once
// the stream has reached that point too. When the Work is done the result is
// in the caller's buffer (the copy back has been synchronized), so kernels
// launched afterwards, on any stream, read it. Barrier just forwards: it
// does not wait for the compute stream.
//
// Timeouts. Each operation is bounded by inner->timeout() + kCopyMargin
// (30 s): the inner operation by inner's own timeout, the copies (which
// include waiting for the compute stream to reach the event) by what is left
// of the 30 s. timeout() reports that sum.
//
// Errors, as the status of a Work: the inner group's (UNAVAILABLE,
// DEADLINE_EXCEEDED, ...); INTERNAL for a failed CUDA call, naming it;
// DEADLINE_EXCEEDED when the copies overran; INVALID_ARGUMENT for bad counts,
// ranks or tags, or a buffer on another device, at once and without breaking
// the group. Any other failure breaks the group for good and aborts `inner`
// too, so peers blocked on this rank fail at once. Health() is the staged
// queue's, or inner's error when only inner has failed (say, its monitor saw
// a peer die while this group was idle). Abort(cause) fails this group's
// queue and aborts `inner`. After a failure, a copy the communication thread
// had already issued still completes (no new one starts), so free device
// buffers of failed work only after a device synchronization.
//
// Thread-safety: as process_group.h. `inner` is used by the communication
// thread (and Health/Abort), never concurrently with another user: nobody
// else may issue on it while the staged group exists.
//
// Cost: two copies over PCIe per operation (device to host, host to device;
// one for Send, Recv and a non-root Broadcast), each synchronized, plus an
// event record per operation; copying does not overlap the next operation's
// communication, nor the chunks of one operation each other. The pinned
// buffer grows to the largest operation's inputs plus outputs and is reused;
// it is freed with the group.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "parallel/process_group.h"

namespace muster::parallel {

struct StagedOptions {
  int device = 0;                  // CUDA device of the buffers
  void* compute_stream = nullptr;  // cudaStream_t the caller's kernels run on
                                   // (nullptr: the legacy default stream)
};

// What the staged group adds to inner's timeout for the copies.
inline constexpr absl::Duration kCopyMargin = absl::Seconds(30);

// Wraps `inner`, a host-memory group (Gloo): not owned; it must outlive the
// result and must not be used directly by anyone else while the result
// exists. Errors: INVALID_ARGUMENT for a null inner or a negative device;
// FAILED_PRECONDITION in a build without CUDA ("built without
// --config=cuda"); INTERNAL for CUDA failures (no GPU, say).
absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateHostStagedGroup(
    ProcessGroup* inner, const StagedOptions& options = {});

// CreateHostStagedGroup's argument checks, the same in both builds.
inline absl::Status CheckStagedArguments(const ProcessGroup* inner, const StagedOptions& options) {
  if (inner == nullptr) {
    return absl::InvalidArgumentError("CreateHostStagedGroup: inner group is null");
  }
  if (options.device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateHostStagedGroup: device is ", options.device, "; expected >= 0"));
  }
  return absl::OkStatus();
}

}  // namespace muster::parallel
