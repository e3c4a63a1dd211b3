// How the ranks of a world are arranged for the parallelisms: a grid of
// pipeline stages (pp), data-parallel replicas (dp_replicate) and shards
// within a replica (dp_shard, FSDP's dimension), as torchtitan's device
// mesh ["pp", "dp_replicate", "dp_shard"] with dp_shard varying fastest:
//
//   rank = (pp_rank * dp_replicate + replicate_rank) * dp_shard + shard_rank
//
// so the ranks of one shard group are consecutive (on one node, when
// dp_shard divides the ranks per node) and the pipeline stages are the
// farthest apart. dp = dp_replicate * dp_shard is the whole data-parallel
// degree: the ranks of one dp group see different data and hold the same
// pipeline stage.
//
// A sub-group is the set of ranks that differ only along one dimension
// (kDp: along both dp_replicate and dp_shard). Every rank is in exactly one
// sub-group per dimension, so the sub-groups of a dimension partition the
// world; GroupRanks lists a rank's, GroupName names it the same on every
// member, for Communicator::NewGroup (parallel/bootstrap.h).
//
// Pure arithmetic: no communication, no state.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::parallel {

struct ParallelDims {
  enum class Dim { kDp, kDpReplicate, kDpShard, kPp };

  // A rank's place in the grid.
  struct Coordinates {
    int pp = 0;         // pipeline stage
    int replicate = 0;  // replica, within the stage
    int shard = 0;      // shard, within the replica
    int dp = 0;         // replicate * dp_shard + shard: its place among the stage's dp ranks
  };

  int dp_replicate = 1;
  int dp_shard = 1;
  int pp = 1;

  // Checks the degrees against the world: each >= 1, and their product
  // equal to `world_size`. Errors are INVALID_ARGUMENT naming the config
  // fields (parallel.dp_replicate, parallel.dp_shard, parallel.pp) and the
  // world size.
  static absl::StatusOr<ParallelDims> Create(int world_size, int dp_replicate, int dp_shard,
                                             int pp);

  int dp() const { return dp_replicate * dp_shard; }
  int world() const { return dp() * pp; }
  // The number of ranks along `dim` (the size of each of its sub-groups).
  int Degree(Dim dim) const;

  // REQUIRES: 0 <= rank < world() (for these and the ones below).
  Coordinates Of(int rank) const;
  // The global rank at those coordinates (`dp` is ignored).
  int RankOf(const Coordinates& at) const;

  // The global ranks of `rank`'s sub-group along `dim`, in group-rank
  // order (ascending: the coordinate along `dim` is the group rank).
  std::vector<int> GroupRanks(Dim dim, int rank) const;
  // `rank`'s rank within that sub-group.
  int GroupRank(Dim dim, int rank) const;
  // "<dimension>.<index>", e.g. "dp_shard.3": the index numbers the
  // sub-groups of `dim` in the order of their lowest rank, so every member
  // computes the same name and no two sub-groups share one.
  std::string GroupName(Dim dim, int rank) const;

  // "dp", "dp_replicate", "dp_shard", "pp".
  static const char* DimName(Dim dim);
};

}  // namespace muster::parallel
