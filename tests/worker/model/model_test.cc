// GptModel on the CPU: gradients against central finite differences,
// determinism, initialisation, the grad-ready callback, llm.c files, the
// optimizer and the schedule.
#include "worker/model/model.h"
#include "worker/model/ops.h"
#include "worker/optim/optim.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ios>
#include <random>
#include <string>
#include <vector>

namespace muster::worker {
namespace {

// A tiny model: L=2, C=16, NH=2, V=11 (Vp=128), maxT=8 (the batches use
// T=5 < maxT, so wpe's last rows must get no gradient).
ModelConfig TinyConfig() {
  ModelConfig config;
  config.layers = 2;
  config.heads = 2;
  config.dim = 16;
  config.vocab = 11;
  config.seq_len = 8;
  return config;
}

// Deterministic pseudo-random numbers for test data (an LCG; the values
// only need to be fixed, not good).
class TestRandom {
 public:
  explicit TestRandom(uint64_t seed) : state_(seed * 6364136223846793005ull + 1) {}
  uint32_t NextU32() {
    state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(state_ >> 33);
  }
  float Uniform(float low, float high) { return low + (high - low) * (NextU32() / 4294967296.0f); }
  int Below(int n) { return static_cast<int>(NextU32() % n); }

 private:
  uint64_t state_;
};

struct Batch {
  int B, T;
  std::vector<int> inputs, targets;
};

Batch RandomBatch(const ModelConfig& config, int B, int T, uint64_t seed) {
  TestRandom random(seed);
  Batch batch{B, T, std::vector<int>(B * T), std::vector<int>(B * T)};
  for (int i = 0; i < B * T; ++i) {
    batch.inputs[i] = random.Below(config.vocab);
    batch.targets[i] = random.Below(config.vocab);
  }
  return batch;
}

std::unique_ptr<GptModel> MakeModel(const ModelConfig& config, int max_batch, uint64_t seed) {
  auto model = GptModel::Create(config, max_batch, Device::kCpu);
  REQUIRE(model.ok());
  (*model)->InitWeights(seed);
  return std::move(*model);
}

float LossAndGrads(GptModel* model, const Batch& batch) {
  model->ZeroGrad();
  const float loss = model->Forward(batch.inputs.data(), batch.targets.data(), batch.B, batch.T);
  model->Backward(1.0f);
  return loss;
}

// Where each tensor starts in CopyParamsToHost's layout.
struct HostTensor {
  std::string stage, name;
  size_t offset, size;
};
std::vector<HostTensor> HostTensors(const GptModel& model) {
  std::vector<HostTensor> tensors;
  size_t stage_start = 0;
  for (const Stage& stage : model.stages()) {
    for (const TensorView& view : stage.tensors) {
      tensors.push_back({stage.name, view.name, stage_start + view.offset, view.size});
    }
    stage_start += stage.size;
  }
  return tensors;
}

TEST_CASE("every parameter's gradient matches central finite differences") {
  const ModelConfig config = TinyConfig();
  auto model = MakeModel(config, 2, 7);
  // Weights well away from GPT-2's small init, so every gradient is large
  // enough to compare in float: noise on everything, gains around 1.
  std::vector<float> params = model->CopyParamsToHost();
  TestRandom random(11);
  const auto tensors = HostTensors(*model);
  for (const HostTensor& tensor : tensors) {
    const bool gain = tensor.name == "ln1w" || tensor.name == "ln2w" || tensor.name == "lnfw";
    size_t count = tensor.size;
    if (tensor.name == "wte") count = static_cast<size_t>(config.vocab) * config.dim;
    for (size_t i = 0; i < count; ++i) {
      params[tensor.offset + i] = (gain ? 1.0f : 0.0f) + random.Uniform(-0.3f, 0.3f);
    }
  }
  model->CopyParamsFromHost(params);
  const Batch batch = RandomBatch(config, 2, 5, 3);
  LossAndGrads(model.get(), batch);
  const std::vector<float> grads = model->CopyGradsToHost();

  // The loss is a float near 2.4 (ulp 2.4e-7), so a step of 1e-2 keeps the
  // rounding noise of a difference near 1e-5, well under the tolerance,
  // while the central difference's truncation error stays O(eps^2).
  const float eps = 1e-2f;
  auto loss_at = [&](size_t index, float value) {
    const float saved = params[index];
    params[index] = value;
    model->CopyParamsFromHost(params);
    params[index] = saved;
    return model->Forward(batch.inputs.data(), batch.targets.data(), batch.B, batch.T);
  };
  constexpr size_t kSamplesPerTensor = 48;
  for (const HostTensor& tensor : tensors) {
    INFO(tensor.stage << "." << tensor.name);
    double diff_sq = 0.0, ref_sq = 0.0;
    for (size_t sample = 0; sample < std::min(kSamplesPerTensor, tensor.size); ++sample) {
      const size_t i =
          tensor.size <= kSamplesPerTensor
              ? sample
              : random.NextU32() % (tensor.name == "wte" ? config.vocab * config.dim : tensor.size);
      const size_t index = tensor.offset + i;
      const double numeric = (static_cast<double>(loss_at(index, params[index] + eps)) -
                              loss_at(index, params[index] - eps)) /
                             (2.0 * eps);
      const double analytic = grads[index];
      INFO("element " << i << ": analytic " << analytic << ", numeric " << numeric);
      CHECK(std::fabs(analytic - numeric) <=
            1e-2 * std::fmax(std::fabs(analytic), std::fabs(numeric)) + 1e-4);
      diff_sq += (analytic - numeric) * (analytic - numeric);
      ref_sq += numeric * numeric;
    }
    CHECK(std::sqrt(diff_sq) <= 1e-2 * std::sqrt(ref_sq) + 1e-4);
  }
}

TEST_CASE("the tied wte's padded rows and wpe's unused rows get no gradient") {
  const ModelConfig config = TinyConfig();
  auto model = MakeModel(config, 2, 5);
  LossAndGrads(model.get(), RandomBatch(config, 2, 5, 9));
  const std::vector<float> grads = model->CopyGradsToHost();
  const auto tensors = HostTensors(*model);
  const HostTensor& wte = tensors[0];
  const HostTensor& wpe = tensors[1];
  REQUIRE(wte.name == "wte");
  const size_t real = static_cast<size_t>(config.vocab) * config.dim;
  double real_norm = 0.0;
  for (size_t i = 0; i < real; ++i) real_norm += std::fabs(grads[wte.offset + i]);
  CHECK(real_norm > 0.0);  // the head gives every real row gradient
  for (size_t i = real; i < wte.size; ++i) REQUIRE(grads[wte.offset + i] == 0.0f);
  for (size_t i = 5 * config.dim; i < wpe.size; ++i) REQUIRE(grads[wpe.offset + i] == 0.0f);

  // Padded rows start at zero and AdamW, even with weight decay, keeps
  // them there.
  OptimConfig optim;
  optim.weight_decay = 0.1;
  auto made = AdamW::Create(model.get(), optim);
  REQUIRE(made.ok());
  AdamW& adamw = **made;
  adamw.Step(1e-2f, 1);
  const std::vector<float> params = model->CopyParamsToHost();
  for (size_t i = real; i < wte.size; ++i) REQUIRE(params[wte.offset + i] == 0.0f);
}

TEST_CASE("two models with one seed compute bitwise-identical losses and gradients") {
  ModelConfig config = TinyConfig();
  config.dim = 32;
  auto first = MakeModel(config, 3, 1234);
  auto second = MakeModel(config, 3, 1234);
  const Batch batch = RandomBatch(config, 3, 8, 4);
  REQUIRE(first->CopyParamsToHost() == second->CopyParamsToHost());
  const float loss1 = LossAndGrads(first.get(), batch);
  const float loss2 = LossAndGrads(second.get(), batch);
  REQUIRE(std::memcmp(&loss1, &loss2, sizeof(float)) == 0);
  REQUIRE(first->CopyGradsToHost() == second->CopyGradsToHost());
  // And again on the same model: buffers are reused without leftovers.
  const float loss3 = LossAndGrads(first.get(), batch);
  REQUIRE(std::memcmp(&loss1, &loss3, sizeof(float)) == 0);
  REQUIRE(first->CopyGradsToHost() == second->CopyGradsToHost());

  auto other_seed = MakeModel(config, 3, 1235);
  REQUIRE(other_seed->CopyParamsToHost() != first->CopyParamsToHost());
}

TEST_CASE("GPT-2 initialisation") {
  ModelConfig config;  // the bench model: L=4, C=256, NH=4, V=256, T=128
  auto model = MakeModel(config, 1, 1337);
  const std::vector<float> params = model->CopyParamsToHost();
  CHECK(model->num_parameters() == params.size());
  CHECK(model->num_parameters() ==
        static_cast<size_t>(256 * 256 + 128 * 256 + 4 * (12 * 256 * 256 + 13 * 256) + 2 * 256));
  // The generator is ours, so these bits hold with any standard library.
  INFO("wte[0..2] = " << std::hexfloat << params[0] << " " << params[1] << " " << params[2]);
  CHECK(params[0] == -0x1.aadd4ap-7f);
  CHECK(params[1] == 0x1.a4e3aap-6f);
  CHECK(params[2] == -0x1.c495d8p-7f);
  for (const HostTensor& tensor : HostTensors(*model)) {
    INFO(tensor.stage << "." << tensor.name);
    double sum = 0.0, sum_sq = 0.0;
    for (size_t i = 0; i < tensor.size; ++i) {
      sum += params[tensor.offset + i];
      sum_sq += static_cast<double>(params[tensor.offset + i]) * params[tensor.offset + i];
    }
    const double mean = sum / tensor.size;
    const double std_dev = std::sqrt(sum_sq / tensor.size - mean * mean);
    const std::string& name = tensor.name;
    if (name == "ln1w" || name == "ln2w" || name == "lnfw") {
      CHECK(mean == 1.0);
      CHECK(std_dev == 0.0);
    } else if (name.back() == 'b') {
      CHECK(sum_sq == 0.0);
    } else {
      const double want = (name == "attprojw" || name == "fcprojw") ? 0.02 / std::sqrt(8.0) : 0.02;
      CHECK(std::fabs(mean) < 0.1 * want);
      CHECK(std_dev == Approx(want).epsilon(0.05));
    }
  }
}

TEST_CASE("the loss at initialisation is about ln(V)") {
  ModelConfig config;
  config.layers = 2;
  config.dim = 64;
  config.vocab = 256;
  config.seq_len = 32;
  auto model = MakeModel(config, 4, 42);
  const Batch batch = RandomBatch(config, 4, 32, 1);
  const float loss = model->Forward(batch.inputs.data(), batch.targets.data(), 4, 32);
  CHECK(loss == Approx(std::log(256.0)).margin(0.05));
  // Without targets: no loss, but logits (Vp,) for generation.
  CHECK(model->Forward(batch.inputs.data(), nullptr, 4, 32) == 0.0f);
  CHECK(model->Logits(3, 31).size() == 256u);
}

TEST_CASE("AdamW overfits one small batch") {
  ModelConfig config = TinyConfig();
  config.dim = 32;
  auto model = MakeModel(config, 2, 3);
  // Two sequences with different first tokens: every prefix determines
  // its target, so the loss can approach zero.
  Batch batch = RandomBatch(config, 2, 8, 8);
  batch.inputs[0] = 1;
  batch.inputs[8] = 2;
  OptimConfig optim;
  optim.lr = 1e-2;
  optim.weight_decay = 0.0;
  auto made = AdamW::Create(model.get(), optim);
  REQUIRE(made.ok());
  AdamW& adamw = **made;
  const float initial = LossAndGrads(model.get(), batch);
  float loss = initial;
  for (int step = 1; step <= 300; ++step) {
    loss = LossAndGrads(model.get(), batch);
    ClipGradNorm(model.get(), 1.0f);
    adamw.Step(static_cast<float>(optim.lr), step);
  }
  loss = model->Forward(batch.inputs.data(), batch.targets.data(), 2, 8);
  INFO("initial loss " << initial << ", final " << loss);
  CHECK(initial > 2.0f);
  CHECK(loss < 0.05f);
  // Moments round-trip through the host.
  const std::vector<float> m = adamw.CopyMomentsToHost(false);
  adamw.CopyMomentsFromHost(false, std::vector<float>(m.size(), 0.0f));
  CHECK(adamw.CopyMomentsToHost(false) == std::vector<float>(m.size(), 0.0f));
  adamw.CopyMomentsFromHost(false, m);
  CHECK(adamw.CopyMomentsToHost(false) == m);
}

TEST_CASE("AdamW stepped one group at a time gives Step's bits") {
  // Two models alike; one AdamW over the whole model, the other with a
  // group per stage (as FSDP builds it) stepped group by group.
  const ModelConfig config = TinyConfig();
  auto whole_model = MakeModel(config, 2, 5);
  auto split_model = MakeModel(config, 2, 5);
  OptimConfig optim;
  optim.weight_decay = 0.1;  // some runs decay, some do not
  auto whole = AdamW::Create(whole_model.get(), optim);
  REQUIRE(whole.ok());
  ParamShard shard = WholeModel(split_model.get());
  ParamShard per_stage;
  for (const ParamShard::Slice& slice : shard.groups[0].slices) {
    ParamShard::Group group;
    group.params = shard.groups[0].params + slice.at;
    group.grads = shard.groups[0].grads + slice.at;
    group.slices.push_back({slice.stage, slice.in_stage, slice.count, 0});
    per_stage.groups.push_back(std::move(group));
  }
  auto split = AdamW::Create(split_model.get(), optim, std::move(per_stage));
  REQUIRE(split.ok());
  REQUIRE((*split)->groups() == split_model->stages().size());
  for (int step = 1; step <= 3; ++step) {
    const Batch batch = RandomBatch(config, 2, 5, 20 + step);
    LossAndGrads(whole_model.get(), batch);
    LossAndGrads(split_model.get(), batch);
    (*whole)->Step(1e-2f, step, 0.5f);
    // Backwards, to show the order does not matter.
    for (size_t g = (*split)->groups(); g-- > 0;) (*split)->StepGroup(g, 1e-2f, step, 0.5f);
    CHECK(split_model->CopyParamsToHost() == whole_model->CopyParamsToHost());
  }
  CHECK((*split)->CopyMomentsToHost(true) == (*whole)->CopyMomentsToHost(true));
}

TEST_CASE("each stage's gradients are final when its post_backward hook runs") {
  const ModelConfig config = TinyConfig();
  auto model = MakeModel(config, 2, 21);
  std::vector<int> order;
  std::vector<std::vector<float>> at_callback(model->stages().size());
  GptModel::StageHooks hooks;
  hooks.post_backward = [&](int stage_index) {
    order.push_back(stage_index);
    const Stage& stage = model->stages()[stage_index];
    // The CPU's device memory is host memory.
    at_callback[stage_index].assign(stage.grads, stage.grads + stage.size);
  };
  model->SetStageHooks(hooks);
  LossAndGrads(model.get(), RandomBatch(config, 2, 5, 13));
  // head (L+1), blocks L-1..0 (stages L..1), embedding (0) last.
  CHECK(order == std::vector<int>{3, 2, 1, 0});
  const std::vector<float> final_grads = model->CopyGradsToHost();
  size_t offset = 0;
  for (size_t s = 0; s < model->stages().size(); ++s) {
    const size_t size = model->stages()[s].size;
    INFO("stage " << model->stages()[s].name);
    CHECK(at_callback[s] ==
          std::vector<float>(final_grads.begin() + offset, final_grads.begin() + offset + size));
    offset += size;
  }
}

TEST_CASE("stage hooks fire in order: forward up the stages, backward down") {
  const ModelConfig config = TinyConfig();  // 2 layers: stages 0..3
  auto model = MakeModel(config, 2, 3);
  std::vector<std::string> events;
  GptModel::StageHooks hooks;
  hooks.pre_forward = [&](int s) { events.push_back("pre_forward " + std::to_string(s)); };
  hooks.post_forward = [&](int s) { events.push_back("post_forward " + std::to_string(s)); };
  hooks.pre_backward = [&](int s) { events.push_back("pre_backward " + std::to_string(s)); };
  hooks.post_backward = [&](int s) { events.push_back("post_backward " + std::to_string(s)); };
  model->SetStageHooks(hooks);
  LossAndGrads(model.get(), RandomBatch(config, 2, 5, 4));
  CHECK(events == std::vector<std::string>{
                      "pre_forward 0", "post_forward 0", "pre_forward 1", "post_forward 1",
                      "pre_forward 2", "post_forward 2", "pre_forward 3", "post_forward 3",
                      "pre_backward 3", "post_backward 3", "pre_backward 2", "post_backward 2",
                      "pre_backward 1", "post_backward 1", "pre_backward 0", "post_backward 0"});
  // Cleared hooks fire nothing.
  events.clear();
  model->SetStageHooks({});
  LossAndGrads(model.get(), RandomBatch(config, 2, 5, 4));
  CHECK(events.empty());
}

TEST_CASE("a stage's parameters are read only between its pre and post hooks") {
  // What FSDP will rely on: a model whose stage parameters are written in
  // at pre_forward / pre_backward and poisoned at post_forward /
  // post_backward computes exactly what a model holding them throughout
  // computes. Stage 0's wte is read by the head too (tied), so it stays.
  const ModelConfig config = TinyConfig();
  auto holder = MakeModel(config, 2, 8);
  auto sharded = MakeModel(config, 2, 9);  // other weights, replaced stage by stage
  const Batch batch = RandomBatch(config, 2, 5, 10);
  auto fill = [&](int s) {
    const Stage& from = holder->stages()[s];
    std::copy(from.params, from.params + from.size, sharded->stages()[s].params);
  };
  auto poison = [&](int s) {
    if (s == 0) return;
    Stage& stage = sharded->stages()[s];
    std::fill(stage.params, stage.params + stage.size, std::nanf(""));
  };
  GptModel::StageHooks hooks;
  hooks.pre_forward = fill;
  hooks.post_forward = poison;
  hooks.pre_backward = fill;
  hooks.post_backward = poison;
  sharded->SetStageHooks(hooks);
  const float expected = LossAndGrads(holder.get(), batch);
  const float loss = LossAndGrads(sharded.get(), batch);
  CHECK(loss == expected);
  CHECK(sharded->CopyGradsToHost() == holder->CopyGradsToHost());
}

TEST_CASE("Backward scales by loss_scale and accumulates across micro-steps") {
  const ModelConfig config = TinyConfig();
  auto model = MakeModel(config, 2, 2);
  const Batch batch = RandomBatch(config, 2, 5, 6);
  LossAndGrads(model.get(), batch);
  const std::vector<float> full = model->CopyGradsToHost();
  model->ZeroGrad();
  for (int micro = 0; micro < 2; ++micro) {
    model->Forward(batch.inputs.data(), batch.targets.data(), 2, 5);
    model->Backward(0.5f);
  }
  const std::vector<float> accumulated = model->CopyGradsToHost();
  for (size_t i = 0; i < full.size(); ++i) {
    REQUIRE(accumulated[i] == Approx(full[i]).margin(1e-7f));
  }
}

TEST_CASE("ClipGradNorm returns the global norm and scales down to max_norm") {
  const ModelConfig config = TinyConfig();
  auto model = MakeModel(config, 2, 2);
  LossAndGrads(model.get(), RandomBatch(config, 2, 5, 6));
  double sum_sq = 0.0;
  for (float g : model->CopyGradsToHost()) sum_sq += static_cast<double>(g) * g;
  const float norm = ClipGradNorm(model.get(), 0.0f);  // 0: measure only
  CHECK(norm == Approx(std::sqrt(sum_sq)).epsilon(1e-6));
  CHECK(ClipGradNorm(model.get(), 10.0f * norm) == norm);  // within: untouched
  CHECK(ClipGradNorm(model.get(), 0.5f * norm) == norm);
  CHECK(ClipGradNorm(model.get(), 0.0f) == Approx(0.5f * norm).epsilon(1e-5));
}

TEST_CASE("SaveLlmc writes llm.c's layout and LoadLlmc reads it back") {
  const ModelConfig config = TinyConfig();
  auto saved = MakeModel(config, 1, 100);
  const std::string dir = std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp";
  const std::string path = dir + "/model_roundtrip.bin";
  REQUIRE(saved->SaveLlmc(path).ok());

  // Header and order: tensor-major across layers.
  std::FILE* file = std::fopen(path.c_str(), "rb");
  REQUIRE(file != nullptr);
  std::vector<char> bytes;
  char chunk[4096];
  for (size_t got; (got = std::fread(chunk, 1, sizeof(chunk), file)) > 0;)
    bytes.insert(bytes.end(), chunk, chunk + got);
  std::fclose(file);
  REQUIRE(bytes.size() == 1024 + 4 * saved->num_parameters());
  const int* header = reinterpret_cast<const int*>(bytes.data());
  CHECK(std::vector<int>(header, header + 8) ==
        std::vector<int>{20240326, 3, 8, 11, 2, 2, 16, 128});
  const float* file_params = reinterpret_cast<const float*>(bytes.data() + 1024);
  const std::vector<float> params = saved->CopyParamsToHost();
  const int C = config.dim, Vp = 128, maxT = 8;
  // ln1w of layer 1 follows ln1w of layer 0 in the file.
  const size_t ln1w_file = static_cast<size_t>(Vp) * C + maxT * C;
  const size_t block1_host = static_cast<size_t>(Vp) * C + maxT * C + saved->stages()[1].size;
  CHECK(file_params[0] == params[0]);
  CHECK(std::memcmp(file_params + ln1w_file + C, params.data() + block1_host, C * sizeof(float)) ==
        0);
  // qkvw of layer 1: after wte, wpe, ln1w[2], ln1b[2], qkvw[0].
  const size_t qkvw1_file = ln1w_file + 4 * C + 3 * C * C;
  CHECK(std::memcmp(file_params + qkvw1_file, params.data() + block1_host + 2 * C,
                    3 * C * C * sizeof(float)) == 0);

  auto loaded = MakeModel(config, 1, 200);
  REQUIRE(loaded->CopyParamsToHost() != params);
  REQUIRE(loaded->LoadLlmc(path).ok());
  CHECK(loaded->CopyParamsToHost() == params);

  ModelConfig wider = config;
  wider.dim = 32;
  auto mismatched = MakeModel(wider, 1, 1);
  const absl::Status status = mismatched->LoadLlmc(path);
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(status.message()), Catch::Contains("channels (dim) is 16"));
  CHECK(loaded->LoadLlmc(dir + "/no_such_model.bin").code() == absl::StatusCode::kNotFound);

  const std::string truncated = dir + "/model_truncated.bin";
  file = std::fopen(truncated.c_str(), "wb");
  std::fwrite(bytes.data(), 1, bytes.size() - 4, file);
  std::fclose(file);
  CHECK(loaded->LoadLlmc(truncated).code() == absl::StatusCode::kDataLoss);
}

TEST_CASE("LearningRate warms up linearly, then follows a cosine to min_lr") {
  OptimConfig optim;
  optim.lr = 1e-3;
  optim.min_lr = 1e-4;
  optim.warmup_steps = 10;
  CHECK(LearningRate(optim, 0, 110) == Approx(1e-4));
  CHECK(LearningRate(optim, 4, 110) == Approx(5e-4));
  CHECK(LearningRate(optim, 9, 110) == Approx(1e-3));
  CHECK(LearningRate(optim, 10, 110) == Approx(1e-3));
  CHECK(LearningRate(optim, 60, 110) == Approx(5.5e-4));
  CHECK(LearningRate(optim, 110, 110) == Approx(1e-4));
  CHECK(LearningRate(optim, 500, 110) == Approx(1e-4));
  for (int step = 10; step < 110; ++step) {
    REQUIRE(LearningRate(optim, step + 1, 110) <= LearningRate(optim, step, 110));
  }
  optim.schedule = "constant";
  CHECK(LearningRate(optim, 5, 110) == Approx(6e-4));
  CHECK(LearningRate(optim, 100, 110) == Approx(1e-3));
}

TEST_CASE("devices and the FLOPs estimate") {
  CHECK(ResolveDevice("cpu").value() == Device::kCpu);
  CHECK(ResolveDevice("gpu").status().code() == absl::StatusCode::kInvalidArgument);
  if (ResolveDevice("cuda").ok()) {
    WARN("a GPU is present: the no-GPU checks are skipped");
  } else {
    CHECK(ResolveDevice("cuda").status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(ResolveDevice("auto").value() == Device::kCpu);
    CHECK(GptModel::Create(TinyConfig(), 1, Device::kCuda).status().code() ==
          absl::StatusCode::kFailedPrecondition);
  }

  ModelConfig config;
  auto model = MakeModel(config, 1, 1);
  CHECK(FlopsPerToken(config, 128) == Approx(6.0 * model->num_parameters() + 6.0 * 4 * 256 * 128));
}

TEST_CASE(
    "attention: muster is muster's kernels, auto cuDNN's or muster's on CUDA in bf16 and muster's "
    "elsewhere; gemm needs cuda; cudnn cuda and bf16") {
  for (const char* name : {"auto", "muster"}) {
    INFO(name);
    for (Device device : {Device::kCpu, Device::kCuda}) {
      for (Precision precision : {Precision::kFp32, Precision::kTf32, Precision::kBf16}) {
        const bool choice =
            std::string(name) == "auto" && device == Device::kCuda && precision == Precision::kBf16;
        CHECK(ResolveAttention(name, device, precision).value() ==
              (choice ? Attention::kAuto : Attention::kMuster));
      }
    }
  }
  CHECK(std::string(AttentionName(Attention::kAuto)) == "auto");
  CHECK(ResolveAttention("cudnn", Device::kCuda, Precision::kBf16).value() == Attention::kCudnn);
  for (Precision precision : {Precision::kFp32, Precision::kTf32, Precision::kBf16}) {
    CHECK(ResolveAttention("gemm", Device::kCuda, precision).value() == Attention::kGemm);
  }
  CHECK(std::string(AttentionName(Attention::kMuster)) == "muster");
  CHECK(std::string(AttentionName(Attention::kCudnn)) == "cudnn");
  CHECK(std::string(AttentionName(Attention::kGemm)) == "gemm");

  struct Case {
    std::string name;
    Device device;
    Precision precision;
    std::string message;
  };
  const Case cases[] = {
      {"cudnn", Device::kCpu, Precision::kFp32,
       "attention: cudnn needs device cuda; the CPU runs muster's own attention"},
      {"cudnn", Device::kCuda, Precision::kFp32,
       "attention: cudnn needs precision bf16 (or auto, bf16 on CUDA), not fp32"},
      {"cudnn", Device::kCuda, Precision::kTf32,
       "attention: cudnn needs precision bf16 (or auto, bf16 on CUDA), not tf32"},
      {"gemm", Device::kCpu, Precision::kFp32,
       "attention: gemm needs device cuda; the CPU runs muster's own attention"},
      {"flash", Device::kCuda, Precision::kBf16,
       "attention: unknown attention 'flash' (expected auto, muster, gemm or cudnn)"},
  };
  for (const Case& c : cases) {
    INFO(c.name << " " << PrecisionName(c.precision));
    absl::StatusOr<Attention> resolved = ResolveAttention(c.name, c.device, c.precision);
    REQUIRE_FALSE(resolved.ok());
    CHECK(resolved.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(resolved.status().message() == c.message);
  }

  // GptModel::Create checks the same before it looks for a GPU, so these
  // hold in every build, with or without one.
  auto on_cpu = GptModel::Create(TinyConfig(), 1, Device::kCpu, Precision::kFp32,
                                 ParamStorage::kOwned, Attention::kCudnn);
  CHECK(on_cpu.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(on_cpu.status().message()),
             Catch::StartsWith("attention: cudnn needs device cuda"));
  auto in_fp32 = GptModel::Create(TinyConfig(), 1, Device::kCuda, Precision::kFp32,
                                  ParamStorage::kOwned, Attention::kCudnn);
  CHECK(in_fp32.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(in_fp32.status().message()),
             Catch::StartsWith("attention: cudnn needs precision bf16"));
  auto gemm_on_cpu = GptModel::Create(TinyConfig(), 1, Device::kCpu, Precision::kFp32,
                                      ParamStorage::kOwned, Attention::kGemm);
  CHECK(gemm_on_cpu.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(gemm_on_cpu.status().message()),
             Catch::StartsWith("attention: gemm needs device cuda"));

  // The default is muster's, and the CPU model says so.
  auto model = GptModel::Create(TinyConfig(), 1, Device::kCpu);
  REQUIRE(model.ok());
  CHECK((*model)->attention() == Attention::kMuster);
  CHECK((*model)->DescribeAttention() == "muster");
  // CUDA graphs are the CUDA model's.
  CHECK((*model)->EnableCudaGraphs().code() == absl::StatusCode::kUnimplemented);
  CHECK((*model)->graph_replays() == 0);
  CHECK((*model)->SetBackwardStreams(1).code() == absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace muster::worker

namespace muster::worker {
namespace {

// Pipeline parts (ModelPart): the model cut into 3 parts, micro-batches in
// slots run GPipe-style (every forward, then every backward), give the
// whole model's losses and gradients: bit for bit for the blocks, and for
// wte the sum of its two shares (the last part's head, the first part's
// encoder), which add in another order.
TEST_CASE("model parts chained over slots match the whole model") {
  ModelConfig config = TinyConfig();
  config.layers = 4;
  const int B = 2, T = 5, M = 3;
  std::unique_ptr<GptModel> whole = MakeModel(config, B, 5);
  const std::vector<float> weights = whole->CopyParamsToHost();
  std::vector<Batch> batches;
  for (int m = 0; m < M; ++m) batches.push_back(RandomBatch(config, B, T, 100 + m));

  std::vector<float> whole_losses;
  whole->ZeroGrad();
  for (const Batch& batch : batches) {
    whole_losses.push_back(
        whole->Forward(batch.inputs.data(), batch.targets.data(), batch.B, batch.T));
    whole->Backward(1.0f / M);
  }
  const std::vector<float> whole_grads = whole->CopyGradsToHost();

  const std::vector<ModelPart> cuts = {{0, 1, M}, {1, 3, M}, {3, 4, M}};
  std::vector<std::unique_ptr<GptModel>> parts;
  for (const ModelPart& cut : cuts) {
    auto part = GptModel::CreatePart(config, B, Device::kCpu, cut);
    REQUIRE(part.ok());
    (*part)->CopyParamsFromHost(weights);
    (*part)->ZeroGrad();
    parts.push_back(*std::move(part));
  }
  const size_t activation = static_cast<size_t>(B) * T * config.dim;
  // boundary[m][p]: part p's output for micro-batch m; its gradient alike.
  std::vector<std::vector<std::vector<float>>> out(M), grad(M);
  std::vector<float> losses(M);
  for (int m = 0; m < M; ++m) {
    out[m].assign(cuts.size(), std::vector<float>(activation));
    grad[m].assign(cuts.size(), std::vector<float>(activation));
    for (size_t p = 0; p < cuts.size(); ++p) {
      const float* in = p == 0 ? nullptr : out[m][p - 1].data();
      losses[m] = parts[p]->PartForward(m, batches[m].inputs.data(), batches[m].targets.data(), in,
                                        out[m][p].data(), B, T);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int p = static_cast<int>(cuts.size()) - 1; p >= 0; --p) {
      const float* from = p + 1 < static_cast<int>(cuts.size()) ? grad[m][p].data() : nullptr;
      float* to = p > 0 ? grad[m][p - 1].data() : nullptr;
      parts[p]->PartBackward(m, 1.0f / M, from, to);
    }
  }
  for (int m = 0; m < M; ++m) CHECK(losses[m] == whole_losses[m]);

  // Each stage's gradient from the part that runs it.
  const std::vector<Stage>& stages = whole->stages();
  size_t offset = 0;
  const size_t wte = static_cast<size_t>(config.padded_vocab()) * config.dim;
  std::vector<std::vector<float>> part_grads;
  for (auto& part : parts) part_grads.push_back(part->CopyGradsToHost());
  for (size_t s = 0; s < stages.size(); ++s) {
    INFO("stage " << stages[s].name);
    // Embedding: the first part; block i (stage i + 1): the part whose
    // range holds i; head: the last part.
    const int layer = static_cast<int>(s) - 1;
    const int owner = s == 0                      ? 0
                      : s + 1 == stages.size()    ? 2
                      : layer < cuts[0].end_block ? 0
                      : layer < cuts[1].end_block ? 1
                                                  : 2;
    for (size_t i = 0; i < stages[s].size; ++i) {
      float got = part_grads[owner][offset + i];
      if (s == 0 && i < wte) {
        // wte: the encoder's share (first part) and the head's (last part).
        got += part_grads[2][offset + i];
        REQUIRE(std::abs(got - whole_grads[offset + i]) <= 1e-6f);
      } else {
        REQUIRE(got == whole_grads[offset + i]);
      }
    }
    offset += stages[s].size;
  }
  // A part touches no other stage's gradient.
  offset = stages[0].size;
  for (size_t s = 1; s + 1 < stages.size(); ++s) {
    const bool mine = s - 1 >= 1 && s - 1 < 3;  // blocks 1 and 2: the middle part
    if (!mine) {
      for (size_t i = 0; i < stages[s].size; ++i) REQUIRE(part_grads[1][offset + i] == 0.0f);
    }
    offset += stages[s].size;
  }
}

TEST_CASE("a split backward (input pass, then weight pass) adds PartBackward's bits") {
  ModelConfig config = TinyConfig();
  config.layers = 4;
  const int B = 2, T = 5, M = 3;
  std::unique_ptr<GptModel> whole = MakeModel(config, B, 5);
  const std::vector<float> weights = whole->CopyParamsToHost();
  // The middle blocks, with gradients flowing in from a made-up output
  // gradient, and the last part (the loss), each run both ways.
  for (const ModelPart& cut : {ModelPart{1, 3, M}, ModelPart{2, 4, M}, ModelPart{0, 4, M}}) {
    INFO("blocks " << cut.first_block << ".." << cut.end_block);
    ModelPart split_cut = cut;
    split_cut.split_backward = true;
    auto plain = GptModel::CreatePart(config, B, Device::kCpu, cut);
    auto split = GptModel::CreatePart(config, B, Device::kCpu, split_cut);
    REQUIRE(plain.ok());
    REQUIRE(split.ok());
    // The kept output gradients live in activations the input pass is done
    // with: a split part takes no more memory than a plain one.
    CHECK((*split)->ActivationBytes() == (*plain)->ActivationBytes());
    const bool last = cut.end_block == config.layers, first = cut.first_block == 0;
    const size_t activation = static_cast<size_t>(B) * T * config.dim;
    std::mt19937 random(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::vector<float>> in(M, std::vector<float>(activation)),
        grad_out(M, std::vector<float>(activation));
    for (int m = 0; m < M; ++m) {
      for (float& x : in[m]) x = normal(random);
      for (float& x : grad_out[m]) x = 0.01f * normal(random);
    }
    std::vector<std::vector<float>> grad_in[2];
    for (int way = 0; way < 2; ++way) {
      GptModel& part = way == 0 ? **plain : **split;
      part.CopyParamsFromHost(weights);
      part.ZeroGrad();
      std::vector<float> out(activation);
      grad_in[way].assign(M, std::vector<float>(activation));
      for (int m = 0; m < M; ++m) {
        const Batch batch = RandomBatch(config, B, T, 200 + m);
        part.PartForward(m, batch.inputs.data(), batch.targets.data(),
                         first ? nullptr : in[m].data(), last ? nullptr : out.data(), B, T);
      }
      // The weight passes late and in order, as ZB-H1 runs them.
      for (int m = 0; m < M; ++m) {
        const float* from = last ? nullptr : grad_out[m].data();
        float* to = first ? nullptr : grad_in[way][m].data();
        if (way == 0) {
          part.PartBackward(m, 1.0f / M, from, to);
        } else {
          part.PartBackwardInput(m, 1.0f / M, from, to);
        }
      }
      if (way == 1) {
        for (int m = 0; m < M; ++m) part.PartBackwardWeight(m);
      }
    }
    CHECK(grad_in[0] == grad_in[1]);
    CHECK((*plain)->CopyGradsToHost() == (*split)->CopyGradsToHost());
  }
}

TEST_CASE("CPU transient buffers: a freed one serves the next request of its size") {
  auto made = MakeOps(Device::kCpu);
  REQUIRE(made.ok());
  Ops& ops = **made;
  const size_t kBig = 8 << 20, kSmall = 3 << 20;
  auto alloc = [&](size_t bytes) {
    absl::StatusOr<void*> ptr = ops.AllocTransient(bytes);
    REQUIRE(ptr.ok());
    std::memset(*ptr, 0x5a, bytes);  // writable, whole
    return *ptr;
  };
  // A stage's gathered parameters and gradient, as FSDP takes them per step.
  void* params = alloc(kBig);
  void* grads = alloc(kBig);
  CHECK(params != grads);
  ops.FreeTransient(params);
  ops.FreeTransient(grads);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    void* again = alloc(kBig);
    void* twice = alloc(kBig);
    // The same two buffers, in either order: nothing new is faulted in.
    CHECK(((again == params && twice == grads) || (again == grads && twice == params)));
    void* other = alloc(kSmall);  // another size never gets them
    CHECK((other != params && other != grads));
    ops.FreeTransient(other);
    ops.FreeTransient(twice);
    ops.FreeTransient(again);
  }
  // Three big ones live at once: the third is new memory, and once all are
  // freed the cache keeps them (the peak was 3 big + 0 small at once).
  void* a = alloc(kBig);
  void* b = alloc(kBig);
  void* c = alloc(kBig);
  CHECK((c != params && c != grads));
  ops.FreeTransient(a);
  ops.FreeTransient(b);
  ops.FreeTransient(c);
  ops.FreeTransient(nullptr);  // a no-op
  void* empty = alloc(0);      // a zero-byte request still gets a buffer
  CHECK(empty != nullptr);
  ops.FreeTransient(empty);
}

TEST_CASE("a bad model part is INVALID_ARGUMENT") {
  const ModelConfig config = TinyConfig();
  CHECK(absl::IsInvalidArgument(GptModel::CreatePart(config, 1, Device::kCpu, {1, 1, 1}).status()));
  CHECK(absl::IsInvalidArgument(GptModel::CreatePart(config, 1, Device::kCpu, {0, 3, 1}).status()));
  CHECK(absl::IsInvalidArgument(GptModel::CreatePart(config, 1, Device::kCpu, {0, 2, 0}).status()));
}

}  // namespace
}  // namespace muster::worker
