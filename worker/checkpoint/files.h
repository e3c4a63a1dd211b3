// Durable file primitives for checkpoints, on an Env (worker/checkpoint/env.h):
// write-and-fsync with a running checksum, streaming checksums, whole
// small files.
//
// Errors are the Env's: UNAVAILABLE (the disk or the OS said no:
// permissions, space, I/O) or NOT_FOUND (a file to read is missing), each
// naming the path and the errno text. Thread-safe: no shared state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/checkpoint/env.h"

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

// Creates (or truncates) `path` on `env`, writes `bytes` from `data`,
// fsyncs and closes it. Sets *crc to the data's CRC-32, computed on a
// second thread beside the write. The data goes to the file in one
// Append (WritableFile takes any size and starts writeback as it goes),
// so a wrapping Env sees a file's whole contents in one call.
absl::Status WriteFileDurably(Env* env, const std::string& path, const void* data, size_t bytes,
                              uint32_t* crc);

// The CRC-32 and size of a whole file (read as ReadChecksummed does).
absl::Status FileCrc(Env* env, const std::string& path, uint32_t* crc, uint64_t* bytes);

// Reads `bytes` at `offset` of `file` (named `path` in errors) into `dst`;
// DATA_LOSS if the file ends first.
absl::Status ReadExactly(const RandomAccessFile& file, uint64_t offset, void* dst, size_t bytes,
                         const std::string& path);

// A run of bytes of a file, read into `dst` (which must hold `bytes`), or,
// when dst is nullptr, only checksummed (through internal scratch memory).
struct FileSpan {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  char* dst = nullptr;
};

// Reads `spans` of `file` (named `path` in errors) in order and
// sets *crc to the CRC-32 of all the bytes read, in that order.
// REQUIRES: the spans are sorted and contiguous (each starts where the
// previous ended), so *crc is the CRC of the file's first bytes. The
// checksum of each chunk runs on a second thread while the next chunk is
// read; both are done when this returns, also on error. DATA_LOSS if the
// file ends first, UNAVAILABLE for a failed read; *crc is then unset.
absl::Status ReadChecksummed(const RandomAccessFile& file, const std::string& path,
                             const std::vector<FileSpan>& spans, uint32_t* crc);

// A small file's whole contents.
absl::StatusOr<std::string> ReadSmallFile(Env* env, const std::string& path);

}  // namespace muster::worker
