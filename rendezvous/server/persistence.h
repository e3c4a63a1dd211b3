// The server's state on disk: one file, `<state_dir>/state.pb`, holding a
// serialized state::ServerState.
//
// Writes are atomic: the snapshot goes to `state.pb.tmp`, is fsynced, renamed
// over `state.pb`, and the directory is fsynced. A crash at any point leaves
// either the previous file or the new one, never a torn mix.
//
// Thread-safety: Load and Write must not run concurrently with each other
// (the server calls them from one thread at a time: start, the group-commit
// writer, shutdown).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rendezvous/state/state_machine.h"  // state::ServerState

namespace muster::rdzv {

class StateFile {
 public:
  // Creates `state_dir` (mode 0700, parents as needed) if missing, and
  // holds an exclusive flock(2) on `<state_dir>/LOCK` (holding this pid and
  // host) for as long as the StateFile or a copy of it lives: a second
  // server on the same directory would overwrite the first's state with
  // its own at its next write. INVALID_ARGUMENT naming the directory if it
  // cannot be created or is not a directory; FAILED_PRECONDITION naming it
  // and the holder when another process holds the lock.
  static absl::StatusOr<StateFile> Open(const std::string& state_dir);

  // The saved state, or nullopt when no state file exists yet. DATA_LOSS
  // naming the file when it exists but is empty or cannot be parsed;
  // INVALID_ARGUMENT when it is not a regular file; INTERNAL when it cannot
  // be read.
  absl::StatusOr<std::optional<state::ServerState>> Load() const;

  // Replaces the saved state atomically (see above); the file is mode 0600.
  // INTERNAL naming the failing step and path; RESOURCE_EXHAUSTED, before
  // anything is written, for a state protobuf cannot serialize (2 GiB or
  // more). The previous file is intact then.
  absl::Status Write(const state::ServerState& snapshot) const;

  const std::string& path() const { return path_; }

  // Lets go of the directory's lock, once this server writes no more (its
  // final write is done), so a successor can start before it is destroyed.
  void ReleaseLock() { lock_.reset(); }

 private:
  StateFile(std::string dir, std::string path, std::shared_ptr<const int> lock)
      : dir_(std::move(dir)), path_(std::move(path)), lock_(std::move(lock)) {}

  std::string dir_;
  std::string path_;
  std::shared_ptr<const int> lock_;  // the LOCK file's descriptor, closed by the last copy
};

}  // namespace muster::rdzv
