// Turns job state changes into one log line per job event (created, round
// closed, round ended, finished, dropped) and the round/restart counters.
// RPCs themselves are not logged: 20,000 KeepAlives a second would drown
// the events that matter.
//
// Thread-safety: none; the service calls Observe under its mutex. The
// returned lines are logged by the caller after releasing it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "proto/rendezvous.pb.h"

namespace muster::rdzv {

class Metrics;

class JobEventTracker {
 public:
  // `metrics` (not owned, may be null) gets rounds and restarts counted.
  explicit JobEventTracker(Metrics* metrics) : metrics_(metrics) {}

  // Compares `state` (the job's current watch view, or NOT_FOUND once the
  // job is dropped) with what was last seen of `job_id`; appends a line per
  // event to `log_lines`.
  void Observe(const std::string& job_id,
               const absl::StatusOr<::muster::rendezvous::v1::JobState>& state,
               std::vector<std::string>* log_lines);

  // Records `state` as already seen without logging or counting (jobs
  // restored from disk are not "created" again).
  void Remember(const std::string& job_id, const ::muster::rendezvous::v1::JobState& state);

 private:
  struct Seen {
    uint64_t round = 0;
    int phase = 0;
    int32_t restart_count = 0;
  };
  Metrics* metrics_;
  absl::flat_hash_map<std::string, Seen> seen_;
};

}  // namespace muster::rdzv
