// A ProcessGroup of one rank (size 1, rank 0), with no transport: every
// collective is the identity or a copy, finished when it is issued (the
// contract is parallel/process_group.h). A world of one uses it so that the
// control plane (parallel/collectives.h) always has a group to talk
// through, and Communicator::NewGroup gives one for a sub-group of one rank.
//
// Memory: host memory only (it copies with std::copy).
//
// Errors: INVALID_ARGUMENT for bad counts, a root other than 0, any
// send/recv (there is no peer) and kAvg on int64s, as every back end.
// Abort(cause) makes every later operation fail with `cause` (the first
// cause stays), and Health() reports it; there is nothing to free.
//
// Thread-safety: any thread may issue, abort or read Health().
#pragma once

#include <memory>

#include "absl/time/time.h"
#include "parallel/process_group.h"

namespace muster::parallel {

// `timeout` is what timeout() reports (a watchdog reads it); nothing waits.
// `members` is what members() reports (a sub-group of one passes its name
// and its one global rank).
std::unique_ptr<ProcessGroup> CreateSelfGroup(absl::Duration timeout = absl::Seconds(60),
                                              GroupMembers members = {});

}  // namespace muster::parallel
