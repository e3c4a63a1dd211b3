// Test-only data parallelism in one process: each thread is one rank
// driving its own Trainer through a real Ddp strategy (worker/strategy/ddp/ddp.h) over
// real Gloo groups, connected through an in-memory store
// (tests/parallel/group_test_util.h). Every wait is bounded by the groups'
// timeout: a stuck rank fails the others instead of hanging the test.
#pragma once

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "parallel/gradient_reducer.h"
#include "rendezvous/client/store.h"
#include "tests/parallel/group_test_util.h"
#include "worker/strategy/ddp/ddp.h"
#include "worker/strategy/strategy.h"

namespace muster::worker::testing {

// Connects `size` ranks (on the calling thread, which may REQUIRE), then
// runs body(rank, strategy) on `size` threads and joins them. The body must
// not use Catch2 assertions (Catch2 v2 is not thread-safe).
inline void RunRanks(int size, const std::function<void(int, ParallelStrategy*)>& body) {
  rdzv::InMemoryStore store;
  parallel::testing::Groups groups = parallel::testing::ConnectGroups(store, size);
  std::vector<std::unique_ptr<Ddp>> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.push_back(
        std::make_unique<Ddp>(groups[r].get(), groups[r].get(), parallel::BucketOptions{}, "gloo"));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] { body(r, ranks[r].get()); });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace muster::worker::testing
