#include "worker/checkpoint/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace muster::worker {
namespace {

// The payload that marks a full file system (FileSystemError, MarkNoSpace).
constexpr char kNoSpaceUrl[] = "muster.worker/no-space";

// Big enough that syscalls cost nothing next to the copy, small enough
// that writeback of one chunk starts while the next is copied in.
constexpr size_t kChunkBytes = 8 << 20;

// "<path>: <what>: <strerror(errno)>".
absl::Status Errno(const std::string& what, const std::string& path) {
  const int error = errno;
  return FileSystemError(error, absl::StrCat(path, ": ", what, ": ", std::strerror(error)));
}

absl::Status FromErrorCode(const std::error_code& error, const std::string& what,
                           const std::string& path) {
  const int value =
      error.category() == std::generic_category() || error.category() == std::system_category()
          ? error.value()
          : 0;
  return FileSystemError(value, absl::StrCat(path, ": ", what, ": ", error.message()));
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Append(const void* data, size_t bytes) override {
    const char* p = static_cast<const char*>(data);
    for (size_t done = 0; done < bytes;) {
      const size_t chunk = std::min(kChunkBytes, bytes - done);
      for (size_t written = 0; written < chunk;) {
        ssize_t n = ::write(fd_, p + done + written, chunk - written);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return Errno("write failed", path_);
        written += static_cast<size_t>(n);
      }
      // Start writing the chunk back now (asynchronous). Left to the
      // kernel, writeback of a 1.5 GB file began only at the fsync (it is
      // below vm.dirty_background_ratio here), so copying into the page
      // cache and writing to disk ran one after the other. Only a hint:
      // Sync() still decides durability, so a refusal is ignored.
      (void)::sync_file_range(fd_, static_cast<off64_t>(offset_), static_cast<off64_t>(chunk),
                              SYNC_FILE_RANGE_WRITE);
      offset_ += chunk;
      done += chunk;
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (::fsync(fd_) != 0) return Errno("fsync failed", path_);
    return absl::OkStatus();
  }

  absl::Status Close() override {
    // close(2) releases the descriptor even when it fails: never retried.
    if (::close(std::exchange(fd_, -1)) != 0) return Errno("close failed", path_);
    return absl::OkStatus();
  }

 private:
  int fd_;
  const std::string path_;
  uint64_t offset_ = 0;  // bytes appended so far
};

class PosixRandomAccessFile : public RandomAccessFile {
 public:
  PosixRandomAccessFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixRandomAccessFile() override { ::close(fd_); }

  absl::StatusOr<size_t> Read(uint64_t offset, size_t bytes, char* dst) const override {
    size_t done = 0;
    while (done < bytes) {
      ssize_t n = ::pread(fd_, dst + done, bytes - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Errno("read failed", path_);
      if (n == 0) break;  // the end of the file
      done += static_cast<size_t>(n);
    }
    return done;
  }

  absl::StatusOr<uint64_t> Size() const override {
    struct stat info;
    if (::fstat(fd_, &info) != 0) return Errno("cannot stat", path_);
    return static_cast<uint64_t>(info.st_size);
  }

 private:
  const int fd_;
  const std::string path_;
};

class PosixFileLock : public FileLock {
 public:
  PosixFileLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  // Closing the descriptor releases the lock: flock(2) locks belong to the
  // open file description, not to the process as fcntl(2) locks do, so
  // two FileLocks of one process exclude each other too.
  ~PosixFileLock() override { ::close(fd_); }

  absl::Status SetContents(const std::string& text) override {
    if (::ftruncate(fd_, 0) != 0) return Errno("cannot truncate", path_);
    for (size_t done = 0; done < text.size();) {
      ssize_t n = ::pwrite(fd_, text.data() + done, text.size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Errno("write failed", path_);
      done += static_cast<size_t>(n);
    }
    // Durable, and on NFS sent to the server, where other clients read it.
    if (::fsync(fd_) != 0) return Errno("fsync failed", path_);
    return absl::OkStatus();
  }

 private:
  const int fd_;
  const std::string path_;
};

class PosixEnv : public Env {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return Errno("cannot create", path);
    return std::make_unique<PosixWritableFile>(fd, path);
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Errno("cannot open", path);
    // A larger kernel readahead: checkpoint files are read front to back.
    // Only a hint, so a refusal changes nothing.
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    return std::make_unique<PosixRandomAccessFile>(fd, path);
  }

  absl::Status SyncFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Errno("cannot open", path);
    absl::Status status;
    if (::fsync(fd) != 0) status = Errno("fsync failed", path);
    ::close(fd);
    return status;
  }

  absl::Status SyncDir(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return Errno("cannot open directory", path);
    absl::Status status;
    if (::fsync(fd) != 0) status = Errno("fsync of directory failed", path);
    ::close(fd);
    return status;
  }

  bool FileExists(const std::string& path) override {
    struct stat info;
    return ::stat(path.c_str(), &info) == 0;
  }

  absl::StatusOr<uint64_t> AvailableBytes(const std::string& path) override {
    struct statvfs info;
    if (::statvfs(path.c_str(), &info) != 0) return Errno("cannot statvfs", path);
    return static_cast<uint64_t>(info.f_bavail) * info.f_frsize;
  }

  bool IsDirectory(const std::string& path) override {
    struct stat info;
    return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
  }

  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    DIR* stream = ::opendir(dir.c_str());
    if (stream == nullptr) return Errno("cannot list directory", dir);
    std::vector<std::string> names;
    absl::Status status;
    while (true) {
      errno = 0;
      const dirent* entry = ::readdir(stream);
      if (entry == nullptr) {
        if (errno != 0) status = Errno("cannot list directory", dir);
        break;
      }
      if (std::strcmp(entry->d_name, ".") == 0 || std::strcmp(entry->d_name, "..") == 0) continue;
      names.emplace_back(entry->d_name);
    }
    ::closedir(stream);
    if (!status.ok()) return status;
    return names;
  }

  absl::Status CreateDir(const std::string& path) override {
    std::error_code error;
    std::filesystem::create_directories(path, error);
    if (error) return FromErrorCode(error, "cannot create directory", path);
    return absl::OkStatus();
  }

  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      const int error = errno;
      return FileSystemError(
          error, absl::StrCat("cannot rename ", from, " to ", to, ": ", std::strerror(error)));
    }
    return absl::OkStatus();
  }

  absl::Status RemoveFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return Errno("cannot delete", path);
    return absl::OkStatus();
  }

  absl::Status RemoveAll(const std::string& path) override {
    std::error_code error;
    std::filesystem::remove_all(path, error);
    if (error) return FromErrorCode(error, "cannot delete", path);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return Errno("cannot open", path);
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      if (error == EWOULDBLOCK) return absl::FailedPreconditionError(path + ": locked");
      errno = error;
      return Errno("cannot lock", path);
    }
    return std::make_unique<PosixFileLock>(fd, path);
  }
};

}  // namespace

absl::Status FileSystemError(int error, const std::string& message) {
  switch (error) {
    case ENOENT:
      return absl::NotFoundError(message);
    case ENOSPC:
    case EDQUOT:
      return MarkNoSpace(absl::ResourceExhaustedError(message));
    // The path itself is wrong: a file where a directory must be, or the
    // other way round, a name too long, a loop of links.
    case ENOTDIR:
    case EISDIR:
    case ENAMETOOLONG:
    case ELOOP:
      return absl::InvalidArgumentError(message);
    // Not ours to write (or read), or a file system mounted read-only.
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    default:
      return absl::UnavailableError(message);
  }
}

bool IsNoSpace(const absl::Status& status) { return status.GetPayload(kNoSpaceUrl).has_value(); }

absl::Status MarkNoSpace(absl::Status status) {
  status.SetPayload(kNoSpaceUrl, absl::Cord("1"));
  return status;
}

Env* Env::Default() {
  static Env* const env = new PosixEnv;  // never deleted: used until exit, from any thread
  return env;
}

}  // namespace muster::worker
