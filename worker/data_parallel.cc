#include "worker/data_parallel.h"

#include <vector>

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

DdpDataParallel::DdpDataParallel(parallel::ProcessGroup* group,
                                 const parallel::BucketOptions& options)
    : group_(group), options_(options) {}

void DdpDataParallel::BeginBackward(GptModel* model, bool last) {
  if (!last) {
    model->SetGradReadyCallback(nullptr);
    return;
  }
  if (reducer_ == nullptr) {
    model_ = model;
    reducer_ = std::make_unique<parallel::GradientReducer>(group_, GradientSegments(model),
                                                           options_);
  }
  reducer_->Arm();
  model->SetGradReadyCallback([this](int stage) { reducer_->SegmentReady(stage); });
}

absl::Status DdpDataParallel::ReduceGradients(GptModel* model) {
  if (reducer_ == nullptr || model != model_) {
    return absl::FailedPreconditionError(
        "ReduceGradients without BeginBackward(last=true) on the same model");
  }
  absl::Status status = reducer_->Finish();
  model->SetGradReadyCallback(nullptr);
  return status;
}

absl::StatusOr<float> DdpDataParallel::MeanOverRanks(float value) {
  float data[1] = {value};
  absl::Status status = group_->AllReduce(absl::MakeSpan(data), parallel::ReduceOp::kAvg)->Wait();
  if (!status.ok()) return status;
  return data[0];
}

absl::Status DdpDataParallel::SyncParameters(GptModel* model) {
  // The stages' parameters, one broadcast per stage: on the CPU these are
  // host memory the Gloo group can read directly.
  std::vector<std::shared_ptr<parallel::Work>> works;
  for (Stage& stage : model->stages()) {
    works.push_back(group_->Broadcast(absl::MakeSpan(stage.params, stage.size), 0));
  }
  absl::Status first_error;
  for (auto& work : works) {
    absl::Status status = work->Wait();
    if (!status.ok() && first_error.ok()) first_error = status;
  }
  model->ParamsChanged();  // written behind the model's back
  return first_error;
}

absl::Status DdpDataParallel::Barrier() { return group_->Barrier()->Wait(); }

}  // namespace muster::worker
