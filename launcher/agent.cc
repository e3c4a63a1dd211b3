#include "launcher/agent.h"

#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "launcher/endpoint.h"
#include "launcher/signal_watch.h"
#include "launcher/workers.h"
#include "rendezvous/client/client.h"
#include "rendezvous/client/store.h"
#include "spdlog/spdlog.h"

namespace muster::launcher {
namespace {

namespace pb = ::muster::rendezvous::v1;
using rdzv::Client;

constexpr char kMasterPortKey[] = "muster/master_port";
// Leaving is best effort: if the service does not answer within this, the
// lease lapses instead.
constexpr absl::Duration kLeaveTimeout = absl::Seconds(1);
// How long workers get to exit on their own after another node left the
// round (at most --shutdown_timeout), before they are signalled.
constexpr absl::Duration kOwnExitWait = absl::Seconds(5);
// Joins as a new node that may follow each other with no round between
// (the server forgetting this node again at once) before the agent gives up.
constexpr int kMaxJoinsWithoutARound = 3;
// What a preempted agent keeps of its grace to exit after leaving.
constexpr absl::Duration kExitMargin = absl::Seconds(2);

// The signals a scheduler preempts with: the workers get --preempt_grace
// to save their state. Other handled signals (an operator's SIGINT) get
// --shutdown_timeout.
bool IsPreemptionSignal(int signal_number) {
  return signal_number == SIGTERM || signal_number == SIGUSR1;
}

std::string SignalName(int signal_number) {
  const char* name = sigabbrev_np(signal_number);
  return name != nullptr ? absl::StrCat("SIG", name) : absl::StrCat("signal ", signal_number);
}

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

// Why a round ended, for the log: the server's reason, or, for a job that
// ended with no round-end reason (closed by an administrator), its phase
// and message.
std::string RoundEndCause(const pb::JobState& state) {
  if (state.last_end_reason() == pb::END_REASON_UNSPECIFIED &&
      rdzv::IsTerminalPhase(state.phase())) {
    return absl::StrCat("job ", pb::Phase_Name(state.phase()),
                        state.status_message().empty() ? "" : ": ", state.status_message());
  }
  return pb::RoundEndReason_Name(state.last_end_reason());
}

// Exit code for a job that reached a terminal phase.
int ExitCodeFor(const pb::JobState& state) {
  switch (state.phase()) {
    case pb::SUCCEEDED:
      spdlog::info("job {} succeeded", state.job_id());
      return 0;
    case pb::FAILED: {
      spdlog::error("job {} failed: {}", state.job_id(), state.status_message());
      // The failure that spent the budget is the newest one.
      if (state.failures_size() > 0) {
        int code = state.failures(state.failures_size() - 1).exit_code();
        // A failed job is not one to requeue: 75 says "preempted" to a
        // scheduler.
        return code > 0 && code != kPreemptedExitCode ? code : 1;
      }
      return 1;
    }
    default:
      spdlog::error("job {} was closed: {}", state.job_id(), state.status_message());
      return 1;
  }
}

// What ended one attempt.
// kJoinAgain: the server forgot this node (its lease lapsed while the agent
// was paused or cut off); it joins again as a new node.
enum class Outcome { kRejoin, kJoinAgain, kExit };

class Agent {
 public:
  Agent(const LaunchOptions& options, const std::map<std::string, std::string>& env,
        SignalWatch* signals, RendezvousSetup setup)
      : options_(options), env_(env), signals_(*signals), setup_(std::move(setup)) {}
  ~Agent() { signals_.Watch(nullptr); }  // before the watcher goes

  int Run();
  // After Run: a job that failed is reported in the TORCHELASTIC_ERROR_FILE
  // that whoever runs launch set (failures.h, ParentErrorReport): this
  // node's last worker failure, or the job's status when it failed
  // elsewhere.
  void WriteParentErrorFile(int code);

 private:
  Outcome RunAttempt(const rdzv::RoundAssignment& assignment);
  absl::StatusOr<int> MasterPort(const rdzv::RoundAssignment& assignment);
  // Waits for the round a first join put us in. nullopt if it formed
  // without us or the job ended: the joining loop handles both.
  std::optional<rdzv::RoundAssignment> AwaitJoinedRound(uint64_t round, int64_t lease_ttl_ms);
  // Joins as a new member (`join` without a member id): sets member_id_,
  // starts the lease keeper (and the watcher, the first time), and returns
  // the round joined when it formed at once. On failure, the agent's exit
  // code.
  absl::StatusOr<std::optional<rdzv::RoundAssignment>> JoinAsNewMember(pb::JoinRequest join);
  // A signal came while the workers ran: forward it, give them the grace
  // (preemption) or the shutdown timeout, leave, and pick the exit code.
  Outcome StopForSignal(WorkerGroup& group, int signal_number, uint64_t round);
  // After `signal_number` was forwarded and the workers are gone: exit
  // kPreemptedExitCode if they all saved their state, else 128+signal. If
  // they all exited 0 (the signal came as they finished), report this
  // node done in `round` and exit as ExitForSignalWhenDone says.
  Outcome FinishPreemption(const WorkerGroup& group, int signal_number, uint64_t round);
  // Tells the service this node's workers succeeded in `round`.
  void ReportDone(uint64_t round);
  // A signal came while no worker ran (`waiting_for` names the wait):
  // leave and return kPreemptedExitCode for a preemption signal (nothing
  // runs here, so nothing is unsaved), else 128+signal.
  int ExitForSignal(const char* waiting_for);
  // A signal came after this node's workers succeeded, while the job had
  // not closed: leave and return the job's code if it closed meanwhile, 0
  // for a preemption signal (see agent.h), else 128+signal.
  // `when` says when the signal came ("while waiting for the job to
  // close").
  int ExitForSignalWhenDone(const char* when);
  // Stops renewing and leaves the job: once, or, for a preemption (leave_retry_until_ set),
  // again while the service is unreachable until shortly before the grace
  // ends.
  void LeaveRendezvous();
  // A worker saved its state and exited kPreemptedExitCode on its own: the
  // scheduler signalled it (or a rank elsewhere was preempted, and every
  // rank stopped after the same step) before or instead of this agent. That
  // is this node's preemption, not a failure to restart from: the other
  // workers are stopped with the grace, and the agent exits 75.
  std::optional<Outcome> PreemptIfAWorkerSaved(WorkerGroup& group, uint64_t round);
  // When the grace of a preemption being handled ends; InfinitePast when
  // none is.
  absl::Time leave_retry_until_ = absl::InfinitePast();

  const LaunchOptions& options_;
  const std::map<std::string, std::string>& env_;
  SignalWatch& signals_;
  RendezvousSetup setup_;
  LogPump pump_;
  EventFd wake_;
  std::unique_ptr<rdzv::JobWatcher> watcher_;
  std::unique_ptr<rdzv::LeaseKeeper> keeper_;
  std::vector<std::string> command_;
  std::string member_id_;
  int attempt_ = 0;
  int exit_code_ = 0;
  // The last failure of this node's workers: the worker's error file and a
  // line, for the agent's own TORCHELASTIC_ERROR_FILE (WriteParentErrorFile).
  uint64_t failure_round_ = 0;
  std::string failure_error_file_;
  std::string failure_message_;
};

// Whether `dir` holds a regular file anywhere below it (a log or an error
// report).
bool HoldsAFile(const std::filesystem::path& dir) {
  std::error_code error;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, error);
       !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
    if (it->is_regular_file(error)) return true;
  }
  return false;
}

// The attempt number after the last one in `log_root` that holds a file: a
// rerun with the same --log_dir and run id appends to none of an earlier
// run's files and overwrites none of them (torchrun makes a fresh directory
// for every run instead; this keeps the documented layout).
int FirstUnusedAttempt(const std::string& log_root) {
  int next = 0;
  std::error_code error;
  for (auto it = std::filesystem::directory_iterator(log_root, error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename().string();
    int number = 0;
    if (absl::StartsWith(name, "attempt_") &&
        absl::SimpleAtoi(absl::StripPrefix(name, "attempt_"), &number) && number >= next &&
        HoldsAFile(it->path())) {
      next = number + 1;
    }
  }
  return next;
}

int Agent::Run() {
  attempt_ = FirstUnusedAttempt(setup_.log_root);
  absl::StatusOr<std::vector<std::string>> command = WorkerCommand(options_, env_);
  if (!command.ok()) {
    spdlog::error("{}", command.status().ToString());
    return 2;
  }
  command_ = *std::move(command);
  Client& client = *setup_.client;
  pb::JoinRequest join = setup_.join;
  absl::StatusOr<std::optional<rdzv::RoundAssignment>> joined = JoinAsNewMember(join);
  if (!joined.ok()) return exit_code_;
  std::optional<rdzv::RoundAssignment> first = *std::move(joined);
  int joins_without_a_round = 0;  // joins as a new node since the last round
  for (;;) {
    if (signals_.received() != 0) return ExitForSignal("waiting for a round");
    join.set_member_id(member_id_);
    absl::Time deadline = absl::Now() + options_.rdzv_conf.join_timeout;
    absl::StatusOr<rdzv::RoundAssignment> assignment =
        first.has_value() ? *std::move(first)
                          : rdzv::JoinAndWaitForRound(client, join, watcher_.get(), deadline);
    first.reset();
    if (!assignment.ok()) {
      if (signals_.received() != 0) return ExitForSignal("waiting for a round");
      std::optional<pb::JobState> latest = watcher_->latest();
      if (absl::IsNotFound(assignment.status()) &&
          (!latest.has_value() || !rdzv::IsTerminalPhase(latest->phase())) &&
          ++joins_without_a_round <= kMaxJoinsWithoutARound) {
        // The server forgot us (the lease lapsed while this agent was
        // paused or cut off): join again as a new node, as a node that
        // was never here would.
        spdlog::warn("job {} no longer has this node ({}); joining it again as a new node",
                     setup_.job_id, assignment.status().ToString());
        joined = JoinAsNewMember(join);
        if (!joined.ok()) return exit_code_;
        first = *std::move(joined);
        continue;
      }
      if (absl::IsDeadlineExceeded(assignment.status()) && absl::Now() >= deadline &&
          latest.has_value() && !rdzv::IsTerminalPhase(latest->phase())) {
        // This agent's own wait ran out, and the service still answers for
        // a job that is alive. The service decides when a round has taken
        // too long (join_timeout from when the job began to gather; it then
        // fails the job, and this loop exits with its reason): a spare
        // waits as long as the job runs without it, and a node carried
        // over a preemption as long as the requeue takes. So wait again.
        spdlog::info("still waiting for a round of job {} (it is {} round {})", setup_.job_id,
                     pb::Phase_Name(latest->phase()), latest->round());
        continue;
      }
      if ((!latest.has_value() || !rdzv::IsTerminalPhase(latest->phase())) &&
          absl::IsFailedPrecondition(assignment.status())) {
        // The join saw the job closed before the watch stream delivered the
        // terminal state; that state carries the exit code (a config error's
        // 2), so wait a moment for it.
        absl::StatusOr<pb::JobState> terminal = watcher_->WaitFor(
            [](const pb::JobState& state) { return rdzv::IsTerminalPhase(state.phase()); },
            absl::Now() + absl::Seconds(5));
        if (terminal.ok()) latest = *terminal;
      }
      if (latest.has_value() && rdzv::IsTerminalPhase(latest->phase())) {
        if (latest->phase() == pb::SUCCEEDED) {
          spdlog::info("this node waited as a spare and ran no worker in the job's last round");
        }
        return ExitCodeFor(*latest);
      }
      if (absl::IsDeadlineExceeded(assignment.status())) {
        spdlog::error("the rendezvous service did not answer for job {} in time: {}", setup_.job_id,
                      assignment.status().ToString());
      } else {
        spdlog::error("rendezvous for job {} failed: {}", setup_.job_id,
                      assignment.status().ToString());
      }
      return absl::IsUnavailable(assignment.status()) ||
                     absl::IsPermissionDenied(assignment.status()) ||
                     absl::IsUnauthenticated(assignment.status())
                 ? 2
                 : 1;
    }
    joins_without_a_round = 0;
    Outcome outcome = RunAttempt(*assignment);
    // The workers are gone; let the pump write what they left in the pipes
    // (bounded: a worker's orphaned child may hold a pipe open).
    pump_.WaitDrained(absl::Seconds(2));
    if (outcome == Outcome::kExit) return exit_code_;
    ++attempt_;
    if (outcome == Outcome::kJoinAgain) {
      joined = JoinAsNewMember(join);
      if (!joined.ok()) return exit_code_;
      first = *std::move(joined);
    }
  }
}

absl::StatusOr<std::optional<rdzv::RoundAssignment>> Agent::JoinAsNewMember(pb::JoinRequest join) {
  Client& client = *setup_.client;
  // The first join creates the job if needed, so the watch that follows
  // finds it. Later joins name our member id and keep our place.
  join.clear_member_id();
  if (keeper_ != nullptr) keeper_->Stop();
  rdzv::CallOptions first_join;
  first_join.timeout = options_.rdzv_conf.join_timeout;
  first_join.cancellation = signals_.cancellation();
  // A service that answers UNAVAILABLE (it could not make the join durable:
  // a full disk; or it is shutting down) may take it a moment later; the
  // change was undone, so a retry is a join like the first. Counted from
  // the first try: one that waited out an unreachable service is not tried
  // again.
  const absl::Time retry_until =
      absl::Now() + std::min(options_.rdzv_conf.join_timeout, absl::Seconds(30));
  absl::StatusOr<pb::JoinResponse> joined = client.Join(join, first_join);
  for (absl::Duration backoff = absl::Milliseconds(200);
       absl::IsUnavailable(joined.status()) && signals_.received() == 0 &&
       absl::Now() + backoff < retry_until;
       backoff = std::min(backoff * 2, absl::Seconds(2))) {
    spdlog::warn("cannot join job {} yet ({}); trying again", setup_.job_id,
                 joined.status().ToString());
    absl::SleepFor(backoff);  // a retry's backoff: no event tells when the service can
    joined = client.Join(join, first_join);
  }
  if (!joined.ok()) {
    // Not a member we know of: if the join got through, the lease lapses.
    if (signals_.received() != 0) {
      exit_code_ = ExitForSignal("joining");
    } else {
      spdlog::error("cannot join job {}: {}", setup_.job_id, joined.status().ToString());
      exit_code_ = absl::IsFailedPrecondition(joined.status()) ||
                           absl::IsInvalidArgument(joined.status()) ||
                           absl::IsUnavailable(joined.status())
                       ? 2
                       : 1;
    }
    return joined.status();
  }
  member_id_ = joined->member_id();
  if (watcher_ != nullptr) {
    // Joining again as a new node: the job may be a new one of the same id
    // (a service restarted without its state dropped the old, which ended
    // the watch for good, and a join made it anew). Watch it afresh: its
    // states must not be read against the old job's, whose round 0 may
    // hold this node's new member id (ids start again too).
    signals_.Watch(nullptr);
    watcher_.reset();
  }
  keeper_ = std::make_unique<rdzv::LeaseKeeper>(&client, setup_.job_id, member_id_,
                                                absl::Milliseconds(joined->lease_ttl_ms()),
                                                options_.rdzv_conf.keep_alive_interval);
  if (watcher_ == nullptr) {
    watcher_ = std::make_unique<rdzv::JobWatcher>(&client, setup_.job_id,
                                                  [this](const pb::JobState&) { wake_.Poke(); });
    signals_.Watch(watcher_.get());  // a signal ends every wait on it
  }
  if (joined->state().phase() == pb::RUNNING && joined->state().round() < joined->round()) {
    // The job runs without this node: it is a spare until a round admits it.
    spdlog::info(
        "job {} is running round {} without this node ({} node(s), world {}): waiting as a "
        "spare",
        setup_.job_id, joined->state().round(), joined->state().members_size(),
        joined->state().world_size());
  }
  // The round we joined may form without another join from us.
  return AwaitJoinedRound(joined->round(), joined->lease_ttl_ms());
}

std::optional<rdzv::RoundAssignment> Agent::AwaitJoinedRound(uint64_t round, int64_t lease_ttl_ms) {
  auto self_in = [this](const pb::JobState& state) -> const pb::Member* {
    for (const pb::Member& member : state.members()) {
      if (member.member_id() == member_id_) return &member;
    }
    return nullptr;
  };
  spdlog::info("waiting for round {} of job {} to form", round, setup_.job_id);
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
  // RemoteStore::Get cannot be cancelled: a signal must end this wait.
  spdlog::info("round {}: waiting for group rank 0 to publish the master port",
               assignment.state.round());
  pb::GetRequest request;
  request.set_job_id(setup_.job_id);
  request.set_round(assignment.state.round());
  request.set_key(kMasterPortKey);
  request.set_wait_ms(absl::ToInt64Milliseconds(options_.rdzv_conf.join_timeout));
  rdzv::CallOptions call;
  call.cancellation = signals_.cancellation();
  absl::StatusOr<pb::GetResponse> got = setup_.client->Get(request, call);
  if (!got.ok()) return got.status();
  int port = 0;
  if (!absl::SimpleAtoi(got->value(), &port)) {
    return absl::DataLossError(
        absl::StrCat("bad master port in the round's store: ", got->value()));
  }
  return port;
}

void Agent::ReportDone(uint64_t round) {
  pb::ReportDoneRequest done;
  done.set_job_id(setup_.job_id);
  done.set_round(round);
  done.set_member_id(member_id_);
  // Not signals_.cancellation(), which may have fired: the report must
  // go through even after a signal. A refusal the service may get over
  // (UNAVAILABLE: restarting, or a change it could not make durable on a
  // full disk) is tried again for up to close_timeout, the lease kept
  // meanwhile: unreported, a finished node counts as lost when its agent
  // exits, and the job restarts instead of succeeding.
  const absl::Time give_up = absl::Now() + options_.rdzv_conf.close_timeout;
  bool said = false;
  for (absl::Duration backoff = absl::Milliseconds(100);;
       backoff = std::min(backoff * 2, absl::Seconds(1))) {
    absl::Status reported = setup_.client->ReportDone(done).status();
    if (reported.ok() || absl::IsAborted(reported) || absl::IsFailedPrecondition(reported)) {
      if (said) spdlog::info("reported this node's workers done in job {}", setup_.job_id);
      return;
    }
    const bool transient = absl::IsUnavailable(reported) || absl::IsDeadlineExceeded(reported);
    if (!transient || absl::Now() + backoff >= give_up) {
      spdlog::warn("could not report this node's workers done in job {}: {}", setup_.job_id,
                   reported.ToString());
      return;
    }
    if (!std::exchange(said, true)) {
      spdlog::warn(
          "could not report this node's workers done in job {} yet ({}); trying again "
          "for up to {}",
          setup_.job_id, reported.ToString(), absl::FormatDuration(give_up - absl::Now()));
    }
    absl::SleepFor(backoff);  // a retry's backoff: no event tells when the service is back
  }
}

void Agent::LeaveRendezvous() {
  if (keeper_ != nullptr) keeper_->Stop();
  if (member_id_.empty()) return;
  pb::LeaveRequest leave;
  leave.set_job_id(setup_.job_id);
  leave.set_member_id(member_id_);
  rdzv::CallOptions call;  // not signals_.cancellation(): it has fired
  call.timeout = kLeaveTimeout;
  // A preempted node that cannot reach the service (restarting, say) keeps
  // trying until shortly before its grace ends: a lease that lapses instead
  // counts as a lost node, charged to the job's restart budget, and a job
  // with none left fails and refuses its own requeue.
  const absl::Time retry_until = leave_retry_until_ - kExitMargin;
  bool said = false;
  for (absl::Duration backoff = absl::Milliseconds(100);;
       backoff = std::min(backoff * 2, absl::Seconds(1))) {
    absl::Status left = setup_.client->Leave(leave, call).status();
    if (left.ok() || absl::IsNotFound(left) || absl::IsFailedPrecondition(left)) {
      if (said) spdlog::info("left job {}", setup_.job_id);
      return;
    }
    const bool transient = absl::IsUnavailable(left) || absl::IsDeadlineExceeded(left);
    if (!transient || absl::Now() + backoff >= retry_until) {
      spdlog::warn("could not leave job {} (its lease will lapse): {}", setup_.job_id,
                   left.ToString());
      return;
    }
    if (!std::exchange(said, true)) {
      spdlog::warn("could not leave job {} yet ({}); trying again for up to {}", setup_.job_id,
                   left.ToString(), absl::FormatDuration(retry_until - absl::Now()));
    }
    absl::SleepFor(backoff);  // a retry's backoff: no event tells when the service is back
  }
}

std::optional<Outcome> Agent::PreemptIfAWorkerSaved(WorkerGroup& group, uint64_t round) {
  for (const WorkerFailure& failure : group.failures()) {
    if (failure.exit.signal != 0 || failure.exit.exit_code != kPreemptedExitCode) continue;
    spdlog::warn("rank {} exited {} (preempted); preempting this node's other workers",
                 failure.global_rank, kPreemptedExitCode);
    leave_retry_until_ = absl::Now() + options_.preempt_grace;
    group.Stop(options_.preempt_grace, SIGTERM);
    if (!group.preempted() && !group.all_succeeded()) {
      // Not a preemption that every worker took part in (a script that
      // exits 75 for its own reasons, whose peers die of the SIGTERM): this
      // agent got no signal, so it is a failure like any other, for the
      // restart budget to answer, not an exit 143 no scheduler requeues.
      spdlog::warn("not every worker saved its state ({}); taking rank {}'s exit {} as a failure",
                   group.DescribeExits(), failure.global_rank, kPreemptedExitCode);
      return std::nullopt;
    }
    return FinishPreemption(group, SIGTERM, round);
  }
  return std::nullopt;
}

int Agent::ExitForSignal(const char* waiting_for) {
  int signal_number = signals_.received();
  if (IsPreemptionSignal(signal_number)) leave_retry_until_ = absl::Now() + options_.preempt_grace;
  LeaveRendezvous();
  if (IsPreemptionSignal(signal_number)) {
    spdlog::warn(
        "got {} while {}; no worker was running on this node, so nothing is left unsaved: "
        "leaving job {} and exiting {} so the job can be requeued",
        SignalName(signal_number), waiting_for, setup_.job_id, kPreemptedExitCode);
    return kPreemptedExitCode;
  }
  spdlog::warn("got {} while {}; leaving job {}", SignalName(signal_number), waiting_for,
               setup_.job_id);
  return 128 + signal_number;
}

int Agent::ExitForSignalWhenDone(const char* when) {
  int signal_number = signals_.received();
  LeaveRendezvous();
  std::optional<pb::JobState> latest = watcher_->latest();
  if (latest.has_value() && rdzv::IsTerminalPhase(latest->phase())) return ExitCodeFor(*latest);
  if (IsPreemptionSignal(signal_number)) {
    spdlog::warn(
        "got {} {}; this node's workers succeeded, so exiting 0 (the other nodes' agents report "
        "the rest of job {})",
        SignalName(signal_number), when, setup_.job_id);
    return 0;
  }
  spdlog::warn("got {} {}; leaving job {}", SignalName(signal_number), when, setup_.job_id);
  return 128 + signal_number;
}

Outcome Agent::StopForSignal(WorkerGroup& group, int signal_number, uint64_t round) {
  const bool preemption = IsPreemptionSignal(signal_number);
  const absl::Duration grace = preemption ? options_.preempt_grace : options_.shutdown_timeout;
  if (preemption) leave_retry_until_ = absl::Now() + grace;
  spdlog::warn("got {}; forwarding it to the workers, SIGKILL after {}{}",
               SignalName(signal_number), absl::FormatDuration(grace),
               preemption ? " (--preempt_grace)" : "");
  group.Stop(grace, signal_number);
  if (preemption) return FinishPreemption(group, signal_number, round);
  LeaveRendezvous();
  exit_code_ = 128 + signal_number;
  return Outcome::kExit;
}

Outcome Agent::FinishPreemption(const WorkerGroup& group, int signal_number, uint64_t round) {
  if (group.all_succeeded()) {
    // They finished training as the signal came (the worker saves its last
    // step and exits 0 then): nothing is left to save or to requeue.
    spdlog::info("round {}: this node's workers succeeded as {} came", round,
                 SignalName(signal_number));
    ReportDone(round);
    exit_code_ = ExitForSignalWhenDone("as this node's workers finished");
    return Outcome::kExit;
  }
  // Leave only now: while the workers saved their state the round stayed
  // up, so the other nodes' workers were not torn out of it.
  LeaveRendezvous();
  if (group.preempted()) {
    spdlog::warn(
        "job {} preempted ({}): this node's workers saved their state ({}); "
        "exiting {} so the job can be requeued",
        setup_.job_id, SignalName(signal_number), group.DescribeExits(), kPreemptedExitCode);
    exit_code_ = kPreemptedExitCode;
  } else {
    exit_code_ = 128 + signal_number;
    spdlog::error(
        "job {}: preemption ({}) not clean, not every worker saved its state ({}); "
        "exiting {}",
        setup_.job_id, SignalName(signal_number), group.DescribeExits(), exit_code_);
  }
  return Outcome::kExit;
}

Outcome Agent::RunAttempt(const rdzv::RoundAssignment& assignment) {
  const pb::JobState& state = assignment.state;
  const uint64_t round = state.round();
  absl::StatusOr<int> master_port = MasterPort(assignment);
  if (!master_port.ok()) {
    if (signals_.received() != 0) {
      exit_code_ = ExitForSignal("waiting for MASTER_PORT");
      return Outcome::kExit;
    }
    if (absl::IsAborted(master_port.status())) return Outcome::kRejoin;  // round ended
    spdlog::error("cannot agree on MASTER_PORT: {}", master_port.status().ToString());
    exit_code_ = 1;
    return Outcome::kExit;
  }

  WorkerGroupSpec spec;
  spec.command = command_;
  if (options_.target_kind == TargetKind::kYamlConfig) {
    spec.blocked_signals.assign(kPreemptionSignals.begin(), kPreemptionSignals.end());
  }
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
  spec.round.preempt_grace_s = absl::ToDoubleSeconds(options_.preempt_grace);
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
    std::vector<pollfd> fds = {{signals_.fd(), POLLIN, 0}, {wake_.fd(), POLLIN, 0}};
    for (int pidfd : group.RunningPidfds()) fds.push_back(pollfd{pidfd, POLLIN, 0});
    int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(options_.monitor_interval));
    // Worker exits, signals and job changes all arrive as events; the
    // timeout is a backstop for the lease keeper's status.
    poll(fds.data(), fds.size(), std::max(timeout_ms, 1));
    if (int signal_number = signals_.received(); signal_number != 0) {
      return StopForSignal(group, signal_number, round);
    }
    if (fds[1].revents & POLLIN) wake_.Drain();

    group.CollectExits();
    if (!group.failures().empty()) {
      if (std::optional<Outcome> preempted = PreemptIfAWorkerSaved(group, round)) {
        return *preempted;
      }
      group.Stop(options_.shutdown_timeout, SIGTERM);
      // A worker's watchdog leaves a round that ended elsewhere as soon as
      // the server says so, often before this loop hears of it: that is
      // the round's end, not a failure of this node.
      std::optional<pb::JobState> now = watcher_->latest();
      if (now.has_value() && (now->round() != round || now->phase() != pb::RUNNING)) {
        spdlog::info("round {} ended ({}); this node's workers left it", round,
                     RoundEndCause(*now));
        if (rdzv::IsTerminalPhase(now->phase())) {
          exit_code_ = ExitCodeFor(*now);
          return Outcome::kExit;
        }
        return Outcome::kRejoin;
      }
      // The first failure, unless one that no restart can mend (its error
      // file says so, or its exit code: kNotRestartableExitCode) came too:
      // that one decides the job's fate.
      const std::vector<WorkerFailure>& failures = group.failures();
      auto permanent = std::find_if(failures.begin(), failures.end(),
                                    [](const WorkerFailure& f) { return !f.restartable; });
      const WorkerFailure& first = permanent != failures.end() ? *permanent : failures.front();
      std::fprintf(stderr, "workers failed on %s in round %lu:\n%s", setup_.hostname.c_str(),
                   static_cast<unsigned long>(round), FormatFailureTable(failures).c_str());
      if (!first.restartable) {
        spdlog::error(
            "rank {}'s {} says no restart can mend its failure (a config or input error, a "
            "full disk): failing job {} now rather than restarting it",
            first.global_rank,
            first.message.empty() ? absl::StrCat("exit code ", kNotRestartableExitCode)
                                  : std::string("error file"),
            setup_.job_id);
      }
      pb::ReportFailureRequest report;
      report.set_job_id(setup_.job_id);
      report.set_round(round);
      report.set_member_id(member_id_);
      report.set_exit_code(first.exit.ShellCode());
      report.set_message(first.message);
      report.set_permanent(!first.restartable);
      failure_round_ = round;
      failure_error_file_ = first.error_file;
      failure_message_ = absl::StrCat("rank ", first.global_rank, " on ", setup_.hostname,
                                      " failed (", first.exit.Describe(), ")",
                                      first.message.empty() ? "" : ": ", first.message);
      absl::StatusOr<pb::ReportFailureResponse> reported = client.ReportFailure(report);
      if (!reported.ok() && !absl::IsAborted(reported.status()) &&
          !absl::IsFailedPrecondition(reported.status())) {
        spdlog::warn("could not report the failure: {}", reported.status().ToString());
      }
      return Outcome::kRejoin;
    }
    if (group.running() == 0 && group.all_succeeded()) {
      ReportDone(round);  // the watcher tells what happened next
      spdlog::info("round {}: this node's workers succeeded; waiting for the job to close", round);
      absl::StatusOr<pb::JobState> next = watcher_->WaitFor(
          [&](const pb::JobState& s) {
            return rdzv::IsTerminalPhase(s.phase()) || s.round() != round;
          },
          absl::Now() + options_.rdzv_conf.close_timeout);
      if (!next.ok()) {
        if (signals_.received() != 0) {
          exit_code_ = ExitForSignalWhenDone("while waiting for the job to close");
          return Outcome::kExit;
        }
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
      // Under a world_size_multiple the server says how many waiting nodes a
      // new round would take: a spare that cannot make a fitting world
      // must not restart the job again and again.
      bool can_grow =
          latest->config().world_size_multiple() > 1
              ? latest->nodes_admittable() > 0
              : latest->nodes_waiting() > 0 &&
                    latest->members_size() < static_cast<int>(latest->config().max_nodes());
      if (round_over || can_grow) {
        if (round_over && latest->last_end_reason() == pb::MEMBER_LEFT && group.running() > 0) {
          // A node left: when it was preempted, every rank stops after the
          // same step and saves it, so this node's workers may be saving
          // right now and about to exit kPreemptedExitCode on their own.
          // A SIGTERM from here would hide that (muster's worker answers
          // it the same way): give them a moment to say it themselves.
          group.AwaitExits(absl::Now() + std::min(options_.shutdown_timeout, kOwnExitWait));
          if (std::optional<Outcome> preempted = PreemptIfAWorkerSaved(group, round)) {
            return *preempted;
          }
        }
        if (round_over) {
          spdlog::info("round {} ended ({}); stopping workers", round, RoundEndCause(*latest));
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
      group.Stop(options_.shutdown_timeout, SIGTERM);
      std::optional<pb::JobState> now = watcher_->latest();
      if (absl::IsNotFound(lease) && (!now.has_value() || !rdzv::IsTerminalPhase(now->phase()))) {
        // The server forgot this node: its lease lapsed while the agent was
        // paused or cut off for longer than the ttl, and the job went on
        // without it. It can still take part, as a node that joins now.
        spdlog::warn("lost the rendezvous lease ({}); joining job {} again as a new node",
                     lease.ToString(), setup_.job_id);
        return Outcome::kJoinAgain;
      }
      spdlog::error("lost the rendezvous lease: {}", lease.ToString());
      exit_code_ = 1;
      return Outcome::kExit;
    }
  }
}

}  // namespace

void Agent::WriteParentErrorFile(int code) {
  auto path = env_.find("TORCHELASTIC_ERROR_FILE");
  if (path == env_.end() || path->second.empty()) return;
  // Success, and a preemption that saved everything, are no errors.
  if (code == 0 || code == kPreemptedExitCode) return;
  std::string message = failure_message_;
  std::string worker_file = failure_error_file_;
  std::optional<pb::JobState> latest = watcher_ != nullptr ? watcher_->latest() : std::nullopt;
  // This node's failure is the job's when it came in the job's last round;
  // an older one was restarted from, and the job then failed elsewhere.
  const bool ours = !message.empty() && (!latest.has_value() || latest->round() == failure_round_);
  if (!ours) {
    worker_file.clear();
    message = latest.has_value() && rdzv::IsTerminalPhase(latest->phase()) &&
                      !latest->status_message().empty()
                  ? absl::StrCat("job ", setup_.job_id, " ", pb::Phase_Name(latest->phase()), ": ",
                                 latest->status_message())
                  : "";
  }
  if (message.empty()) message = absl::StrCat("launch exited ", code, " (see its log)");
  std::ofstream out(path->second, std::ios::trunc);
  out << ParentErrorReport(worker_file, message, absl::Now());
  out.flush();
  if (!out) {
    spdlog::warn("cannot write the error report to TORCHELASTIC_ERROR_FILE {}", path->second);
  }
}

int RunAgent(const LaunchOptions& options, const std::map<std::string, std::string>& env,
             int signal_fd) {
  SignalWatch signals(signal_fd);
  absl::StatusOr<RendezvousSetup> setup = SetUpRendezvous(options, signals.cancellation());
  if (!setup.ok()) {
    if (int signal_number = signals.received(); signal_number != 0) {
      if (IsPreemptionSignal(signal_number)) {
        spdlog::warn(
            "got {} while connecting to the rendezvous service; no worker was running, "
            "so exiting {} so the job can be requeued",
            SignalName(signal_number), kPreemptedExitCode);
        return kPreemptedExitCode;
      }
      spdlog::warn("got {} while connecting to the rendezvous service", SignalName(signal_number));
      return 128 + signal_number;
    }
    spdlog::error("{}", std::string(setup.status().message()));
    return 2;
  }
  // Without --log_dir the logs live in a directory of $TMPDIR made for
  // this run. Once the agent is done, the directories in it that hold no
  // file (every rank's, when no worker failed and nothing was redirected)
  // go, so that runs do not pile up empty trees there; an error report or
  // a log file keeps its directory, and the path the agent printed.
  const std::string temporary_root = options.log_dir.empty() ? setup->log_root : "";
  int code = 0;
  {
    Agent agent(options, env, &signals, *std::move(setup));
    code = agent.Run();
    agent.WriteParentErrorFile(code);
  }
  if (!temporary_root.empty()) {
    RemoveEmptyDirectories(temporary_root);
    std::error_code error;
    if (std::filesystem::exists(temporary_root, error)) {
      spdlog::info("this run's logs are kept in {}", temporary_root);
    }
  }
  return code;
}

}  // namespace muster::launcher
