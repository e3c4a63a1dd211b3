// The model's memory layout (model_layout.h): the stages of named tensors
// and where each stage starts in one allocation. Their initial values are
// model_layout_init.cc's.
#include "worker/model/model_layout.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muster::worker::layout {
namespace {

// Appends a tensor at the end of the stage.
void AddTensor(Stage* stage, std::string name, std::vector<int> shape, bool decay) {
  TensorView view;
  view.name = std::move(name);
  view.shape = std::move(shape);
  view.offset = stage->size;
  view.size = 1;
  for (int extent : view.shape) view.size *= static_cast<size_t>(extent);
  view.decay = decay;
  stage->size += view.size;
  stage->tensors.push_back(std::move(view));
}

}  // namespace

std::vector<Stage> PlanStages(const ModelConfig& config) {
  const int C = config.dim, Vp = config.padded_vocab(), maxT = config.seq_len;
  std::vector<Stage> stages;

  Stage embedding;
  embedding.name = "embedding";
  AddTensor(&embedding, "wte", {Vp, C}, true);
  AddTensor(&embedding, "wpe", {maxT, C}, false);
  stages.push_back(std::move(embedding));

  for (int layer = 0; layer < config.layers; ++layer) {
    Stage block;
    block.name = absl::StrCat("block", layer);
    AddTensor(&block, "ln1w", {C}, false);
    AddTensor(&block, "ln1b", {C}, false);
    AddTensor(&block, "qkvw", {3 * C, C}, true);
    AddTensor(&block, "qkvb", {3 * C}, false);
    AddTensor(&block, "attprojw", {C, C}, true);
    AddTensor(&block, "attprojb", {C}, false);
    AddTensor(&block, "ln2w", {C}, false);
    AddTensor(&block, "ln2b", {C}, false);
    AddTensor(&block, "fcw", {4 * C, C}, true);
    AddTensor(&block, "fcb", {4 * C}, false);
    AddTensor(&block, "fcprojw", {C, 4 * C}, true);
    AddTensor(&block, "fcprojb", {C}, false);
    stages.push_back(std::move(block));
  }

  Stage head;
  head.name = "head";
  AddTensor(&head, "lnfw", {C}, false);
  AddTensor(&head, "lnfb", {C}, false);
  stages.push_back(std::move(head));
  return stages;
}

size_t StageOffsets(const std::vector<Stage>& stages, std::vector<size_t>* offsets) {
  offsets->clear();
  size_t end = 0;
  for (const Stage& stage : stages) {
    offsets->push_back(end);
    end += (stage.size + kStageAlignFloats - 1) / kStageAlignFloats * kStageAlignFloats;
  }
  return end;
}

size_t TotalFloats(const std::vector<Stage>& stages) {
  size_t total = 0;
  for (const Stage& stage : stages) total += stage.size;
  return total;
}

}  // namespace muster::worker::layout
