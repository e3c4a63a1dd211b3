#include "rendezvous/server/metrics.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "rendezvous/server/https_credentials.h"

namespace muster::rdzv {
namespace {

// Upper bounds in seconds; the last bucket is +Inf.
constexpr double kBucketBounds[] = {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                                    5e-2, 0.1,    0.25, 0.5,  1,      2.5,  5,    10};

const char* const kRpcNames[kRpcCount] = {
    "Join", "KeepAlive", "Leave",       "ReportFailure", "ReportDone", "Watch",
    "Set",  "Get",       "Add",         "CompareAndSet", "Delete",     "MultiGet",
    "Wait", "ListJobs",  "DescribeJob", "CloseJob"};

void Header(std::string* out, const char* name, const char* type, const char* help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

std::string FormatDouble(double value) { return absl::StrFormat("%.17g", value); }

// Threads serving /metrics at most; more connections (up to the cap) wait.
constexpr int kHttpThreads = 4;
constexpr int kHttpReadTimeoutSeconds = 2;

// Set while the accepting thread itself answers a connection over the cap.
thread_local bool t_over_connection_cap = false;

// httplib's thread pool with a cap on connections served or queued. One
// over the cap is processed right away on the accepting thread (httplib
// hands the queue an opaque task, not the socket), where the pre-routing
// handler sees t_over_connection_cap and answers 503; with one request per
// connection and a short read timeout that closes it promptly. So sockets
// and queued tasks never exceed the cap plus one.
class CappedTaskQueue final : public httplib::TaskQueue {
 public:
  CappedTaskQueue(int threads, int max_connections)
      : max_connections_(max_connections), pool_(threads) {}

  void enqueue(std::function<void()> task) override {
    if (outstanding_.load() >= max_connections_) {
      t_over_connection_cap = true;
      task();
      t_over_connection_cap = false;
      return;
    }
    outstanding_.fetch_add(1);
    pool_.enqueue([this, task = std::move(task)] {
      task();
      outstanding_.fetch_sub(1);
    });
  }

  void shutdown() override { pool_.shutdown(); }

 private:
  const int max_connections_;
  std::atomic<int> outstanding_{0};
  httplib::ThreadPool pool_;
};

}  // namespace

const char* RpcName(Rpc rpc) { return kRpcNames[static_cast<int>(rpc)]; }

Metrics::Metrics(std::function<Gauges()> read_gauges) : read_gauges_(std::move(read_gauges)) {
  static_assert(sizeof(kBucketBounds) / sizeof(double) == kBucketCount);
}

Metrics::~Metrics() { StopHttp(); }

void Metrics::set_gauge_reader(std::function<Gauges()> read_gauges) {
  read_gauges_ = std::move(read_gauges);
}

void Metrics::RecordRpc(Rpc rpc, int code, absl::Duration duration) {
  PerRpc& stats = per_rpc_[static_cast<int>(rpc)];
  if (code < 0 || code >= kCodeCount) code = 2;  // UNKNOWN
  stats.calls[code].fetch_add(1, std::memory_order_relaxed);
  double seconds = absl::ToDoubleSeconds(duration);
  int bucket = 0;
  while (bucket < kBucketCount && seconds > kBucketBounds[bucket]) ++bucket;
  stats.buckets[bucket].fetch_add(1, std::memory_order_relaxed);
  stats.duration_sum_ns.fetch_add(static_cast<uint64_t>(absl::ToInt64Nanoseconds(duration)),
                                  std::memory_order_relaxed);
  stats.duration_count.fetch_add(1, std::memory_order_relaxed);
}

std::string Metrics::Render() const {
  Gauges gauges;
  if (read_gauges_) gauges = read_gauges_();
  std::string out;
  Header(&out, "muster_rdzv_jobs", "gauge", "Jobs the server holds.");
  absl::StrAppend(&out, "muster_rdzv_jobs ", gauges.jobs, "\n");
  Header(&out, "muster_rdzv_jobs_by_phase", "gauge",
         "Jobs the server holds, by phase; finished ones until they are dropped.");
  for (const char* phase : {"gathering", "running", "succeeded", "failed", "closed"}) {
    auto count = gauges.jobs_by_phase.find(phase);
    absl::StrAppend(&out, "muster_rdzv_jobs_by_phase{phase=\"", phase, "\"} ",
                    count == gauges.jobs_by_phase.end() ? 0 : count->second, "\n");
  }
  Header(&out, "muster_rdzv_members", "gauge", "Members across all jobs.");
  absl::StrAppend(&out, "muster_rdzv_members ", gauges.members, "\n");
  Header(&out, "muster_rdzv_watch_streams", "gauge", "Open Watch streams.");
  absl::StrAppend(&out, "muster_rdzv_watch_streams ", watch_streams_.load(), "\n");
  Header(&out, "muster_rdzv_rounds_total", "counter", "Rounds that closed and started running.");
  absl::StrAppend(&out, "muster_rdzv_rounds_total ", rounds_total_.load(), "\n");
  Header(&out, "muster_rdzv_restarts_total", "counter",
         "Failure restarts counted against jobs' budgets.");
  absl::StrAppend(&out, "muster_rdzv_restarts_total ", restarts_total_.load(), "\n");

  Header(&out, "muster_rdzv_rpcs_total", "counter", "Finished RPCs by method and status code.");
  for (int rpc = 0; rpc < kRpcCount; ++rpc) {
    for (int code = 0; code < kCodeCount; ++code) {
      uint64_t calls = per_rpc_[rpc].calls[code].load();
      if (calls == 0) continue;
      absl::StrAppend(&out, "muster_rdzv_rpcs_total{method=\"", kRpcNames[rpc], "\",code=\"",
                      absl::StatusCodeToString(static_cast<absl::StatusCode>(code)), "\"} ", calls,
                      "\n");
    }
  }

  Header(&out, "muster_rdzv_rpc_duration_seconds", "histogram",
         "Time from an RPC's arrival to its reply.");
  for (int rpc = 0; rpc < kRpcCount; ++rpc) {
    const PerRpc& stats = per_rpc_[rpc];
    uint64_t count = stats.duration_count.load();
    if (count == 0) continue;
    uint64_t cumulative = 0;
    for (int bucket = 0; bucket <= kBucketCount; ++bucket) {
      cumulative += stats.buckets[bucket].load();
      std::string bound =
          bucket < kBucketCount ? FormatDouble(kBucketBounds[bucket]) : std::string("+Inf");
      absl::StrAppend(&out, "muster_rdzv_rpc_duration_seconds_bucket{method=\"", kRpcNames[rpc],
                      "\",le=\"", bound, "\"} ", cumulative, "\n");
    }
    absl::StrAppend(&out, "muster_rdzv_rpc_duration_seconds_sum{method=\"", kRpcNames[rpc], "\"} ",
                    FormatDouble(stats.duration_sum_ns.load() / 1e9), "\n");
    absl::StrAppend(&out, "muster_rdzv_rpc_duration_seconds_count{method=\"", kRpcNames[rpc],
                    "\"} ", count, "\n");
  }
  return out;
}

absl::StatusOr<int> Metrics::StartHttp(const HttpOptions& options) {
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics max_connections is ", options.max_connections, "; expected at least 1"));
  }
  std::unique_ptr<httplib::Server> http;
  if (options.https != nullptr) {
    // httplib makes the context and runs each connection's handshake on the
    // thread that serves it (or, over the cap, on the accepting thread);
    // each wait there for the client's bytes ends after the read timeout
    // set below, so a client that sends no ClientHello frees its place.
    http = std::make_unique<httplib::SSLServer>(
        [https = options.https.get()](SSL_CTX& context) { return https->Configure(context); });
    if (!http->is_valid()) {
      return absl::InternalError("OpenSSL refused the TLS settings of the metrics endpoint");
    }
  } else {
    http = std::make_unique<httplib::Server>();
  }
  // httplib's default sets SO_REUSEPORT, which lets a second server bind the
  // same port: scrapes would then land on either at random, past the
  // other's --metrics-require-token. SO_REUSEADDR alone still allows a
  // quick restart over connections in TIME_WAIT, and a taken port fails.
  http->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const int threads = std::min(options.max_connections, kHttpThreads);
  const int max_connections = options.max_connections;
  http->new_task_queue = [threads, max_connections] {
    return new CappedTaskQueue(threads, max_connections);
  };
  // One request per connection, and a short wait for it: a scraper needs no
  // more, and a connection refused over the cap is read on the accepting
  // thread.
  http->set_keep_alive_max_count(1);
  http->set_read_timeout(kHttpReadTimeoutSeconds, 0);
  http->set_write_timeout(kHttpReadTimeoutSeconds, 0);
  http->set_pre_routing_handler([authorize = options.authorize](const httplib::Request& request,
                                                                httplib::Response& response) {
    if (t_over_connection_cap) {
      response.status = 503;
      response.set_header("Connection", "close");
      response.set_content("too many connections to /metrics\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (authorize && !authorize(request.get_header_value("Authorization"))) {
      response.status = 401;
      response.set_header("WWW-Authenticate", "Bearer");
      response.set_content("expected 'Authorization: Bearer <token>'\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  int bound_port = options.port;
  if (options.port <= 0) {
    bound_port = http->bind_to_any_port(options.address);
    if (bound_port < 0) bound_port = 0;
  } else if (!http->bind_to_port(options.address.c_str(), options.port)) {
    bound_port = 0;
  }
  if (bound_port <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind the metrics endpoint to ", options.address, ":", options.port));
  }
  https_ = options.https;
  http_ = std::move(http);
  http_thread_ = std::thread([server = http_.get()] { server->listen_after_bind(); });
  // stop() is a no-op until listen has begun, so StopHttp right after this
  // could otherwise leave the thread listening forever.
  absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (!http_->is_running() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return bound_port;
}

void Metrics::StopHttp() {
  if (http_) http_->stop();
  if (http_thread_.joinable()) http_thread_.join();
  http_.reset();
  https_.reset();
}

}  // namespace muster::rdzv
