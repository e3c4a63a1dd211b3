#include "worker/data_parallel.h"

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

absl::StatusOr<parallel::DataBackend> ChooseDataBackend(const std::string& backend,
                                                        Device device) {
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

DdpDataParallel::DdpDataParallel(parallel::ProcessGroup* data, parallel::ProcessGroup* control,
                                 const parallel::BucketOptions& options)
    : group_(data), control_(control), options_(options) {}

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

absl::Status DdpDataParallel::MeanOverRanks(absl::Span<float> values) {
  return control_->AllReduce(values, parallel::ReduceOp::kAvg)->Wait();
}

absl::Status DdpDataParallel::SyncParameters(GptModel* model) {
  // The stages' parameters, one broadcast per stage, over the data group:
  // device memory on CUDA, host memory on the CPU.
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

absl::Status DdpDataParallel::Barrier() { return control_->Barrier()->Wait(); }

}  // namespace muster::worker
