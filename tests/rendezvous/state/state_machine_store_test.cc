// The state machine's per-round store, its limits, and job secrets.
#include <catch2/catch.hpp>

#include "rendezvous/state/state_machine.h"
#include "tests/rendezvous/state/state_machine_test_util.h"

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

  absl::StatusOr<pb::AddResponse> Add(const std::string& key, int64_t delta, uint64_t round = 0) {
    pb::AddRequest request;
    request.set_job_id("j1");
    request.set_round(round);
    request.set_key(key);
    request.set_delta(delta);
    auto response = h.machine.Add(request);
    h.Check();
    return response;
  }
  absl::StatusOr<pb::CompareAndSetResponse> Cas(const std::string& key, bool expect_absent,
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
  REQUIRE_CODE(h.machine.Get("j1", 1, "MASTER_PORT"), absl::StatusCode::kNotFound);
  REQUIRE_CODE(h.machine.Get("j1", 0, "MASTER_PORT"), absl::StatusCode::kAborted);
  REQUIRE_CODE(h.machine.Get("nope", 0, "k"), absl::StatusCode::kNotFound);
}

bool Mentions(const absl::Status& status, const std::string& text) {
  return std::string(status.message()).find(text) != std::string::npos;
}
template <typename T>
bool Mentions(const absl::StatusOr<T>& result, const std::string& text) {
  return Mentions(result.status(), text);
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
  absl::Status fourth = h.Set("j1", 0, "k4", "v");
  REQUIRE_CODE(fourth, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(fourth,
                 "round 0 of job j1 holds 3 keys; "
                 "the limit is 3 (rendezvous --max-keys-per-job)"));
  REQUIRE_CODE(job.Add("k4", 1), absl::StatusCode::kResourceExhausted);
  REQUIRE_CODE(job.Cas("k4", true, "", "v"), absl::StatusCode::kResourceExhausted);
  REQUIRE_OK(h.Set("j1", 0, "k1", "overwrite"));  // existing keys are fine
}

TEST_CASE("oversized and empty keys and values are rejected") {
  Limits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  RunningJob job(limits);
  Harness& h = job.h;
  REQUIRE_CODE(h.Set("j1", 0, "", "v"), absl::StatusCode::kInvalidArgument);
  absl::Status long_key = h.Set("j1", 0, "123456789", "v");
  REQUIRE_CODE(long_key, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(long_key, "key is 9 bytes; the limit is 8 (rendezvous --max-key-bytes)"));
  absl::Status long_value = h.Set("j1", 0, "k", std::string(17, 'x'));
  REQUIRE_CODE(long_value, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(long_value, "value is 17 bytes; the limit is 16 (rendezvous --max-value-bytes)"));
  REQUIRE_OK(h.Set("j1", 0, "12345678", std::string(16, 'x')));
  REQUIRE_CODE(job.Cas("k", true, "", std::string(17, 'x')), absl::StatusCode::kResourceExhausted);
  REQUIRE_CODE(h.machine.Get("j1", 0, "123456789"), absl::StatusCode::kResourceExhausted);
}

pb::MultiGetRequest MultiGetOf(const std::string& key, int times) {
  pb::MultiGetRequest request;
  request.set_job_id("j1");
  for (int i = 0; i < times; ++i) request.add_keys(key);
  return request;
}

TEST_CASE("MultiGet and AllSet cap the keys named and the bytes returned") {
  Limits limits;
  limits.max_value_bytes = 1024;
  limits.max_keys_per_request = 8;
  limits.max_response_bytes = 4096;
  RunningJob job(limits);
  Harness& h = job.h;
  REQUIRE_OK(h.Set("j1", 0, "big", std::string(1024, 'x')));

  // A key named twice is answered twice while both caps hold.
  auto four = h.machine.MultiGet(MultiGetOf("big", 4));
  REQUIRE_OK(four);
  REQUIRE(four->values_size() == 4);
  REQUIRE(four->values(3).size() == 1024);
  auto five = h.machine.MultiGet(MultiGetOf("big", 5));  // 5 KiB of values
  REQUIRE_CODE(five, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(five, "--max-response-bytes"));
  auto nine = h.machine.MultiGet(MultiGetOf("absent", 9));
  REQUIRE_CODE(nine, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(nine, "--max-keys-per-request"));

  REQUIRE(*h.machine.AllSet("j1", 0, {"big", "big"}));
  REQUIRE_FALSE(*h.machine.AllSet("j1", 0, {"big", "absent"}));
  auto too_many = h.machine.AllSet("j1", 0, std::vector<std::string>(9, "big"));
  REQUIRE_CODE(too_many, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(too_many, "--max-keys-per-request"));
  REQUIRE_CODE(h.machine.AllSet("j1", 1, {"big"}), absl::StatusCode::kFailedPrecondition);
  REQUIRE_CODE(h.machine.AllSet("j1", 0, {""}), absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a job's bytes are capped; shrinking or freeing is never refused") {
  Limits limits;
  limits.max_value_bytes = 1000;
  limits.max_job_bytes = 8 * 1024;
  RunningJob job(limits);
  Harness& h = job.h;
  const size_t bare = *h.machine.JobBytes("j1");  // members and records
  REQUIRE(bare > 0);
  absl::Status status;
  int stored = 0;
  for (; stored < 100; ++stored) {
    status = h.Set("j1", 0, "k" + std::to_string(stored), std::string(1000, 'v'));
    if (!status.ok()) break;
  }
  REQUIRE_CODE(status, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(status, "the limit is 8192 (rendezvous --max-job-bytes)"));
  CHECK(stored >= 5);
  REQUIRE(*h.machine.JobBytes("j1") <= limits.max_job_bytes);
  REQUIRE_CODE(job.Cas("fresh", true, "", std::string(1000, 'c')),
               absl::StatusCode::kResourceExhausted);
  // Overwriting with a value no larger is not growth; it makes room.
  REQUIRE_OK(h.Set("j1", 0, "k0", "small"));
  REQUIRE_OK(h.Set("j1", 0, "fresh", std::string(900, 'f')));
  REQUIRE(job.Delete("k1")->deleted());
  REQUIRE_OK(job.Add("counter", 1));
  // A new round starts with an empty store.
  h.Rejoin("j1", job.config, job.a);
  h.Rejoin("j1", job.config, job.b);
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE(*h.machine.JobBytes("j1") == bare);
  REQUIRE_CODE(h.machine.JobBytes("nope"), absl::StatusCode::kNotFound);
}

TEST_CASE("the bytes of all jobs are capped and bound the snapshot's size") {
  Limits limits;
  limits.max_value_bytes = 1000;
  limits.max_job_bytes = 64 * 1024;
  limits.max_total_bytes = 16 * 1024;
  Harness h(limits);
  pb::JobConfig config = Config(1, 1);
  config.set_max_restarts(100);
  std::string a = h.Join("j1", config);
  JoinArgs long_host;
  long_host.hostname = std::string(200, 'h');
  std::string b = h.Join("j2", config, long_host);
  absl::Status status;
  for (int i = 0; i < 100 && status.ok(); ++i) {
    status = h.Set("j1", 0, "k" + std::to_string(i), std::string(1000, 'v'));
  }
  REQUIRE_CODE(status, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(status, "the limit is 16384 (rendezvous --max-total-bytes)"));
  status = h.Set("j2", 0, "k", std::string(1000, 'v'));
  REQUIRE_CODE(status, absl::StatusCode::kResourceExhausted);
  REQUIRE(h.machine.total_bytes() <= limits.max_total_bytes);
  REQUIRE(*h.machine.JobBytes("j1") + *h.machine.JobBytes("j2") == h.machine.total_bytes());
  REQUIRE(h.machine.Snapshot(h.now).ByteSizeLong() <= h.machine.total_bytes());

  // Failures, long hostnames and close reasons are charged too, so the
  // accounting keeps bounding the snapshot whatever the job records.
  for (uint64_t round = 0; round < 40; ++round) {
    pb::ReportFailureRequest failure;
    failure.set_job_id("j2");
    failure.set_round(round);
    failure.set_member_id(b);
    failure.set_message(std::string(5000, 'm'));
    REQUIRE_OK(h.machine.ReportFailure(failure, h.now));
    JoinArgs rejoin = long_host;
    rejoin.member_id = b;
    REQUIRE_OK(h.TryJoin("j2", config, rejoin));
    REQUIRE(h.machine.Snapshot(h.now).ByteSizeLong() <= h.machine.total_bytes());
  }
  pb::CloseJobRequest close;
  close.set_job_id("j2");
  close.set_reason(std::string(5000, 'r'));
  REQUIRE_OK(h.machine.Close(close, h.now));
  h.Check();
  REQUIRE(h.machine.Snapshot(h.now).ByteSizeLong() <= h.machine.total_bytes());
  // Dropping a job returns its bytes.
  const size_t j1_bytes = *h.machine.JobBytes("j1");
  REQUIRE(h.machine.total_bytes() > j1_bytes);
  h.Advance(limits.closed_retention);
  REQUIRE_CODE(h.machine.JobBytes("j2"), absl::StatusCode::kNotFound);
  REQUIRE(h.machine.total_bytes() == *h.machine.JobBytes("j1"));
}

TEST_CASE("the limits are checked against each other and the state file") {
  REQUIRE_OK(ValidateLimits(Limits()));
  Limits small_response;
  small_response.max_response_bytes = small_response.max_value_bytes - 1;
  auto status = ValidateLimits(small_response);
  REQUIRE_CODE(status, absl::StatusCode::kInvalidArgument);
  CHECK(Mentions(status, "--max-response-bytes"));
  Limits small_job;
  small_job.max_job_bytes = small_job.max_value_bytes;
  REQUIRE_CODE(ValidateLimits(small_job), absl::StatusCode::kInvalidArgument);
  Limits huge_total;
  huge_total.max_total_bytes = kMaxStateBytes;
  status = ValidateLimits(huge_total);
  REQUIRE_CODE(status, absl::StatusCode::kInvalidArgument);
  CHECK(Mentions(status, "--max-total-bytes"));
  Limits many_jobs;
  many_jobs.max_jobs = kMaxStateBytes / MaxUnrefusedJobBytes(many_jobs);
  REQUIRE_CODE(ValidateLimits(many_jobs), absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Restore keeps jobs over lowered limits and refuses only growth") {
  Limits generous;
  generous.max_join_timeout_ms = 10'000'000;
  Harness h(generous);
  pb::JobConfig config = Config(2, 3);
  config.set_join_timeout_ms(7'200'000);
  std::string a = h.Join("j1", config);
  std::string b = h.Join("j1", config);
  h.Advance(absl::Seconds(1));
  REQUIRE(h.State("j1").phase() == pb::RUNNING);
  REQUIRE_OK(h.Set("j1", 0, "big", std::string(2000, 'v')));
  for (int i = 0; i < 20; ++i) {
    REQUIRE_OK(h.Set("j1", 0, "k" + std::to_string(i), "v"));
  }
  h.Join("j2", Config(1, 1));
  const state::ServerState snapshot = h.machine.Snapshot(h.now);

  Limits lowered;
  lowered.max_value_bytes = 1000;
  lowered.max_keys_per_job = 10;
  lowered.max_members_per_job = 1;
  lowered.max_jobs = 1;
  lowered.max_job_bytes = 2000;
  lowered.max_total_bytes = 3000;
  lowered.max_join_timeout_ms = 60'000;
  Harness restored(lowered);
  REQUIRE_OK(restored.machine.Restore(snapshot, restored.now));
  restored.Check();
  REQUIRE(restored.machine.job_count() == 2);
  REQUIRE(*restored.machine.Get("j1", 0, "big") == std::string(2000, 'v'));
  REQUIRE(restored.machine.total_bytes() > lowered.max_total_bytes);

  REQUIRE_CODE(restored.Set("j1", 0, "new", "v"), absl::StatusCode::kResourceExhausted);
  REQUIRE_CODE(restored.Set("j1", 0, "k0", "vv"), absl::StatusCode::kResourceExhausted);
  REQUIRE_OK(restored.Set("j1", 0, "k0", "w"));  // same size: no growth
  REQUIRE_OK(restored.Set("j1", 0, "big", std::string(900, 'v')));
  REQUIRE_CODE(restored.TryJoin("j3", Config(1, 1)), absl::StatusCode::kResourceExhausted);
  REQUIRE_CODE(restored.TryJoin("j1", config), absl::StatusCode::kResourceExhausted);
  // A member already in the job re-joins under the job's own settings.
  restored.Rejoin("j1", config, a);
  restored.Rejoin("j1", config, b);
  REQUIRE(restored.State("j1").phase() == pb::RUNNING);
  REQUIRE(restored.State("j1").round() == 1);
}

TEST_CASE("jobs and members per job are capped") {
  Limits limits;
  limits.max_jobs = 2;
  limits.max_members_per_job = 2;
  Harness h(limits);
  auto config = Config(3, 3);
  h.Join("j1", config);
  h.Join("j1", config);
  auto third_member = h.TryJoin("j1", config);
  REQUIRE_CODE(third_member, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(third_member,
                 "job j1 has 2 members; the limit is 2 (rendezvous --max-members-per-job)"));
  h.Join("j2", config);
  auto third_job = h.TryJoin("j3", config);
  REQUIRE_CODE(third_job, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(third_job,
                 "job j3 cannot be created: the server holds 2 jobs; "
                 "the limit is 2 (rendezvous --max-jobs)"));
  REQUIRE(h.machine.job_count() == 2);
  REQUIRE(h.machine.member_count() == 3);

  Limits one;
  one.max_members_per_job = 1;
  Harness single(one);
  single.Join("j1", Config(1, 2));
  CHECK(Mentions(single.TryJoin("j1", Config(1, 2)), "job j1 has 1 member; the limit is 1"));
  Limits none;
  none.max_members_per_job = 0;
  Harness empty(none);
  auto refused = empty.TryJoin("j1", Config(1, 1));
  REQUIRE_CODE(refused, absl::StatusCode::kResourceExhausted);
  CHECK(Mentions(refused, "the limit is 0 (rendezvous --max-members-per-job)"));
  CHECK(empty.machine.job_count() == 0);
}

TEST_CASE("job secrets") {
  Harness h;
  auto config = Config(2, 2);
  JoinArgs with_secret;
  with_secret.secret = "s3cret";
  std::string a = h.Join("j1", config, with_secret);
  REQUIRE_OK(h.machine.Authorize("j1", "s3cret"));
  REQUIRE_CODE(h.machine.Authorize("j1", "wrong"), absl::StatusCode::kPermissionDenied);
  REQUIRE_CODE(h.machine.Authorize("j1", ""), absl::StatusCode::kPermissionDenied);
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
