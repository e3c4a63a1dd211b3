// ParallelDims: every layout of every world up to 16 ranks, rank by rank,
// against the layout's definition; the sub-groups partition the world and
// their members agree on the name; the config errors.
#include "parallel/parallel_dims.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muster::parallel {
namespace {

using Dim = ParallelDims::Dim;

constexpr Dim kDims[] = {Dim::kDp, Dim::kDpReplicate, Dim::kDpShard, Dim::kPp};

TEST_CASE("the layout is [pp, dp_replicate, dp_shard], dp_shard fastest") {
  absl::StatusOr<ParallelDims> dims = ParallelDims::Create(12, 2, 3, 2);
  REQUIRE(dims.ok());
  CHECK(dims->dp() == 6);
  CHECK(dims->world() == 12);
  // Rank 10 = (pp 1 * 2 + replicate 1) * 3 + shard 1.
  ParallelDims::Coordinates at = dims->Of(10);
  CHECK(at.pp == 1);
  CHECK(at.replicate == 1);
  CHECK(at.shard == 1);
  CHECK(at.dp == 4);
  CHECK(dims->GroupRanks(Dim::kDpShard, 10) == std::vector<int>{9, 10, 11});
  CHECK(dims->GroupRanks(Dim::kDpReplicate, 10) == std::vector<int>{7, 10});
  CHECK(dims->GroupRanks(Dim::kDp, 10) == std::vector<int>{6, 7, 8, 9, 10, 11});
  CHECK(dims->GroupRanks(Dim::kPp, 10) == std::vector<int>{4, 10});
  CHECK(dims->GroupName(Dim::kDpShard, 10) == "dp_shard.3");
  CHECK(dims->GroupName(Dim::kDpReplicate, 10) == "dp_replicate.4");
  CHECK(dims->GroupName(Dim::kDp, 10) == "dp.1");
  CHECK(dims->GroupName(Dim::kPp, 10) == "pp.4");
  CHECK(dims->GroupRank(Dim::kDp, 10) == 4);
  CHECK(dims->GroupRank(Dim::kPp, 10) == 1);
}

TEST_CASE("docs/parallel.md's example: 8 ranks, dp_replicate 2, dp_shard 2, pp 2") {
  absl::StatusOr<ParallelDims> dims = ParallelDims::Create(8, 2, 2, 2);
  REQUIRE(dims.ok());
  auto groups = [&](Dim dim) {
    std::map<std::string, std::vector<int>> named;
    for (int rank = 0; rank < 8; ++rank) {
      named[dims->GroupName(dim, rank)] = dims->GroupRanks(dim, rank);
    }
    return named;
  };
  using Named = std::map<std::string, std::vector<int>>;
  CHECK(groups(Dim::kDpShard) == Named{{"dp_shard.0", {0, 1}},
                                       {"dp_shard.1", {2, 3}},
                                       {"dp_shard.2", {4, 5}},
                                       {"dp_shard.3", {6, 7}}});
  CHECK(groups(Dim::kDpReplicate) == Named{{"dp_replicate.0", {0, 2}},
                                           {"dp_replicate.1", {1, 3}},
                                           {"dp_replicate.2", {4, 6}},
                                           {"dp_replicate.3", {5, 7}}});
  CHECK(groups(Dim::kDp) == Named{{"dp.0", {0, 1, 2, 3}}, {"dp.1", {4, 5, 6, 7}}});
  CHECK(groups(Dim::kPp) ==
        Named{{"pp.0", {0, 4}}, {"pp.1", {1, 5}}, {"pp.2", {2, 6}}, {"pp.3", {3, 7}}});
}

TEST_CASE("the defaults are a world of one") {
  ParallelDims dims;
  CHECK(dims.world() == 1);
  CHECK(dims.GroupRanks(Dim::kDp, 0) == std::vector<int>{0});
  CHECK(dims.GroupName(Dim::kPp, 0) == "pp.0");
}

TEST_CASE("every layout of every world up to 16 ranks") {
  for (int world = 1; world <= 16; ++world) {
    for (int pp = 1; pp <= world; ++pp) {
      for (int replicate = 1; replicate * pp <= world; ++replicate) {
        if (world % (pp * replicate) != 0) continue;
        const int shard = world / (pp * replicate);
        INFO("world " << world << ": pp " << pp << ", dp_replicate " << replicate << ", dp_shard "
                      << shard);
        absl::StatusOr<ParallelDims> made = ParallelDims::Create(world, replicate, shard, pp);
        REQUIRE(made.ok());
        const ParallelDims& dims = *made;
        CHECK(dims.world() == world);
        CHECK(dims.dp() == replicate * shard);

        // Coordinates: the definition, both ways, every rank once.
        std::set<int> seen;
        for (int p = 0; p < pp; ++p) {
          for (int r = 0; r < replicate; ++r) {
            for (int s = 0; s < shard; ++s) {
              const int rank = (p * replicate + r) * shard + s;
              ParallelDims::Coordinates at = dims.Of(rank);
              CHECK(at.pp == p);
              CHECK(at.replicate == r);
              CHECK(at.shard == s);
              CHECK(at.dp == r * shard + s);
              CHECK(dims.RankOf(at) == rank);
              seen.insert(rank);
            }
          }
        }
        CHECK(seen.size() == static_cast<size_t>(world));

        for (Dim dim : kDims) {
          INFO("dimension " << ParallelDims::DimName(dim));
          // name -> ranks, as every member computes them.
          std::map<std::string, std::vector<int>> groups;
          std::vector<int> membership(world, 0);
          for (int rank = 0; rank < world; ++rank) {
            const std::vector<int> ranks = dims.GroupRanks(dim, rank);
            const std::string name = dims.GroupName(dim, rank);
            CHECK(static_cast<int>(ranks.size()) == dims.Degree(dim));
            // Group-rank order: this rank sits at its own group rank.
            REQUIRE(dims.GroupRank(dim, rank) < static_cast<int>(ranks.size()));
            CHECK(ranks[dims.GroupRank(dim, rank)] == rank);
            CHECK(std::is_sorted(ranks.begin(), ranks.end()));
            // The members differ from this rank only along `dim`.
            for (int member : ranks) {
              ParallelDims::Coordinates a = dims.Of(rank), b = dims.Of(member);
              if (dim != Dim::kPp) CHECK(a.pp == b.pp);
              if (dim == Dim::kDpShard || dim == Dim::kPp) CHECK(a.replicate == b.replicate);
              if (dim == Dim::kDpReplicate || dim == Dim::kPp) CHECK(a.shard == b.shard);
            }
            auto [it, inserted] = groups.emplace(name, ranks);
            if (!inserted) CHECK(it->second == ranks);  // members agree on the name
            if (inserted) {
              for (int member : ranks) ++membership[member];
            }
          }
          // A partition: every rank in exactly one group; names unique
          // per group; indices 0..count-1 in the order of the lowest rank.
          for (int rank = 0; rank < world; ++rank) CHECK(membership[rank] == 1);
          CHECK(static_cast<int>(groups.size()) == world / dims.Degree(dim));
          std::vector<std::pair<int, std::string>> by_lowest;
          for (const auto& [name, ranks] : groups) by_lowest.emplace_back(ranks.front(), name);
          std::sort(by_lowest.begin(), by_lowest.end());
          for (size_t i = 0; i < by_lowest.size(); ++i) {
            CHECK(by_lowest[i].second == absl::StrCat(ParallelDims::DimName(dim), ".", i));
          }
        }
      }
    }
  }
}

TEST_CASE("the errors name the config fields and the world size") {
  absl::Status status = ParallelDims::Create(4, 2, 3, 1).status();
  CHECK(absl::IsInvalidArgument(status));
  CHECK(status.message() ==
        "parallel.dp_replicate (2) x parallel.dp_shard (3) x parallel.pp (1) = 6, but the world "
        "has 4 ranks");
  status = ParallelDims::Create(1, 1, 1, 2).status();
  CHECK(status.message() ==
        "parallel.dp_replicate (1) x parallel.dp_shard (1) x parallel.pp (2) = 2, but the world "
        "has 1 rank");
  status = ParallelDims::Create(4, 0, 4, 1).status();
  CHECK(absl::IsInvalidArgument(status));
  CHECK(status.message() == "parallel.dp_replicate is 0; expected at least 1");
  CHECK(ParallelDims::Create(4, 4, -1, 1).status().message() ==
        "parallel.dp_shard is -1; expected at least 1");
  CHECK(ParallelDims::Create(4, 4, 1, 0).status().message() ==
        "parallel.pp is 0; expected at least 1");
  CHECK(absl::IsInvalidArgument(ParallelDims::Create(0, 1, 1, 1).status()));
  // Degrees whose product overflows an int are still a mismatch, not a wrap.
  status = ParallelDims::Create(1 << 30, 1 << 16, 1 << 16, 1 << 2).status();
  CHECK(absl::IsInvalidArgument(status));
  CHECK_THAT(std::string(status.message()), Catch::Contains("= 17179869184"));
}

}  // namespace
}  // namespace muster::parallel
