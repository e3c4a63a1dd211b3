// The `rendezvous` binary: one rendezvous server until SIGTERM or SIGINT.
// SIGHUP, SIGUSR1 and SIGUSR2 are logged and ignored.
//
// Prints "rendezvous: listening on <host>:<port>" once it serves (tools and
// tests wait for that line). Exit codes: 0 after a graceful shutdown, 2 for
// bad flags or a server that cannot start (one line on stderr says why).
#include <pthread.h>
#include <signal.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "rendezvous/server/server.h"
#include "spdlog/spdlog.h"

namespace {

constexpr int kExitUsage = 2;

// A number above (or, with `or_equal`, at least) `bound`: CLI11's
// PositiveNumber and NonNegativeNumber print their range with a 310-digit
// maximum and the bound they exclude ("0 not in range 0 to 1797..."), and
// let NaN through.
CLI::Validator Above(double bound, bool or_equal = false) {
  const std::string wanted = absl::StrCat(or_equal ? ">= " : "> ", bound);
  return CLI::Validator(
      [bound, or_equal, wanted](std::string& text) -> std::string {
        double value = 0;
        if (absl::SimpleAtod(text, &value) && std::isfinite(value) &&
            (or_equal ? value >= bound : value > bound)) {
          return "";
        }
        return absl::StrCat("must be a number ", wanted, ", not '", text, "'");
      },
      wanted);
}

// The host part of host:port, as the listening line shows it.
std::string HostOf(const std::string& listen_address) {
  size_t colon = listen_address.rfind(':');
  return colon == std::string::npos ? listen_address : listen_address.substr(0, colon);
}

}  // namespace

int main(int argc, char** argv) {
  muster::rdzv::ServerOptions options;
  muster::rdzv::Limits defaults;
  std::string log_level = "info";
  double closed_retention_s = absl::ToDoubleSeconds(defaults.closed_retention);
  double idle_retention_s = absl::ToDoubleSeconds(defaults.idle_retention);

  CLI::App app("muster rendezvous server", "rendezvous");
  app.add_option("--listen", options.listen_address,
                 "host:port to serve gRPC on (port 0 picks one)")
      ->capture_default_str();
  app.add_option("--state-dir", options.state_dir,
                 "directory for durable state (empty: memory only)");
  app.add_option("--token-file", options.token_file,
                 "file holding the bearer tokens a call may present, one a line");
  app.add_option("--tls-cert", options.tls_cert_file, "PEM server certificate");
  app.add_option("--tls-key", options.tls_key_file, "PEM server private key");
  app.add_option("--tls-client-ca", options.tls_client_ca_file,
                 "PEM CA that client certificates must chain to (mTLS)");
  double credentials_refresh_s = absl::ToDoubleSeconds(options.credentials_refresh);
  app.add_option("--credentials-refresh", credentials_refresh_s,
                 "seconds between looks at the token and TLS files for a change, which takes "
                 "effect without a restart (the TLS files: rounded up to whole seconds)")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--metrics-port", options.metrics_port, "port for Prometheus /metrics (0: off)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics-address", options.metrics_address,
                 "address /metrics binds to (default: the host of --listen)");
  app.add_option("--metrics-max-connections", options.metrics_max_connections,
                 "connections /metrics serves or queues at once; more get 503")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_flag("--metrics-require-token", options.metrics_require_token,
               "/metrics requires 'Authorization: Bearer <token>' "
               "(the --token-file token), else 401");
  app.add_flag("--metrics-plaintext", options.metrics_plaintext,
               "serve /metrics over plain HTTP even with --tls-cert (a scraper on this host); "
               "not with --metrics-require-token");
  app.add_option("--max-watch-streams", options.max_watch_streams,
                 "open Watch streams on this server")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-watch-streams-per-job", options.max_watch_streams_per_job,
                 "open Watch streams on one job")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-waiters-per-job", options.max_waiters_per_job,
                 "blocked Get and Wait calls on one job")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-jobs-per-identity", options.max_jobs_per_identity,
                 "jobs that callers presenting one job secret (or none) may "
                 "have at once")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|critical|off")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
  app.add_option("--max-value-bytes", options.limits.max_value_bytes, "largest store value")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-key-bytes", options.limits.max_key_bytes, "largest store key")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-keys-per-job", options.limits.max_keys_per_job,
                 "keys in one job's round store")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-members-per-job", options.limits.max_members_per_job, "members of one job")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-jobs", options.limits.max_jobs, "jobs on this server")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-keys-per-request", options.limits.max_keys_per_request,
                 "keys one MultiGet or Wait may name")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-response-bytes", options.limits.max_response_bytes,
                 "bytes of values one MultiGet may return (>= --max-value-bytes)")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-job-bytes", options.limits.max_job_bytes,
                 "bytes one job may hold: store keys and values, members, "
                 "records")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-total-bytes", options.limits.max_total_bytes,
                 "bytes all jobs together may hold (bounds the state file)")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--max-join-timeout-ms", options.limits.max_join_timeout_ms,
                 "longest join_timeout_ms a new job may ask for")
      ->capture_default_str()
      ->check(Above(0));
  app.add_option("--closed-retention", closed_retention_s,
                 "seconds a finished job is kept before it is dropped")
      ->capture_default_str()
      ->check(Above(0, /*or_equal=*/true));
  app.add_option("--idle-retention", idle_retention_s,
                 "seconds a job that every member has left is kept before it is dropped")
      ->capture_default_str()
      ->check(Above(0, /*or_equal=*/true));

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForAllHelp& help) {
    return app.exit(help);
  } catch (const CLI::ParseError& error) {
    std::cerr << "rendezvous: " << error.what() << " (see --help)\n";
    return kExitUsage;
  }
  spdlog::set_level(spdlog::level::from_str(log_level));
  options.limits.closed_retention = absl::Seconds(closed_retention_s);
  options.limits.idle_retention = absl::Seconds(idle_retention_s);
  options.credentials_refresh = absl::Seconds(credentials_refresh_s);
  if (absl::Status limits = muster::rdzv::ValidateLimits(options.limits); !limits.ok()) {
    std::cerr << "rendezvous: " << limits.message() << " (see --help)\n";
    return kExitUsage;
  }

  // Block the signals handled here in every thread (gRPC's threads inherit
  // this mask) so that this thread alone receives them through sigwait.
  // HUP, USR1 and USR2 would otherwise kill the server without a word (a
  // closed SSH session, a reload by habit); there is nothing to reload, as
  // credentials are read again when their files change, so they are
  // logged and ignored.
  sigset_t handled_signals;
  sigemptyset(&handled_signals);
  for (int signal_number : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2}) {
    sigaddset(&handled_signals, signal_number);
  }
  pthread_sigmask(SIG_BLOCK, &handled_signals, nullptr);

  absl::StatusOr<std::unique_ptr<muster::rdzv::Server>> server =
      muster::rdzv::Server::Start(options);
  if (!server.ok()) {
    std::cerr << "rendezvous: cannot start: " << server.status().message() << "\n";
    return kExitUsage;
  }
  std::printf("rendezvous: listening on %s:%d\n", HostOf(options.listen_address).c_str(),
              (*server)->port());
  if ((*server)->metrics_port() != 0) {
    std::printf("rendezvous: metrics on %s\n",
                muster::rdzv::MetricsUrl(options, (*server)->metrics_port()).c_str());
  }
  std::fflush(stdout);

  int signal_number = 0;
  while (sigwait(&handled_signals, &signal_number) == 0 && signal_number != SIGTERM &&
         signal_number != SIGINT) {
    spdlog::info(
        "rendezvous: SIG{} received and ignored (credentials are read again when their files "
        "change; SIGTERM or SIGINT stops the server)",
        sigabbrev_np(signal_number));
  }
  spdlog::info("rendezvous: SIG{} received, shutting down", sigabbrev_np(signal_number));
  (*server)->Shutdown(absl::Seconds(2));
  return 0;
}
