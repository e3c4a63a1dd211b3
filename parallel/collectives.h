// The control plane: blocking collectives over a host-memory ProcessGroup,
// for the few numbers and messages the ranks must agree on (a mean loss, a
// checkpoint vote, the step to resume from, a path only rank 0 knows).
// Gradients and parameters go through the ProcessGroup itself, without
// blocking.
//
// Contract (that of process_group.h, made blocking):
//   - every rank of the group calls the same sequence of these methods,
//     with the same arguments where they must agree (op, root, lengths);
//   - buffers are host memory: the group is Gloo, a self group, or a
//     staged group (whose new ops take host memory only), never NCCL:
//     over a group whose takes_host_memory() is false, every call but
//     Barrier is FAILED_PRECONDITION, without communicating;
//   - nobody else issues on the group while a call runs, or the issue
//     order would differ between ranks.
// Each call returns once its operations have finished, so the buffers may
// be reused at once. Errors are the group's (process_group.h): after a
// communication error every later call fails with the first one.
//
// Integers are exact (AllReduce on int64_t); floats only up to 2^24. Votes
// are integer reductions: "every rank agrees" is kMin over 0/1, "any rank
// asks" is kMax.
//
// Thread-safety: as the group's; one thread calls, in practice.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "parallel/process_group.h"

namespace muster::parallel {

class Collectives {
 public:
  // `group` is not owned and must outlive this object.
  explicit Collectives(ProcessGroup* group) : group_(group) {}

  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  ProcessGroup& group() const { return *group_; }

  // Returns once every rank has reached it.
  absl::Status Barrier();

  // In place, element-wise over ranks. int64: kSum, kMin, kMax (kAvg is
  // INVALID_ARGUMENT); float: all four.
  absl::Status AllReduce(absl::Span<int64_t> values, ReduceOp op);
  absl::Status AllReduce(absl::Span<float> values, ReduceOp op);
  absl::StatusOr<int64_t> AllReduce(int64_t value, ReduceOp op);
  absl::StatusOr<float> AllReduce(float value, ReduceOp op);

  // The lowest rank whose `flag` is true, -1 when none's is: the rank
  // whose log says why, for the others to name when a check fails on one.
  absl::StatusOr<int> LowestRankWith(bool flag);

  // The sum over ranks of a double, kept in double precision (each rank's
  // value travels as two floats, its high and low parts) and added in rank
  // order: the same bits on every rank, and on every group of the same
  // size given the same values. For gradient norms over shards.
  absl::StatusOr<double> SumDouble(double value);

  // Root's `*bytes`, of any length, replaces every other rank's (whose own
  // is ignored). Two operations: the length (an int64 broadcast), then the
  // bytes (none when empty).
  absl::Status Broadcast(std::string* bytes, int root);
  // Root's `value`; the others' is ignored.
  absl::StatusOr<int64_t> Broadcast(int64_t value, int root);

 private:
  absl::Status HostMemory() const;

  ProcessGroup* const group_;
};

}  // namespace muster::parallel
