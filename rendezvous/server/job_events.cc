#include "rendezvous/server/job_events.h"

#include "absl/strings/str_cat.h"
#include "rendezvous/server/metrics.h"

namespace muster::rdzv {
namespace {

namespace pb = ::muster::rendezvous::v1;

bool IsFinished(int phase) {
  return phase == pb::SUCCEEDED || phase == pb::FAILED || phase == pb::CLOSED;
}

}  // namespace

void JobEventTracker::Observe(const std::string& job_id, const absl::StatusOr<pb::JobState>& state,
                              std::vector<std::string>* log_lines) {
  auto it = seen_.find(job_id);
  if (!state.ok()) {
    if (it != seen_.end()) {
      log_lines->push_back(absl::StrCat("job ", job_id, ": dropped"));
      seen_.erase(it);
    }
    return;
  }
  if (it == seen_.end()) {
    const pb::JobConfig& config = state->config();
    log_lines->push_back(absl::StrCat("job ", job_id, ": created (nodes ", config.min_nodes(), "..",
                                      config.max_nodes(), ", lease ttl ", config.lease_ttl_ms(),
                                      " ms, max restarts ", config.max_restarts(), ")"));
    it = seen_.emplace(job_id, Seen{state->round(), pb::PHASE_UNSPECIFIED, state->restart_count()})
             .first;
  }
  Seen& seen = it->second;

  if (state->round() > seen.round) {
    log_lines->push_back(absl::StrCat("job ", job_id, ": round ", seen.round, " ended (",
                                      pb::RoundEndReason_Name(state->last_end_reason()),
                                      "), gathering round ", state->round(), ", restarts ",
                                      state->restart_count(), "/", state->config().max_restarts()));
  }
  if (state->restart_count() > seen.restart_count && metrics_ != nullptr) {
    metrics_->AddRestarts(state->restart_count() - seen.restart_count);
  }
  bool round_closed =
      state->phase() == pb::RUNNING && (seen.phase != pb::RUNNING || state->round() != seen.round);
  if (round_closed) {
    log_lines->push_back(absl::StrCat("job ", job_id, ": round ", state->round(), " closed with ",
                                      state->members_size(), " nodes, world size ",
                                      state->world_size()));
    if (metrics_ != nullptr) metrics_->AddRounds(1);
  }
  if (IsFinished(state->phase()) && !IsFinished(seen.phase)) {
    std::string line = absl::StrCat("job ", job_id, ": finished ", pb::Phase_Name(state->phase()));
    if (!state->status_message().empty()) {
      absl::StrAppend(&line, " (", state->status_message(), ")");
    }
    log_lines->push_back(std::move(line));
  }
  seen.round = state->round();
  seen.phase = state->phase();
  seen.restart_count = state->restart_count();
}

void JobEventTracker::Remember(const std::string& job_id, const pb::JobState& state) {
  seen_[job_id] = Seen{state.round(), state.phase(), state.restart_count()};
}

}  // namespace muster::rdzv
