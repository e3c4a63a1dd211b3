// Prometheus metrics of the rendezvous server (text format 0.0.4), served
// on GET /metrics by a small cpp-httplib server, over HTTP or HTTPS, with a
// connection cap and an optional bearer token (HttpOptions).
//
//   muster_rdzv_jobs, muster_rdzv_members           gauges (read on scrape)
//   muster_rdzv_watch_streams                       gauge
//   muster_rdzv_rounds_total                        rounds closed (RUNNING)
//   muster_rdzv_restarts_total                      failure restarts counted
//   muster_rdzv_rpcs_total{method,code}             finished RPCs
//   muster_rdzv_rpc_duration_seconds{method}        histogram, 1e-4 .. 10 s
//
// Thread-safety: every method may be called from any thread. Recording is
// a handful of relaxed atomic adds, because 20,000 KeepAlives per second go
// through it.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace httplib {
class Server;
}

namespace muster::rdzv {

class HttpsCredentials;

// The RPCs of pb::Rendezvous, as metric label values.
enum class Rpc {
  kJoin,
  kKeepAlive,
  kLeave,
  kReportFailure,
  kReportDone,
  kWatch,
  kSet,
  kGet,
  kAdd,
  kCompareAndSet,
  kDelete,
  kMultiGet,
  kWait,
  kListJobs,
  kDescribeJob,
  kCloseJob,
};
inline constexpr int kRpcCount = 16;
const char* RpcName(Rpc rpc);

class Metrics {
 public:
  struct Gauges {
    int64_t jobs = 0;
    int64_t members = 0;
    // Jobs by phase, "gathering", "running", "succeeded", "failed",
    // "closed": a finished job is held (and counted in `jobs`) until it is
    // dropped, so `jobs` alone does not tell how many are live.
    std::map<std::string, int64_t> jobs_by_phase;
  };

  // `read_gauges` is called on every scrape (it may take the service lock
  // briefly); it may be empty.
  explicit Metrics(std::function<Gauges()> read_gauges = nullptr);
  ~Metrics();  // Stops the HTTP server.

  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  void set_gauge_reader(std::function<Gauges()> read_gauges);

  // `code` is an absl/gRPC status code number (0..16).
  void RecordRpc(Rpc rpc, int code, absl::Duration duration);
  void AddWatchStreams(int64_t delta) { watch_streams_ += delta; }
  void AddRounds(int64_t count) { rounds_total_ += count; }
  void AddRestarts(int64_t count) { restarts_total_ += count; }
  int64_t watch_streams() const { return watch_streams_.load(); }

  // The whole exposition text.
  std::string Render() const;

  // Who may reach GET /metrics, and how many at once.
  struct HttpOptions {
    std::string address = "127.0.0.1";
    int port = 0;  // 0 or negative: a free one
    // Connections being served or waiting for a thread, at most. One more
    // is answered "503 Service Unavailable" and closed at once, by the
    // accepting thread, so idle or slow clients cannot pile up sockets or
    // threads in the server.
    int max_connections = 16;
    // Set: called with each request's Authorization header (empty if
    // absent); false answers 401. Must be safe to call from any thread.
    std::function<bool(const std::string& authorization)> authorize;
    // Set: HTTPS with these credentials (and client certificates required
    // when they hold a client CA); a connection whose handshake fails is
    // closed and counts no more. Null: plain HTTP. Kept until StopHttp.
    std::shared_ptr<HttpsCredentials> https;
  };

  // Serves GET /metrics in a background thread; returns the bound port.
  // UNAVAILABLE naming the address if it cannot bind; INVALID_ARGUMENT if
  // max_connections < 1; INTERNAL if OpenSSL refuses the HTTPS settings.
  // REQUIRES: not serving already.
  absl::StatusOr<int> StartHttp(const HttpOptions& options);
  void StopHttp();

 private:
  static constexpr int kCodeCount = 17;
  static constexpr int kBucketCount = 16;  // plus +Inf

  struct PerRpc {
    std::array<std::atomic<uint64_t>, kCodeCount> calls{};
    std::array<std::atomic<uint64_t>, kBucketCount + 1> buckets{};
    std::atomic<uint64_t> duration_sum_ns{0};
    std::atomic<uint64_t> duration_count{0};
  };

  std::function<Gauges()> read_gauges_;
  std::array<PerRpc, kRpcCount> per_rpc_;
  std::atomic<int64_t> watch_streams_{0};
  std::atomic<int64_t> rounds_total_{0};
  std::atomic<int64_t> restarts_total_{0};

  // Declared before http_, so that it outlives every handshake there.
  std::shared_ptr<HttpsCredentials> https_;
  std::unique_ptr<httplib::Server> http_;  // an httplib::SSLServer with https_
  std::thread http_thread_;
};

}  // namespace muster::rdzv
