// The ordering and sticky-error rules, on a WorkQueue with plain closures.
#include "parallel/work_queue.h"

#include <catch2/catch.hpp>
#include <thread>
#include <vector>

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

}  // namespace
}  // namespace muster::parallel
