// Helpers for the rendezvous service tests: an in-process server on
// 127.0.0.1:0, raw generated stubs, call contexts with deadlines, and Watch
// readers that give up at a deadline instead of hanging.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <catch2/catch.hpp>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/rendezvous.grpc.pb.h"
#include "rendezvous/server/server.h"

namespace muster::rdzv::testing {

namespace pb = ::muster::rendezvous::v1;
using Stub = pb::Rendezvous::Stub;

inline ServerOptions LocalOptions() {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  return options;
}

inline std::unique_ptr<Server> StartOrFail(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  INFO("Server::Start: " << server.status().ToString());
  REQUIRE(server.ok());
  return *std::move(server);
}

inline std::string Target(const Server& server) {
  return "127.0.0.1:" + std::to_string(server.port());
}

inline std::unique_ptr<Stub> StubFor(
    const Server& server,
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials()) {
  return pb::Rendezvous::NewStub(grpc::CreateChannel(Target(server), std::move(credentials)));
}

struct CallOptions {
  std::string token;   // sent as "authorization: Bearer <token>" if set
  std::string secret;  // sent as "x-muster-job-secret" if set
  absl::Duration timeout = absl::Seconds(10);
};

inline std::unique_ptr<grpc::ClientContext> Context(const CallOptions& options = CallOptions()) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  if (!options.token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options.token);
  }
  if (!options.secret.empty()) {
    context->AddMetadata("x-muster-job-secret", options.secret);
  }
  return context;
}

inline pb::JoinRequest JoinRequestFor(const std::string& job_id, uint32_t min_nodes,
                                      uint32_t max_nodes, int64_t lease_ttl_ms = 10000) {
  pb::JoinRequest request;
  request.set_job_id(job_id);
  pb::JobConfig* config = request.mutable_config();
  config->set_min_nodes(min_nodes);
  config->set_max_nodes(max_nodes);
  config->set_join_timeout_ms(60000);
  config->set_last_call_timeout_ms(0);
  config->set_lease_ttl_ms(lease_ttl_ms);
  config->set_max_restarts(3);
  request.set_address("127.0.0.1");
  request.set_hostname("node");
  request.set_nproc(1);
  request.set_requested_rank(-1);
  return request;
}

// Reads the job's Watch stream until `wanted` holds, the stream ends, or
// `timeout` passes. Safe to call from any thread (no Catch2 assertions).
struct WatchResult {
  std::optional<pb::JobState> matched;
  grpc::Status status;  // set when the stream ended
  bool ended = false;
};

inline WatchResult WatchUntil(Stub& stub, const std::string& job_id,
                              const std::function<bool(const pb::JobState&)>& wanted,
                              const CallOptions& options = CallOptions(),
                              uint64_t after_version = 0) {
  std::unique_ptr<grpc::ClientContext> context = Context(options);
  pb::WatchRequest request;
  request.set_job_id(job_id);
  request.set_after_version(after_version);
  std::unique_ptr<grpc::ClientReader<pb::JobState>> reader = stub.Watch(context.get(), request);
  WatchResult result;
  pb::JobState state;
  while (reader->Read(&state)) {
    if (wanted(state)) {
      result.matched = state;
      context->TryCancel();
      break;
    }
  }
  if (!result.matched) result.ended = true;
  result.status = reader->Finish();
  return result;
}

inline bool IsRunningWith(const pb::JobState& state, int members) {
  return state.phase() == pb::RUNNING && state.members_size() == members;
}

// A fresh directory, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    const char* base = getenv("TEST_TMPDIR");
    std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/rdzv_service.XXXXXX";
    char* made = mkdtemp(pattern.data());
    REQUIRE(made != nullptr);
    path_ = made;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace muster::rdzv::testing
