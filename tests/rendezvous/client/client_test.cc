// The client library against an in-process server (Server::Start on
// 127.0.0.1:0): Connect's validation, calls that survive a server restart,
// LeaseKeeper, JobWatcher, JoinAndWaitForRound and RemoteStore.
#include "rendezvous/client/client.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rendezvous/client/store.h"
#include "rendezvous/server/server.h"
#include "tests/rendezvous/client/test_util.h"

namespace muster::rdzv {
namespace {

using testing::JoinRequestFor;
using testing::StartLocalServer;

TEST_CASE("Connect rejects a malformed endpoint", "[client]") {
  for (const char* endpoint :
       {"", "host:port", "host:0", "host:70000", ":29400", "http://host:1", "[::1", "a b"}) {
    ClientOptions options;
    options.endpoint = endpoint;
    auto client = Client::Connect(options);
    INFO("endpoint \"" << endpoint << "\"");
    CHECK(client.status().code() == absl::StatusCode::kInvalidArgument);
  }
  CHECK(*NormalizeEndpoint("node7") == "node7:29400");
  CHECK(*NormalizeEndpoint("10.0.0.1:123") == "10.0.0.1:123");
  CHECK(*NormalizeEndpoint("[::1]:5") == "[::1]:5");
  CHECK(*NormalizeEndpoint("::1") == "[::1]:29400");
}

TEST_CASE("Connect names an unreadable token file", "[client]") {
  ClientOptions options;
  options.token_file = "/nonexistent/muster-token";
  auto client = Client::Connect(options);
  REQUIRE(client.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(client.status().message()).find("/nonexistent/muster-token") !=
        std::string::npos);

  ClientOptions half_tls;
  half_tls.tls_cert_file = "/nonexistent/cert.pem";
  CHECK(Client::Connect(half_tls).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Connect reads the job secret file, and names a bad one", "[client]") {
  const std::string path = absl::StrCat(testing::TempDir(), "/client_test_job_secret");
  std::ofstream(path) << "\n  j0b-secret \n";
  ClientOptions options;
  options.job_secret_file = path;
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  CHECK((*client)->options().job_secret == "j0b-secret");

  std::ofstream(path) << " \t\n";  // only whitespace
  auto empty = Client::Connect(options);
  CHECK(empty.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(empty.status().message(), path));

  options.job_secret = "given-too";
  CHECK(Client::Connect(options).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Bearer token is sent from the token file", "[client]") {
  const std::string token_path = absl::StrCat(testing::TempDir(), "/client_test_token");
  std::ofstream(token_path) << "  s3cret-token\n";
  ServerOptions server_options;
  server_options.token_file = token_path;
  auto server = StartLocalServer(server_options);

  ClientOptions without;
  without.endpoint = absl::StrCat("127.0.0.1:", server->port());
  auto anonymous = Client::Connect(without);
  REQUIRE(anonymous.ok());
  CHECK((*anonymous)->ListJobs().status().code() == absl::StatusCode::kUnauthenticated);

  ClientOptions with = without;
  with.token_file = token_path;
  auto authorized = Client::Connect(with);
  REQUIRE(authorized.ok());
  CHECK((*authorized)->ListJobs().ok());
}

TEST_CASE("A token file is read by the server's rules; what cannot be a header is refused",
          "[client]") {
  const std::string dir =
      absl::StrCat(testing::TempDir(), "/client_token_rules_", absl::ToUnixMicros(absl::Now()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    const std::string path = dir + "/" + name;
    std::ofstream(path + ".new") << text;
    REQUIRE(std::rename((path + ".new").c_str(), path.c_str()) == 0);
    return path;
  };
  const std::string server_file = write("server", "# the tokens\n\ntok-B\n  tok-C  \n");
  ServerOptions server_options;
  server_options.token_file = server_file;
  auto server = StartLocalServer(server_options);
  ClientOptions options;
  options.endpoint = absl::StrCat("127.0.0.1:", server->port());
  options.credentials_refresh = absl::Milliseconds(1);

  // The server's own file, and one with a comment: the first token goes.
  // (Before, the whole file went, newlines included, and gRPC aborted the
  // client: rdzvctl and launch exited 134.)
  for (const std::string& path : {server_file, write("commented", "# my token\ntok-C\n")}) {
    INFO(path);
    options.token_file = path;
    auto client = Client::Connect(options);
    REQUIRE(client.ok());
    CHECK((*client)->ListJobs().ok());
  }

  // Bytes no header may hold: refused at Connect, naming the line.
  for (const std::string& text : {std::string("t\xc3\xb6k\n"), std::string("tok\tB\n")}) {
    options.token_file = write("unsendable", "# fine\n" + text);
    auto refused = Client::Connect(options);
    INFO(refused.status().ToString());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(refused.status().message(), "line 2"));
    CHECK(absl::StrContains(refused.status().message(), "printable ASCII on one line"));
  }
  ClientOptions direct = options;
  direct.token_file.clear();
  direct.token = "two\nlines";
  CHECK(Client::Connect(direct).status().code() == absl::StatusCode::kInvalidArgument);
  ClientOptions secret = options;
  secret.token_file.clear();
  secret.job_secret_file = write("secret", "line one\nline two\n");
  CHECK(Client::Connect(secret).status().code() == absl::StatusCode::kInvalidArgument);

  // A rotation to a file that cannot be sent keeps the token before, and
  // calls go on (before: the client aborted about one refresh later).
  const std::string rotated = write("rotated", "tok-B\n");
  options.token_file = rotated;
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  REQUIRE((*client)->ListJobs().ok());
  write("rotated", "# rotated\nt\xc3\xb6k\n");
  for (int i = 0; i < 3; ++i) CHECK((*client)->ListJobs().ok());
  write("rotated", "# rotated\ntok-C\n");
  CHECK((*client)->ListJobs().ok());
}

TEST_CASE("CheckHealth asks grpc.health.v1.Health, which takes no token", "[client][health]") {
  const std::string token_path = absl::StrCat(testing::TempDir(), "/client_test_health_token");
  std::ofstream(token_path) << "health-token\n";
  ServerOptions server_options;
  server_options.token_file = token_path;
  auto server = StartLocalServer(server_options);

  // Without the token the Rendezvous service refuses, the health service
  // answers: a load balancer's probe needs no token.
  auto client = testing::ConnectTo(server->port());
  CHECK(client->ListJobs().status().code() == absl::StatusCode::kUnauthenticated);
  absl::StatusOr<ServingStatus> serving = client->CheckHealth();
  INFO(serving.status().ToString());
  REQUIRE(serving.ok());
  CHECK(*serving == ServingStatus::kServing);
  CHECK(ServingStatusName(*serving) == "SERVING");
  // A named service goes on the wire: gRPC's default service knows only "".
  CHECK(client->CheckHealth("no.such.Service").status().code() == absl::StatusCode::kNotFound);

  // Nobody listening: UNAVAILABLE once the call's time is up.
  const int port = server->port();
  server->Shutdown(absl::Seconds(1));
  server.reset();
  auto orphan = testing::ConnectTo(port);
  CallOptions short_call;
  short_call.timeout = absl::Milliseconds(300);
  CHECK(orphan->CheckHealth("", short_call).status().code() == absl::StatusCode::kUnavailable);
  CHECK(ServingStatusName(static_cast<ServingStatus>(7)) == "UNRECOGNIZED(7)");
}

TEST_CASE("A rotated token file is read again: a refused call or watch goes again", "[client]") {
  const std::string dir =
      absl::StrCat(testing::TempDir(), "/client_rotation_", absl::ToUnixMicros(absl::Now()));
  std::filesystem::create_directories(dir);
  const std::string server_file = dir + "/server_token", client_file = dir + "/client_token";
  auto write = [](const std::string& path, const std::string& text) {
    std::ofstream(path + ".new") << text;
    REQUIRE(std::rename((path + ".new").c_str(), path.c_str()) == 0);
  };
  write(server_file, "first\n");
  write(client_file, "first\n");
  ServerOptions server_options;
  server_options.token_file = server_file;
  server_options.credentials_refresh = absl::Milliseconds(1);
  auto server = StartLocalServer(server_options);
  ClientOptions options;
  options.endpoint = absl::StrCat("127.0.0.1:", server->port());
  options.rpc_timeout = absl::Seconds(5);
  options.token_file = client_file;
  // Never time to look on its own in this test: only a refusal reads it.
  options.credentials_refresh = absl::Hours(1);
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  REQUIRE((*client)->ListJobs().ok());

  // The worst rotation, with no overlap: the server takes only the new
  // token, and the client's file gets it after. Each server change is
  // awaited with a probe that presents the new token directly.
  auto rotate = [&](const std::string& token) {
    write(server_file, token + "\n");
    ClientOptions probe = options;
    probe.token_file.clear();
    probe.token = token;
    auto prober = Client::Connect(probe);
    REQUIRE(prober.ok());
    REQUIRE(testing::Eventually([&] { return (*prober)->ListJobs().ok(); }, absl::Seconds(10)));
    write(client_file, token + "\n");
  };
  rotate("second");
  // A call safe to repeat, then one that is not (a first Join): both go
  // again at once with the new token, since the server refused the first
  // attempt before acting on it.
  auto listed = (*client)->ListJobs();
  INFO(listed.status().ToString());
  CHECK(listed.ok());
  rotate("third");
  const pb::JobConfig config = testing::Config(1, 1, 5000);
  auto joined = (*client)->Join(JoinRequestFor("rotated", config, 0, 1));
  INFO(joined.status().ToString());
  REQUIRE(joined.ok());
  // A watch stream refused with the old token opens again with the new.
  rotate("fourth");
  JobWatcher watcher(client->get(), "rotated", nullptr);
  auto seen =
      watcher.WaitFor([](const pb::JobState&) { return true; }, absl::Now() + absl::Seconds(10));
  INFO(seen.status().ToString());
  CHECK(seen.ok());

  // A token file emptied by mistake keeps the token read before.
  write(client_file, "\n");
  CHECK((*client)->ListJobs().ok());
  // A wrong token is refused: after one more try with what the file holds
  // now, the call returns UNAUTHENTICATED.
  write(client_file, "wrong\n");
  write(server_file, "fifth\n");
  CHECK(testing::Eventually(
      [&] { return (*client)->ListJobs().status().code() == absl::StatusCode::kUnauthenticated; },
      absl::Seconds(10)));
  std::filesystem::remove_all(dir);
}

TEST_CASE("A call made while the server is down succeeds once it is back", "[client]") {
  auto server = StartLocalServer();
  const int port = server->port();
  auto client = testing::ConnectTo(port);
  REQUIRE(client->ListJobs().ok());
  server->Shutdown(absl::Seconds(1));
  server.reset();

  // Unreachable for a while: a safe call keeps retrying within its timeout.
  absl::StatusOr<pb::ListJobsResponse> listed;
  std::thread caller([&] {
    CallOptions call;
    call.timeout = absl::Seconds(15);
    listed = client->ListJobs({}, call);
  });
  ServerOptions again;
  again.listen_address = absl::StrCat("127.0.0.1:", port);
  auto restarted = StartLocalServer(again);
  caller.join();
  CHECK(listed.ok());

  // With nobody listening, a short call reports UNAVAILABLE, not a timeout.
  restarted->Shutdown(absl::Seconds(1));
  CallOptions short_call;
  short_call.timeout = absl::Milliseconds(300);
  CHECK(client->ListJobs({}, short_call).status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("Two nodes rendezvous and agree on the round", "[client]") {
  auto server = StartLocalServer();
  auto first = testing::ConnectTo(server->port());
  auto second = testing::ConnectTo(server->port());
  const pb::JobConfig config = testing::Config(2, 2, 5000);

  absl::StatusOr<RoundAssignment> a, b;
  std::thread other([&] {
    b = JoinAndWaitForRound(*second, JoinRequestFor("pair", config, 1, 4), nullptr,
                            absl::Now() + absl::Seconds(15));
  });
  a = JoinAndWaitForRound(*first, JoinRequestFor("pair", config, 0, 2), nullptr,
                          absl::Now() + absl::Seconds(15));
  other.join();
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->state.round() == b->state.round());
  CHECK(a->state.world_size() == 6);
  CHECK(a->self.group_rank() != b->self.group_rank());
  CHECK(a->state.members_size() == 2);
  for (const auto* assignment : {&*a, &*b}) {
    const pb::Member& rank0 = assignment->state.members(0);
    CHECK(rank0.group_rank() == 0);
    CHECK(rank0.rank_offset() == 0);
    CHECK(assignment->state.members(1).rank_offset() == rank0.nproc());
  }
}

TEST_CASE(
    "LeaseKeeper keeps a member alive and reports NOT_FOUND once the "
    "server forgets it",
    "[client][lease]") {
  auto server = StartLocalServer();
  auto client = testing::ConnectTo(server->port());
  const absl::Duration ttl = absl::Milliseconds(300);
  auto joined =
      JoinAndWaitForRound(*client, JoinRequestFor("leased", testing::Config(1, 1, 300), 0, 1),
                          nullptr, absl::Now() + absl::Seconds(10));
  REQUIRE(joined.ok());
  REQUIRE(joined->lease_ttl_ms == 300);

  LeaseKeeper keeper(client.get(), "leased", joined->member_id, ttl);
  JobWatcher watcher(client.get(), "leased");
  // Five ttls pass and the round never loses its member.
  auto lost = watcher.WaitFor(
      [&](const pb::JobState& s) {
        return s.phase() != pb::RUNNING || s.round() != joined->state.round();
      },
      absl::Now() + 5 * ttl);
  CHECK(lost.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(keeper.status().ok());
  CHECK(keeper.renewals() >= 8);  // about every ttl/3

  // The member leaves (from another process's view): the server forgets it.
  pb::LeaveRequest leave;
  leave.set_job_id("leased");
  leave.set_member_id(joined->member_id);
  REQUIRE(client->Leave(leave).ok());
  absl::Status failure = keeper.WaitForFailure(absl::Now() + absl::Seconds(5));
  CHECK(failure.code() == absl::StatusCode::kNotFound);
  CHECK(keeper.status().code() == absl::StatusCode::kNotFound);

  const absl::Time stop_started = absl::Now();
  keeper.Stop();
  CHECK(absl::Now() - stop_started < absl::Seconds(1));
}

TEST_CASE("LeaseKeeper renews at the interval asked for, never one the lease would not survive",
          "[client][lease]") {
  auto server = StartLocalServer();
  auto client = testing::ConnectTo(server->port());
  auto joined =
      JoinAndWaitForRound(*client, JoinRequestFor("often", testing::Config(1, 1, 3000), 0, 1),
                          nullptr, absl::Now() + absl::Seconds(10));
  REQUIRE(joined.ok());
  // A 3 s lease renewed every 100 ms: about 15 renewals in 1.5 s, where
  // the default of ttl/3 would make one.
  LeaseKeeper often(client.get(), "often", joined->member_id, absl::Seconds(3),
                    absl::Milliseconds(100));
  CHECK(often.WaitForFailure(absl::Now() + absl::Milliseconds(1500)).ok());
  CHECK(often.renewals() >= 8);
  often.Stop();

  // An interval as long as the lease falls back to ttl/3, and the member
  // survives five ttls.
  auto short_lease =
      JoinAndWaitForRound(*client, JoinRequestFor("short", testing::Config(1, 1, 300), 0, 1),
                          nullptr, absl::Now() + absl::Seconds(10));
  REQUIRE(short_lease.ok());
  LeaseKeeper rare(client.get(), "short", short_lease->member_id, absl::Milliseconds(300),
                   absl::Seconds(1));
  JobWatcher watcher(client.get(), "short");
  auto lost = watcher.WaitFor(
      [&](const pb::JobState& state) {
        return state.phase() != pb::RUNNING || state.round() != short_lease->state.round();
      },
      absl::Now() + absl::Milliseconds(1500));
  CHECK(lost.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(rare.status().ok());
  CHECK(rare.renewals() >= 8);
}

TEST_CASE("LeaseKeeper stops promptly while a renewal is far off", "[client][lease]") {
  auto server = StartLocalServer();
  auto client = testing::ConnectTo(server->port());
  auto keeper = std::make_unique<LeaseKeeper>(client.get(), "nobody", "m", absl::Seconds(60));
  const absl::Time start = absl::Now();
  keeper.reset();
  CHECK(absl::Now() - start < absl::Seconds(1));
}

TEST_CASE("JobWatcher sees round changes", "[client][watch]") {
  auto server = StartLocalServer();
  auto client = testing::ConnectTo(server->port());
  const pb::JobConfig config = testing::Config(1, 1, 5000);
  int callbacks = 0;
  absl::Mutex callbacks_mu;
  // Started before the join that creates the job: it waits for the job.
  JobWatcher watcher(
      client.get(), "rounds",
      [&](const pb::JobState&) {
        absl::MutexLock lock(&callbacks_mu);
        ++callbacks;
      },
      /*wait_for_job=*/true);
  auto first = JoinAndWaitForRound(*client, JoinRequestFor("rounds", config, 0, 1), &watcher,
                                   absl::Now() + absl::Seconds(10));
  REQUIRE(first.ok());
  const uint64_t round = first->state.round();

  pb::ReportFailureRequest failure;
  failure.set_job_id("rounds");
  failure.set_round(round);
  failure.set_member_id(first->member_id);
  failure.set_exit_code(3);
  REQUIRE(client->ReportFailure(failure).ok());
  auto next = watcher.WaitFor([&](const pb::JobState& s) { return s.round() > round; },
                              absl::Now() + absl::Seconds(5));
  REQUIRE(next.ok());
  CHECK(next->phase() == pb::GATHERING);
  CHECK(next->last_end_reason() == pb::MEMBER_FAILED);
  CHECK(next->restart_count() == 1);

  // Re-joining with the same member id forms the next round.
  pb::JoinRequest rejoin = JoinRequestFor("rounds", config, 0, 1);
  rejoin.set_member_id(first->member_id);
  auto second = JoinAndWaitForRound(*client, rejoin, &watcher, absl::Now() + absl::Seconds(10));
  REQUIRE(second.ok());
  CHECK(second->state.round() == round + 1);
  CHECK(second->member_id == first->member_id);

  pb::CloseJobRequest close;
  close.set_job_id("rounds");
  close.set_reason("test over");
  REQUIRE(client->CloseJob(close).ok());
  auto ended =
      watcher.WaitFor([](const pb::JobState&) { return false; }, absl::Now() + absl::Seconds(5));
  CHECK(ended.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(ended.status().message()).find("CLOSED") != std::string::npos);
  CHECK(watcher.latest()->status_message() == "test over");
  absl::MutexLock lock(&callbacks_mu);
  CHECK(callbacks >= 4);
}

TEST_CASE("JobWatcher reports NOT_FOUND for an unknown job", "[client][watch]") {
  auto server = StartLocalServer();
  auto client = testing::ConnectTo(server->port());
  JobWatcher watcher(client.get(), "no-such-job");
  auto state =
      watcher.WaitFor([](const pb::JobState&) { return true; }, absl::Now() + absl::Seconds(5));
  CHECK(state.status().code() == absl::StatusCode::kNotFound);
  CHECK(watcher.status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace muster::rdzv
