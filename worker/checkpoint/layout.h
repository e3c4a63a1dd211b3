// What a checkpoint of GptModel + AdamW holds, laid flat, and how the
// files of a world of ranks split it (docs/checkpoint-format.md).
//
// The flat state is the parameters, then AdamW's first moments, then its
// second moments, each in GptModel::CopyParamsToHost's layout (stages in
// order, each stage's tensors in order). A rank's file is one or more
// ranges of it laid end to end (ParallelStrategy::CheckpointFiles). Under
// DDP every rank holds all of it and rank r of P writes one range, the
// r-th chunk of parallel::EvenCounts(total, P) (EvenShards), so writing
// costs the same on every rank. Under FSDP a rank writes the slices it
// owns: its shard of every stage's parameters, m and v, many ranges. The
// manifest describes any split alike, because it lists slices of global
// tensors, not chunks of a buffer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/checkpoint/manifest.h"
#include "worker/model/model.h"

namespace muster::worker {

// One tensor of the flat state.
struct StateTensor {
  std::string name;  // "params/embedding.wte", "adamw_m/block3.fcw", ...
  std::vector<int64_t> shape;
  uint64_t flat_begin = 0;  // floats from the start of the flat state
  uint64_t count = 0;
};

// The flat state of a model with these stages (params, m, v).
std::vector<StateTensor> StateTensors(const std::vector<Stage>& stages);
uint64_t StateFloats(const std::vector<StateTensor>& tensors);

// Whether `manifest`'s tensors are exactly those its `model` implies (the
// parameters, then AdamW's m and v, of GptModel with those dims), each in
// the model's shape, and its config_hash is that model's: DATA_LOSS
// naming the first difference otherwise. Plans the stages; allocates no
// model.
absl::Status CheckModelTensors(const Manifest& manifest);

// A manifest's tensors laid end to end in its order: a flat state to load
// a checkpoint whole without a model (tools).
std::vector<StateTensor> ManifestStateTensors(const Manifest& manifest);

// A contiguous range of the flat state, in floats.
struct FlatRange {
  uint64_t begin = 0;
  uint64_t count = 0;
};

// The DDP split: rank r's range of `total` floats over `world` ranks.
std::vector<FlatRange> EvenShards(uint64_t total, int world);

// Appends `range` (unless empty), merged with the last one when they touch.
void AppendRange(std::vector<FlatRange>* ranges, FlatRange range);

// The flat-state ranges of parameter ranges `params_ranges` (sorted) in
// each of the three parts (params, m, v) of a state of `total` floats:
// what a rank that owns those parameters writes or loads.
std::vector<FlatRange> StateRanges(const std::vector<FlatRange>& params_ranges, uint64_t total);

// Part `index` of `ranges` cut in `parts` even parts: the ranks that hold
// the same state (FSDP's replicas, a pipeline stage's dp ranks) share its
// writing.
std::vector<FlatRange> SplitRanges(const std::vector<FlatRange>& ranges, int parts, int index);

// Tensor records for files where file i holds the ranges `files[i]` of the
// flat state, in that order, end to end from byte 0: a range starts at the
// sum of the counts of the ranges before it in its file (times 4 bytes).
// Each record's slices are sorted by their start in the tensor. Empty
// ranges and empty files are allowed. REQUIRES: the ranges of all files
// together cover each tensor exactly once (ParseManifest refuses anything
// else).
std::vector<TensorRecord> SliceTensors(const std::vector<StateTensor>& tensors,
                                       const std::vector<std::vector<FlatRange>>& files);

}  // namespace muster::worker
