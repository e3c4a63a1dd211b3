#include "worker/config/config_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muster::worker::config_detail {
namespace {

// A train.yaml is a few KiB: anything past this is not one.
constexpr size_t kMaxConfigBytes = 1 << 20;

absl::Status CannotRead(const std::string& path, int error) {
  return absl::NotFoundError(
      absl::StrCat(path, ": cannot read the config file: ", std::strerror(error)));
}

// What is refused before a byte is read: a directory opens and reads as
// nothing ("empty file"), a device such as /dev/zero reads forever.
absl::Status CheckKind(const std::string& path, mode_t mode) {
  if (S_ISREG(mode) || S_ISFIFO(mode)) return absl::OkStatus();
  if (S_ISDIR(mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": a directory, not a config file; name the train.yaml in it"));
  }
  const char* kind = S_ISCHR(mode)    ? "a character device"
                     : S_ISBLK(mode)  ? "a block device"
                     : S_ISSOCK(mode) ? "a socket"
                                      : "not a regular file";
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", kind, ", not a config file"));
}

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

absl::StatusOr<std::string> ReadConfigFile(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) return CannotRead(path, errno);
  if (absl::Status kind = CheckKind(path, info.st_mode); !kind.ok()) return kind;
  // O_NONBLOCK: a FIFO opens at once, writer or not. Then the kind again,
  // of what was opened: the path may name another file by now.
  FileDescriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (file.get() < 0) return CannotRead(path, errno);
  if (::fstat(file.get(), &info) != 0) return CannotRead(path, errno);
  if (absl::Status kind = CheckKind(path, info.st_mode); !kind.ok()) return kind;

  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t got = ::read(file.get(), buffer, sizeof(buffer));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && errno == EAGAIN) {
      // A FIFO with a writer that has not written (yet): wait for it, as
      // for the rest of what it writes.
      const int flags = ::fcntl(file.get(), F_GETFL);
      if (flags < 0 || ::fcntl(file.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
        return CannotRead(path, errno);
      }
      continue;
    }
    if (got < 0) return CannotRead(path, errno);
    if (got == 0) break;
    text.append(buffer, static_cast<size_t>(got));
    if (text.size() > kMaxConfigBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": more than ", kMaxConfigBytes / (1 << 20),
                       " MiB, too large for a config file (is it the right file?)"));
    }
  }
  // End of file at once: on a FIFO, no writer had it open and nothing was
  // left in it. Refused, whether or not one would have come.
  if (text.empty() && S_ISFIFO(info.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": a FIFO that nothing writes to, not a config file"));
  }
  return text;
}

}  // namespace muster::worker::config_detail
