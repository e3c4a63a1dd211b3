#include "rendezvous/server/persistence.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace muster::rdzv {
namespace {

constexpr char kStateFileName[] = "state.pb";
constexpr char kTempSuffix[] = ".tmp";
constexpr char kLockFileName[] = "LOCK";

absl::Status ErrnoError(const std::string& step, const std::string& path) {
  return absl::InternalError(absl::StrCat(step, " '", path, "': ", std::strerror(errno)));
}

// mkdir -p with mode 0700 for every directory it creates.
absl::Status MakeDirectories(const std::string& dir) {
  if (dir.empty()) return absl::OkStatus();
  struct stat info;
  if (stat(dir.c_str(), &info) == 0) {
    if (!S_ISDIR(info.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("state dir '", dir, "' exists but is not a directory"));
    }
    return absl::OkStatus();
  }
  size_t slash = dir.find_last_of('/');
  if (slash != std::string::npos && slash > 0) {
    absl::Status parent = MakeDirectories(dir.substr(0, slash));
    if (!parent.ok()) return parent;
  }
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create state dir '", dir, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t written = 0;
  while (written < data.size()) {
    ssize_t n = write(fd, data.data() + written, data.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write", path);
    }
    written += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FsyncPath(const std::string& path, int flags) {
  int fd = open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return ErrnoError("open for fsync", path);
  int rc = fsync(fd);
  int saved_errno = errno;
  close(fd);
  errno = saved_errno;
  if (rc != 0) return ErrnoError("fsync", path);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StateFile> StateFile::Open(const std::string& state_dir) {
  if (state_dir.empty()) {
    return absl::InvalidArgumentError("state dir must not be empty");
  }
  absl::Status made = MakeDirectories(state_dir);
  if (!made.ok()) return made;
  // Why flock and not a pid file: the kernel lets go of it when the holder
  // dies, even by SIGKILL, so a crashed server never locks its successor out.
  const std::string lock_path = absl::StrCat(state_dir, "/", kLockFileName);
  int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoError("cannot open", lock_path);
  auto lock = std::shared_ptr<const int>(new int(fd), [](const int* held) {
    close(*held);
    delete held;
  });
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return ErrnoError("cannot lock", lock_path);
    char holder[256] = {};
    ssize_t got = pread(fd, holder, sizeof(holder) - 1, 0);
    std::string who(holder, got > 0 ? static_cast<size_t>(got) : 0);
    while (!who.empty() && (who.back() == '\n' || who.back() == '\0')) who.pop_back();
    return absl::FailedPreconditionError(
        absl::StrCat("state dir '", state_dir, "' is in use by another rendezvous server (",
                     who.empty() ? "holder unknown" : who,
                     "); two servers on one directory would overwrite each other's state"));
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const std::string holder = absl::StrCat("pid ", getpid(), " on ", host, "\n");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, holder.data(), holder.size(), 0) < 0) {
    return ErrnoError("cannot write", lock_path);
  }
  return StateFile(state_dir, absl::StrCat(state_dir, "/", kStateFileName), std::move(lock));
}

absl::StatusOr<std::optional<state::ServerState>> StateFile::Load() const {
  struct stat info;
  if (stat(path_.c_str(), &info) != 0) {
    if (errno == ENOENT) return std::optional<state::ServerState>();
    return ErrnoError("cannot read state file", path_);
  }
  // A directory reads as no bytes, which parse as no jobs: the server would
  // claim a restore and then fail every write (the rename over it).
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state file '", path_, "' is not a regular file; move it away to start empty"));
  }
  // Every state written holds its format_version, so it is never empty.
  if (info.st_size == 0) {
    return absl::DataLossError(absl::StrCat(
        "state file '", path_,
        "' is empty, and no server writes an empty one (a copy or restore cut short?); "
        "restore it, or remove it to start empty"));
  }
  std::ifstream in(path_, std::ios::binary);
  if (!in) return ErrnoError("cannot read state file", path_);
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return ErrnoError("cannot read state file", path_);
  state::ServerState snapshot;
  if (!snapshot.ParseFromString(contents.str())) {
    return absl::DataLossError(absl::StrCat(
        "state file '", path_, "' cannot be parsed as muster state; move it away to start empty"));
  }
  return std::optional<state::ServerState>(std::move(snapshot));
}

absl::Status StateFile::Write(const state::ServerState& snapshot) const {
  // Protobuf cannot serialize 2 GiB or more. The state machine's byte caps
  // keep the state far below that; say so plainly if they ever do not.
  const size_t size = snapshot.ByteSizeLong();
  if (size > static_cast<size_t>(INT_MAX)) {
    return absl::ResourceExhaustedError(absl::StrCat("the server state is ", size,
                                                     " bytes; a state file holds less than ",
                                                     "2 GiB (lower --max-total-bytes)"));
  }
  std::string data;
  if (!snapshot.SerializeToString(&data)) {
    return absl::InternalError("cannot serialize the server state");
  }
  std::string temp_path = path_ + kTempSuffix;
  int fd = open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoError("cannot create", temp_path);
  // A stale temp file (a crash mid-write, a copy) keeps its own mode through
  // O_TRUNC, and would pass it on to state.pb.
  absl::Status status = fchmod(fd, 0600) == 0 ? absl::OkStatus() : ErrnoError("chmod", temp_path);
  if (status.ok()) status = WriteAll(fd, data, temp_path);
  if (status.ok() && fsync(fd) != 0) status = ErrnoError("fsync", temp_path);
  if (close(fd) != 0 && status.ok()) status = ErrnoError("close", temp_path);
  if (!status.ok()) {
    unlink(temp_path.c_str());
    return status;
  }
  if (rename(temp_path.c_str(), path_.c_str()) != 0) {
    status = ErrnoError("cannot rename over", path_);
    unlink(temp_path.c_str());
    return status;
  }
  // The rename is only durable once the directory entry is.
  return FsyncPath(dir_, O_RDONLY | O_DIRECTORY);
}

}  // namespace muster::rdzv
