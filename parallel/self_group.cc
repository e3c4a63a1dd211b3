#include "parallel/self_group.h"

#include <algorithm>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "parallel/work_queue.h"

namespace muster::parallel {
namespace {

class SelfGroup : public ProcessGroup {
 public:
  SelfGroup(absl::Duration timeout, GroupMembers members)
      : timeout_(timeout), members_(std::move(members)) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::Duration timeout() const override { return timeout_; }
  GroupMembers members() const override { return members_; }

  // Sum, mean, min and max over one rank are the value itself.
  std::shared_ptr<Work> AllReduce(absl::Span<float>, ReduceOp) override { return Done(); }

  std::shared_ptr<Work> AllReduceInt64(absl::Span<int64_t>, ReduceOp op) override {
    if (absl::Status bad = CheckInt64Op(op); !bad.ok()) return WorkQueue::Finished(bad);
    return Done();
  }

  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> input, absl::Span<float> output,
                                      std::vector<size_t> counts, ReduceOp) override {
    return Copy("reduce_scatter", counts, input.size(), output.size(), input, output);
  }

  std::shared_ptr<Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                  std::vector<size_t> counts) override {
    return Copy("allgather", counts, output.size(), input.size(), input, output);
  }

  std::shared_ptr<Work> AllGatherBf16(absl::Span<const uint16_t> input, absl::Span<uint16_t> output,
                                      std::vector<size_t> counts) override {
    return Copy("allgather", counts, output.size(), input.size(), input, output);
  }

  std::shared_ptr<Work> Broadcast(absl::Span<float>, int root) override { return CheckRoot(root); }

  std::shared_ptr<Work> BroadcastBytes(absl::Span<uint8_t>, int root) override {
    return CheckRoot(root);
  }

  // No peer exists: CheckPointToPoint refuses rank 0 (this rank) and any other.
  std::shared_ptr<Work> Send(absl::Span<const float>, int destination, int tag) override {
    return WorkQueue::Finished(CheckPointToPoint("send destination", destination, tag, 0, 1));
  }

  std::shared_ptr<Work> Recv(absl::Span<float>, int source, int tag) override {
    return WorkQueue::Finished(CheckPointToPoint("recv source", source, tag, 0, 1));
  }

  std::shared_ptr<Work> Barrier() override { return Done(); }

  GroupHealth Health() const override {
    GroupHealth health;
    absl::MutexLock lock(&mu_);
    health.error = error_;
    return health;
  }

  void Abort(const absl::Status& cause) override {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) {
      error_ = cause.ok() ? absl::AbortedError("the group was aborted") : cause;
    }
  }

 private:
  // A world of one's reduce_scatter and allgathers: check the counts against
  // the `full` and `piece` sizes, then copy.
  template <typename T>
  std::shared_ptr<Work> Copy(const char* what, const std::vector<size_t>& counts, size_t full,
                             size_t piece, absl::Span<const T> input, absl::Span<T> output) {
    if (absl::Status bad = CheckCounts(what, counts, full, piece, 0, 1); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Done([&] { std::copy(input.begin(), input.end(), output.begin()); });
  }

  std::shared_ptr<Work> CheckRoot(int root) {
    if (absl::Status bad = CheckPeer("broadcast root", root, /*self_ok=*/true, 0, 1); !bad.ok()) {
      return WorkQueue::Finished(bad);
    }
    return Done();
  }

  // Runs `body` (the copy) unless the group was aborted, and reports it
  // finished.
  template <typename Body>
  std::shared_ptr<Work> Done(Body body) {
    {
      absl::MutexLock lock(&mu_);
      if (!error_.ok()) return WorkQueue::Finished(error_);
    }
    body();
    return WorkQueue::Finished(absl::OkStatus());
  }
  std::shared_ptr<Work> Done() {
    return Done([] {});
  }

  const absl::Duration timeout_;
  const GroupMembers members_;
  mutable absl::Mutex mu_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<ProcessGroup> CreateSelfGroup(absl::Duration timeout, GroupMembers members) {
  return std::make_unique<SelfGroup>(timeout, std::move(members));
}

}  // namespace muster::parallel
