#include "rendezvous/client/watcher.h"

#include <memory>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"

namespace muster::rdzv {
namespace {

// RESOURCE_EXHAUSTED (a stream quota) is retried too, but only
// ClientOptions::resource_exhausted_attempts times in a row.
bool IsTransient(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::UNKNOWN ||
         code == grpc::StatusCode::DEADLINE_EXCEEDED ||
         code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         code == grpc::StatusCode::CANCELLED;  // server-side cancel on drain
}

}  // namespace

bool IsTerminalPhase(pb::Phase phase) {
  return phase == pb::SUCCEEDED || phase == pb::FAILED || phase == pb::CLOSED;
}

JobWatcher::JobWatcher(Client* client, std::string job_id, Callback on_state, bool wait_for_job)
    : client_(client),
      job_id_(std::move(job_id)),
      on_state_(std::move(on_state)),
      wait_for_job_(wait_for_job),
      thread_([this] { Run(); }) {}

JobWatcher::~JobWatcher() { Stop(); }

void JobWatcher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (active_ != nullptr) active_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

void JobWatcher::Publish(const pb::JobState& state) {
  {
    absl::MutexLock lock(&mu_);
    history_.push_back(state);
    if (history_.size() > kHistory) history_.pop_front();
    ++received_;
  }
  if (on_state_) on_state_(state);
}

void JobWatcher::Run() {
  const ClientOptions& options = client_->options();
  uint64_t last_version = 0;
  int failures_in_a_row = 0;
  int refusals_in_a_row = 0;  // RESOURCE_EXHAUSTED
  for (;;) {
    grpc::ClientContext context;
    // The stream's deadline bounds how long a stall that keepalive cannot
    // see (the server stopped writing) goes unnoticed; then it resumes.
    const absl::Time stream_deadline = absl::Now() + options.watch_stream_deadline;
    const std::string token = client_->PrepareContext(&context, stream_deadline);
    // While the server is down the stream waits for the channel instead of
    // failing at once (see rpc.h); Stop() cancels it.
    context.set_wait_for_ready(true);
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      active_ = &context;
    }
    pb::WatchRequest request;
    request.set_job_id(job_id_);
    request.set_after_version(last_version);
    std::unique_ptr<grpc::ClientReader<pb::JobState>> reader =
        client_->stub()->Watch(&context, request);
    pb::JobState state;
    bool terminal = false;
    while (reader->Read(&state)) {
      failures_in_a_row = 0;
      refusals_in_a_row = 0;
      if (state.version() <= last_version && last_version != 0) continue;
      last_version = state.version();
      terminal = IsTerminalPhase(state.phase());
      Publish(state);
    }
    grpc::Status status = reader->Finish();

    absl::MutexLock lock(&mu_);
    active_ = nullptr;
    if (stopping_) return;
    if (terminal ||
        (status.ok() && !history_.empty() && IsTerminalPhase(history_.back().phase()))) {
      ended_ = true;
      return;
    }
    bool job_not_created_yet =
        wait_for_job_ && received_ == 0 && status.error_code() == grpc::StatusCode::NOT_FOUND;
    // Refused with a token since rotated in its file: again, at once, with the new one.
    if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED &&
        client_->TokenRotatedFrom(token)) {
      ++reconnects_;
      continue;
    }
    if (!status.ok() && !IsTransient(status.error_code()) && !job_not_created_yet) {
      error_ = absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                            absl::StrCat("watch of job ", job_id_, ": ", status.error_message()));
      return;
    }
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
        ++refusals_in_a_row >= options.resource_exhausted_attempts) {
      error_ = absl::ResourceExhaustedError(
          absl::StrCat("watch of job ", job_id_, " refused ", refusals_in_a_row,
                       " time(s) for lack of a server resource: ", status.error_message()));
      return;
    }
    ++reconnects_;
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
        absl::Now() >= stream_deadline) {
      continue;  // the stream's own deadline: resume at once, no failure
    }
    // Broken (or ended early without a terminal state): reconnect.
    const absl::Time wake = absl::Now() + JitteredBackoff(options.backoff, failures_in_a_row++);
    mu_.AwaitWithDeadline(absl::Condition(&stopping_), wake);
    if (stopping_) return;
  }
}

absl::StatusOr<pb::JobState> JobWatcher::WaitFor(
    const std::function<bool(const pb::JobState&)>& predicate, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  // Sequence number of the next state to test; start at the latest.
  uint64_t next = received_ == 0 ? 0 : received_ - 1;
  for (;;) {
    const uint64_t oldest_kept = received_ - history_.size();
    for (next = std::max(next, oldest_kept); next < received_; ++next) {
      const pb::JobState& state = history_[next - oldest_kept];
      if (predicate(state)) return state;
    }
    if (!error_.ok()) return error_;
    if (ended_) {
      const pb::JobState& last = history_.back();
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id_, " ended in phase ", pb::Phase_Name(last.phase()),
                       last.status_message().empty() ? "" : ": ", last.status_message()));
    }
    if (stopping_) {
      return absl::CancelledError(absl::StrCat("watcher of job ", job_id_, " stopped"));
    }
    const uint64_t seen = received_;
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return received_ != seen || !error_.ok() || ended_ || stopping_;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&changed), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no matching state of job ", job_id_, " before the deadline",
          history_.empty() ? std::string(" (no state received)")
                           : absl::StrCat(" (latest: version ", history_.back().version(),
                                          ", round ", history_.back().round(), ", ",
                                          pb::Phase_Name(history_.back().phase()), ")")));
    }
  }
}

std::optional<pb::JobState> JobWatcher::latest() const {
  absl::MutexLock lock(&mu_);
  if (history_.empty()) return std::nullopt;
  return history_.back();
}

absl::Status JobWatcher::status() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

int JobWatcher::reconnects() const {
  absl::MutexLock lock(&mu_);
  return reconnects_;
}

}  // namespace muster::rdzv
