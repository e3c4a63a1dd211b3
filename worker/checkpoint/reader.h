// Finding, verifying and loading checkpoints (docs/checkpoint-format.md).
//
// Errors: NOT_FOUND for a missing directory or manifest (a torn checkpoint
// has no manifest), DATA_LOSS for a manifest that does not parse or is not
// self-consistent or a data file whose size or CRC-32 differs from the
// manifest's, the Env's code (UNAVAILABLE, PERMISSION_DENIED, ...) for a
// manifest or file that cannot be read. Every message names the file. All I/O goes through `env`.
// Thread-safe: no shared state.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/layout.h"
#include "worker/checkpoint/manifest.h"

namespace muster::worker {

struct CheckpointEntry {
  int step = 0;
  std::string path;  // dir/step_XXXXXXXX
};

// Committed-looking checkpoint directories in `dir` (names step_<8 digits>;
// temporary directories are skipped), oldest first. NOT_FOUND if `dir`
// does not exist; any other failure to list it keeps its code (Env's), so
// that it is not taken for an empty directory.
absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(Env* env, const std::string& dir);

// Reads and parses path/manifest.json, and checks that its tensors are
// its model's (CheckModelTensors).
absl::StatusOr<Manifest> ReadManifest(Env* env, const std::string& path);

// Reads the manifest and every data file in full, checking sizes and CRCs,
// and that a step_N directory's manifest says step N.
absl::StatusOr<Manifest> VerifyCheckpoint(Env* env, const std::string& path);

// The newest checkpoint in `dir` that verifies and that `accept` (when
// set) accepts. Each newer accepted one that does not verify is appended
// to *skipped as "<path>: <why>", and its step to *skipped_steps (when
// set). NOT_FOUND if none does (or `dir` is missing).
absl::StatusOr<CheckpointEntry> FindLatestValid(
    Env* env, const std::string& dir, std::vector<std::string>* skipped,
    const std::function<bool(const Manifest&)>& accept = nullptr,
    std::vector<int>* skipped_steps = nullptr);

// Loads the floats of `ranges` of the flat state `tensors` from the
// checkpoint at `path`: `where(i)` is the address of flat element i,
// called with the first element of each piece, which runs on within its
// tensor and its range (so each range may go to its own memory, and a
// tensor's piece need not follow the previous tensor's). Every data file
// holding any wanted float is opened and read in full exactly once,
// however many ranges touch it, so its CRC-32 is checked on the way.
// `ranges` must be sorted by begin and disjoint (empty ones allowed) and
// lie inside the flat state: INVALID_ARGUMENT naming them otherwise,
// before any file is opened. INVALID_ARGUMENT also if the manifest lacks a
// wanted tensor or has it in another shape.
absl::Status LoadFlatRanges(Env* env, const std::string& path, const Manifest& manifest,
                            const std::vector<StateTensor>& tensors,
                            const std::vector<FlatRange>& ranges,
                            const std::function<float*(uint64_t)>& where);
// The one range [first, first + count), into `dst` (count floats).
absl::Status LoadFlatRange(Env* env, const std::string& path, const Manifest& manifest,
                           const std::vector<StateTensor>& tensors, uint64_t first, uint64_t count,
                           float* dst);
// The one range [first, first + count), to `where` as in LoadFlatRanges.
absl::Status LoadFlatRange(Env* env, const std::string& path, const Manifest& manifest,
                           const std::vector<StateTensor>& tensors, uint64_t first, uint64_t count,
                           const std::function<float*(uint64_t)>& where);

}  // namespace muster::worker
