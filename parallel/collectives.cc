#include "parallel/collectives.h"

#include <vector>

#include <utility>

#include "absl/strings/str_cat.h"

namespace muster::parallel {

absl::Status Collectives::HostMemory() const {
  if (group_->takes_host_memory()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "the control plane's collectives pass host memory, and this group takes device memory "
      "only (NCCL): use the control group");
}

absl::Status Collectives::Barrier() { return group_->Barrier()->Wait(); }

absl::Status Collectives::AllReduce(absl::Span<int64_t> values, ReduceOp op) {
  if (absl::Status host = HostMemory(); !host.ok()) return host;
  return group_->AllReduceInt64(values, op)->Wait();
}

absl::Status Collectives::AllReduce(absl::Span<float> values, ReduceOp op) {
  if (absl::Status host = HostMemory(); !host.ok()) return host;
  return group_->AllReduce(values, op)->Wait();
}

absl::StatusOr<int64_t> Collectives::AllReduce(int64_t value, ReduceOp op) {
  if (absl::Status status = AllReduce(absl::MakeSpan(&value, 1), op); !status.ok()) {
    return status;
  }
  return value;
}

absl::StatusOr<int> Collectives::LowestRankWith(bool flag) {
  // size - rank for a flagged rank, so the max names the lowest one.
  auto max = AllReduce(int64_t{flag ? size() - rank() : 0}, ReduceOp::kMax);
  if (!max.ok()) return max.status();
  return *max == 0 ? -1 : size() - static_cast<int>(*max);
}

absl::StatusOr<float> Collectives::AllReduce(float value, ReduceOp op) {
  if (absl::Status status = AllReduce(absl::MakeSpan(&value, 1), op); !status.ok()) {
    return status;
  }
  return value;
}

absl::StatusOr<double> Collectives::SumDouble(double value) {
  if (absl::Status host = HostMemory(); !host.ok()) return host;
  const float high = static_cast<float>(value);
  const float mine[2] = {high, static_cast<float>(value - high)};
  std::vector<float> all(2 * static_cast<size_t>(size()));
  if (absl::Status status = group_
                                ->AllGather(absl::MakeConstSpan(mine, 2), absl::MakeSpan(all),
                                            std::vector<size_t>(size(), 2))
                                ->Wait();
      !status.ok()) {
    return status;
  }
  double sum = 0.0;
  for (size_t r = 0; r < all.size(); r += 2) {
    sum += static_cast<double>(all[r]) + static_cast<double>(all[r + 1]);
  }
  return sum;
}

absl::StatusOr<int64_t> Collectives::Broadcast(int64_t value, int root) {
  if (absl::Status host = HostMemory(); !host.ok()) return host;
  // As its 8 bytes: every rank runs the same build, so the representation
  // is the same everywhere.
  if (absl::Status status =
          group_
              ->BroadcastBytes(absl::MakeSpan(reinterpret_cast<uint8_t*>(&value), sizeof(value)),
                               root)
              ->Wait();
      !status.ok()) {
    return status;
  }
  return value;
}

absl::Status Collectives::Broadcast(std::string* bytes, int root) {
  if (bytes == nullptr) {
    return absl::InvalidArgumentError("Collectives::Broadcast: bytes is null");
  }
  // Only root knows the length: it goes first, so every rank can size its
  // buffer for the second broadcast.
  const bool is_root = root == rank();
  absl::StatusOr<int64_t> length =
      Broadcast(is_root ? static_cast<int64_t>(bytes->size()) : int64_t{0}, root);
  if (!length.ok()) return length.status();
  if (*length < 0) {
    return absl::InternalError(absl::StrCat("broadcast of a string from rank ", root,
                                            ": received a negative length ", *length));
  }
  if (!is_root) bytes->assign(static_cast<size_t>(*length), '\0');
  if (*length == 0) return absl::OkStatus();  // every rank knows: none issues
  return group_
      ->BroadcastBytes(absl::MakeSpan(reinterpret_cast<uint8_t*>(bytes->data()), bytes->size()),
                       root)
      ->Wait();
}

}  // namespace muster::parallel
