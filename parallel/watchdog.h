// The communication watchdog: turns "this rank's peers are gone" into an
// abort of its process group and an exit, within a bounded time, instead of
// a collective that hangs until a transport timeout (NCCL's is often 10 to
// 30 minutes).
//
// A thread checks, every `interval` and whenever Wake() is called:
//   1. the group's own error (GroupHealth::error): a peer's connection
//      failed, NCCL reported ncclRemoteError, an operation timed out. The
//      group has already broken itself; the watchdog only starts the exit
//      countdown below.
//   2. the rendezvous round (the `round` probe): when the round this worker
//      belongs to has ended (a node lost its lease, a worker failed on
//      another node, the job was closed), no peer will ever finish a
//      collective with us. The group is aborted with ABORTED and the probe's
//      message. This is how a lost node is noticed within the rendezvous
//      lease TTL rather than the transport's timeout.
//   3. the running operation's age: past the group's timeout (plus
//      `timeout_slack`) it is aborted with DEADLINE_EXCEEDED, in case the
//      group's own bound did not fire (a thread stuck inside a transport
//      call).
// The first cause found wins; later ones are ignored. A group's error
// reaches the other groups as "aborted after an error in group <name>:
// <error>" (<name> is ProcessGroup::members().name), so that the rank
// numbers in it, which are that group's, are not read as the aborted
// group's; the round's end and an overdue operation reach them as they are.
//
// After a cause, the training thread normally fails out of its next Wait()
// and the process exits with the cause. If the process is still running
// `exit_grace` after the cause, the `on_stuck` callback runs once (the
// worker prints the cause and _exits): nothing blocks an exit for longer.
//
// Decide() is the pure decision, PollOnce() one check with its actions:
// tests drive both with a fake clock and a fake group, no thread.
//
// Thread-safety: Wake(), Watch(), cause() and the destructor may be called
// from any thread. PollOnce() is for tests that do not Start() the thread.
#pragma once

#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "parallel/process_group.h"

namespace muster::parallel {

struct WatchdogOptions {
  absl::Duration interval = absl::Milliseconds(100);
  // Added to the group's timeout before the watchdog steps in for an
  // operation (the group's own bound should fire first).
  absl::Duration timeout_slack = absl::Seconds(5);
  absl::Duration exit_grace = absl::Seconds(5);
  // The clock of GroupHealth::running_since (absl::Now in a real group).
  std::function<absl::Time()> now = [] { return absl::Now(); };
};

// What one check sees.
struct WatchdogObservation {
  absl::Time now;
  GroupHealth health;
  absl::Status round;  // OK while this worker's round is running
};

// Several groups seen as one: the first error, the oldest running operation.
GroupHealth MergedHealth(const std::vector<ProcessGroup*>& groups);

// The cause to act on, or OK: the group's error first, then the round's
// end (ABORTED), then an operation older than `limit` (DEADLINE_EXCEEDED).
absl::Status Decide(const WatchdogObservation& observation, absl::Duration limit);

// What the other groups are aborted with when `failed` broke with `error`:
// the same code, "aborted after an error in group <name>: <message>".
absl::Status PassedOn(const absl::Status& error, const ProcessGroup& failed);

class Watchdog {
 public:
  // OK while the round this process belongs to is running; otherwise the
  // reason it ended (the worker reads its rendezvous JobWatcher).
  using RoundProbe = std::function<absl::Status()>;
  using OnStuck = std::function<void(const absl::Status& cause)>;

  // `groups` (one or more: e.g. NCCL for gradients and Gloo for control
  // messages) are not owned and must outlive the watchdog; a cause aborts
  // them all. `round` may be null (no rendezvous: a world started by hand).
  Watchdog(std::vector<ProcessGroup*> groups, RoundProbe round, OnStuck on_stuck,
           WatchdogOptions options = {});
  // Stops and joins the thread.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts checking on a thread of its own.
  void Start();
  // Watches one more group from now on, as those given to the constructor
  // (a sub-group made after the watchdog started: Communicator::NewGroup).
  // Its error, like theirs, is a cause that aborts every group. If a cause
  // was found already, `group` is aborted with it (passed on, as above)
  // before this returns: a group joined after the round ended must not
  // outlive it. Not owned; it
  // must outlive the watchdog. Any thread.
  void Watch(ProcessGroup* group);

  // Checks now rather than at the next interval (e.g. from the round
  // watcher's callback, so a round's end is acted on at once).
  void Wake();

  // One check: observe, decide, abort the group on a new cause, and run
  // on_stuck once the cause is older than exit_grace. Returns the cause
  // (OK: none yet).
  absl::Status PollOnce();

  // The first cause found (OK: none), as the group that failed has it.
  absl::Status cause() const;

 private:
  void Loop();

  const RoundProbe round_;
  const OnStuck on_stuck_;
  const WatchdogOptions options_;

  mutable absl::Mutex mu_;
  // Grows (Watch), never shrinks: a group stays watched until the end.
  std::vector<ProcessGroup*> groups_ ABSL_GUARDED_BY(mu_);
  absl::Status cause_ ABSL_GUARDED_BY(mu_);
  // What the other groups are aborted with: PassedOn(cause_) when it is a
  // group's error, else cause_.
  absl::Status passed_on_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Time> cause_since_ ABSL_GUARDED_BY(mu_);
  bool stuck_reported_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace muster::parallel
