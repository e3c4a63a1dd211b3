#include "parallel/process_group.h"

#include <numeric>

#include "absl/strings/str_cat.h"

namespace muster::parallel {

std::vector<size_t> EvenCounts(size_t total, int parts) {
  std::vector<size_t> counts(parts > 0 ? parts : 0, parts > 0 ? total / parts : 0);
  for (size_t i = 0; parts > 0 && i < total % parts; ++i) ++counts[i];
  return counts;
}

absl::Status CheckCounts(const char* op, const std::vector<size_t>& counts, size_t total,
                         size_t mine, int rank, int size) {
  if (counts.size() != static_cast<size_t>(size)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": counts has ", counts.size(),
                                                   " entries; expected one per rank (", size, ")"));
  }
  size_t sum = std::accumulate(counts.begin(), counts.end(), size_t{0});
  if (sum != total) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": counts sum to ", sum, " but the full buffer holds ", total, " floats"));
  }
  if (counts[rank] != mine) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": this rank's buffer holds ", mine,
                                                   " floats but counts[", rank, "] is ",
                                                   counts[rank]));
  }
  return absl::OkStatus();
}

absl::Status CheckPeer(const char* what, int peer, bool self_ok, int rank, int size) {
  if (peer < 0 || peer >= size || (!self_ok && peer == rank)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is ", peer, "; expected a rank in [0, ",
                                                   size, ")",
                                                   self_ok ? "" : " other than this rank"));
  }
  return absl::OkStatus();
}

absl::Status CheckPointToPoint(const char* what, int peer, int tag, int rank, int size) {
  if (tag < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tag is ", tag, "; expected >= 0"));
  }
  return CheckPeer(what, peer, /*self_ok=*/false, rank, size);
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

absl::Status CheckInt64Op(ReduceOp op) {
  if (op == ReduceOp::kAvg) {
    return absl::InvalidArgumentError(
        "allreduce of int64: avg is not defined on integers; expected sum, min or max");
  }
  return absl::OkStatus();
}

}  // namespace muster::parallel
