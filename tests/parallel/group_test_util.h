// Threads-as-ranks helpers for Catch2 tests, over parallel/local_ranks.h:
// every rank's ProcessGroup lives in this one process, connected over an
// InMemoryStore. Operations are asynchronous, so
// the test thread issues each rank's operation in turn and then waits; no
// Catch2 assertion runs on another thread (Catch2 v2 is not thread-safe).
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/status/statusor.h"
#include "parallel/gloo/group.h"
#include "parallel/local_ranks.h"
#include "rendezvous/client/store.h"

namespace muster::parallel::testing {

using Groups = std::vector<std::unique_ptr<ProcessGroup>>;

// Connects `size` ranks (parallel/local_ranks.h) and REQUIREs success.
inline Groups ConnectGroups(rdzv::Store& store, int size, GlooOptions options = {}) {
  auto groups = ConnectLocalGroups(&store, size, "", options);
  INFO(groups.status().ToString());
  REQUIRE(groups.ok());
  return *std::move(groups);
}

// OnEveryRank (parallel/local_ranks.h) runs a blocking body on every rank
// at once; the body must not use Catch2 (Catch2 v2 is not thread-safe).
using parallel::OnEveryRank;

// Waits for every Work and REQUIREs each is OK.
inline void WaitAll(const std::vector<std::shared_ptr<Work>>& works) {
  for (size_t i = 0; i < works.size(); ++i) {
    absl::Status status = works[i]->Wait();
    INFO("work " << i << ": " << status.ToString());
    REQUIRE(status.ok());
  }
}

// Integer-valued floats (exact sums): rank r's element i.
inline float Value(int rank, size_t i) { return static_cast<float>(i % 1013 + 7 * rank); }

inline std::vector<float> RankData(int rank, size_t n) {
  std::vector<float> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = Value(rank, i);
  return data;
}

// The element-wise sum over `size` ranks of RankData.
inline std::vector<float> SumOverRanks(int size, size_t n) {
  std::vector<float> sum(n, 0.0f);
  for (int rank = 0; rank < size; ++rank) {
    for (size_t i = 0; i < n; ++i) sum[i] += Value(rank, i);
  }
  return sum;
}

}  // namespace muster::parallel::testing
