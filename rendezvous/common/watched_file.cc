#include "rendezvous/common/watched_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muster::rdzv {

bool WatchedFile::Version::operator==(const Version& other) const {
  return exists == other.exists && device == other.device && inode == other.inode &&
         size == other.size && mtime_ns == other.mtime_ns;
}

WatchedFile::WatchedFile(std::string path, absl::Duration refresh)
    : path_(std::move(path)), refresh_(refresh) {}

WatchedFile::Version WatchedFile::Stat() const {
  struct stat info;
  if (::stat(path_.c_str(), &info) != 0) return {};
  return {true, static_cast<uint64_t>(info.st_dev), static_cast<uint64_t>(info.st_ino),
          static_cast<uint64_t>(info.st_size),
          int64_t{info.st_mtim.tv_sec} * 1000000000 + info.st_mtim.tv_nsec};
}

unsigned int WatcherSeconds(absl::Duration refresh) {
  return static_cast<unsigned int>(std::max(1.0, std::ceil(absl::ToDoubleSeconds(refresh))));
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what) {
  // POSIX calls rather than an ifstream, which loses errno: the reason
  // (Permission denied, No such file or directory, Is a directory) is what
  // an operator needs to fix a credential file.
  auto failed = [&](const char* doing, int error) {
    return absl::InvalidArgumentError(
        absl::StrCat(doing, " ", what, " '", path, "': ", std::strerror(error)));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return failed("cannot read", errno);
  std::string contents;
  struct stat info;
  if (::fstat(fd, &info) == 0 && S_ISDIR(info.st_mode)) {
    ::close(fd);
    return failed("cannot read", EISDIR);
  }
  char buffer[1 << 16];
  for (;;) {
    const ssize_t got = ::read(fd, buffer, sizeof(buffer));
    if (got == 0) break;
    if (got < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      return failed("error reading", error);
    }
    contents.append(buffer, static_cast<size_t>(got));
  }
  ::close(fd);
  return contents;
}

absl::StatusOr<std::string> WatchedFile::Read(const std::string& what) {
  seen_ = Stat();
  next_look_ = absl::Now() + refresh_;
  return ReadWholeFile(path_, what);
}

std::optional<absl::StatusOr<std::string>> WatchedFile::Changed(const std::string& what, bool now) {
  if (!now && absl::Now() < next_look_) return std::nullopt;
  next_look_ = absl::Now() + refresh_;
  if (Stat() == seen_) return std::nullopt;
  return Read(what);
}

}  // namespace muster::rdzv
