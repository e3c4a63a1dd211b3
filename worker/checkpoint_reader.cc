#include "worker/checkpoint_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "worker/checkpoint_files.h"

namespace muster::worker {
namespace {

// A run of bytes of one data file, read either into the destination or
// only for the checksum (dst == nullptr).
struct Piece {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  char* dst = nullptr;
};

constexpr uint64_t kScratchBytes = 8 << 20;

// Reads `pieces` (sorted, covering the file exactly) and checks the CRC.
absl::Status ReadFileChecked(const std::string& path, const FileRecord& record,
                             const std::vector<Piece>& pieces) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open checkpoint data file"));
  }
  std::vector<char> scratch;
  uint32_t crc = 0;
  absl::Status status;
  for (const Piece& piece : pieces) {
    for (uint64_t done = 0; done < piece.bytes && status.ok();) {
      char* into = piece.dst;
      uint64_t bytes = piece.bytes - done;
      if (into == nullptr) {
        scratch.resize(kScratchBytes);
        into = scratch.data();
        bytes = std::min(bytes, kScratchBytes);
      } else {
        into += done;
      }
      status = ReadExactly(fd, piece.offset + done, into, bytes, path);
      crc = Crc32(crc, into, bytes);
      done += bytes;
    }
  }
  char extra;
  if (status.ok() && ::pread(fd, &extra, 1, static_cast<off_t>(record.bytes)) > 0) {
    status = absl::DataLossError(
        absl::StrCat(path, ": longer than the manifest's ", record.bytes, " bytes"));
  }
  ::close(fd);
  if (!status.ok()) return status;
  if (crc != record.crc32) {
    return absl::DataLossError(absl::StrFormat("%s: CRC-32 is %08x, the manifest says %08x",
                                               path, crc, record.crc32));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& dir) {
  std::error_code error;
  std::filesystem::directory_iterator it(dir, error);
  if (error) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, ": ", error.message()));
  }
  std::vector<CheckpointEntry> entries;
  for (const auto& entry : it) {
    auto step = ParseStepDirName(entry.path().filename().string());
    if (step.has_value() && entry.is_directory()) entries.push_back({*step, entry.path().string()});
  }
  std::sort(entries.begin(), entries.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return entries;
}

absl::StatusOr<Manifest> ReadManifest(const std::string& path) {
  const std::string file = path + "/" + kManifestName;
  if (!std::filesystem::is_directory(path)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such checkpoint directory"));
  }
  if (!std::filesystem::exists(file)) {
    return absl::NotFoundError(
        absl::StrCat(path, ": no ", kManifestName, " (a torn or unfinished checkpoint)"));
  }
  auto text = ReadSmallFile(file);
  if (!text.ok()) return text.status();
  return ParseManifest(*text, file);
}

absl::StatusOr<Manifest> VerifyCheckpoint(const std::string& path) {
  auto manifest = ReadManifest(path);
  if (!manifest.ok()) return manifest.status();
  for (const FileRecord& record : manifest->files) {
    const std::string file = path + "/" + record.name;
    uint32_t crc = 0;
    uint64_t bytes = 0;
    if (absl::Status status = FileCrc(file, &crc, &bytes); !status.ok()) return status;
    if (bytes != record.bytes) {
      return absl::DataLossError(absl::StrCat(file, ": ", bytes, " bytes, the manifest says ",
                                              record.bytes));
    }
    if (crc != record.crc32) {
      return absl::DataLossError(absl::StrFormat("%s: CRC-32 is %08x, the manifest says %08x",
                                                 file, crc, record.crc32));
    }
  }
  return manifest;
}

absl::StatusOr<CheckpointEntry> FindLatestValid(const std::string& dir,
                                                std::vector<std::string>* skipped) {
  auto entries = ListCheckpoints(dir);
  if (!entries.ok()) return entries.status();
  for (auto it = entries->rbegin(); it != entries->rend(); ++it) {
    auto verified = VerifyCheckpoint(it->path);
    if (verified.ok()) return *it;
    skipped->push_back(std::string(verified.status().message()));
  }
  return absl::NotFoundError(absl::StrCat("no checkpoint in ", dir, " verifies"));
}

absl::Status LoadFlatRange(const std::string& path, const Manifest& manifest,
                           const std::vector<StateTensor>& tensors, uint64_t first,
                           uint64_t count, float* dst) {
  // Per file: where each of its bytes goes (or nullptr: checksum only).
  std::map<int, std::vector<Piece>> wanted;
  for (const StateTensor& tensor : tensors) {
    const uint64_t lo = std::max(first, tensor.flat_begin);
    const uint64_t hi = std::min(first + count, tensor.flat_begin + tensor.count);
    if (lo >= hi) continue;
    const TensorRecord* record = manifest.Find(tensor.name);
    if (record == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": the checkpoint has no tensor ", tensor.name));
    }
    if (record->shape != tensor.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor ", tensor.name, " has shape [", absl::StrJoin(record->shape, ","),
          "] in the checkpoint, expected [", absl::StrJoin(tensor.shape, ","), "]"));
    }
    // The wanted elements of this tensor are [lo, hi) - flat_begin.
    const uint64_t want_lo = lo - tensor.flat_begin, want_hi = hi - tensor.flat_begin;
    for (const TensorSlice& slice : record->slices) {
      const uint64_t a = std::max(want_lo, slice.start);
      const uint64_t b = std::min(want_hi, slice.start + slice.count);
      if (a >= b) continue;
      char* into = reinterpret_cast<char*>(dst + (tensor.flat_begin + a - first));
      wanted[slice.file].push_back({slice.offset + (a - slice.start) * sizeof(float),
                                    (b - a) * sizeof(float), into});
    }
  }
  for (auto& [file, pieces] : wanted) {
    const FileRecord& record = manifest.files[file];
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& x, const Piece& y) { return x.offset < y.offset; });
    // Fill the gaps with checksum-only pieces so the whole file is read.
    std::vector<Piece> all;
    uint64_t at = 0;
    for (const Piece& piece : pieces) {
      if (piece.offset > at) all.push_back({at, piece.offset - at, nullptr});
      all.push_back(piece);
      at = piece.offset + piece.bytes;
    }
    if (at < record.bytes) all.push_back({at, record.bytes - at, nullptr});
    absl::Status status = ReadFileChecked(path + "/" + record.name, record, all);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace muster::worker
