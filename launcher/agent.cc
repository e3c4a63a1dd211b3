#include "launcher/agent.h"

#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "launcher/endpoint.h"
#include "launcher/workers.h"
#include "rendezvous/client.h"
#include "rendezvous/store.h"
#include "spdlog/spdlog.h"

namespace muster::launcher {
namespace {

namespace pb = ::muster::rendezvous::v1;
using rdzv::Client;

constexpr char kMasterPortKey[] = "muster/master_port";

// Wakes the main loop from the watcher's thread.
class EventFd {
 public:
  EventFd() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  ~EventFd() { close(fd_); }
  int fd() const { return fd_; }
  void Poke() {
    uint64_t one = 1;
    ssize_t ignored = write(fd_, &one, sizeof(one));
    (void)ignored;
  }
  void Drain() {
    uint64_t count;
    ssize_t ignored = read(fd_, &count, sizeof(count));
    (void)ignored;
  }

 private:
  int fd_;
};

// Exit code for a job that reached a terminal phase.
int ExitCodeFor(const pb::JobState& state) {
  switch (state.phase()) {
    case pb::SUCCEEDED:
      return 0;
    case pb::FAILED: {
      spdlog::error("job {} failed: {}", state.job_id(), state.status_message());
      // The failure that spent the budget is the newest one.
      if (state.failures_size() > 0) {
        int code = state.failures(state.failures_size() - 1).exit_code();
        return code > 0 ? code : 1;
      }
      return 1;
    }
    default:
      spdlog::error("job {} was closed: {}", state.job_id(), state.status_message());
      return 1;
  }
}

bool ReadSignal(int signal_fd, int* signal_number) {
  signalfd_siginfo info;
  if (read(signal_fd, &info, sizeof(info)) != sizeof(info)) return false;
  *signal_number = static_cast<int>(info.ssi_signo);
  return true;
}

// What ended one attempt.
enum class Outcome { kRejoin, kExit };

class Agent {
 public:
  Agent(const LaunchOptions& options, const std::map<std::string, std::string>& env,
        int signal_fd, RendezvousSetup setup)
      : options_(options), env_(env), signal_fd_(signal_fd), setup_(std::move(setup)) {}

  int Run();

 private:
  Outcome RunAttempt(const rdzv::RoundAssignment& assignment);
  absl::StatusOr<int> MasterPort(const rdzv::RoundAssignment& assignment);
  // Waits for the round a first join put us in. nullopt if it formed
  // without us or the job ended: the joining loop handles both.
  std::optional<rdzv::RoundAssignment> AwaitJoinedRound(uint64_t round, int64_t lease_ttl_ms);
  Outcome ForwardSignal(WorkerGroup& group, int signal_number);

  const LaunchOptions& options_;
  const std::map<std::string, std::string>& env_;
  const int signal_fd_;
  RendezvousSetup setup_;
  LogPump pump_;
  EventFd wake_;
  std::unique_ptr<rdzv::JobWatcher> watcher_;
  std::unique_ptr<rdzv::LeaseKeeper> keeper_;
  std::vector<std::string> command_;
  std::string member_id_;
  int attempt_ = 0;
  int exit_code_ = 0;
};

int Agent::Run() {
  absl::StatusOr<std::vector<std::string>> command = WorkerCommand(options_, env_);
  if (!command.ok()) {
    spdlog::error("{}", command.status().ToString());
    return 2;
  }
  command_ = *std::move(command);
  Client& client = *setup_.client;
  pb::JoinRequest join = setup_.join;
  // The first join creates the job if needed, so the watch that follows
  // finds it. Later joins name our member id and keep our place.
  rdzv::CallOptions first_join;
  first_join.timeout = options_.rdzv_conf.join_timeout;
  absl::StatusOr<pb::JoinResponse> joined = client.Join(join, first_join);
  if (!joined.ok()) {
    spdlog::error("cannot join job {}: {}", setup_.job_id, joined.status().ToString());
    return absl::IsFailedPrecondition(joined.status()) || absl::IsInvalidArgument(joined.status())
               ? 2
               : 1;
  }
  member_id_ = joined->member_id();
  keeper_ = std::make_unique<rdzv::LeaseKeeper>(&client, setup_.job_id, member_id_,
                                                absl::Milliseconds(joined->lease_ttl_ms()));
  watcher_ = std::make_unique<rdzv::JobWatcher>(&client, setup_.job_id,
                                                [this](const pb::JobState&) { wake_.Poke(); });
  // The round we joined may form without another join from us.
  std::optional<rdzv::RoundAssignment> first =
      AwaitJoinedRound(joined->round(), joined->lease_ttl_ms());
  for (;;) {
    join.set_member_id(member_id_);
    absl::Time deadline = absl::Now() + options_.rdzv_conf.join_timeout;
    absl::StatusOr<rdzv::RoundAssignment> assignment =
        first.has_value() ? *std::move(first)
                          : rdzv::JoinAndWaitForRound(client, join, watcher_.get(), deadline);
    first.reset();
    if (!assignment.ok()) {
      std::optional<pb::JobState> latest = watcher_->latest();
      if (latest.has_value() && rdzv::IsTerminalPhase(latest->phase())) {
        return ExitCodeFor(*latest);
      }
      spdlog::error("rendezvous for job {} failed: {}", setup_.job_id,
                    assignment.status().ToString());
      return absl::IsUnavailable(assignment.status()) ||
                     absl::IsPermissionDenied(assignment.status()) ||
                     absl::IsUnauthenticated(assignment.status())
                 ? 2
                 : 1;
    }
    Outcome outcome = RunAttempt(*assignment);
    // The workers are gone; let the pump write what they left in the pipes
    // (bounded: a worker's orphaned child may hold a pipe open).
    pump_.WaitDrained(absl::Seconds(2));
    if (outcome == Outcome::kExit) return exit_code_;
    ++attempt_;
  }
}

std::optional<rdzv::RoundAssignment> Agent::AwaitJoinedRound(uint64_t round,
                                                             int64_t lease_ttl_ms) {
  auto self_in = [this](const pb::JobState& state) -> const pb::Member* {
    for (const pb::Member& member : state.members()) {
      if (member.member_id() == member_id_) return &member;
    }
    return nullptr;
  };
  absl::StatusOr<pb::JobState> state = watcher_->WaitFor(
      [&](const pb::JobState& s) {
        return rdzv::IsTerminalPhase(s.phase()) || s.round() > round ||
               (s.phase() == pb::RUNNING && self_in(s) != nullptr);
      },
      absl::Now() + options_.rdzv_conf.join_timeout);
  if (!state.ok() || state->phase() != pb::RUNNING || state->round() != round ||
      self_in(*state) == nullptr) {
    return std::nullopt;  // the joining loop sorts it out
  }
  rdzv::RoundAssignment assignment;
  assignment.member_id = member_id_;
  assignment.lease_ttl_ms = lease_ttl_ms;
  assignment.self = *self_in(*state);
  assignment.state = *std::move(state);
  return assignment;
}

absl::StatusOr<int> Agent::MasterPort(const rdzv::RoundAssignment& assignment) {
  rdzv::RemoteStore store(setup_.client.get(), setup_.job_id, assignment.state.round());
  if (assignment.self.group_rank() == 0) {
    absl::StatusOr<int> port = PickFreePort();
    if (!port.ok()) return port.status();
    absl::Status status = store.Set(kMasterPortKey, absl::StrCat(*port));
    if (!status.ok()) return status;
    return *port;
  }
  absl::StatusOr<std::string> text = store.Get(kMasterPortKey, options_.rdzv_conf.join_timeout);
  if (!text.ok()) return text.status();
  int port = 0;
  if (!absl::SimpleAtoi(*text, &port)) {
    return absl::DataLossError(absl::StrCat("bad master port in the round's store: ", *text));
  }
  return port;
}

Outcome Agent::ForwardSignal(WorkerGroup& group, int signal_number) {
  spdlog::warn("got signal {}; stopping workers", signal_number);
  group.Stop(options_.shutdown_timeout, signal_number);
  keeper_->Stop();
  pb::LeaveRequest leave;
  leave.set_job_id(setup_.job_id);
  leave.set_member_id(member_id_);
  rdzv::CallOptions call;
  call.timeout = absl::Seconds(5);
  setup_.client->Leave(leave, call).IgnoreError();  // best effort: the lease lapses anyway
  exit_code_ = 128 + signal_number;
  return Outcome::kExit;
}

Outcome Agent::RunAttempt(const rdzv::RoundAssignment& assignment) {
  const pb::JobState& state = assignment.state;
  const uint64_t round = state.round();
  absl::StatusOr<int> master_port = MasterPort(assignment);
  if (!master_port.ok()) {
    if (absl::IsAborted(master_port.status())) return Outcome::kRejoin;  // round ended
    spdlog::error("cannot agree on MASTER_PORT: {}", master_port.status().ToString());
    exit_code_ = 1;
    return Outcome::kExit;
  }

  WorkerGroupSpec spec;
  spec.command = command_;
  spec.base_env = env_;
  spec.round.round = round;
  spec.round.group_rank = assignment.self.group_rank();
  spec.round.group_world_size = state.members_size();
  spec.round.rank_offset = static_cast<int>(assignment.self.rank_offset());
  spec.round.local_world_size = static_cast<int>(assignment.self.nproc());
  spec.round.world_size = static_cast<int>(state.world_size());
  spec.round.master_addr = state.members(0).address();
  spec.round.master_port = *master_port;
  spec.round.restart_count = state.restart_count();
  spec.round.max_restarts = options_.max_restarts;
  spec.round.run_id = setup_.job_id;
  spec.round.role = options_.role;
  spec.access = setup_.access;
  spec.attempt_dir = absl::StrCat(setup_.log_root, "/attempt_", attempt_);
  spec.host = setup_.hostname;
  spec.redirects = options_.redirects;
  spec.tee = options_.tee;
  spec.local_ranks_filter = options_.local_ranks_filter;
  spdlog::info("round {}: node {} of {}, ranks {}..{} of {}, master {}:{}", round,
               spec.round.group_rank, spec.round.group_world_size, spec.round.rank_offset,
               spec.round.rank_offset + spec.round.local_world_size - 1, spec.round.world_size,
               spec.round.master_addr, spec.round.master_port);

  absl::StatusOr<std::unique_ptr<WorkerGroup>> started = WorkerGroup::Start(spec, &pump_);
  if (!started.ok()) {
    spdlog::error("cannot start workers: {}", started.status().ToString());
    exit_code_ = 2;
    return Outcome::kExit;
  }
  WorkerGroup& group = **started;
  Client& client = *setup_.client;

  for (;;) {
    std::vector<pollfd> fds = {{signal_fd_, POLLIN, 0}, {wake_.fd(), POLLIN, 0}};
    for (int pidfd : group.RunningPidfds()) fds.push_back(pollfd{pidfd, POLLIN, 0});
    int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(options_.monitor_interval));
    // Worker exits, signals and job changes all arrive as events; the
    // timeout is a backstop for the lease keeper's status.
    poll(fds.data(), fds.size(), std::max(timeout_ms, 1));
    if (fds[0].revents & POLLIN) {
      int signal_number = 0;
      if (ReadSignal(signal_fd_, &signal_number)) return ForwardSignal(group, signal_number);
    }
    if (fds[1].revents & POLLIN) wake_.Drain();

    group.Reap();
    if (!group.failures().empty()) {
      group.Stop(options_.shutdown_timeout, SIGTERM);
      // A worker's watchdog leaves a round that ended elsewhere as soon as
      // the server says so, often before this loop hears of it: that is
      // the round's end, not a failure of this node.
      std::optional<pb::JobState> now = watcher_->latest();
      if (now.has_value() && (now->round() != round || now->phase() != pb::RUNNING)) {
        spdlog::info("round {} ended ({}); this node's workers left it", round,
                     pb::RoundEndReason_Name(now->last_end_reason()));
        if (rdzv::IsTerminalPhase(now->phase())) {
          exit_code_ = ExitCodeFor(*now);
          return Outcome::kExit;
        }
        return Outcome::kRejoin;
      }
      const WorkerFailure& first = group.failures().front();
      std::fprintf(stderr, "workers failed on %s in round %lu:\n%s", setup_.hostname.c_str(),
                   static_cast<unsigned long>(round),
                   FormatFailureTable(group.failures()).c_str());
      pb::ReportFailureRequest report;
      report.set_job_id(setup_.job_id);
      report.set_round(round);
      report.set_member_id(member_id_);
      report.set_exit_code(first.exit.ShellCode());
      report.set_message(first.message);
      absl::StatusOr<pb::ReportFailureResponse> reported = client.ReportFailure(report);
      if (!reported.ok() && !absl::IsAborted(reported.status()) &&
          !absl::IsFailedPrecondition(reported.status())) {
        spdlog::warn("could not report the failure: {}", reported.status().ToString());
      }
      return Outcome::kRejoin;
    }
    if (group.running() == 0 && group.all_succeeded()) {
      pb::ReportDoneRequest done;
      done.set_job_id(setup_.job_id);
      done.set_round(round);
      done.set_member_id(member_id_);
      client.ReportDone(done).IgnoreError();  // the watcher tells what happened next
      absl::StatusOr<pb::JobState> next = watcher_->WaitFor(
          [&](const pb::JobState& s) {
            return rdzv::IsTerminalPhase(s.phase()) || s.round() != round;
          },
          absl::Now() + options_.rdzv_conf.close_timeout);
      if (!next.ok()) {
        spdlog::warn("this node's workers succeeded, but the job did not close within {}",
                     absl::FormatDuration(options_.rdzv_conf.close_timeout));
        exit_code_ = 0;
        return Outcome::kExit;
      }
      if (rdzv::IsTerminalPhase(next->phase())) {
        exit_code_ = ExitCodeFor(*next);
        return Outcome::kExit;
      }
      return Outcome::kRejoin;  // another node failed after ours finished
    }

    std::optional<pb::JobState> latest = watcher_->latest();
    if (latest.has_value()) {
      bool round_over = latest->round() != round || latest->phase() != pb::RUNNING;
      bool can_grow = latest->nodes_waiting() > 0 &&
                      latest->members_size() < static_cast<int>(latest->config().max_nodes());
      if (round_over || can_grow) {
        if (round_over) {
          spdlog::info("round {} ended ({}); stopping workers", round,
                       pb::RoundEndReason_Name(latest->last_end_reason()));
        } else {
          spdlog::info("round {}: {} node(s) waiting; restarting to admit them", round,
                       latest->nodes_waiting());
        }
        group.Stop(options_.shutdown_timeout, SIGTERM);
        if (rdzv::IsTerminalPhase(latest->phase())) {
          exit_code_ = ExitCodeFor(*latest);
          return Outcome::kExit;
        }
        return Outcome::kRejoin;
      }
    }
    if (absl::Status lease = keeper_->status(); !lease.ok()) {
      spdlog::error("lost the rendezvous lease: {}", lease.ToString());
      group.Stop(options_.shutdown_timeout, SIGTERM);
      exit_code_ = 1;
      return Outcome::kExit;
    }
  }
}

}  // namespace

int RunAgent(const LaunchOptions& options, const std::map<std::string, std::string>& env,
             int signal_fd) {
  absl::StatusOr<RendezvousSetup> setup = SetUpRendezvous(options);
  if (!setup.ok()) {
    spdlog::error("{}", std::string(setup.status().message()));
    return 2;
  }
  Agent agent(options, env, signal_fd, *std::move(setup));
  return agent.Run();
}

}  // namespace muster::launcher
