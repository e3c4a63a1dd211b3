// CreateNcclGroup under --config=cuda (see group.h).
#include "parallel/nccl/group.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <functional>
#include <memory>
#include <numeric>
#include <thread>
#include <type_traits>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "parallel/poll_backoff.h"
#include "parallel/work_queue.h"

namespace muster::parallel {
namespace {

constexpr char kIdKey[] = "nccl_id";
// Polling an operation (poll_backoff.h): yield for kSpin, then sleep from
// kFirstSleep, doubling to kLongestSleep. Most collectives of a GPU step
// end within microseconds to a millisecond.
constexpr absl::Duration kSpin = absl::Microseconds(50);
constexpr absl::Duration kFirstSleep = absl::Microseconds(20);
constexpr absl::Duration kLongestSleep = absl::Microseconds(200);
// Initialising or finalising a communicator takes milliseconds at least.
constexpr absl::Duration kSetUpPoll = absl::Microseconds(200);

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

absl::Status NcclStatus(ncclResult_t result, ncclComm_t comm, const char* what) {
  if (result == ncclSuccess || result == ncclInProgress) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", ncclGetErrorString(result));
  if (comm != nullptr) absl::StrAppend(&message, " (", ncclGetLastError(comm), ")");
  if (result == ncclRemoteError || result == ncclSystemError) {
    return absl::UnavailableError(message);
  }
  return absl::InternalError(message);
}

// A non-blocking communicator reports ncclInProgress until the last call
// has been enqueued; poll it until then or `deadline`.
absl::Status PollComm(ncclComm_t comm, absl::Time deadline, const char* what) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t result = ncclCommGetAsyncError(comm, &state);
    if (result != ncclSuccess) return NcclStatus(result, comm, what);
    if (state != ncclInProgress) return NcclStatus(state, comm, what);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": still in progress at the deadline"));
    }
    absl::SleepFor(kSetUpPoll);
  }
}

std::vector<size_t> Offsets(const std::vector<size_t>& counts) {
  std::vector<size_t> offsets(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  return offsets;
}

bool AllEqual(const std::vector<size_t>& counts) {
  return std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
}

// What the queued operations use, shared with them: after a failure the
// WorkQueue may detach a thread still finishing an operation (work_queue.h),
// so nothing an operation touches may live in the NcclGroup itself.
//
// Every call on `comm` goes through Call(), under `mu`, so Abort() on a
// watchdog thread never races the communication thread's calls: once
// aborted, the handle is gone and Call() answers with the abort's cause.
struct NcclComm {
  NcclComm(ncclComm_t comm, const NcclOptions& options, cudaStream_t stream, float* scratch)
      : comm(comm), options(options), stream(stream), scratch(scratch) {}

  // The last owner: no other thread uses the communicator any more.
  ~NcclComm() {
    bool aborted_already = false;
    {
      absl::MutexLock lock(&mu);
      aborted_already = aborted;
    }
    if (!aborted_already) {
      absl::Status finalized = NcclStatus(ncclCommFinalize(comm), comm, "ncclCommFinalize");
      if (finalized.ok()) {
        finalized = PollComm(comm, absl::Now() + options.timeout, "ncclCommFinalize");
      }
      if (finalized.ok()) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    cudaFree(scratch);
    cudaStreamDestroy(stream);
  }

  // Runs `call(comm)` unless the communicator was aborted; `what` names it
  // in the error.
  template <typename Fn>
  absl::Status Call(const char* what, Fn&& call) {
    absl::MutexLock lock(&mu);
    if (aborted) return abort_cause;
    return NcclStatus(call(comm), comm, what);
  }

  // The communicator's asynchronous error (ncclInProgress is not one).
  absl::Status AsyncError(const char* what) {
    return Call(what, [](ncclComm_t c) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t result = ncclCommGetAsyncError(c, &state);
      return result != ncclSuccess ? result : state;
    });
  }

  // Idempotent; the first cause stays.
  void Abort(const absl::Status& cause) {
    absl::MutexLock lock(&mu);
    if (aborted) return;
    ncclCommAbort(comm);  // also ends the kernels of a collective in flight
    aborted = true;
    abort_cause = cause;
  }

  const ncclComm_t comm;
  const NcclOptions options;
  const cudaStream_t stream;
  float* const scratch;  // one device float for Barrier
  absl::Mutex mu;
  bool aborted ABSL_GUARDED_BY(mu) = false;
  absl::Status abort_cause ABSL_GUARDED_BY(mu);
};

class NcclGroup : public ProcessGroup {
 public:
  NcclGroup(std::shared_ptr<NcclComm> comm, int rank, int size)
      : comm_(std::move(comm)),
        rank_(rank),
        size_(size),
        queue_(std::make_unique<WorkQueue>(comm_->options.timeout)) {}

  ~NcclGroup() override {
    // Joins the communication thread, or detaches it after a failure; in
    // both cases the last owner of comm_ finalizes or frees it.
    queue_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool takes_host_memory() const override { return false; }  // device memory only
  absl::Duration timeout() const override { return comm_->options.timeout; }
  GroupMembers members() const override { return comm_->options.members; }

  std::shared_ptr<Work> AllReduce(absl::Span<float> data, ReduceOp op) override {
    return Issue(absl::StrCat("allreduce (", ReduceOpName(op), ") of ", data.size(), " floats"),
                 [=](ncclComm_t comm, cudaStream_t stream) {
                   return ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat, Nccl(op),
                                        comm, stream);
                 });
  }

  std::shared_ptr<Work> AllReduceInt64(absl::Span<int64_t> data, ReduceOp op) override {
    if (absl::Status bad = CheckInt64Op(op); !bad.ok()) return WorkQueue::Finished(bad);
    return Issue(absl::StrCat("allreduce (", ReduceOpName(op), ") of ", data.size(), " int64s"),
                 [=](ncclComm_t comm, cudaStream_t stream) {
                   return ncclAllReduce(data.data(), data.data(), data.size(), ncclInt64, Nccl(op),
                                        comm, stream);
                 });
  }

  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> input, absl::Span<float> output,
                                      std::vector<size_t> counts, ReduceOp op) override {
    if (absl::Status bad =
            CheckCounts("reduce_scatter", counts, input.size(), output.size(), rank_, size_);
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    const int size = size_;
    return Issue(
        absl::StrCat("reduce_scatter (", ReduceOpName(op), ") of ", input.size(), " floats"),
        [=](ncclComm_t comm, cudaStream_t stream) {
          if (AllEqual(counts)) {
            return ncclReduceScatter(input.data(), output.data(), counts[0], ncclFloat, Nccl(op),
                                     comm, stream);
          }
          // Uneven chunks: chunk r reduced to rank r, all in one NCCL group.
          std::vector<size_t> offsets = Offsets(counts);
          ncclGroupStart();
          for (int root = 0; root < size; ++root) {
            ncclResult_t result = ncclReduce(input.data() + offsets[root], output.data(),
                                             counts[root], ncclFloat, Nccl(op), root, comm, stream);
            if (result != ncclSuccess && result != ncclInProgress) {
              ncclGroupEnd();
              return result;
            }
          }
          return ncclGroupEnd();
        });
  }

  std::shared_ptr<Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                  std::vector<size_t> counts) override {
    return AllGatherOf(input, output, std::move(counts), ncclFloat, "floats");
  }

  std::shared_ptr<Work> AllGatherBf16(absl::Span<const uint16_t> input, absl::Span<uint16_t> output,
                                      std::vector<size_t> counts) override {
    return AllGatherOf(input, output, std::move(counts), ncclBfloat16, "bf16s");
  }

  std::shared_ptr<Work> Broadcast(absl::Span<float> data, int root) override {
    if (absl::Status bad = CheckPeer("broadcast root", root, /*self_ok=*/true, rank_, size_);
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("broadcast of ", data.size(), " floats from"), root,
                 [=](ncclComm_t comm, cudaStream_t stream) {
                   return ncclBroadcast(data.data(), data.data(), data.size(), ncclFloat, root,
                                        comm, stream);
                 });
  }

  std::shared_ptr<Work> BroadcastBytes(absl::Span<uint8_t> data, int root) override {
    if (absl::Status bad = CheckPeer("broadcast root", root, /*self_ok=*/true, rank_, size_);
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("broadcast of ", data.size(), " bytes from"), root,
                 [=](ncclComm_t comm, cudaStream_t stream) {
                   return ncclBroadcast(data.data(), data.data(), data.size(), ncclUint8, root,
                                        comm, stream);
                 });
  }

  std::shared_ptr<Work> Send(absl::Span<const float> data, int destination, int tag) override {
    if (absl::Status bad = CheckPointToPoint("send destination", destination, tag, rank_, size_);
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("send of ", data.size(), " floats to"), destination,
                 [=](ncclComm_t comm, cudaStream_t stream) {
                   return ncclSend(data.data(), data.size(), ncclFloat, destination, comm, stream);
                 });
  }

  std::shared_ptr<Work> Recv(absl::Span<float> data, int source, int tag) override {
    if (absl::Status bad = CheckPointToPoint("recv source", source, tag, rank_, size_); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("recv of ", data.size(), " floats from"), source,
                 [=](ncclComm_t comm, cudaStream_t stream) {
                   return ncclRecv(data.data(), data.size(), ncclFloat, source, comm, stream);
                 });
  }

  std::shared_ptr<Work> Barrier() override {
    // An allreduce of one float: done on a rank only once every rank joined.
    float* scratch = comm_->scratch;
    return Issue("barrier", [scratch](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllReduce(scratch, scratch, 1, ncclFloat, ncclSum, comm, stream);
    });
  }

  GroupHealth Health() const override {
    GroupHealth health = queue_->health();
    if (health.error.ok()) {
      // The watchdog asks every 100 ms. The communication thread polls
      // ncclCommGetAsyncError only while an operation runs, so a failure
      // NCCL sees between collectives (a peer's connection lost:
      // ncclRemoteError) would otherwise wait for the next one; asked
      // here, the watchdog aborts within its period.
      absl::Status async = comm_->AsyncError("communicator, between operations");
      if (!async.ok()) health.error = async;
    }
    return health;
  }

  void Abort(const absl::Status& cause) override {
    // The communicator first, then the queue: ncclCommAbort ends the
    // kernels of a collective in flight, so no waiter returns (and frees
    // its buffers) while NCCL may still write them. (The Gloo group closes
    // its connections before its waiters return for the same reason.) The
    // communication thread's next call sees the abort and fails its
    // operation with `cause`; Fail then breaks the queue if that has not
    // happened yet, and wakes the waiters.
    comm_->Abort(cause);
    queue_->Fail(cause);
  }

 private:
  // AllGather and AllGatherBf16: the same calls on `type`'s elements.
  template <typename T>
  std::shared_ptr<Work> AllGatherOf(absl::Span<const T> input, absl::Span<T> output,
                                    std::vector<size_t> counts, ncclDataType_t type,
                                    const char* unit) {
    if (absl::Status bad =
            CheckCounts("allgather", counts, output.size(), input.size(), rank_, size_);
        !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    const int size = size_;
    return Issue(absl::StrCat("allgather of ", output.size(), " ", unit), [=](ncclComm_t comm,
                                                                              cudaStream_t stream) {
      if (AllEqual(counts)) {
        return ncclAllGather(input.data(), output.data(), counts[0], type, comm, stream);
      }
      // Uneven pieces: every rank broadcasts its piece into its place.
      std::vector<size_t> offsets = Offsets(counts);
      ncclGroupStart();
      for (int root = 0; root < size; ++root) {
        ncclResult_t result = ncclBroadcast(input.data(), output.data() + offsets[root],
                                            counts[root], type, root, comm, stream);
        if (result != ncclSuccess && result != ncclInProgress) {
          ncclGroupEnd();
          return result;
        }
      }
      return ncclGroupEnd();
    });
  }

  using Launch = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;

  static ncclRedOp_t Nccl(ReduceOp op) {
    switch (op) {
      case ReduceOp::kAvg:
        return ncclAvg;
      case ReduceOp::kMin:
        return ncclMin;
      case ReduceOp::kMax:
        return ncclMax;
      case ReduceOp::kSum:
        break;
    }
    return ncclSum;
  }

  // Records the compute stream's progress now (on the issuing thread) and
  // queues `launch` to run after it on the group's stream. `what` and
  // `peer` (a group rank; none for a collective) as GroupMembers::Describe
  // takes them.
  std::shared_ptr<Work> Issue(const std::string& what, Launch launch) {
    return Issue(what, /*peer=*/-1, std::move(launch));
  }
  std::shared_ptr<Work> Issue(const std::string& what, int peer, Launch launch) {
    const std::string described =
        comm_->options.members.Describe(what, peer, /*op=*/-1, rank_, size_);
    cudaEvent_t event = nullptr;
    absl::Status recorded =
        CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    // Destroyed with the last owner: the operation once it has run, or the
    // queue when it drops the operation unrun (cancelled, or after a
    // failure).
    std::shared_ptr<std::remove_pointer_t<cudaEvent_t>> ready(event, [](cudaEvent_t e) {
      if (e != nullptr) cudaEventDestroy(e);
    });
    if (recorded.ok()) {
      recorded = CudaStatus(
          cudaEventRecord(event, static_cast<cudaStream_t>(comm_->options.compute_stream)),
          "cudaEventRecord");
    }
    if (!recorded.ok()) {
      // CUDA itself failed: this rank skips a collective its peers issue,
      // so break the group now, which frees them, rather than let them
      // time out.
      const absl::Status status(recorded.code(), absl::StrCat(described, ": ", recorded.message()));
      Abort(status);
      return WorkQueue::Finished(status);
    }
    return queue_->Enqueue(described, [comm = comm_, ready = std::move(ready),
                                       launch = std::move(launch)](absl::Time deadline) {
      absl::Status status = Run(*comm, ready.get(), launch, deadline);
      // Broken for good: aborting frees the peers blocked on us.
      if (!status.ok()) comm->Abort(status);
      return status;
    });
  }

  // On the communication thread: wait for `ready`, launch, then poll the
  // completion event and the communicator until done or `deadline`.
  static absl::Status Run(NcclComm& comm, cudaEvent_t ready, const Launch& launch,
                          absl::Time deadline) {
    if (absl::Status s = CudaStatus(cudaSetDevice(comm.options.device), "cudaSetDevice"); !s.ok()) {
      return s;
    }
    if (absl::Status s =
            CudaStatus(cudaStreamWaitEvent(comm.stream, ready, 0), "cudaStreamWaitEvent");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = comm.Call("launch", [&](ncclComm_t c) { return launch(c, comm.stream); });
        !s.ok()) {
      return s;
    }
    // A non-blocking communicator may still be enqueueing the launch.
    PollBackoff enqueue_backoff(kSpin, kFirstSleep, kLongestSleep);
    while (true) {
      ncclResult_t state = ncclSuccess;
      absl::Status s = comm.Call("enqueue", [&](ncclComm_t c) {
        ncclResult_t result = ncclCommGetAsyncError(c, &state);
        return result != ncclSuccess ? result : state;
      });
      if (!s.ok()) return s;
      if (state != ncclInProgress) break;
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError("enqueue: still in progress at the deadline");
      }
      enqueue_backoff.Pause();
    }
    cudaEvent_t done = nullptr;
    if (absl::Status s =
            CudaStatus(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
        !s.ok()) {
      return s;
    }
    absl::Status status = CudaStatus(cudaEventRecord(done, comm.stream), "cudaEventRecord");
    PollBackoff backoff(kSpin, kFirstSleep, kLongestSleep);
    while (status.ok()) {
      cudaError_t query = cudaEventQuery(done);
      if (query == cudaSuccess) break;
      if (query != cudaErrorNotReady) {
        status = CudaStatus(query, "cudaEventQuery");
        break;
      }
      // A peer's failure (ncclRemoteError / ncclSystemError), or a
      // watchdog's Abort, shows here.
      status = comm.AsyncError("operation");
      if (status.ok() && absl::Now() >= deadline) {
        status = absl::DeadlineExceededError(
            absl::StrCat("not finished on the GPU within the timeout (",
                         absl::FormatDuration(comm.options.timeout), "); communicator aborted"));
      }
      if (status.ok()) backoff.Pause();
    }
    cudaEventDestroy(done);
    // An Abort between the kernel's end and here (ncclCommAbort also ends
    // a collective's kernel early, and the event then completes): the
    // operation failed, whatever the event says.
    if (status.ok()) status = comm.AsyncError("operation");
    return status;
  }

  const std::shared_ptr<NcclComm> comm_;
  const int rank_;
  const int size_;
  std::unique_ptr<WorkQueue> queue_;
};

absl::StatusOr<ncclUniqueId> ExchangeId(rdzv::Store* store, int rank, absl::Duration timeout) {
  ncclUniqueId id;
  if (rank == 0) {
    if (absl::Status s = NcclStatus(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId"); !s.ok()) {
      return s;
    }
    absl::Status set = store->Set(kIdKey, absl::string_view(id.internal, sizeof(id.internal)));
    if (!set.ok()) return set;
    return id;
  }
  absl::StatusOr<std::string> value = store->Get(kIdKey, timeout);
  if (!value.ok()) return value.status();
  if (value->size() != sizeof(id.internal)) {
    return absl::InternalError(absl::StrCat("store key '", kIdKey, "' holds ", value->size(),
                                            " bytes; an ncclUniqueId has ", sizeof(id.internal)));
  }
  std::copy(value->begin(), value->end(), id.internal);
  return id;
}

}  // namespace

std::string NcclVersionString() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return "NCCL (version unknown)";
  // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since 2.9.
  return absl::StrCat("NCCL ", version / 10000, ".", version / 100 % 100, ".", version % 100);
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateNcclGroup(rdzv::Store* store, int rank,
                                                              int size,
                                                              const NcclOptions& options) {
  if (store == nullptr || size < 1 || rank < 0 || rank >= size ||
      options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("CreateNcclGroup: rank ", rank, ", size ", size,
                                                   ", timeout ",
                                                   absl::FormatDuration(options.timeout),
                                                   "; expected a store, 0 <= rank < size and a "
                                                   "positive timeout"));
  }
  if (absl::Status bad = CheckMembers("CreateNcclGroup", options.members, size); !bad.ok()) {
    return bad;
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  if (absl::Status s = CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"); !s.ok()) {
    return s;
  }
  absl::StatusOr<ncclUniqueId> id = ExchangeId(store, rank, options.timeout);
  if (!id.ok()) return id.status();

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so a missing peer cannot hang us past the deadline
  ncclComm_t comm = nullptr;
  absl::Status init = NcclStatus(ncclCommInitRankConfig(&comm, size, *id, rank, &config), comm,
                                 "ncclCommInitRankConfig");
  if (init.ok()) init = PollComm(comm, deadline, "ncclCommInitRankConfig");
  if (!init.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    return init;
  }

  cudaStream_t stream = nullptr;
  float* scratch = nullptr;
  absl::Status ready =
      CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  if (ready.ok()) ready = CudaStatus(cudaMalloc(&scratch, sizeof(float)), "cudaMalloc");
  if (!ready.ok()) {
    ncclCommAbort(comm);
    if (stream != nullptr) cudaStreamDestroy(stream);
    return ready;
  }
  return std::unique_ptr<ProcessGroup>(
      new NcclGroup(std::make_shared<NcclComm>(comm, options, stream, scratch), rank, size));
}

}  // namespace muster::parallel
