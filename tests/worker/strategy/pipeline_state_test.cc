// PipelineState's checkpoint ranges (worker/strategy/pipeline/pipeline_state.h), without
// communication: every layout's files cover the flat state exactly once,
// and each rank loads what it writes plus, on the last pipeline rank, the
// wte copy. The state it trains is checked end to end in pipeline_test.
#include "worker/strategy/pipeline/pipeline_state.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muster::worker {
namespace {

// A toy model: stage 0 (wte 40 + wpe 10 floats), 4 blocks of 30, a head of
// 6; `held` per pipeline rank.
PipelineLayout Toy(std::vector<std::vector<int>> held) {
  PipelineLayout layout;
  layout.stage_sizes = {50, 30, 30, 30, 30, 6};
  layout.wte_floats = 40;
  layout.held = std::move(held);
  return layout;
}

// How many files hold each float of a state of `total` floats.
std::vector<int> Coverage(const std::vector<std::vector<FlatRange>>& files, uint64_t total) {
  std::vector<int> times(total, 0);
  for (const auto& file : files) {
    for (const FlatRange& range : file) {
      for (uint64_t i = range.begin; i < range.begin + range.count; ++i) ++times[i];
    }
  }
  return times;
}

bool Contains(const std::vector<FlatRange>& ranges, uint64_t at) {
  for (const FlatRange& range : ranges) {
    if (at >= range.begin && at < range.begin + range.count) return true;
  }
  return false;
}

TEST_CASE("every layout's checkpoint files cover the state once; loads hold the writes") {
  const uint64_t params = 50 + 4 * 30 + 6, total = 3 * params;  // params, m, v
  struct Case {
    const char* name;
    int replicate, shard, pp;
    std::vector<std::vector<int>> held;
  };
  const std::vector<Case> cases = {
      {"pp 2", 1, 1, 2, {{0, 1, 2}, {0, 3, 4, 5}}},
      {"dp 2 x pp 2", 2, 1, 2, {{0, 1, 2}, {0, 3, 4, 5}}},
      {"pp 3", 1, 1, 3, {{0, 1}, {2, 3}, {0, 4, 5}}},
      // Interleaved, 2 ranks x 2 virtual stages: blocks 0 and 2, 1 and 3.
      {"pp 2 interleaved", 1, 1, 2, {{0, 1, 3}, {0, 2, 4, 5}}},
      {"2 shards x pp 2", 1, 2, 2, {{0, 1, 2}, {0, 3, 4, 5}}},
      {"3 shards (uneven) x pp 2 interleaved", 1, 3, 2, {{0, 1, 3}, {0, 2, 4, 5}}},
      {"2 replicas x 2 shards x pp 2", 2, 2, 2, {{0, 1, 2}, {0, 3, 4, 5}}},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const int world = c.replicate * c.shard * c.pp;
    auto dims = parallel::ParallelDims::Create(world, c.replicate, c.shard, c.pp);
    REQUIRE(dims.ok());
    std::vector<std::vector<FlatRange>> files;
    for (int rank = 0; rank < world; ++rank) {
      PipelineState state(Toy(c.held), *dims, rank, /*zero=*/3, nullptr, nullptr, nullptr, nullptr);
      const std::vector<std::vector<FlatRange>> all = state.CheckpointFiles(total);
      if (rank == 0) files = all;
      REQUIRE(all.size() == static_cast<size_t>(world));
      // Every rank describes the same files.
      for (int r = 0; r < world; ++r) {
        REQUIRE(all[r].size() == files[r].size());
        for (size_t i = 0; i < all[r].size(); ++i) {
          CHECK(all[r][i].begin == files[r][i].begin);
          CHECK(all[r][i].count == files[r][i].count);
        }
      }
      const std::vector<FlatRange> load = state.CheckpointLoad(total);
      for (const FlatRange& range : all[rank]) {
        for (uint64_t i = range.begin; i < range.begin + range.count; ++i) {
          INFO("rank " << rank << " writes " << i << " but does not load it");
          REQUIRE(Contains(load, i));
        }
      }
      // The last pipeline rank loads some of the wte (its copy) and writes
      // none of it.
      if (dims->Of(rank).pp == c.pp - 1) {
        bool loads_wte = false;
        for (uint64_t i = 0; i < 40; ++i) {
          loads_wte = loads_wte || Contains(load, i);
          REQUIRE_FALSE(Contains(all[rank], i));
        }
        // Under sharding each shard rank loads its slice of the copy.
        CHECK(loads_wte);
      }
    }
    const std::vector<int> times = Coverage(files, total);
    for (uint64_t i = 0; i < total; ++i) {
      INFO("float " << i << " of the state");
      REQUIRE(times[i] == 1);
    }
  }
}

}  // namespace
}  // namespace muster::worker
