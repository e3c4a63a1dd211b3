// The state machine's per-round store, its limits, and job secrets.
#include <catch2/catch.hpp>

#include "rendezvous/state_machine.h"
#include "tests/rendezvous/state_machine_test_util.h"

namespace muster::rdzv {
namespace {

using testing::Config;
using testing::Harness;
using testing::JoinArgs;

// A harness with job "j1" RUNNING round 0 with members a and b.
struct RunningJob {
  explicit RunningJob(Limits limits = Limits()) : h(limits) {
    a = h.Join("j1", config);
    b = h.Join("j1", config);
    REQUIRE(h.State("j1").phase() == pb::RUNNING);
  }
  Harness h;
  pb::JobConfig config = Config(2, 2);
  std::string a, b;

  absl::StatusOr<pb::AddResponse> Add(const std::string& key, int64_t delta,
                                      uint64_t round = 0) {
    pb::AddRequest request;
    request.set_job_id("j1");
    request.set_round(round);
    request.set_key(key);
    request.set_delta(delta);
    auto response = h.machine.Add(request);
    h.Check();
    return response;
  }
  absl::StatusOr<pb::CompareAndSetResponse> Cas(const std::string& key,
                                                bool expect_absent,
                                                const std::string& expected,
                                                const std::string& desired) {
    pb::CompareAndSetRequest request;
    request.set_job_id("j1");
    request.set_key(key);
    request.set_expect_absent(expect_absent);
    request.set_expected(expected);
    request.set_desired(desired);
    auto response = h.machine.CompareAndSet(request);
    h.Check();
    return response;
  }
  absl::StatusOr<pb::DeleteResponse> Delete(const std::string& key) {
    pb::DeleteRequest request;
    request.set_job_id("j1");
    request.set_key(key);
    return h.machine.Delete(request);
  }
};

TEST_CASE("set, get, add, compare-and-set, delete and multiget") {
  RunningJob job;
  Harness& h = job.h;
  REQUIRE_CODE(h.machine.Get("j1", 0, "k"), absl::StatusCode::kNotFound);
  REQUIRE_OK(h.Set("j1", 0, "k", std::string("bin\0ary", 7)));
  REQUIRE(*h.machine.Get("j1", 0, "k") == std::string("bin\0ary", 7));
  REQUIRE_OK(h.Set("j1", 0, "empty", ""));
  REQUIRE(*h.machine.Get("j1", 0, "empty") == "");

  REQUIRE(job.Add("counter", 5)->value() == 5);
  REQUIRE(job.Add("counter", -7)->value() == -2);
  REQUIRE(*h.machine.Get("j1", 0, "counter") == "-2");
  REQUIRE_CODE(job.Add("k", 1), absl::StatusCode::kFailedPrecondition);
  REQUIRE_OK(h.Set("j1", 0, "big", "9223372036854775807"));
  REQUIRE_CODE(job.Add("big", 1), absl::StatusCode::kFailedPrecondition);

  auto created = job.Cas("id", /*expect_absent=*/true, "", "first");
  REQUIRE(created->swapped());
  REQUIRE(created->present());
  REQUIRE(created->value() == "first");
  auto lost = job.Cas("id", true, "", "second");
  REQUIRE_FALSE(lost->swapped());
  REQUIRE(lost->value() == "first");
  auto mismatch = job.Cas("id", false, "nope", "third");
  REQUIRE_FALSE(mismatch->swapped());
  REQUIRE(mismatch->value() == "first");
  auto swapped = job.Cas("id", false, "first", "third");
  REQUIRE(swapped->swapped());
  REQUIRE(*h.machine.Get("j1", 0, "id") == "third");
  auto absent = job.Cas("missing", false, "", "x");
  REQUIRE_FALSE(absent->swapped());
  REQUIRE_FALSE(absent->present());

  REQUIRE(job.Delete("id")->deleted());
  REQUIRE_FALSE(job.Delete("id")->deleted());

  pb::MultiGetRequest multi;
  multi.set_job_id("j1");
  multi.add_keys("counter");
  multi.add_keys("id");
  multi.add_keys("empty");
  auto values = h.machine.MultiGet(multi);
  REQUIRE_OK(values);
  REQUIRE(values->present_size() == 3);
  REQUIRE(values->present(0));
  REQUIRE(values->values(0) == "-2");
  REQUIRE_FALSE(values->present(1));
  REQUIRE(values->present(2));
  REQUIRE(values->values(2) == "");
}

TEST_CASE("the store is scoped to the round and cleared when it ends") {
  RunningJob job;
  Harness& h = job.h;
  REQUIRE_OK(h.Set("j1", 0, "MASTER_PORT", "29500"));
  REQUIRE_OK(h.ReportFailure("j1", 0, job.a));
  h.Rejoin("j1", job.config, job.a);
  h.Rejoin("j1", job.config, job.b);
  REQUIRE(h.State("j1").round() == 1);
  REQUIRE_CODE(h.machine.Get("j1", 1, "MASTER_PORT"),
               absl::StatusCode::kNotFound);
  REQUIRE_CODE(h.machine.Get("j1", 0, "MASTER_PORT"),
               absl::StatusCode::kAborted);
  REQUIRE_CODE(h.machine.Get("nope", 0, "k"), absl::StatusCode::kNotFound);
}

TEST_CASE("store limits") {
  Limits limits;
  limits.max_keys_per_job = 3;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  RunningJob job(limits);
  Harness& h = job.h;
  REQUIRE_OK(h.Set("j1", 0, "k1", "v"));
  REQUIRE_OK(h.Set("j1", 0, "k2", "v"));
  REQUIRE_OK(job.Add("k3", 1));
  REQUIRE_CODE(h.Set("j1", 0, "k4", "v"), absl::StatusCode::kResourceExhausted);
  REQUIRE_CODE(job.Add("k4", 1), absl::StatusCode::kResourceExhausted);
  REQUIRE_CODE(job.Cas("k4", true, "", "v"),
               absl::StatusCode::kResourceExhausted);
  REQUIRE_OK(h.Set("j1", 0, "k1", "overwrite"));  // existing keys are fine
}

TEST_CASE("oversized and empty keys and values are rejected") {
  Limits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  RunningJob job(limits);
  Harness& h = job.h;
  REQUIRE_CODE(h.Set("j1", 0, "", "v"), absl::StatusCode::kInvalidArgument);
  REQUIRE_CODE(h.Set("j1", 0, "123456789", "v"),
               absl::StatusCode::kResourceExhausted);
  REQUIRE_CODE(h.Set("j1", 0, "k", std::string(17, 'x')),
               absl::StatusCode::kResourceExhausted);
  REQUIRE_OK(h.Set("j1", 0, "12345678", std::string(16, 'x')));
  REQUIRE_CODE(job.Cas("k", true, "", std::string(17, 'x')),
               absl::StatusCode::kResourceExhausted);
  REQUIRE_CODE(h.machine.Get("j1", 0, "123456789"),
               absl::StatusCode::kResourceExhausted);
}

TEST_CASE("jobs and members per job are capped") {
  Limits limits;
  limits.max_jobs = 2;
  limits.max_members_per_job = 2;
  Harness h(limits);
  auto config = Config(3, 3);
  h.Join("j1", config);
  h.Join("j1", config);
  REQUIRE_CODE(h.TryJoin("j1", config), absl::StatusCode::kResourceExhausted);
  h.Join("j2", config);
  REQUIRE_CODE(h.TryJoin("j3", config), absl::StatusCode::kResourceExhausted);
  REQUIRE(h.machine.job_count() == 2);
  REQUIRE(h.machine.member_count() == 3);
}

TEST_CASE("job secrets") {
  Harness h;
  auto config = Config(2, 2);
  JoinArgs with_secret;
  with_secret.secret = "s3cret";
  std::string a = h.Join("j1", config, with_secret);
  REQUIRE_OK(h.machine.Authorize("j1", "s3cret"));
  REQUIRE_CODE(h.machine.Authorize("j1", "wrong"),
               absl::StatusCode::kPermissionDenied);
  REQUIRE_CODE(h.machine.Authorize("j1", ""),
               absl::StatusCode::kPermissionDenied);
  REQUIRE_OK(h.machine.Authorize("unknown-job", "anything"));
  REQUIRE_CODE(h.TryJoin("j1", config), absl::StatusCode::kPermissionDenied);
  REQUIRE(h.State("j1").nodes_pending() == 1);
  h.Join("j1", config, with_secret);
  REQUIRE(h.State("j1").phase() == pb::RUNNING);

  h.Join("open", config);  // no secret: anyone may act on it
  REQUIRE_OK(h.machine.Authorize("open", ""));
  REQUIRE_OK(h.machine.Authorize("open", "whatever"));
}

TEST_CASE("Describe adds lease ages and the waiting nodes") {
  RunningJob job;
  Harness& h = job.h;
  std::string c = h.Join("j1", job.config);
  h.Advance(absl::Seconds(2));
  REQUIRE_OK(h.KeepAlive("j1", job.a));
  auto described = h.machine.Describe("j1", h.now);
  REQUIRE_OK(described);
  REQUIRE(described->members(0).lease_age_ms() == 0);
  REQUIRE(described->members(1).lease_age_ms() == 2000);
  REQUIRE(described->waiting_size() == 1);
  REQUIRE(described->waiting(0).member_id() == c);
  REQUIRE(described->waiting(0).group_rank() == -1);
  auto list = h.machine.ListJobs();
  REQUIRE(list.jobs_size() == 1);
  REQUIRE(list.jobs(0).nodes() == 2);
  REQUIRE(list.jobs(0).nodes_waiting() == 1);
  REQUIRE(list.jobs(0).max_restarts() == 3);
}

}  // namespace
}  // namespace muster::rdzv
