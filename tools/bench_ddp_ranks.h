// Ranks as threads of one process for tools/bench_ddp: each thread joins a
// Gloo ProcessGroup through one shared in-memory store, as the tests of
// parallel/ do (style.md item 7), so the bench needs no rendezvous server.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/process_group.h"
#include "rendezvous/store.h"

namespace muster::tools {

// Runs fn(rank) on `ranks` threads and joins them all; returns the first
// error in rank order (OK if none).
absl::Status RunRanksAsThreads(int ranks, const std::function<absl::Status(int rank)>& fn);

// Rank `rank` of `size` joins the Gloo group scoped to `name` in `store`
// (a fresh name per group). Loopback, 60 s timeout.
absl::StatusOr<std::unique_ptr<parallel::ProcessGroup>> JoinGlooGroup(
    rdzv::Store* store, const std::string& name, int rank, int size);

}  // namespace muster::tools
