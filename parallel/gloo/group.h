// ProcessGroup over Gloo's TCP transport, on CPU memory (the contract is
// parallel/process_group.h).
//
// Every rank listens on `GlooOptions::address` (an ephemeral port) and
// advertises that address through the store; gloo's connectFullMesh then
// connects every pair. Operations use gloo's algorithms (ring allreduce,
// allgatherv, broadcast, barrier) and unbound buffers (send/recv, and a
// ring reduce-scatter for uneven counts). Avg is the sum divided by size().
//
// Send/recv: a send completes only once the receiver has posted the
// matching receive, and each rank runs its operations one at a time, so two
// ranks that both Send to each other before their Recv deadlock until the
// timeout (DEADLINE_EXCEEDED). Order them as send on one side, recv on the
// other.
//
// Failure: after a communication error the group also closes its
// connections, so peers blocked on this rank fail at once (UNAVAILABLE)
// instead of waiting out their timeout. UNAVAILABLE messages name the peer
// whose connection failed when the transport's message identifies it (or
// the group has two ranks), by its global rank and its rank in the group
// (GlooOptions::members; process_group.h, "Names in messages").
// A monitor thread probes the connections every 50 ms, because this gloo
// does not wake a pending send when its connection fails.
//
// Process-wide side effect: CreateGlooGroup sets SIGPIPE to SIG_IGN if it
// has the default action (as Python does), because gloo's socket writes to
// a dead peer would otherwise kill the process instead of failing the
// operation.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/process_group.h"
#include "rendezvous/client/store.h"

namespace muster::parallel {

struct GlooOptions {
  // The local address to listen on, which is also the address peers
  // connect to (gloo advertises the bound address), so it must be
  // reachable from every peer: not 0.0.0.0.
  std::string address = "127.0.0.1";
  // Bounds connecting the mesh and then each operation.
  absl::Duration timeout = absl::Seconds(60);
  // What messages call the group and its ranks: the default is the world
  // group ("world", group rank == global rank); a sub-group passes its
  // name and its members' global ranks in group-rank order
  // (Communicator::NewGroup does).
  GroupMembers members;
};

// Joins `size` ranks through `store`. Every rank calls this with the same
// `size`, a distinct `rank`, and a store scoped to this group (a fresh
// PrefixStore per group: the keys are "0".."size-1" and "address/<rank>").
// Blocks until every peer is connected or options.timeout has passed.
// `store` is used only during this call.
//
// Errors: INVALID_ARGUMENT for a bad rank, size, timeout, members (see
// CheckMembers) or address (one that cannot be bound); DEADLINE_EXCEEDED when the peers did not all
// show up within the timeout; UNAVAILABLE when a connection failed; the store's own codes (e.g.
// ABORTED: the rendezvous round is over).
absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateGlooGroup(rdzv::Store* store, int rank,
                                                              int size,
                                                              const GlooOptions& options = {});

}  // namespace muster::parallel
