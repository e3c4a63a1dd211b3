// One rank's background writer: takes a host snapshot of the rank's slice
// of the flat state and writes it to a data file (plus a small sidecar
// with its size and checksum, which rank 0 reads to build the manifest)
// while training goes on.
//
// Memory is bounded to one snapshot: Buffer() waits for the write in
// flight before handing the buffer out again. The buffer is kept from one
// save to the next (huge pages, never zeroed): only the first save pays
// for faulting it in. A failed write is kept and returned by the next
// Wait() (or Buffer()); it is never dropped.
//
// Thread-safety: one thread (the trainer's) calls every method; the
// writer's own thread only runs the write.
#pragma once

#include <cstdint>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/checkpoint/files.h"
#include "worker/checkpoint/manifest.h"

namespace muster::worker {

// "rank_00003.bin.done": the sidecar that says a rank's file is durable.
std::string SidecarName(const std::string& data_file);
// Reads a sidecar written by ShardWriter: DATA_LOSS if malformed.
absl::StatusOr<FileRecord> ReadSidecar(Env* env, const std::string& dir,
                                       const std::string& data_file);

class ShardWriter {
 public:
  // REQUIRES: `env` outlives the writer.
  explicit ShardWriter(Env* env) : env_(env) {}
  ~ShardWriter();  // waits for the write in flight
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Waits for the write in flight, then returns the snapshot buffer sized
  // to `floats` (uninitialized), for the caller to fill completely. Returns
  // that write's error, if it failed (and then hands out no buffer), or
  // RESOURCE_EXHAUSTED if the memory cannot be had.
  absl::StatusOr<float*> Buffer(size_t floats);

  // Starts writing the buffer to dir/file_name (then fsync, then the
  // sidecar, then fsync of the directory) on a background thread.
  // REQUIRES: Buffer() was called since the last Start().
  void Start(const std::string& dir, const std::string& file_name);

  // True when no write is in flight (done or never started). Never blocks.
  bool Idle() const;
  // Waits for the write in flight; returns its record (name, bytes, CRC),
  // or its error. OK with an empty name when none was started.
  absl::StatusOr<FileRecord> Wait();

 private:
  void Write(std::string dir, std::string file_name);

  Env* const env_;
  // Touched by the writer thread only while busy_. buffer_ holds
  // capacity_ floats, of which the first size_ are the snapshot.
  HostFloats buffer_;
  size_t capacity_ = 0;
  size_t size_ = 0;
  std::thread thread_;
  mutable absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<FileRecord> result_ ABSL_GUARDED_BY(mu_) = FileRecord{};
};

}  // namespace muster::worker
