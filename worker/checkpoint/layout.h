// What a checkpoint of GptModel + AdamW holds, laid flat, and how the
// files of a world of ranks split it (docs/checkpoint-format.md).
//
// The flat state is the parameters, then AdamW's first moments, then its
// second moments, each in GptModel::CopyParamsToHost's layout (stages in
// order, each stage's tensors in order). Under DDP every rank holds all of
// it; rank r of P writes the r-th chunk of parallel::EvenCounts(total, P),
// so writing costs the same on every rank. Any other split (FSDP's shards)
// is described by the same manifest, because the manifest lists slices of
// global tensors, not chunks of a buffer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// Tensor records for files where file i holds `ranges[i]` of the flat state
// contiguously from byte 0.
std::vector<TensorRecord> SliceTensors(const std::vector<StateTensor>& tensors,
                                       const std::vector<FlatRange>& ranges);

}  // namespace muster::worker
