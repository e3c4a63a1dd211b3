// The ordering and failure rules of process_group.h, independent of any
// back end: one communication thread per group runs queued operations one at
// a time in issue order, and the first failure is sticky.
//
// Ownership: the group owns its WorkQueue; Work handles share the queue's
// state, so they stay valid (and keep their status) after the queue is gone.
//
// Thread-safety: Enqueue and first_error may be called from any thread; the
// order of Enqueue calls is the order of execution. Work handles may be
// waited on from any thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "parallel/process_group.h"

namespace muster::parallel {

class WorkQueue {
 public:
  // Runs on the communication thread. Must return by `deadline` (plus a
  // short grace, kStuckGrace): a Wait() that sees an operation overrun it
  // gives up with DEADLINE_EXCEEDED and breaks the queue, because the
  // thread is then stuck and nothing queued behind it can run.
  using Op = std::function<absl::Status(absl::Time deadline)>;

  static constexpr absl::Duration kStuckGrace = absl::Seconds(2);

  // `timeout` bounds each operation, counted from when it starts running.
  //
  // `on_break` (may be empty) runs once, with the error, when the queue
  // first fails, whichever thread breaks it (the communication thread,
  // Fail, or a Wait that finds the thread stuck), while that thread holds
  // the queue's lock: so before any waiter can return with the failure. A
  // transport uses it to stop touching the callers' buffers (Gloo closes
  // its connections; a staged group aborts the group it wraps) before a
  // waiter, seeing the error, frees them. It must not call into this queue.
  explicit WorkQueue(absl::Duration timeout,
                     std::function<void(const absl::Status&)> on_break = {});
  // Queued operations fail with CANCELLED. A running operation is waited
  // for (it returns by its deadline), unless the queue has failed: then the
  // thread is detached and finishes that operation on its own, so a thread
  // stuck in a transport call cannot hold up shutdown. Ops must therefore
  // own (share) everything they use rather than point into their owner.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `op`. `description` (e.g. "allreduce #3 of 1000 floats") prefixes
  // its error. Once the queue has failed, the Work fails at once with the
  // first error and `op` never runs.
  std::shared_ptr<Work> Enqueue(std::string description, Op op);

  // A Work that has already finished with `status`: for argument errors
  // found at issue time, which do not break the queue.
  static std::shared_ptr<Work> Finished(absl::Status status);

  // Breaks the queue from outside the communication thread, e.g. when a
  // monitor sees a peer's connection fail while the running operation is
  // blocked in a wait the transport never ends early. The running and
  // queued operations fail with `error` (prefixed with the running one's
  // description) unless the queue had failed already.
  void Fail(const absl::Status& error);

  // OK until an operation fails; then that operation's error forever.
  absl::Status first_error() const;

  // The first error and the running operation (ProcessGroup::Health).
  GroupHealth health() const;

  absl::Duration timeout() const { return timeout_; }

 private:
  struct State;
  struct Item;
  class QueuedWork;
  class FinishedWork;

  static void Run(State& state);

  const absl::Duration timeout_;
  const std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace muster::parallel
