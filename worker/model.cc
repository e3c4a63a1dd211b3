// The model's memory layout (stages of named tensors), device selection,
// and the host copies every GptModel shares.
#include "worker/model.h"

#include <cassert>

#include "absl/strings/str_cat.h"
#include "worker/model_layout.h"
#include "worker/ops.h"

namespace muster::worker {
namespace layout {
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

}  // namespace layout

absl::StatusOr<Device> ResolveDevice(const std::string& name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") {
    if (absl::Status available = CudaAvailable(); !available.ok()) return available;
    return Device::kCuda;
  }
  if (name == "auto") return CudaAvailable().ok() ? Device::kCuda : Device::kCpu;
  return absl::InvalidArgumentError(
      absl::StrCat("device: unknown device '", name, "' (expected cpu, cuda or auto)"));
}

absl::StatusOr<Precision> ResolvePrecision(const std::string& name, Device device) {
  if (name == "auto") return device == Device::kCuda ? Precision::kBf16 : Precision::kFp32;
  if (name == "fp32") return Precision::kFp32;
  if (name == "tf32" || name == "bf16") {
    if (device != Device::kCuda) {
      return absl::InvalidArgumentError(absl::StrCat(
          "precision: ", name, " needs device cuda; the CPU computes in fp32 only"));
    }
    return name == "tf32" ? Precision::kTf32 : Precision::kBf16;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "precision: unknown precision '", name, "' (expected auto, fp32, tf32 or bf16)"));
}

const char* PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kTf32:
      return "tf32";
    case Precision::kBf16:
      return "bf16";
  }
  return "?";
}

void GptModel::InitWeights(uint64_t seed) {
  CopyParamsFromHost(layout::InitialParams(config_, stages_, seed));
}

absl::Status GptModel::DeviceStatus() const { return ops_->status(); }

size_t GptModel::num_parameters() const { return layout::TotalFloats(stages_); }

std::vector<float> GptModel::CopyParamsToHost() const {
  std::vector<float> host(layout::TotalFloats(stages_));
  size_t offset = 0;
  for (const Stage& stage : stages_) {
    ops_->ToHost(host.data() + offset, stage.params, stage.size * sizeof(float));
    offset += stage.size;
  }
  return host;
}

void GptModel::CopyParamsFromHost(const std::vector<float>& host) {
  assert(host.size() == layout::TotalFloats(stages_));
  size_t offset = 0;
  for (Stage& stage : stages_) {
    ops_->ToDevice(stage.params, host.data() + offset, stage.size * sizeof(float));
    offset += stage.size;
  }
  ParamsChanged();
}

std::vector<float> GptModel::CopyGradsToHost() const {
  std::vector<float> host(layout::TotalFloats(stages_));
  size_t offset = 0;
  for (const Stage& stage : stages_) {
    ops_->ToHost(host.data() + offset, stage.grads, stage.size * sizeof(float));
    offset += stage.size;
  }
  return host;
}

void GptModel::CopyParamsRangeToHost(size_t first, size_t count, float* host) const {
  layout::ForEachStagePiece(stages_, first, count,
                            [&](size_t s, size_t in_stage, size_t in_range, size_t floats) {
                              ops_->ToHost(host + in_range, stages_[s].params + in_stage,
                                           floats * sizeof(float));
                            });
}

void GptModel::CopyParamsRangeFromHost(size_t first, size_t count, const float* host) {
  layout::ForEachStagePiece(stages_, first, count,
                            [&](size_t s, size_t in_stage, size_t in_range, size_t floats) {
                              ops_->ToDevice(stages_[s].params + in_stage, host + in_range,
                                             floats * sizeof(float));
                            });
  ParamsChanged();
}

double GptModel::GradSumOfSquares() {
  double sum_of_squares = 0.0;  // stages in order: deterministic
  for (const Stage& stage : stages_) sum_of_squares += ops_->SumOfSquares(stage.grads, stage.size);
  return sum_of_squares;
}

double FlopsPerToken(const ModelConfig& config, int T) {
  // llm.c's gpt2_estimate_mfu: 6 FLOPs per parameter per token (forward 2,
  // backward 4), counting wte once as the tied LM head, plus attention's
  // scores and weighted sums, 6 * L * C * T.
  const double C = config.dim, L = config.layers;
  const double parameters = static_cast<double>(config.padded_vocab()) * C +
                            static_cast<double>(config.seq_len) * C +
                            L * (12.0 * C * C + 13.0 * C) + 2.0 * C;
  return 6.0 * parameters + 6.0 * L * C * T;
}

}  // namespace muster::worker
