#include "parallel/work_queue.h"

#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace muster::parallel {

// One queued operation. Its fields are guarded by the queue's State::mu,
// which every Work shares, so one CondVar wakes every waiter.
struct WorkQueue::Item {
  std::string description;
  Op op;  // cleared once run, to drop what it captured
  bool done = false;
  absl::Status status;
};

struct WorkQueue::State {
  State(absl::Duration timeout, std::function<void(const absl::Status&)> on_break)
      : timeout(timeout), on_break(std::move(on_break)) {}

  // Completes `item` (if not already) and wakes every waiter.
  void Finish(Item& item, absl::Status result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (item.done) return;
    item.done = true;
    item.status = std::move(result);
    changed.SignalAll();
  }

  // The sticky failure: records the first error (running on_break, before
  // the lock is let go) and fails the running operation and everything
  // queued with it.
  void Break(const absl::Status& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (first_error.ok()) {
      first_error = error;
      if (on_break) on_break(first_error);
    }
    if (running != nullptr) Finish(*running, first_error);
    for (const std::shared_ptr<Item>& item : queue) Finish(*item, first_error);
    queue.clear();
  }

  const absl::Duration timeout;
  const std::function<void(const absl::Status&)> on_break;
  absl::Mutex mu;
  absl::CondVar changed;  // an item finished, was queued or started
  std::deque<std::shared_ptr<Item>> queue ABSL_GUARDED_BY(mu);
  std::shared_ptr<Item> running ABSL_GUARDED_BY(mu);
  absl::Time running_since ABSL_GUARDED_BY(mu);
  absl::Status first_error ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
};

class WorkQueue::QueuedWork : public Work {
 public:
  QueuedWork(std::shared_ptr<State> state, std::shared_ptr<Item> item)
      : state_(std::move(state)), item_(std::move(item)) {}

  absl::Status Wait() override {
    State& s = *state_;
    absl::MutexLock lock(&s.mu);
    while (!item_->done) {
      // Whatever runs now must finish by its deadline plus the grace; a
      // queued item's wait is thereby bounded by the items ahead of it.
      absl::Time bound = absl::InfiniteFuture();
      if (s.running != nullptr) {
        bound = s.running_since + s.timeout + kStuckGrace;
        if (absl::Now() >= bound) {
          s.Break(absl::DeadlineExceededError(absl::StrCat(
              s.running->description, ": still running ",
              absl::FormatDuration(s.timeout + kStuckGrace), " after it started (timeout ",
              absl::FormatDuration(s.timeout), "); the communication thread is stuck")));
          break;
        }
      }
      s.changed.WaitWithDeadline(&s.mu, bound);
    }
    return item_->status;
  }

  bool Done() const override {
    absl::MutexLock lock(&state_->mu);
    return item_->done;
  }

 private:
  const std::shared_ptr<State> state_;
  const std::shared_ptr<Item> item_;
};

class WorkQueue::FinishedWork : public Work {
 public:
  explicit FinishedWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }
  bool Done() const override { return true; }

 private:
  const absl::Status status_;
};

WorkQueue::WorkQueue(absl::Duration timeout, std::function<void(const absl::Status&)> on_break)
    : timeout_(timeout),
      state_(std::make_shared<State>(timeout, std::move(on_break))),
      thread_([state = state_] { Run(*state); }) {}

WorkQueue::~WorkQueue() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->stopping = true;
    for (const std::shared_ptr<Item>& item : state_->queue) {
      state_->Finish(*item,
                     absl::CancelledError(absl::StrCat(
                         item->description, ": the process group was destroyed before it ran")));
    }
    state_->queue.clear();
    state_->changed.SignalAll();
    if (state_->running != nullptr && !state_->first_error.ok()) {
      thread_.detach();  // it holds `state_` and its op; both outlive us
      return;
    }
  }
  thread_.join();
}

void WorkQueue::Fail(const absl::Status& error) {
  absl::MutexLock lock(&state_->mu);
  if (state_->first_error.ok()) {
    state_->Break(state_->running == nullptr
                      ? error
                      : absl::Status(error.code(), absl::StrCat(state_->running->description, ": ",
                                                                error.message())));
  }
}

std::shared_ptr<Work> WorkQueue::Enqueue(std::string description, Op op) {
  auto item = std::make_shared<Item>();
  item->description = std::move(description);
  item->op = std::move(op);
  absl::MutexLock lock(&state_->mu);
  if (!state_->first_error.ok()) return Finished(state_->first_error);
  state_->queue.push_back(item);
  state_->changed.SignalAll();
  return std::make_shared<QueuedWork>(state_, std::move(item));
}

std::shared_ptr<Work> WorkQueue::Finished(absl::Status status) {
  return std::make_shared<FinishedWork>(std::move(status));
}

absl::Status WorkQueue::first_error() const {
  absl::MutexLock lock(&state_->mu);
  return state_->first_error;
}

GroupHealth WorkQueue::health() const {
  absl::MutexLock lock(&state_->mu);
  GroupHealth health;
  health.error = state_->first_error;
  if (state_->running != nullptr) {
    health.running_since = state_->running_since;
    health.running = state_->running->description;
  }
  return health;
}

void WorkQueue::Run(State& s) {
  absl::MutexLock lock(&s.mu);
  while (true) {
    s.mu.Await(absl::Condition(
        +[](State* st)
             ABSL_NO_THREAD_SAFETY_ANALYSIS { return st->stopping || !st->queue.empty(); },
        &s));
    if (s.queue.empty()) return;  // stopping
    std::shared_ptr<Item> item = std::move(s.queue.front());
    s.queue.pop_front();
    s.running = item;
    s.running_since = absl::Now();
    s.changed.SignalAll();
    Op op = std::move(item->op);
    absl::Time deadline = s.running_since + s.timeout;

    s.mu.Unlock();
    absl::Status result = op(deadline);
    op = nullptr;  // drop captured buffers before reporting done
    s.mu.Lock();

    s.running = nullptr;
    if (item->done) continue;  // a stuck-thread Wait() already broke the queue
    if (result.ok()) {
      s.Finish(*item, absl::OkStatus());
    } else {
      absl::Status error(result.code(), absl::StrCat(item->description, ": ", result.message()));
      s.Finish(*item, error);
      s.Break(error);
    }
  }
}

}  // namespace muster::parallel
