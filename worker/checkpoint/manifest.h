// A checkpoint's manifest (docs/checkpoint-format.md): which global tensors
// a checkpoint holds, which file holds which slice of each, the training
// position, and a checksum per file. The manifest is written last; a
// checkpoint directory without one is torn and never loaded.
//
// Everything here is plain data and pure functions; thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/config/config.h"

namespace muster::worker {

inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr char kManifestName[] = "manifest.json";

// "step_00000012": a committed checkpoint's directory name.
std::string StepDirName(int step);
// The step of a committed checkpoint's directory name; nullopt for any
// other name (temporary directories included).
std::optional<int> ParseStepDirName(std::string_view name);
// ".tmp_step_00000012": where ranks write before the commit renames it.
std::string TempStepDirName(int step);
// "rank_00003.bin": the data file rank 3 writes.
std::string RankFileName(int rank);

// Elements [start, start + count) of a tensor (flattened, row-major) are
// stored in files[file] from byte `offset`, as little-endian values of the
// tensor's dtype.
struct TensorSlice {
  int file = 0;
  uint64_t start = 0;
  uint64_t count = 0;
  uint64_t offset = 0;
};

struct TensorRecord {
  std::string name;            // "params/block0.qkvw", "adamw_m/...", "adamw_v/..."
  std::vector<int64_t> shape;  // global shape
  std::string dtype = "f32";   // the only dtype so far
  std::vector<TensorSlice> slices;
  uint64_t elements() const;
};

struct FileRecord {
  std::string name;  // relative to the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32 = 0;  // zlib's CRC-32 (IEEE 802.3 polynomial) of the whole file
};

struct Manifest {
  int format_version = kCheckpointFormatVersion;
  int step = 0;               // optimizer steps completed
  int optimizer_step = 0;     // AdamW's step count (bias correction)
  uint64_t sample_index = 0;  // global index of the next training sample
  uint64_t data_seed = 0;     // train.seed: fixes the data order (the only RNG)
  // data.train's windows per epoch at save time, which the order depends
  // on too; 0 in manifests written before the field existed.
  uint64_t data_windows = 0;
  // Samples an optimizer step read and a validation pass read at save time
  // (TrainState); 0 in manifests written before the fields existed, and
  // val_samples 0 for a run without validation.
  uint64_t global_batch = 0;
  uint64_t val_samples = 0;
  uint64_t config_hash = 0;  // ModelConfigHash(model)
  ModelConfig model;
  int world_size = 1;            // at save time
  std::string strategy = "ddp";  // at save time
  // The run's history (16 hex digits): kept from a checkpoint resumed with
  // checkpoint.resume "auto", forked from one resumed by path, new for a
  // fresh start. Retention only deletes checkpoints of its own lineage.
  // "" in manifests written before the field existed.
  std::string lineage;
  // The settings of the run that saved it that decide what a step does
  // (worker/trainer/training_settings.h): (field path, value as train.yaml
  // writes it). Empty in manifests written before the field existed.
  std::vector<std::pair<std::string, std::string>> training;
  std::vector<FileRecord> files;
  std::vector<TensorRecord> tensors;

  const TensorRecord* Find(std::string_view tensor_name) const;
};

// A new lineage for a run that starts from nothing (random).
std::string NewLineage();
// The lineage of a run started from `source` by an explicit resume path:
// a function of the source's content only, so every restart of that run
// computes the same one and finds the checkpoints it already wrote.
std::string ForkLineage(const Manifest& source);

// One JSON object; tensors one per line. Its second line is
// "manifest_crc32": zlib's CRC-32 of the text with those 8 hex digits
// read as 0s.
std::string ManifestToJson(const Manifest& manifest);

// Parses and checks a manifest: DATA_LOSS naming `source` and the field if
// it is not JSON, lacks a field, has another format version, does not
// match its manifest_crc32 (when it has one: older manifests do not), or is
// not self-consistent (world_size files, no file or tensor twice, each
// tensor's slices cover it exactly once, each file is its slices end to
// end).
absl::StatusOr<Manifest> ParseManifest(const std::string& json, const std::string& source);

}  // namespace muster::worker
