// A ProcessGroup that passes every call to another group: the base of the
// wrappers that add one thing to a group and leave the rest alone (a tool
// that records or times the collectives a strategy issues, a test that
// makes a Gloo group say it takes device memory only, as NCCL's does).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "parallel/process_group.h"

namespace muster::parallel {

class ForwardingGroup : public ProcessGroup {
 public:
  // `inner` is not owned and must outlive this object.
  explicit ForwardingGroup(ProcessGroup* inner) : inner_(inner) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Duration timeout() const override { return inner_->timeout(); }
  GroupMembers members() const override { return inner_->members(); }
  bool takes_host_memory() const override { return inner_->takes_host_memory(); }
  std::shared_ptr<Work> AllReduce(absl::Span<float> data, ReduceOp op) override {
    return inner_->AllReduce(data, op);
  }
  std::shared_ptr<Work> AllReduceInt64(absl::Span<int64_t> data, ReduceOp op) override {
    return inner_->AllReduceInt64(data, op);
  }
  std::shared_ptr<Work> ReduceScatter(absl::Span<const float> input, absl::Span<float> output,
                                      std::vector<size_t> counts, ReduceOp op) override {
    return inner_->ReduceScatter(input, output, std::move(counts), op);
  }
  std::shared_ptr<Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                  std::vector<size_t> counts) override {
    return inner_->AllGather(input, output, std::move(counts));
  }
  std::shared_ptr<Work> AllGatherBf16(absl::Span<const uint16_t> input, absl::Span<uint16_t> output,
                                      std::vector<size_t> counts) override {
    return inner_->AllGatherBf16(input, output, std::move(counts));
  }
  std::shared_ptr<Work> Broadcast(absl::Span<float> data, int root) override {
    return inner_->Broadcast(data, root);
  }
  std::shared_ptr<Work> BroadcastBytes(absl::Span<uint8_t> data, int root) override {
    return inner_->BroadcastBytes(data, root);
  }
  std::shared_ptr<Work> Send(absl::Span<const float> data, int destination, int tag) override {
    return inner_->Send(data, destination, tag);
  }
  std::shared_ptr<Work> Recv(absl::Span<float> data, int source, int tag) override {
    return inner_->Recv(data, source, tag);
  }
  std::shared_ptr<Work> Barrier() override { return inner_->Barrier(); }
  GroupHealth Health() const override { return inner_->Health(); }
  void Abort(const absl::Status& cause) override { inner_->Abort(cause); }

 protected:
  ProcessGroup& inner() const { return *inner_; }

 private:
  ProcessGroup* const inner_;
};

}  // namespace muster::parallel
