#include "worker/optim.h"

#include <algorithm>
#include <cassert>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/grad_norm.h"
#include "worker/model/model_layout.h"
#include "worker/model/ops.h"

namespace muster::worker {

// The moments cover the owned range in the parameter ALLOCATION's
// coordinates (stages at aligned offsets, layout::StageOffsets): from the
// allocation offset of the range's first float to that of its last. Runs
// are offsets from that start, so Ops::AdamWUpdate indexes params, grads,
// the bf16 copy (each passed from that start) and m, v alike. Owning
// everything, the start is 0 and this is the whole allocation.
struct AdamW::Impl {
  GptModel* model;
  OptimConfig config;
  ParamRange owned;
  std::vector<size_t> offsets;  // each stage's start in the parameter allocation
  size_t base = 0;              // the allocation offset of owned.first
  size_t floats = 0;            // moments' length
  // Runs of neighbouring tensors that share the decay setting, clipped to
  // the owned range, in floats from `base`.
  std::vector<Ops::AdamWRun> runs;
  float* m = nullptr;
  float* v = nullptr;

  ~Impl() {
    model->ops().Free(m);
    model->ops().Free(v);
  }
  // Calls fn(moment offset, in-range offset, floats) for the pieces of flat
  // range [first, first + count), which must lie inside `owned`.
  template <typename Fn>
  void ForEachPiece(size_t first, size_t count, Fn fn) const {
    assert(first >= owned.first && first + count <= owned.first + owned.count);
    layout::ForEachStagePiece(model->stages(), first, count,
                              [&](size_t s, size_t in_stage, size_t in_range, size_t n) {
                                fn(offsets[s] + in_stage - base, in_range, n);
                              });
  }
};

absl::StatusOr<std::unique_ptr<AdamW>> AdamW::Create(GptModel* model, const OptimConfig& config) {
  return Create(model, config, ParamRange{0, layout::TotalFloats(model->stages())});
}

absl::StatusOr<std::unique_ptr<AdamW>> AdamW::Create(GptModel* model, const OptimConfig& config,
                                                     ParamRange owned) {
  const std::vector<Stage>& stages = model->stages();
  const size_t total = layout::TotalFloats(stages);
  if (owned.first > total || owned.count > total - owned.first) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdamW: parameter range [", owned.first, ", ", owned.first + owned.count,
                     ") is outside the model's ", total, " parameters"));
  }
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->config = config;
  impl->owned = owned;
  layout::StageOffsets(stages, &impl->offsets);
  // The owned range's ends in allocation coordinates.
  size_t begin = 0, end = 0;
  bool any = false;
  layout::ForEachStagePiece(stages, owned.first, owned.count,
                            [&](size_t s, size_t in_stage, size_t, size_t n) {
                              if (!any) begin = impl->offsets[s] + in_stage;
                              end = impl->offsets[s] + in_stage + n;
                              any = true;
                            });
  impl->base = begin;
  impl->floats = end - begin;
  absl::StatusOr<void*> m = model->ops().Alloc(impl->floats * sizeof(float));
  if (!m.ok()) return m.status();
  impl->m = static_cast<float*>(*m);
  absl::StatusOr<void*> v = model->ops().Alloc(impl->floats * sizeof(float));
  if (!v.ok()) return v.status();
  impl->v = static_cast<float*>(*v);

  const size_t owned_end = owned.first + owned.count;
  size_t stage_flat = 0;  // the stage's start in the flat layout
  for (size_t s = 0; s < stages.size(); ++s) {
    assert(stages[s].params == stages[0].params + impl->offsets[s]);
    assert(stages[s].grads == stages[0].grads + impl->offsets[s]);
    const std::vector<TensorView>& tensors = stages[s].tensors;
    size_t run = 0;
    while (run < tensors.size()) {
      size_t stop = run + 1;
      while (stop < tensors.size() && tensors[stop].decay == tensors[run].decay) ++stop;
      // [first, last) of this run in the flat layout, clipped to `owned`.
      const size_t first =
          std::max(stage_flat + tensors[run].offset, static_cast<size_t>(owned.first));
      const size_t last =
          std::min(stage_flat + tensors[stop - 1].offset + tensors[stop - 1].size, owned_end);
      if (first < last) {
        Ops::AdamWRun piece;
        piece.begin = impl->offsets[s] + (first - stage_flat) - impl->base;
        piece.count = last - first;
        piece.decay = tensors[run].decay;
        impl->runs.push_back(piece);
      }
      run = stop;
    }
    stage_flat += stages[s].size;
  }
  return std::unique_ptr<AdamW>(new AdamW(std::move(impl)));
}

AdamW::AdamW(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdamW::~AdamW() = default;

ParamRange AdamW::owned() const { return impl_->owned; }

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
  const size_t base = impl_->base;
  uint16_t* bf16 = impl_->model->ParamsBf16(0);
  impl_->model->ops().AdamWUpdate(stages[0].params + base, impl_->m, impl_->v,
                                  stages[0].grads + base, bf16 != nullptr ? bf16 + base : nullptr,
                                  impl_->runs, hyper, step);
}

std::vector<float> AdamW::CopyMomentsToHost(bool second) const {
  std::vector<float> host(impl_->owned.count);
  CopyMomentsRangeToHost(second, impl_->owned.first, impl_->owned.count, host.data());
  return host;
}

void AdamW::CopyMomentsFromHost(bool second, const std::vector<float>& host) {
  assert(host.size() == impl_->owned.count);
  CopyMomentsRangeFromHost(second, impl_->owned.first, impl_->owned.count, host.data());
}

void AdamW::CopyMomentsRangeToHost(bool second, size_t first, size_t count, float* host) const {
  const float* moments = second ? impl_->v : impl_->m;
  impl_->ForEachPiece(first, count, [&](size_t at, size_t in_range, size_t floats) {
    impl_->model->ops().ToHost(host + in_range, moments + at, floats * sizeof(float));
  });
}

void AdamW::CopyMomentsRangeFromHost(bool second, size_t first, size_t count, const float* host) {
  float* moments = second ? impl_->v : impl_->m;
  impl_->ForEachPiece(first, count, [&](size_t at, size_t in_range, size_t floats) {
    impl_->model->ops().ToDevice(moments + at, host + in_range, floats * sizeof(float));
  });
}

float* AdamW::HostMoments(bool second) {
  if (impl_->model->device() != Device::kCpu) return nullptr;
  if (impl_->owned.first != 0 ||
      impl_->owned.count != layout::TotalFloats(impl_->model->stages())) {
    return nullptr;
  }
  return second ? impl_->v : impl_->m;  // one allocation, stages in order
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
