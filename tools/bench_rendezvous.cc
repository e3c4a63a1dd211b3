// bench_rendezvous: how fast one rendezvous server forms a big round.
//
// Starts the real `rendezvous` binary on a free loopback port (or uses
// --endpoint), then simulates --nodes nodes joining one job with
// min = max = nodes. Every node joins with an async (callback) Join and
// then follows the job over its own Watch stream, so 1000 nodes need no
// 1000 threads. Reports the time until every node has seen the RUNNING
// round with itself in it, Join latency, KeepAlive renewals/s, store
// Set/s and Get/s, and the server's peak RSS. Exits non-zero on errors
// only, not on missed goals.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "rendezvous/client/client.h"
#include "tools/bench_calls.h"
#include "tools/server_process.h"

namespace muster::tools {
namespace {

using rdzv::Client;
namespace pb = rdzv::pb;

struct Flags {
  std::string server;
  std::string endpoint;
  int nodes = 1000;
  int channels = 8;
  int in_flight = 64;
  double phase_seconds = 3;
  bool server_output = false;
};

int Run(const Flags& flags) {
  std::unique_ptr<ServerProcess> server;
  std::string endpoint = flags.endpoint;
  if (endpoint.empty()) {
    ServerProcessOptions options;
    options.binary =
        flags.server.empty() ? ExecutableDir() + "/../rendezvous/rendezvous" : flags.server;
    options.echo_output = flags.server_output;
    auto started = ServerProcess::Start(options);
    if (!started.ok()) {
      std::fprintf(stderr, "bench_rendezvous: %s\n", started.status().ToString().c_str());
      return 1;
    }
    server = *std::move(started);
    endpoint = server->endpoint();
    std::printf("server: pid %d on %s\n", server->pid(), endpoint.c_str());
  } else {
    std::printf("server: %s (running elsewhere; RSS not measured)\n", endpoint.c_str());
  }

  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < flags.channels; ++i) {
    rdzv::ClientOptions options;
    options.endpoint = endpoint;
    auto client = Client::Connect(options);
    if (!client.ok()) {
      std::fprintf(stderr, "bench_rendezvous: %s\n", client.status().ToString().c_str());
      return 1;
    }
    clients.push_back(*std::move(client));
  }

  const std::string job_id = absl::StrCat("bench-", absl::ToUnixMicros(absl::Now()));
  RendezvousResult rendezvous;
  RunRendezvous(clients, job_id, flags.nodes, absl::Seconds(60), &rendezvous);
  if (!rendezvous.error.ok()) {
    std::fprintf(stderr, "bench_rendezvous: rendezvous failed: %s\n",
                 rendezvous.error.ToString().c_str());
    return 1;
  }
  const absl::Duration phase = absl::Seconds(flags.phase_seconds);
  Throughput renewals =
      RunKeepAlives(clients, job_id, rendezvous.member_ids, flags.in_flight, phase);
  Throughput sets = RunStoreSets(clients, job_id, rendezvous.round, flags.in_flight, phase);
  Throughput gets =
      RunStoreGets(clients, job_id, rendezvous.round, flags.in_flight, phase, sets.ok);

  const double rendezvous_s = absl::ToDoubleSeconds(rendezvous.all_running);
  std::printf("\n%-34s %d (job %s, round %llu, %d channels)\n", "nodes", flags.nodes,
              job_id.c_str(), static_cast<unsigned long long>(rendezvous.round), flags.channels);
  std::printf(
      "%-34s %.3f s   (goal < 2 s: %s; every node learnt it over its "
      "own Watch stream)\n",
      "rendezvous complete (all nodes)", rendezvous_s, rendezvous_s < 2 ? "met" : "MISSED");
  std::printf("%-34s %.3f s\n", "  of which: all joins answered",
              absl::ToDoubleSeconds(rendezvous.all_joined));
  std::printf("%-34s %lld (%.1f per node)\n", "  watch states received",
              static_cast<long long>(rendezvous.watch_messages),
              static_cast<double>(rendezvous.watch_messages) / flags.nodes);
  std::printf("%-34s p50 %.2f ms, p99 %.2f ms, max %.2f ms\n", "join latency",
              rendezvous.join_latency_ms.Percentile(50), rendezvous.join_latency_ms.Percentile(99),
              rendezvous.join_latency_ms.Percentile(100));
  const double renewal_rate = renewals.PerSecond();
  std::printf(
      "%-34s %.0f /s  (goal >= 20000: %s; %d in flight for %.1f s, "
      "%lld errors)\n",
      "keepalive renewals", renewal_rate, renewal_rate >= 20000 ? "met" : "MISSED", flags.in_flight,
      flags.phase_seconds, static_cast<long long>(renewals.failed));
  std::printf("%-34s %.0f /s  (%lld errors)\n", "store Set", sets.PerSecond(),
              static_cast<long long>(sets.failed));
  std::printf("%-34s %.0f /s  (%lld errors)\n", "store Get", gets.PerSecond(),
              static_cast<long long>(gets.failed));
  bool errors = renewals.failed > 0 || sets.failed > 0 || gets.failed > 0;
  if (server != nullptr) {
    auto rss = server->PeakRssKib();
    if (rss.ok()) {
      const double mib = *rss / 1024.0;
      std::printf("%-34s %.1f MiB  (goal < 200 MB: %s)\n", "server peak RSS (VmHWM)", mib,
                  *rss * 1024.0 < 200e6 ? "met" : "MISSED");
    } else {
      std::printf("%-34s unknown: %s\n", "server peak RSS", rss.status().ToString().c_str());
    }
    (void)server->Kill(SIGTERM);
    if (!server->Wait(absl::Now() + absl::Seconds(10)).ok()) {
      std::fprintf(stderr, "bench_rendezvous: server ignored SIGTERM\n");
    }
  }
  if (errors) std::fprintf(stderr, "bench_rendezvous: some calls failed\n");
  return errors ? 1 : 0;
}

}  // namespace
}  // namespace muster::tools

int main(int argc, char** argv) {
  muster::tools::Flags flags;
  CLI::App app{"Benchmark a rendezvous server with many simulated nodes"};
  app.add_option("--server", flags.server,
                 "rendezvous binary (default: ../rendezvous/rendezvous next "
                 "to this binary)");
  app.add_option("--endpoint", flags.endpoint, "use a running server instead of starting one");
  app.add_option("--nodes", flags.nodes, "simulated nodes")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--channels", flags.channels, "client connections")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--in-flight", flags.in_flight, "concurrent calls in the throughput phases")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--phase-seconds", flags.phase_seconds, "length of each throughput phase")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--server-output", flags.server_output, "echo the server's log to stderr");
  CLI11_PARSE(app, argc, argv);
  return muster::tools::Run(flags);
}
