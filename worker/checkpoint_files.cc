#include "worker/checkpoint_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

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

// Scratch buffers for checksum-only reads: two, so one is read into while
// the checksum thread works on the other.
constexpr int kScratchSlots = 2;

// The CRC-32 of a sequence of chunks, computed in order on its own thread.
// zlib's crc32 runs at about the disk's speed here, so done in series with
// the reads it halved load throughput (docs/benchmarks.md).
class ChunkChecksummer {
 public:
  ChunkChecksummer() : thread_([this] { Run(); }) {}
  // Checksums what was queued, then joins.
  ~ChunkChecksummer() { Close(); }
  ChunkChecksummer(const ChunkChecksummer&) = delete;
  ChunkChecksummer& operator=(const ChunkChecksummer&) = delete;

  // Queues [data, data + bytes). The memory must stay valid and unchanged
  // until WaitUntilDone(the chunk's number) or Finish() returns.
  void Push(const char* data, size_t bytes) {
    absl::MutexLock lock(&mu_);
    queue_.push_back({data, bytes});
    ++pushed_;
    work_.Signal();
  }
  // Chunks pushed so far; the next one pushed is number pushed() + 1.
  uint64_t pushed() const {
    absl::MutexLock lock(&mu_);
    return pushed_;
  }
  // Waits until chunks 1..`chunk` are checksummed (0: returns at once).
  void WaitUntilDone(uint64_t chunk) {
    absl::MutexLock lock(&mu_);
    while (done_ < chunk) done_changed_.Wait(&mu_);
  }
  // The CRC-32 of every chunk pushed.
  uint32_t Finish() {
    Close();
    return crc_;
  }

 private:
  void Close() {
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      work_.Signal();
    }
    if (thread_.joinable()) thread_.join();
  }
  void Run() {
    while (true) {
      std::pair<const char*, size_t> chunk;
      {
        absl::MutexLock lock(&mu_);
        while (!closed_ && queue_.empty()) work_.Wait(&mu_);
        if (queue_.empty()) return;  // closed and drained
        chunk = queue_.front();
        queue_.pop_front();
      }
      crc_ = Crc32(crc_, chunk.first, chunk.second);
      absl::MutexLock lock(&mu_);
      ++done_;
      done_changed_.SignalAll();
    }
  }

  mutable absl::Mutex mu_;
  std::deque<std::pair<const char*, size_t>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t pushed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::CondVar work_;          // queue_ or closed_ changed
  absl::CondVar done_changed_;  // done_ grew
  uint32_t crc_ = 0;  // the checksum thread's until it is joined
  std::thread thread_;  // last: starts once the fields above exist
};

}  // namespace

void AdviseSequential(int fd) {
  // Larger kernel readahead; only a hint, so a refusal changes nothing.
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
}

void FreeHostFloats::operator()(float* p) const { std::free(p); }

absl::StatusOr<HostFloats> AllocateHostFloats(uint64_t floats) {
  constexpr size_t kHugePage = 2 << 20;
  const size_t bytes = (floats * sizeof(float) + kHugePage - 1) / kHugePage * kHugePage;
  void* memory = bytes == 0 ? nullptr : std::aligned_alloc(kHugePage, bytes);
  if (memory == nullptr && bytes > 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory for a checkpoint"));
  }
  if (memory != nullptr) (void)::madvise(memory, bytes, MADV_HUGEPAGE);  // a hint
  return HostFloats(static_cast<float*>(memory));
}

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
    // Start writing the chunk back now (asynchronous). Left to the kernel,
    // writeback of a 1.5 GB file began only at the fsync (it is below
    // vm.dirty_background_ratio here), so copying into the page cache and
    // writing to disk ran one after the other. Only a hint: the fsync
    // below still decides durability, so a refusal is ignored.
    if (chunk > 0) {
      (void)::sync_file_range(fd.get(), static_cast<off64_t>(done), static_cast<off64_t>(chunk),
                              SYNC_FILE_RANGE_WRITE);
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

absl::Status SyncFile(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path);
  if (::fsync(fd.get()) != 0) return Errno("fsync failed", path);
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

absl::Status ReadChecksummed(int fd, const std::string& path, const std::vector<FileSpan>& spans,
                             uint32_t* crc) {
  // Declared before the checksummer: queued chunks may point into it, and
  // the checksummer's destructor (which joins) must run first.
  std::vector<char> scratch[kScratchSlots];
  uint64_t scratch_chunk[kScratchSlots] = {};  // the chunk that last used each slot
  int next_slot = 0;
  ChunkChecksummer checksummer;
  for (const FileSpan& span : spans) {
    for (uint64_t done = 0; done < span.bytes;) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, span.bytes - done));
      char* into = span.dst == nullptr ? nullptr : span.dst + done;
      if (into == nullptr) {
        // Reuse a slot only once the checksum has finished with it.
        checksummer.WaitUntilDone(scratch_chunk[next_slot]);
        scratch[next_slot].resize(kChunkBytes);
        into = scratch[next_slot].data();
        scratch_chunk[next_slot] = checksummer.pushed() + 1;
        next_slot = (next_slot + 1) % kScratchSlots;
      }
      if (absl::Status status = ReadExactly(fd, span.offset + done, into, chunk, path);
          !status.ok()) {
        return status;
      }
      checksummer.Push(into, chunk);
      done += chunk;
    }
  }
  *crc = checksummer.Finish();
  return absl::OkStatus();
}

absl::Status FileCrc(const std::string& path, uint32_t* crc, uint64_t* bytes) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Errno("cannot open", path);
  struct stat info;
  if (::fstat(fd.get(), &info) != 0) return Errno("cannot stat", path);
  AdviseSequential(fd.get());
  const uint64_t size = static_cast<uint64_t>(info.st_size);
  if (absl::Status status = ReadChecksummed(fd.get(), path, {{0, size, nullptr}}, crc);
      !status.ok()) {
    return status;
  }
  *bytes = size;
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
  // Waiting to be killed by the test: nothing can announce that, so this
  // one place sleeps, once, bounded; a test that forgets to kill gets the
  // error below.
  std::this_thread::sleep_for(std::chrono::seconds(120));
  return absl::DeadlineExceededError(
      absl::StrCat("MUSTER_CKPT_TEST_PAUSE=", phase, ": paused 120 s and was not killed"));
}

}  // namespace muster::worker
