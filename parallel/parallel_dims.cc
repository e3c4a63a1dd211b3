#include "parallel/parallel_dims.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace muster::parallel {

absl::StatusOr<ParallelDims> ParallelDims::Create(int world_size, int dp_replicate, int dp_shard,
                                                  int pp) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the world has ", world_size, " ranks; expected at least 1"));
  }
  for (const auto& [field, value] :
       {std::pair<const char*, int>{"parallel.dp_replicate", dp_replicate},
        {"parallel.dp_shard", dp_shard},
        {"parallel.pp", pp}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is ", value, "; expected at least 1"));
    }
  }
  // In 64 bits: three ints may overflow 32.
  const int64_t product = int64_t{dp_replicate} * dp_shard * pp;
  if (product != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.dp_replicate (", dp_replicate, ") x parallel.dp_shard (", dp_shard,
                     ") x parallel.pp (", pp, ") = ", product, ", but the world has ", world_size,
                     world_size == 1 ? " rank" : " ranks"));
  }
  ParallelDims dims;
  dims.dp_replicate = dp_replicate;
  dims.dp_shard = dp_shard;
  dims.pp = pp;
  return dims;
}

int ParallelDims::Degree(Dim dim) const {
  switch (dim) {
    case Dim::kDp:
      return dp();
    case Dim::kDpReplicate:
      return dp_replicate;
    case Dim::kDpShard:
      return dp_shard;
    case Dim::kPp:
      return pp;
  }
  return 1;
}

ParallelDims::Coordinates ParallelDims::Of(int rank) const {
  Coordinates at;
  at.shard = rank % dp_shard;
  at.replicate = rank / dp_shard % dp_replicate;
  at.pp = rank / dp();
  at.dp = rank % dp();
  return at;
}

int ParallelDims::RankOf(const Coordinates& at) const {
  return (at.pp * dp_replicate + at.replicate) * dp_shard + at.shard;
}

int ParallelDims::GroupRank(Dim dim, int rank) const {
  const Coordinates at = Of(rank);
  switch (dim) {
    case Dim::kDp:
      return at.dp;
    case Dim::kDpReplicate:
      return at.replicate;
    case Dim::kDpShard:
      return at.shard;
    case Dim::kPp:
      return at.pp;
  }
  return 0;
}

std::vector<int> ParallelDims::GroupRanks(Dim dim, int rank) const {
  const Coordinates at = Of(rank);
  std::vector<int> ranks;
  ranks.reserve(Degree(dim));
  for (int i = 0; i < Degree(dim); ++i) {
    Coordinates member = at;
    switch (dim) {
      case Dim::kDp:
        member.replicate = i / dp_shard;
        member.shard = i % dp_shard;
        break;
      case Dim::kDpReplicate:
        member.replicate = i;
        break;
      case Dim::kDpShard:
        member.shard = i;
        break;
      case Dim::kPp:
        member.pp = i;
        break;
    }
    ranks.push_back(RankOf(member));
  }
  return ranks;
}

std::string ParallelDims::GroupName(Dim dim, int rank) const {
  // The index is the other coordinates' place, in the rank order of the
  // grid with `dim` left out: the sub-groups come out in the order of
  // their lowest rank.
  const Coordinates at = Of(rank);
  int index = 0;
  switch (dim) {
    case Dim::kDp:
      index = at.pp;
      break;
    case Dim::kDpReplicate:
      index = at.pp * dp_shard + at.shard;
      break;
    case Dim::kDpShard:
      index = at.pp * dp_replicate + at.replicate;
      break;
    case Dim::kPp:
      index = at.dp;
      break;
  }
  return absl::StrCat(DimName(dim), ".", index);
}

const char* ParallelDims::DimName(Dim dim) {
  switch (dim) {
    case Dim::kDp:
      return "dp";
    case Dim::kDpReplicate:
      return "dp_replicate";
    case Dim::kDpShard:
      return "dp_shard";
    case Dim::kPp:
      return "pp";
  }
  return "unknown";
}

}  // namespace muster::parallel
