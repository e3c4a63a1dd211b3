// GptModel against an independent GPT-2 written in plain PyTorch
// (tests/worker/model/torch_reference.py), run in float64 on the same weights
// and batch: the loss and every parameter's gradient must agree to 1e-4
// relative (per tensor, ||ours - torch|| / ||torch||).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "worker/model/model.h"

namespace muster::worker {
namespace {

constexpr char kPython[] = "/usr/bin/python3";  // Debian's, with python3-torch

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

std::string ScriptPath() {
  const char* runfiles = std::getenv("TEST_SRCDIR");
  const std::string relative = "tests/worker/model/torch_reference.py";
  return runfiles != nullptr ? std::string(runfiles) + "/muster/" + relative : relative;
}

template <typename Elem>
std::vector<Elem> ReadFile(const std::string& path) {
  std::vector<Elem> values;
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return values;
  Elem value;
  while (std::fread(&value, sizeof(Elem), 1, file) == 1) values.push_back(value);
  std::fclose(file);
  return values;
}

template <typename Elem>
void WriteFile(const std::string& path, const std::vector<Elem>& values) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  REQUIRE(file != nullptr);
  REQUIRE(std::fwrite(values.data(), sizeof(Elem), values.size(), file) == values.size());
  std::fclose(file);
}

// A gradient tensor in llm.c's file order: name and slice of the host copy.
struct NamedSlice {
  std::string name;
  size_t host_offset, size;
};

std::vector<NamedSlice> LlmcOrder(const GptModel& model) {
  const std::vector<Stage>& stages = model.stages();
  std::vector<size_t> start;
  size_t offset = 0;
  for (const Stage& stage : stages) {
    start.push_back(offset);
    offset += stage.size;
  }
  std::vector<NamedSlice> order;
  auto add = [&](size_t s, size_t t) {
    const TensorView& view = stages[s].tensors[t];
    order.push_back({stages[s].name + "." + view.name, start[s] + view.offset, view.size});
  };
  const size_t head = stages.size() - 1;
  for (size_t t = 0; t < stages[0].tensors.size(); ++t) add(0, t);
  for (size_t t = 0; t < stages[1].tensors.size(); ++t) {
    for (size_t s = 1; s < head; ++s) add(s, t);
  }
  for (size_t t = 0; t < stages[head].tensors.size(); ++t) add(head, t);
  return order;
}

TEST_CASE("loss and every gradient match a float64 PyTorch GPT-2") {
  const std::string probe = std::string(kPython) + " -c 'import torch' >/dev/null 2>&1";
  if (std::system(probe.c_str()) != 0) {
    FAIL(kPython << " cannot import torch; run scripts/setup.sh --test "
                    "(it installs Debian's python3-torch)");
  }

  ModelConfig config;
  config.layers = 2;
  config.heads = 4;
  config.dim = 32;
  config.vocab = 50;  // Vp = 128
  config.seq_len = 16;
  const int B = 3, T = 12;  // T < maxT
  auto created = GptModel::Create(config, B, Device::kCpu);
  REQUIRE(created.ok());
  GptModel& model = **created;
  model.InitWeights(5);
  // GPT-2's init leaves biases zero, gains one and wte's padded rows zero;
  // noise on everything exercises each term (padded rows must still be
  // ignored by the loss).
  std::vector<float> params = model.CopyParamsToHost();
  uint64_t state = 99;
  for (float& value : params) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    value += 0.05f * (static_cast<float>(state >> 40) / 16777216.0f - 0.5f);
  }
  model.CopyParamsFromHost(params);

  std::vector<int> batch = {B, T};
  for (int i = 0; i < 2 * B * T; ++i) batch.push_back((i * 37 + i / 5) % config.vocab);
  const int* inputs = batch.data() + 2;
  const int* targets = inputs + B * T;

  const std::string dir = TempDir();
  REQUIRE(model.SaveLlmc(dir + "/reference_model.bin").ok());
  WriteFile(dir + "/reference_batch.bin", batch);
  const std::string command = "timeout 300 " + std::string(kPython) + " " + ScriptPath() + " " +
                              dir + "/reference_model.bin " + dir + "/reference_batch.bin " + dir;
  INFO(command);
  REQUIRE(std::system(command.c_str()) == 0);
  const std::vector<double> torch_loss = ReadFile<double>(dir + "/loss.bin");
  const std::vector<double> torch_grads = ReadFile<double>(dir + "/grads.bin");
  REQUIRE(torch_loss.size() == 1);
  REQUIRE(torch_grads.size() == model.num_parameters());

  model.ZeroGrad();
  const float loss = model.Forward(inputs, targets, B, T);
  model.Backward(1.0f);
  const std::vector<float> grads = model.CopyGradsToHost();
  INFO("loss: ours " << loss << ", torch " << torch_loss[0]);
  CHECK(std::fabs(loss - torch_loss[0]) <= 1e-4 * std::fabs(torch_loss[0]));

  size_t file_offset = 0;
  for (const NamedSlice& tensor : LlmcOrder(model)) {
    double diff_sq = 0.0, ref_sq = 0.0;
    for (size_t i = 0; i < tensor.size; ++i) {
      const double ours = grads[tensor.host_offset + i];
      const double reference = torch_grads[file_offset + i];
      diff_sq += (ours - reference) * (ours - reference);
      ref_sq += reference * reference;
    }
    file_offset += tensor.size;
    const double relative = std::sqrt(diff_sq) / std::fmax(std::sqrt(ref_sq), 1e-30);
    INFO(tensor.name << ": ||ours - torch|| / ||torch|| = " << relative
                     << " (||torch|| = " << std::sqrt(ref_sq) << ")");
    CHECK(relative <= 1e-4);
  }
}

}  // namespace
}  // namespace muster::worker
