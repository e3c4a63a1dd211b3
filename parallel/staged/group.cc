// CreateHostStagedGroup under --config=cuda (see group.h).
#include "parallel/staged/group.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "parallel/poll_backoff.h"
#include "parallel/work_queue.h"

namespace muster::parallel {
namespace {

// Polling a copy (poll_backoff.h): yield for kSpin, then sleep from
// kFirstPause, doubling to kLongestPause.
constexpr absl::Duration kSpin = absl::Microseconds(20);
constexpr absl::Duration kFirstPause = absl::Microseconds(10);
constexpr absl::Duration kLongestPause = absl::Microseconds(500);

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

// Makes `device` current on the calling thread for a scope, then restores
// the caller's: issuing runs on the caller's thread, whose current device
// is the caller's business. (PyTorch's CUDAGuard; a few lines are cheaper
// than a dependency.)
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    status_ = CudaStatus(cudaGetDevice(&previous_), "cudaGetDevice");
    if (status_.ok() && previous_ != device) {
      status_ = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
      restore_ = status_.ok();
    }
  }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  absl::Status status_;
};

// The compute stream's progress at issue time. Destroyed with the last
// holder: the operation once it has run, or its queue item when it never
// runs (the queue had failed, or was destroyed first).
struct Event {
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (event != nullptr) cudaEventDestroy(event);
  }
  cudaEvent_t event = nullptr;
};

// What the operations use, shared with them: WorkQueue detaches a thread
// stuck after a failure, and that thread may outlive the group.
struct Staging {
  explicit Staging(ProcessGroup* inner) : inner(inner) {}
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    if (pinned != nullptr) cudaFreeHost(pinned);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  int device = 0;
  absl::Duration inner_timeout;
  // Non-blocking: no implicit synchronization with the legacy default
  // stream, so the copies wait for nothing but the issue-time event.
  cudaStream_t stream = nullptr;
  // Used by the communication thread only (one operation at a time).
  uint8_t* pinned = nullptr;
  size_t capacity = 0;  // bytes
  // Set by Abort: the running operation starts no further copy.
  std::atomic<bool> aborted{false};
  absl::Mutex mu;
  // Null once the group is destroyed: a detached thread must not start an
  // operation on an inner group that may be gone. Held while issuing on it
  // (not while waiting).
  ProcessGroup* inner ABSL_GUARDED_BY(mu);
};

// One caller buffer of an operation.
struct Region {
  uint8_t* user = nullptr;  // the caller's buffer
  size_t bytes = 0;
  bool copy_in = false;    // the inner operation reads it
  bool copy_out = false;   // the inner operation writes it
  bool host_only = false;  // the operation takes host memory only (int64s, bytes)
  bool staged = false;     // device memory: copied through the pinned buffer
};

// Regions start at multiples of this in the pinned buffer (more than any
// element needs).
constexpr size_t kPinnedAlignment = 64;

// Issues the inner operation on the host view of the regions (in order).
using HostViews = std::vector<absl::Span<uint8_t>>;
using Launch = std::function<std::shared_ptr<Work>(ProcessGroup& inner, const HostViews& host)>;

template <typename T>
absl::Span<T> ViewAs(absl::Span<uint8_t> bytes) {
  return absl::Span<T>(reinterpret_cast<T*>(bytes.data()), bytes.size() / sizeof(T));
}
absl::Span<float> Floats(absl::Span<uint8_t> bytes) { return ViewAs<float>(bytes); }

// Device (or managed) memory is staged; pinned and pageable host memory is
// passed to the inner group as it is. A host-only region in device or
// managed memory is INVALID_ARGUMENT.
absl::Status Classify(Region& region, int device) {
  region.staged = false;
  if (region.bytes == 0) return absl::OkStatus();
  cudaPointerAttributes attributes{};
  cudaError_t error = cudaPointerGetAttributes(&attributes, region.user);
  if (error != cudaSuccess) {
    cudaGetLastError();  // not the caller's error to find later
    return CudaStatus(error, "cudaPointerGetAttributes");
  }
  switch (attributes.type) {
    case cudaMemoryTypeDevice:
      if (attributes.device != device) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a buffer is on CUDA device ", attributes.device, "; the group's device is ", device));
      }
      region.staged = true;
      break;
    case cudaMemoryTypeManaged:
      // The host may read managed memory, but not while kernels may write
      // it; the copies are ordered after them.
      region.staged = true;
      break;
    default:  // cudaMemoryTypeHost (pinned), cudaMemoryTypeUnregistered
      break;
  }
  if (region.staged && region.host_only) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the buffer is CUDA ", attributes.type == cudaMemoryTypeManaged ? "managed" : "device",
        " memory; this operation takes host memory only (the control plane's)"));
  }
  return absl::OkStatus();
}

// Polls `query` (a cudaEventQuery or cudaStreamQuery) until done. Not
// cudaStreamSynchronize: it has no timeout, and the copies wait for the
// caller's compute stream, which may never get there.
absl::Status PollUntilDone(const std::function<cudaError_t()>& query, absl::Time deadline,
                           const char* what) {
  PollBackoff backoff(kSpin, kFirstPause, kLongestPause);
  while (true) {
    cudaError_t result = query();
    if (result == cudaSuccess) return absl::OkStatus();
    if (result != cudaErrorNotReady) return CudaStatus(result, what);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": not finished within the time left for copying"));
    }
    backoff.Pause();
  }
}

// On the communication thread: copy in, run the inner operation, copy out.
// `ready` is null for an operation without buffers.
absl::Status RunStaged(Staging& s, cudaEvent_t ready, const std::vector<Region>& regions,
                       const Launch& launch, absl::Time deadline) {
  // The inner operation gets its whole timeout; the copies before it what
  // is left of the margin.
  const absl::Time copy_in_deadline = deadline - s.inner_timeout;
  HostViews host;
  if (ready != nullptr) {
    if (absl::Status st = CudaStatus(cudaSetDevice(s.device), "cudaSetDevice"); !st.ok()) {
      return st;
    }
    auto aligned = [](size_t bytes) {
      return (bytes + kPinnedAlignment - 1) / kPinnedAlignment * kPinnedAlignment;
    };
    size_t needed = 0;
    for (const Region& region : regions) {
      if (region.staged) needed += aligned(region.bytes);
    }
    if (needed > s.capacity) {
      // One buffer, grown to the largest operation and reused, rather than
      // one per operation: pinning memory is far slower than copying it.
      uint8_t* old = s.pinned;
      s.pinned = nullptr;
      s.capacity = 0;
      if (old != nullptr) {
        if (absl::Status st = CudaStatus(cudaFreeHost(old), "cudaFreeHost"); !st.ok()) return st;
      }
      void* pinned = nullptr;
      if (absl::Status st =
              CudaStatus(cudaHostAlloc(&pinned, needed, cudaHostAllocDefault), "cudaHostAlloc");
          !st.ok()) {
        return st;
      }
      s.pinned = static_cast<uint8_t*>(pinned);
      s.capacity = needed;
    }
    size_t offset = 0;
    for (const Region& region : regions) {
      if (region.staged) {
        host.emplace_back(s.pinned + offset, region.bytes);
        offset += aligned(region.bytes);
      } else {
        host.emplace_back(region.user, region.bytes);
      }
    }

    if (absl::Status st =
            CudaStatus(cudaStreamWaitEvent(s.stream, ready, 0), "cudaStreamWaitEvent");
        !st.ok()) {
      return st;
    }
    for (size_t i = 0; i < regions.size(); ++i) {
      const Region& region = regions[i];
      if (!region.staged || !region.copy_in || region.bytes == 0) continue;
      if (absl::Status st = CudaStatus(cudaMemcpyAsync(host[i].data(), region.user, region.bytes,
                                                       cudaMemcpyDeviceToHost, s.stream),
                                       "cudaMemcpyAsync device to host");
          !st.ok()) {
        return st;
      }
    }
    // The event first: host regions are read and written only once the
    // compute stream has passed the issue point.
    if (absl::Status st = PollUntilDone([ready] { return cudaEventQuery(ready); }, copy_in_deadline,
                                        "cudaEventQuery (waiting for the compute stream)");
        !st.ok()) {
      return st;
    }
    if (absl::Status st =
            PollUntilDone([&s] { return cudaStreamQuery(s.stream); }, copy_in_deadline,
                          "cudaStreamQuery (copies device to host)");
        !st.ok()) {
      return st;
    }
  }

  if (s.aborted.load()) return absl::AbortedError("the group was aborted");
  std::shared_ptr<Work> work;
  {
    absl::MutexLock lock(&s.mu);
    if (s.inner == nullptr) return absl::CancelledError("the staged group was destroyed");
    work = launch(*s.inner, host);
  }
  if (absl::Status st = work->Wait(); !st.ok()) return st;
  if (ready == nullptr) return absl::OkStatus();

  if (s.aborted.load()) return absl::AbortedError("the group was aborted");
  bool copied = false;
  for (size_t i = 0; i < regions.size(); ++i) {
    const Region& region = regions[i];
    if (!region.staged || !region.copy_out || region.bytes == 0) continue;
    if (absl::Status st = CudaStatus(cudaMemcpyAsync(region.user, host[i].data(), region.bytes,
                                                     cudaMemcpyHostToDevice, s.stream),
                                     "cudaMemcpyAsync host to device");
        !st.ok()) {
      return st;
    }
    copied = true;
  }
  if (!copied) return absl::OkStatus();
  return PollUntilDone([&s] { return cudaStreamQuery(s.stream); }, deadline,
                       "cudaStreamQuery (copies host to device)");
}

template <typename T>
Region Buffer(const T* data, size_t count, bool copy_in, bool copy_out) {
  Region region;
  // Never written unless copy_out, which only mutable buffers ask for.
  region.user = reinterpret_cast<uint8_t*>(const_cast<T*>(data));
  region.bytes = count * sizeof(T);
  region.copy_in = copy_in;
  region.copy_out = copy_out;
  return region;
}

// A buffer of an operation that takes host memory only: never staged, so
// the copy flags do not matter.
Region HostBuffer(void* data, size_t bytes) {
  Region region;
  region.user = static_cast<uint8_t*>(data);
  region.bytes = bytes;
  region.host_only = true;
  return region;
}

class StagedGroup : public ProcessGroup {
 public:
  StagedGroup(ProcessGroup* inner, const StagedOptions& options, std::shared_ptr<Staging> staging)
      : inner_(inner),
        options_(options),
        rank_(inner->rank()),
        size_(inner->size()),
        timeout_(inner->timeout() + kCopyMargin),
        members_(inner->members()),
        staging_(std::move(staging)),
        queue_(std::make_unique<WorkQueue>(
            timeout_, [weak = std::weak_ptr<Staging>(staging_)](const absl::Status& cause) {
              if (auto staging = weak.lock()) Break(*staging, cause);
            })) {}

  ~StagedGroup() override {
    queue_.reset();  // joins the thread, or detaches one stuck after a failure
    absl::MutexLock lock(&staging_->mu);
    staging_->inner = nullptr;
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Duration timeout() const override { return timeout_; }
  // The group it stages through: the same ranks, the same name.
  GroupMembers members() const override { return members_; }

  std::shared_ptr<Work> AllReduce(absl::Span<float> data, ReduceOp op) override {
    return Issue(absl::StrCat("allreduce (", ReduceOpName(op), ") of ", data.size(), " floats"),
                 {Buffer(data.data(), data.size(), true, true)},
                 [op](ProcessGroup& inner, const HostViews& host) {
                   return inner.AllReduce(Floats(host[0]), op);
                 });
  }

  // Host memory only: forwarded to inner through the queue like the
  // others, so inner sees every rank's operations in the same order.
  std::shared_ptr<Work> AllReduceInt64(absl::Span<int64_t> data, ReduceOp op) override {
    if (absl::Status bad = CheckInt64Op(op); !bad.ok()) return WorkQueue::Finished(bad);
    return Issue(absl::StrCat("allreduce (", ReduceOpName(op), ") of ", data.size(), " int64s"),
                 {HostBuffer(data.data(), data.size() * sizeof(int64_t))},
                 [data, op](ProcessGroup& inner, const HostViews&) {
                   return inner.AllReduceInt64(data, op);
                 });
  }

  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> input, absl::Span<float> output,
                                      std::vector<size_t> counts, ReduceOp op) override {
    if (absl::Status bad = CheckCounts("reduce_scatter", counts, input.size(), output.size());
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(
        absl::StrCat("reduce_scatter (", ReduceOpName(op), ") of ", input.size(), " floats"),
        {Buffer(input.data(), input.size(), true, false),
         Buffer(output.data(), output.size(), false, true)},
        [counts = std::move(counts), op](ProcessGroup& inner, const HostViews& host) {
          return inner.ReduceScatter(Floats(host[0]), Floats(host[1]), counts, op);
        });
  }

  std::shared_ptr<Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                  std::vector<size_t> counts) override {
    return AllGatherOf(
        input, output, std::move(counts), "floats",
        [](ProcessGroup& inner, absl::Span<const float> in, absl::Span<float> out,
           const std::vector<size_t>& counts) { return inner.AllGather(in, out, counts); });
  }

  std::shared_ptr<Work> AllGatherBf16(absl::Span<const uint16_t> input, absl::Span<uint16_t> output,
                                      std::vector<size_t> counts) override {
    return AllGatherOf(
        input, output, std::move(counts), "bf16s",
        [](ProcessGroup& inner, absl::Span<const uint16_t> in, absl::Span<uint16_t> out,
           const std::vector<size_t>& counts) { return inner.AllGatherBf16(in, out, counts); });
  }

  std::shared_ptr<Work> Broadcast(absl::Span<float> data, int root) override {
    if (absl::Status bad = CheckPeer("broadcast root", root, /*self_ok=*/true); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    // Only the root's data is read, and only the others' written.
    const bool is_root = root == rank_;
    return Issue(absl::StrCat("broadcast of ", data.size(), " floats from"), root,
                 {Buffer(data.data(), data.size(), is_root, !is_root)},
                 [root](ProcessGroup& inner, const HostViews& host) {
                   return inner.Broadcast(Floats(host[0]), root);
                 });
  }

  std::shared_ptr<Work> BroadcastBytes(absl::Span<uint8_t> data, int root) override {
    if (absl::Status bad = CheckPeer("broadcast root", root, /*self_ok=*/true); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("broadcast of ", data.size(), " bytes from"), root,
                 {HostBuffer(data.data(), data.size())},
                 [data, root](ProcessGroup& inner, const HostViews&) {
                   return inner.BroadcastBytes(data, root);
                 });
  }

  std::shared_ptr<Work> Send(absl::Span<const float> data, int destination, int tag) override {
    if (absl::Status bad = CheckPointToPoint("send destination", destination, tag); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("send of ", data.size(), " floats with tag ", tag, " to"),
                 destination, {Buffer(data.data(), data.size(), true, false)},
                 [destination, tag](ProcessGroup& inner, const HostViews& host) {
                   return inner.Send(Floats(host[0]), destination, tag);
                 });
  }

  std::shared_ptr<Work> Recv(absl::Span<float> data, int source, int tag) override {
    if (absl::Status bad = CheckPointToPoint("recv source", source, tag); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("recv of ", data.size(), " floats with tag ", tag, " from"), source,
                 {Buffer(data.data(), data.size(), false, true)},
                 [source, tag](ProcessGroup& inner, const HostViews& host) {
                   return inner.Recv(Floats(host[0]), source, tag);
                 });
  }

  std::shared_ptr<Work> Barrier() override {
    // No buffers, no event: it does not wait for the compute stream.
    return Issue("barrier", {},
                 [](ProcessGroup& inner, const HostViews&) { return inner.Barrier(); });
  }

  GroupHealth Health() const override {
    GroupHealth health = queue_->health();
    if (health.error.ok()) {
      absl::Status inner_error = inner_->Health().error;
      if (!inner_error.ok()) health.error = std::move(inner_error);
    }
    return health;
  }

  // Breaking the queue aborts the inner group (on_break, Break below).
  void Abort(const absl::Status& cause) override { queue_->Fail(cause); }

 private:
  // The queue's on_break: runs once, when it first fails, before any waiter
  // can see the failure (the queue's lock is held), so after `cause` is the
  // running operation's result. Host-only buffers (a SumDouble's, a
  // BroadcastBytes's) go to the inner group as they are: it is aborted now
  // (Gloo closes its connections), or it could go on reading and writing
  // them after the waiter has returned and freed them. That also frees our
  // thread if it is blocked in an inner operation, and the peers blocked
  // on this rank. The running operation starts no further copy once
  // `aborted` is set; a copy already on the staging stream is not waited
  // for here (it may wait behind the compute stream, and this runs under
  // the queue's lock): device memory freed meanwhile stays mapped in the
  // stream-ordered pool, so it cannot fault, only be overwritten in a
  // step that has failed.
  static void Break(Staging& staging, const absl::Status& cause) {
    staging.aborted.store(true);
    absl::MutexLock lock(&staging.mu);
    if (staging.inner != nullptr) staging.inner->Abort(cause);
  }

  // AllGather and AllGatherBf16: the same staging of T's around `gather`,
  // the inner group's call.
  template <typename T, typename Gather>
  std::shared_ptr<Work> AllGatherOf(absl::Span<const T> input, absl::Span<T> output,
                                    std::vector<size_t> counts, const char* unit, Gather gather) {
    if (absl::Status bad = CheckCounts("allgather", counts, output.size(), input.size());
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("allgather of ", output.size(), " ", unit),
                 {Buffer(input.data(), input.size(), true, false),
                  Buffer(output.data(), output.size(), false, true)},
                 [counts = std::move(counts), gather](ProcessGroup& inner, const HostViews& host) {
                   return gather(inner, ViewAs<T>(host[0]), ViewAs<T>(host[1]), counts);
                 });
  }

  // Records the compute stream's progress now, on the issuing thread, and
  // queues the staged operation to run after it. `what` and `peer` (a
  // group rank; none for a collective) as GroupMembers::Describe takes them.
  std::shared_ptr<Work> Issue(const std::string& what, std::vector<Region> regions, Launch launch) {
    return Issue(what, /*peer=*/-1, std::move(regions), std::move(launch));
  }
  std::shared_ptr<Work> Issue(const std::string& what, int peer, std::vector<Region> regions,
                              Launch launch) {
    const std::string described =
        absl::StrCat(members_.Describe(what, peer, /*op=*/-1, rank_, size_), " via host memory");
    std::shared_ptr<Event> ready;
    if (!regions.empty()) {
      DeviceScope scope(options_.device);
      absl::Status status = scope.status();
      for (Region& region : regions) {
        if (status.ok()) status = Classify(region, options_.device);
      }
      if (absl::IsInvalidArgument(status)) {
        return WorkQueue::Finished(
            absl::Status(status.code(), absl::StrCat(described, ": ", status.message())));
      }
      if (status.ok()) {
        ready = std::make_shared<Event>();
        status = CudaStatus(cudaEventCreateWithFlags(&ready->event, cudaEventDisableTiming),
                            "cudaEventCreateWithFlags");
      }
      if (status.ok()) {
        status = CudaStatus(
            cudaEventRecord(ready->event, static_cast<cudaStream_t>(options_.compute_stream)),
            "cudaEventRecord on the compute stream");
      }
      if (!status.ok()) {
        // CUDA itself failed: this rank cannot go on, so break the group
        // now, which frees the peers, rather than let them time out.
        status = absl::Status(status.code(), absl::StrCat(described, ": ", status.message()));
        Abort(status);
        return WorkQueue::Finished(status);
      }
    }
    return queue_->Enqueue(
        described, [staging = staging_, ready = std::move(ready), regions = std::move(regions),
                    launch = std::move(launch)](absl::Time deadline) {
          // A failure breaks the queue, whose on_break aborts the inner
          // group too, so that peers blocked on this rank fail now.
          return RunStaged(*staging, ready == nullptr ? nullptr : ready->event, regions, launch,
                           deadline);
        });
  }

  // The checks inner (Gloo) would make, made here so that bad arguments
  // fail at once and leave the group usable: inner sees an operation only
  // on the communication thread, where its failure would break the group.
  // (The same checks as Gloo's: process_group.h.)
  absl::Status CheckCounts(const char* op, const std::vector<size_t>& counts, size_t total,
                           size_t mine) const {
    return parallel::CheckCounts(op, counts, total, mine, rank_, size_);
  }
  absl::Status CheckPeer(const char* what, int peer, bool self_ok) const {
    return parallel::CheckPeer(what, peer, self_ok, rank_, size_);
  }
  absl::Status CheckPointToPoint(const char* what, int peer, int tag) const {
    return parallel::CheckPointToPoint(what, peer, tag, rank_, size_);
  }

  ProcessGroup* const inner_;  // valid while this group exists
  const StagedOptions options_;
  const int rank_;
  const int size_;
  const absl::Duration timeout_;
  const GroupMembers members_;
  const std::shared_ptr<Staging> staging_;
  std::unique_ptr<WorkQueue> queue_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateHostStagedGroup(ProcessGroup* inner,
                                                                    const StagedOptions& options) {
  if (absl::Status bad = CheckStagedArguments(inner, options); !bad.ok()) return bad;
  auto staging = std::make_shared<Staging>(inner);
  staging->device = options.device;
  staging->inner_timeout = inner->timeout();
  DeviceScope scope(options.device);
  absl::Status status = scope.status();
  if (status.ok()) {
    status = CudaStatus(cudaStreamCreateWithFlags(&staging->stream, cudaStreamNonBlocking),
                        "cudaStreamCreateWithFlags");
  }
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("CreateHostStagedGroup on CUDA device ",
                                                    options.device, ": ", status.message()));
  }
  return std::unique_ptr<ProcessGroup>(new StagedGroup(inner, options, std::move(staging)));
}

}  // namespace muster::parallel
