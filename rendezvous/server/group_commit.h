// Group commit: many mutating calls, one state write.
//
// Every durable mutation gets a sequence number under the service mutex.
// A caller hands its reply to RunWhenDurable(seq, ...); the one writer thread
// takes a snapshot (which, taken under the same mutex, contains every
// mutation numbered up to the counter it reports), writes it, and then runs
// every callback whose number it covered. A burst of N mutations thus costs
// one or two writes, not N.
//
// A write that fails undoes what it would have made durable: the service
// goes back to the last state on disk (RollbackFn) and every mutation
// numbered since fails UNAVAILABLE, so no change a caller was refused
// stays in memory to be acted on, or written later.
//
// Thread-safety: all public methods may be called from any thread.
// Callbacks run on the writer thread (or inline in RunWhenDurable when the
// sequence number is already durable), never under this class's lock.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "rendezvous/server/persistence.h"
#include "rendezvous/state/state_machine.h"  // state::ServerState

namespace muster::rdzv {

class GroupCommitter {
 public:
  // Returns the current snapshot and the highest mutation number it holds.
  using SnapshotFn = std::function<std::pair<state::ServerState, uint64_t>()>;
  // Told whether the state holding the mutation reached the disk.
  using DurableCallback = std::function<void(absl::Status)>;
  // Puts the service back at `durable` (the last state written) and
  // returns the number it gives that restoring, above every mutation it
  // undid. Called on the writer thread, without this class's lock.
  using RollbackFn = std::function<uint64_t(const state::ServerState& durable)>;

  // `file` is not owned and must outlive this object. Without `rollback`,
  // a failed write leaves the mutations in memory and retries them.
  GroupCommitter(const StateFile* file, SnapshotFn snapshot, RollbackFn rollback = nullptr);
  ~GroupCommitter();  // Stops (see Stop).

  GroupCommitter(const GroupCommitter&) = delete;
  GroupCommitter& operator=(const GroupCommitter&) = delete;

  void Start();

  // Runs `done` once a snapshot holding mutation `seq` is on disk (OK), or
  // once writing such a snapshot failed (INTERNAL/UNAVAILABLE naming the
  // file), or at once with UNAVAILABLE when a rollback undid `seq`. After Stop, `done` runs inline
  // with UNAVAILABLE if `seq` is not yet durable.
  void RunWhenDurable(uint64_t seq, DurableCallback done);

  // Stops the writer thread, then writes one last snapshot (covering
  // whatever was pending) and completes every callback. Returns the status
  // of that last write. Idempotent; writes nothing if Start never ran.
  absl::Status Stop();

 private:
  void WriterLoop();
  // One snapshot + write; completes the callbacks it covered. False if the
  // write failed.
  bool WriteOnce();

  // UNAVAILABLE for a mutation a rollback undid.
  static absl::Status Undone();

  const StateFile* file_;
  SnapshotFn snapshot_;
  RollbackFn rollback_;
  state::ServerState last_durable_;  // the writer thread's (Start's before it runs)

  absl::Mutex mu_;
  uint64_t requested_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t durable_seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::multimap<uint64_t, DurableCallback> waiting_ ABSL_GUARDED_BY(mu_);
  // (from, to): the mutations numbered between, exclusive, that a rollback
  // undid (to is the rollback's own, durable, number).
  std::vector<std::pair<uint64_t, uint64_t>> undone_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status last_stop_status_ ABSL_GUARDED_BY(mu_);
  std::thread writer_;
};

}  // namespace muster::rdzv
