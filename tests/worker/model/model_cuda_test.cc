// GptModel on CUDA (the fused engine, worker/model/model_cuda.cc) against the
// CPU model: the same weights and batch give the same loss, gradients and
// trajectory within each precision's bound; a step is bitwise repeatable;
// running out of memory is a clear error. Needs a GPU: tagged manual, run
// on the lent machine (docs/gpu.md).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "worker/model/model.h"
#include "worker/model/ops.h"
#include "worker/optim/optim.h"

namespace muster::worker {
namespace {

// Small, but every width a multiple of 8 as the CUDA engine requires:
// L=2, C=64, NH=2 (hs 32), V=300 (Vp=384), maxT=48; batches use T=40.
ModelConfig SmallConfig() {
  ModelConfig config;
  config.layers = 2;
  config.heads = 2;
  config.dim = 64;
  config.vocab = 300;
  config.seq_len = 48;
  return config;
}

struct Batch {
  int B, T;
  std::vector<int> inputs, targets;
};

Batch RandomBatch(const ModelConfig& config, int B, int T, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> token(0, config.vocab - 1);
  Batch batch{B, T, std::vector<int>(B * T), std::vector<int>(B * T)};
  for (int i = 0; i < B * T; ++i) {
    // Half the inputs from a few ids, so the embedding backward sums
    // repeated tokens.
    batch.inputs[i] = i % 2 ? token(rng) % 7 : token(rng);
    batch.targets[i] = token(rng);
  }
  return batch;
}

std::unique_ptr<GptModel> Make(const ModelConfig& config, int B, Device device, Precision precision,
                               Attention attention = Attention::kMuster) {
  auto model = GptModel::Create(config, B, device, precision, ParamStorage::kOwned, attention);
  INFO(model.status().ToString());
  REQUIRE(model.ok());
  (*model)->InitWeights(4242);
  return *std::move(model);
}

double RelError(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    REQUIRE(std::isfinite(got[i]));
    diff += double(got[i] - want[i]) * (got[i] - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

// Every stage's gradient of `gpu` within relative error `bound` of `cpu`'s.
void CheckGradsClose(const GptModel& cpu, const GptModel& gpu, double bound) {
  const std::vector<float> want = cpu.CopyGradsToHost(), got = gpu.CopyGradsToHost();
  size_t offset = 0;
  for (const Stage& stage : cpu.stages()) {
    std::vector<float> w(want.begin() + offset, want.begin() + offset + stage.size);
    std::vector<float> g(got.begin() + offset, got.begin() + offset + stage.size);
    const double error = RelError(g, w);
    INFO("stage " << stage.name << ": gradient relative error " << error);
    CHECK(error < bound);
    offset += stage.size;
  }
}

struct Bounds {
  Precision precision;
  double loss;   // relative, of the mean loss
  double grads;  // relative, per stage
};
const Bounds kBounds[] = {
    {Precision::kFp32, 1e-5, 1e-4},
    {Precision::kTf32, 2e-3, 1e-2},
    {Precision::kBf16, 1e-2, 5e-2},
};

// One forward and backward of `batch` (scaled by `loss_scale`) on the CPU
// in fp32 and on CUDA in each precision, a section each: the loss and
// every stage's gradient within kBounds; `attention`, what the CUDA model
// must say it runs in that precision.
void CheckMatchesCpu(const ModelConfig& config, const Batch& batch, float loss_scale,
                     const std::function<std::string(Precision)>& attention,
                     Attention kernels = Attention::kMuster) {
  auto cpu = Make(config, batch.B, Device::kCpu, Precision::kFp32);
  const float cpu_loss = cpu->Forward(batch.inputs.data(), batch.targets.data(), batch.B, batch.T);
  cpu->Backward(loss_scale);
  for (const Bounds& bounds : kBounds) {
    SECTION(PrecisionName(bounds.precision)) {
      auto gpu = Make(config, batch.B, Device::kCuda, bounds.precision, kernels);
      const float loss = gpu->Forward(batch.inputs.data(), batch.targets.data(), batch.B, batch.T);
      gpu->Backward(loss_scale);
      REQUIRE(gpu->DeviceStatus().ok());
      CHECK(gpu->DescribeAttention() == attention(bounds.precision));
      INFO("cpu loss " << cpu_loss << ", cuda loss " << loss);
      CHECK(std::fabs(loss - cpu_loss) / cpu_loss < bounds.loss);
      CheckGradsClose(*cpu, *gpu, bounds.grads);
    }
  }
}

TEST_CASE("loss and every stage's gradient match the CPU model", "[cuda]") {
  // Head size 32: the GEMM attention in every precision.
  const ModelConfig config = SmallConfig();
  CheckMatchesCpu(config, RandomBatch(config, 4, 40, 7), 0.5f,
                  [](Precision) { return "muster GEMM"; });
}

// Head size 64: flash attention in bf16 and tf32 (exact fp32 keeps the
// GEMM attention).
ModelConfig FlashConfig() {
  ModelConfig config = SmallConfig();
  config.dim = 128;  // 2 heads of 64
  config.seq_len = 160;
  return config;
}

TEST_CASE("with head size 64 (flash attention), every precision matches the CPU model", "[cuda]") {
  const ModelConfig config = FlashConfig();
  // T = 150: 3 tiles of 64, the last partial.
  CheckMatchesCpu(config, RandomBatch(config, 3, 150, 11), 1.0f, [](Precision precision) {
    return precision == Precision::kFp32 ? "muster GEMM" : "muster flash";
  });
}

TEST_CASE("with attention: gemm at head size 64, every precision runs the GEMM attention",
          "[cuda]") {
  const ModelConfig config = FlashConfig();
  CheckMatchesCpu(
      config, RandomBatch(config, 3, 150, 11), 1.0f, [](Precision) { return "muster GEMM"; },
      Attention::kGemm);
}

TEST_CASE("logits without targets match the CPU model", "[cuda]") {
  const ModelConfig config = SmallConfig();
  const Batch batch = RandomBatch(config, 2, 40, 8);
  auto cpu = Make(config, 2, Device::kCpu, Precision::kFp32);
  cpu->Forward(batch.inputs.data(), nullptr, 2, 40);
  for (const Bounds& bounds : kBounds) {
    SECTION(PrecisionName(bounds.precision)) {
      auto gpu = Make(config, 2, Device::kCuda, bounds.precision);
      gpu->Forward(batch.inputs.data(), nullptr, 2, 40);
      REQUIRE(gpu->DeviceStatus().ok());
      const std::vector<float> want = cpu->Logits(1, 39), got = gpu->Logits(1, 39);
      const double error = RelError(std::vector<float>(got.begin(), got.begin() + config.vocab),
                                    std::vector<float>(want.begin(), want.begin() + config.vocab));
      INFO("logits relative error " << error);
      CHECK(error < bounds.grads);
    }
  }
}

// Steps of forward, backward, clip and AdamW; returns the losses. Batches
// are B=4, T=40, or with `vary_shape` every third one B=2, T=48 (longer:
// cuDNN's attention may need a larger workspace for it).
std::vector<float> Train(GptModel* model, const ModelConfig& config, int steps,
                         bool vary_shape = false) {
  OptimConfig optim;
  optim.lr = 1e-3;
  optim.weight_decay = 0.1;
  auto made = AdamW::Create(model, optim);
  REQUIRE(made.ok());
  AdamW& adamw = **made;
  std::vector<float> losses;
  for (int step = 0; step < steps; ++step) {
    const bool other = vary_shape && step % 3 == 2;
    const Batch batch = RandomBatch(config, other ? 2 : 4, other ? 48 : 40, 100 + step % 3);
    losses.push_back(model->Forward(batch.inputs.data(), batch.targets.data(), batch.B, batch.T));
    model->Backward(1.0f);
    ClipGradNorm(model, 1.0f);
    adamw.Step(1e-3f, step + 1);
    model->ZeroGrad();
  }
  REQUIRE(model->DeviceStatus().ok());
  return losses;
}

TEST_CASE("training follows the CPU model's trajectory", "[cuda]") {
  const ModelConfig config = SmallConfig();
  auto cpu = Make(config, 4, Device::kCpu, Precision::kFp32);
  const std::vector<float> want = Train(cpu.get(), config, 30);
  for (const Bounds& bounds : kBounds) {
    SECTION(PrecisionName(bounds.precision)) {
      auto gpu = Make(config, 4, Device::kCuda, bounds.precision);
      const std::vector<float> got = Train(gpu.get(), config, 30);
      for (size_t i = 0; i < want.size(); ++i) {
        INFO("step " << i << ": cpu " << want[i] << ", cuda " << got[i]);
        CHECK(std::fabs(got[i] - want[i]) / want[i] < 10 * bounds.loss);
      }
      CHECK(got.back() < got.front() - 0.5f);  // it learns
    }
  }
}

// Two models trained for 8 steps from the same weights give the same
// losses and parameters, bit for bit. With `graphs`, the second runs its
// passes as CUDA graphs (EnableCudaGraphs), and both train 12 steps, every
// third at another batch shape: each pass then runs once eagerly and is
// captured and replayed for each shape, 8 + 4 steps, (7 + 3) replays per
// pass.
// With graphs, `streams` is the second model's backward streams
// (SetBackwardStreams): its bits must be the eager, one-stream model's.
void CheckTrainingRepeats(const ModelConfig& config, Precision precision, Attention attention,
                          bool graphs = false, int streams = 2) {
  auto first = Make(config, 4, Device::kCuda, precision, attention);
  auto second = Make(config, 4, Device::kCuda, precision, attention);
  if (graphs) {
    REQUIRE(second->EnableCudaGraphs().ok());
    REQUIRE(second->SetBackwardStreams(streams).ok());
  }
  const int steps = graphs ? 12 : 8;
  const std::vector<float> a = Train(first.get(), config, steps, graphs);
  const std::vector<float> b = Train(second.get(), config, steps, graphs);
  INFO(second->DeviceStatus().ToString());
  REQUIRE(second->DeviceStatus().ok());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i);
    CHECK(a[i] == b[i]);
  }
  CHECK(first->CopyParamsToHost() == second->CopyParamsToHost());
  if (graphs) CHECK(second->graph_replays() == 2 * (7 + 3));
}

// cuDNN's attention (attention: cudnn) in the whole model: head sizes 32
// (the small config) and 64, at a T that is no multiple of 64; then two
// runs of training bitwise equal. Loads libcudnn.so.9 (scripts/gpu_run.sh
// puts it on the library path).
TEST_CASE("with cuDNN's attention, bf16 matches the CPU model and repeats bitwise",
          "[cuda][cudnn]") {
  for (const int dim : {64, 128}) {
    SECTION("head size " + std::to_string(dim / 2)) {
      ModelConfig config = SmallConfig();
      config.dim = dim;
      config.seq_len = 160;
      const Batch batch = RandomBatch(config, 3, 150, 13);
      auto cpu = Make(config, 3, Device::kCpu, Precision::kFp32);
      auto gpu = Make(config, 3, Device::kCuda, Precision::kBf16, Attention::kCudnn);
      const float cpu_loss = cpu->Forward(batch.inputs.data(), batch.targets.data(), 3, 150);
      const float loss = gpu->Forward(batch.inputs.data(), batch.targets.data(), 3, 150);
      cpu->Backward(1.0f);
      gpu->Backward(1.0f);
      INFO(gpu->DeviceStatus().ToString());
      REQUIRE(gpu->DeviceStatus().ok());
      std::printf("model with cuDNN attention: %s\n", gpu->DescribeAttention().c_str());
      INFO("cpu loss " << cpu_loss << ", cuda loss " << loss);
      CHECK(std::fabs(loss - cpu_loss) / cpu_loss < 1e-2);
      CheckGradsClose(*cpu, *gpu, 5e-2);
    }
  }
  SECTION("training twice") {
    CheckTrainingRepeats(SmallConfig(), Precision::kBf16, Attention::kCudnn);
  }
}

TEST_CASE("a training run is bitwise repeatable", "[cuda]") {
  for (const Bounds& bounds : kBounds) {
    SECTION(PrecisionName(bounds.precision)) {
      CheckTrainingRepeats(SmallConfig(), bounds.precision, Attention::kMuster);
    }
    SECTION(std::string(PrecisionName(bounds.precision)) + ", head size 64") {
      CheckTrainingRepeats(FlashConfig(), bounds.precision, Attention::kMuster);
    }
  }
}

TEST_CASE("with CUDA graphs, training gives the eager run's bits", "[cuda][graph]") {
  for (const Bounds& bounds : kBounds) {
    SECTION(PrecisionName(bounds.precision)) {
      CheckTrainingRepeats(SmallConfig(), bounds.precision, Attention::kMuster, true);
    }
    SECTION(std::string(PrecisionName(bounds.precision)) + ", head size 64") {
      CheckTrainingRepeats(FlashConfig(), bounds.precision, Attention::kMuster, true);
    }
  }
}

TEST_CASE("with CUDA graphs and cuDNN's attention, training gives the eager run's bits",
          "[cuda][graph][cudnn]") {
  CheckTrainingRepeats(SmallConfig(), Precision::kBf16, Attention::kCudnn, true);
}

// The default above is 2 backward streams (each block's dW and db beside
// its dx); 1 is the other way to run it.
TEST_CASE("with CUDA graphs on 1 or 2 backward streams, training gives the eager run's bits",
          "[cuda][graph]") {
  for (const int streams : {1, 2}) {
    SECTION(std::to_string(streams) + " streams, bf16, head size 64") {
      CheckTrainingRepeats(FlashConfig(), Precision::kBf16, Attention::kMuster, true, streams);
    }
    SECTION(std::to_string(streams) + " streams, fp32") {
      CheckTrainingRepeats(SmallConfig(), Precision::kFp32, Attention::kMuster, true, streams);
    }
  }
  auto model = Make(SmallConfig(), 2, Device::kCuda, Precision::kBf16);
  for (const int wrong : {0, 3, -1}) {
    INFO(wrong);
    const absl::Status status = model->SetBackwardStreams(wrong);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(status.message(), "1 or 2"));
  }
}

// After ZeroGrad the engine's Backward writes over the stale gradients
// (model.h, ZeroGrad): the gradients must equal those of a model whose
// gradients were cleared first (CopyGradsToHost settles them, so its
// Backward adds into zeros), step after step: with T changing (wpe's rows
// past a shorter T must read zero, not an earlier step's gradient), with
// two micro-steps in a step (the second adds), eager and replayed.
TEST_CASE("gradients written over after ZeroGrad equal gradients added into zeros",
          "[cuda][graph]") {
  const ModelConfig config = SmallConfig();
  // (T, micro-steps) of each step; T = 24 recurs so that its graphs replay.
  const std::pair<int, int> steps[] = {{48, 1}, {40, 1}, {24, 2}, {48, 1}, {24, 1},
                                       {24, 1}, {24, 1}, {40, 2}, {24, 2}};
  for (const Bounds& bounds : kBounds) {
    for (const bool graphs : {false, true}) {
      SECTION(std::string(PrecisionName(bounds.precision)) + (graphs ? ", graphs" : ", eager")) {
        auto over = Make(config, 4, Device::kCuda, bounds.precision);
        auto added = Make(config, 4, Device::kCuda, bounds.precision);
        if (graphs) {
          REQUIRE(over->EnableCudaGraphs().ok());
          REQUIRE(added->EnableCudaGraphs().ok());
        }
        unsigned seed = 300;
        for (size_t step = 0; step < std::size(steps); ++step) {
          const auto [T, micro] = steps[step];
          over->ZeroGrad();
          added->ZeroGrad();
          (void)added->CopyGradsToHost();  // clears them
          for (int m = 0; m < micro; ++m) {
            const Batch batch = RandomBatch(config, 4, T, seed++);
            for (GptModel* model : {over.get(), added.get()}) {
              model->Forward(batch.inputs.data(), batch.targets.data(), batch.B, batch.T);
              model->Backward(1.0f / micro);
            }
          }
          const std::vector<float> want = added->CopyGradsToHost(), got = over->CopyGradsToHost();
          INFO("step " << step << ", T=" << T << ", micro-steps " << micro);
          REQUIRE(got == want);  // as floats: a zero's sign may differ
        }
        REQUIRE(over->DeviceStatus().ok());
        REQUIRE(added->DeviceStatus().ok());
        if (graphs) REQUIRE(over->graph_replays() > 0);
      }
    }
  }
}

// Steps as Train's, with DDP's pattern of hooks: none in the forward, and
// in the backward a post_backward that copies the stage's gradients to the
// host at once (ops().ToHost, ordered by the default stream only, as
// parallel/'s groups order their collectives). Returns every copy.
std::vector<std::vector<float>> TrainSeeingGrads(GptModel* model, const ModelConfig& config,
                                                 int steps) {
  OptimConfig optim;
  optim.lr = 1e-3;
  auto made = AdamW::Create(model, optim);
  REQUIRE(made.ok());
  std::vector<std::vector<float>> seen;
  GptModel::StageHooks hooks;
  hooks.post_backward = [model, &seen](int stage) {
    const Stage& s = model->stages()[stage];
    std::vector<float> grads(s.size);
    model->ops().ToHost(grads.data(), s.grads, s.size * sizeof(float));
    seen.push_back(std::move(grads));
  };
  for (int step = 0; step < steps; ++step) {
    const Batch batch = RandomBatch(config, 4, 40, 200 + step);
    model->Forward(batch.inputs.data(), batch.targets.data(), batch.B, batch.T);
    model->SetStageHooks(hooks);
    model->Backward(1.0f);
    model->SetStageHooks({});
    ClipGradNorm(model, 1.0f);
    (*made)->Step(1e-3f, step + 1);
    model->ZeroGrad();
  }
  REQUIRE(model->DeviceStatus().ok());
  return seen;
}

// With graphs enabled, a pass with a hook set runs on the default stream
// (the forward, hook-free, is still replayed): a hook that reads a stage's
// gradients sees them final, the eager model's bits. On the graphs' own
// stream it read them while they were computed (DDP over 2 ranks lost bits).
TEST_CASE("with CUDA graphs, a stage hook sees its stage's final gradients", "[cuda][graph]") {
  for (const Bounds& bounds : kBounds) {
    SECTION(PrecisionName(bounds.precision)) {
      const ModelConfig config = FlashConfig();
      auto eager = Make(config, 4, Device::kCuda, bounds.precision);
      auto graphed = Make(config, 4, Device::kCuda, bounds.precision);
      REQUIRE(graphed->EnableCudaGraphs().ok());
      const int steps = 5;
      const auto want = TrainSeeingGrads(eager.get(), config, steps);
      const auto got = TrainSeeingGrads(graphed.get(), config, steps);
      REQUIRE(got.size() == want.size());
      REQUIRE(want.size() == static_cast<size_t>(steps) * eager->stages().size());
      for (size_t i = 0; i < want.size(); ++i) {
        INFO("copy " << i << " (step " << i / eager->stages().size() << ")");
        CHECK(got[i] == want[i]);
      }
      CHECK(graphed->graph_replays() == steps - 1);  // the forwards after the first
      CHECK(eager->CopyParamsToHost() == graphed->CopyParamsToHost());
    }
  }
}

TEST_CASE("parameters written from the host reach the bf16 weight copy", "[cuda]") {
  // A checkpoint load after some training: the GEMMs must see the loaded
  // weights, not the stale bf16 copy of the trained ones.
  const ModelConfig config = SmallConfig();
  const Batch batch = RandomBatch(config, 4, 40, 9);
  auto fresh = Make(config, 4, Device::kCuda, Precision::kBf16);
  const float want = fresh->Forward(batch.inputs.data(), batch.targets.data(), 4, 40);
  auto trained = Make(config, 4, Device::kCuda, Precision::kBf16);
  Train(trained.get(), config, 3);
  trained->CopyParamsFromHost(fresh->CopyParamsToHost());
  CHECK(trained->Forward(batch.inputs.data(), batch.targets.data(), 4, 40) == want);
}

TEST_CASE("with external storage (FSDP's), the engine computes the owned model's bits", "[cuda]") {
  // The stages' buffers allocated one by one as a sharding strategy binds
  // them, holding the owned model's weights (and their bf16 copy): the same
  // loss and gradients, bit for bit, and ZeroGrad clears the bound buffers.
  const ModelConfig config = SmallConfig();
  const Batch batch = RandomBatch(config, 4, 40, 31);
  for (const Bounds& bounds : kBounds) {
    SECTION(PrecisionName(bounds.precision)) {
      auto owned = Make(config, 4, Device::kCuda, bounds.precision);
      auto made =
          GptModel::Create(config, 4, Device::kCuda, bounds.precision, ParamStorage::kExternal);
      INFO(made.status().ToString());
      REQUIRE(made.ok());
      GptModel& external = **made;
      Ops& ops = external.ops();
      const std::vector<float> weights = owned->CopyParamsToHost();
      std::vector<void*> buffers;
      size_t flat = 0;
      for (size_t s = 0; s < external.stages().size(); ++s) {
        const size_t size = external.stages()[s].size;
        auto params = ops.AllocTransient(size * sizeof(float));  // as FSDP's gathered ones
        auto grads = ops.Alloc(size * sizeof(float));
        REQUIRE(params.ok());
        REQUIRE(grads.ok());
        ops.ToDevice(*params, weights.data() + flat, size * sizeof(float));
        uint16_t* bf16 = nullptr;
        if (bounds.precision == Precision::kBf16) {
          auto copy = ops.Alloc(size * sizeof(uint16_t));
          REQUIRE(copy.ok());
          bf16 = static_cast<uint16_t*>(*copy);
          ops.CastToBf16(bf16, static_cast<float*>(*params), size);
          buffers.push_back(*copy);
        }
        external.BindStage(static_cast<int>(s), static_cast<float*>(*params),
                           static_cast<float*>(*grads), bf16);
        buffers.push_back(*grads);
        flat += size;
      }
      for (int round = 0; round < 2; ++round) {  // the second after ZeroGrad
        INFO("round " << round);
        owned->ZeroGrad();
        external.ZeroGrad();
        const float want = owned->Forward(batch.inputs.data(), batch.targets.data(), 4, 40);
        const float got = external.Forward(batch.inputs.data(), batch.targets.data(), 4, 40);
        CHECK(got == want);
        owned->Backward(1.0f);
        external.Backward(1.0f);
        CHECK(external.CopyGradsToHost() == owned->CopyGradsToHost());
        const double norm = owned->GradSumOfSquares();
        CHECK(std::fabs(external.GradSumOfSquares() - norm) <= 1e-12 * norm);
      }
      REQUIRE(external.DeviceStatus().ok());
      for (size_t s = 0; s < external.stages().size(); ++s) {
        ops.FreeTransient(external.stages()[s].params);
      }
      for (void* buffer : buffers) ops.Free(buffer);
    }
  }
}

TEST_CASE("a batch that does not fit is RESOURCE_EXHAUSTED naming the bytes", "[cuda]") {
  ModelConfig config = SmallConfig();
  config.seq_len = 4096;
  auto model = GptModel::Create(config, 4096, Device::kCuda, Precision::kBf16);
  REQUIRE(!model.ok());
  INFO(model.status().ToString());
  CHECK(model.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(model.status().message(), "asked for"));
  CHECK(absl::StrContains(model.status().message(), "free"));
  // The failure is not sticky: a model that fits still trains.
  auto small = Make(SmallConfig(), 4, Device::kCuda, Precision::kBf16);
  Train(small.get(), SmallConfig(), 2);
}

TEST_CASE("widths that are not multiples of 8 are refused on CUDA", "[cuda]") {
  ModelConfig config = SmallConfig();
  config.dim = 60;
  config.heads = 2;
  auto model = GptModel::Create(config, 2, Device::kCuda, Precision::kBf16);
  REQUIRE(!model.ok());
  CHECK(model.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(model.status().message(), "model.dim"));
}

}  // namespace
}  // namespace muster::worker
