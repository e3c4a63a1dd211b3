// How a worker process joins its peers: read the environment `launch` gives
// it (launcher/worker_env.cc), reach the rendezvous service, connect the
// process groups through the round's store, and start the watchdog that
// aborts them when the round ends (parallel/watchdog.h).
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
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "parallel/process_group.h"
#include "parallel/watchdog.h"
#include "rendezvous/client/rpc.h"
#include "rendezvous/client/store.h"

namespace muster::rdzv {
class JobWatcher;
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

// OK while `latest` (the newest state of the job, if any) is still
// running `round`; otherwise ABORTED naming the round, the job and why the
// round ended (the watchdog's round probe).
absl::Status RoundStatus(const std::optional<rdzv::pb::JobState>& latest, const std::string& job_id,
                         uint64_t round);

// What messages call the world's groups (process_group.h, "Names in
// messages"; group rank == global rank): the Gloo group (group(), for
// control messages) and, with DataBackend::kNccl, the NCCL data group.
// A sub-group is called by the name NewGroup is given.
inline constexpr char kWorldGroupName[] = "world";
inline constexpr char kWorldNcclGroupName[] = "world.nccl";

// Where gradients (device or host buffers) are reduced.
enum class DataBackend {
  kGloo,        // the Gloo group itself (host memory)
  kNccl,        // an NCCL group on `cuda_device` (device memory)
  kStagedGloo,  // Gloo, with device buffers staged through pinned host memory
};

struct CommunicatorOptions {
  // Bounds connecting the groups and each operation (the worker passes its
  // config's value); WorldInfo::comm_timeout overrides it.
  absl::Duration timeout = absl::Seconds(60);
  // Store keys of the Gloo group live under this prefix within the round
  // (NCCL's under "nccl").
  std::string key_prefix = "gloo";

  DataBackend data_backend = DataBackend::kGloo;
  int cuda_device = 0;             // kNccl, kStagedGloo
  void* compute_stream = nullptr;  // cudaStream_t the gradients are written on

  // The watchdog runs when the world has a rendezvous round (world > 1).
  // on_stuck: called once if the process is still running exit_grace after
  // a cause (the worker prints the cause and exits).
  Watchdog::OnStuck on_stuck;
  WatchdogOptions watchdog;
};

// Owns everything a worker's process groups need: the rendezvous Client,
// the round's RemoteStore, PrefixStores scoping the keys, the groups (the
// world's and the sub-groups of NewGroup), the round's JobWatcher and the
// watchdog.
//
// Two groups: group() is Gloo over host memory, for control messages
// (losses, checkpoint votes); data_group() reduces the gradients with the
// chosen DataBackend and is group() itself for kGloo. A kStagedGloo data
// group wraps group(), so then every operation must go through it
// (data_group()), control messages included, to keep one order per rank.
// Thread-safety: the groups are ProcessGroups (see process_group.h).
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

  // A Gloo group (host memory) among `ranks`: global ranks, listed in
  // group-rank order (ParallelDims::GroupRanks gives them), this rank among
  // them. Its messages name it `name` and its ranks by global rank
  // (ProcessGroup::members()). Every member calls this with the same name and ranks; it blocks
  // until all have joined or the timeout passes. The group connects through
  // the round's store under "group/<name>/", with the world group's timeout
  // and local address; a sub-group of one rank (and any group of a world of
  // one) is a self group (parallel/self_group.h), which needs no peers. The
  // Communicator owns it (it lives as long as the Communicator) and its
  // watchdog watches it: the round's end, or any group's error, aborts it
  // with the others.
  //
  // Errors: INVALID_ARGUMENT for an empty name, a rank outside the world or
  // listed twice, a list without this rank, or a list that differs from
  // the one another member gave for the same name; ALREADY_EXISTS for a
  // name used before by this Communicator (even if creating it failed: its
  // keys in the store may be half-written); CreateGlooGroup's otherwise
  // (DEADLINE_EXCEEDED: a member did not join; ABORTED: the round ended).
  // Thread-safety: any thread, but every member must create its groups in
  // the same order, or two ranks can wait for each other on different ones.
  absl::StatusOr<ProcessGroup*> NewGroup(const std::string& name, const std::vector<int>& ranks);
  // The same on the data backend, for device buffers (FSDP's sub-groups
  // under HSDP): kGloo, NewGroup's group; kStagedGloo, that Gloo group (or
  // self group) staged through pinned host memory on the data group's
  // device; kNccl, an NCCL communicator of its own among `ranks` (a single
  // rank too: NCCL takes device memory, the self group does not), its id
  // exchanged under "nccl-group/<name>/". The watchdog watches it as it
  // does NewGroup's. Errors: NewGroup's, and CreateHostStagedGroup's or
  // CreateNcclGroup's.
  absl::StatusOr<ProcessGroup*> NewDataGroup(const std::string& name,
                                             const std::vector<int>& ranks);

  ProcessGroup& group() { return *group_; }
  ProcessGroup& data_group() { return data_group_ != nullptr ? *data_group_ : *group_; }
  // The group for control messages: group(), unless data_group() wraps it.
  ProcessGroup& control_group() { return data_group_owns_group_ ? *data_group_ : *group_; }
  // nullptr for a world of one or without a rendezvous round.
  const Watchdog* watchdog() const { return watchdog_.get(); }
  const WorldInfo& world() const { return world_; }
  // The address this rank listens on and advertises.
  const std::string& local_address() const { return local_address_; }

 private:
  Communicator() = default;
  // NewGroup and NewDataGroup: the checks, then a group on `backend`.
  absl::StatusOr<ProcessGroup*> CreateSubGroup(const std::string& name,
                                               const std::vector<int>& ranks, DataBackend backend);
  // A sub-group and, when it is staged, the Gloo group it wraps (declared
  // first: destroyed after the wrapper).
  struct SubGroup {
    std::unique_ptr<ProcessGroup> inner;
    std::unique_ptr<ProcessGroup> group;
  };

  WorldInfo world_;
  std::string local_address_;
  std::unique_ptr<rdzv::Client> client_;
  std::unique_ptr<rdzv::Store> store_;  // RemoteStore, or InMemoryStore for one
  std::unique_ptr<rdzv::Store> scoped_store_;
  std::unique_ptr<rdzv::Store> nccl_store_;
  std::unique_ptr<ProcessGroup> group_;
  std::unique_ptr<ProcessGroup> data_group_;  // nullptr: group_
  bool data_group_owns_group_ = false;        // kStagedGloo wraps group_
  std::unique_ptr<rdzv::JobWatcher> round_watcher_;
  std::unique_ptr<Watchdog> watchdog_;
  absl::Duration timeout_;  // of every Gloo group
  CommunicatorOptions options_;
  absl::Mutex sub_groups_mu_;
  // NewGroup's and NewDataGroup's, by name; empty while being created, or
  // when creating failed.
  std::map<std::string, SubGroup> sub_groups_ ABSL_GUARDED_BY(sub_groups_mu_);
};

}  // namespace muster::parallel
