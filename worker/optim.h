// The optimizer side of a step over GptModel's stage buffers: AdamW,
// global-norm gradient clipping and the learning-rate schedule.
//
// Thread-safety: none; the training thread drives them.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/config.h"
#include "worker/model/model.h"

namespace muster::worker {

// A range of the flat parameter layout (GptModel::CopyParamsToHost's:
// stages in order, tensors in order), in floats.
struct ParamRange {
  size_t first = 0;
  size_t count = 0;
};

// AdamW over a range of the model's parameters: every parameter under a
// single process or DDP, the rank's own slice under ZeRO (planned). The
// moments cover only that range; decay per TensorView::decay; bias
// correction with a 1-based step.
// REQUIRES: the model outlives its AdamW (the moments are its device memory).
class AdamW {
 public:
  // AdamW over `owned`. INVALID_ARGUMENT for a range outside the model;
  // RESOURCE_EXHAUSTED (the back end's message) when the moments do not
  // fit in device memory.
  static absl::StatusOr<std::unique_ptr<AdamW>> Create(GptModel* model, const OptimConfig& config,
                                                       ParamRange owned);
  // Over every parameter.
  static absl::StatusOr<std::unique_ptr<AdamW>> Create(GptModel* model, const OptimConfig& config);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  ParamRange owned() const;
  // One update of the owned parameters with learning rate `lr`; `step`
  // counts from 1. Every gradient is multiplied by `grad_scale` as it is
  // read (the clip factor of ClipScale; the gradient buffers are left as
  // they are).
  void Step(float lr, int step, float grad_scale = 1.0f);
  // The owned range's moments as host copies (checkpoints) and back.
  std::vector<float> CopyMomentsToHost(bool second) const;
  void CopyMomentsFromHost(bool second, const std::vector<float>& host);
  // Floats [first, first + count) of the flat layout (GptModel's
  // CopyParamsRangeToHost, for the moments). REQUIRES: inside owned().
  void CopyMomentsRangeToHost(bool second, size_t first, size_t count, float* host) const;
  void CopyMomentsRangeFromHost(bool second, size_t first, size_t count, const float* host);
  // The moments as one host array in CopyParamsToHost's layout, for
  // reading a checkpoint straight into them; nullptr unless the model is
  // on the CPU and every parameter is owned.
  float* HostMoments(bool second);

 private:
  struct Impl;
  explicit AdamW(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Global L2 norm of every gradient buffer (computed in double), and the
// clip: scales all gradients by min(1, max_norm / norm) when max_norm > 0.
// Returns the norm before clipping. (The trainer instead passes the factor
// to AdamW::Step, saving a pass over the gradients.)
float ClipGradNorm(GptModel* model, float max_norm);

// Learning rate at `step` (0-based): linear warmup over warmup_steps, then
// cosine from lr to min_lr at total_steps (or constant).
float LearningRate(const OptimConfig& config, int step, int total_steps);

}  // namespace muster::worker
