// One run per checkpoint directory. Two runs saving into one directory
// would wreck each other: each moves the other's step_N aside when it
// reaches N, removes the other's save in progress as a stale .tmp_step_N,
// and resume would pick whichever run's checkpoint happens to be newest.
// So rank 0 holds <dir>/LOCK (Env::LockFile) for as long as it trains, and
// writes into it who holds it; a second run is refused with that named.
//
// The kernel releases the lock when its holder exits, however it exits, so
// a job that launch restarts after a crash, or a preempted job started
// again, takes the lock at once. A holder on another host (a shared file
// system) may be a node that died or lost its rendezvous lease and whose
// lock its file server has not let go yet: that one is waited for, up to a
// deadline (checkpoint.lock_wait, and at most half of
// parallel.timeout_s: the other ranks wait for rank 0 inside a collective). A holder that is a live
// process on this host is not going away: refused at once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/checkpoint/env.h"

namespace muster::worker {

// Who holds a directory's lock, as its holder wrote it into the file.
struct LockHolder {
  int pid = 0;        // 0: not known
  std::string host;   // gethostname(2)
  std::string job;    // the launcher's run id (TORCHELASTIC_RUN_ID), or empty
  std::string since;  // when it took the lock, UTC
  // Set by the run (nonzero): what every rank must read in the file,
  // proof that they all see one directory (SeesLock).
  uint64_t token = 0;
};

// The file's text for `holder` ("pid: 12\nhost: h\n..."), and back.
// ParseLockHolder reads what it can: a missing or garbled line leaves its
// field empty (a holder that has not written yet, or another program).
std::string FormatLockHolder(const LockHolder& holder);
LockHolder ParseLockHolder(const std::string& text);

// This host's name (gethostname(2)); empty when it cannot be had.
std::string HostName();

// This process: its pid, host, the launcher's run id, `now` and `token`.
LockHolder ThisProcess(absl::Time now, uint64_t token);

// A token for ThisProcess: random, never 0.
uint64_t NewLockToken();

// The clock and the pause between tries. Polled, because nothing signals
// that another process released a flock(2) (inotify does not report it),
// and a blocking flock cannot be given a deadline. Tests pass a fake
// clock whose sleep advances it.
struct LockClock {
  std::function<absl::Time()> now = [] { return absl::Now(); };
  std::function<void(absl::Duration)> sleep = [](absl::Duration d) { absl::SleepFor(d); };
};

// Takes <dir>/LOCK and writes ThisProcess(now, token) into it, made
// durable (so that other clients of a network file system read it). `dir`
// must exist.
// While a holder elsewhere keeps it, tries again (every 50 ms at first,
// then up to every second) until `wait` has passed, having logged once
// through `log` whom it waits for; `wait_name` says in both messages
// where the wait came from. FAILED_PRECONDITION, naming the
// holder, when a live process of this host holds it (at once) or when
// `wait` passes; the Env's UNAVAILABLE / NOT_FOUND when the file cannot be
// opened or written.
absl::StatusOr<std::unique_ptr<FileLock>> LockCheckpointDir(
    Env* env, const std::string& dir, absl::Duration wait, const std::string& wait_name,
    uint64_t token, const std::function<void(const std::string&)>& log,
    const LockClock& clock = {});

// On every other rank, once rank 0 holds the lock: whether this rank reads
// rank 0's `token` in <dir>/LOCK. Every rank writes its own file of each
// checkpoint into the directory, so all must see one directory: a node
// whose checkpoint.dir is a disk of its own would fail at its first save,
// maybe hours in. FAILED_PRECONDITION, naming this rank and host and what
// it found instead, when it does not.
absl::Status SeesLock(Env* env, const std::string& dir, uint64_t token, int rank);

}  // namespace muster::worker
