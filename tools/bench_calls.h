// The load phases of bench_rendezvous, each driven through gRPC's callback
// API so thousands of simulated nodes cost no thousands of threads.
//
// Thread-safety: each Run* call blocks its caller until its phase ends;
// callbacks run on gRPC's threads. The Clients must outlive the call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rendezvous/client/rpc.h"

namespace muster::tools {

// Latency samples in milliseconds; thread-safe.
class LatencySamples {
 public:
  void Add(double millis);
  // p in [0, 100]; 0 when empty.
  double Percentile(double p) const;

 private:
  mutable absl::Mutex mu_;
  std::vector<double> samples_ ABSL_GUARDED_BY(mu_);
};

struct RendezvousResult {
  absl::Status error;          // first failure, if any
  absl::Duration all_joined;   // until every Join was answered
  absl::Duration all_running;  // until every node saw its RUNNING round
  LatencySamples join_latency_ms;
  int64_t watch_messages = 0;  // JobStates received over all streams
  uint64_t round = 0;
  std::vector<std::string> member_ids;  // in node order
};

// `nodes` nodes join `job_id` (min = max = nodes) round-robin over
// `clients`; each then follows the job over its own Watch stream until it
// sees a RUNNING round of all nodes that includes itself.
// Fills `result` (result->error: the first failure).
void RunRendezvous(const std::vector<std::unique_ptr<rdzv::Client>>& clients,
                   const std::string& job_id, int nodes, absl::Duration timeout,
                   RendezvousResult* result);

struct Throughput {
  int64_t ok = 0;
  int64_t failed = 0;
  absl::Duration elapsed;
  std::string first_error;
  double PerSecond() const {
    double seconds = absl::ToDoubleSeconds(elapsed);
    return seconds > 0 ? ok / seconds : 0;
  }
};

// Keeps `in_flight` KeepAlive calls going for `length`, cycling through the
// members.
Throughput RunKeepAlives(const std::vector<std::unique_ptr<rdzv::Client>>& clients,
                         const std::string& job_id, const std::vector<std::string>& member_ids,
                         int in_flight, absl::Duration length);

// Store Set then Get throughput in the round's store (keys "bench/<n>",
// 64-byte values). Gets read the first min(keys_written, 10000) keys.
Throughput RunStoreSets(const std::vector<std::unique_ptr<rdzv::Client>>& clients,
                        const std::string& job_id, uint64_t round, int in_flight,
                        absl::Duration length);
Throughput RunStoreGets(const std::vector<std::unique_ptr<rdzv::Client>>& clients,
                        const std::string& job_id, uint64_t round, int in_flight,
                        absl::Duration length, int64_t keys_written);

}  // namespace muster::tools
