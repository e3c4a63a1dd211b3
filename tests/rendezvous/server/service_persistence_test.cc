// Persistence of the rendezvous server across restarts: what a restarted
// server knows, that replies wait for durability, that leases are extended
// after a restart, and that a bad state file is refused, not overwritten.
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <optional>
#include <sstream>

#include <catch2/catch.hpp>

#include "rendezvous/server/clock.h"
#include "rendezvous/state/state.pb.h"
#include "tests/rendezvous/server/service_test_util.h"

namespace muster::rdzv::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

int ModeOf(const std::string& path) {
  struct stat info;
  REQUIRE(stat(path.c_str(), &info) == 0);
  return info.st_mode & 0777;
}

TEST_CASE("a restarted server keeps jobs, rounds and keys, and extends leases") {
  TempDir dir;
  FakeClock clock;
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path() + "/state";
  options.clock = &clock;
  const std::string state_file = options.state_dir + "/state.pb";

  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  pb::JoinResponse joined;
  REQUIRE(stub->Join(Context().get(), JoinRequestFor("job-p", 1, 1, 10000), &joined).ok());
  WatchResult running =
      WatchUntil(*stub, "job-p", [](const pb::JobState& s) { return IsRunningWith(s, 1); });
  REQUIRE(running.matched.has_value());
  const uint64_t round = running.matched->round();

  pb::SetRequest set;
  set.set_job_id("job-p");
  set.set_round(round);
  set.set_key("master_port");
  set.set_value("29500");
  pb::SetResponse set_reply;
  REQUIRE(stub->Set(Context().get(), set, &set_reply).ok());

  // The reply came only after the write: the file already holds the key.
  state::ServerState saved;
  REQUIRE(saved.ParseFromString(ReadFile(state_file)));
  bool key_saved = false;
  for (const state::JobRecord& job : saved.jobs()) {
    for (const state::StoreEntry& entry : job.store()) {
      key_saved |=
          job.job_id() == "job-p" && entry.key() == "master_port" && entry.value() == "29500";
    }
  }
  CHECK(key_saved);
  CHECK(ModeOf(options.state_dir) == 0700);
  CHECK(ModeOf(state_file) == 0600);

  // Close to the end of the member's lease when the server goes down.
  clock.Advance(absl::Seconds(9));
  server->Shutdown(absl::Seconds(2));
  server.reset();

  // A write torn by a crash leaves only a temp file behind; it is ignored.
  {
    std::ofstream torn(state_file + ".tmp", std::ios::binary);
    torn << "\x0a\xff torn";
  }
  server = StartOrFail(options);
  stub = StubFor(*server);
  pb::DescribeJobRequest describe;
  describe.set_job_id("job-p");
  pb::DescribeJobResponse described;
  REQUIRE(stub->DescribeJob(Context().get(), describe, &described).ok());
  CHECK(described.state().phase() == pb::RUNNING);
  CHECK(described.state().round() == round);
  REQUIRE(described.state().members_size() == 1);
  CHECK(described.state().members(0).member_id() == joined.member_id());

  pb::GetRequest get;
  get.set_job_id("job-p");
  get.set_round(round);
  get.set_key("master_port");
  pb::GetResponse value;
  REQUIRE(stub->Get(Context().get(), get, &value).ok());
  CHECK(value.value() == "29500");

  // Past the old lease's end but within the one granted at restart.
  clock.Advance(absl::Seconds(5));
  REQUIRE(stub->DescribeJob(Context().get(), describe, &described).ok());
  REQUIRE(described.state().members_size() == 1);
  CHECK(described.state().members(0).lease_age_ms() < 10000);
  pb::KeepAliveRequest keep_alive;
  keep_alive.set_job_id("job-p");
  keep_alive.set_member_id(joined.member_id());
  pb::KeepAliveResponse renewed;
  grpc::Status status = stub->KeepAlive(Context().get(), keep_alive, &renewed);
  INFO(status.error_message());
  REQUIRE(status.ok());

  // Leases still lapse after a restart: the timer ends the round.
  REQUIRE(stub->DescribeJob(Context().get(), describe, &described).ok());
  uint64_t version = described.state().version();
  auto lapsed = std::async(std::launch::async, [&] {
    return WatchUntil(
        *stub, "job-p",
        [&](const pb::JobState& s) { return s.round() > round || s.phase() != pb::RUNNING; },
        CallOptions(), version);
  });
  clock.Advance(absl::Seconds(11));
  REQUIRE(lapsed.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(lapsed.get().matched.has_value());
}

// Joins a one-node job and returns its running round.
uint64_t RunOneNodeJob(Stub& stub, const std::string& job_id) {
  pb::JoinResponse joined;
  grpc::Status status = stub.Join(Context().get(), JoinRequestFor(job_id, 1, 1), &joined);
  INFO(status.error_message());
  REQUIRE(status.ok());
  REQUIRE(joined.state().phase() == pb::RUNNING);
  return joined.state().round();
}

grpc::Status SetKey(Stub& stub, const std::string& job_id, uint64_t round, const std::string& key,
                    const std::string& value) {
  pb::SetRequest set;
  set.set_job_id(job_id);
  set.set_round(round);
  set.set_key(key);
  set.set_value(value);
  pb::SetResponse reply;
  return stub.Set(Context().get(), set, &reply);
}

grpc::Status GetKey(Stub& stub, const std::string& job_id, uint64_t round, const std::string& key,
                    std::string* value) {
  pb::GetRequest get;
  get.set_job_id(job_id);
  get.set_round(round);
  get.set_key(key);
  pb::GetResponse reply;
  grpc::Status status = stub.Get(Context().get(), get, &reply);
  *value = reply.value();
  return status;
}

// The value `key` of `job_id` has in a saved state, or nullopt.
std::optional<std::string> SavedValue(const state::ServerState& saved, const std::string& job_id,
                                      const std::string& key) {
  for (const state::JobRecord& job : saved.jobs()) {
    if (job.job_id() != job_id) continue;
    for (const state::StoreEntry& entry : job.store()) {
      if (entry.key() == key) return entry.value();
    }
  }
  return std::nullopt;
}

// Reads a FIFO until its writer closes it or `deadline` passes.
std::string DrainFifo(int fd, absl::Time deadline) {
  std::string data;
  char buffer[65536];
  while (absl::Now() < deadline) {
    pollfd ready{fd, POLLIN, 0};
    int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()) + 1);
    if (poll(&ready, 1, timeout_ms) <= 0) continue;
    ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      data.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 && !data.empty()) {
      return data;  // the writer wrote and closed
    } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return data;
    }
  }
  return data;
}

// A second server on the same --state-dir would overwrite the first's
// state at its next write (a blue-green restart on another port, a typo):
// it is refused, naming the holder, until the first is gone.
TEST_CASE("a state dir in use by a live server is refused; its end frees it") {
  TempDir dir;
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path();
  std::unique_ptr<Server> first = StartOrFail(options);
  absl::StatusOr<std::unique_ptr<Server>> second = Server::Start(options);
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string message(second.status().message());
  CHECK(message.find("state dir '" + dir.path() + "' is in use by another rendezvous server (pid " +
                     std::to_string(getpid())) != std::string::npos);
  first.reset();
  CHECK(Server::Start(options).ok());
}

TEST_CASE("a change whose state write fails is undone: nothing shows it, and none is written") {
  TempDir dir;
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path();
  const std::string state_file = dir.path() + "/state.pb";
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  const uint64_t round = RunOneNodeJob(*stub, "job-g");

  // The next state write goes into a FIFO: the test sees the snapshot the
  // writer took, and the write fails (a FIFO cannot be fsynced), so the Set
  // reached memory but never the disk.
  const std::string temp = state_file + ".tmp";
  REQUIRE(mkfifo(temp.c_str(), 0600) == 0);
  int fifo = open(temp.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(fifo >= 0);
  auto set = std::async(std::launch::async,
                        [&] { return SetKey(*stub, "job-g", round, "addr", "10.0.0.7"); });
  state::ServerState written;
  REQUIRE(written.ParseFromString(DrainFifo(fifo, absl::Now() + absl::Seconds(10))));
  close(fifo);
  REQUIRE(SavedValue(written, "job-g", "addr") == "10.0.0.7");
  REQUIRE(set.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  grpc::Status set_status = set.get();
  INFO("Set: " << set_status.error_message());
  REQUIRE(set_status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(set_status.error_message().find("change not durable") != std::string::npos);

  // The refused Set was undone: a Get does not see it, and the next write
  // (the FIFO gone) does not save it either.
  unlink(temp.c_str());  // the failed write may have removed it
  std::string value;
  grpc::Status got = GetKey(*stub, "job-g", round, "addr", &value);
  INFO("Get: " << got.error_message());
  CHECK(got.error_code() == grpc::StatusCode::NOT_FOUND);
  REQUIRE(SetKey(*stub, "job-g", round, "other", "1").ok());
  state::ServerState saved;
  REQUIRE(saved.ParseFromString(ReadFile(state_file)));
  CHECK_FALSE(SavedValue(saved, "job-g", "addr").has_value());
  CHECK(SavedValue(saved, "job-g", "other") == "1");

  // A job a refused Join would have made is not there to fail a retry.
  REQUIRE(mkfifo(temp.c_str(), 0600) == 0);
  fifo = open(temp.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(fifo >= 0);
  auto join = std::async(std::launch::async, [&] {
    pb::JoinResponse joined;
    return stub->Join(Context().get(), JoinRequestFor("phantom", 1, 1), &joined);
  });
  DrainFifo(fifo, absl::Now() + absl::Seconds(10));
  close(fifo);
  REQUIRE(join.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(join.get().error_code() == grpc::StatusCode::UNAVAILABLE);
  unlink(temp.c_str());  // the failed write may have removed it
  pb::DescribeJobRequest describe;
  describe.set_job_id("phantom");
  pb::DescribeJobResponse described;
  CHECK(stub->DescribeJob(Context().get(), describe, &described).error_code() ==
        grpc::StatusCode::NOT_FOUND);
  pb::JoinResponse joined;
  CHECK(stub->Join(Context().get(), JoinRequestFor("phantom", 1, 1), &joined).ok());
}

TEST_CASE("the state file keeps working at the byte caps") {
  TempDir dir;
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path();
  options.limits.max_value_bytes = 4096;
  options.limits.max_job_bytes = 32 * 1024;
  options.limits.max_total_bytes = 48 * 1024;
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  const uint64_t round1 = RunOneNodeJob(*stub, "job-1");
  const uint64_t round2 = RunOneNodeJob(*stub, "job-2");

  auto fill = [&](const std::string& job_id, uint64_t round) {
    for (int i = 0; i < 100; ++i) {
      grpc::Status status =
          SetKey(*stub, job_id, round, "k" + std::to_string(i), std::string(4096, 'v'));
      if (!status.ok()) return status;
    }
    return grpc::Status::OK;
  };
  grpc::Status job_full = fill("job-1", round1);
  INFO(job_full.error_message());
  REQUIRE(job_full.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(job_full.error_message().find("--max-job-bytes") != std::string::npos);
  grpc::Status server_full = fill("job-2", round2);
  INFO(server_full.error_message());
  REQUIRE(server_full.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(server_full.error_message().find("--max-total-bytes") != std::string::npos);
  CHECK(ReadFile(dir.path() + "/state.pb").size() <= options.limits.max_total_bytes);

  // Refusals wedge nothing: freeing room lets every job write again.
  pb::DeleteRequest del;
  del.set_job_id("job-1");
  del.set_round(round1);
  del.set_key("k0");
  pb::DeleteResponse deleted;
  REQUIRE(stub->Delete(Context().get(), del, &deleted).ok());
  REQUIRE(deleted.deleted());
  REQUIRE(SetKey(*stub, "job-2", round2, "last", "x").ok());
  REQUIRE(SetKey(*stub, "job-1", round1, "last", "y").ok());

  server->Shutdown(absl::Seconds(2));
  server = StartOrFail(options);
  stub = StubFor(*server);
  std::string value;
  REQUIRE(GetKey(*stub, "job-2", round2, "last", &value).ok());
  CHECK(value == "x");
  REQUIRE(GetKey(*stub, "job-1", round1, "k1", &value).ok());
  CHECK(value == std::string(4096, 'v'));
}

TEST_CASE("a restart over lowered limits keeps the jobs and refuses growth") {
  TempDir dir;
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path();
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  const uint64_t round = RunOneNodeJob(*stub, "job-l");
  REQUIRE(SetKey(*stub, "job-l", round, "big", std::string(8192, 'b')).ok());
  for (int i = 0; i < 20; ++i) {
    REQUIRE(SetKey(*stub, "job-l", round, "k" + std::to_string(i), "v").ok());
  }
  server->Shutdown(absl::Seconds(2));

  // The operator lowers the caps below what job-l holds and restarts.
  options.limits.max_value_bytes = 4096;
  options.limits.max_keys_per_job = 10;
  options.limits.max_job_bytes = 8192;
  absl::StatusOr<std::unique_ptr<Server>> restarted = Server::Start(options);
  INFO(restarted.status().ToString());
  REQUIRE(restarted.ok());
  server = *std::move(restarted);
  stub = StubFor(*server);
  std::string value;
  REQUIRE(GetKey(*stub, "job-l", round, "big", &value).ok());
  CHECK(value == std::string(8192, 'b'));
  grpc::Status grown = SetKey(*stub, "job-l", round, "new", "v");
  CHECK(grown.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(SetKey(*stub, "job-l", round, "k0", "w").ok());  // same size
  CHECK(SetKey(*stub, "job-l", round, "big", "shrunk").ok());
}

TEST_CASE("an unparseable state file stops Start with DATA_LOSS and is kept") {
  TempDir dir;
  const std::string garbage("\x0a\xff\xff\xff\xff\x0f garbage", 14);
  {
    std::ofstream out(dir.path() + "/state.pb", std::ios::binary);
    out << garbage;
  }
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path();
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  REQUIRE(!server.ok());
  CHECK(server.status().code() == absl::StatusCode::kDataLoss);
  CHECK(server.status().message().find(dir.path() + "/state.pb") != std::string::npos);
  CHECK(ReadFile(dir.path() + "/state.pb") == garbage);
}

TEST_CASE("a state file that is a directory or empty stops Start, naming it") {
  TempDir dir;
  const std::string state_file = dir.path() + "/state.pb";
  absl::StatusCode expected;
  SECTION("a directory") {
    // It read as no jobs, and then every write failed to rename over it.
    REQUIRE(mkdir(state_file.c_str(), 0700) == 0);
    expected = absl::StatusCode::kInvalidArgument;
  }
  SECTION("empty") {
    // It read as no jobs; no server writes one, so it is a botched restore.
    std::ofstream(state_file, std::ios::binary).flush();
    expected = absl::StatusCode::kDataLoss;
  }
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path();
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  REQUIRE(!server.ok());
  INFO(server.status().ToString());
  CHECK(server.status().code() == expected);
  CHECK(server.status().message().find("'" + state_file + "'") != std::string::npos);
}

TEST_CASE("a stale state.pb.tmp does not pass its mode to state.pb") {
  TempDir dir;
  const std::string temp = dir.path() + "/state.pb.tmp";
  std::ofstream(temp, std::ios::binary) << "stale";
  REQUIRE(chmod(temp.c_str(), 0644) == 0);
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path();
  StartOrFail(options)->Shutdown();  // the last write makes state.pb
  CHECK(ModeOf(dir.path() + "/state.pb") == 0600);
}

}  // namespace
}  // namespace muster::rdzv::testing
