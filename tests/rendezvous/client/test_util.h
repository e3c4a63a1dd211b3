// Helpers shared by the client tests: an in-process server on a loopback
// port, clients connected to it, and join requests. Call from the test's
// main thread only (they use Catch2 assertions).
#pragma once

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "rendezvous/client/client.h"
#include "rendezvous/server/server.h"

namespace muster::rdzv::testing {

inline std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// Starts a server; a default listen address becomes 127.0.0.1:0.
inline std::unique_ptr<Server> StartLocalServer(ServerOptions options = {}) {
  if (options.listen_address == ServerOptions().listen_address) {
    options.listen_address = "127.0.0.1:0";
  }
  auto server = Server::Start(options);
  INFO("Server::Start: " << server.status().ToString());
  REQUIRE(server.ok());
  return *std::move(server);
}

// Polls `condition` every 10 ms until it holds or `timeout` passes: for
// what no event announces, such as a server's next look at its files.
inline bool Eventually(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

inline std::unique_ptr<Client> ConnectTo(int port) {
  ClientOptions options;
  options.endpoint = absl::StrCat("127.0.0.1:", port);
  options.rpc_timeout = absl::Seconds(5);
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  return *std::move(client);
}

inline pb::JobConfig Config(int min_nodes, int max_nodes, int64_t lease_ttl_ms) {
  pb::JobConfig config;
  config.set_min_nodes(min_nodes);
  config.set_max_nodes(max_nodes);
  config.set_join_timeout_ms(30000);
  config.set_last_call_timeout_ms(100);
  config.set_lease_ttl_ms(lease_ttl_ms);
  config.set_max_restarts(3);
  return config;
}

inline pb::JoinRequest JoinRequestFor(const std::string& job_id, const pb::JobConfig& config,
                                      int node, int nproc) {
  pb::JoinRequest request;
  request.set_job_id(job_id);
  *request.mutable_config() = config;
  request.set_address(absl::StrCat("10.1.0.", node));
  request.set_hostname(absl::StrCat("node", node));
  request.set_nproc(nproc);
  request.set_requested_rank(-1);
  return request;
}

}  // namespace muster::rdzv::testing
