// The ordering and sticky-error rules, on a WorkQueue with plain closures.
#include "parallel/work_queue.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace muster::parallel {
namespace {

TEST_CASE("operations run one at a time in issue order") {
  WorkQueue queue(absl::Seconds(10));
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 100; ++i) {
    works.push_back(queue.Enqueue("op", [&, i](absl::Time) {
      absl::MutexLock lock(&mu);
      order.push_back(i);
      return absl::OkStatus();
    }));
  }
  for (auto& work : works) CHECK(work->Wait().ok());
  std::vector<int> expected(100);
  for (int i = 0; i < 100; ++i) expected[i] = i;
  absl::MutexLock lock(&mu);
  CHECK(order == expected);
}

TEST_CASE("the first error fails what is queued behind it and everything later") {
  WorkQueue queue(absl::Seconds(10));
  absl::Notification release;
  int ran_after = 0;
  auto first = queue.Enqueue("first", [&](absl::Time) {
    release.WaitForNotification();
    return absl::UnavailableError("peer gone");
  });
  auto queued = queue.Enqueue("second", [&](absl::Time) {
    ++ran_after;
    return absl::OkStatus();
  });
  CHECK_FALSE(first->Done());
  release.Notify();
  absl::Status error = first->Wait();
  CHECK(error.code() == absl::StatusCode::kUnavailable);
  CHECK(error.message() == "first: peer gone");
  CHECK(queued->Wait() == error);
  CHECK(queue
            .Enqueue("later",
                     [&](absl::Time) {
                       ++ran_after;
                       return absl::OkStatus();
                     })
            ->Wait() == error);
  CHECK(queue.first_error() == error);
  CHECK(ran_after == 0);
}

TEST_CASE("the deadline handed to an operation is its start plus the timeout") {
  const absl::Duration timeout = absl::Seconds(3);
  WorkQueue queue(timeout);
  absl::Time deadline;
  absl::Time before = absl::Now();
  CHECK(queue
            .Enqueue("op",
                     [&](absl::Time d) {
                       deadline = d;
                       return absl::OkStatus();
                     })
            ->Wait()
            .ok());
  CHECK(deadline >= before + timeout);
  CHECK(deadline <= absl::Now() + timeout);
}

TEST_CASE("a stuck operation: Wait gives up after timeout plus grace and breaks the queue") {
  const absl::Duration timeout = absl::Milliseconds(100);
  // Shared: the detached thread may still be leaving WaitForNotification
  // when this test returns.
  auto release = std::make_shared<absl::Notification>();
  std::shared_ptr<Work> queued;
  {
    WorkQueue queue(timeout);
    auto stuck = queue.Enqueue("stuck", [release](absl::Time) {
      release->WaitForNotification();  // ignores its deadline
      return absl::OkStatus();
    });
    queued = queue.Enqueue("queued", [](absl::Time) { return absl::OkStatus(); });
    const absl::Time start = absl::Now();
    absl::Status status = queued->Wait();  // bounded by the op ahead of it
    const absl::Duration elapsed = absl::Now() - start;
    CHECK(status.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(elapsed < timeout + WorkQueue::kStuckGrace + absl::Seconds(1));
    CHECK(stuck->Wait() == status);
    release->Notify();  // the broken queue's destructor detaches the thread
  }
  CHECK(queued->Done());  // handles outlive the queue
}

TEST_CASE("destroying the queue cancels what has not started") {
  absl::Notification started, release;
  std::shared_ptr<Work> running, queued;
  std::thread releaser;
  {
    WorkQueue queue(absl::Seconds(10));
    running = queue.Enqueue("running", [&](absl::Time) {
      started.Notify();
      release.WaitForNotification();
      return absl::OkStatus();
    });
    queued = queue.Enqueue("queued", [](absl::Time) { return absl::OkStatus(); });
    started.WaitForNotification();
    releaser = std::thread([&] {
      // The destructor cancels `queued` before it waits for `running`.
      queued->Wait().IgnoreError();
      release.Notify();
    });
  }  // ~WorkQueue
  releaser.join();
  CHECK(running->Wait().ok());
  CHECK(queued->Wait().code() == absl::StatusCode::kCancelled);
  CHECK(WorkQueue::Finished(absl::InvalidArgumentError("x"))->Done());
}

TEST_CASE("on_break runs once, when the queue first fails, before any waiter returns") {
  // The waiter below returns as soon as the queue lets it. on_break waits a
  // while for it to have returned: it must not have (the queue holds its
  // lock through on_break), or a transport could still be sending from the
  // buffers that waiter goes on to free.
  absl::Mutex mu;
  bool waiter_returned = false;
  int breaks = 0;
  bool waiter_had_returned = false;
  // Shared: the queue, broken while its operation runs, detaches its
  // thread, which may still be leaving WaitForNotification after the test.
  auto started = std::make_shared<absl::Notification>();
  auto release = std::make_shared<absl::Notification>();
  std::string break_message;
  auto queue = std::make_unique<WorkQueue>(absl::Seconds(10), [&](const absl::Status& error) {
    absl::MutexLock lock(&mu);
    ++breaks;
    break_message = std::string(error.message());
    mu.AwaitWithTimeout(absl::Condition(&waiter_returned), absl::Milliseconds(200));
    waiter_had_returned = waiter_returned;
  });
  auto running = queue->Enqueue("running", [started, release](absl::Time) {
    started->Notify();
    release->WaitForNotification();
    return absl::UnavailableError("closed under it");
  });
  started->WaitForNotification();
  std::thread waiter([&] {
    absl::Status status = running->Wait();
    CHECK(status.code() == absl::StatusCode::kAborted);
    absl::MutexLock lock(&mu);
    waiter_returned = true;
  });
  queue->Fail(absl::AbortedError("the round ended"));
  waiter.join();
  release->Notify();  // the operation now fails too: the queue had failed already
  CHECK(queue->Enqueue("later", [](absl::Time) { return absl::OkStatus(); })->Wait().code() ==
        absl::StatusCode::kAborted);
  queue.reset();
  absl::MutexLock lock(&mu);
  CHECK(breaks == 1);
  // The cause, prefixed with the running operation, not its later error.
  CHECK(break_message == "running: the round ended");
  CHECK_FALSE(waiter_had_returned);
}

TEST_CASE("on_break runs on the communication thread when an operation fails") {
  std::atomic<int> breaks{0};
  absl::Status broken_by;
  WorkQueue queue(absl::Seconds(10), [&](const absl::Status& error) {
    ++breaks;
    broken_by = error;
  });
  CHECK(queue.Enqueue("fine", [](absl::Time) { return absl::OkStatus(); })->Wait().ok());
  CHECK(breaks == 0);
  CHECK(queue.Enqueue("bad", [](absl::Time) { return absl::UnavailableError("peer gone"); })
            ->Wait()
            .code() == absl::StatusCode::kUnavailable);
  CHECK(breaks == 1);
  CHECK(broken_by.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(broken_by.message(), "peer gone"));
  queue.Fail(absl::AbortedError("again"));
  CHECK(breaks == 1);
}

}  // namespace
}  // namespace muster::parallel
