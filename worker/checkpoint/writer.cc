#include "worker/checkpoint/writer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cinttypes>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace muster::worker {

std::string SidecarName(const std::string& data_file) { return data_file + ".done"; }

absl::StatusOr<FileRecord> ReadSidecar(Env* env, const std::string& dir,
                                       const std::string& data_file) {
  const std::string path = dir + "/" + SidecarName(data_file);
  auto text = ReadSmallFile(env, path);
  if (!text.ok()) return text.status();
  std::vector<std::string> words = absl::StrSplit(absl::StripAsciiWhitespace(*text), ' ');
  FileRecord record;
  record.name = data_file;
  if (words.size() != 2 || !absl::SimpleAtoi(words[0], &record.bytes) ||
      !absl::SimpleHexAtoi(words[1], &record.crc32)) {
    return absl::DataLossError(
        absl::StrCat(path, ": expected \"<bytes> <crc32 hex>\", got \"", *text, "\""));
  }
  return record;
}

ShardWriter::~ShardWriter() {
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<float*> ShardWriter::Buffer(size_t floats) {
  auto previous = Wait();
  if (!previous.ok()) return previous.status();
  if (floats > capacity_) {
    buffer_.reset();  // the old one first: at most one snapshot in memory
    capacity_ = 0;
    auto grown = AllocateHostFloats(floats);
    if (!grown.ok()) return grown.status();
    buffer_ = std::move(*grown);
    capacity_ = floats;
  }
  size_ = floats;
  return buffer_.get();
}

void ShardWriter::Start(const std::string& dir, const std::string& file_name) {
  if (thread_.joinable()) thread_.join();
  {
    absl::MutexLock lock(&mu_);
    busy_ = true;
    result_ = FileRecord{};
  }
  thread_ = std::thread(&ShardWriter::Write, this, dir, file_name);
}

bool ShardWriter::Idle() const {
  absl::MutexLock lock(&mu_);
  return !busy_;
}

absl::StatusOr<FileRecord> ShardWriter::Wait() {
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  absl::StatusOr<FileRecord> result = result_;
  result_ = FileRecord{};  // reported once; the caller now owns the error
  return result;
}

void ShardWriter::Write(std::string dir, std::string file_name) {
  // Training comes first. On a machine whose cores the training threads
  // fill, the writer and its checksum thread (which inherits this nice
  // value) otherwise take cores from the step in flight: one GPT-2 124M
  // step overlapping a save stalled 19% at nice 0. The save only has to
  // finish before the next one starts.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
  FileRecord record;
  record.name = file_name;
  record.bytes = size_ * sizeof(float);
  auto write = [&]() -> absl::Status {
    absl::Status status =
        WriteFileDurably(env_, dir + "/" + file_name, buffer_.get(), record.bytes, &record.crc32);
    if (!status.ok()) return status;
    std::string sidecar = absl::StrFormat("%" PRIu64 " %08x\n", record.bytes, record.crc32);
    uint32_t ignored;
    status = WriteFileDurably(env_, dir + "/" + SidecarName(file_name), sidecar.data(),
                              sidecar.size(), &ignored);
    if (!status.ok()) return status;
    return env_->SyncDir(dir);
  };
  absl::Status status = write();
  absl::MutexLock lock(&mu_);
  if (status.ok()) {
    result_ = record;
  } else {
    result_ = status;
  }
  busy_ = false;
}

}  // namespace muster::worker
