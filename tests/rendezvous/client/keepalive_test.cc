// Keepalive and Watch deadlines: a connection that dies silently (a TCP
// proxy that stops forwarding without closing, as a NAT or firewall that
// drops a flow does) is noticed by the client's watch and lease within
// about keepalive time + timeout, and by the server, which frees the dead
// client's Watch stream.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <catch2/catch.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "rendezvous/client/client.h"
#include "rendezvous/server/server.h"
#include "tests/rendezvous/client/test_util.h"

namespace muster::rdzv {
namespace {

using testing::JoinRequestFor;
using testing::StartLocalServer;

// Forwards 127.0.0.1:port() to 127.0.0.1:target_port. Blackhole() freezes
// every connection accepted so far: nothing more is read or forwarded in
// either direction, yet both sockets stay open until the proxy is
// destroyed. Connections accepted later are forwarded normally.
class TcpProxy {
 public:
  explicit TcpProxy(int target_port) : target_port_(target_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(listen_fd_ >= 0);
    sockaddr_in address = Loopback(0);
    REQUIRE(bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
    REQUIRE(listen(listen_fd_, 16) == 0);
    socklen_t length = sizeof(address);
    REQUIRE(getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length) == 0);
    port_ = ntohs(address.sin_port);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }

  ~TcpProxy() {
    stopping_ = true;
    acceptor_.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (std::thread& pump : pumps_) pump.join();
    for (int fd : fds_) close(fd);
    close(listen_fd_);
  }

  int port() const { return port_; }

  void Blackhole() { frozen_below_ = next_connection_.load(); }

 private:
  static sockaddr_in Loopback(int port) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return address;
  }

  void AcceptLoop() {
    while (!stopping_) {
      pollfd ready{listen_fd_, POLLIN, 0};
      if (poll(&ready, 1, 50) <= 0) continue;
      int client = accept(listen_fd_, nullptr, nullptr);
      if (client < 0) continue;
      int server = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in target = Loopback(target_port_);
      if (connect(server, reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
        close(client);
        close(server);
        continue;
      }
      const int id = next_connection_++;
      std::lock_guard<std::mutex> lock(mu_);
      fds_.push_back(client);
      fds_.push_back(server);
      pumps_.emplace_back([this, client, server, id] { Pump(client, server, id); });
      pumps_.emplace_back([this, client, server, id] { Pump(server, client, id); });
    }
  }

  void Pump(int from, int to, int id) {
    char buffer[16384];
    while (!stopping_) {
      if (id < frozen_below_) {  // blackholed: hold the socket, move nothing
        usleep(20000);
        continue;
      }
      pollfd ready{from, POLLIN, 0};
      if (poll(&ready, 1, 20) <= 0) continue;
      if (id < frozen_below_) continue;
      ssize_t got = read(from, buffer, sizeof(buffer));
      if (got <= 0) {
        shutdown(to, SHUT_WR);
        return;
      }
      for (ssize_t sent = 0; sent < got;) {
        ssize_t wrote = send(to, buffer + sent, got - sent, MSG_NOSIGNAL);
        if (wrote <= 0) return;
        sent += wrote;
      }
    }
  }

  const int target_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> next_connection_{0};
  std::atomic<int> frozen_below_{0};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> pumps_;
  std::vector<int> fds_;
};

// One plain HTTP GET of /metrics; the value of `metric`, or -1.
int64_t ScrapeGauge(int port, const std::string& metric) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buffer[4096];
  for (ssize_t got; (got = read(fd, buffer, sizeof(buffer))) > 0;) {
    response.append(buffer, got);
  }
  close(fd);
  size_t at = response.find("\n" + metric + " ");
  if (at == std::string::npos) return -1;
  size_t start = at + metric.size() + 2;
  int64_t value = -1;
  if (!absl::SimpleAtoi(response.substr(start, response.find('\n', start) - start), &value)) {
    return -1;
  }
  return value;
}

std::unique_ptr<Client> ConnectWithKeepalive(int port, absl::Duration every) {
  ClientOptions options;
  options.endpoint = absl::StrCat("127.0.0.1:", port);
  options.rpc_timeout = absl::Seconds(2);
  options.keepalive.time = every;
  options.keepalive.timeout = every;
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  return *std::move(client);
}

// The value of `key` among the arguments, or -1.
int IntArgument(const grpc::ChannelArguments& arguments, const char* key) {
  grpc_channel_args raw;
  arguments.SetChannelArgs(&raw);
  for (size_t i = 0; i < raw.num_args; ++i) {
    if (std::string(raw.args[i].key) == key && raw.args[i].type == GRPC_ARG_INTEGER) {
      return raw.args[i].value.integer;
    }
  }
  return -1;
}

TEST_CASE(
    "every client channel sets keepalive: 10 s ping, 5 s timeout, "
    "even without calls",
    "[client][keepalive]") {
  grpc::ChannelArguments defaults = ChannelArgumentsFor(ClientOptions());
  CHECK(IntArgument(defaults, GRPC_ARG_KEEPALIVE_TIME_MS) == 10000);
  CHECK(IntArgument(defaults, GRPC_ARG_KEEPALIVE_TIMEOUT_MS) == 5000);
  CHECK(IntArgument(defaults, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS) == 1);
  // gRPC stops pinging after 2 pings without data unless told otherwise.
  CHECK(IntArgument(defaults, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA) == 0);

  ClientOptions fast;
  fast.keepalive.time = absl::Milliseconds(250);
  fast.keepalive.timeout = absl::Milliseconds(100);
  grpc::ChannelArguments injected = ChannelArgumentsFor(fast);
  CHECK(IntArgument(injected, GRPC_ARG_KEEPALIVE_TIME_MS) == 250);
  CHECK(IntArgument(injected, GRPC_ARG_KEEPALIVE_TIMEOUT_MS) == 100);
}

TEST_CASE(
    "a silently dropped connection is noticed: the watch resumes, "
    "the lease is renewed, the server frees the dead stream",
    "[client][keepalive]") {
  ServerOptions server_options;
  server_options.metrics_port = -1;
  server_options.metrics_address = "127.0.0.1";
  server_options.keepalive_time = absl::Milliseconds(300);
  server_options.keepalive_timeout = absl::Milliseconds(300);
  auto server = StartLocalServer(server_options);
  TcpProxy proxy(server->port());
  auto direct = testing::ConnectTo(server->port());
  auto proxied = ConnectWithKeepalive(proxy.port(), absl::Milliseconds(300));

  const pb::JobConfig config = testing::Config(1, 2, 3000);
  auto first = JoinAndWaitForRound(*direct, JoinRequestFor("dropped", config, 0, 1), nullptr,
                                   absl::Now() + absl::Seconds(10));
  REQUIRE(first.ok());
  JobWatcher watcher(proxied.get(), "dropped");
  auto seen =
      watcher.WaitFor([](const pb::JobState&) { return true; }, absl::Now() + absl::Seconds(5));
  REQUIRE(seen.ok());
  LeaseKeeper keeper(proxied.get(), "dropped", first->member_id, absl::Milliseconds(3000));

  proxy.Blackhole();
  const absl::Time dropped = absl::Now();
  // A change made while the watcher's connection is dead.
  pb::JoinRequest second = JoinRequestFor("dropped", config, 1, 1);
  REQUIRE(direct->Join(second).ok());
  auto resumed =
      watcher.WaitFor([&](const pb::JobState& s) { return s.version() > seen->version(); },
                      absl::Now() + absl::Seconds(5));
  INFO("watch after the drop: " << resumed.status().ToString());
  REQUIRE(resumed.ok());
  CHECK(resumed->nodes_waiting() == 1);
  CHECK(watcher.reconnects() >= 1);
  CHECK(watcher.status().ok());

  // Renewals go through again on a fresh connection well within the lease.
  const int64_t renewals = keeper.renewals();
  const absl::Time give_up = dropped + absl::Seconds(5);
  while (keeper.renewals() < renewals + 2 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  INFO("last transient error: " << keeper.last_transient_error().ToString());
  CHECK(keeper.renewals() >= renewals + 2);
  CHECK(keeper.status().ok());

  // The server pinged the frozen connection, got no answer and dropped it:
  // only the resumed stream is left.
  int64_t streams = -1;
  while (absl::Now() < dropped + absl::Seconds(5)) {
    streams = ScrapeGauge(server->metrics_port(), "muster_rdzv_watch_streams");
    if (streams == 1) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  CHECK(streams == 1);
}

TEST_CASE("the server accepts frequent keepalive pings without GOAWAY", "[client][keepalive]") {
  auto server = StartLocalServer();
  auto client = ConnectWithKeepalive(server->port(), absl::Milliseconds(50));
  auto joined =
      JoinAndWaitForRound(*client, JoinRequestFor("pinged", testing::Config(1, 1, 60000), 0, 1),
                          nullptr, absl::Now() + absl::Seconds(10));
  REQUIRE(joined.ok());
  JobWatcher watcher(client.get(), "pinged");
  REQUIRE(watcher.WaitFor([](const pb::JobState&) { return true; }, absl::Now() + absl::Seconds(5))
              .ok());
  // Idle but for pings every 50 ms: a "too_many_pings" GOAWAY would break
  // the stream and show as a reconnect.
  absl::SleepFor(absl::Seconds(1));
  CHECK(watcher.reconnects() == 0);
  CHECK(watcher.status().ok());
  pb::DescribeJobRequest describe;
  describe.set_job_id("pinged");
  CHECK(client->DescribeJob(describe).ok());
}

TEST_CASE(
    "a Watch stream ends at its deadline and resumes without "
    "repeating or losing a state",
    "[client][watch]") {
  auto server = StartLocalServer();
  ClientOptions options;
  options.endpoint = absl::StrCat("127.0.0.1:", server->port());
  options.watch_stream_deadline = absl::Milliseconds(300);
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  auto direct = testing::ConnectTo(server->port());

  const pb::JobConfig config = testing::Config(1, 4, 60000);
  auto first = JoinAndWaitForRound(*direct, JoinRequestFor("renewed", config, 0, 1), nullptr,
                                   absl::Now() + absl::Seconds(10));
  REQUIRE(first.ok());
  absl::Mutex mu;
  std::vector<uint64_t> versions;
  JobWatcher watcher(client->get(), "renewed", [&](const pb::JobState& s) {
    absl::MutexLock lock(&mu);
    versions.push_back(s.version());
  });
  REQUIRE(watcher.WaitFor([](const pb::JobState&) { return true; }, absl::Now() + absl::Seconds(5))
              .ok());
  for (int node = 1; node <= 3; ++node) {
    absl::SleepFor(absl::Milliseconds(400));  // across a stream deadline
    REQUIRE(direct->Join(JoinRequestFor("renewed", config, node, 1)).ok());
  }
  auto last = watcher.WaitFor([](const pb::JobState& s) { return s.nodes_waiting() == 3; },
                              absl::Now() + absl::Seconds(5));
  REQUIRE(last.ok());
  CHECK(watcher.status().ok());
  CHECK(watcher.reconnects() >= 3);
  // The callback runs just after WaitFor can see the state.
  auto has_last = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return !versions.empty() && versions.back() == last->version();
  };
  absl::MutexLock lock(&mu);
  mu.AwaitWithTimeout(absl::Condition(&has_last), absl::Seconds(2));
  REQUIRE(!versions.empty());
  for (size_t i = 1; i < versions.size(); ++i) {
    INFO("state " << i);
    CHECK(versions[i] > versions[i - 1]);  // in order, none twice
  }
  // The first state and the last at least; a state replaced while no
  // stream was open may be skipped (the server coalesces), never repeated.
  INFO("versions seen: " << absl::StrJoin(versions, ","));
  CHECK(versions.size() >= 2);
  CHECK(versions.back() == last->version());
}

}  // namespace
}  // namespace muster::rdzv
