// CreateNcclGroup under --config=cuda (see nccl_group.h).
#include "parallel/nccl_group.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <functional>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "parallel/work_queue.h"

namespace muster::parallel {
namespace {

constexpr char kIdKey[] = "nccl_id";
constexpr absl::Duration kPollInterval = absl::Microseconds(200);

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
    absl::SleepFor(kPollInterval);
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

class NcclGroup : public ProcessGroup {
 public:
  NcclGroup(ncclComm_t comm, int rank, int size, const NcclOptions& options, cudaStream_t stream,
            float* scratch)
      : comm_(comm),
        rank_(rank),
        size_(size),
        options_(options),
        stream_(stream),
        scratch_(scratch),
        queue_(std::make_unique<WorkQueue>(options.timeout)) {}

  ~NcclGroup() override {
    queue_.reset();  // joins the thread that uses comm_
    if (!aborted_) {
      absl::Status finalized =
          NcclStatus(ncclCommFinalize(comm_), comm_, "ncclCommFinalize");
      if (finalized.ok()) {
        finalized = PollComm(comm_, absl::Now() + options_.timeout, "ncclCommFinalize");
      }
      if (finalized.ok()) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Duration timeout() const override { return options_.timeout; }

  std::shared_ptr<Work> AllReduce(absl::Span<float> data, ReduceOp op) override {
    return Issue(absl::StrCat("allreduce of ", data.size(), " floats"), [=] {
      return ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat, Nccl(op), comm_,
                           stream_);
    });
  }

  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> input, absl::Span<float> output,
                                      std::vector<size_t> counts, ReduceOp op) override {
    if (absl::Status bad = CheckCounts(counts, input.size(), output.size()); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("reduce_scatter of ", input.size(), " floats"), [=] {
      if (AllEqual(counts)) {
        return ncclReduceScatter(input.data(), output.data(), counts[0], ncclFloat, Nccl(op),
                                 comm_, stream_);
      }
      // Uneven chunks: chunk r reduced to rank r, all in one NCCL group.
      std::vector<size_t> offsets = Offsets(counts);
      ncclGroupStart();
      for (int root = 0; root < size_; ++root) {
        ncclResult_t result =
            ncclReduce(input.data() + offsets[root], output.data(), counts[root], ncclFloat,
                       Nccl(op), root, comm_, stream_);
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
    if (absl::Status bad = CheckCounts(counts, output.size(), input.size()); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Issue(absl::StrCat("allgather of ", output.size(), " floats"), [=] {
      if (AllEqual(counts)) {
        return ncclAllGather(input.data(), output.data(), counts[0], ncclFloat, comm_, stream_);
      }
      // Uneven pieces: every rank broadcasts its piece into its place.
      std::vector<size_t> offsets = Offsets(counts);
      ncclGroupStart();
      for (int root = 0; root < size_; ++root) {
        ncclResult_t result = ncclBroadcast(input.data(), output.data() + offsets[root],
                                            counts[root], ncclFloat, root, comm_, stream_);
        if (result != ncclSuccess && result != ncclInProgress) {
          ncclGroupEnd();
          return result;
        }
      }
      return ncclGroupEnd();
    });
  }

  std::shared_ptr<Work> Broadcast(absl::Span<float> data, int root) override {
    if (root < 0 || root >= size_) {
      return WorkQueue::Finished(absl::InvalidArgumentError(
          absl::StrCat("broadcast root is ", root, "; expected a rank in [0, ", size_, ")")));
    }
    return Issue(absl::StrCat("broadcast of ", data.size(), " floats from rank ", root), [=] {
      return ncclBroadcast(data.data(), data.data(), data.size(), ncclFloat, root, comm_, stream_);
    });
  }

  std::shared_ptr<Work> Send(absl::Span<const float> data, int destination, int tag) override {
    if (absl::Status bad = CheckPeer(destination, tag); !bad.ok()) return WorkQueue::Finished(bad);
    return Issue(absl::StrCat("send of ", data.size(), " floats to rank ", destination), [=] {
      return ncclSend(data.data(), data.size(), ncclFloat, destination, comm_, stream_);
    });
  }

  std::shared_ptr<Work> Recv(absl::Span<float> data, int source, int tag) override {
    if (absl::Status bad = CheckPeer(source, tag); !bad.ok()) return WorkQueue::Finished(bad);
    return Issue(absl::StrCat("recv of ", data.size(), " floats from rank ", source), [=] {
      return ncclRecv(data.data(), data.size(), ncclFloat, source, comm_, stream_);
    });
  }

  std::shared_ptr<Work> Barrier() override {
    // An allreduce of one float: done on a rank only once every rank joined.
    return Issue("barrier", [this] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclFloat, ncclSum, comm_, stream_);
    });
  }

 private:
  static ncclRedOp_t Nccl(ReduceOp op) { return op == ReduceOp::kAvg ? ncclAvg : ncclSum; }

  // Records the compute stream's progress now (on the issuing thread) and
  // queues `launch` to run after it on the group's stream.
  std::shared_ptr<Work> Issue(std::string what, std::function<ncclResult_t()> launch) {
    cudaEvent_t ready = nullptr;
    absl::Status recorded =
        CudaStatus(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    if (recorded.ok()) {
      recorded = CudaStatus(
          cudaEventRecord(ready, static_cast<cudaStream_t>(options_.compute_stream)),
          "cudaEventRecord");
    }
    if (!recorded.ok()) {
      if (ready != nullptr) cudaEventDestroy(ready);
      return WorkQueue::Finished(recorded);
    }
    return queue_->Enqueue(
        absl::StrCat(what, " on rank ", rank_, " of ", size_),
        [this, ready, launch = std::move(launch)](absl::Time deadline) {
          absl::Status status = Run(ready, launch, deadline);
          cudaEventDestroy(ready);
          if (!status.ok() && !aborted_) {
            ncclCommAbort(comm_);  // broken for good; frees peers blocked on us
            aborted_ = true;
          }
          return status;
        });
  }

  // On the communication thread: wait for `ready`, launch, then poll the
  // completion event and the communicator until done or `deadline`.
  absl::Status Run(cudaEvent_t ready, const std::function<ncclResult_t()>& launch,
                   absl::Time deadline) {
    if (absl::Status s = CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"); !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(cudaStreamWaitEvent(stream_, ready, 0), "cudaStreamWaitEvent");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = NcclStatus(launch(), comm_, "launch"); !s.ok()) return s;
    if (absl::Status s = PollComm(comm_, deadline, "enqueue"); !s.ok()) return s;
    cudaEvent_t done = nullptr;
    if (absl::Status s = CudaStatus(cudaEventCreateWithFlags(&done, cudaEventDisableTiming),
                                    "cudaEventCreate");
        !s.ok()) {
      return s;
    }
    absl::Status status = CudaStatus(cudaEventRecord(done, stream_), "cudaEventRecord");
    while (status.ok()) {
      cudaError_t query = cudaEventQuery(done);
      if (query == cudaSuccess) break;
      if (query != cudaErrorNotReady) {
        status = CudaStatus(query, "cudaEventQuery");
        break;
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      status = NcclStatus(async, comm_, "operation");
      if (status.ok() && absl::Now() >= deadline) {
        status = absl::DeadlineExceededError(absl::StrCat(
            "not finished on the GPU within the timeout (", absl::FormatDuration(options_.timeout),
            "); communicator aborted"));
      }
      if (status.ok()) absl::SleepFor(kPollInterval);
    }
    cudaEventDestroy(done);
    return status;
  }

  absl::Status CheckCounts(const std::vector<size_t>& counts, size_t total, size_t mine) const {
    if (counts.size() != static_cast<size_t>(size_) ||
        std::accumulate(counts.begin(), counts.end(), size_t{0}) != total ||
        counts[rank_] != mine) {
      return absl::InvalidArgumentError(absl::StrCat(
          "counts must have one entry per rank (", size_, "), sum to ", total,
          " and give this rank ", mine));
    }
    return absl::OkStatus();
  }

  absl::Status CheckPeer(int peer, int tag) const {
    if (peer < 0 || peer >= size_ || peer == rank_ || tag < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "peer ", peer, " / tag ", tag, ": expected another rank in [0, ", size_,
          ") and a tag >= 0"));
    }
    return absl::OkStatus();
  }

  const ncclComm_t comm_;
  const int rank_;
  const int size_;
  const NcclOptions options_;
  const cudaStream_t stream_;
  float* const scratch_;  // one device float for Barrier
  // Touched only by the communication thread, then by the destructor after
  // that thread has been joined.
  bool aborted_ = false;
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

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateNcclGroup(rdzv::Store* store, int rank,
                                                              int size,
                                                              const NcclOptions& options) {
  if (store == nullptr || size < 1 || rank < 0 || rank >= size ||
      options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateNcclGroup: rank ", rank, ", size ", size, ", timeout ",
        absl::FormatDuration(options.timeout), "; expected a store, 0 <= rank < size and a "
        "positive timeout"));
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
  return std::unique_ptr<ProcessGroup>(new NcclGroup(comm, rank, size, options, stream, scratch));
}

}  // namespace muster::parallel
