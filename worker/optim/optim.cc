#include "worker/optim/optim.h"

#include <algorithm>
#include <cassert>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/grad_norm.h"
#include "worker/model/model_layout.h"
#include "worker/model/ops.h"

namespace muster::worker {

// The moments take each group's layout: group g's moments start at
// moment_base[g] and its slice at `at` in the group's arrays is at `at` in
// its moments too. Runs are Ops::AdamWUpdate's, offsets from the group's
// start, so one call per group updates params, grads, the bf16 copy and
// m, v alike. A group over the model's own buffers (WholeModel) spans the
// alignment gaps between stages; its runs skip them.
struct AdamW::Impl {
  GptModel* model;
  OptimConfig config;
  ParamShard shard;
  std::vector<size_t> stage_flat;                // each stage's start in the flat layout
  std::vector<size_t> moment_base;               // per group
  std::vector<std::vector<Ops::AdamWRun>> runs;  // per group
  size_t floats = 0;                             // moments' length
  float* m = nullptr;
  float* v = nullptr;

  ~Impl() {
    model->ops().Free(m);
    model->ops().Free(v);
  }
  // Calls fn(group, at, in_range, n) for the pieces of flat range
  // [first, first + count), which must lie inside the owned slices.
  template <typename Fn>
  void ForEachPiece(size_t first, size_t count, Fn fn) const {
    size_t covered = 0;
    const size_t end = first + count;
    for (size_t g = 0; g < shard.groups.size(); ++g) {
      for (const ParamShard::Slice& slice : shard.groups[g].slices) {
        const size_t flat = stage_flat[slice.stage] + slice.in_stage;
        const size_t lo = std::max(first, flat), hi = std::min(end, flat + slice.count);
        if (lo >= hi) continue;
        fn(g, slice.at + (lo - flat), lo - first, hi - lo);
        covered += hi - lo;
      }
    }
    assert(covered == count);
    (void)covered;
  }
};

ParamShard WholeModel(GptModel* model) {
  std::vector<Stage>& stages = model->stages();
  std::vector<size_t> offsets;
  layout::StageOffsets(stages, &offsets);
  ParamShard shard;
  ParamShard::Group group;
  group.params = stages.empty() ? nullptr : stages[0].params;
  group.grads = stages.empty() ? nullptr : stages[0].grads;
  group.bf16 = model->ParamsBf16(0);
  for (size_t s = 0; s < stages.size(); ++s) {
    // One allocation per buffer, stages at StageOffsets (model_layout.h).
    assert(stages[s].params == stages[0].params + offsets[s]);
    assert(stages[s].grads == stages[0].grads + offsets[s]);
    group.slices.push_back({static_cast<int>(s), 0, stages[s].size, offsets[s]});
  }
  shard.groups.push_back(std::move(group));
  return shard;
}

absl::StatusOr<std::unique_ptr<AdamW>> AdamW::Create(GptModel* model, const OptimConfig& config) {
  return Create(model, config, WholeModel(model));
}

absl::StatusOr<std::unique_ptr<AdamW>> AdamW::Create(GptModel* model, const OptimConfig& config,
                                                     ParamShard shard) {
  const std::vector<Stage>& stages = model->stages();
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->config = config;
  size_t flat = 0;
  for (const Stage& stage : stages) {
    impl->stage_flat.push_back(flat);
    flat += stage.size;
  }
  size_t last_end = 0;  // flat order across groups
  for (const ParamShard::Group& group : shard.groups) {
    size_t extent = 0;
    std::vector<Ops::AdamWRun> runs;
    for (const ParamShard::Slice& slice : group.slices) {
      if (slice.stage < 0 || slice.stage >= static_cast<int>(stages.size()) ||
          slice.in_stage > stages[slice.stage].size ||
          slice.count > stages[slice.stage].size - slice.in_stage) {
        return absl::InvalidArgumentError(
            absl::StrCat("AdamW: slice [", slice.in_stage, ", ", slice.in_stage + slice.count,
                         ") of stage ", slice.stage, " is outside the model's stages"));
      }
      const size_t begin = impl->stage_flat[slice.stage] + slice.in_stage;
      if (begin < last_end) {
        return absl::InvalidArgumentError("AdamW: the shard's slices are not in flat order");
      }
      if (slice.count > 0) last_end = begin + slice.count;
      extent = std::max(extent, slice.at + slice.count);
      // Runs of neighbouring tensors that share the decay setting, clipped
      // to the slice.
      const std::vector<TensorView>& tensors = stages[slice.stage].tensors;
      const size_t slice_end = slice.in_stage + slice.count;
      size_t run = 0;
      while (run < tensors.size()) {
        size_t stop = run + 1;
        while (stop < tensors.size() && tensors[stop].decay == tensors[run].decay) ++stop;
        const size_t lo = std::max(tensors[run].offset, slice.in_stage);
        const size_t hi = std::min(tensors[stop - 1].offset + tensors[stop - 1].size, slice_end);
        if (lo < hi)
          runs.push_back({slice.at + (lo - slice.in_stage), hi - lo, tensors[run].decay});
        run = stop;
      }
    }
    impl->moment_base.push_back(impl->floats);
    impl->runs.push_back(std::move(runs));
    impl->floats += extent;
  }
  impl->shard = std::move(shard);
  absl::StatusOr<void*> m = model->ops().Alloc(impl->floats * sizeof(float));
  if (!m.ok()) return m.status();
  impl->m = static_cast<float*>(*m);
  absl::StatusOr<void*> v = model->ops().Alloc(impl->floats * sizeof(float));
  if (!v.ok()) return v.status();
  impl->v = static_cast<float*>(*v);
  return std::unique_ptr<AdamW>(new AdamW(std::move(impl)));
}

AdamW::AdamW(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdamW::~AdamW() = default;

std::vector<ParamRange> AdamW::owned() const {
  std::vector<ParamRange> ranges;
  for (const ParamShard::Group& group : impl_->shard.groups) {
    for (const ParamShard::Slice& slice : group.slices) {
      if (slice.count == 0) continue;
      const size_t first = impl_->stage_flat[slice.stage] + slice.in_stage;
      if (!ranges.empty() && ranges.back().first + ranges.back().count == first) {
        ranges.back().count += slice.count;
      } else {
        ranges.push_back({first, slice.count});
      }
    }
  }
  return ranges;
}

size_t AdamW::moment_floats() const { return impl_->floats; }

void AdamW::Step(float lr, int step, float grad_scale) {
  // One call per group: on CUDA one launch for the whole model.
  for (size_t g = 0; g < impl_->shard.groups.size(); ++g) StepGroup(g, lr, step, grad_scale);
}

void AdamW::StepGroup(size_t g, float lr, int step, float grad_scale) {
  assert(g < impl_->shard.groups.size());
  kernels::AdamWHyper hyper;
  hyper.learning_rate = lr;
  hyper.grad_scale = grad_scale;
  hyper.beta1 = static_cast<float>(impl_->config.beta1);
  hyper.beta2 = static_cast<float>(impl_->config.beta2);
  hyper.eps = static_cast<float>(impl_->config.eps);
  hyper.weight_decay = static_cast<float>(impl_->config.weight_decay);
  const ParamShard::Group& group = impl_->shard.groups[g];
  const size_t base = impl_->moment_base[g];
  impl_->model->ops().AdamWUpdate(group.params, impl_->m + base, impl_->v + base, group.grads,
                                  group.bf16, impl_->runs[g], hyper, step);
}

size_t AdamW::groups() const { return impl_->shard.groups.size(); }

void AdamW::CopyParamsRangeToHost(size_t first, size_t count, float* host) const {
  impl_->ForEachPiece(first, count, [&](size_t g, size_t at, size_t in_range, size_t floats) {
    impl_->model->ops().ToHost(host + in_range, impl_->shard.groups[g].params + at,
                               floats * sizeof(float));
  });
}

void AdamW::CopyParamsRangeFromHost(size_t first, size_t count, const float* host) {
  impl_->ForEachPiece(first, count, [&](size_t g, size_t at, size_t in_range, size_t floats) {
    impl_->model->ops().ToDevice(impl_->shard.groups[g].params + at, host + in_range,
                                 floats * sizeof(float));
  });
  impl_->model->ParamsChanged();
}

std::vector<float> AdamW::CopyMomentsToHost(bool second) const {
  const std::vector<ParamRange> ranges = owned();
  assert(ranges.size() <= 1);
  if (ranges.empty()) return {};
  std::vector<float> host(ranges[0].count);
  CopyMomentsRangeToHost(second, ranges[0].first, ranges[0].count, host.data());
  return host;
}

void AdamW::CopyMomentsFromHost(bool second, const std::vector<float>& host) {
  const std::vector<ParamRange> ranges = owned();
  assert(ranges.size() <= 1);
  if (ranges.empty()) return;
  assert(host.size() == ranges[0].count);
  CopyMomentsRangeFromHost(second, ranges[0].first, ranges[0].count, host.data());
}

void AdamW::CopyMomentsRangeToHost(bool second, size_t first, size_t count, float* host) const {
  const float* moments = second ? impl_->v : impl_->m;
  impl_->ForEachPiece(first, count, [&](size_t g, size_t at, size_t in_range, size_t floats) {
    impl_->model->ops().ToHost(host + in_range, moments + impl_->moment_base[g] + at,
                               floats * sizeof(float));
  });
}

void AdamW::CopyMomentsRangeFromHost(bool second, size_t first, size_t count, const float* host) {
  float* moments = second ? impl_->v : impl_->m;
  impl_->ForEachPiece(first, count, [&](size_t g, size_t at, size_t in_range, size_t floats) {
    impl_->model->ops().ToDevice(moments + impl_->moment_base[g] + at, host + in_range,
                                 floats * sizeof(float));
  });
}

float* AdamW::HostParams() {
  return HostMoments(false) != nullptr ? impl_->shard.groups[0].params : nullptr;
}

float* AdamW::HostMoments(bool second) {
  if (impl_->model->device() != Device::kCpu || impl_->shard.groups.size() != 1) return nullptr;
  // Every stage whole, each at its flat position: the moments are the
  // flat layout itself.
  const std::vector<ParamShard::Slice>& slices = impl_->shard.groups[0].slices;
  const std::vector<Stage>& stages = impl_->model->stages();
  if (slices.size() != stages.size()) return nullptr;
  for (const ParamShard::Slice& slice : slices) {
    if (slice.in_stage != 0 || slice.count != stages[slice.stage].size ||
        slice.at != impl_->stage_flat[slice.stage]) {
      return nullptr;
    }
  }
  return second ? impl_->v : impl_->m;
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
