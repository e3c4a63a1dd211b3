// The watchdog's decisions and actions, with a fake clock and a fake group:
// no thread, no sockets, no GPU. (The real thing, a worker aborting when
// its rendezvous round ends, is //tests/worker/strategy:ddp_watchdog_test.)
#include "parallel/watchdog.h"

#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "parallel/work_queue.h"

namespace muster::parallel {
namespace {

// A group whose health the test sets and whose aborts it records.
class FakeGroup : public ProcessGroup {
 public:
  explicit FakeGroup(std::string name = "world") : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  absl::Duration timeout() const override { return absl::Seconds(60); }
  GroupMembers members() const override { return {name_, {}}; }
  std::shared_ptr<Work> AllReduce(absl::Span<float>, ReduceOp) override { return Nothing(); }
  std::shared_ptr<Work> ReduceScatter(absl::Span<const float>, absl::Span<float>,
                                      std::vector<size_t>, ReduceOp) override {
    return Nothing();
  }
  std::shared_ptr<Work> AllGather(absl::Span<const float>, absl::Span<float>,
                                  std::vector<size_t>) override {
    return Nothing();
  }
  std::shared_ptr<Work> AllGatherBf16(absl::Span<const uint16_t>, absl::Span<uint16_t>,
                                      std::vector<size_t>) override {
    return Nothing();
  }
  std::shared_ptr<Work> AllReduceInt64(absl::Span<int64_t>, ReduceOp) override { return Nothing(); }
  std::shared_ptr<Work> Broadcast(absl::Span<float>, int) override { return Nothing(); }
  std::shared_ptr<Work> BroadcastBytes(absl::Span<uint8_t>, int) override { return Nothing(); }
  std::shared_ptr<Work> Send(absl::Span<const float>, int, int) override { return Nothing(); }
  std::shared_ptr<Work> Recv(absl::Span<float>, int, int) override { return Nothing(); }
  std::shared_ptr<Work> Barrier() override { return Nothing(); }

  GroupHealth Health() const override {
    absl::MutexLock lock(&mu_);
    return health_;
  }
  void Abort(const absl::Status& cause) override {
    absl::MutexLock lock(&mu_);
    aborts_.push_back(cause);
    if (health_.error.ok()) health_.error = cause;  // as a real group: sticky
    if (!aborted_.HasBeenNotified()) aborted_.Notify();
  }

  void SetHealth(GroupHealth health) {
    absl::MutexLock lock(&mu_);
    health_ = std::move(health);
  }
  std::vector<absl::Status> aborts() const {
    absl::MutexLock lock(&mu_);
    return aborts_;
  }
  absl::Notification& aborted() { return aborted_; }

 private:
  static std::shared_ptr<Work> Nothing() {
    // The watchdog issues no operation; none of these is called.
    return WorkQueue::Finished(absl::UnimplementedError("FakeGroup carries no data"));
  }
  const std::string name_;
  mutable absl::Mutex mu_;
  GroupHealth health_;
  std::vector<absl::Status> aborts_;
  absl::Notification aborted_;
};

struct FakeClock {
  absl::Time now = absl::UnixEpoch() + absl::Hours(1);
};

struct Fixture {
  FakeGroup group;
  FakeClock clock;
  absl::Status round;  // what the round probe says
  std::vector<absl::Status> stuck;
  WatchdogOptions Options() {
    WatchdogOptions options;
    options.now = [this] { return clock.now; };
    options.timeout_slack = absl::Seconds(5);
    options.exit_grace = absl::Seconds(5);
    return options;
  }
  std::unique_ptr<Watchdog> Make() {
    return std::make_unique<Watchdog>(
        std::vector<ProcessGroup*>{&group}, [this] { return round; },
        [this](const absl::Status& cause) { stuck.push_back(cause); }, Options());
  }
};

GroupHealth Running(absl::Time since, std::string what = "allreduce of 1000 floats") {
  GroupHealth health;
  health.running_since = since;
  health.running = std::move(what);
  return health;
}

TEST_CASE("Decide: nothing wrong is OK") {
  WatchdogObservation o;
  o.now = absl::UnixEpoch() + absl::Hours(1);
  CHECK(Decide(o, absl::Seconds(10)).ok());
  o.health = Running(o.now - absl::Seconds(10));  // exactly at the limit: not past it
  CHECK(Decide(o, absl::Seconds(10)).ok());
}

TEST_CASE("Decide: the group's error comes first, then the round, then the clock") {
  WatchdogObservation o;
  o.now = absl::UnixEpoch() + absl::Hours(1);
  o.health = Running(o.now - absl::Minutes(5));
  o.round = absl::AbortedError("rendezvous round 3 ended (LEASE_EXPIRED)");
  o.health.error = absl::UnavailableError("connection to rank 1 failed");
  absl::Status cause = Decide(o, absl::Seconds(10));
  CHECK(absl::IsUnavailable(cause));
  CHECK(cause.message() == "connection to rank 1 failed");

  o.health.error = absl::OkStatus();
  cause = Decide(o, absl::Seconds(10));
  CHECK(absl::IsAborted(cause));
  CHECK(cause.message() == "rendezvous round 3 ended (LEASE_EXPIRED)");

  o.round = absl::OkStatus();
  cause = Decide(o, absl::Seconds(10));
  CHECK(absl::IsDeadlineExceeded(cause));
  CHECK_THAT(std::string(cause.message()),
             Catch::Contains("allreduce of 1000 floats") && Catch::Contains("has run for 5m"));
}

TEST_CASE("a healthy group is never aborted") {
  Fixture f;
  auto dog = f.Make();
  for (int i = 0; i < 100; ++i) {
    f.group.SetHealth(Running(f.clock.now - absl::Seconds(30)));  // long, but within 60 + 5
    CHECK(dog->PollOnce().ok());
    f.clock.now += absl::Seconds(1);
  }
  CHECK(f.group.aborts().empty());
  CHECK(f.stuck.empty());
  CHECK(dog->cause().ok());
}

TEST_CASE("the round's end aborts the group once, and on_stuck runs once after the grace") {
  Fixture f;
  auto dog = f.Make();
  f.group.SetHealth(Running(f.clock.now));
  CHECK(dog->PollOnce().ok());
  f.round = absl::AbortedError("rendezvous round 7 of job j ended (NODE_FAILED)");
  absl::Status cause = dog->PollOnce();
  REQUIRE(absl::IsAborted(cause));
  CHECK_THAT(std::string(cause.message()), Catch::Contains("round 7 of job j ended"));
  REQUIRE(f.group.aborts().size() == 1);
  CHECK(f.group.aborts()[0] == cause);
  CHECK(dog->cause() == cause);

  // Before the grace: no second abort, no exit.
  for (int i = 0; i < 4; ++i) {
    f.clock.now += absl::Seconds(1);
    CHECK(dog->PollOnce() == cause);
  }
  CHECK(f.group.aborts().size() == 1);
  CHECK(f.stuck.empty());
  f.clock.now += absl::Seconds(1);  // 5 s after the cause
  CHECK(dog->PollOnce() == cause);
  REQUIRE(f.stuck.size() == 1);
  CHECK(f.stuck[0] == cause);
  f.clock.now += absl::Minutes(1);
  dog->PollOnce().IgnoreError();
  CHECK(f.stuck.size() == 1);
  CHECK(f.group.aborts().size() == 1);
}

TEST_CASE("an operation past the group's timeout plus the slack is aborted") {
  Fixture f;
  auto dog = f.Make();
  const absl::Time started = f.clock.now;
  f.group.SetHealth(Running(started, "broadcast of 10 floats from rank 0"));
  f.clock.now = started + absl::Seconds(65);  // timeout 60 s + slack 5 s: not past
  CHECK(dog->PollOnce().ok());
  f.clock.now += absl::Milliseconds(1);
  absl::Status cause = dog->PollOnce();
  REQUIRE(absl::IsDeadlineExceeded(cause));
  CHECK_THAT(std::string(cause.message()), Catch::Contains("broadcast of 10 floats"));
  CHECK(f.group.aborts().size() == 1);
}

TEST_CASE("a group that broke itself is not blamed on the round, and the exit still comes") {
  Fixture f;
  auto dog = f.Make();
  GroupHealth broken;
  broken.error = absl::UnavailableError("connection to rank 1 failed (that process died)");
  f.group.SetHealth(broken);
  f.round = absl::AbortedError("round ended");  // also true by now; the first cause wins
  absl::Status cause = dog->PollOnce();
  CHECK(absl::IsUnavailable(cause));
  f.clock.now += absl::Seconds(5);
  dog->PollOnce().IgnoreError();
  REQUIRE(f.stuck.size() == 1);
  CHECK(absl::IsUnavailable(f.stuck[0]));
}

TEST_CASE("without a round probe only the group and the clock count") {
  FakeGroup group;
  FakeClock clock;
  WatchdogOptions options;
  options.now = [&] { return clock.now; };
  Watchdog dog({&group}, nullptr, nullptr, options);
  CHECK(dog.PollOnce().ok());
  group.SetHealth(Running(clock.now - absl::Minutes(2)));
  CHECK(absl::IsDeadlineExceeded(dog.PollOnce()));
  clock.now += absl::Minutes(1);
  dog.PollOnce().IgnoreError();  // no on_stuck given: nothing to call
}

TEST_CASE("the thread acts on Wake() without waiting for its interval") {
  FakeGroup group;
  absl::Mutex mu;
  absl::Status round;
  WatchdogOptions options;
  options.interval = absl::Hours(1);  // only a Wake() can make it look
  Watchdog dog(
      {&group},
      [&] {
        absl::MutexLock lock(&mu);
        return round;
      },
      nullptr, options);
  dog.Start();
  {
    absl::MutexLock lock(&mu);
    round = absl::AbortedError("rendezvous round 2 ended");
  }
  dog.Wake();
  REQUIRE(group.aborted().WaitForNotificationWithTimeout(absl::Seconds(10)));
  CHECK(absl::IsAborted(dog.cause()));
}

}  // namespace
}  // namespace muster::parallel

namespace muster::parallel {
namespace {

TEST_CASE("several groups: the first error, the oldest operation, and a cause aborts all") {
  FakeGroup nccl("world.nccl"), gloo("world");
  FakeClock clock;
  WatchdogOptions options;
  options.now = [&] { return clock.now; };
  nccl.SetHealth(Running(clock.now - absl::Seconds(3), "allreduce of 5 floats"));
  gloo.SetHealth(Running(clock.now - absl::Seconds(9), "allreduce of 1 floats"));
  GroupHealth merged = MergedHealth({&nccl, &gloo});
  CHECK(merged.error.ok());
  CHECK(merged.running == "allreduce of 1 floats");

  GroupHealth broken;
  broken.error = absl::UnavailableError("gloo: connection to rank 1 failed");
  gloo.SetHealth(broken);
  Watchdog dog({&nccl, &gloo}, nullptr, nullptr, options);
  absl::Status cause = dog.PollOnce();
  CHECK(absl::IsUnavailable(cause));
  CHECK(cause == broken.error);        // as the group that failed has it
  REQUIRE(nccl.aborts().size() == 1);  // the healthy group goes too, told whose error it is
  CHECK(nccl.aborts()[0] == PassedOn(cause, gloo));
  CHECK(nccl.aborts()[0] ==
        absl::UnavailableError(
            "aborted after an error in group world: gloo: connection to rank 1 failed"));
  REQUIRE(gloo.aborts().size() == 1);
  CHECK(gloo.aborts()[0] == cause);  // its own error, as it is
}

}  // namespace
}  // namespace muster::parallel

namespace muster::parallel {
namespace {

TEST_CASE("a group watched later is one of the groups: its error aborts all, and theirs it") {
  FakeGroup world, sub("dp_shard.1");
  FakeClock clock;
  WatchdogOptions options;
  options.now = [&] { return clock.now; };
  Watchdog dog({&world}, nullptr, nullptr, options);
  CHECK(dog.PollOnce().ok());
  dog.Watch(&sub);
  CHECK(sub.aborts().empty());  // nothing wrong yet
  CHECK(dog.PollOnce().ok());

  GroupHealth broken;
  broken.error =
      absl::UnavailableError("connection to global rank 3 (rank 1 of group dp_shard.1) failed");
  sub.SetHealth(broken);
  absl::Status cause = dog.PollOnce();
  CHECK(absl::IsUnavailable(cause));
  REQUIRE(world.aborts().size() == 1);
  CHECK(world.aborts()[0] ==
        absl::UnavailableError("aborted after an error in group dp_shard.1: connection to global "
                               "rank 3 (rank 1 of group dp_shard.1) failed"));
  CHECK(sub.aborts().size() == 1);
}

TEST_CASE("the world group's failure aborts a sub-group watched later") {
  FakeGroup world, sub("act.pp.0.0");
  FakeClock clock;
  WatchdogOptions options;
  options.now = [&] { return clock.now; };
  Watchdog dog({&world}, nullptr, nullptr, options);
  dog.Watch(&sub);
  GroupHealth broken;
  broken.error = absl::UnavailableError("connection to rank 1 failed");
  world.SetHealth(broken);
  absl::Status cause = dog.PollOnce();
  REQUIRE(sub.aborts().size() == 1);
  CHECK(sub.aborts()[0] == PassedOn(cause, world));
  CHECK_THAT(std::string(sub.aborts()[0].message()),
             Catch::StartsWith("aborted after an error in group world: "));

  // One watched after the cause is told the same.
  FakeGroup late("grad.pp.0.0");
  dog.Watch(&late);
  REQUIRE(late.aborts().size() == 1);
  CHECK(late.aborts()[0] == PassedOn(cause, world));
}

TEST_CASE("a group watched after the cause is aborted with it at once") {
  FakeGroup world, late;
  FakeClock clock;
  WatchdogOptions options;
  options.now = [&] { return clock.now; };
  absl::Status round = absl::AbortedError("rendezvous round 5 of job j ended (MEMBER_LOST)");
  Watchdog dog(
      {&world}, [&] { return round; }, nullptr, options);
  absl::Status cause = dog.PollOnce();
  REQUIRE(absl::IsAborted(cause));
  dog.Watch(&late);
  REQUIRE(late.aborts().size() == 1);
  CHECK(late.aborts()[0] == cause);
  dog.PollOnce().IgnoreError();
  CHECK(late.aborts().size() == 1);  // once
}

TEST_CASE("a sub-group's running operation counts against the clock") {
  FakeGroup world, sub;
  FakeClock clock;
  WatchdogOptions options;
  options.now = [&] { return clock.now; };
  Watchdog dog({&world}, nullptr, nullptr, options);
  dog.Watch(&sub);
  sub.SetHealth(Running(clock.now - absl::Minutes(2), "allreduce (min) of 1 int64s"));
  absl::Status cause = dog.PollOnce();
  CHECK(absl::IsDeadlineExceeded(cause));
  CHECK_THAT(std::string(cause.message()), Catch::Contains("allreduce (min) of 1 int64s"));
  CHECK(world.aborts().size() == 1);
}

}  // namespace
}  // namespace muster::parallel
