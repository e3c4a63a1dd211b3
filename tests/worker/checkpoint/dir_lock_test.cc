// One run per checkpoint directory (worker/checkpoint/dir_lock.h): the
// POSIX Env's flock, a holder that is a live process of this host (a real
// child, then SIGKILLed: its lock goes with it), and a holder elsewhere,
// waited for on a fake clock until it lets go or the wait runs out.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "tests/worker/checkpoint/tiny_job.h"
#include "worker/checkpoint/dir_lock.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/files.h"

namespace muster::worker {
namespace {

std::string FreshDir(const std::string& name) { return testing::FreshDir("dir_lock_test", name); }

constexpr uint64_t kToken = 0x5eed5eed5eed5eedULL;

// A clock that only moves when slept on, recording each pause.
struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1800000000);
  std::vector<absl::Duration> pauses;
  // Called at each pause, after the clock moved (e.g. to release a lock).
  std::function<void()> on_pause = [] {};

  LockClock Clock() {
    LockClock clock;
    clock.now = [this] { return now; };
    clock.sleep = [this](absl::Duration pause) {
      pauses.push_back(pause);
      now += pause;
      on_pause();
    };
    return clock;
  }
};

// Takes dir/LOCK in this process as a holder on another host would.
std::unique_ptr<FileLock> HoldAsElsewhere(const std::string& dir) {
  auto held = Env::Default()->LockFile(dir + "/LOCK");
  REQUIRE(held.ok());
  LockHolder other;
  other.pid = 4242;
  other.host = "elsewhere.example";
  other.job = "other-job";
  other.since = "2026-11-27 10:00:00 UTC";
  REQUIRE((*held)->SetContents(FormatLockHolder(other)).ok());
  return *std::move(held);
}

TEST_CASE("LockFile: a held file is FAILED_PRECONDITION until its lock is destroyed") {
  const std::string dir = FreshDir("flock");
  Env* env = Env::Default();
  auto first = env->LockFile(dir + "/LOCK");
  REQUIRE(first.ok());
  auto second = env->LockFile(dir + "/LOCK");
  CHECK(absl::IsFailedPrecondition(second.status()));
  CHECK(absl::StrContains(second.status().message(), dir + "/LOCK"));
  REQUIRE((*first)->SetContents("a longer text first\n").ok());
  REQUIRE((*first)->SetContents("short\n").ok());
  CHECK(*ReadSmallFile(env, dir + "/LOCK") == "short\n");
  first->reset();
  CHECK(env->LockFile(dir + "/LOCK").ok());
  CHECK(absl::IsNotFound(env->LockFile(dir + "/missing/LOCK").status()));
}

TEST_CASE("the holder's text round-trips; a garbled one leaves fields empty") {
  LockHolder holder;
  holder.pid = 123;
  holder.host = "node-7";
  holder.job = "llm-run-7";
  holder.since = "2026-11-27 18:00:00 UTC";
  holder.token = 18446744073709551557ULL;
  const LockHolder back = ParseLockHolder(FormatLockHolder(holder));
  CHECK(back.token == 18446744073709551557ULL);
  CHECK(back.pid == 123);
  CHECK(back.host == "node-7");
  CHECK(back.job == "llm-run-7");
  CHECK(back.since == "2026-11-27 18:00:00 UTC");
  const LockHolder garbled = ParseLockHolder("pid: x12\nhost\nnonsense: 3\ntoken: -4\n");
  CHECK(garbled.pid == 0);
  CHECK(garbled.token == 0);
  CHECK(garbled.host.empty());
  CHECK(ParseLockHolder("").pid == 0);
}

TEST_CASE(
    "a live process of this host holding the lock is refused at once, and its kill frees it") {
  const std::string dir = FreshDir("child");
  // ready: the child says it holds the lock. hold: open while this test
  // runs; the child leaves when it reads its end (the test ended or died),
  // if no SIGKILL came first.
  int ready[2], hold[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(hold) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The child: take the lock as a run would, and say so.
    ::close(ready[0]);
    ::close(hold[1]);
    auto lock = LockCheckpointDir(Env::Default(), dir, absl::ZeroDuration(), "checkpoint.lock_wait",
                                  kToken, [](const std::string&) {});
    const char byte = lock.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &byte, 1);
    char unused;
    (void)!::read(hold[0], &unused, 1);
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(hold[0]);
  char byte = 0;
  REQUIRE(::read(ready[0], &byte, 1) == 1);  // the child writes before anything else
  ::close(ready[0]);
  REQUIRE(byte == 'y');

  FakeClock clock;
  std::vector<std::string> lines;
  auto refused = LockCheckpointDir(
      Env::Default(), dir, absl::Seconds(60), "checkpoint.lock_wait", kToken,
      [&](const std::string& line) { lines.push_back(line); }, clock.Clock());
  INFO(refused.status().ToString());
  CHECK(absl::IsFailedPrecondition(refused.status()));
  CHECK(absl::StrContains(
      refused.status().message(),
      absl::StrCat("checkpoint.dir ", dir, " is in use by another run: pid ", child, " on host ")));
  CHECK(absl::StrContains(refused.status().message(), "another checkpoint.dir"));
  CHECK(!absl::StrContains(refused.status().message(), "waited"));
  CHECK(clock.pauses.empty());  // not waited for
  CHECK(lines.empty());

  REQUIRE(::kill(child, SIGKILL) == 0);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  ::close(hold[1]);
  auto taken = LockCheckpointDir(
      Env::Default(), dir, absl::Seconds(60), "checkpoint.lock_wait", kToken,
      [&](const std::string& line) { lines.push_back(line); }, clock.Clock());
  REQUIRE(taken.ok());
  CHECK(clock.pauses.empty());
  const LockHolder now_held = ParseLockHolder(*ReadSmallFile(Env::Default(), dir + "/LOCK"));
  CHECK(now_held.pid == ::getpid());
  CHECK(now_held.token == kToken);

  // This process holds it now: a second lock of its own is refused too.
  auto again = LockCheckpointDir(
      Env::Default(), dir, absl::Seconds(60), "checkpoint.lock_wait", kToken,
      [](const std::string&) {}, clock.Clock());
  CHECK(absl::IsFailedPrecondition(again.status()));
  CHECK(clock.pauses.empty());
}

TEST_CASE("a holder elsewhere is waited for: taken once it lets go, refused when the wait ends") {
  const std::string dir = FreshDir("elsewhere");
  std::vector<std::string> lines;
  auto log = [&](const std::string& line) { lines.push_back(line); };

  SECTION("it lets go after three pauses") {
    std::unique_ptr<FileLock> held = HoldAsElsewhere(dir);
    FakeClock clock;
    clock.on_pause = [&] {
      if (clock.pauses.size() == 3) held.reset();
    };
    auto taken = LockCheckpointDir(Env::Default(), dir, absl::Seconds(120), "checkpoint.lock_wait",
                                   kToken, log, clock.Clock());
    REQUIRE(taken.ok());
    CHECK(clock.pauses == std::vector<absl::Duration>{absl::Milliseconds(50),
                                                      absl::Milliseconds(100),
                                                      absl::Milliseconds(200)});
    REQUIRE(lines.size() == 2);
    CHECK(lines[0] == absl::StrCat(dir,
                                   "/LOCK is held by pid 4242 on host elsewhere.example (job "
                                   "other-job, since 2026-11-27 10:00:00 UTC); waiting up to 120 "
                                   "s for it (checkpoint.lock_wait)"));
    CHECK(lines[1] == absl::StrCat("took ", dir, "/LOCK after 350ms"));
    CHECK(ParseLockHolder(*ReadSmallFile(Env::Default(), dir + "/LOCK")).pid == ::getpid());
  }
  SECTION("it keeps it: refused after the wait, the pauses growing to a second") {
    std::unique_ptr<FileLock> held = HoldAsElsewhere(dir);
    FakeClock clock;
    auto refused = LockCheckpointDir(Env::Default(), dir, absl::Seconds(10), "checkpoint.lock_wait",
                                     kToken, log, clock.Clock());
    CHECK(absl::IsFailedPrecondition(refused.status()));
    CHECK(absl::StrContains(refused.status().message(),
                            "pid 4242 on host elsewhere.example (job other-job, since "
                            "2026-11-27 10:00:00 UTC); waited 10 s for it (checkpoint.lock_wait)"));
    absl::Duration slept;
    for (absl::Duration pause : clock.pauses) {
      CHECK(pause <= absl::Seconds(1));
      slept += pause;
    }
    CHECK(slept == absl::Seconds(10));
    CHECK(clock.pauses.back() <= absl::Seconds(1));
    CHECK(lines.size() == 1);  // told once
    // The holder's file is the holder's still.
    CHECK(ParseLockHolder(*ReadSmallFile(Env::Default(), dir + "/LOCK")).pid == 4242);
  }
  SECTION("lock_wait 0: refused at once") {
    std::unique_ptr<FileLock> held = HoldAsElsewhere(dir);
    FakeClock clock;
    auto refused = LockCheckpointDir(Env::Default(), dir, absl::ZeroDuration(),
                                     "checkpoint.lock_wait", kToken, log, clock.Clock());
    CHECK(absl::IsFailedPrecondition(refused.status()));
    CHECK(!absl::StrContains(refused.status().message(), "waited"));
    CHECK(clock.pauses.empty());
  }
  SECTION("a holder that has not written who it is counts as elsewhere") {
    auto held = Env::Default()->LockFile(dir + "/LOCK");
    REQUIRE(held.ok());
    FakeClock clock;
    auto refused = LockCheckpointDir(Env::Default(), dir, absl::Seconds(1), "checkpoint.lock_wait",
                                     kToken, log, clock.Clock());
    CHECK(absl::IsFailedPrecondition(refused.status()));
    CHECK(absl::StrContains(refused.status().message(),
                            "another process (it has not said which); waited 1 s"));
    CHECK(!clock.pauses.empty());
  }
}

TEST_CASE("SeesLock: a rank that reads another token, or none, is told its directory differs") {
  const std::string dir = FreshDir("sees");
  auto lock = LockCheckpointDir(Env::Default(), dir, absl::ZeroDuration(), "checkpoint.lock_wait",
                                kToken, [](const std::string&) {});
  REQUIRE(lock.ok());
  CHECK(SeesLock(Env::Default(), dir, kToken, 3).ok());

  absl::Status other = SeesLock(Env::Default(), dir, kToken + 1, 3);
  CHECK(absl::IsFailedPrecondition(other));
  CHECK(absl::StrContains(
      other.message(),
      absl::StrCat("checkpoint.dir ", dir, " is not one directory for every rank: rank 0 holds ",
                   dir, "/LOCK, and rank 3 on host ")));
  CHECK(absl::StrContains(other.message(),
                          absl::StrCat("finds another run's there, that of pid ", ::getpid())));
  CHECK(absl::StrContains(other.message(), "a file system that every node mounts"));

  const std::string empty = FreshDir("sees_none");
  absl::Status none = SeesLock(Env::Default(), empty, kToken, 1);
  CHECK(absl::IsFailedPrecondition(none));
  CHECK(absl::StrContains(none.message(), "rank 1 on host "));
  CHECK(absl::StrContains(none.message(), absl::StrCat("cannot read it (", empty, "/LOCK")));
  CHECK(NewLockToken() != 0);
  CHECK(NewLockToken() != NewLockToken());
}

}  // namespace
}  // namespace muster::worker
