// Durable file primitives for checkpoints: write-and-fsync with a running
// checksum, fsync of a directory, streaming checksums, and the test-only
// pause hook used to kill a save at a chosen phase.
//
// Errors are UNAVAILABLE (the disk or the OS said no: permissions, space,
// I/O) or NOT_FOUND (a file to read is missing), each naming the path and
// the errno text. Thread-safe: no shared state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muster::worker {

struct FreeHostFloats {
  void operator()(float* p) const;
};
using HostFloats = std::unique_ptr<float[], FreeHostFloats>;

// Host memory for `floats` floats, left uninitialized (zeroing it, as
// std::vector does, is a pass over 1.5 GB for GPT-2 124M) and asked to be
// backed by transparent huge pages (this machine's THP mode is "madvise"),
// so the first pass over it faults it in 2 MiB at a time instead of 4 KiB.
// RESOURCE_EXHAUSTED if it cannot be had; nullptr for 0 floats.
absl::StatusOr<HostFloats> AllocateHostFloats(uint64_t floats);

// zlib's CRC-32 of `bytes` at `data`, continuing from `crc` (0 to start).
uint32_t Crc32(uint32_t crc, const void* data, size_t bytes);

// Creates (or truncates) `path`, writes `bytes` from `data`, fsyncs and
// closes it. Sets *crc to the data's CRC-32. `between_chunks`, when set,
// is called after the first chunk is written (the test pause hook).
// Writeback of each chunk is started as soon as it is written
// (sync_file_range), so the disk works while later chunks are copied in
// and the fsync at the end has little left to flush; the fsync is still
// what makes the file durable.
absl::Status WriteFileDurably(const std::string& path, const void* data, size_t bytes,
                              uint32_t* crc, const std::function<absl::Status()>& between_chunks = {});

// fsync of a directory: makes a rename or create inside it durable.
absl::Status SyncDirectory(const std::string& path);
// fsync of a file written by other means (stdio, a library).
absl::Status SyncFile(const std::string& path);

// The CRC-32 and size of a whole file (read as ReadChecksummed does).
absl::Status FileCrc(const std::string& path, uint32_t* crc, uint64_t* bytes);

// Reads `bytes` at `offset` of an open descriptor into `dst`; DATA_LOSS if
// the file ends first.
absl::Status ReadExactly(int fd, uint64_t offset, void* dst, size_t bytes, const std::string& path);

// Asks the kernel for a larger readahead window on `fd` (a hint: errors
// are ignored).
void AdviseSequential(int fd);

// A run of bytes of a file, read into `dst` (which must hold `bytes`), or,
// when dst is nullptr, only checksummed (through internal scratch memory).
struct FileSpan {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  char* dst = nullptr;
};

// Reads `spans` of the open file `fd` (named `path` in errors) in order and
// sets *crc to the CRC-32 of all the bytes read, in that order.
// REQUIRES: the spans are sorted and contiguous (each starts where the
// previous ended), so *crc is the CRC of the file's first bytes. The
// checksum of each chunk runs on a second thread while the next chunk is
// read; both are done when this returns, also on error. DATA_LOSS if the
// file ends first, UNAVAILABLE for a failed read; *crc is then unset.
absl::Status ReadChecksummed(int fd, const std::string& path, const std::vector<FileSpan>& spans,
                             uint32_t* crc);

// A small file's whole contents.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path);

// Test-only fault injection. When the environment has
// MUSTER_CKPT_TEST_PAUSE=<phase> or <phase>@<step>, a save (of that step)
// reaching `phase` (data: a rank's file is half written; manifest: every
// file is durable, no manifest yet; rename: the manifest is durable, the
// directory not yet renamed) creates the file named by MUSTER_CKPT_TEST_MARKER (if set) and
// blocks, so a test can SIGKILL the process mid-save. The block is bounded:
// after 120 s it returns DEADLINE_EXCEEDED instead of hanging a test run.
absl::Status CheckpointTestPause(const char* phase, int step);

}  // namespace muster::worker
