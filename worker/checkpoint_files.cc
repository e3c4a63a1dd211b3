#include "worker/checkpoint_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muster::worker {
namespace {

// Big enough that syscalls cost nothing next to the copy, small enough to
// stay in cache for the checksum that follows the write.
constexpr size_t kChunkBytes = 8 << 20;

absl::Status Errno(const std::string& what, const std::string& path) {
  int error = errno;
  std::string message = absl::StrCat(path, ": ", what, ": ", std::strerror(error));
  if (error == ENOENT) return absl::NotFoundError(message);
  return absl::UnavailableError(message);
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

uint32_t Crc32(uint32_t crc, const void* data, size_t bytes) {
  const Bytef* p = static_cast<const Bytef*>(data);
  uLong value = crc;
  while (bytes > 0) {  // zlib's length is a uInt
    uInt piece = static_cast<uInt>(std::min<size_t>(bytes, 1u << 30));
    value = ::crc32(value, p, piece);
    p += piece;
    bytes -= piece;
  }
  return static_cast<uint32_t>(value);
}

absl::Status WriteFileDurably(const std::string& path, const void* data, size_t bytes,
                              uint32_t* crc, const std::function<absl::Status()>& between_chunks) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Errno("cannot create", path);
  const char* p = static_cast<const char*>(data);
  // The checksum runs on its own thread beside the writes: done in series
  // they made a save half as fast as `dd` (docs/benchmarks.md).
  uint32_t running = 0;
  std::thread checksum([&running, p, bytes] { running = Crc32(0, p, bytes); });
  struct Joiner {
    std::thread& thread;
    ~Joiner() {
      if (thread.joinable()) thread.join();
    }
  } joiner{checksum};
  size_t done = 0;
  bool first_chunk = true;
  while (done < bytes || first_chunk) {
    const size_t chunk = std::min(kChunkBytes, bytes - done);
    size_t written = 0;
    while (written < chunk) {
      ssize_t n = ::write(fd.get(), p + done + written, chunk - written);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Errno("write failed", path);
      written += static_cast<size_t>(n);
    }
    done += chunk;
    if (first_chunk && between_chunks) {
      if (absl::Status status = between_chunks(); !status.ok()) return status;
    }
    first_chunk = false;
  }
  if (::fsync(fd.get()) != 0) return Errno("fsync failed", path);
  if (::close(fd.release()) != 0) return Errno("close failed", path);
  checksum.join();
  *crc = running;
  return absl::OkStatus();
}

absl::Status SyncDirectory(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open directory", path);
  if (::fsync(fd.get()) != 0) return Errno("fsync of directory failed", path);
  return absl::OkStatus();
}

absl::Status ReadExactly(int fd, uint64_t offset, void* dst, size_t bytes,
                         const std::string& path) {
  char* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pread(fd, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("read failed", path);
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, ": ends at byte ", offset + done,
                                              "; expected ", offset + bytes, " bytes"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FileCrc(const std::string& path, uint32_t* crc, uint64_t* bytes) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path);
  std::vector<char> buffer(kChunkBytes);
  uint32_t running = 0;
  uint64_t total = 0;
  while (true) {
    ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("read failed", path);
    if (n == 0) break;
    running = Crc32(running, buffer.data(), static_cast<size_t>(n));
    total += static_cast<uint64_t>(n);
  }
  *crc = running;
  *bytes = total;
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path);
  std::string text;
  char buffer[65536];
  while (true) {
    ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("read failed", path);
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  return text;
}

absl::Status CheckpointTestPause(const char* phase, int step) {
  const char* wanted = std::getenv("MUSTER_CKPT_TEST_PAUSE");
  if (wanted == nullptr) return absl::OkStatus();
  if (wanted != std::string(phase) && wanted != absl::StrCat(phase, "@", step)) {
    return absl::OkStatus();
  }
  if (const char* marker = std::getenv("MUSTER_CKPT_TEST_MARKER")) {
    Fd fd(::open(marker, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  }
  // Waiting to be killed: nothing can announce that, so this one place sleeps.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("MUSTER_CKPT_TEST_PAUSE=", phase, ": paused 120 s and was not killed"));
}

}  // namespace muster::worker
