// Everything an agent needs before its first join: the rendezvous service
// (an embedded one for --standalone, for node 0 of --rdzv_backend static,
// and for the agent on the endpoint's machine with c10d), a client with
// the right credentials, this node's identity, and where logs go.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "launcher/options.h"
#include "launcher/worker_env.h"
#include "proto/rendezvous.pb.h"
#include "rendezvous/client/client.h"
#include "rendezvous/server/server.h"

namespace muster::launcher {

struct RendezvousSetup {
  // Declared before `client`, so the client goes first on destruction.
  std::unique_ptr<rdzv::Server> server;  // embedded, or null
  std::unique_ptr<rdzv::Client> client;
  std::string job_id;
  rendezvous::v1::JoinRequest join;  // this node's join (member_id unset)
  RendezvousAccess access;           // passed on to the workers
  std::string hostname;
  std::string log_root;  // <log_dir>/<run_id>, or a temp dir
};

// Starts the embedded server if the mode needs one, connects, and checks
// the service answers within min(join_timeout, 30 s). Errors carry one line
// for the user: INVALID_ARGUMENT (bad option or file), UNAVAILABLE (cannot
// reach the service), UNAUTHENTICATED / PERMISSION_DENIED, CANCELLED
// (`cancellation`, if given, fired while waiting for the service).
absl::StatusOr<RendezvousSetup> SetUpRendezvous(const LaunchOptions& options,
                                                rdzv::Cancellation* cancellation = nullptr);

// The worlds this node's job may form rounds of, at `nproc` per node.
struct RoundWorld {
  // JobConfig.world_size_multiple: --rdzv_conf world_size_multiple, or what
  // a train.yaml target's parallel layout needs (worker::WorldSizeMultiple);
  // 0 when nothing constrains the world.
  uint32_t multiple = 0;
  // --nnodes, narrowed to the one node count that makes the world when the
  // layout fixes it (worker::WorldSizeFixed: no degree is auto).
  int min_nodes = 1;
  int max_nodes = 1;
};
// INVALID_ARGUMENT, naming the flags, when no node count that --nnodes (or
// --standalone, one node) allows makes such a world, or when the given
// multiple is not a multiple of the layout's.
absl::StatusOr<RoundWorld> RoundWorldFor(const LaunchOptions& options, int nproc);

// Removes every directory under `root`, and `root`, that holds no file:
// what is left of a log root once the files worth keeping are written.
// Errors are ignored (a directory that cannot go stays).
void RemoveEmptyDirectories(const std::string& root);

// A TCP port that was free a moment ago on every interface. Racy by nature
// (another process may take it before the worker binds it); the window is
// the time to spawn rank 0.
absl::StatusOr<int> PickFreePort();

// The local IP address this node uses to reach `host` (a UDP connect
// reveals the route without sending anything); "" if unknown.
std::string LocalAddressToward(const std::string& host);

}  // namespace muster::launcher
