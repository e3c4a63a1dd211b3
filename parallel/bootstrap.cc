#include "parallel/bootstrap.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>
#include <utility>

extern char** environ;

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "parallel/gloo/group.h"
#include "parallel/nccl/group.h"
#include "parallel/self_group.h"
#include "parallel/staged/group.h"
#include "rendezvous/client/rpc.h"
#include "rendezvous/client/watcher.h"

namespace muster::parallel {
namespace {

using Env = std::map<std::string, std::string>;

const std::string* Find(const Env& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

// Parses env[name] as an integer; `fallback` if unset.
template <typename Int>
absl::StatusOr<Int> ParseInt(const Env& env, const std::string& name, Int fallback) {
  const std::string* text = Find(env, name);
  if (text == nullptr) return fallback;
  Int value;
  if (!absl::SimpleAtoi(*text, &value)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "='", *text, "' is not an integer"));
  }
  return value;
}

absl::StatusOr<std::string> Required(const Env& env, const std::string& name, int world_size) {
  const std::string* value = Find(env, name);
  if (value == nullptr || value->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is not set; a worker of a world of ",
                                                   world_size,
                                                   " needs the environment `launch` gives it"));
  }
  return *value;
}

std::string Optional(const Env& env, const std::string& name) {
  const std::string* value = Find(env, name);
  return value == nullptr ? "" : *value;
}

}  // namespace

absl::StatusOr<WorldInfo> WorldFromEnvironment(const Env& env) {
  WorldInfo world;
  absl::StatusOr<int> world_size = ParseInt<int>(env, "WORLD_SIZE", 1);
  if (!world_size.ok()) return world_size.status();
  if (*world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("WORLD_SIZE=", *world_size, " must be at least 1"));
  }
  world.world_size = *world_size;
  world.local_addr = Optional(env, "MUSTER_LOCAL_ADDR");
  if (const std::string* text = Find(env, "MUSTER_COMM_TIMEOUT_S")) {
    double seconds = 0;
    if (!absl::SimpleAtod(*text, &seconds) || !(seconds > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("MUSTER_COMM_TIMEOUT_S='", *text, "' must be a positive number of seconds"));
    }
    world.comm_timeout = absl::Seconds(seconds);
  }
  if (world.world_size == 1) {  // needs nothing else, and RANK, when set, is 0
    absl::StatusOr<int> rank = ParseInt<int>(env, "RANK", 0);
    if (!rank.ok()) return rank.status();
    if (*rank != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("RANK=", *rank, " is outside [0, WORLD_SIZE=1)"));
    }
    return world;
  }

  absl::StatusOr<int> rank = ParseInt<int>(env, "RANK", -1);
  if (!rank.ok()) return rank.status();
  if (*rank < 0 || *rank >= world.world_size) {
    return absl::InvalidArgumentError(
        Find(env, "RANK") == nullptr
            ? absl::StrCat("RANK is not set but WORLD_SIZE is ", world.world_size)
            : absl::StrCat("RANK=", *rank, " is outside [0, WORLD_SIZE=", world.world_size, ")"));
  }
  world.rank = *rank;
  absl::StatusOr<int> local_rank = ParseInt<int>(env, "LOCAL_RANK", 0);
  if (!local_rank.ok()) return local_rank.status();
  world.local_rank = *local_rank;
  world.master_addr = Optional(env, "MASTER_ADDR");

  absl::StatusOr<std::string> endpoint = Required(env, "MUSTER_RDZV_ENDPOINT", world.world_size);
  if (!endpoint.ok()) return endpoint.status();
  world.rdzv_endpoint = *endpoint;
  absl::StatusOr<std::string> job = Required(env, "MUSTER_JOB", world.world_size);
  if (!job.ok()) return job.status();
  world.job_id = *job;
  if (Find(env, "MUSTER_ROUND") == nullptr) {
    return Required(env, "MUSTER_ROUND", world.world_size).status();
  }
  absl::StatusOr<uint64_t> round = ParseInt<uint64_t>(env, "MUSTER_ROUND", 0);
  if (!round.ok()) return round.status();
  world.round = *round;

  world.token_file = Optional(env, "MUSTER_TOKEN_FILE");
  world.tls_ca = Optional(env, "MUSTER_TLS_CA");
  world.tls_cert = Optional(env, "MUSTER_TLS_CERT");
  world.tls_key = Optional(env, "MUSTER_TLS_KEY");
  world.job_secret_file = Optional(env, "MUSTER_JOB_SECRET_FILE");
  return world;
}

absl::StatusOr<WorldInfo> WorldFromEnvironment() {
  Env env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string text(*entry);
    size_t equals = text.find('=');
    if (equals != std::string::npos) env[text.substr(0, equals)] = text.substr(equals + 1);
  }
  return WorldFromEnvironment(env);
}

std::string LocalAddressToward(const std::string& host) {
  const std::string fallback = "127.0.0.1";
  if (host.empty()) return fallback;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  // Any port will do: connect() on UDP only picks the route.
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return fallback;
  std::string address = fallback;
  int fd = socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {};
    if (connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      const void* raw =
          local.ss_family == AF_INET6
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr) address = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return address;
}

namespace {

// The data backend's groups, made alike for the world (Connect) and for
// sub-groups (NewDataGroup): an NCCL communicator of `size` ranks whose id
// goes through `store`, named in messages by `members`, and a Gloo (or
// self) group staged through pinned host memory on the options' device.
absl::StatusOr<std::unique_ptr<ProcessGroup>> ConnectNccl(rdzv::Store* store, int rank, int size,
                                                          const CommunicatorOptions& options,
                                                          absl::Duration timeout,
                                                          GroupMembers members) {
  NcclOptions nccl;
  nccl.device = options.cuda_device;
  nccl.timeout = timeout;
  nccl.compute_stream = options.compute_stream;
  nccl.members = std::move(members);
  return CreateNcclGroup(store, rank, size, nccl);
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> StageThroughHost(ProcessGroup* inner,
                                                               const CommunicatorOptions& options) {
  StagedOptions staged;
  staged.device = options.cuda_device;
  staged.compute_stream = options.compute_stream;
  return CreateHostStagedGroup(inner, staged);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Connect(
    const WorldInfo& world, const CommunicatorOptions& options) {
  std::unique_ptr<Communicator> comm(new Communicator());
  comm->world_ = world;
  comm->local_address_ =
      !world.local_addr.empty() ? world.local_addr : LocalAddressToward(world.master_addr);
  GlooOptions gloo;
  gloo.address = comm->local_address_;
  gloo.timeout = world.comm_timeout.value_or(options.timeout);
  gloo.members.name = kWorldGroupName;  // group rank == global rank
  comm->timeout_ = gloo.timeout;
  comm->options_ = options;

  if (world.world_size == 1) {
    comm->store_ = std::make_unique<rdzv::InMemoryStore>();
  } else {
    rdzv::ClientOptions client;
    client.endpoint = world.rdzv_endpoint;
    client.token_file = world.token_file;
    client.tls_ca_file = world.tls_ca;
    client.tls_cert_file = world.tls_cert;
    client.tls_key_file = world.tls_key;
    client.job_secret_file = world.job_secret_file;
    absl::StatusOr<std::unique_ptr<rdzv::Client>> connected = rdzv::Client::Connect(client);
    if (!connected.ok()) return connected.status();
    comm->client_ = *std::move(connected);
    comm->store_ =
        std::make_unique<rdzv::RemoteStore>(comm->client_.get(), world.job_id, world.round);
  }
  comm->scoped_store_ = std::make_unique<rdzv::PrefixStore>(comm->store_.get(), options.key_prefix);
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
      CreateGlooGroup(comm->scoped_store_.get(), world.rank, world.world_size, gloo);
  if (!group.ok()) {
    return absl::Status(
        group.status().code(),
        absl::StrCat("joining the process group of job '", world.job_id, "' round ", world.round,
                     " at ", comm->local_address_, ": ", group.status().message()));
  }
  comm->group_ = *std::move(group);

  const std::string where = absl::StrCat("rank ", world.rank, " of ", world.world_size);
  switch (options.data_backend) {
    case DataBackend::kGloo:
      break;
    case DataBackend::kNccl: {
      comm->nccl_store_ = std::make_unique<rdzv::PrefixStore>(comm->store_.get(), "nccl");
      absl::StatusOr<std::unique_ptr<ProcessGroup>> made =
          ConnectNccl(comm->nccl_store_.get(), world.rank, world.world_size, options, gloo.timeout,
                      GroupMembers{kWorldNcclGroupName, {}});
      if (!made.ok()) {
        return absl::Status(made.status().code(),
                            absl::StrCat(where, ": creating the NCCL communicator on CUDA device ",
                                         options.cuda_device, ": ", made.status().message()));
      }
      comm->data_group_ = *std::move(made);
      break;
    }
    case DataBackend::kStagedGloo: {
      absl::StatusOr<std::unique_ptr<ProcessGroup>> made =
          StageThroughHost(comm->group_.get(), options);
      if (!made.ok()) {
        return absl::Status(
            made.status().code(),
            absl::StrCat(where, ": staging Gloo through host memory: ", made.status().message()));
      }
      comm->data_group_ = *std::move(made);
      comm->data_group_owns_group_ = true;
      break;
    }
  }

  if (comm->client_ != nullptr) {
    std::vector<ProcessGroup*> groups = {comm->group_.get()};
    if (comm->data_group_ != nullptr) groups.push_back(comm->data_group_.get());
    Communicator* self = comm.get();
    comm->watchdog_ = std::make_unique<Watchdog>(
        std::move(groups),
        [self, job = world.job_id, round = world.round] {
          return RoundStatus(self->round_watcher_->latest(), job, round);
        },
        options.on_stuck, options.watchdog);
    // Every state the server pushes wakes the watchdog, so a round's end
    // is acted on as soon as it is known, not at the next interval.
    comm->round_watcher_ = std::make_unique<rdzv::JobWatcher>(
        comm->client_.get(), world.job_id,
        [self](const rdzv::pb::JobState&) { self->watchdog_->Wake(); });
    comm->watchdog_->Start();
  }
  return comm;
}

absl::Status RoundStatus(const std::optional<rdzv::pb::JobState>& latest, const std::string& job_id,
                         uint64_t round) {
  if (!latest.has_value()) return absl::OkStatus();
  if (latest->round() == round && latest->phase() == rdzv::pb::RUNNING) return absl::OkStatus();
  std::string reason = rdzv::pb::RoundEndReason_Name(latest->last_end_reason());
  // The failure that ended it, when a member reported one for our round.
  for (auto failure = latest->failures().rbegin(); failure != latest->failures().rend();
       ++failure) {
    if (failure->round() != round) continue;
    // A lapsed lease is recorded as a failure with no exit code.
    if (failure->exit_code() >= 0) {
      absl::StrAppend(&reason, ": member ", failure->member_id(), " exited ", failure->exit_code(),
                      failure->message().empty() ? "" : absl::StrCat(", ", failure->message()));
    } else if (!failure->message().empty()) {
      absl::StrAppend(&reason, ": ", failure->message());
    }
    break;
  }
  if (latest->round() != round) {
    return absl::AbortedError(absl::StrCat("rendezvous round ", round, " of job '", job_id,
                                           "' ended (", reason, "); the job is now at round ",
                                           latest->round(), ", ",
                                           rdzv::pb::Phase_Name(latest->phase())));
  }
  return absl::AbortedError(absl::StrCat("rendezvous round ", round, " of job '", job_id,
                                         "' ended: the job is ",
                                         rdzv::pb::Phase_Name(latest->phase()), " (", reason, ")"));
}

absl::StatusOr<ProcessGroup*> Communicator::NewGroup(const std::string& name,
                                                     const std::vector<int>& ranks) {
  return CreateSubGroup(name, ranks, DataBackend::kGloo);
}

absl::StatusOr<ProcessGroup*> Communicator::NewDataGroup(const std::string& name,
                                                         const std::vector<int>& ranks) {
  return CreateSubGroup(name, ranks, options_.data_backend);
}

absl::StatusOr<ProcessGroup*> Communicator::CreateSubGroup(const std::string& name,
                                                           const std::vector<int>& ranks,
                                                           DataBackend backend) {
  const std::string listed = absl::StrCat("[", absl::StrJoin(ranks, ","), "]");
  const std::string where = absl::StrCat("rank ", world_.rank, " of ", world_.world_size,
                                         ": creating group '", name, "' of ranks ", listed);
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the name is empty"));
  }
  int group_rank = -1;
  std::set<int> seen;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= world_.world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": rank ", ranks[i], " is outside the world [0, ", world_.world_size, ")"));
    }
    if (!seen.insert(ranks[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": rank ", ranks[i], " is listed twice"));
    }
    if (ranks[i] == world_.rank) group_rank = static_cast<int>(i);
  }
  if (group_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": this rank is not a member; only the members create a group"));
  }
  {
    absl::MutexLock lock(&sub_groups_mu_);
    if (!sub_groups_.emplace(name, SubGroup{}).second) {
      return absl::AlreadyExistsError(
          absl::StrCat(where, ": a group of that name was created already"));
    }
  }

  const int size = static_cast<int>(ranks.size());
  // Its messages name it and its members' global ranks.
  const GroupMembers members{name, ranks};
  rdzv::PrefixStore store(store_.get(), absl::StrCat("group/", name));
  if (size > 1) {
    // Two layouts that name different groups alike would otherwise wait
    // for each other until the timeout: the first member to get here
    // records the ranks, the others compare.
    absl::StatusOr<rdzv::Store::CasResult> recorded =
        store.CompareAndSet("members", std::nullopt, listed);
    if (!recorded.ok()) {
      return absl::Status(recorded.status().code(),
                          absl::StrCat(where, ": ", recorded.status().message()));
    }
    if (!recorded->swapped && recorded->value != listed) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ", but another member created it with ranks ", recorded->value));
    }
  }
  SubGroup made;
  if (backend == DataBackend::kNccl) {
    rdzv::PrefixStore nccl_store(store_.get(), absl::StrCat("nccl-group/", name));
    absl::StatusOr<std::unique_ptr<ProcessGroup>> connected =
        ConnectNccl(&nccl_store, group_rank, size, options_, timeout_, members);
    if (!connected.ok()) {
      return absl::Status(connected.status().code(),
                          absl::StrCat(where, " over NCCL: ", connected.status().message()));
    }
    made.group = *std::move(connected);
  } else if (size == 1) {
    made.group = CreateSelfGroup(timeout_, members);
  } else {
    GlooOptions gloo;
    gloo.address = local_address_;
    gloo.timeout = timeout_;
    gloo.members = members;
    absl::StatusOr<std::unique_ptr<ProcessGroup>> connected =
        CreateGlooGroup(&store, group_rank, size, gloo);
    if (!connected.ok()) {
      return absl::Status(connected.status().code(),
                          absl::StrCat(where, ": ", connected.status().message()));
    }
    made.group = *std::move(connected);
  }
  if (backend == DataBackend::kStagedGloo) {
    absl::StatusOr<std::unique_ptr<ProcessGroup>> wrapped =
        StageThroughHost(made.group.get(), options_);
    if (!wrapped.ok()) {
      return absl::Status(
          wrapped.status().code(),
          absl::StrCat(where, ": staging it through host memory: ", wrapped.status().message()));
    }
    made.inner = std::move(made.group);
    made.group = *std::move(wrapped);
  }
  ProcessGroup* group = made.group.get();
  ProcessGroup* inner = made.inner.get();
  {
    absl::MutexLock lock(&sub_groups_mu_);
    sub_groups_[name] = std::move(made);
  }
  if (watchdog_ != nullptr) {
    watchdog_->Watch(group);
    if (inner != nullptr) watchdog_->Watch(inner);
  }
  return group;
}

Communicator::~Communicator() {
  // The watcher's callback wakes the watchdog and the watchdog's probe
  // reads the watcher: stop the stream, then the watchdog, then the rest.
  if (round_watcher_ != nullptr) round_watcher_->Stop();
  watchdog_.reset();
  round_watcher_.reset();
  {
    absl::MutexLock lock(&sub_groups_mu_);
    sub_groups_.clear();
  }
  data_group_.reset();  // may wrap group_
  group_.reset();
}

}  // namespace muster::parallel
