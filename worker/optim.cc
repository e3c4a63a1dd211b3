#include "worker/optim.h"

#include <cassert>
#include <cmath>

#include "kernels/grad_norm.h"
#include "worker/model_layout.h"
#include "worker/ops.h"

namespace muster::worker {

// m and v mirror the parameters: one allocation each, stages at the same
// offsets as in the parameter allocation.
struct AdamW::Impl {
  GptModel* model;
  OptimConfig config;
  std::vector<size_t> offsets;  // each stage's start in m and v
  // Runs of neighbouring tensors that share the decay setting, in floats
  // from the start of the buffers (the stages' params and grads lie at the
  // same offsets in their allocations as m and v).
  std::vector<Ops::AdamWRun> runs;
  float* m = nullptr;
  float* v = nullptr;
};

AdamW::AdamW(GptModel* model, const OptimConfig& config) : impl_(std::make_unique<Impl>()) {
  impl_->model = model;
  impl_->config = config;
  const size_t floats = layout::StageOffsets(model->stages(), &impl_->offsets);
  // Moments are small next to the activations; failing to allocate them
  // is treated like running out of memory anywhere else in the step.
  absl::StatusOr<void*> m = model->ops().Alloc(floats * sizeof(float));
  absl::StatusOr<void*> v = model->ops().Alloc(floats * sizeof(float));
  assert(m.ok() && v.ok());
  impl_->m = static_cast<float*>(m.value());
  impl_->v = static_cast<float*>(v.value());
  const std::vector<Stage>& stages = model->stages();
  for (size_t s = 0; s < stages.size(); ++s) {
    assert(stages[s].params == stages[0].params + impl_->offsets[s]);
    assert(stages[s].grads == stages[0].grads + impl_->offsets[s]);
    const std::vector<TensorView>& tensors = stages[s].tensors;
    size_t run = 0;
    while (run < tensors.size()) {
      size_t end = run + 1;
      while (end < tensors.size() && tensors[end].decay == tensors[run].decay) ++end;
      Ops::AdamWRun piece;
      piece.begin = impl_->offsets[s] + tensors[run].offset;
      piece.count = tensors[end - 1].offset + tensors[end - 1].size - tensors[run].offset;
      piece.decay = tensors[run].decay;
      impl_->runs.push_back(piece);
      run = end;
    }
  }
}

AdamW::~AdamW() {
  impl_->model->ops().Free(impl_->m);
  impl_->model->ops().Free(impl_->v);
}

void AdamW::Step(float lr, int step, float grad_scale) {
  kernels::AdamWHyper hyper;
  hyper.learning_rate = lr;
  hyper.grad_scale = grad_scale;
  hyper.beta1 = static_cast<float>(impl_->config.beta1);
  hyper.beta2 = static_cast<float>(impl_->config.beta2);
  hyper.eps = static_cast<float>(impl_->config.eps);
  hyper.weight_decay = static_cast<float>(impl_->config.weight_decay);
  // One call for every stage: on CUDA one launch.
  std::vector<Stage>& stages = impl_->model->stages();
  impl_->model->ops().AdamWUpdate(stages[0].params, impl_->m, impl_->v, stages[0].grads,
                                  impl_->model->ParamsBf16(0), impl_->runs, hyper, step);
}

std::vector<float> AdamW::CopyMomentsToHost(bool second) const {
  const std::vector<Stage>& stages = impl_->model->stages();
  const float* moments = second ? impl_->v : impl_->m;
  std::vector<float> host(layout::TotalFloats(stages));
  size_t offset = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    impl_->model->ops().ToHost(host.data() + offset, moments + impl_->offsets[s],
                               stages[s].size * sizeof(float));
    offset += stages[s].size;
  }
  return host;
}

void AdamW::CopyMomentsFromHost(bool second, const std::vector<float>& host) {
  const std::vector<Stage>& stages = impl_->model->stages();
  assert(host.size() == layout::TotalFloats(stages));
  float* moments = second ? impl_->v : impl_->m;
  size_t offset = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    impl_->model->ops().ToDevice(moments + impl_->offsets[s], host.data() + offset,
                                 stages[s].size * sizeof(float));
    offset += stages[s].size;
  }
}

void AdamW::CopyMomentsRangeToHost(bool second, size_t first, size_t count, float* host) const {
  const float* moments = second ? impl_->v : impl_->m;
  layout::ForEachStagePiece(impl_->model->stages(), first, count,
                            [&](size_t s, size_t in_stage, size_t in_range, size_t floats) {
                              impl_->model->ops().ToHost(host + in_range,
                                                         moments + impl_->offsets[s] + in_stage,
                                                         floats * sizeof(float));
                            });
}

float* AdamW::HostMoments(bool second) {
  if (impl_->model->device() != Device::kCpu) return nullptr;
  return second ? impl_->v : impl_->m;  // one allocation, stages in order
}

void AdamW::CopyMomentsRangeFromHost(bool second, size_t first, size_t count, const float* host) {
  float* moments = second ? impl_->v : impl_->m;
  layout::ForEachStagePiece(impl_->model->stages(), first, count,
                            [&](size_t s, size_t in_stage, size_t in_range, size_t floats) {
                              impl_->model->ops().ToDevice(moments + impl_->offsets[s] + in_stage,
                                                           host + in_range, floats * sizeof(float));
                            });
}

float ClipGradNorm(GptModel* model, float max_norm) {
  Ops& ops = model->ops();
  const double norm = std::sqrt(model->GradSumOfSquares());
  if (max_norm > 0.0f) {
    const float scale = kernels::ClipScale(norm, max_norm);
    if (scale != 1.0f) {
      for (Stage& stage : model->stages()) ops.Scale(stage.grads, stage.size, scale);
    }
  }
  return static_cast<float>(norm);
}

float LearningRate(const OptimConfig& config, int step, int total_steps) {
  if (step < config.warmup_steps) {
    return static_cast<float>(config.lr * (step + 1) / config.warmup_steps);
  }
  if (config.schedule == "constant") return static_cast<float>(config.lr);
  const int decay_steps = total_steps - config.warmup_steps;
  if (decay_steps <= 0) return static_cast<float>(config.lr);
  double progress = static_cast<double>(step - config.warmup_steps) / decay_steps;
  progress = std::fmin(1.0, std::fmax(0.0, progress));
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));  // 1 -> 0
  return static_cast<float>(config.min_lr + cosine * (config.lr - config.min_lr));
}

}  // namespace muster::worker
