// /metrics under TLS: HTTPS with the gRPC port's certificate, mTLS, the
// bearer token over HTTPS, the --metrics-plaintext opt-out, certificate
// rotation, and the connection cap and read timeout over TLS; against an
// in-process server, and the `rendezvous` binary for its flags and start-up
// line. Certificates are made at test time with the openssl CLI.
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <httplib.h>
#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "launcher/process.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"
#include "tests/launcher/harness.h"
#include "tests/rendezvous/server/service_test_util.h"

namespace muster::rdzv::testing {
namespace {

namespace harness = ::muster::testing;

// Runs `command` with sh in `dir`; REQUIREs that it succeeds.
void RunIn(const std::string& dir, const std::string& command) {
  INFO(command);
  REQUIRE(command.find('"') == std::string::npos);
  REQUIRE(std::system(("sh -c \"cd '" + dir + "' && " + command + "\" >/dev/null 2>&1").c_str()) ==
          0);
}

// A CA and two certificates it signs, in `dir`: ca.crt, server.crt and
// server.key for 127.0.0.1, client.crt and client.key for a client.
void MakeCertificateSet(const std::string& dir) {
  const std::string new_key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  RunIn(dir, "openssl req -x509 " + new_key +
                 " -keyout ca.key -out ca.crt -days 2 -subj /CN=metrics-tls-test-ca");
  const std::pair<std::string, std::string> leaves[] = {
      {"server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"},
      {"client", "extendedKeyUsage=clientAuth\n"}};
  for (const auto& [name, extensions] : leaves) {
    harness::WriteFile(dir + "/" + name + ".ext", extensions);
    RunIn(dir, absl::StrCat("openssl req ", new_key, " -keyout ", name, ".key -out ", name,
                            ".csr -subj /CN=", name, " && openssl x509 -req -in ", name,
                            ".csr -out ", name, ".crt -extfile ", name,
                            ".ext -CA ca.crt -CAkey ca.key -CAcreateserial -days 2"));
  }
}

// Two certificate sets, under two CAs: dir/a and dir/b.
struct Certificates {
  harness::TempDir dir;
  Certificates() {
    for (const char* set : {"a", "b"}) {
      RunIn(dir.path(), absl::StrCat("mkdir ", set));
      MakeCertificateSet(dir.File(set));
    }
  }
  std::string File(const std::string& set, const std::string& name) const {
    return dir.File(set + "/" + name);
  }
};

// Who scrapes /metrics over HTTPS: the CA it trusts, its certificate (if
// any) and its Authorization header (if any).
struct Scraper {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  std::string authorization;
};

// The status of one GET /metrics over HTTPS on a fresh connection (a new
// handshake), -1 when there is no answer (the handshake failed).
int HttpsStatus(int port, const Scraper& scraper) {
  httplib::SSLClient client("127.0.0.1", port, scraper.cert_file, scraper.key_file);
  client.set_ca_cert_path(scraper.ca_file.c_str());
  client.enable_server_certificate_verification(true);
  client.set_connection_timeout(5);
  client.set_read_timeout(5);
  httplib::Headers headers;
  if (!scraper.authorization.empty()) headers.emplace("Authorization", scraper.authorization);
  httplib::Result scraped = client.Get("/metrics", headers);
  return scraped ? scraped->status : -1;
}

// The same over plain HTTP.
int HttpStatus(int port) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5);
  client.set_read_timeout(5);
  httplib::Result scraped = client.Get("/metrics");
  return scraped ? scraped->status : -1;
}

// 127.0.0.1:port.
sockaddr_in LoopbackAddress(int port) {
  return sockaddr_in{AF_INET, htons(static_cast<uint16_t>(port)), {htonl(INADDR_LOOPBACK)}, {}};
}

// A loopback port that was free a moment ago: bound, read back, let go.
int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address = LoopbackAddress(0);
  socklen_t length = sizeof(address);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  close(fd);
  return ntohs(address.sin_port);
}

// A TCP connection to 127.0.0.1:port that sends nothing, not even a
// ClientHello; closed when it goes.
class SilentConnection {
 public:
  explicit SilentConnection(int port) : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address = LoopbackAddress(port);
    REQUIRE(connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  }
  ~SilentConnection() { close(fd_); }

  // Whether the server closes it (end of stream or a reset) within
  // `timeout`.
  bool ClosedByServerWithin(absl::Duration timeout) {
    pollfd ready = {fd_, POLLIN, 0};
    if (poll(&ready, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) return false;
    char byte;
    return recv(fd_, &byte, 1, 0) <= 0;
  }

 private:
  const int fd_;
};

// The server's log lines while it lives: spdlog's default logger is
// replaced by one that keeps them.
class LogLines {
 public:
  LogLines()
      : previous_(spdlog::default_logger()),
        sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(1000)) {
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("metrics_tls_test", sink_));
  }
  ~LogLines() { spdlog::set_default_logger(previous_); }

  int Count(const std::string& text) const {
    std::vector<std::string> lines = sink_->last_formatted();
    return static_cast<int>(std::count_if(lines.begin(), lines.end(), [&](const std::string& line) {
      return absl::StrContains(line, text);
    }));
  }

 private:
  std::shared_ptr<spdlog::logger> previous_;
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
};

ServerOptions TlsOptions(const Certificates& certificates) {
  ServerOptions options = LocalOptions();
  options.tls_cert_file = certificates.File("a", "server.crt");
  options.tls_key_file = certificates.File("a", "server.key");
  options.metrics_port = -1;
  return options;
}

TEST_CASE("with TLS, /metrics is HTTPS with the server's certificate") {
  Certificates certificates;
  std::unique_ptr<Server> server = StartOrFail(TlsOptions(certificates));
  const int port = server->metrics_port();
  REQUIRE(port > 0);
  const Scraper trusting_a{certificates.File("a", "ca.crt")};
  const Scraper trusting_b{certificates.File("b", "ca.crt")};

  httplib::SSLClient client("127.0.0.1", port);
  client.set_ca_cert_path(trusting_a.ca_file.c_str());
  client.enable_server_certificate_verification(true);
  httplib::Result scraped = client.Get("/metrics");
  REQUIRE(scraped);
  CHECK(scraped->status == 200);
  CHECK(absl::StrContains(scraped->body, "muster_rdzv_jobs 0"));

  CHECK(HttpsStatus(port, trusting_b) == -1);  // not the certificate it trusts
  CHECK(HttpStatus(port) == -1);               // plain HTTP makes no handshake
  // Failed handshakes cost the endpoint nothing.
  CHECK(HttpsStatus(port, trusting_a) == 200);
  CHECK(MetricsUrl(TlsOptions(certificates), port) ==
        absl::StrCat("https://127.0.0.1:", port, "/metrics"));
}

TEST_CASE("with mTLS, /metrics requires a client certificate the client CA signed") {
  Certificates certificates;
  ServerOptions options = TlsOptions(certificates);
  options.tls_client_ca_file = certificates.File("a", "ca.crt");
  std::unique_ptr<Server> server = StartOrFail(options);
  const int port = server->metrics_port();
  const std::string ca = certificates.File("a", "ca.crt");

  CHECK(HttpsStatus(port, {ca}) == -1);
  CHECK(HttpsStatus(port, {ca, certificates.File("b", "client.crt"),
                           certificates.File("b", "client.key")}) == -1);  // another CA's
  CHECK(HttpsStatus(port, {ca, certificates.File("a", "client.crt"),
                           certificates.File("a", "client.key")}) == 200);
}

TEST_CASE("/metrics over HTTPS can require the bearer token") {
  Certificates certificates;
  harness::WriteFile(certificates.dir.File("token"), "metrics-token\n");
  ServerOptions options = TlsOptions(certificates);
  options.token_file = certificates.dir.File("token");
  options.metrics_require_token = true;
  std::unique_ptr<Server> server = StartOrFail(options);
  Scraper scraper{certificates.File("a", "ca.crt")};
  CHECK(HttpsStatus(server->metrics_port(), scraper) == 401);
  scraper.authorization = "Bearer wrong";
  CHECK(HttpsStatus(server->metrics_port(), scraper) == 401);
  scraper.authorization = "Bearer metrics-token";
  CHECK(HttpsStatus(server->metrics_port(), scraper) == 200);
}

TEST_CASE("metrics_plaintext keeps /metrics on plain HTTP under TLS, never with a token") {
  Certificates certificates;
  ServerOptions options = TlsOptions(certificates);
  options.metrics_plaintext = true;
  {
    std::unique_ptr<Server> server = StartOrFail(options);
    CHECK(HttpStatus(server->metrics_port()) == 200);
    CHECK(HttpsStatus(server->metrics_port(), {certificates.File("a", "ca.crt")}) == -1);
    CHECK(MetricsUrl(options, server->metrics_port()) ==
          absl::StrCat("http://127.0.0.1:", server->metrics_port(), "/metrics"));
  }
  harness::WriteFile(certificates.dir.File("token"), "metrics-token\n");
  options.token_file = certificates.dir.File("token");
  options.metrics_require_token = true;
  absl::StatusOr<std::unique_ptr<Server>> refused = Server::Start(options);
  REQUIRE(!refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(refused.status().message(), "--metrics-plaintext"));
  CHECK(absl::StrContains(refused.status().message(), "--metrics-require-token"));
}

TEST_CASE("MetricsUrl names the scheme and brackets an IPv6 host") {
  ServerOptions options;
  options.listen_address = "[::1]:29400";
  CHECK(MetricsUrl(options, 9400) == "http://[::1]:9400/metrics");
  options.tls_cert_file = "server.crt";
  CHECK(MetricsUrl(options, 9400) == "https://[::1]:9400/metrics");
  options.metrics_address = "10.0.0.5";
  CHECK(MetricsUrl(options, 9400) == "https://10.0.0.5:9400/metrics");
}

// Renames `from` over `to`, as tools that renew certificates write them.
void Install(const std::string& from, const std::string& to) {
  harness::WriteFile(to + ".new", harness::ReadFile(from));
  REQUIRE(std::rename((to + ".new").c_str(), to.c_str()) == 0);
}

// A server on set A installed at `live_cert` and `live_key`, looking at
// them every 100 ms, with /metrics.
std::unique_ptr<Server> StartOnLiveFiles(const Certificates& certificates,
                                         const std::string& live_cert,
                                         const std::string& live_key) {
  Install(certificates.File("a", "server.crt"), live_cert);
  Install(certificates.File("a", "server.key"), live_key);
  ServerOptions options = LocalOptions();
  options.tls_cert_file = live_cert;
  options.tls_key_file = live_key;
  options.metrics_port = -1;
  options.credentials_refresh = absl::Milliseconds(100);
  return StartOrFail(options);
}

TEST_CASE("/metrics serves a rotated certificate without a restart") {
  LogLines log;
  Certificates certificates;
  const std::string live_cert = certificates.dir.File("live.crt");
  const std::string live_key = certificates.dir.File("live.key");
  std::unique_ptr<Server> server = StartOnLiveFiles(certificates, live_cert, live_key);
  const int port = server->metrics_port();
  auto trusting = [&](const char* set) {
    return HttpsStatus(port, {certificates.File(set, "ca.crt")});
  };
  CHECK(trusting("a") == 200);
  CHECK(trusting("b") == -1);

  // Half a rotation: B's certificate beside A's key. The server looks at
  // the files when a handshake comes, so each poll makes one; it keeps A
  // and says so once.
  const std::string kept = "the gRPC port and /metrics keep the TLS credentials they had";
  Install(certificates.File("b", "server.crt"), live_cert);
  REQUIRE(harness::WaitUntil(
      [&] {
        (void)trusting("a");
        return log.Count(kept) > 0;
      },
      absl::Seconds(10)));
  CHECK(log.Count("does not hold the private key of certificate file '" + live_cert + "'") == 1);
  for (int i = 0; i < 3; ++i) CHECK(trusting("a") == 200);
  CHECK(log.Count(kept) == 1);

  // The key follows: B is served from the next look on.
  Install(certificates.File("b", "server.key"), live_key);
  REQUIRE(harness::WaitUntil([&] { return trusting("b") == 200; }, absl::Seconds(10)));
  CHECK(trusting("a") == -1);
  CHECK(log.Count("the gRPC port and /metrics serve the TLS files '" + live_cert + "'") == 1);
}

// Whether a gRPC client trusting `ca_file` completes a TLS handshake with
// the server's gRPC port.
bool GrpcHandshakes(int port, const std::string& ca_file) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = harness::ReadFile(ca_file);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::SslCredentials(ssl));
  return channel->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
}

TEST_CASE("the gRPC port keeps its TLS credentials through a bad change, an empty file too") {
  // gRPC's file watcher took the files as they were: an empty one (a `cp`
  // caught between its truncate and its write) aborted the server, and a
  // certificate beside its old key failed every handshake until fixed.
  LogLines log;
  Certificates certificates;
  const std::string live_cert = certificates.dir.File("live.crt");
  const std::string live_key = certificates.dir.File("live.key");
  std::unique_ptr<Server> server = StartOnLiveFiles(certificates, live_cert, live_key);
  const int port = server->port();
  CHECK(GrpcHandshakes(port, certificates.File("a", "ca.crt")));
  const std::string kept = "the gRPC port and /metrics keep the TLS credentials they had";

  harness::WriteFile(live_cert, "");  // truncated in place
  REQUIRE(harness::WaitUntil([&] { return log.Count(kept) == 1; }, absl::Seconds(10)));
  absl::SleepFor(absl::Seconds(2));  // gRPC's watcher looks once a second: let it look
  CHECK(GrpcHandshakes(port, certificates.File("a", "ca.crt")));

  Install(certificates.File("b", "server.crt"), live_cert);  // half a rotation
  REQUIRE(harness::WaitUntil([&] { return log.Count(kept) == 2; }, absl::Seconds(10)));
  absl::SleepFor(absl::Seconds(2));
  CHECK(GrpcHandshakes(port, certificates.File("a", "ca.crt")));

  Install(certificates.File("b", "server.key"), live_key);  // the rest of it
  REQUIRE(harness::WaitUntil([&] { return GrpcHandshakes(port, certificates.File("b", "ca.crt")); },
                             absl::Seconds(15)));
  CHECK(!GrpcHandshakes(port, certificates.File("a", "ca.crt")));
}

TEST_CASE("over TLS, the connection cap and the read timeout hold, a silent client included") {
  Certificates certificates;
  ServerOptions options = TlsOptions(certificates);
  options.metrics_max_connections = 1;
  std::unique_ptr<Server> server = StartOrFail(options);
  const int port = server->metrics_port();
  const Scraper scraper{certificates.File("a", "ca.crt")};

  SilentConnection silent(port);
  const absl::Time connected = absl::Now();
  // It takes the one place while the server waits for its ClientHello; a
  // scrape over the cap is answered 503 at once, by the accepting thread.
  absl::Time asked = absl::Now();
  REQUIRE(harness::WaitUntil(
      [&] {
        asked = absl::Now();
        return HttpsStatus(port, scraper) == 503;
      },
      absl::Seconds(2)));
  CHECK(absl::Now() - asked < absl::Seconds(1));
  // The wait for the handshake ends with the read timeout (2 s): the place
  // is freed, not held forever.
  CHECK(silent.ClosedByServerWithin(absl::Seconds(10)));
  CHECK(absl::Now() - connected < absl::Seconds(5));
  CHECK(HttpsStatus(port, scraper) == 200);
}

// The `rendezvous` binary, run to its end; a refused start ends at once.
struct Ended {
  int exit_code = -1;
  std::string err;
};

Ended RunRendezvousToEnd(const std::vector<std::string>& args) {
  launcher::SpawnSpec spec;
  spec.argv = {harness::BinaryPath("rendezvous/rendezvous")};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.pipe_stderr = true;
  absl::StatusOr<launcher::Child> child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  const int err_fd = child->TakeStderr();
  std::optional<launcher::ExitInfo> exit = child->WaitFor(absl::Seconds(30));
  if (!exit.has_value()) child->KillGroupAndReap(absl::Seconds(5));
  Ended ended;
  char buffer[4096];
  for (ssize_t got; (got = read(err_fd, buffer, sizeof(buffer))) > 0;)
    ended.err.append(buffer, got);
  close(err_fd);
  REQUIRE(exit.has_value());
  ended.exit_code = exit->ShellCode();
  return ended;
}

TEST_CASE("the binary refuses --metrics-plaintext with --metrics-require-token") {
  Certificates certificates;
  harness::WriteFile(certificates.dir.File("token"), "metrics-token\n");
  Ended refused = RunRendezvousToEnd(
      {"--listen", "127.0.0.1:0", "--tls-cert", certificates.File("a", "server.crt"), "--tls-key",
       certificates.File("a", "server.key"), "--token-file", certificates.dir.File("token"),
       "--metrics-port", "9400", "--metrics-plaintext", "--metrics-require-token"});
  INFO(refused.err);
  CHECK(refused.exit_code == 2);
  CHECK(absl::StartsWith(refused.err, "rendezvous: cannot start: "));
  CHECK(absl::StrContains(refused.err, "--metrics-plaintext"));
  CHECK(absl::StrContains(refused.err, "--metrics-require-token"));
  CHECK(absl::StrContains(refused.err, "clear text"));
  CHECK(std::count(refused.err.begin(), refused.err.end(), '\n') == 1);
}

TEST_CASE("the binary's start-up line names the scheme of /metrics") {
  Certificates certificates;
  for (bool plaintext : {false, true}) {
    const int port = FreeLoopbackPort();
    std::vector<std::string> args = {"--tls-cert",     certificates.File("a", "server.crt"),
                                     "--tls-key",      certificates.File("a", "server.key"),
                                     "--metrics-port", absl::StrCat(port)};
    if (plaintext) args.push_back("--metrics-plaintext");
    auto server = harness::StartServer(args);
    const std::string line = absl::StrCat("rendezvous: metrics on ", plaintext ? "http" : "https",
                                          "://127.0.0.1:", port, "/metrics\n");
    INFO(server->output());
    CHECK(harness::WaitUntil([&] { return absl::StrContains(server->output(), line); },
                             absl::Seconds(10)));
    REQUIRE(server->Kill(SIGTERM).ok());
    absl::StatusOr<int> status = server->Wait(absl::Now() + absl::Seconds(20));
    REQUIRE(status.ok());
    CHECK(WIFEXITED(*status));
  }
}

}  // namespace
}  // namespace muster::rdzv::testing
