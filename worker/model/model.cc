// Device, precision and attention selection, and the host copies every GptModel
// shares (the layout they copy: model_layout.cc).
#include "worker/model/model.h"

#include <cassert>

#include "absl/strings/str_cat.h"
#include "worker/model/model_layout.h"
#include "worker/model/ops.h"

namespace muster::worker {

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
      return absl::InvalidArgumentError(
          absl::StrCat("precision: ", name, " needs device cuda; the CPU computes in fp32 only"));
    }
    return name == "tf32" ? Precision::kTf32 : Precision::kBf16;
  }
  return absl::InvalidArgumentError(absl::StrCat("precision: unknown precision '", name,
                                                 "' (expected auto, fp32, tf32 or bf16)"));
}

const char* DeviceName(Device device) { return device == Device::kCuda ? "cuda" : "cpu"; }

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

absl::StatusOr<Attention> ResolveAttention(const std::string& name, Device device,
                                           Precision precision) {
  if (name == "auto") {
    return device == Device::kCuda && precision == Precision::kBf16 ? Attention::kAuto
                                                                    : Attention::kMuster;
  }
  if (name == "muster") return Attention::kMuster;
  if (name == "gemm") {
    if (device != Device::kCuda) {
      return absl::InvalidArgumentError(
          "attention: gemm needs device cuda; the CPU runs muster's own attention");
    }
    return Attention::kGemm;
  }
  if (name == "cudnn") {
    if (device != Device::kCuda) {
      return absl::InvalidArgumentError(
          "attention: cudnn needs device cuda; the CPU runs muster's own attention");
    }
    if (precision != Precision::kBf16) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention: cudnn needs precision bf16 (or auto, bf16 on CUDA), not ",
                       PrecisionName(precision)));
    }
    return Attention::kCudnn;
  }
  return absl::InvalidArgumentError(absl::StrCat("attention: unknown attention '", name,
                                                 "' (expected auto, muster, gemm or cudnn)"));
}

const char* AttentionName(Attention attention) {
  switch (attention) {
    case Attention::kMuster:
      return "muster";
    case Attention::kCudnn:
      return "cudnn";
    case Attention::kGemm:
      return "gemm";
    case Attention::kAuto:
      return "auto";
  }
  return "?";
}

void GptModel::InitWeights(uint64_t seed) {
  CopyParamsFromHost(layout::InitialParams(config_, stages_, seed));
}

void GptModel::InitStageWeights(int stage, uint64_t seed, float* host) const {
  layout::InitialStageParams(config_, stages_, stage, seed, host);
}

// Engines without parts (the CUDA one) are never made by CreatePart, so
// nobody calls these on them.
float GptModel::PartForward(int, const int*, const int*, const float*, float*, int, int) {
  assert(false && "PartForward on an engine without parts");
  return 0.0f;
}
void GptModel::PartBackwardInput(int, float, const float*, float*) {
  assert(false && "PartBackwardInput on an engine without parts");
}
void GptModel::PartBackwardWeight(int) {
  assert(false && "PartBackwardWeight on an engine without parts");
}
void GptModel::PartBackward(int, float, const float*, float*) {
  assert(false && "PartBackward on an engine without parts");
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
  SettleGrads();
  std::vector<float> host(layout::TotalFloats(stages_));
  size_t offset = 0;
  for (const Stage& stage : stages_) {
    ops_->ToHost(host.data() + offset, stage.grads, stage.size * sizeof(float));
    offset += stage.size;
  }
  return host;
}

void GptModel::CopyParamsRangeToHost(size_t first, size_t count, float* host) const {
  layout::ForEachStagePiece(
      stages_, first, count, [&](size_t s, size_t in_stage, size_t in_range, size_t floats) {
        ops_->ToHost(host + in_range, stages_[s].params + in_stage, floats * sizeof(float));
      });
}

void GptModel::CopyParamsRangeFromHost(size_t first, size_t count, const float* host) {
  layout::ForEachStagePiece(
      stages_, first, count, [&](size_t s, size_t in_stage, size_t in_range, size_t floats) {
        ops_->ToDevice(stages_[s].params + in_stage, host + in_range, floats * sizeof(float));
      });
  ParamsChanged();
}

double GptModel::GradSumOfSquares() {
  SettleGrads();
  double sum_of_squares = 0.0;  // stages in order: deterministic
  for (const Stage& stage : stages_) {
    if (stage.grads != nullptr) sum_of_squares += ops_->SumOfSquares(stage.grads, stage.size);
  }
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
