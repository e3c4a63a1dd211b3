// How a worker process joins its peers: read the environment `launch` gives
// it (launcher/worker_env.cc), reach the rendezvous service, and connect a
// Gloo ProcessGroup through the round's store.
//
// Environment (set by launch; a process started by hand without WORLD_SIZE,
// or with WORLD_SIZE=1, is a world of one and needs none of the others):
//   RANK, WORLD_SIZE, LOCAL_RANK   this process's place in the world
//   MASTER_ADDR                    used only to pick the local address
//   MUSTER_RDZV_ENDPOINT           the rendezvous service, host:port
//   MUSTER_JOB, MUSTER_ROUND       the round whose store scopes the keys
//   MUSTER_TOKEN_FILE, MUSTER_TLS_CA, MUSTER_TLS_CERT, MUSTER_TLS_KEY,
//   MUSTER_JOB_SECRET_FILE         optional: how to authenticate
//   MUSTER_LOCAL_ADDR              optional: the address to listen on and
//                                  advertise (default: the local address
//                                  that routes toward MASTER_ADDR)
//   MUSTER_COMM_TIMEOUT_S          optional: overrides the group timeout
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/process_group.h"
#include "rendezvous/store.h"

namespace muster::rdzv {
class Client;
}

namespace muster::parallel {

struct WorldInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;

  // The rendezvous round (empty/0 for a world of one).
  std::string rdzv_endpoint;
  std::string job_id;
  uint64_t round = 0;
  std::string token_file;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string job_secret_file;

  // Overrides from the environment (unset: use CommunicatorOptions).
  std::string local_addr;
  std::optional<absl::Duration> comm_timeout;
};

// Parses the variables above from `env`. Errors: INVALID_ARGUMENT naming
// the variable when one is malformed (not an integer, RANK outside
// [0, WORLD_SIZE), a non-positive timeout) or when WORLD_SIZE > 1 and
// RANK, MUSTER_RDZV_ENDPOINT, MUSTER_JOB or MUSTER_ROUND is missing.
absl::StatusOr<WorldInfo> WorldFromEnvironment(const std::map<std::string, std::string>& env);
// The same, from this process's environment.
absl::StatusOr<WorldInfo> WorldFromEnvironment();

// The local address whose route leads toward `host` (a connected UDP
// socket's name; no packet is sent), or "127.0.0.1" if `host` is empty or
// does not resolve or route.
std::string LocalAddressToward(const std::string& host);

struct CommunicatorOptions {
  // Bounds connecting the group and each operation (the worker passes its
  // config's value); WorldInfo::comm_timeout overrides it.
  absl::Duration timeout = absl::Seconds(60);
  // Store keys of this group live under this prefix within the round.
  std::string key_prefix = "gloo";
};

// Owns everything a worker's process group needs: the rendezvous Client,
// the round's RemoteStore, a PrefixStore scoping the keys, and the group.
// Thread-safety: group() is a ProcessGroup (see process_group.h).
class Communicator {
 public:
  // Connects to the rendezvous service (a world of one uses an in-memory
  // store instead) and joins the Gloo group; blocks until every rank has
  // joined or the timeout passes. Errors: those of rdzv::Client::Connect
  // (INVALID_ARGUMENT for bad TLS/token files), of the job secret file, and
  // of CreateGlooGroup (DEADLINE_EXCEEDED: a peer did not show up;
  // ABORTED: the round ended meanwhile).
  static absl::StatusOr<std::unique_ptr<Communicator>> Connect(
      const WorldInfo& world, const CommunicatorOptions& options = {});

  // The group goes first: its connections close before the stores go.
  ~Communicator();

  ProcessGroup& group() { return *group_; }
  const WorldInfo& world() const { return world_; }
  // The address this rank listens on and advertises.
  const std::string& local_address() const { return local_address_; }

 private:
  Communicator() = default;

  WorldInfo world_;
  std::string local_address_;
  std::unique_ptr<rdzv::Client> client_;
  std::unique_ptr<rdzv::Store> store_;  // RemoteStore, or InMemoryStore for one
  std::unique_ptr<rdzv::Store> scoped_store_;
  std::unique_ptr<ProcessGroup> group_;
};

}  // namespace muster::parallel
