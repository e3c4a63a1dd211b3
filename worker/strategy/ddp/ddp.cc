#include "worker/strategy/ddp/ddp.h"

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

parallel::BucketOptions BucketOptionsFor(const ParallelConfig& config) {
  parallel::BucketOptions options;
  options.bucket_bytes = static_cast<size_t>(config.bucket_mb * (1 << 20));
  if (options.first_bucket_bytes > options.bucket_bytes) {
    options.first_bucket_bytes = options.bucket_bytes;
  }
  return options;
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
  comm_wait_s_ += absl::ToDoubleSeconds(reducer_->last_exposed_wait());
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
