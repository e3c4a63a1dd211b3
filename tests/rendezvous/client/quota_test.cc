// RESOURCE_EXHAUSTED is final after a bounded retry: the JobWatcher, the
// LeaseKeeper and the calls that are safe to repeat try a few times with
// backoff, then hand the server's message (naming the quota) to the caller.
#include <atomic>
#include <memory>

#include <grpcpp/grpcpp.h>
#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rendezvous/client/client.h"
#include "rendezvous/server/server.h"
#include "tests/rendezvous/client/test_util.h"

namespace muster::rdzv {
namespace {

using testing::JoinRequestFor;
using testing::StartLocalServer;

constexpr char kQuotaMessage[] = "test quota of lease slots is used up";

// A server whose every KeepAlive, Get and Add is refused with
// RESOURCE_EXHAUSTED; counts the attempts.
class ExhaustedService final : public pb::Rendezvous::Service {
 public:
  grpc::Status KeepAlive(grpc::ServerContext*, const pb::KeepAliveRequest*,
                         pb::KeepAliveResponse*) override {
    return Refuse();
  }
  grpc::Status Get(grpc::ServerContext*, const pb::GetRequest*, pb::GetResponse*) override {
    return Refuse();
  }
  grpc::Status Add(grpc::ServerContext*, const pb::AddRequest*, pb::AddResponse*) override {
    return Refuse();
  }
  std::atomic<int> attempts{0};

 private:
  grpc::Status Refuse() {
    ++attempts;
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, kQuotaMessage);
  }
};

struct ExhaustedServer {
  ExhaustedServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
  }
  ~ExhaustedServer() { server->Shutdown(); }
  ExhaustedService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

TEST_CASE("JobWatcher gives up on a refused stream and names the quota", "[client][watch][quota]") {
  ServerOptions server_options;
  server_options.max_watch_streams = 1;
  auto server = StartLocalServer(server_options);
  auto client = testing::ConnectTo(server->port());
  auto joined =
      JoinAndWaitForRound(*client, JoinRequestFor("crowded", testing::Config(1, 1, 60000), 0, 1),
                          nullptr, absl::Now() + absl::Seconds(10));
  REQUIRE(joined.ok());

  JobWatcher holder(client.get(), "crowded");  // takes the only stream
  REQUIRE(holder.WaitFor([](const pb::JobState&) { return true; }, absl::Now() + absl::Seconds(5))
              .ok());
  JobWatcher refused(client.get(), "crowded");
  const absl::Time start = absl::Now();
  auto state =
      refused.WaitFor([](const pb::JobState&) { return true; }, absl::Now() + absl::Seconds(8));
  INFO(state.status().ToString());
  CHECK(state.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(state.status().message(), "open Watch stream"));
  CHECK(absl::StrContains(state.status().message(),
                          "the limit is 1 (rendezvous --max-watch-streams)"));
  CHECK(absl::StrContains(state.status().message(), "crowded"));
  CHECK(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::Now() - start < absl::Seconds(5));
  CHECK(holder.status().ok());
}

TEST_CASE("LeaseKeeper stops after a bounded retry of RESOURCE_EXHAUSTED",
          "[client][lease][quota]") {
  ExhaustedServer fake;
  auto client = testing::ConnectTo(fake.port);
  // Renewals every second, each call with a third of the ttl: room for
  // every attempt and its backoff.
  LeaseKeeper keeper(client.get(), "job", "member", absl::Seconds(3));
  absl::Status failure = keeper.WaitForFailure(absl::Now() + absl::Seconds(8));
  INFO(failure.ToString());
  CHECK(failure.code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(failure.message(), kQuotaMessage));
  CHECK(fake.service.attempts.load() == client->options().resource_exhausted_attempts);
}

TEST_CASE(
    "a call safe to repeat retries RESOURCE_EXHAUSTED a bounded number "
    "of times; one that is not, never",
    "[client][quota]") {
  ExhaustedServer fake;
  auto client = testing::ConnectTo(fake.port);
  pb::GetRequest get;
  get.set_job_id("job");
  get.set_key("k");
  auto got = client->Get(get);
  CHECK(got.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(got.status().message(), kQuotaMessage));
  CHECK(fake.service.attempts.load() == client->options().resource_exhausted_attempts);

  fake.service.attempts = 0;
  pb::AddRequest add;
  add.set_job_id("job");
  add.set_key("k");
  add.set_delta(1);
  CHECK(client->Add(add).status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(fake.service.attempts.load() == 1);
}

}  // namespace
}  // namespace muster::rdzv
