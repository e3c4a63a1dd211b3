#include "rendezvous/common/watched_file.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
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
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " '", path, "'"));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("error reading ", what, " '", path, "'"));
  }
  return contents.str();
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
