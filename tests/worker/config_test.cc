#include "worker/config.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace muster::worker {
namespace {

std::string ExamplePath(const std::string& file) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  std::string path = std::string(srcdir ? srcdir : ".") + "/" +
                     (workspace ? workspace : "muster") + "/examples/" + file;
  REQUIRE(access(path.c_str(), R_OK) == 0);
  return path;
}

// The smallest valid file: data.train is the one field without a default.
const char kMinimal[] = "data:\n  train: shards/train_*.bin\n";

std::string ErrorOf(const std::string& yaml) {
  absl::StatusOr<TrainConfig> config = ParseConfig(yaml, "t.yaml", "/base");
  REQUIRE_FALSE(config.ok());
  CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(config.status().message());
}

TEST_CASE("a minimal file gets every default") {
  absl::StatusOr<TrainConfig> config = ParseConfig(kMinimal, "t.yaml", "");
  REQUIRE(config.ok());
  TrainConfig expected;
  expected.source = "t.yaml";
  expected.data.train = "shards/train_*.bin";
  CHECK(*config == expected);
  CHECK(config->model.layers == 4);
  CHECK(config->model.padded_vocab() == 256);
  CHECK(config->optim.schedule == "cosine");
  CHECK(config->optim.lr == 3e-4);
  CHECK(config->train.seed == 1337);
  CHECK(config->device == "auto");
  CHECK(config->precision == "auto");
  CHECK(config->parallel.strategy == "ddp");
  CHECK(config->checkpoint.resume == "auto");
  CHECK(config->checkpoint.dir.empty());
}

TEST_CASE("every example file loads") {
  absl::StatusOr<TrainConfig> tiny = LoadConfig(ExamplePath("tiny.yaml"));
  REQUIRE(tiny.ok());
  CHECK(tiny->model.vocab == 256);
  CHECK(tiny->model.dim % tiny->model.heads == 0);
  CHECK(tiny->train.eval_every == 50);
  // examples/../data/tiny: the repository root's data directory.
  std::filesystem::path root = std::filesystem::path(ExamplePath("tiny.yaml")).parent_path();
  root = std::filesystem::absolute(root).parent_path();
  CHECK(tiny->data.train == (root / "data/tiny/train_*.bin").string());
  CHECK(tiny->data.val == (root / "data/tiny/val_*.bin").string());

  absl::StatusOr<TrainConfig> gpt2 = LoadConfig(ExamplePath("gpt2_124m.yaml"));
  REQUIRE(gpt2.ok());
  CHECK(gpt2->model.layers == 12);
  CHECK(gpt2->model.heads == 12);
  CHECK(gpt2->model.dim == 768);
  CHECK(gpt2->model.vocab == 50257);
  CHECK(gpt2->model.padded_vocab() == 50304);
  CHECK(gpt2->model.seq_len == 1024);
  CHECK(gpt2->optim.lr == 6e-4);
  CHECK(gpt2->optim.warmup_steps == 700);
  CHECK(gpt2->optim.min_lr == 0.0);
  CHECK(gpt2->optim.weight_decay == 0.1);
  CHECK(gpt2->data.train == (root / "dev/data/fineweb10B/fineweb_train_*.bin").string());
}

TEST_CASE("a missing file is NOT_FOUND naming it") {
  absl::StatusOr<TrainConfig> config = LoadConfig("/nonexistent/train.yaml");
  REQUIRE_FALSE(config.ok());
  CHECK(config.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(std::string(config.status().message()),
             Catch::Contains("/nonexistent/train.yaml"));
}

TEST_CASE("errors name the file, the line, the key path and what was expected") {
  struct Case {
    std::string yaml;
    std::string message;  // a substring of the error
  };
  const std::string train = "data:\n  train: x.bin\n";  // lines 1-2
  const std::vector<Case> cases = {
      {"", "t.yaml:1: empty file"},
      {"# only a comment\n", "t.yaml:1: empty file"},
      {"- model\n- data\n", "t.yaml:1: expected a map of sections at the top level, got a list"},
      {"model: [1,\n", "t.yaml:2: invalid yaml"},
      {train + "model:\n  layer: 4\n",
       "t.yaml:4: model.layer: unknown key; did you mean 'layers'?"},
      {train + "model:\n  colour: 4\n", "t.yaml:4: model.colour: unknown key (known keys in model: "
                                        "layers, heads, dim, vocab, seq_len)"},
      {train + "optimizer:\n  lr: 1\n", "t.yaml:3: optimizer: unknown key; did you mean 'optim'?"},
      {train + "model:\n  layers: four\n",
       "t.yaml:4: model.layers: expected an integer, got 'four'"},
      {train + "model:\n  layers: 2.5\n", "t.yaml:4: model.layers: expected an integer, got '2.5'"},
      {train + "model:\n  layers: 99999999999\n",
       "t.yaml:4: model.layers: expected a 32-bit integer"},
      {train + "model:\n  layers: [1, 2]\n",
       "t.yaml:4: model.layers: expected an integer, got a list"},
      {train + "model:\n  layers:\n", "t.yaml:4: model.layers: expected an integer, got nothing"},
      {train + "optim:\n  lr: fast\n", "t.yaml:4: optim.lr: expected a number, got 'fast'"},
      {train + "optim:\n  lr: .nan\n", "t.yaml:4: optim.lr: expected a number"},
      {train + "train:\n  seed: -1\n",
       "t.yaml:4: train.seed: expected a non-negative integer, got '-1'"},
      {"data:\n  train: {a: 1}\n", "t.yaml:2: data.train: expected a string, got a map"},
      {"model: 4\n" + train, "t.yaml:1: model: expected a map, got '4'"},
      {train + "optim:\n  learning_rate: 1\n", "t.yaml:4: optim.learning_rate: unknown key (known"},
      {train + "model:\n  layers: 2\n  layers: 3\n",
       "t.yaml:5: model.layers: duplicate key (first set on line 4)"},
      {train + "model: {}\nmodel: {}\n", "t.yaml:4: model: duplicate key (first set on line 3)"},
      {train + "model:\n  dim: 768\n  heads: 5\n",
       "t.yaml:5: model.heads: 5 does not divide model.dim 768"},
      // heads left at its default: the line is the one that set dim.
      {train + "model:\n  dim: 250\n", "t.yaml:4: model.heads: 4 does not divide model.dim 250"},
      {train + "model:\n  layers: 0\n", "t.yaml:4: model.layers: must be > 0, got 0"},
      {train + "model:\n  seq_len: -8\n", "t.yaml:4: model.seq_len: must be > 0, got -8"},
      {train + "data:\n", "t.yaml:3: data: duplicate key"},
      {"data:\n  train: x.bin\n  micro_batch: 0\n", "t.yaml:3: data.micro_batch: must be > 0"},
      {"data:\n  train: x.bin\n  grad_accumulation: -1\n",
       "t.yaml:3: data.grad_accumulation: must be > 0"},
      {train + "model:\n  vocab: 65537\n", "t.yaml:4: model.vocab: 65537 is more than 65536"},
      {train + "optim:\n  lr: 0\n", "t.yaml:4: optim.lr: must be > 0, got 0"},
      {train + "optim:\n  lr: 1e-4\n  min_lr: 1e-3\n",
       "t.yaml:5: optim.min_lr: 0.001 is above optim.lr 0.0001"},
      {train + "optim:\n  beta1: 1.0\n", "t.yaml:4: optim.beta1: expected a value in [0, 1), got 1"},
      {train + "optim:\n  beta2: -0.1\n", "t.yaml:4: optim.beta2: expected a value in [0, 1)"},
      {train + "optim:\n  eps: 0\n", "t.yaml:4: optim.eps: must be > 0, got 0"},
      {train + "optim:\n  schedule: linear\n",
       "t.yaml:4: optim.schedule: expected cosine or constant, got 'linear'"},
      {train + "device: tpu\n", "t.yaml:3: device: expected cpu, cuda or auto, got 'tpu'"},
      {train + "precision: fp16\n",
       "t.yaml:3: precision: expected auto, fp32, tf32 or bf16, got 'fp16'"},
      {train + "device: cpu\nprecision: bf16\n",
       "t.yaml:4: precision: bf16 needs device cuda; the CPU computes in fp32 only"},
      // The line is precision's whichever comes first.
      {train + "precision: tf32\ndevice: cpu\n",
       "t.yaml:3: precision: tf32 needs device cuda; the CPU computes in fp32 only"},
      {train + "parallel:\n  strategy: fsdp\n",
       "t.yaml:4: parallel.strategy: unknown strategy 'fsdp'; known strategies: ddp"},
      {train + "checkpoint:\n  dir: ckpt\n  every: 10\n  keep_last: 1\n",
       "t.yaml:6: checkpoint.keep_last: 1 is too few while checkpoints are on"},
      {train + "checkpoint:\n  every: 10\n",
       "t.yaml:4: checkpoint.every: saving checkpoints needs checkpoint.dir"},
      {train + "checkpoint:\n  resume: \"\"\n",
       "t.yaml:4: checkpoint.resume: expected auto, never or a checkpoint path"},
      {train + "checkpoint:\n  keep_every: -5\n", "t.yaml:4: checkpoint.keep_every: must be >= 0"},
      {train + "train:\n  eval_every: 10\n", "t.yaml:4: train.eval_every: evaluation needs data.val"},
      {"model:\n  layers: 2\n", "t.yaml:1: data.train: missing"},
      {"data:\n  val: v.bin\n", "t.yaml:1: data.train: missing"},
  };
  for (const Case& c : cases) {
    INFO("yaml:\n" << c.yaml);
    CHECK_THAT(ErrorOf(c.yaml), Catch::Contains(c.message));
  }
}

TEST_CASE("precision reads every value; tf32 and bf16 need more than an explicit cpu") {
  for (const char* value : {"auto", "fp32", "tf32", "bf16"}) {
    INFO(value);
    // device auto (the default) may turn out to be cuda: the trainer
    // decides, once it has resolved the device.
    std::string text = std::string(kMinimal) + "precision: " + value + "\n";
    absl::StatusOr<TrainConfig> parsed = ParseConfig(text, "t.yaml", "");
    REQUIRE(parsed.ok());
    CHECK(parsed->precision == value);
    absl::StatusOr<TrainConfig> on_cuda = ParseConfig(text + "device: cuda\n", "t.yaml", "");
    REQUIRE(on_cuda.ok());
    CHECK(on_cuda->precision == value);
  }
  for (const char* value : {"auto", "fp32"}) {
    INFO(value);
    std::string text = std::string(kMinimal) + "device: cpu\nprecision: " + value + "\n";
    CHECK(ParseConfig(text, "t.yaml", "").ok());
  }
}

TEST_CASE("parallel.backend: auto, nccl, gloo; nccl is refused with an explicit cpu") {
  for (const char* value : {"auto", "nccl", "gloo"}) {
    INFO(value);
    std::string text = std::string(kMinimal) + "parallel:\n  backend: " + value + "\n";
    absl::StatusOr<TrainConfig> parsed = ParseConfig(text, "t.yaml", "");
    REQUIRE(parsed.ok());
    CHECK(parsed->parallel.backend == value);
  }
  CHECK(ParseConfig(kMinimal, "t.yaml", "")->parallel.backend == "auto");
  std::string text = std::string(kMinimal) + "parallel:\n  backend: mpi\n";
  CHECK_THAT(ErrorOf(text), Catch::Contains("parallel.backend: expected auto, nccl or gloo, got 'mpi'"));
  text = std::string(kMinimal) + "device: cpu\nparallel:\n  backend: nccl\n";
  CHECK_THAT(ErrorOf(text), Catch::Contains("parallel.backend: nccl needs device cuda"));
  text = std::string(kMinimal) + "device: cpu\nparallel:\n  backend: gloo\n";
  CHECK(ParseConfig(text, "t.yaml", "").ok());
}

TEST_CASE("keep_last below 2 is fine while checkpoints are off") {
  std::string yaml = std::string(kMinimal) + "checkpoint:\n  keep_last: 1\n";
  CHECK(ParseConfig(yaml, "t.yaml", "").ok());
}

TEST_CASE("ConfigToYaml parses back to an equal config") {
  std::vector<TrainConfig> configs;
  for (const char* file : {"tiny.yaml", "gpt2_124m.yaml"}) {
    absl::StatusOr<TrainConfig> loaded = LoadConfig(ExamplePath(file));
    REQUIRE(loaded.ok());
    configs.push_back(*loaded);
  }
  // Values chosen to trip a lossy printer: doubles without a short decimal
  // form, a glob that would be a yaml alias unquoted, quotes, a huge seed.
  TrainConfig odd;
  odd.source = "odd.yaml";
  odd.data.train = "*.bin";
  odd.data.val = "va\"l \\ #x: y";
  odd.optim.lr = 0.1 + 0.2;
  odd.optim.min_lr = 1e-300;
  odd.optim.eps = 1.0 / 3.0;
  odd.optim.schedule = "constant";
  odd.train.seed = 18446744073709551615ull;
  odd.train.eval_every = 7;
  odd.device = "cpu";
  odd.precision = "fp32";
  odd.parallel.bucket_mb = 0.125;
  odd.checkpoint.dir = "/ckpt dir";
  odd.checkpoint.every = 3;
  odd.checkpoint.resume = "/ckpt dir/step_00000003";
  configs.push_back(odd);
  TrainConfig on_cuda = odd;
  on_cuda.device = "cuda";
  on_cuda.precision = "bf16";
  on_cuda.parallel.backend = "gloo";
  configs.push_back(on_cuda);

  for (const TrainConfig& config : configs) {
    std::string yaml = ConfigToYaml(config);
    INFO(yaml);
    absl::StatusOr<TrainConfig> parsed = ParseConfig(yaml, config.source, "");
    REQUIRE(parsed.ok());
    CHECK(*parsed == config);
    CHECK(ConfigToYaml(*parsed) == yaml);
  }
}

TEST_CASE("ConfigToYaml prints every field") {
  std::string yaml = ConfigToYaml(*ParseConfig(kMinimal, "t.yaml", ""));
  for (const char* key :
       {"model:", "layers:", "heads:", "dim:", "vocab:", "seq_len:", "data:", "train:", "val:",
        "micro_batch:", "grad_accumulation:", "optim:", "lr:", "warmup_steps:", "schedule:",
        "min_lr:", "weight_decay:", "beta1:", "beta2:", "eps:", "grad_clip:", "steps:", "seed:",
        "log_every:", "eval_every:", "eval_batches:", "metrics_file:", "device:", "precision:",
        "parallel:", "strategy:", "backend:", "bucket_mb:", "checkpoint:", "dir:", "every:", "keep_last:",
        "keep_every:", "resume:"}) {
    CHECK_THAT(yaml, Catch::Contains(key));
  }
}

TEST_CASE("relative paths resolve against the yaml file's directory") {
  const std::string yaml =
      "data:\n  train: shards/train_*.bin\n  val: ../val/v_*.bin\n"
      "train:\n  metrics_file: out/metrics.jsonl\n"
      "checkpoint:\n  dir: /abs/ckpt\n  resume: ckpt/step_00000100\n";
  absl::StatusOr<TrainConfig> config = ParseConfig(yaml, "t.yaml", "/base/run");
  REQUIRE(config.ok());
  CHECK(config->data.train == "/base/run/shards/train_*.bin");
  CHECK(config->data.val == "/base/val/v_*.bin");
  CHECK(config->train.metrics_file == "/base/run/out/metrics.jsonl");
  CHECK(config->checkpoint.dir == "/abs/ckpt");
  CHECK(config->checkpoint.resume == "/base/run/ckpt/step_00000100");

  // auto and never are words, not paths.
  for (const char* word : {"auto", "never"}) {
    std::string text = std::string(kMinimal) + "checkpoint:\n  resume: " + word + "\n";
    absl::StatusOr<TrainConfig> parsed = ParseConfig(text, "t.yaml", "/base");
    REQUIRE(parsed.ok());
    CHECK(parsed->checkpoint.resume == word);
  }

  // LoadConfig uses the file's own directory, made absolute.
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::filesystem::path dir = std::filesystem::path(tmp ? tmp : "/tmp") / "config_test_dir";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "train.yaml") << kMinimal;
  absl::StatusOr<TrainConfig> loaded = LoadConfig((dir / "train.yaml").string());
  REQUIRE(loaded.ok());
  CHECK(loaded->source == (dir / "train.yaml").string());
  CHECK(loaded->data.train == (std::filesystem::absolute(dir) / "shards/train_*.bin").string());
}

TEST_CASE("ModelConfigHash is stable and covers exactly the model's shape") {
  ModelConfig base;
  // FNV-1a 64 over (4, 4, 256, 256, 128) as little-endian int32: fixed for
  // every platform and build, since checkpoints store it.
  CHECK(ModelConfigHash(base) == 4111355433892761413ull);
  CHECK(ModelConfigHash(base) == ModelConfigHash(ModelConfig{}));

  std::vector<std::function<void(ModelConfig&)>> changes = {
      [](ModelConfig& m) { m.layers += 1; }, [](ModelConfig& m) { m.heads = 8; },
      [](ModelConfig& m) { m.dim = 384; },   [](ModelConfig& m) { m.vocab = 257; },
      [](ModelConfig& m) { m.seq_len = 64; },
  };
  for (size_t i = 0; i < changes.size(); ++i) {
    ModelConfig changed = base;
    changes[i](changed);
    INFO("model field " << i);
    CHECK(ModelConfigHash(changed) != ModelConfigHash(base));
  }

  // Everything outside the model leaves the hash alone.
  TrainConfig a = *ParseConfig(kMinimal, "a.yaml", "");
  const std::string other =
      "data:\n  train: other_*.bin\n  micro_batch: 3\n"
      "optim:\n  lr: 0.1\n  schedule: constant\n"
      "train:\n  steps: 9\n  seed: 7\n"
      "device: cpu\nparallel:\n  bucket_mb: 1\n"
      "checkpoint:\n  dir: c\n  every: 2\n";
  TrainConfig b = *ParseConfig(other, "b.yaml", "");
  CHECK(ModelConfigHash(a.model) == ModelConfigHash(b.model));
}

}  // namespace
}  // namespace muster::worker
