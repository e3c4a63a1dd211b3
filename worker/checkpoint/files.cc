#include "worker/checkpoint/files.h"

#include <sys/mman.h>
#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace muster::worker {
namespace {

// Big enough that syscalls cost nothing next to the copy, small enough to
// stay in cache for the checksum that follows the read.
constexpr size_t kChunkBytes = 8 << 20;

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
  uint32_t crc_ = 0;            // the checksum thread's until it is joined
  std::thread thread_;          // last: starts once the fields above exist
};

}  // namespace

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

absl::Status WriteFileDurably(Env* env, const std::string& path, const void* data, size_t bytes,
                              uint32_t* crc) {
  auto file = env->NewWritableFile(path);
  if (!file.ok()) return file.status();
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
  if (absl::Status status = (*file)->Append(p, bytes); !status.ok()) return status;
  if (absl::Status status = (*file)->Sync(); !status.ok()) return status;
  if (absl::Status status = (*file)->Close(); !status.ok()) return status;
  checksum.join();
  *crc = running;
  return absl::OkStatus();
}

absl::Status ReadExactly(const RandomAccessFile& file, uint64_t offset, void* dst, size_t bytes,
                         const std::string& path) {
  auto read = file.Read(offset, bytes, static_cast<char*>(dst));
  if (!read.ok()) return read.status();
  if (*read < bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ends at byte ", offset + *read, "; expected ",
                                            offset + bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ReadChecksummed(const RandomAccessFile& file, const std::string& path,
                             const std::vector<FileSpan>& spans, uint32_t* crc) {
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
      if (absl::Status status = ReadExactly(file, span.offset + done, into, chunk, path);
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

absl::Status FileCrc(Env* env, const std::string& path, uint32_t* crc, uint64_t* bytes) {
  auto file = env->NewRandomAccessFile(path);
  if (!file.ok()) return file.status();
  auto size = (*file)->Size();
  if (!size.ok()) return size.status();
  if (absl::Status status = ReadChecksummed(**file, path, {{0, *size, nullptr}}, crc);
      !status.ok()) {
    return status;
  }
  *bytes = *size;
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(Env* env, const std::string& path) {
  auto file = env->NewRandomAccessFile(path);
  if (!file.ok()) return file.status();
  std::string text;
  constexpr size_t kPiece = 65536;
  while (true) {
    const size_t had = text.size();
    text.resize(had + kPiece);
    auto read = (*file)->Read(had, kPiece, text.data() + had);
    if (!read.ok()) return read.status();
    text.resize(had + *read);
    if (*read < kPiece) break;  // the end of the file
  }
  return text;
}

}  // namespace muster::worker
