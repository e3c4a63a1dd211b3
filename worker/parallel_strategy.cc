#include "worker/parallel_strategy.h"

#include <utility>

#include "parallel/self_group.h"

namespace muster::worker {

absl::StatusOr<BuiltModel> BuildWholeModel(const BuildSpec& spec,
                                           const std::function<absl::Status(GptModel*)>& agree) {
  BuiltModel built;
  auto model = GptModel::Create(spec.model, spec.micro_batch, spec.device, spec.precision);
  if (!model.ok()) return model.status();
  built.model = *std::move(model);
  built.model->InitWeights(spec.seed);
  if (agree) {
    if (absl::Status agreed = agree(built.model.get()); !agreed.ok()) return agreed;
  }
  auto optimizer = AdamW::Create(built.model.get(), spec.optim);
  if (!optimizer.ok()) return optimizer.status();
  built.optimizer = *std::move(optimizer);
  return built;
}

SingleProcess::SingleProcess()
    : group_(parallel::CreateSelfGroup()),
      control_(std::make_unique<parallel::Collectives>(group_.get())) {}

SingleProcess::~SingleProcess() = default;

absl::StatusOr<BuiltModel> SingleProcess::Build(const BuildSpec& spec) {
  return BuildWholeModel(spec, nullptr);  // alone: nothing to agree on
}

void SingleProcess::BeginBackward(GptModel* model, bool last) {
  // Nothing to communicate: gradients are final when Backward returns.
  model->SetStageHooks({});
}

absl::Status SingleProcess::ReduceGradients(GptModel* model) { return absl::OkStatus(); }

absl::StatusOr<double> SingleProcess::GradSumOfSquares(GptModel* model) {
  return model->GradSumOfSquares();
}

absl::Status SingleProcess::OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                                          float grad_scale) {
  optimizer->Step(lr, step, grad_scale);
  return absl::OkStatus();
}

void SingleProcess::ZeroGrad(GptModel* model) { model->ZeroGrad(); }

std::vector<std::vector<FlatRange>> SingleProcess::CheckpointFiles(uint64_t total) const {
  return {{FlatRange{0, total}}};
}

std::vector<FlatRange> SingleProcess::CheckpointLoad(uint64_t total) const {
  return {FlatRange{0, total}};
}

absl::Status SingleProcess::StateLoaded(GptModel* model) { return absl::OkStatus(); }

absl::StatusOr<StepLoss> RunMicroSteps(ParallelStrategy* strategy, GptModel* model,
                                       const MicroBatches& batches, bool backward) {
  const size_t tokens = static_cast<size_t>(batches.B) * batches.T;
  std::vector<int> inputs(tokens), targets(tokens);
  StepLoss loss;
  for (int m = 0; m < batches.count; ++m) {
    batches.fill(m, inputs.data(), targets.data());
    loss.sum += model->Forward(inputs.data(), targets.data(), batches.B, batches.T);
    ++loss.count;
    if (!backward) continue;
    strategy->BeginBackward(model, m == batches.count - 1);
    model->Backward(1.0f / batches.count);
  }
  return loss;
}

}  // namespace muster::worker
