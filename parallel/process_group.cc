#include "parallel/process_group.h"

#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

int GroupMembers::Global(int rank) const {
  if (rank < 0 || static_cast<size_t>(rank) >= global_ranks.size()) return rank;
  return global_ranks[rank];
}

std::string GroupMembers::Peer(int rank) const {
  return absl::StrCat("global rank ", Global(rank), " (rank ", rank, " of group ", name, ")");
}

std::string GroupMembers::Describe(const std::string& what, int peer, int64_t op, int rank,
                                   int size) const {
  const std::string on = op >= 0 ? absl::StrCat("op #", op, " on global rank ", Global(rank))
                                 : absl::StrCat("on global rank ", Global(rank));
  if (peer >= 0) {
    return absl::StrCat(what, " global rank ", Global(peer), " (rank ", peer, " of group ", name,
                        "; ", on, ")");
  }
  return absl::StrCat(what, " (group ", name, " of ", size, size == 1 ? " rank; " : " ranks; ", on,
                      ")");
}

absl::Status CheckMembers(const char* who, const GroupMembers& members, int size) {
  if (members.name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": the group has no name"));
  }
  if (members.global_ranks.empty()) return absl::OkStatus();
  const std::string listed = absl::StrCat("group '", members.name, "' lists global ranks [",
                                          absl::StrJoin(members.global_ranks, ","), "]");
  if (members.global_ranks.size() != static_cast<size_t>(size)) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", listed, "; expected one per rank (", size, ")"));
  }
  std::set<int> seen;
  for (int global : members.global_ranks) {
    if (global < 0 || !seen.insert(global).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": ", listed, "; expected distinct ranks >= 0, but ", global,
                       global < 0 ? " is negative" : " is listed twice"));
    }
  }
  return absl::OkStatus();
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
