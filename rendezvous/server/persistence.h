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

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rendezvous/state/state_machine.h"  // state::ServerState

namespace muster::rdzv {

class StateFile {
 public:
  // Creates `state_dir` (mode 0700, parents as needed) if missing.
  // INVALID_ARGUMENT naming the directory if it cannot be created or is not
  // a directory.
  static absl::StatusOr<StateFile> Open(const std::string& state_dir);

  // The saved state, or nullopt when no state file exists yet. DATA_LOSS
  // naming the file when it exists but cannot be parsed; INTERNAL when it
  // cannot be read.
  absl::StatusOr<std::optional<state::ServerState>> Load() const;

  // Replaces the saved state atomically (see above); the file is mode 0600.
  // INTERNAL naming the failing step and path; RESOURCE_EXHAUSTED, before
  // anything is written, for a state protobuf cannot serialize (2 GiB or
  // more). The previous file is intact then.
  absl::Status Write(const state::ServerState& snapshot) const;

  const std::string& path() const { return path_; }

 private:
  StateFile(std::string dir, std::string path) : dir_(std::move(dir)), path_(std::move(path)) {}

  std::string dir_;
  std::string path_;
};

}  // namespace muster::rdzv
