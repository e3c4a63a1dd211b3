#include "worker/checkpoint/reader.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "worker/checkpoint/files.h"

namespace muster::worker {
namespace {

// The same words from verify and from a load, so either names the file's
// real size and the manifest's.
absl::Status SizeMismatch(const std::string& path, uint64_t bytes, const FileRecord& record) {
  return absl::DataLossError(
      absl::StrCat(path, ": ", bytes, " bytes, the manifest says ", record.bytes));
}
absl::Status CrcMismatch(const std::string& path, uint32_t crc, const FileRecord& record) {
  return absl::DataLossError(
      absl::StrFormat("%s: CRC-32 is %08x, the manifest says %08x", path, crc, record.crc32));
}

// Reads `spans` (sorted, covering the file exactly) and checks the CRC.
absl::Status ReadFileChecked(Env* env, const std::string& path, const FileRecord& record,
                             const std::vector<FileSpan>& spans) {
  auto file = env->NewRandomAccessFile(path);
  if (!file.ok()) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open checkpoint data file"));
  }
  // The size first: a read that ran out part-way would name neither the
  // file's size nor the manifest's.
  auto size = (*file)->Size();
  if (!size.ok()) return size.status();
  if (*size != record.bytes) return SizeMismatch(path, *size, record);
  uint32_t crc = 0;
  if (absl::Status status = ReadChecksummed(**file, path, spans, &crc); !status.ok()) {
    return status;
  }
  // The spans cover the file in order (the manifest's slices tile it), so
  // this is the CRC-32 of the whole file, as the manifest's is.
  if (crc != record.crc32) return CrcMismatch(path, crc, record);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(Env* env, const std::string& dir) {
  auto names = env->GetChildren(dir);
  if (!names.ok()) {
    // A directory that is not there holds nothing to resume (NOT_FOUND).
    // One that cannot be listed (not ours to read, NFS's ESTALE, EIO) keeps
    // its own code: taken for an empty one, it would start a resumed job
    // again at step 0 and write a new lineage beside the old one.
    return absl::Status(names.status().code(),
                        absl::StrCat("checkpoint directory ", names.status().message()));
  }
  std::vector<CheckpointEntry> entries;
  for (const std::string& name : *names) {
    auto step = ParseStepDirName(name);
    const std::string path = dir + "/" + name;
    if (step.has_value() && env->IsDirectory(path)) entries.push_back({*step, path});
  }
  std::sort(entries.begin(), entries.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return entries;
}

absl::StatusOr<Manifest> ReadManifest(Env* env, const std::string& path) {
  const std::string file = path + "/" + kManifestName;
  if (!env->IsDirectory(path)) {
    if (env->FileExists(path)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": a file, not a checkpoint (a step_XXXXXXXX directory)"));
    }
    // checkpoint.resume: Auto, NEVER: a word of the field's, miswritten,
    // read as a path.
    const std::string name = std::filesystem::path(path).filename().string();
    for (const char* word : {"auto", "never"}) {
      if (absl::EqualsIgnoreCase(name, word) && name != word) {
        return absl::NotFoundError(absl::StrCat(path,
                                                ": no such checkpoint directory (did you mean `",
                                                word, "`? the words are lower case)"));
      }
    }
    return absl::NotFoundError(absl::StrCat(path, ": no such checkpoint directory"));
  }
  // Opened, not stat'ed first: a directory we may not read (EACCES) must
  // not pass for a torn one, which retention deletes.
  auto text = ReadSmallFile(env, file);
  if (!text.ok() && text.status().code() == absl::StatusCode::kNotFound) {
    // A checkpoint.dir given where one of its step_N is meant (generate
    // --checkpoint, checkpoint.resume): name what it holds.
    auto held = ListCheckpoints(env, path);
    if (held.ok() && !held->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": a directory of checkpoints, not one (no ", kManifestName,
                       "); name one of them, e.g. the newest: ", held->back().path));
    }
    return absl::NotFoundError(
        absl::StrCat(path, ": no ", kManifestName, " (a torn or unfinished checkpoint)"));
  }
  if (!text.ok()) return text.status();
  auto manifest = ParseManifest(*text, file);
  if (!manifest.ok()) return manifest.status();
  if (absl::Status model = CheckModelTensors(*manifest); !model.ok()) {
    return absl::DataLossError(absl::StrCat(file, ": ", model.message()));
  }
  return manifest;
}

absl::StatusOr<Manifest> VerifyCheckpoint(Env* env, const std::string& path) {
  auto manifest = ReadManifest(env, path);
  if (!manifest.ok()) return manifest.status();
  // Resume and retention order checkpoints by their names: one named for
  // another step than it holds would be taken out of turn.
  const std::string name = std::filesystem::path(path).filename().string();
  if (std::optional<int> named = ParseStepDirName(name); named && *named != manifest->step) {
    return absl::DataLossError(absl::StrCat(path, "/", kManifestName, ": step ", manifest->step,
                                            ", but the directory is named for step ", *named));
  }
  for (const FileRecord& record : manifest->files) {
    const std::string file = path + "/" + record.name;
    uint32_t crc = 0;
    uint64_t bytes = 0;
    if (absl::Status status = FileCrc(env, file, &crc, &bytes); !status.ok()) return status;
    if (bytes != record.bytes) return SizeMismatch(file, bytes, record);
    if (crc != record.crc32) return CrcMismatch(file, crc, record);
  }
  return manifest;
}

absl::StatusOr<CheckpointEntry> FindLatestValid(Env* env, const std::string& dir,
                                                std::vector<std::string>* skipped,
                                                const std::function<bool(const Manifest&)>& accept,
                                                std::vector<int>* skipped_steps) {
  auto entries = ListCheckpoints(env, dir);
  if (!entries.ok()) return entries.status();
  for (auto it = entries->rbegin(); it != entries->rend(); ++it) {
    if (accept) {
      auto manifest = ReadManifest(env, it->path);
      if (manifest.ok() && !accept(*manifest)) continue;
    }
    auto verified = VerifyCheckpoint(env, it->path);
    if (verified.ok()) return *it;
    if (skipped != nullptr) skipped->push_back(std::string(verified.status().message()));
    if (skipped_steps != nullptr) skipped_steps->push_back(it->step);
  }
  return absl::NotFoundError(absl::StrCat("no checkpoint in ", dir, " verifies"));
}

absl::Status LoadFlatRange(Env* env, const std::string& path, const Manifest& manifest,
                           const std::vector<StateTensor>& tensors, uint64_t first, uint64_t count,
                           float* dst) {
  return LoadFlatRanges(env, path, manifest, tensors, {FlatRange{first, count}},
                        [dst, first](uint64_t i) { return dst + (i - first); });
}

absl::Status LoadFlatRange(Env* env, const std::string& path, const Manifest& manifest,
                           const std::vector<StateTensor>& tensors, uint64_t first, uint64_t count,
                           const std::function<float*(uint64_t)>& where) {
  return LoadFlatRanges(env, path, manifest, tensors, {FlatRange{first, count}}, where);
}

absl::Status LoadFlatRanges(Env* env, const std::string& path, const Manifest& manifest,
                            const std::vector<StateTensor>& tensors,
                            const std::vector<FlatRange>& ranges,
                            const std::function<float*(uint64_t)>& where) {
  const uint64_t total = StateFloats(tensors);
  for (size_t i = 0; i < ranges.size(); ++i) {
    const FlatRange& range = ranges[i];
    if (range.begin > total || range.count > total - range.begin) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": wanted range [", range.begin, ", ", range.begin + range.count,
                       ") lies past the end of the flat state's ", total, " floats"));
    }
    if (i > 0 && range.begin < ranges[i - 1].begin + ranges[i - 1].count) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": wanted ranges [", ranges[i - 1].begin, ", ",
          ranges[i - 1].begin + ranges[i - 1].count, ") and [", range.begin, ", ",
          range.begin + range.count, ") are out of order or overlap (expected sorted, disjoint)"));
    }
  }
  // Per file: where each wanted run of its bytes goes. One map over every
  // range, so a file is read once however many ranges it serves.
  std::map<int, std::vector<FileSpan>> wanted;
  for (const StateTensor& tensor : tensors) {
    const uint64_t tensor_end = tensor.flat_begin + tensor.count;
    // The first range ending after the tensor begins (ends are sorted too).
    auto range = std::partition_point(ranges.begin(), ranges.end(), [&](const FlatRange& r) {
      return r.begin + r.count <= tensor.flat_begin;
    });
    const TensorRecord* record = nullptr;
    for (; range != ranges.end() && range->begin < tensor_end; ++range) {
      const uint64_t lo = std::max(range->begin, tensor.flat_begin);
      const uint64_t hi = std::min(range->begin + range->count, tensor_end);
      if (lo >= hi) continue;
      if (record == nullptr) {
        record = manifest.Find(tensor.name);
        if (record == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": the checkpoint has no tensor ", tensor.name));
        }
        if (record->shape != tensor.shape) {
          return absl::InvalidArgumentError(absl::StrCat(
              path, ": tensor ", tensor.name, " has shape [", absl::StrJoin(record->shape, ","),
              "] in the checkpoint, expected [", absl::StrJoin(tensor.shape, ","), "]"));
        }
      }
      // The wanted elements of this tensor are [lo, hi) - flat_begin.
      const uint64_t want_lo = lo - tensor.flat_begin, want_hi = hi - tensor.flat_begin;
      for (const TensorSlice& slice : record->slices) {
        const uint64_t a = std::max(want_lo, slice.start);
        const uint64_t b = std::min(want_hi, slice.start + slice.count);
        if (a >= b) continue;
        char* into = reinterpret_cast<char*>(where(tensor.flat_begin + a));
        wanted[slice.file].push_back(
            {slice.offset + (a - slice.start) * sizeof(float), (b - a) * sizeof(float), into});
      }
    }
  }
  for (auto& [file, pieces] : wanted) {
    const FileRecord& record = manifest.files[file];
    std::sort(pieces.begin(), pieces.end(),
              [](const FileSpan& x, const FileSpan& y) { return x.offset < y.offset; });
    // Fill the gaps with checksum-only pieces so the whole file is read.
    std::vector<FileSpan> all;
    uint64_t at = 0;
    for (const FileSpan& piece : pieces) {
      if (piece.offset < at) {  // ParseManifest refuses such a manifest
        return absl::InvalidArgumentError(absl::StrCat(
            path, "/", record.name, ": the manifest's slices overlap at byte ", piece.offset));
      }
      if (piece.offset > at) all.push_back({at, piece.offset - at, nullptr});
      all.push_back(piece);
      at = piece.offset + piece.bytes;
    }
    if (at < record.bytes) all.push_back({at, record.bytes - at, nullptr});
    absl::Status status = ReadFileChecked(env, path + "/" + record.name, record, all);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace muster::worker
