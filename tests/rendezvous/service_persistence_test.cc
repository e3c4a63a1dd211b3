// Persistence of the rendezvous server across restarts: what a restarted
// server knows, that replies wait for durability, that leases are extended
// after a restart, and that a bad state file is refused, not overwritten.
#include <sys/stat.h>

#include <fstream>
#include <future>
#include <sstream>

#include <catch2/catch.hpp>

#include "rendezvous/clock.h"
#include "rendezvous/state.pb.h"
#include "tests/rendezvous/service_test_util.h"

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
  REQUIRE(stub->Join(Context().get(), JoinRequestFor("job-p", 1, 1, 10000),
                     &joined)
              .ok());
  WatchResult running = WatchUntil(*stub, "job-p", [](const pb::JobState& s) {
    return IsRunningWith(s, 1);
  });
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
      key_saved |= job.job_id() == "job-p" && entry.key() == "master_port" &&
                   entry.value() == "29500";
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
        [&](const pb::JobState& s) {
          return s.round() > round || s.phase() != pb::RUNNING;
        },
        CallOptions(), version);
  });
  clock.Advance(absl::Seconds(11));
  REQUIRE(lapsed.wait_for(std::chrono::seconds(10)) ==
          std::future_status::ready);
  CHECK(lapsed.get().matched.has_value());
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
  CHECK(server.status().message().find(dir.path() + "/state.pb") !=
        std::string::npos);
  CHECK(ReadFile(dir.path() + "/state.pb") == garbage);
}

}  // namespace
}  // namespace muster::rdzv::testing
