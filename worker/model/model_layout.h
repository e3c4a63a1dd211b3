// The model's memory layout: where each tensor lives, and the activations
// of the forward pass. Internal to the model library and to the optimizer
// (//worker/optim, which walks the stage buffers with StageOffsets and
// ForEachStagePiece), and to the checkpoint layout, which checks a
// manifest's tensors against PlanStages without allocating a model;
// nothing else should include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "worker/config/config.h"
#include "worker/model/model.h"

namespace muster::worker::layout {

// The stages' tensor views as model.h lists them; params/grads unset.
// Stage::size is the exact sum of its tensors' sizes.
std::vector<Stage> PlanStages(const ModelConfig& config);

// A block stage's tensors, in llm.c's order (also their order in the stage).
enum BlockTensor {
  kLn1w,
  kLn1b,
  kQkvw,
  kQkvb,
  kAttprojw,
  kAttprojb,
  kLn2w,
  kLn2b,
  kFcw,
  kFcb,
  kFcprojw,
  kFcprojb,
  kNumBlockTensors
};
enum EmbeddingTensor { kWte, kWpe };
enum HeadTensor { kLnfw, kLnfb };

// Stage indices: 0 embedding, 1..L blocks, L+1 head.
inline int BlockStage(int layer) { return 1 + layer; }
inline int HeadStage(const ModelConfig& config) { return config.layers + 1; }

// Where each stage's buffer starts in one allocation holding all stages:
// offsets rounded up to kStageAlignFloats so every stage starts on a
// 256-byte boundary. Returns the allocation's size in floats.
constexpr size_t kStageAlignFloats = 64;
size_t StageOffsets(const std::vector<Stage>& stages, std::vector<size_t>* offsets);

// Hands out 256-byte-aligned slices of one allocation: first every
// request is recorded, then Assign() points them into the allocation.
class MemoryPlanner {
 public:
  // `count` elements of T at *slot.
  template <typename T>
  void Request(T** slot, size_t count) {
    RequestBytes(count * sizeof(T), [slot](char* at) { *slot = reinterpret_cast<T*>(at); });
  }
  // `bytes` at *slot (tensors whose element type is chosen at run time).
  void Request(void** slot, size_t bytes) {
    RequestBytes(bytes, [slot](char* at) { *slot = at; });
  }
  size_t total_bytes() const { return total_; }
  void Assign(void* base) {
    for (const auto& [offset, assign] : requests_) assign(static_cast<char*>(base) + offset);
  }

 private:
  static constexpr size_t kAlign = kStageAlignFloats * sizeof(float);
  void RequestBytes(size_t bytes, std::function<void(char*)> assign) {
    requests_.emplace_back(total_, std::move(assign));
    total_ += (bytes + kAlign - 1) / kAlign * kAlign;
  }
  std::vector<std::pair<size_t, std::function<void(char*)>>> requests_;
  size_t total_ = 0;
};

// Sum of every stage's size (what CopyParamsToHost returns).
size_t TotalFloats(const std::vector<Stage>& stages);

// Calls fn(stage_index, offset_in_stage, offset_in_range, floats) for each
// piece of the range [first, first + count) of the stages laid end to end
// (CopyParamsToHost's layout).
template <typename Fn>
void ForEachStagePiece(const std::vector<Stage>& stages, size_t first, size_t count, Fn fn) {
  size_t stage_start = 0;
  const size_t end = first + count;
  for (size_t s = 0; s < stages.size() && stage_start < end; ++s) {
    const size_t stage_end = stage_start + stages[s].size;
    const size_t begin = first > stage_start ? first : stage_start;
    const size_t stop = end < stage_end ? end : stage_end;
    if (begin < stop) fn(s, begin - stage_start, begin - first, stop - begin);
    stage_start = stage_end;
  }
}

// GPT-2's initial parameters in CopyParamsToHost's layout (model.h,
// InitWeights), from a generator of our own so that a seed gives the same
// bits with any compiler and standard library. Each tensor draws from its
// own stream, keyed by (seed, stage, tensor), so no tensor's values depend
// on another's size.
std::vector<float> InitialParams(const ModelConfig& config, const std::vector<Stage>& stages,
                                 uint64_t seed);
// Stage `stage`'s part of it, into `out` (stages[stage].size floats).
void InitialStageParams(const ModelConfig& config, const std::vector<Stage>& stages, int stage,
                        uint64_t seed, float* out);

}  // namespace muster::worker::layout
