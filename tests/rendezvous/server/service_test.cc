// The rendezvous gRPC service end to end, through raw generated stubs
// against an in-process server: joining and watching, blocking store calls,
// bad input, Watch endings, metrics and health.
#include <future>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include <httplib.h>
#include <catch2/catch.hpp>

#include "proto/health.grpc.pb.h"
#include "tests/rendezvous/server/service_test_util.h"

namespace muster::rdzv::testing {
namespace {

using std::chrono::milliseconds;

constexpr auto kEventTimeout = std::chrono::seconds(10);

// Joins `job_id` as a single-node job and returns the running round.
uint64_t StartSingleNodeJob(Stub& stub, const std::string& job_id, std::string* member_id) {
  pb::JoinResponse joined;
  grpc::Status status = stub.Join(Context().get(), JoinRequestFor(job_id, 1, 1), &joined);
  INFO(status.error_message());
  REQUIRE(status.ok());
  *member_id = joined.member_id();
  WatchResult running =
      WatchUntil(stub, job_id, [](const pb::JobState& s) { return IsRunningWith(s, 1); });
  REQUIRE(running.matched.has_value());
  return running.matched->round();
}

grpc::Status SetKey(Stub& stub, const std::string& job_id, uint64_t round, const std::string& key,
                    const std::string& value) {
  pb::SetRequest request;
  request.set_job_id(job_id);
  request.set_round(round);
  request.set_key(key);
  request.set_value(value);
  pb::SetResponse response;
  return stub.Set(Context().get(), request, &response);
}

// The server still answers after whatever came before.
void RequireServerAnswers(Stub& stub) {
  pb::ListJobsResponse jobs;
  grpc::Status status = stub.ListJobs(Context().get(), pb::ListJobsRequest(), &jobs);
  INFO(status.error_message());
  REQUIRE(status.ok());
}

TEST_CASE("three members join and every watch sees the same running round") {
  std::unique_ptr<Server> server = StartOrFail(LocalOptions());
  std::vector<std::unique_ptr<Stub>> stubs;
  for (int i = 0; i < 3; ++i) stubs.push_back(StubFor(*server));

  auto watch_until_running = [&](int i) {
    return std::async(std::launch::async, [&stubs, i] {
      return WatchUntil(*stubs[i], "job-a",
                        [](const pb::JobState& state) { return IsRunningWith(state, 3); });
    });
  };
  std::set<std::string> member_ids;
  std::vector<std::future<WatchResult>> watches;
  for (int i = 0; i < 3; ++i) {
    pb::JoinResponse joined;
    grpc::Status status = stubs[i]->Join(Context().get(), JoinRequestFor("job-a", 3, 3), &joined);
    INFO(status.error_message());
    REQUIRE(status.ok());
    member_ids.insert(joined.member_id());
    // The first watch opens while the round still gathers, so it sees the
    // change streamed; the others get the running state at once.
    watches.push_back(watch_until_running(i));
  }
  REQUIRE(member_ids.size() == 3);

  std::vector<pb::JobState> seen;
  for (auto& watch : watches) {
    REQUIRE(watch.wait_for(kEventTimeout) == std::future_status::ready);
    WatchResult result = watch.get();
    INFO(result.status.error_message());
    REQUIRE(result.matched.has_value());
    seen.push_back(*result.matched);
  }
  std::set<int> ranks;
  for (const pb::Member& member : seen[0].members()) {
    ranks.insert(member.group_rank());
    CHECK(member_ids.count(member.member_id()) == 1);
  }
  CHECK(ranks == std::set<int>{0, 1, 2});
  CHECK(seen[0].world_size() == 3);
  for (const pb::JobState& other : seen) {
    REQUIRE(other.members_size() == 3);
    CHECK(other.round() == seen[0].round());
    for (int i = 0; i < 3; ++i) {
      CHECK(other.members(i).member_id() == seen[0].members(i).member_id());
      CHECK(other.members(i).group_rank() == seen[0].members(i).group_rank());
      CHECK(other.members(i).rank_offset() == seen[0].members(i).rank_offset());
    }
  }
}

TEST_CASE("blocking store calls wake on change, time out, and abort") {
  std::unique_ptr<Server> server = StartOrFail(LocalOptions());
  std::unique_ptr<Stub> stub = StubFor(*server);
  std::string member_id;
  uint64_t round = StartSingleNodeJob(*stub, "job-store", &member_id);

  auto blocking_get = [&](const std::string& key, int64_t wait_ms, absl::Duration client_timeout) {
    return std::async(std::launch::async, [&, key, wait_ms, client_timeout] {
      pb::GetRequest request;
      request.set_job_id("job-store");
      request.set_round(round);
      request.set_key(key);
      request.set_wait_ms(wait_ms);
      pb::GetResponse response;
      CallOptions options;
      options.timeout = client_timeout;
      grpc::Status status = stub->Get(Context(options).get(), request, &response);
      return std::make_pair(status, response.value());
    });
  };

  SECTION("a blocked Get completes when another client sets the key") {
    auto get = blocking_get("master_addr", 20000, absl::Seconds(30));
    // Still blocked: nothing has set the key.
    REQUIRE(get.wait_for(milliseconds(200)) == std::future_status::timeout);
    std::unique_ptr<Stub> other = StubFor(*server);
    REQUIRE(SetKey(*other, "job-store", round, "master_addr", "10.0.0.1").ok());
    REQUIRE(get.wait_for(kEventTimeout) == std::future_status::ready);
    auto [status, value] = get.get();
    INFO(status.error_message());
    REQUIRE(status.ok());
    CHECK(value == "10.0.0.1");
  }

  SECTION("Get without wait_ms is NOT_FOUND at once") {
    pb::GetRequest request;
    request.set_job_id("job-store");
    request.set_round(round);
    request.set_key("absent");
    pb::GetResponse response;
    CHECK(stub->Get(Context().get(), request, &response).error_code() ==
          grpc::StatusCode::NOT_FOUND);
  }

  SECTION("Wait times out with DEADLINE_EXCEEDED after wait_ms") {
    pb::WaitRequest request;
    request.set_job_id("job-store");
    request.set_round(round);
    request.add_keys("never");
    request.set_wait_ms(300);
    pb::WaitResponse response;
    absl::Time start = absl::Now();
    grpc::Status status = stub->Wait(Context().get(), request, &response);
    absl::Duration took = absl::Now() - start;
    CHECK(status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    CHECK(took >= absl::Milliseconds(280));
    CHECK(took < absl::Seconds(5));
  }

  SECTION("Wait with wait_ms 0 and an absent key is DEADLINE_EXCEEDED at once") {
    pb::WaitRequest request;
    request.set_job_id("job-store");
    request.set_round(round);
    request.add_keys("absent");
    request.set_wait_ms(0);
    pb::WaitResponse response;
    absl::Time start = absl::Now();
    grpc::Status status = stub->Wait(Context().get(), request, &response);
    CHECK(status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    CHECK(absl::Now() - start < absl::Seconds(2));
  }

  SECTION("Wait returns once every key exists") {
    REQUIRE(SetKey(*stub, "job-store", round, "a", "1").ok());
    auto wait = std::async(std::launch::async, [&] {
      pb::WaitRequest request;
      request.set_job_id("job-store");
      request.set_round(round);
      request.add_keys("a");
      request.add_keys("b");
      request.set_wait_ms(20000);
      pb::WaitResponse response;
      return stub->Wait(Context().get(), request, &response);
    });
    REQUIRE(wait.wait_for(milliseconds(200)) == std::future_status::timeout);
    REQUIRE(SetKey(*stub, "job-store", round, "b", "2").ok());
    REQUIRE(wait.wait_for(kEventTimeout) == std::future_status::ready);
    grpc::Status status = wait.get();
    INFO(status.error_message());
    CHECK(status.ok());
  }

  SECTION("a blocked Get is ABORTED when its round ends") {
    auto get = blocking_get("never", 20000, absl::Seconds(30));
    REQUIRE(get.wait_for(milliseconds(200)) == std::future_status::timeout);
    pb::ReportFailureRequest failure;
    failure.set_job_id("job-store");
    failure.set_round(round);
    failure.set_member_id(member_id);
    failure.set_exit_code(1);
    pb::ReportFailureResponse failed;
    REQUIRE(stub->ReportFailure(Context().get(), failure, &failed).ok());
    REQUIRE(get.wait_for(kEventTimeout) == std::future_status::ready);
    CHECK(get.get().first.error_code() == grpc::StatusCode::ABORTED);
  }

  SECTION("the client's own deadline ends a blocked Get") {
    auto get = blocking_get("never", 60000, absl::Milliseconds(300));
    REQUIRE(get.wait_for(kEventTimeout) == std::future_status::ready);
    CHECK(get.get().first.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    RequireServerAnswers(*stub);
  }
}

TEST_CASE("bad input gets the exact status code and the server keeps going") {
  ServerOptions options = LocalOptions();
  options.limits.max_value_bytes = 1024;
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  pb::JoinResponse joined;

  auto join_code = [&](const pb::JoinRequest& request) {
    return stub->Join(Context().get(), request, &joined).error_code();
  };
  CHECK(join_code(JoinRequestFor("", 1, 1)) == grpc::StatusCode::INVALID_ARGUMENT);
  RequireServerAnswers(*stub);
  CHECK(join_code(JoinRequestFor(std::string(300, 'j'), 1, 1)) ==
        grpc::StatusCode::INVALID_ARGUMENT);
  RequireServerAnswers(*stub);
  CHECK(join_code(JoinRequestFor("job-bad", 3, 2)) == grpc::StatusCode::INVALID_ARGUMENT);
  RequireServerAnswers(*stub);

  pb::DescribeJobRequest describe;
  describe.set_job_id("no-such-job");
  pb::DescribeJobResponse described;
  CHECK(stub->DescribeJob(Context().get(), describe, &described).error_code() ==
        grpc::StatusCode::NOT_FOUND);
  RequireServerAnswers(*stub);

  std::string member_id;
  uint64_t round = StartSingleNodeJob(*stub, "job-bad", &member_id);
  CHECK(join_code(JoinRequestFor("job-bad", 1, 2)) == grpc::StatusCode::FAILED_PRECONDITION);
  RequireServerAnswers(*stub);

  // Over the limit, but small enough for gRPC: the state machine's check.
  // Limits caps answer RESOURCE_EXHAUSTED (rendezvous/state/state_machine.h,
  // docs/rendezvous.md).
  CHECK(SetKey(*stub, "job-bad", round, "big", std::string(1025, 'v')).error_code() ==
        grpc::StatusCode::RESOURCE_EXHAUSTED);
  RequireServerAnswers(*stub);
  // Beyond the receive limit (max value + 64 KiB): gRPC's own check.
  CHECK(SetKey(*stub, "job-bad", round, "huge", std::string(200 * 1024, 'v')).error_code() ==
        grpc::StatusCode::RESOURCE_EXHAUSTED);
  RequireServerAnswers(*stub);

  // The next round begins after a failure; the first round is then over.
  pb::ReportFailureRequest failure;
  failure.set_job_id("job-bad");
  failure.set_round(round);
  failure.set_member_id(member_id);
  pb::ReportFailureResponse failed;
  REQUIRE(stub->ReportFailure(Context().get(), failure, &failed).ok());
  pb::JoinRequest rejoin = JoinRequestFor("job-bad", 1, 1);
  rejoin.set_member_id(member_id);
  REQUIRE(stub->Join(Context().get(), rejoin, &joined).ok());
  uint64_t next_round = joined.round();
  REQUIRE(next_round > round);
  CHECK(SetKey(*stub, "job-bad", round, "k", "v").error_code() == grpc::StatusCode::ABORTED);
  CHECK(SetKey(*stub, "job-bad", next_round + 1, "k", "v").error_code() ==
        grpc::StatusCode::FAILED_PRECONDITION);
  RequireServerAnswers(*stub);
}

TEST_CASE(
    "Watch ends OK on a finished job, NOT_FOUND on an unknown one, "
    "UNAVAILABLE on shutdown") {
  std::unique_ptr<Server> server = StartOrFail(LocalOptions());
  std::unique_ptr<Stub> stub = StubFor(*server);

  WatchResult unknown = WatchUntil(*stub, "nobody", [](const pb::JobState&) { return true; });
  CHECK(unknown.ended);
  CHECK(unknown.status.error_code() == grpc::StatusCode::NOT_FOUND);

  std::string member_id;
  StartSingleNodeJob(*stub, "job-closing", &member_id);
  auto closed_watch = std::async(std::launch::async, [&] {
    return WatchUntil(*stub, "job-closing", [](const pb::JobState&) {
      return false;  // read to the end of the stream
    });
  });
  pb::CloseJobRequest close;
  close.set_job_id("job-closing");
  close.set_reason("test is done");
  pb::CloseJobResponse closed;
  REQUIRE(stub->CloseJob(Context().get(), close, &closed).ok());
  REQUIRE(closed_watch.wait_for(kEventTimeout) == std::future_status::ready);
  WatchResult after_close = closed_watch.get();
  CHECK(after_close.ended);
  CHECK(after_close.status.ok());

  StartSingleNodeJob(*stub, "job-open", &member_id);
  std::unique_ptr<grpc::ClientContext> context = Context();
  pb::WatchRequest watch;
  watch.set_job_id("job-open");
  std::unique_ptr<grpc::ClientReader<pb::JobState>> reader = stub->Watch(context.get(), watch);
  pb::JobState first;
  REQUIRE(reader->Read(&first));  // the stream is open on the server now
  auto open_watch = std::async(std::launch::async, [&] {
    pb::JobState state;
    while (reader->Read(&state)) {
    }
    return reader->Finish();
  });
  absl::Time start = absl::Now();
  server->Shutdown(absl::Seconds(2));
  CHECK(absl::Now() - start < absl::Seconds(5));
  REQUIRE(open_watch.wait_for(kEventTimeout) == std::future_status::ready);
  CHECK(open_watch.get().error_code() == grpc::StatusCode::UNAVAILABLE);
}

// A Watch stream held open after its first state.
struct HeldWatch {
  std::unique_ptr<grpc::ClientContext> context = Context();
  std::unique_ptr<grpc::ClientReader<pb::JobState>> reader;
  ~HeldWatch() {
    if (reader == nullptr) return;
    context->TryCancel();
    reader->Finish().IgnoreError();
  }
};

std::unique_ptr<HeldWatch> HoldWatch(Stub& stub, const std::string& job_id) {
  auto held = std::make_unique<HeldWatch>();
  pb::WatchRequest request;
  request.set_job_id(job_id);
  held->reader = stub.Watch(held->context.get(), request);
  pb::JobState first;
  REQUIRE(held->reader->Read(&first));  // registered on the server
  return held;
}

TEST_CASE(
    "Watch streams are capped per job and server-wide, each naming "
    "its quota") {
  ServerOptions options = LocalOptions();
  options.max_watch_streams_per_job = 2;
  options.max_watch_streams = 3;
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  for (const char* job_id : {"job-greedy", "job-modest"}) {
    pb::JoinResponse joined;
    REQUIRE(stub->Join(Context().get(), JoinRequestFor(job_id, 2, 2), &joined).ok());
  }
  auto any_state = [](const pb::JobState&) { return true; };

  std::vector<std::unique_ptr<HeldWatch>> held;
  held.push_back(HoldWatch(*stub, "job-greedy"));
  held.push_back(HoldWatch(*stub, "job-greedy"));
  WatchResult third = WatchUntil(*stub, "job-greedy", any_state);
  INFO(third.status.error_message());
  CHECK(third.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(third.status.error_message().find("job-greedy") != std::string::npos);
  CHECK(third.status.error_message().find("per job") != std::string::npos);
  CHECK(third.status.error_message().find(
            "the limit is 2 (rendezvous --max-watch-streams-per-job)") != std::string::npos);

  // The other job still gets a stream: one tenant did not starve it.
  held.push_back(HoldWatch(*stub, "job-modest"));
  WatchResult over = WatchUntil(*stub, "job-modest", any_state);
  INFO(over.status.error_message());
  CHECK(over.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(over.status.error_message().find("server already has 3") != std::string::npos);
  CHECK(over.status.error_message().find("the limit is 3 (rendezvous --max-watch-streams)") !=
        std::string::npos);
}

// A refusal by a cap: RESOURCE_EXHAUSTED whose message names the limit's
// value and the server flag that sets it.
void CheckNamesLimit(const grpc::Status& status, const std::string& limit,
                     const std::string& flag) {
  INFO(status.error_message());
  CHECK(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(status.error_message().find("the limit is " + limit + " (rendezvous " + flag + ")") !=
        std::string::npos);
}

TEST_CASE("every cap's refusal names the limit and the server flag that sets it") {
  ServerOptions options = LocalOptions();
  options.limits.max_key_bytes = 16;
  options.limits.max_value_bytes = 64;
  options.limits.max_keys_per_job = 2;
  options.limits.max_keys_per_request = 3;
  options.limits.max_response_bytes = 100;
  options.limits.max_members_per_job = 1;
  options.limits.max_jobs = 2;
  options.max_waiters_per_job = 1;
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  std::string member_id;
  const uint64_t round = StartSingleNodeJob(*stub, "job-caps", &member_id);

  CheckNamesLimit(SetKey(*stub, "job-caps", round, std::string(17, 'k'), "v"), "16",
                  "--max-key-bytes");
  CheckNamesLimit(SetKey(*stub, "job-caps", round, "k", std::string(65, 'v')), "64",
                  "--max-value-bytes");
  REQUIRE(SetKey(*stub, "job-caps", round, "a", std::string(64, 'a')).ok());
  REQUIRE(SetKey(*stub, "job-caps", round, "b", std::string(64, 'b')).ok());
  grpc::Status third_key = SetKey(*stub, "job-caps", round, "c", "v");
  CheckNamesLimit(third_key, "2", "--max-keys-per-job");
  CHECK(third_key.error_message().find("holds 2 keys") != std::string::npos);

  auto multi_get = [&](std::vector<std::string> keys) {
    pb::MultiGetRequest request;
    request.set_job_id("job-caps");
    request.set_round(round);
    for (const std::string& key : keys) request.add_keys(key);
    pb::MultiGetResponse response;
    return stub->MultiGet(Context().get(), request, &response);
  };
  CheckNamesLimit(multi_get({"a", "a", "a", "a"}), "3", "--max-keys-per-request");
  CheckNamesLimit(multi_get({"a", "b"}), "100", "--max-response-bytes");

  pb::JoinResponse joined;
  grpc::Status member = stub->Join(Context().get(), JoinRequestFor("job-caps", 1, 1), &joined);
  CheckNamesLimit(member, "1", "--max-members-per-job");
  CHECK(member.error_message().find("has 1 member;") != std::string::npos);

  REQUIRE(stub->Join(Context().get(), JoinRequestFor("job-other", 1, 1), &joined).ok());
  grpc::Status job = stub->Join(Context().get(), JoinRequestFor("job-third", 1, 1), &joined);
  CheckNamesLimit(job, "2", "--max-jobs");
  CHECK(job.error_message().find("holds 2 jobs") != std::string::npos);

  // One blocked Get is the cap; a blocked Wait beside it is refused at once.
  auto blocked = std::async(std::launch::async, [&] {
    pb::GetRequest request;
    request.set_job_id("job-caps");
    request.set_round(round);
    request.set_key("later");
    request.set_wait_ms(20000);
    pb::GetResponse response;
    return stub->Get(Context().get(), request, &response);
  });
  REQUIRE(blocked.wait_for(milliseconds(200)) == std::future_status::timeout);
  pb::WaitRequest wait;
  wait.set_job_id("job-caps");
  wait.set_round(round);
  wait.add_keys("later");
  wait.set_wait_ms(20000);
  pb::WaitResponse waited;
  grpc::Status waiter = stub->Wait(Context().get(), wait, &waited);
  CheckNamesLimit(waiter, "1", "--max-waiters-per-job");
  CHECK(waiter.error_message().find("1 blocked Get or Wait call;") != std::string::npos);

  // The blocked Get still completes: make room for its key and set it.
  pb::DeleteRequest drop;
  drop.set_job_id("job-caps");
  drop.set_round(round);
  drop.set_key("a");
  pb::DeleteResponse dropped;
  REQUIRE(stub->Delete(Context().get(), drop, &dropped).ok());
  REQUIRE(SetKey(*stub, "job-caps", round, "later", "v").ok());
  REQUIRE(blocked.wait_for(kEventTimeout) == std::future_status::ready);
  grpc::Status got = blocked.get();
  INFO(got.error_message());
  CHECK(got.ok());
}

TEST_CASE("Start refuses a blocked-call cap of 0") {
  ServerOptions options = LocalOptions();
  options.max_waiters_per_job = 0;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  REQUIRE(!server.ok());
  CHECK(server.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(server.status().message()).find("max_waiters_per_job") != std::string::npos);
}

TEST_CASE("metrics and health endpoints answer") {
  ServerOptions options = LocalOptions();
  options.metrics_port = -1;  // any free port
  options.metrics_address = "127.0.0.1";
  std::unique_ptr<Server> server = StartOrFail(options);
  REQUIRE(server->metrics_port() > 0);
  std::unique_ptr<Stub> stub = StubFor(*server);
  std::string member_id;
  StartSingleNodeJob(*stub, "job-metrics", &member_id);

  httplib::Client http("127.0.0.1", server->metrics_port());
  http.set_connection_timeout(5);
  http.set_read_timeout(5);
  httplib::Result scraped = http.Get("/metrics");
  REQUIRE(scraped);
  CHECK(scraped->status == 200);
  const std::string& body = scraped->body;
  CHECK(body.find("muster_rdzv_jobs 1") != std::string::npos);
  CHECK(body.find("muster_rdzv_jobs_by_phase{phase=\"running\"} 1") != std::string::npos);
  CHECK(body.find("muster_rdzv_jobs_by_phase{phase=\"succeeded\"} 0") != std::string::npos);
  CHECK(body.find("muster_rdzv_rpcs_total{method=\"Join\",code=\"OK\"} 1") != std::string::npos);
  CHECK(body.find("muster_rdzv_rpc_duration_seconds_bucket{method=\"Join\"") != std::string::npos);
  CHECK(body.find("muster_rdzv_rounds_total 1") != std::string::npos);

  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(Target(*server), grpc::InsecureChannelCredentials()));
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status =
      health->Check(Context().get(), grpc::health::v1::HealthCheckRequest(), &response);
  INFO(status.error_message());
  REQUIRE(status.ok());
  CHECK(response.status() == grpc::health::v1::HealthCheckResponse::SERVING);

  // A second server cannot take the same metrics port (httplib's default
  // SO_REUSEPORT would let it, and scrapes would reach either at random).
  ServerOptions second = LocalOptions();
  second.metrics_port = server->metrics_port();
  second.metrics_address = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<Server>> clash = Server::Start(second);
  INFO(clash.status().ToString());
  CHECK_FALSE(clash.ok());
  CHECK(std::string(clash.status().message()) ==
        absl::StrCat("cannot serve /metrics: cannot listen on '127.0.0.1:", server->metrics_port(),
                     "': Address already in use"));
}

}  // namespace
}  // namespace muster::rdzv::testing
