// An embeddable rendezvous server: the `rendezvous` binary runs one, and
// `launch --standalone` runs one inside the agent.
//
// Thread-safety: Start, port and Shutdown may be called from any thread;
// Shutdown is idempotent and also runs from the destructor.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rendezvous/server/clock.h"
#include "rendezvous/state/state_machine.h"

namespace muster::rdzv {

struct ServerOptions {
  // host:port to listen on; port 0 picks a free port (see Server::port()).
  std::string listen_address = "0.0.0.0:29400";

  // Persistence. Empty: state lives in memory only. Otherwise the directory
  // is created if missing, state is restored from it at start, and every
  // acknowledged mutation is durable there before its reply is sent.
  std::string state_dir;

  // Security. A non-empty token_file holds the bearer tokens an RPC may
  // present ("authorization: Bearer <token>"), one a line (ParseTokenFile
  // in auth.h). TLS is on when tls_cert_file and tls_key_file are set; mTLS
  // when tls_client_ca_file is also set (clients must present a cert it
  // signed). Every credentials_refresh the files are checked for a change
  // and what they hold then is used (new TLS handshakes, the next call's
  // token): credentials rotate without a restart (docs/rendezvous.md).
  std::string token_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  absl::Duration credentials_refresh = absl::Seconds(60);

  // Prometheus text format on <metrics_address>:<metrics_port>/metrics
  // (MetricsUrl). 0 disables it; a negative port picks a free one (see
  // metrics_port()). An empty metrics_address means the host of
  // listen_address, so a server listening on loopback does not publish its
  // metrics to the network. At most metrics_max_connections connections
  // are served or queued at once; beyond that a connection is answered 503
  // and closed. With metrics_require_token (needs token_file), a scrape
  // must send "Authorization: Bearer <token>" or gets 401.
  //
  // With TLS it is HTTPS with the gRPC port's certificate and key, and with
  // tls_client_ca_file a client certificate signed by that CA is required,
  // as on the gRPC port; the files are followed every credentials_refresh
  // as there (HttpsCredentials). metrics_plaintext keeps plain HTTP under
  // TLS (a scraper on the same host); it cannot go with
  // metrics_require_token, whose token would then travel in clear text.
  int metrics_port = 0;
  std::string metrics_address;
  int metrics_max_connections = 16;
  bool metrics_require_token = false;
  bool metrics_plaintext = false;

  // Quotas per tenant, each RESOURCE_EXHAUSTED naming it when exceeded:
  // open Watch streams on the server and on one job, blocked Get and Wait
  // calls on one job, and jobs created per caller identity (the job secret
  // presented; see service.h).
  size_t max_watch_streams = 100000;
  size_t max_watch_streams_per_job = 10000;
  size_t max_waiters_per_job = 10000;
  size_t max_jobs_per_identity = 1000;

  // The server pings each client connection after keepalive_time without
  // activity and drops it when a ping goes unanswered for keepalive_timeout,
  // so the Watch streams of a client that vanished are freed.
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);

  Limits limits;

  // Time source; nullptr means MonotonicClock::Default(). Not owned.
  Clock* clock = nullptr;
};

// The address /metrics binds to: metrics_address, or else the host of
// listen_address ("[::1]:29400" gives "::1").
std::string MetricsAddress(const ServerOptions& options);

// Whether /metrics is served over HTTPS: TLS is on and metrics_plaintext
// is not.
bool MetricsUseTls(const ServerOptions& options);

// Where /metrics is served when bound to `port`:
// "https://[::1]:9400/metrics", or "http://..." (MetricsUseTls).
std::string MetricsUrl(const ServerOptions& options, int port);

class Server {
 public:
  // Starts serving. Errors: INVALID_ARGUMENT for unreadable TLS/token files,
  // a TLS key that is not the certificate's own, a client CA that does not
  // load, a bad address, metrics_require_token without a token_file or with
  // metrics_plaintext, or a quota or keepalive that is not positive,
  // UNAVAILABLE if the port cannot be bound, DATA_LOSS if the state dir
  // holds state that cannot be read.
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options);

  virtual ~Server() = default;

  // The port actually bound (useful with port 0).
  virtual int port() const = 0;
  // The metrics port actually bound, 0 if disabled.
  virtual int metrics_port() const = 0;

  // Stops accepting calls, ends open streams and waits (up to `grace`) for
  // calls in flight, then writes the state one last time.
  virtual void Shutdown(absl::Duration grace = absl::Seconds(2)) = 0;

  // Blocks until Shutdown has completed.
  virtual void Wait() = 0;
};

}  // namespace muster::rdzv
