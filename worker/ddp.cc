#include "worker/ddp.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace muster::worker {
namespace {

std::vector<absl::Span<float>> GradientSegments(GptModel* model) {
  std::vector<absl::Span<float>> segments;
  for (Stage& stage : model->stages()) segments.emplace_back(stage.grads, stage.size);
  return segments;
}

}  // namespace

absl::StatusOr<parallel::ParallelDims> ParallelDimsFor(const ParallelConfig& config,
                                                       int world_size) {
  const bool fsdp = config.strategy == "fsdp";
  int replicate = config.dp_replicate;
  int shard = config.dp_shard;
  const int pp = config.pp;
  if (!fsdp) {
    // LoadConfig refuses this; a config built in code may still say it.
    if (shard > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("parallel.dp_shard: ", shard,
                       " shards each replica, which needs parallel.strategy: fsdp"));
    }
    shard = 1;
  } else if (replicate == 0 && shard == 0) {
    replicate = 1;  // plain FSDP: one replica, sharded over the whole dp world
  }
  if (replicate < 0 || shard < 0 || pp < 1) {
    // Only from code (LoadConfig refuses these): Create names the field,
    // with an auto degree standing in as 1 so that it is not the one named.
    return parallel::ParallelDims::Create(world_size, replicate == 0 ? 1 : replicate,
                                          shard == 0 ? 1 : shard, pp);
  }
  // At most one degree is auto (0) now; it takes the rest of the world.
  if (replicate == 0 || shard == 0) {
    const int64_t known = int64_t{std::max(replicate, 1)} * std::max(shard, 1) * pp;
    if (world_size >= 1 && world_size % known != 0) {
      auto shown = [](int degree) {
        return degree == 0 ? std::string("auto") : absl::StrCat(degree);
      };
      return absl::InvalidArgumentError(absl::StrCat(
          "parallel.dp_replicate (", shown(replicate), ") x parallel.dp_shard (", shown(shard),
          ") x parallel.pp (", pp, ") cannot cover the world: ", world_size,
          world_size == 1 ? " rank is" : " ranks are", " not a multiple of ", known));
    }
    (replicate == 0 ? replicate : shard) = static_cast<int>(world_size / known);
  }
  return parallel::ParallelDims::Create(world_size, replicate, shard, pp);
}

parallel::BucketOptions BucketOptionsFor(const ParallelConfig& config) {
  parallel::BucketOptions options;
  options.bucket_bytes = static_cast<size_t>(config.bucket_mb * (1 << 20));
  if (options.first_bucket_bytes > options.bucket_bytes) {
    options.first_bucket_bytes = options.bucket_bytes;
  }
  return options;
}

absl::StatusOr<parallel::DataBackend> ChooseDataBackend(const std::string& backend, Device device) {
  const bool cuda = device == Device::kCuda;
  if (backend == "auto") return cuda ? parallel::DataBackend::kNccl : parallel::DataBackend::kGloo;
  if (backend == "gloo") {
    return cuda ? parallel::DataBackend::kStagedGloo : parallel::DataBackend::kGloo;
  }
  if (backend == "nccl") {
    if (cuda) return parallel::DataBackend::kNccl;
    return absl::InvalidArgumentError(
        "parallel.backend: nccl needs device cuda; on the CPU gradients are reduced over gloo");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("parallel.backend: expected auto, nccl or gloo, got '", backend, "'"));
}

const char* DataBackendName(parallel::DataBackend backend) {
  switch (backend) {
    case parallel::DataBackend::kGloo:
      return "gloo";
    case parallel::DataBackend::kNccl:
      return "nccl";
    case parallel::DataBackend::kStagedGloo:
      return "gloo (staged through pinned host memory)";
  }
  return "?";
}

Ddp::Ddp(parallel::ProcessGroup* data, parallel::ProcessGroup* control,
         const parallel::BucketOptions& options, std::string backend)
    : data_(data), control_(control), options_(options), backend_(std::move(backend)) {
  // Every rank is a replica: dp_replicate is the world. Cannot fail.
  dims_ = *parallel::ParallelDims::Create(data->size(), data->size(), 1, 1);
}

// The model is destroyed first (the trainer goes before the strategy), and
// ReduceGradients has cleared its hooks after every step: nothing to undo.
Ddp::~Ddp() = default;

std::string Ddp::Describe() const {
  return absl::StrCat("ddp over ", backend_, ", ", data_->size(), " ranks");
}

absl::StatusOr<BuiltModel> Ddp::Build(const BuildSpec& spec) {
  if (model_ != nullptr) return absl::FailedPreconditionError("Ddp::Build called twice");
  // Every rank starts from rank 0's weights; a resumed run then loads the
  // same checkpoint on every rank.
  auto built = BuildWholeModel(spec, [this](GptModel* model) { return SyncParameters(model); });
  if (!built.ok()) return built.status();
  model_ = built->model.get();
  reducer_ = std::make_unique<parallel::GradientReducer>(data_, GradientSegments(model_), options_);
  return built;
}

void Ddp::BeginBackward(GptModel* model, bool last) {
  if (!last) {
    model->SetStageHooks({});
    return;
  }
  reducer_->Arm();
  GptModel::StageHooks hooks;
  hooks.post_backward = [this](int stage) { reducer_->SegmentReady(stage); };
  model->SetStageHooks(std::move(hooks));
}

absl::Status Ddp::ReduceGradients(GptModel* model) {
  if (reducer_ == nullptr || model != model_) {
    return absl::FailedPreconditionError("Ddp::ReduceGradients on a model Build did not make");
  }
  absl::Status status = reducer_->Finish();
  model->SetStageHooks({});
  return status;
}

absl::StatusOr<double> Ddp::GradSumOfSquares(GptModel* model) {
  // The gradients are the same on every rank after ReduceGradients.
  return model->GradSumOfSquares();
}

absl::Status Ddp::OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                                float grad_scale) {
  // Same gradients, same moments, same parameters: the same step on
  // every rank keeps the replicas bitwise equal.
  optimizer->Step(lr, step, grad_scale);
  return absl::OkStatus();
}

void Ddp::ZeroGrad(GptModel* model) { model->ZeroGrad(); }

std::vector<std::vector<FlatRange>> Ddp::CheckpointFiles(uint64_t total) const {
  std::vector<std::vector<FlatRange>> files;
  for (const FlatRange& range : EvenShards(total, data_->size())) files.push_back({range});
  return files;
}

std::vector<FlatRange> Ddp::CheckpointLoad(uint64_t total) const { return {FlatRange{0, total}}; }

absl::Status Ddp::StateLoaded(GptModel* model) {
  // Every rank loaded the whole state into its own buffers.
  return absl::OkStatus();
}

absl::Status Ddp::SyncParameters(GptModel* model) {
  // The stages' parameters, one broadcast per stage, over the data group:
  // device memory on CUDA, host memory on the CPU.
  std::vector<std::shared_ptr<parallel::Work>> works;
  for (Stage& stage : model->stages()) {
    works.push_back(data_->Broadcast(absl::MakeSpan(stage.params, stage.size), 0));
  }
  absl::Status first_error;
  for (auto& work : works) {
    absl::Status status = work->Wait();
    if (!status.ok() && first_error.ok()) first_error = status;
  }
  model->ParamsChanged();  // written behind the model's back
  return first_error;
}

}  // namespace muster::worker
