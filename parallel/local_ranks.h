// Ranks as threads of one process: real Gloo groups joined through one
// in-memory store, for the tests and benchmarks that need a world without
// a rendezvous server (tests/parallel/group_test_util.h,
// tests/worker/thread_ranks.h, tools/bench_ddp). The one copy of this
// plumbing; production code joins through parallel::Communicator.
#pragma once

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/gloo/group.h"
#include "parallel/process_group.h"
#include "rendezvous/client/store.h"

namespace muster::parallel {

// Runs body(rank) for every rank at once, each on a thread of its own, and
// returns the results in rank order. Bounded when every call in `body` is
// (every group operation is, by its group's timeout).
template <typename Body>
auto OnEveryRank(int size, Body body) -> std::vector<decltype(body(0))> {
  std::vector<decltype(body(0))> results(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] { results[rank] = body(rank); });
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

// The first error of `statuses`, in rank order (OK if none).
absl::Status FirstError(const std::vector<absl::Status>& statuses);

// Connects `size` ranks through `store` (concurrently: each blocks until
// all have joined), keys under `prefix` (a fresh prefix per world sharing
// the store). Element r is rank r's group. The first rank's error, if any.
absl::StatusOr<std::vector<std::unique_ptr<ProcessGroup>>> ConnectLocalGroups(
    rdzv::Store* store, int size, const std::string& prefix = "", const GlooOptions& options = {});

}  // namespace muster::parallel
