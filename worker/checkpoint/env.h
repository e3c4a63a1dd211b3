// The file system as checkpoints see it (after leveldb's Env): every read,
// write, fsync, rename, listing and deletion of checkpoint I/O goes
// through an Env, so a test can wrap it (EnvWrapper) to fail a write or
// stop a save at a chosen call, and production code holds no test hooks.
// Env::Default() is the POSIX file system.
//
// Errors name the path and the OS's reason ("<path>: <what>: <strerror>"):
// NOT_FOUND when the path, or a directory on the way to it, does not
// exist (ENOENT); RESOURCE_EXHAUSTED, which IsNoSpace() tells apart, when
// the file system or the user's quota on it is full (ENOSPC, EDQUOT);
// INVALID_ARGUMENT when the path is wrong (ENOTDIR: a file on the way,
// EISDIR, ENAMETOOLONG, ELOOP); PERMISSION_DENIED when it is not ours to
// write or read (EACCES, EPERM, EROFS: a read-only mount); UNAVAILABLE for
// any other refusal (I/O). Only NOT_FOUND and UNAVAILABLE may mend by
// themselves (a late mount, a flaky server), so only they are restartable
// (worker_main.cc). Thread-safety: an Env is used from several
// threads at once (the trainer, the background writer, retention) and must be thread-safe; a file
// object is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muster::worker {

// The status of a failed file-system call that set errno to `error`, with
// `message` (see above for the codes).
absl::Status FileSystemError(int error, const std::string& message);
// Whether `status` is FileSystemError's for a full file system or quota
// (ENOSPC, EDQUOT), or carries that mark (MarkNoSpace). No restart of the
// job can mend it until someone frees space, so the worker reports it as
// not restartable (docs/worker.md).
bool IsNoSpace(const absl::Status& status);
// `status` (not OK) with the mark IsNoSpace() reads: for an error that
// reports another rank's full file system.
absl::Status MarkNoSpace(absl::Status status);

// A file being written from its start.
class WritableFile {
 public:
  virtual ~WritableFile() = default;  // closes, ignoring errors, if Close() was not called
  // Appends `bytes` at `data`, all of them (or fails). Any size: the POSIX
  // file writes a large append in 8 MiB chunks and starts writeback of
  // each as it goes (sync_file_range), so the disk works while later
  // chunks are copied in and Sync() has little left to flush.
  virtual absl::Status Append(const void* data, size_t bytes) = 0;
  // fsync: what makes the data durable.
  virtual absl::Status Sync() = 0;
  // REQUIRES: called at most once; nothing after it.
  virtual absl::Status Close() = 0;
};

// A file read by position (pread). The checkpoint code reads front to
// back in large pieces, so the POSIX file asks for a larger readahead.
class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // Reads up to `bytes` at `offset` into `dst`; returns how many were
  // read: fewer only where the file ends (0 at or past its end).
  virtual absl::StatusOr<size_t> Read(uint64_t offset, size_t bytes, char* dst) const = 0;
  // The file's size now.
  virtual absl::StatusOr<uint64_t> Size() const = 0;
};

// An exclusive advisory lock on a file, held until the object is
// destroyed or its process ends (a crash included: the kernel releases
// it). The file's contents are the holder's to set, so whoever is refused
// the lock can read who holds it.
class FileLock {
 public:
  virtual ~FileLock() = default;  // releases the lock
  // Replaces the file's contents with `text`, and fsyncs it.
  virtual absl::Status SetContents(const std::string& text) = 0;
};

class Env {
 public:
  virtual ~Env() = default;

  // The POSIX file system; never deleted.
  static Env* Default();

  // Creates `path`, truncating a file that exists.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) = 0;
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) = 0;

  // fsync of a file written by other means (stdio, a library).
  virtual absl::Status SyncFile(const std::string& path) = 0;
  // fsync of a directory: makes a create, rename or delete in it durable.
  virtual absl::Status SyncDir(const std::string& path) = 0;

  // statvfs: the bytes an unprivileged writer may still write to the file
  // system that holds `path` (f_bavail x f_frsize).
  virtual absl::StatusOr<uint64_t> AvailableBytes(const std::string& path) = 0;

  // Whether `path` exists (any type); false also when it cannot be told.
  virtual bool FileExists(const std::string& path) = 0;
  // Whether `path` is a directory (following symlinks).
  virtual bool IsDirectory(const std::string& path) = 0;
  // The names in directory `dir` (no "." or ".."), in no particular order.
  virtual absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) = 0;

  // Creates directory `path` and its missing parents; OK if it exists.
  virtual absl::Status CreateDir(const std::string& path) = 0;
  // rename(2): replaces a file or an empty directory at `to`. The message
  // names both paths.
  virtual absl::Status RenameFile(const std::string& from, const std::string& to) = 0;
  // Removes one file.
  virtual absl::Status RemoveFile(const std::string& path) = 0;
  // Removes `path` and, if it is a directory, everything under it; OK if
  // it does not exist.
  virtual absl::Status RemoveAll(const std::string& path) = 0;

  // Takes an exclusive lock on `path`, creating the file if it is missing,
  // without waiting. FAILED_PRECONDITION when it is held: by another
  // process, or by another FileLock of this process. The POSIX Env uses
  // flock(2), which NFS v4 and Lustre (with its flock mount option) carry
  // to every client of a shared file system.
  virtual absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& path) = 0;
};

// An Env that forwards every call to `target`: a test overrides the
// methods it wants to change (fail a write, pause at a rename).
class EnvWrapper : public Env {
 public:
  // REQUIRES: `target` outlives the wrapper.
  explicit EnvWrapper(Env* target) : target_(target) {}
  Env* target() const { return target_; }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    return target_->NewWritableFile(path);
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override {
    return target_->NewRandomAccessFile(path);
  }
  absl::Status SyncFile(const std::string& path) override { return target_->SyncFile(path); }
  absl::Status SyncDir(const std::string& path) override { return target_->SyncDir(path); }
  absl::StatusOr<uint64_t> AvailableBytes(const std::string& path) override {
    return target_->AvailableBytes(path);
  }
  bool FileExists(const std::string& path) override { return target_->FileExists(path); }
  bool IsDirectory(const std::string& path) override { return target_->IsDirectory(path); }
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    return target_->GetChildren(dir);
  }
  absl::Status CreateDir(const std::string& path) override { return target_->CreateDir(path); }
  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    return target_->RenameFile(from, to);
  }
  absl::Status RemoveFile(const std::string& path) override { return target_->RemoveFile(path); }
  absl::Status RemoveAll(const std::string& path) override { return target_->RemoveAll(path); }
  absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& path) override {
    return target_->LockFile(path);
  }

 private:
  Env* target_;
};

}  // namespace muster::worker
