// The optimizer side of a step over GptModel's stage buffers: AdamW,
// global-norm gradient clipping and the learning-rate schedule.
//
// Thread-safety: none; the training thread drives them.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/config/config.h"
#include "worker/model/model.h"

namespace muster::worker {

// A range of the flat parameter layout (GptModel::CopyParamsToHost's:
// stages in order, tensors in order), in floats.
struct ParamRange {
  size_t first = 0;
  size_t count = 0;
};

// The parameters an AdamW updates and where they live. A Slice is the run
// [in_stage, in_stage + count) of stage `stage`'s parameters, stored `at`
// floats from the start of its Group's arrays: `params`, `grads` (the same
// layout) and `bf16` (the bf16 copy AdamW refreshes, or nullptr). The
// moments get each group's layout, so one kernel call updates a group.
// Slices are disjoint and in flat order.
//   Single process and DDP: one group, the model's own buffers, every
//   stage whole (WholeModel).
//   FSDP (worker/strategy/fsdp/fsdp.h): one group, the rank's shard arrays, one slice
//   of each stage.
struct ParamShard {
  struct Slice {
    int stage = 0;
    size_t in_stage = 0;
    size_t count = 0;
    size_t at = 0;
  };
  struct Group {
    float* params = nullptr;
    float* grads = nullptr;
    uint16_t* bf16 = nullptr;
    std::vector<Slice> slices;
  };
  std::vector<Group> groups;
};

// Every parameter of `model`, in the model's own buffers.
ParamShard WholeModel(GptModel* model);

// AdamW over the parameters of a ParamShard; decay per TensorView::decay;
// bias correction with a 1-based step. The moments cover only those
// parameters.
// REQUIRES: the model, and the shard's arrays, outlive the AdamW (the
// moments are the model's device memory).
class AdamW {
 public:
  // INVALID_ARGUMENT for a slice outside its stage or slices out of flat
  // order; RESOURCE_EXHAUSTED (the back end's message) when the moments do
  // not fit in device memory.
  static absl::StatusOr<std::unique_ptr<AdamW>> Create(GptModel* model, const OptimConfig& config,
                                                       ParamShard shard);
  // Over every parameter (WholeModel).
  static absl::StatusOr<std::unique_ptr<AdamW>> Create(GptModel* model, const OptimConfig& config);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // The flat ranges of the parameters it updates, merged, in order.
  std::vector<ParamRange> owned() const;
  // Floats of moments per moment (the bytes of m are 4x this).
  size_t moment_floats() const;
  // One update of the owned parameters with learning rate `lr`; `step`
  // counts from 1. Every gradient is multiplied by `grad_scale` as it is
  // read (the clip factor of ClipScale; the gradient buffers are left as
  // they are).
  void Step(float lr, int step, float grad_scale = 1.0f);
  // The same update of group `group` of the ParamShard alone (0 <= group <
  // groups()): a sharding strategy steps its groups one at a time to send
  // each group's new parameters while the next one updates. Calling it
  // once for every group is Step, bit for bit (the update is elementwise).
  void StepGroup(size_t group, float lr, int step, float grad_scale = 1.0f);
  size_t groups() const;
  // Floats [first, first + count) of the flat layout: the owned parameters
  // and the moments, to and from `host` (checkpoints). Writing parameters
  // tells the model (GptModel::ParamsChanged).
  // REQUIRES: the range lies inside owned().
  void CopyParamsRangeToHost(size_t first, size_t count, float* host) const;
  void CopyParamsRangeFromHost(size_t first, size_t count, const float* host);
  void CopyMomentsRangeToHost(bool second, size_t first, size_t count, float* host) const;
  void CopyMomentsRangeFromHost(bool second, size_t first, size_t count, const float* host);
  // The whole owned range's moments (owned() must be one range).
  std::vector<float> CopyMomentsToHost(bool second) const;
  void CopyMomentsFromHost(bool second, const std::vector<float>& host);
  // The owned parameters and the moments as host arrays in
  // CopyParamsToHost's layout, for reading a checkpoint straight into them;
  // nullptr unless the model is on the CPU and every parameter is owned,
  // in one group with no gaps. Writing the parameters there bypasses
  // ParamsChanged (the CPU keeps no other copy).
  float* HostParams();
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
