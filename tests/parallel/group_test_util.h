// Threads-as-ranks helpers: every rank's ProcessGroup lives in this one
// process, connected over an InMemoryStore. Operations are asynchronous, so
// the test thread issues each rank's operation in turn and then waits; no
// Catch2 assertion runs on another thread (Catch2 v2 is not thread-safe).
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/status/statusor.h"
#include "parallel/gloo_group.h"
#include "rendezvous/store.h"

namespace muster::parallel::testing {

using Groups = std::vector<std::unique_ptr<ProcessGroup>>;

// Connects `size` ranks (concurrently: each blocks until all have joined).
inline Groups ConnectGroups(rdzv::Store& store, int size, GlooOptions options = {}) {
  std::vector<absl::StatusOr<std::unique_ptr<ProcessGroup>>> made;
  for (int rank = 0; rank < size; ++rank) made.emplace_back(absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back(
        [&, rank] { made[rank] = CreateGlooGroup(&store, rank, size, options); });
  }
  for (std::thread& thread : threads) thread.join();
  Groups groups;
  for (int rank = 0; rank < size; ++rank) {
    INFO("rank " << rank << ": " << made[rank].status().ToString());
    REQUIRE(made[rank].ok());
    groups.push_back(*std::move(made[rank]));
  }
  return groups;
}

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
