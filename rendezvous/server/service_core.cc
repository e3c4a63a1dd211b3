// RendezvousService: lifecycle, group commit plumbing, notification of
// changed jobs, and the timer thread.
#include <algorithm>
#include <exception>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "rendezvous/server/service.h"
#include "rendezvous/server/service_reactors.h"
#include "spdlog/spdlog.h"

namespace muster::rdzv {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // The message travels as the grpc-message trailer, and clients refuse
  // metadata over 8-16 KiB: a longer one reached them as "metadata size
  // exceeds limit" (RESOURCE_EXHAUSTED) instead of the real code, and could
  // fail other calls on the same connection. Messages quote request
  // fields (a 70 kB job id in "job ... not found"), so the cut is here,
  // where every reply passes, keeping both ends of the text.
  std::string message(status.message());
  if (message.size() > kMaxStatusMessageBytes) {
    const size_t keep = kMaxStatusMessageBytes / 2;
    message = absl::StrCat(message.substr(0, keep), " [", message.size() - 2 * keep, " bytes cut] ",
                           message.substr(message.size() - keep));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(message));
}

RendezvousService::RendezvousService(ServiceOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : MonotonicClock::Default()),
      metrics_(options_.metrics),
      machine_(options_.limits),
      events_(options_.metrics) {
  if (options_.state_file != nullptr) {
    committer_ = std::make_unique<GroupCommitter>(
        options_.state_file, [this] { return SnapshotForCommit(); },
        [this](const state::ServerState& durable) { return RollBack(durable); });
  }
}

RendezvousService::~RendezvousService() {
  BeginShutdown();
  Stop().IgnoreError();
}

absl::Status RendezvousService::RestoreFromDisk() {
  if (options_.state_file == nullptr) return absl::OkStatus();
  absl::StatusOr<std::optional<state::ServerState>> loaded = options_.state_file->Load();
  if (!loaded.ok()) return loaded.status();
  if (!loaded->has_value()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  absl::Status restored = machine_.Restore(**loaded, clock_->Now());
  if (!restored.ok()) {
    return absl::Status(restored.code(),
                        absl::StrCat("cannot restore state from '", options_.state_file->path(),
                                     "': ", restored.message()));
  }
  // What was restored is neither a change to announce nor to write back.
  machine_.TakeChangedJobs();
  machine_.TakeDirty();
  pb::ListJobsResponse jobs = machine_.ListJobs();
  for (const pb::JobSummary& job : jobs.jobs()) {
    absl::StatusOr<pb::JobState> state = machine_.State(job.job_id());
    if (state.ok()) events_.Remember(job.job_id(), *state);
  }
  spdlog::info("rendezvous: restored {} jobs, {} members from {}", machine_.job_count(),
               machine_.member_count(), options_.state_file->path());
  return absl::OkStatus();
}

void RendezvousService::Start() {
  if (committer_) committer_->Start();
  timer_ = std::thread([this] { TimerLoop(); });
}

void RendezvousService::BeginShutdown() {
  std::vector<std::shared_ptr<WatchReactor>> watchers;
  std::vector<StoreWaiter*> waiters;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    for (auto& [job_id, by_pointer] : watchers_) {
      for (auto& [pointer, watcher] : by_pointer) watchers.push_back(watcher);
    }
    for (auto& [deadline, waiter] : waiter_deadlines_) waiters.push_back(waiter);
    waiters_.clear();
    waiter_deadlines_.clear();
  }
  absl::Status unavailable =
      absl::UnavailableError("rendezvous server is shutting down; reconnect and retry");
  for (auto& watcher : watchers) watcher->Terminate(unavailable);
  for (StoreWaiter* waiter : waiters) waiter->Complete(unavailable);
}

absl::Status RendezvousService::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::OkStatus();
    stopping_ = true;
    timer_wake_.Signal();
  }
  if (timer_.joinable()) timer_.join();
  absl::Status status;
  if (committer_) status = committer_->Stop();
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  return status;
}

Metrics::Gauges RendezvousService::ReadGauges() {
  absl::MutexLock lock(&mu_);
  Metrics::Gauges gauges;
  gauges.jobs = static_cast<int64_t>(machine_.job_count());
  gauges.members = static_cast<int64_t>(machine_.member_count());
  const pb::ListJobsResponse jobs = machine_.ListJobs();
  for (const pb::JobSummary& job : jobs.jobs()) {
    std::string phase = absl::AsciiStrToLower(pb::Phase_Name(job.phase()));
    ++gauges.jobs_by_phase[phase];
  }
  return gauges;
}

std::pair<state::ServerState, uint64_t> RendezvousService::SnapshotForCommit() {
  absl::MutexLock lock(&mu_);
  return {machine_.Snapshot(clock_->Now()), mutation_sequence_};
}

uint64_t RendezvousService::RollBack(const state::ServerState& durable) {
  std::vector<std::string> jobs;
  uint64_t sequence = 0;
  bool rolled_back = false;
  {
    absl::MutexLock lock(&mu_);
    const pb::ListJobsResponse before = machine_.ListJobs();
    for (const pb::JobSummary& job : before.jobs()) jobs.push_back(job.job_id());
    StateMachine restored(options_.limits);
    absl::Status status = restored.Restore(durable, clock_->Now());
    if (status.ok()) {
      restored.TakeChangedJobs();
      restored.TakeDirty();
      machine_ = std::move(restored);
      const pb::ListJobsResponse after = machine_.ListJobs();
      for (const pb::JobSummary& job : after.jobs()) jobs.push_back(job.job_id());
      rolled_back = true;
    } else {
      spdlog::error("rendezvous: cannot undo the changes a failed state write left: {}",
                    status.ToString());
    }
    sequence = ++mutation_sequence_;
    timer_wake_.Signal();  // the deadlines are the restored state's
  }
  if (rolled_back) {
    spdlog::error(
        "rendezvous: undid every change since the last state written to {}; calls that made "
        "them failed UNAVAILABLE, and leases run from now",
        options_.state_file->path());
    std::sort(jobs.begin(), jobs.end());
    jobs.erase(std::unique(jobs.begin(), jobs.end()), jobs.end());
    NotifyJobs(jobs);  // watchers of a job that changed back see it
  }
  return sequence;
}

RendezvousService::Effects RendezvousService::TakeEffects(bool may_move_deadlines) {
  Effects effects;
  effects.changed_jobs = machine_.TakeChangedJobs();
  if (machine_.TakeDirty() && committer_) {
    effects.durable = true;
    effects.sequence = ++mutation_sequence_;
  } else if (committer_ && mutation_sequence_ > 0) {
    // A read barrier: the call may have seen mutations not yet on disk
    // (a Get of a key whose Set awaits its write). It is answered once
    // they are, so no reply shows state that a crash could take back.
    // Already durable: RunWhenDurable answers at once.
    effects.durable = true;
    effects.sequence = mutation_sequence_;
  }
  if (may_move_deadlines && timer_wakes_at_clock_ != absl::InfinitePast() &&
      machine_.NextDeadline() < timer_wakes_at_clock_) {
    timer_wake_.Signal();
  }
  return effects;
}

void RendezvousService::AfterCommit(Effects effects, Reply reply) {
  // Watchers and waiters are told before the caller gets its reply, so a
  // caller that sees its reply knows the change has been passed on.
  if (!effects.durable) {
    if (!effects.changed_jobs.empty()) NotifyJobs(effects.changed_jobs);
    if (reply) reply(absl::OkStatus());
    return;
  }
  // Watchers and waiters only learn of a change once it is durable, so no
  // client acts on state a crash could take back.
  // A change whose write failed was undone (RollBack), and watchers hear of
  // the state it left instead.
  committer_->RunWhenDurable(effects.sequence, [this, jobs = std::move(effects.changed_jobs),
                                                reply = std::move(reply)](absl::Status durable) {
    if (!jobs.empty() && durable.ok()) NotifyJobs(jobs);
    if (reply) reply(durable);
  });
}

void RendezvousService::NotifyJobs(const std::vector<std::string>& job_ids) {
  std::vector<std::pair<std::shared_ptr<WatchReactor>, WatchReactor::SharedState>> offers;
  std::vector<std::pair<StoreWaiter*, absl::Status>> completions;
  std::vector<std::string> log_lines;
  uint64_t observed = 0;
  {
    absl::MutexLock lock(&mu_);
    // The checks below may see mutations newer than the one being
    // notified; waiters are answered once those are durable too.
    observed = mutation_sequence_;
    for (const std::string& job_id : job_ids) {
      absl::StatusOr<uint64_t> version = machine_.Version(job_id);
      auto cached = last_views_.find(job_id);
      bool view_changed = !version.ok() || cached == last_views_.end() || !cached->second->ok() ||
                          (*cached->second)->version() != *version;
      if (view_changed) {
        auto state = std::make_shared<const absl::StatusOr<pb::JobState>>(machine_.State(job_id));
        events_.Observe(job_id, *state, &log_lines);
        if (state->ok()) {
          last_views_[job_id] = state;
        } else {
          last_views_.erase(job_id);
        }
        auto watching = watchers_.find(job_id);
        if (watching != watchers_.end()) {
          for (auto& [pointer, watcher] : watching->second) {
            offers.emplace_back(watcher, state);
          }
        }
      }
      auto waiting = waiters_.find(job_id);
      if (waiting == waiters_.end()) continue;
      std::vector<StoreWaiter*> candidates(waiting->second.begin(), waiting->second.end());
      for (StoreWaiter* waiter : candidates) {
        std::optional<absl::Status> outcome = CheckWaiter(waiter);
        if (!outcome.has_value()) continue;
        UnregisterWaiter(waiter);
        completions.emplace_back(waiter, *std::move(outcome));
      }
    }
  }
  for (const std::string& line : log_lines) spdlog::info("rendezvous: {}", line);
  if (committer_ && !completions.empty()) {
    committer_->RunWhenDurable(observed, [completions](absl::Status durable) {
      for (auto& [waiter, status] : completions) {
        waiter->Complete(status.ok() ? durable : status);
      }
    });
  } else {
    for (auto& [waiter, status] : completions) waiter->Complete(status);
  }
  for (auto& [watcher, state] : offers) watcher->Offer(state);
}

void RendezvousService::TimerLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    timer_wakes_at_clock_ = absl::InfinitePast();
    timer_wakes_at_real_ = absl::InfinitePast();
    Effects effects;
    std::vector<StoreWaiter*> expired;
    try {
      machine_.Tick(clock_->Now());
      const uint64_t before = mutation_sequence_;
      effects = TakeEffects(/*may_move_deadlines=*/false);
      // The timer answers nobody, so it needs no read barrier; waiting on
      // one would spin this loop until the pending write lands.
      if (mutation_sequence_ == before) effects.durable = false;
    } catch (const std::exception& error) {
      spdlog::error("rendezvous: applying deadlines failed: {}", error.what());
    }
    absl::Time real_now = absl::Now();
    while (!waiter_deadlines_.empty() && waiter_deadlines_.begin()->first <= real_now) {
      StoreWaiter* waiter = waiter_deadlines_.begin()->second;
      UnregisterWaiter(waiter);
      expired.push_back(waiter);
    }
    if (!effects.changed_jobs.empty() || effects.durable || !expired.empty()) {
      mu_.Unlock();
      AfterCommit(std::move(effects), nullptr);
      for (StoreWaiter* waiter : expired) {
        waiter->Complete(absl::DeadlineExceededError(
            absl::StrCat("keys of job '", waiter->job_id_, "' round ", waiter->round_,
                         " still absent when the wait ended")));
      }
      mu_.Lock();
      continue;  // time moved on while notifying: look again
    }

    absl::Duration sleep = options_.max_timer_sleep;
    absl::Time next_deadline = machine_.NextDeadline();
    if (next_deadline != absl::InfiniteFuture()) {
      sleep = std::min(sleep, next_deadline - clock_->Now());
    }
    if (!waiter_deadlines_.empty()) {
      sleep = std::min(sleep, waiter_deadlines_.begin()->first - absl::Now());
    }
    // Never spin: a deadline already due is applied on the next pass.
    sleep = std::max(sleep, absl::Milliseconds(1));
    timer_wakes_at_clock_ = clock_->Now() + sleep;
    timer_wakes_at_real_ = absl::Now() + sleep;
    timer_wake_.WaitWithTimeout(&mu_, sleep);
  }
}

}  // namespace muster::rdzv
