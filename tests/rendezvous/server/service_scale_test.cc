// The service under load: a thousand Watch streams cost no thousand
// threads and all hear of a change; concurrent durable writes all land;
// a port in use is refused.
#include <fstream>
#include <sstream>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "rendezvous/state/state.pb.h"
#include "tests/rendezvous/server/service_test_util.h"

namespace muster::rdzv::testing {
namespace {

int ThreadsInThisProcess() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// Counts, across many streams, those that saw a first state, those that
// saw the round running, and those that ended (by status code).
struct Tally {
  absl::Mutex mu;
  int first_seen ABSL_GUARDED_BY(mu) = 0;
  int running_seen ABSL_GUARDED_BY(mu) = 0;
  int ended ABSL_GUARDED_BY(mu) = 0;
  int ended_unavailable ABSL_GUARDED_BY(mu) = 0;

  // Waits until `count` reaches `target` or `timeout` passes.
  bool AwaitCount(int Tally::*count, int target, absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    auto reached = [this, count, target]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return this->*count >= target; };
    return mu.AwaitWithTimeout(absl::Condition(&reached), timeout);
  }
};

// One Watch stream on the client's callback API (no thread of its own).
class CountingWatch final : public grpc::ClientReadReactor<pb::JobState> {
 public:
  CountingWatch(Stub& stub, const std::string& job_id, Tally* tally) : tally_(tally) {
    request_.set_job_id(job_id);
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    stub.async()->Watch(&context_, &request_, this);
    StartRead(&state_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    {
      absl::MutexLock lock(&tally_->mu);
      if (!saw_first_) tally_->first_seen++;
      saw_first_ = true;
      if (!saw_running_ && state_.phase() == pb::RUNNING) {
        saw_running_ = true;
        tally_->running_seen++;
      }
    }
    StartRead(&state_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&tally_->mu);
    tally_->ended++;
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      tally_->ended_unavailable++;
    }
  }

 private:
  Tally* tally_;
  grpc::ClientContext context_;
  pb::WatchRequest request_;
  pb::JobState state_;
  bool saw_first_ = false;    // guarded by tally_->mu
  bool saw_running_ = false;  // guarded by tally_->mu
};

TEST_CASE("a thousand Watch streams cost few threads and all hear a change") {
  constexpr int kStreams = 1000;
  std::unique_ptr<Server> server = StartOrFail(LocalOptions());
  std::unique_ptr<Stub> stub = StubFor(*server);
  pb::JoinResponse joined;
  REQUIRE(stub->Join(Context().get(), JoinRequestFor("job-many", 2, 2), &joined).ok());

  Tally tally;
  int threads_before = ThreadsInThisProcess();
  std::vector<std::unique_ptr<CountingWatch>> watches;
  for (int i = 0; i < kStreams; ++i) {
    watches.push_back(std::make_unique<CountingWatch>(*stub, "job-many", &tally));
  }
  bool all_open = tally.AwaitCount(&Tally::first_seen, kStreams, absl::Seconds(30));
  int threads_after = ThreadsInThisProcess();
  CHECK(all_open);
  INFO("threads before " << threads_before << ", after " << threads_after);
  CHECK(threads_after - threads_before < 64);

  pb::JoinResponse second;
  REQUIRE(stub->Join(Context().get(), JoinRequestFor("job-many", 2, 2), &second).ok());
  CHECK(tally.AwaitCount(&Tally::running_seen, kStreams, absl::Seconds(30)));

  server->Shutdown(absl::Seconds(2));
  bool all_ended = tally.AwaitCount(&Tally::ended, kStreams, absl::Seconds(30));
  REQUIRE(all_ended);  // the reactors must not be destroyed before OnDone
  absl::MutexLock lock(&tally.mu);
  CHECK(tally.ended_unavailable == kStreams);
}

TEST_CASE("concurrent durable writes all complete and all reach the file") {
  constexpr int kWriters = 8;
  constexpr int kKeysEach = 10;
  TempDir dir;
  ServerOptions options = LocalOptions();
  options.state_dir = dir.path();
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  pb::JoinResponse joined;
  REQUIRE(stub->Join(Context().get(), JoinRequestFor("job-commit", 1, 1), &joined).ok());
  WatchResult running =
      WatchUntil(*stub, "job-commit", [](const pb::JobState& s) { return IsRunningWith(s, 1); });
  REQUIRE(running.matched.has_value());

  std::vector<std::thread> writers;
  std::atomic<int> succeeded{0};
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int k = 0; k < kKeysEach; ++k) {
        pb::SetRequest set;
        set.set_job_id("job-commit");
        set.set_round(running.matched->round());
        set.set_key("key-" + std::to_string(w) + "-" + std::to_string(k));
        set.set_value("value");
        pb::SetResponse reply;
        if (stub->Set(Context().get(), set, &reply).ok()) succeeded++;
      }
    });
  }
  for (std::thread& writer : writers) writer.join();
  CHECK(succeeded.load() == kWriters * kKeysEach);

  // Every acknowledged write is in the file before Shutdown writes again.
  std::ifstream in(dir.path() + "/state.pb", std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  state::ServerState saved;
  REQUIRE(saved.ParseFromString(contents.str()));
  int keys = 0;
  for (const state::JobRecord& job : saved.jobs()) {
    if (job.job_id() == "job-commit") keys += job.store_size();
  }
  CHECK(keys == kWriters * kKeysEach);
}

TEST_CASE("a port already in use is refused with UNAVAILABLE") {
  std::unique_ptr<Server> first = StartOrFail(LocalOptions());
  ServerOptions options = LocalOptions();
  options.listen_address = Target(*first);
  absl::StatusOr<std::unique_ptr<Server>> second = Server::Start(options);
  REQUIRE(!second.ok());
  CHECK(second.status().code() == absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace muster::rdzv::testing
