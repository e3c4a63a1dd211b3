#include "worker/strategy/strategy.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/self_group.h"

namespace muster::worker {

absl::StatusOr<BuiltModel> BuildWholeModel(const BuildSpec& spec,
                                           const std::function<absl::Status(GptModel*)>& agree) {
  BuiltModel built;
  auto model = GptModel::Create(spec.model, spec.micro_batch, spec.device, spec.precision,
                                ParamStorage::kOwned, spec.attention);
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

absl::Status SingleProcess::AfterRun(GptModel* model) { return absl::OkStatus(); }

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
          world_size == 1 ? " rank is" : " ranks are", " not a multiple of ", known,
          "; launch, given this train.yaml as its target, forms only rounds whose world is a "
          "multiple of ",
          known,
          " (--rdzv_conf world_size_multiple otherwise); started another way, choose "
          "the world size"));
    }
    (replicate == 0 ? replicate : shard) = static_cast<int>(world_size / known);
  }
  return parallel::ParallelDims::Create(world_size, replicate, shard, pp);
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

}  // namespace muster::worker
