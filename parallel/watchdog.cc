#include "parallel/watchdog.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muster::parallel {

absl::Status Decide(const WatchdogObservation& observation, absl::Duration limit) {
  const GroupHealth& health = observation.health;
  if (!health.error.ok()) return health.error;
  if (!observation.round.ok()) {
    // The group prefixes the running operation's description (WorkQueue).
    return absl::AbortedError(observation.round.message());
  }
  if (health.running_since.has_value() && observation.now - *health.running_since > limit) {
    return absl::DeadlineExceededError(
        absl::StrCat(health.running.empty() ? "an operation" : health.running, " has run for ",
                     absl::FormatDuration(observation.now - *health.running_since), ", past ",
                     absl::FormatDuration(limit), "; communicator aborted"));
  }
  return absl::OkStatus();
}

namespace {

// MergedHealth, and which group the error is from (nullptr: none).
GroupHealth Merge(const std::vector<ProcessGroup*>& groups, ProcessGroup** failed) {
  GroupHealth merged;
  *failed = nullptr;
  for (ProcessGroup* group : groups) {
    GroupHealth health = group->Health();
    if (merged.error.ok() && !health.error.ok()) {
      merged.error = health.error;
      *failed = group;
    }
    if (health.running_since.has_value() &&
        (!merged.running_since.has_value() || *health.running_since < *merged.running_since)) {
      merged.running_since = health.running_since;
      merged.running = std::move(health.running);
    }
  }
  return merged;
}

}  // namespace

GroupHealth MergedHealth(const std::vector<ProcessGroup*>& groups) {
  ProcessGroup* failed = nullptr;
  return Merge(groups, &failed);
}

absl::Status PassedOn(const absl::Status& error, const ProcessGroup& failed) {
  return absl::Status(error.code(), absl::StrCat("aborted after an error in group ",
                                                 failed.members().name, ": ", error.message()));
}

Watchdog::Watchdog(std::vector<ProcessGroup*> groups, RoundProbe round, OnStuck on_stuck,
                   WatchdogOptions options)
    : round_(std::move(round)),
      on_stuck_(std::move(on_stuck)),
      options_(std::move(options)),
      groups_(std::move(groups)) {}

Watchdog::~Watchdog() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Watchdog::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void Watchdog::Watch(ProcessGroup* group) {
  absl::Status cause, passed_on;
  {
    absl::MutexLock lock(&mu_);
    groups_.push_back(group);
    cause = cause_;
    passed_on = passed_on_;
  }
  // PollOnce aborts the groups it listed when it recorded the cause, under
  // the same lock: a group added later sees the cause here instead.
  if (!cause.ok()) group->Abort(passed_on);
}

void Watchdog::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

absl::Status Watchdog::cause() const {
  absl::MutexLock lock(&mu_);
  return cause_;
}

absl::Status Watchdog::PollOnce() {
  std::vector<ProcessGroup*> groups;
  {
    absl::MutexLock lock(&mu_);
    groups = groups_;
  }
  WatchdogObservation observation;
  observation.now = options_.now();
  ProcessGroup* failed = nullptr;  // the group whose error this is
  observation.health = Merge(groups, &failed);
  if (round_) observation.round = round_();
  // Decide puts a group's error first; the other groups are then told which
  // group it is from, whose names (its rank numbers) it uses.
  const absl::Status group_error_passed_on =
      failed != nullptr ? PassedOn(observation.health.error, *failed) : absl::OkStatus();

  enum class Act { kNothing, kAbort, kStuck } act = Act::kNothing;
  absl::Status cause, passed_on;
  {
    absl::MutexLock lock(&mu_);
    if (cause_.ok()) {
      absl::Duration timeout;
      for (ProcessGroup* group : groups) timeout = std::max(timeout, group->timeout());
      absl::Status found = Decide(observation, timeout + options_.timeout_slack);
      if (found.ok()) return found;
      cause_ = found;
      passed_on_ = failed != nullptr ? group_error_passed_on : found;
      cause_since_ = observation.now;
      act = Act::kAbort;
      // Every group watched at this point, including one Watch() added
      // since the observation: Watch() aborts the ones added after.
      groups = groups_;
    } else if (!stuck_reported_ && observation.now - *cause_since_ >= options_.exit_grace) {
      stuck_reported_ = true;
      act = Act::kStuck;
    }
    cause = cause_;
    passed_on = passed_on_;
  }
  // Outside the lock: ncclCommAbort may take a while, and on_stuck exits.
  if (act == Act::kAbort) {
    // When the cause is the group's own error the group has broken itself
    // already and keeps that first error; aborting again is harmless.
    for (ProcessGroup* group : groups) group->Abort(group == failed ? cause : passed_on);
  } else if (act == Act::kStuck && on_stuck_) {
    on_stuck_(cause);
  }
  return cause;
}

void Watchdog::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](Watchdog* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                 return self->stopping_ || self->wake_;
                               },
                               this),
                           options_.interval);
      if (stopping_) return;
      wake_ = false;
    }
    PollOnce().IgnoreError();  // acted on inside
  }
}

}  // namespace muster::parallel
