// Server::Start: wires the token check, TLS, the state file, the service,
// metrics and health checking into one grpc::Server.
#include "rendezvous/server/server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "rendezvous/server/auth.h"
#include "rendezvous/server/https_credentials.h"
#include "rendezvous/server/metrics.h"
#include "rendezvous/server/persistence.h"
#include "rendezvous/server/service.h"
#include "rendezvous/server/tls_check.h"
#include "rendezvous/server/tls_mirror.h"
#include "spdlog/spdlog.h"

namespace muster::rdzv {
namespace {

// Room for the rest of a Set request around a value of max_value_bytes, so
// an oversized value reaches the state machine's RESOURCE_EXHAUSTED check
// instead of being cut off by gRPC.
constexpr size_t kMessageOverhead = 64 * 1024;

// "host:port" or "[v6]:port" with a port in 0..65535.
absl::Status ValidateListenAddress(const std::string& address) {
  size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", address, "' is not host:port (port 0..65535)"));
  }
  return absl::OkStatus();
}

// gRPC reports a port it cannot bind only in a multi-line log entry and a
// null server, with no cause it returns; binding the address once here
// first gets the cause (errno, or the resolver's) for a one-line error. A
// host that resolves to several addresses needs one of them, as gRPC does.
absl::Status ProbeListenAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", address, "': cannot resolve '", host,
                     "': ", rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc)));
  }
  std::string first_error;
  bool bound = false;
  for (addrinfo* candidate = found; candidate != nullptr && !bound;
       candidate = candidate->ai_next) {
    int fd =
        socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC, candidate->ai_protocol);
    if (fd >= 0) {
      // As gRPC binds: a port left in TIME_WAIT by a server before is free.
      int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      bound = bind(fd, candidate->ai_addr, candidate->ai_addrlen) == 0;
    }
    if (!bound && first_error.empty()) first_error = strerror(errno);
    if (fd >= 0) close(fd);
  }
  freeaddrinfo(found);
  if (bound) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("cannot listen on '", address, "': ", first_error));
}

absl::Status ValidateQuotas(const ServerOptions& options) {
  if (options.max_watch_streams == 0 || options.max_watch_streams_per_job == 0 ||
      options.max_waiters_per_job == 0 || options.max_jobs_per_identity == 0 ||
      options.metrics_max_connections < 1) {
    return absl::InvalidArgumentError(
        "max_watch_streams, max_watch_streams_per_job, max_waiters_per_job, "
        "max_jobs_per_identity and metrics_max_connections must be at least 1");
  }
  if (options.keepalive_time <= absl::ZeroDuration() ||
      options.keepalive_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("keepalive_time and keepalive_timeout must be positive");
  }
  if (options.metrics_require_token && options.metrics_plaintext) {
    return absl::InvalidArgumentError(
        "metrics_require_token (--metrics-require-token) with metrics_plaintext "
        "(--metrics-plaintext) would send the bearer token over plain HTTP, in clear text; "
        "drop one of them");
  }
  if (options.metrics_require_token && options.token_file.empty()) {
    return absl::InvalidArgumentError(
        "metrics_require_token needs a token_file: there is no token to require");
  }
  return absl::OkStatus();
}

int Milliseconds(absl::Duration duration) {
  return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(duration), 1, INT_MAX));
}

class ServerImpl final : public Server {
 public:
  explicit ServerImpl(ServerOptions options) : options_(std::move(options)) {}
  ~ServerImpl() override { Shutdown(absl::Seconds(2)); }

  absl::Status Init();

  int port() const override { return port_; }
  int metrics_port() const override { return metrics_port_; }
  void Shutdown(absl::Duration grace) override;
  void Wait() override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&shutdown_done_));
  }

 private:
  ServerOptions options_;
  std::optional<StateFile> state_file_;
  // With TLS: the operator's files as last loaded, and the copies of them
  // the gRPC port reads (tls_mirror.h); declared before grpc_server_ and
  // metrics_, which read them, so they go after those.
  std::shared_ptr<HttpsCredentials> tls_source_;
  std::unique_ptr<TlsMirror> tls_mirror_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<RendezvousService> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  int port_ = 0;
  int metrics_port_ = 0;

  absl::Mutex mu_;
  bool shutdown_started_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_done_ ABSL_GUARDED_BY(mu_) = false;
};

absl::Status ServerImpl::Init() {
  absl::Status address_ok = ValidateListenAddress(options_.listen_address);
  if (!address_ok.ok()) return address_ok;
  absl::Status quotas_ok = ValidateQuotas(options_);
  if (!quotas_ok.ok()) return quotas_ok;
  absl::Status bindable = ProbeListenAddress(options_.listen_address);
  if (!bindable.ok()) return bindable;
  if (options_.credentials_refresh <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("credentials_refresh must be positive");
  }
  absl::StatusOr<TokenChecker> tokens =
      TokenChecker::FromFile(options_.token_file, options_.credentials_refresh);
  if (!tokens.ok()) return tokens.status();
  const TlsFiles tls_files = {options_.tls_cert_file, options_.tls_key_file,
                              options_.tls_client_ca_file};
  // gRPC watches copies of the files that loaded, not the files (tls_mirror.h).
  auto mirror = [&]() -> absl::StatusOr<TlsFiles> {
    absl::StatusOr<std::unique_ptr<HttpsCredentials>> loaded =
        HttpsCredentials::Load(tls_files, options_.credentials_refresh);
    if (!loaded.ok()) return loaded.status();
    tls_source_ = *std::move(loaded);
    absl::StatusOr<std::unique_ptr<TlsMirror>> started = TlsMirror::Start(
        tls_source_, options_.credentials_refresh, !options_.tls_client_ca_file.empty());
    if (!started.ok()) return started.status();
    tls_mirror_ = *std::move(started);
    return tls_mirror_->files();
  };
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      BuildServerCredentials(tls_files, options_.credentials_refresh, mirror);
  if (!credentials.ok()) return credentials.status();
  if (!options_.tls_client_ca_file.empty()) {
    absl::Status client_ca = CheckClientCaLoads(options_.tls_client_ca_file);
    if (!client_ca.ok()) return client_ca;
  }
  if (!options_.tls_cert_file.empty()) WarnIfCertificateOutOfDate(options_.tls_cert_file);
  if (!options_.state_dir.empty()) {
    absl::StatusOr<StateFile> file = StateFile::Open(options_.state_dir);
    if (!file.ok()) return file.status();
    state_file_.emplace(*std::move(file));
  }

  metrics_ = std::make_unique<Metrics>();
  ServiceOptions service_options;
  service_options.limits = options_.limits;
  service_options.clock = options_.clock != nullptr ? options_.clock : MonotonicClock::Default();
  service_options.tokens = *tokens;
  service_options.metrics = metrics_.get();
  service_options.state_file = state_file_ ? &*state_file_ : nullptr;
  service_options.max_watch_streams = options_.max_watch_streams;
  service_options.max_watch_streams_per_job = options_.max_watch_streams_per_job;
  service_options.max_waiters_per_job = options_.max_waiters_per_job;
  service_options.max_jobs_per_identity = options_.max_jobs_per_identity;
  service_ = std::make_unique<RendezvousService>(std::move(service_options));
  absl::Status restored = service_->RestoreFromDisk();
  if (!restored.ok()) return restored;
  metrics_->set_gauge_reader([service = service_.get()] { return service->ReadGauges(); });
  service_->Start();

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.listen_address, *credentials, &port_);
  builder.RegisterService(service_.get());
  size_t max_message = options_.limits.max_value_bytes + kMessageOverhead;
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<size_t>(max_message, INT_MAX)));
  // Clients ping every 10 s to notice a dead connection (ChannelArgumentsFor
  // in rendezvous/client/rpc.h), with or without calls; never punish that:
  // no GOAWAY ("too_many_pings") however often pings come (0 strikes =
  // unlimited).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // And the server pings its clients: a client that vanished without a
  // FIN (power loss, a dropped NAT flow) loses its connection, and so its
  // Watch streams and their places in the quotas, within keepalive_time +
  // keepalive_timeout instead of when TCP gives up.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, Milliseconds(options_.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             Milliseconds(options_.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Two servers on one port would split the clients between them.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", options_.listen_address,
                     "' (bound by another process since it was tried, or TLS credentials gRPC "
                     "refused; see gRPC's log above)"));
  }
  if (grpc::HealthCheckServiceInterface* health = grpc_server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
  }

  if (options_.metrics_port != 0) {
    Metrics::HttpOptions http;
    http.address = MetricsAddress(options_);
    http.port = options_.metrics_port;
    http.max_connections = options_.metrics_max_connections;
    if (options_.metrics_require_token) {
      http.authorize = [tokens = *tokens](const std::string& authorization) {
        return tokens.CheckAuthorization(authorization).ok();
      };
    }
    if (MetricsUseTls(options_)) http.https = tls_source_;  // the gRPC port's files
    absl::StatusOr<int> bound = metrics_->StartHttp(http);
    if (!bound.ok()) {
      // httplib says only that it could not bind; a bind of our own says why.
      absl::Status why =
          ProbeListenAddress(absl::StrCat(http.address, ":", std::max(http.port, 0)));
      if (!why.ok()) {
        return absl::UnavailableError(absl::StrCat("cannot serve /metrics: ", why.message()));
      }
      return bound.status();
    }
    metrics_port_ = *bound;
  } else if (options_.metrics_require_token || options_.metrics_plaintext ||
             !options_.metrics_address.empty()) {
    spdlog::warn(
        "rendezvous: --metrics-require-token, --metrics-plaintext and --metrics-address do "
        "nothing without --metrics-port");
  }
  return absl::OkStatus();
}

void ServerImpl::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_started_) {
      mu_.Await(absl::Condition(&shutdown_done_));
      return;
    }
    shutdown_started_ = true;
  }
  if (grpc_server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = grpc_server_->GetHealthCheckService()) {
      health->Shutdown();
    }
  }
  // Streams and blocked calls end first: gRPC's Shutdown waits for every
  // open call to be finished.
  if (service_) service_->BeginShutdown();
  if (grpc_server_ != nullptr) {
    grpc_server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  }
  if (service_) {
    absl::Status saved = service_->Stop();
    if (!saved.ok()) {
      spdlog::error("rendezvous: final state write failed: {}", saved.ToString());
    }
  }
  if (state_file_) state_file_->ReleaseLock();  // nothing more is written
  if (metrics_) metrics_->StopHttp();
  absl::MutexLock lock(&mu_);
  shutdown_done_ = true;
}

}  // namespace

std::string MetricsAddress(const ServerOptions& options) {
  std::string host = !options.metrics_address.empty()
                         ? options.metrics_address
                         : options.listen_address.substr(0, options.listen_address.rfind(':'));
  // "[::1]", as --listen writes an IPv6 host, is "::1" to bind.
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

bool MetricsUseTls(const ServerOptions& options) {
  return !options.tls_cert_file.empty() && !options.metrics_plaintext;
}

std::string MetricsUrl(const ServerOptions& options, int port) {
  std::string host = MetricsAddress(options);
  if (host.find(':') != std::string::npos) host = absl::StrCat("[", host, "]");
  return absl::StrCat(MetricsUseTls(options) ? "https" : "http", "://", host, ":", port,
                      "/metrics");
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  auto server = std::make_unique<ServerImpl>(std::move(options));
  absl::Status started = server->Init();
  if (!started.ok()) {
    server->Shutdown(absl::ZeroDuration());
    return started;
  }
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace muster::rdzv
