// A file read again when it changes: the bearer token files that the
// rendezvous server and its clients read, which an operator rotates in
// place, without a restart (docs/rendezvous.md, "Rotating credentials").
//
// A change is another inode (a file renamed over it, as tools that write
// atomically do), size or modification time, seen by stat(2) at most once
// per `refresh`: cheap enough to ask on every call. The version is told
// before the file is read, so a write still under way when it is read
// changes it again and is read once more at the next look.
//
// Not thread-safe: its owner locks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace muster::rdzv {

// Reads a whole file. INVALID_ARGUMENT naming it (as `what`) and the reason
// when it cannot be read: "cannot read token file '/etc/muster/token':
// Permission denied".
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what);

// `refresh` as the whole seconds, at least 1, that gRPC's
// FileWatcherCertificateProvider takes: the TLS files' period.
unsigned int WatcherSeconds(absl::Duration refresh);

class WatchedFile {
 public:
  WatchedFile(std::string path, absl::Duration refresh);

  const std::string& path() const { return path_; }

  // Reads the file now, whatever its version. INVALID_ARGUMENT naming it
  // (as `what`) when it cannot be read.
  absl::StatusOr<std::string> Read(const std::string& what);

  // The file's contents when its version is not the one last read or
  // looked at: after `refresh` has passed since the last look, or at once
  // with `now`. nullopt when it is not time to look or nothing changed.
  // The version returned counts as looked at, whether the caller uses what
  // it holds or not: a version it refused is not offered again.
  std::optional<absl::StatusOr<std::string>> Changed(const std::string& what, bool now = false);

 private:
  struct Version {
    bool exists = false;
    uint64_t device = 0, inode = 0, size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const Version& other) const;
  };
  Version Stat() const;

  const std::string path_;
  const absl::Duration refresh_;
  Version seen_;
  absl::Time next_look_ = absl::InfinitePast();
};

}  // namespace muster::rdzv
