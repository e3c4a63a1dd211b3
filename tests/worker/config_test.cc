#include "worker/config/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace muster::worker {
namespace {

// A data file of this test, by its path in the workspace.
std::string RunfilePath(const std::string& file) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  std::string path =
      std::string(srcdir ? srcdir : ".") + "/" + (workspace ? workspace : "muster") + "/" + file;
  REQUIRE(access(path.c_str(), R_OK) == 0);
  return path;
}

std::string ExamplePath(const std::string& file) { return RunfilePath("examples/" + file); }

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
  CHECK(config->attention == "auto");
  CHECK(config->parallel.strategy == "ddp");
  CHECK(config->parallel.zero == 3);
  CHECK(config->parallel.reshard_after_forward);
  CHECK(config->parallel.dp_replicate == 0);  // auto
  CHECK(config->parallel.dp_shard == 0);      // auto
  CHECK(config->parallel.pp == 1);
  CHECK(config->parallel.pp_split.empty());  // balanced
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

  absl::StatusOr<TrainConfig> fsdp = LoadConfig(ExamplePath("tiny_fsdp.yaml"));
  REQUIRE(fsdp.ok());
  CHECK(fsdp->parallel.strategy == "fsdp");
  CHECK(fsdp->parallel.zero == 3);
  absl::StatusOr<TrainConfig> pipeline = LoadConfig(ExamplePath("tiny_pipeline.yaml"));
  REQUIRE(pipeline.ok());
  CHECK(pipeline->parallel.pp == 2);
  CHECK(MicroSteps(*pipeline) == 4);
}

TEST_CASE("a missing file is NOT_FOUND naming it and the reason") {
  absl::StatusOr<TrainConfig> config = LoadConfig("/nonexistent/train.yaml");
  REQUIRE_FALSE(config.ok());
  CHECK(config.status().code() == absl::StatusCode::kNotFound);
  CHECK(config.status().message() ==
        "/nonexistent/train.yaml: cannot read the config file: No such file or directory");
}

// A fresh directory of this test's own, made absolute.
std::filesystem::path TestDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::filesystem::path dir =
      std::filesystem::absolute(std::filesystem::path(tmp ? tmp : "/tmp") / name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// A directory read as "empty file"; /dev/zero was read forever.
TEST_CASE("a directory, a device, or a file of more than 1 MiB, is not a config") {
  const std::filesystem::path dir = TestDir("config_test_not_a_file");
  absl::StatusOr<TrainConfig> directory = LoadConfig(dir.string());
  REQUIRE_FALSE(directory.ok());
  CHECK(directory.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(directory.status().message() ==
        dir.string() + ": a directory, not a config file; name the train.yaml in it");
  absl::StatusOr<TrainConfig> zero = LoadConfig("/dev/zero");
  REQUIRE_FALSE(zero.ok());
  CHECK(zero.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(zero.status().message() == "/dev/zero: a character device, not a config file");
  // A comment makes a valid config of just over 1 MiB.
  std::ofstream(dir / "big.yaml") << kMinimal << "# " << std::string(1 << 20, 'x') << "\n";
  absl::StatusOr<TrainConfig> big = LoadConfig((dir / "big.yaml").string());
  REQUIRE_FALSE(big.ok());
  CHECK(big.status().message() == (dir / "big.yaml").string() +
                                      ": more than 1 MiB, too large for a config file (is it the "
                                      "right file?)");
}

TEST_CASE("a symlink loop is NOT_FOUND naming the reason") {
  const std::filesystem::path dir = TestDir("config_test_loop");
  std::filesystem::create_symlink(dir / "loop.yaml", dir / "loop.yaml");
  absl::StatusOr<TrainConfig> config = LoadConfig((dir / "loop.yaml").string());
  REQUIRE_FALSE(config.ok());
  CHECK(config.status().code() == absl::StatusCode::kNotFound);
  CHECK(config.status().message() == (dir / "loop.yaml").string() +
                                         ": cannot read the config file: Too many levels of "
                                         "symbolic links");
}

// LoadConfig in a thread, waited for at most 20 s: a FIFO's open(2) for
// reading waited for a writer forever. If it is still waiting, a writer
// that opens and closes the FIFO releases it, and the test fails.
absl::StatusOr<TrainConfig> LoadConfigWithin20s(const std::string& path) {
  std::future<absl::StatusOr<TrainConfig>> loaded =
      std::async(std::launch::async, [path] { return LoadConfig(path); });
  if (loaded.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    const int writer = open(path.c_str(), O_WRONLY | O_NONBLOCK);
    if (writer >= 0) close(writer);
    FAIL_CHECK("LoadConfig(" << path << ") still waits after 20 s");
  }
  return loaded.get();
}

// `mkfifo f.yaml; worker f.yaml` waited forever for a writer.
TEST_CASE("a FIFO that nothing writes to is refused at once; a pipe being written is read") {
  const std::filesystem::path dir = TestDir("config_test_fifo");
  const std::string fifo = (dir / "fifo.yaml").string();
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  absl::StatusOr<TrainConfig> unwritten = LoadConfigWithin20s(fifo);
  REQUIRE_FALSE(unwritten.ok());
  CHECK(unwritten.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(unwritten.status().message() ==
        fifo + ": a FIFO that nothing writes to, not a config file");

  // `worker <(sed ... train.yaml)`: a pipe whose writer is there, by a
  // /dev/fd path. It writes only after the reader has started (or not:
  // either way the reader waits for its end).
  int ends[2];
  REQUIRE(pipe(ends) == 0);
  const std::string pipe_path = "/proc/self/fd/" + std::to_string(ends[0]);
  std::future<absl::StatusOr<TrainConfig>> loaded =
      std::async(std::launch::async, [&] { return LoadConfig(pipe_path); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const std::string text = kMinimal;
  REQUIRE(write(ends[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  close(ends[1]);  // the end of the file: the reader cannot wait past it
  absl::StatusOr<TrainConfig> piped = loaded.get();
  close(ends[0]);
  INFO(piped.status().ToString());
  REQUIRE(piped.ok());
  CHECK_THAT(piped->data.train, Catch::EndsWith("/shards/train_*.bin"));

  // A pipe whose writer went without writing: nothing to read, ever.
  REQUIRE(pipe(ends) == 0);
  close(ends[1]);
  const std::string closed_path = "/proc/self/fd/" + std::to_string(ends[0]);
  absl::StatusOr<TrainConfig> closed = LoadConfigWithin20s(closed_path);
  close(ends[0]);
  REQUIRE_FALSE(closed.ok());
  CHECK(closed.status().message() ==
        closed_path + ": a FIFO that nothing writes to, not a config file");
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
      // A value's newline is escaped: an error is one line.
      {train + "device: \"cpu\\n\"\n",
       "t.yaml:3: device: expected cpu, cuda or auto, got 'cpu\\n'"},
      // yaml-cpp does not say why for these two; the message does.
      {"model:\n\tlayers: 4\n", "indents with a tab; yaml indents with spaces only)"},
      {std::string("model: \"a\0b\\\0\"\n", 14), "(the file holds a NUL byte: it is not text)"},
      // A second document was ignored, whatever it held.
      {train + "---\nmodel: {layers: 8}\n",
       "t.yaml:3: a second yaml document; a train.yaml is one document: remove the '---' and what "
       "follows, or merge it into the first"},
      {"---\n" + train + "---\n", "t.yaml:4: a second yaml document"},
      {"# a comment\n---\n" + train + "--- # more\n{not: [valid\n", "t.yaml:7: invalid yaml"},
      {train + "...\nmodel: {}\n", "t.yaml:4: a second yaml document"},
      {train + "model:\n  layer: 4\n",
       "t.yaml:4: model.layer: unknown key; did you mean 'layers'?"},
      {train + "model:\n  colour: 4\n",
       "t.yaml:4: model.colour: unknown key (known keys in model: "
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
      // A quoted or !!str value is a string in yaml, whatever it spells.
      {train + "model:\n  layers: \"2\"\n",
       "t.yaml:4: model.layers: expected an integer, got the string '2'"},
      {train + "train:\n  steps: '30'\n",
       "t.yaml:4: train.steps: expected an integer, got the string '30'"},
      {train + "train:\n  steps: !!str 30\n",
       "t.yaml:4: train.steps: expected an integer, got '30' tagged !!str"},
      {train + "model:\n  layers: !!float 2\n",
       "t.yaml:4: model.layers: expected an integer, got '2' tagged !!float"},
      {train + "train:\n  seed: \"7\"\n",
       "t.yaml:4: train.seed: expected a non-negative integer, got the string '7'"},
      {train + "optim:\n  lr: \"0.1\"\n",
       "t.yaml:4: optim.lr: expected a number, got the string '0.1'"},
      {train + "optim:\n  lr: !unknown 0.1\n",
       "t.yaml:4: optim.lr: expected a number, got '0.1' tagged !unknown"},
      {train + "parallel:\n  reshard_after_forward: \"false\"\n",
       "t.yaml:4: parallel.reshard_after_forward: expected true or false, got the string 'false'"},
      {train + "parallel:\n  pp_split: [2, \"2\"]\n",
       "t.yaml:4: parallel.pp_split: expected a list of integers, got the string '2' at entry 2"},
      // A number is decimal, as an integer is: 0x10 read as 16.
      {train + "optim:\n  lr: 0x10\n", "t.yaml:4: optim.lr: expected a number, got '0x10'"},
      {train + "optim:\n  lr: 0x1p-10\n", "t.yaml:4: optim.lr: expected a number, got '0x1p-10'"},
      {train + "optim:\n  lr: 0o20\n", "t.yaml:4: optim.lr: expected a number, got '0o20'"},
      {train + "model:\n  layers: 0x2\n", "t.yaml:4: model.layers: expected an integer, got '0x2'"},
      {train + "train:\n  seed: -1\n",
       "t.yaml:4: train.seed: expected a non-negative integer, got '-1'"},
      {"data:\n  train: {a: 1}\n", "t.yaml:2: data.train: expected a string, got a map"},
      {"model: 4\n" + train, "t.yaml:1: model: expected a map, got '4'"},
      {train + "optim:\n  learning_rate: 1\n", "t.yaml:4: optim.learning_rate: unknown key (known"},
      {train + "model:\n  layers: 2\n  layers: 3\n",
       "t.yaml:5: model.layers: duplicate key (first set on line 4)"},
      // yaml-cpp gives an alias its anchor's line: the value's is the alias's.
      {train + "train:\n  &k steps: 30\n  log_every: 1\n  *k : 40\n",
       "t.yaml:6: train.steps: duplicate key, an alias of the key first set on line 4"},
      {train + "train:\n  &k steps: 30\n  *k :\n",
       "t.yaml:4: train.steps: duplicate key, an alias of the key first set on line 4"},
      {train + "model: {}\nmodel: {}\n", "t.yaml:4: model: duplicate key (first set on line 3)"},
      // A dotted key is unknown, not a duplicate of the field it spells.
      {train + "optim:\n  lr: 0.1\noptim.lr: 0.2\n",
       "t.yaml:5: optim.lr: unknown key; a key is one name, not a dotted path: write 'lr:' under "
       "'optim:' (known keys: model, data, optim, train, device, precision, attention, parallel, "
       "checkpoint)"},
      {train + "optim.lr: 0.2\n", "t.yaml:3: optim.lr: unknown key; a key is one name"},
      {train + "model:\n  a.b: 1\n",
       "t.yaml:4: model.a.b: unknown key; a key is one name, not a dotted path: write 'b:' under "
       "'a:' (known keys in model: layers"},
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
      // Numbers are quoted as written, not as read: 1e-400 reads as 0.
      {train + "optim:\n  lr: 1e-400\n", "t.yaml:4: optim.lr: must be > 0, got 1e-400"},
      // The optimizer computes in 32-bit floats: an lr of 1e-50 trained with 0.
      {train + "optim:\n  lr: 1e-50\n",
       "t.yaml:4: optim.lr: 1e-50 is 0 as the 32-bit float the optimizer computes in; the "
       "smallest positive one is about 1.4e-45"},
      {train + "optim:\n  grad_clip: 1e-46\n",
       "t.yaml:4: optim.grad_clip: 1e-46 is 0 as the 32-bit float"},
      {train + "optim:\n  lr: 1e39\n",
       "t.yaml:4: optim.lr: 1e39 is beyond the largest 32-bit float, which the optimizer "
       "computes in (about 3.4e38)"},
      {train + "optim:\n  beta2: 0.99999999999\n",
       "t.yaml:4: optim.beta2: 0.99999999999 is 1 as the 32-bit float the optimizer computes in; "
       "expected a value in [0, 1)"},
      // parallel.timeout_s: 1e10 s overflowed into a timeout at the first
      // collective; 0.0004 s failed there with internal text.
      {train + "parallel:\n  timeout_s: 1e10\n",
       "t.yaml:4: parallel.timeout_s: 1e10 is more than 1000000, about 11.6 days; a longer bound "
       "is none"},
      {train + "parallel:\n  timeout_s: 0.0004\n",
       "t.yaml:4: parallel.timeout_s: 0.0004 is less than 0.01, a bound that healthy collectives "
       "would miss"},
      {train + "parallel:\n  timeout_s: 1e-300\n", "parallel.timeout_s: 1e-300 is less than 0.01"},
      {train + "parallel:\n  timeout_s: 0\n", "parallel.timeout_s: must be > 0, got 0"},
      {train + "optim:\n  lr: 1e-4\n  min_lr: 1e-3\n",
       "t.yaml:5: optim.min_lr: 0.001 is above optim.lr 0.0001"},
      {train + "optim:\n  beta1: 1.0\n",
       "t.yaml:4: optim.beta1: expected a value in [0, 1), got 1.0"},
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
      {train + "attention: flash\n",
       "t.yaml:3: attention: expected auto, muster, gemm or cudnn, got 'flash'"},
      {train + "device: cpu\ntrain:\n  cuda_graphs: true\n",
       "t.yaml:5: train.cuda_graphs: true needs device cuda; the CPU runs no CUDA graphs"},
      {train + "train:\n  cuda_graphs: maybe\n",
       "t.yaml:4: train.cuda_graphs: expected auto, true or false, got 'maybe'"},
      {train + "device: cpu\nattention: gemm\n",
       "t.yaml:4: attention: gemm needs device cuda; the CPU runs muster's own attention"},
      {train + "device: cpu\nattention: cudnn\n",
       "t.yaml:4: attention: cudnn needs device cuda; the CPU runs muster's own attention"},
      {train + "attention: cudnn\nprecision: fp32\n",
       "t.yaml:3: attention: cudnn needs precision bf16 (or auto, bf16 on CUDA), not fp32"},
      {train + "precision: tf32\nattention: cudnn\n",
       "t.yaml:4: attention: cudnn needs precision bf16 (or auto, bf16 on CUDA), not tf32"},
      {train + "attention: cudnn\nmodel:\n  dim: 1024\n  heads: 4\n",
       "t.yaml:3: attention: cudnn needs a head size (model.dim / model.heads) that is a multiple "
       "of 8 and at most 128; 1024 / 4 is 256"},
      {train + "parallel:\n  strategy: hsdp\n",
       "t.yaml:4: parallel.strategy: unknown strategy 'hsdp'; known strategies: ddp, fsdp"},
      {train + "parallel:\n  dp_shard: 2\n",
       "t.yaml:4: parallel.dp_shard: 2 shards each replica, which needs parallel.strategy: fsdp; "
       "ddp replicates the whole model: 0 (auto) or 1"},
      // The line is dp_shard's, the field named, whichever comes first.
      {train + "parallel:\n  dp_shard: 4\n  strategy: ddp\n",
       "t.yaml:4: parallel.dp_shard: 4 shards each replica, which needs parallel.strategy: fsdp"},
      {train + "parallel:\n  dp_shard: -1\n", "t.yaml:4: parallel.dp_shard: must be >= 0, got -1"},
      {train + "parallel:\n  gather_dtype: bf16\n",
       "t.yaml:4: parallel.gather_dtype: bf16 all-gathers fsdp's parameters, which needs "
       "parallel.strategy: fsdp; ddp gathers none"},
      {train + "parallel:\n  strategy: fsdp\n  pp: 2\n  microbatches: 2\n  gather_dtype: bf16\n",
       "t.yaml:7: parallel.gather_dtype: bf16 with parallel.pp 2: a pipeline stage's shards are "
       "gathered in fp32; use fp32 or auto"},
      {train + "parallel:\n  pp: 4\n",
       "t.yaml:4: parallel.microbatches: 1 micro-batches per step (parallel.microbatches, or "
       "data.grad_accumulation when it is 0) is fewer than parallel.pp (4)"},
      {train + "parallel:\n  pp: 5\n  microbatches: 8\n",
       "t.yaml:4: parallel.pp: 5 pipeline stages for 4 blocks (model.layers)"},
      {train + "parallel:\n  schedule: interleaved_1f1b\n  virtual_stages: 1\n",
       "t.yaml:5: parallel.virtual_stages: 1 with interleaved_1f1b, which runs 2 or more "
       "pipeline stages per rank"},
      {train + "parallel:\n  virtual_stages: 2\n",
       "t.yaml:4: parallel.virtual_stages: 2 with parallel.schedule 1f1b, which runs one "
       "pipeline stage per rank"},
      // Without a pipeline, as parallel.microbatches: refused, not ignored.
      {train + "parallel:\n  schedule: interleaved_1f1b\n",
       "t.yaml:4: parallel.schedule: interleaved_1f1b runs 2 pipeline stages per rank, which needs "
       "parallel.pp above 1 (it is 1); without a pipeline leave parallel.schedule and "
       "parallel.virtual_stages unset"},
      {train + "parallel:\n  pp: 1\n  virtual_stages: 3\n  schedule: interleaved_1f1b\n",
       "t.yaml:6: parallel.schedule: interleaved_1f1b runs 3 pipeline stages per rank"},
      {train + "parallel:\n  virtual_stages: -1\n",
       "t.yaml:4: parallel.virtual_stages: must be >= 0, got -1"},
      {train + "parallel:\n  pp: 2\n  schedule: interleaved_1f1b\n  microbatches: 3\n",
       "t.yaml:6: parallel.microbatches: 3 micro-batches per step is not a multiple of "
       "parallel.pp (2)"},
      {train + "parallel:\n  pp: 2\n  schedule: interleaved_1f1b\n  virtual_stages: 3\n"
               "  microbatches: 4\n",
       "t.yaml:4: parallel.pp: 6 pipeline stages (2 ranks x 3 virtual stages) for 4 blocks"},
      {train + "parallel:\n  pp: 2\n  schedule: interleaved_1f1b\n  microbatches: 4\n"
               "  pp_split: [2, 2]\n",
       "parallel.pp_split: [2, 2] has 2 entries; expected one per pipeline stage, parallel.pp 2 "
       "x parallel.virtual_stages 2"},
      {train + "parallel:\n  pp: 2\n  schedule: interleaved_1f1b\n  microbatches: 1\n",
       "parallel.microbatches: 1 micro-batches per step (parallel.microbatches, or "
       "data.grad_accumulation when it is 0) is fewer than parallel.pp (2): interleaved_1f1b "
       "never fills the pipeline"},
      {train + "parallel:\n  schedule: zb\n",
       "t.yaml:4: parallel.schedule: unknown schedule 'zb'; known schedules: gpipe, 1f1b, "
       "interleaved_1f1b, zb_h1"},
      {train + "parallel:\n  pp: 4\n  schedule: zb_h1\n  microbatches: 2\n",
       "parallel.microbatches: 2 micro-batches per step (parallel.microbatches, or "
       "data.grad_accumulation when it is 0) is fewer than parallel.pp (4): zb_h1 never fills "
       "the pipeline"},
      {"data:\n  train: x.bin\n  grad_accumulation: 2\nparallel:\n  pp: 2\n  microbatches: 4\n",
       "data.grad_accumulation: 2 with parallel.microbatches 4"},
      {train + "parallel:\n  pp: 0\n", "t.yaml:4: parallel.pp: must be > 0, got 0"},
      // pp x virtual_stages wrapped negative in 32 bits, and passed.
      {train + "parallel:\n  schedule: interleaved_1f1b\n  pp: 2\n  virtual_stages: 1073741824\n"
               "  microbatches: 2\n",
       "t.yaml:5: parallel.pp: 2147483648 pipeline stages (2 ranks x 1073741824 virtual stages) "
       "for 4 blocks (model.layers)"},
      {train + "parallel:\n  zero: 0\n", "t.yaml:4: parallel.zero: must be > 0, got 0"},
      {train + "parallel:\n  strategy: fsdp\n  zero: 4\n",
       "t.yaml:5: parallel.zero: 4 is more than 3, the ZeRO stages are 1, 2 and 3"},
      {train + "parallel:\n  zero: two\n",
       "t.yaml:4: parallel.zero: expected an integer, got 'two'"},
      {train + "parallel:\n  reshard_after_forward: yes\n",
       "t.yaml:4: parallel.reshard_after_forward: expected true or false, got 'yes'"},
      {train + "parallel:\n  reshard_after_forward: 1\n",
       "t.yaml:4: parallel.reshard_after_forward: expected true or false, got '1'"},
      {train + "parallel:\n  reshard_after_forward:\n",
       "t.yaml:4: parallel.reshard_after_forward: expected true or false, got nothing"},
      {train + "parallel:\n  reshard_after_forward: [true]\n",
       "t.yaml:4: parallel.reshard_after_forward: expected true or false, got a list"},
      {train + "parallel:\n  dp_replicate: -1\n", "t.yaml:4: parallel.dp_replicate: must be >= 0"},
      {train + "parallel:\n  pp_split: 4\n",
       "t.yaml:4: parallel.pp_split: expected a list of integers, got '4'"},
      {train + "parallel:\n  pp_split: {a: 1}\n",
       "t.yaml:4: parallel.pp_split: expected a list of integers, got a map"},
      {train + "parallel:\n  pp_split: [2, two]\n",
       "t.yaml:4: parallel.pp_split: expected a list of integers, got 'two' at entry 2"},
      {train + "parallel:\n  pp_split: [2.5, 1.5]\n",
       "t.yaml:4: parallel.pp_split: expected a list of integers, got '2.5' at entry 1"},
      {train + "parallel:\n  pp_split: [[2], 2]\n",
       "t.yaml:4: parallel.pp_split: expected a list of integers, got a list at entry 1"},
      {train + "parallel:\n  pp_split:\n    - 2\n    -\n",
       "parallel.pp_split: expected a list of integers, got nothing at entry 2"},
      {train + "parallel:\n  pp_split: [9999999999, 1]\n",
       "t.yaml:4: parallel.pp_split: expected a list of 32-bit integers, entry 1 '9999999999' is "
       "out of range"},
      // The checks against parallel.pp and model.layers (4 by default).
      {train + "parallel:\n  microbatches: 4\n",
       "t.yaml:4: parallel.microbatches: 4 sets a pipeline's micro-batches per step, which needs "
       "parallel.pp above 1 (it is 1); without a pipeline the micro-batches per step are "
       "data.grad_accumulation: set that, and leave this at 0"},
      {train + "parallel:\n  pp_split: [4]\n",
       "t.yaml:4: parallel.pp_split: [4] splits a pipeline, which needs parallel.pp above 1 (it is "
       "1)"},
      {train + "parallel:\n  pp: 2\n  microbatches: 2\n  pp_split: [1, 1, 2]\n",
       "t.yaml:6: parallel.pp_split: [1, 1, 2] has 3 entries; expected one per pipeline stage, "
       "parallel.pp 2"},
      {train + "parallel:\n  pp: 2\n  microbatches: 2\n  pp_split: [0, 4]\n",
       "t.yaml:6: parallel.pp_split: [0, 4]: entry 1 is 0; each stage needs at least 1 block"},
      {train + "parallel:\n  pp: 2\n  microbatches: 2\n  pp_split: [5, -1]\n",
       "t.yaml:6: parallel.pp_split: [5, -1]: entry 2 is -1; each stage needs at least 1 block"},
      {train + "parallel:\n  pp: 2\n  microbatches: 2\n  pp_split: [2, 3]\n",
       "t.yaml:6: parallel.pp_split: [2, 3] sums to 5 blocks, but model.layers is 4"},
      {train + "model:\n  layers: 6\nparallel:\n  pp: 2\n  microbatches: 2\n  pp_split:\n"
               "    - 1\n    - 4\n",
       "t.yaml:8: parallel.pp_split: [1, 4] sums to 5 blocks, but model.layers is 6"},
      {train + "checkpoint:\n  dir: ckpt\n  every: 10\n  keep_last: 1\n",
       "t.yaml:6: checkpoint.keep_last: 1 is too few while checkpoints are on"},
      {train + "checkpoint:\n  every: 10\n",
       "t.yaml:4: checkpoint.every: saving checkpoints needs checkpoint.dir"},
      {train + "checkpoint:\n  resume: \"\"\n",
       "t.yaml:4: checkpoint.resume: expected auto, never or a checkpoint path"},
      {train + "checkpoint:\n  keep_every: -5\n", "t.yaml:4: checkpoint.keep_every: must be >= 0"},
      {train + "checkpoint:\n  lock_wait: -1\n", "t.yaml:4: checkpoint.lock_wait: must be >= 0"},
      {train + "train:\n  eval_every: 10\n",
       "t.yaml:4: train.eval_every: evaluation needs data.val"},
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

TEST_CASE("attention: auto by default, muster, or cudnn with cuda, bf16 and a head size it takes") {
  absl::StatusOr<TrainConfig> defaults = ParseConfig(kMinimal, "t.yaml", "");
  REQUIRE(defaults.ok());
  CHECK(defaults->attention == "auto");
  for (const char* value : {"auto", "muster", "gemm", "cudnn"}) {
    INFO(value);
    // device auto (the default) may turn out to be cuda, and precision auto
    // is then bf16: the trainer decides (ResolveAttention), as for precision.
    const std::string text = std::string(kMinimal) + "attention: " + value + "\n";
    for (const std::string& more :
         {std::string(), std::string("device: cuda\n"), std::string("precision: bf16\n"),
          std::string("device: cuda\nprecision: auto\n")}) {
      INFO(more);
      absl::StatusOr<TrainConfig> parsed = ParseConfig(text + more, "t.yaml", "");
      INFO(parsed.status().ToString());
      REQUIRE(parsed.ok());
      CHECK(parsed->attention == value);
    }
  }
  // muster's kernels run anywhere, in any precision, at any head size.
  for (const char* value : {"auto", "muster"}) {
    INFO(value);
    const std::string text = std::string(kMinimal) + "attention: " + value +
                             "\ndevice: cpu\nprecision: fp32\nmodel:\n  dim: 1024\n  heads: 4\n";
    CHECK(ParseConfig(text, "t.yaml", "").ok());
  }
  // cuDNN's head sizes: multiples of 8 up to 128 (CudnnAttentionSupports,
  // kernels/fast/cudnn_attention.h).
  struct Shape {
    int dim, heads;
    bool ok;
  };
  for (const Shape& shape :
       {Shape{768, 12, true}, Shape{512, 4, true}, Shape{64, 8, true}, Shape{1024, 4, false},
        Shape{240, 12, false}, Shape{60, 10, false}, Shape{1040, 8, false}}) {
    INFO(shape.dim << " / " << shape.heads);
    const std::string text = std::string(kMinimal) +
                             "attention: cudnn\nmodel:\n  dim: " + std::to_string(shape.dim) +
                             "\n  heads: " + std::to_string(shape.heads) + "\n";
    if (shape.ok) {
      absl::StatusOr<TrainConfig> parsed = ParseConfig(text, "t.yaml", "");
      INFO(parsed.status().ToString());
      CHECK(parsed.ok());
    } else {
      const std::string error = ErrorOf(text);
      CHECK_THAT(error, Catch::StartsWith("t.yaml:3: attention: cudnn needs a head size"));
      CHECK_THAT(error, Catch::Contains(absl::StrCat(shape.dim, " / ", shape.heads, " is ",
                                                     shape.dim / shape.heads)));
    }
  }
  // Every refusal names the field, at its line.
  for (const std::string& more :
       {std::string("device: cpu\n"), std::string("precision: fp32\n"),
        std::string("precision: tf32\n"), std::string("model:\n  dim: 768\n  heads: 3\n")}) {
    INFO(more);
    CHECK_THAT(ErrorOf(more + kMinimal + "attention: cudnn\n"),
               Catch::Matches("t\\.yaml:[0-9]+: attention: cudnn needs .*"));
  }
  CHECK(ErrorOf(std::string(kMinimal) + "attention: CUDNN\n") ==
        "t.yaml:3: attention: expected auto, muster, gemm or cudnn, got 'CUDNN'");
  CHECK(ErrorOf(std::string(kMinimal) + "attention: [cudnn]\n") ==
        "t.yaml:3: attention: expected a string, got a list");
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
  CHECK_THAT(ErrorOf(text),
             Catch::Contains("parallel.backend: expected auto, nccl or gloo, got 'mpi'"));
  text = std::string(kMinimal) + "device: cpu\nparallel:\n  backend: nccl\n";
  CHECK_THAT(ErrorOf(text), Catch::Contains("parallel.backend: nccl needs device cuda"));
  text = std::string(kMinimal) + "device: cpu\nparallel:\n  backend: gloo\n";
  CHECK(ParseConfig(text, "t.yaml", "").ok());
}

TEST_CASE(
    "train.cuda_graphs: auto by default, true or false; true is refused with an explicit cpu") {
  CHECK(ParseConfig(kMinimal, "t.yaml", "")->train.cuda_graphs == "auto");
  for (const char* device : {"auto", "cuda", "cpu"}) {
    for (const char* value : {"auto", "true", "false"}) {
      INFO("device " << device << ", cuda_graphs " << value);
      const std::string text =
          std::string(kMinimal) + "device: " + device + "\ntrain:\n  cuda_graphs: " + value + "\n";
      absl::StatusOr<TrainConfig> parsed = ParseConfig(text, "t.yaml", "");
      // The default, auto, is on for CUDA alone, so a CPU file may keep it.
      if (std::string(device) == "cpu" && std::string(value) == "true") {
        CHECK_THAT(ErrorOf(text), Catch::Contains("train.cuda_graphs: true needs device cuda"));
        continue;
      }
      REQUIRE(parsed.ok());
      CHECK(parsed->train.cuda_graphs == value);
    }
  }
}

TEST_CASE("parallel.gather_dtype: auto, fp32 or bf16 on either device; anything else is named") {
  const std::string fsdp = std::string(kMinimal) + "parallel:\n  strategy: fsdp\n";
  absl::StatusOr<TrainConfig> parsed = ParseConfig(fsdp, "t.yaml", "");
  REQUIRE(parsed.ok());
  CHECK(parsed->parallel.gather_dtype == "auto");
  for (const char* value : {"auto", "fp32", "bf16"}) {
    INFO(value);
    parsed = ParseConfig(fsdp + "  gather_dtype: " + value + "\n", "t.yaml", "");
    INFO(parsed.status().ToString());
    REQUIRE(parsed.ok());
    CHECK(parsed->parallel.gather_dtype == value);
  }
  // bf16 gathers need no bf16 arithmetic: the CPU takes them.
  parsed = ParseConfig(fsdp + "  gather_dtype: bf16\ndevice: cpu\n", "t.yaml", "");
  REQUIRE(parsed.ok());
  for (const char* value : {"fp16", "BF16"}) {
    INFO(value);
    CHECK(ErrorOf(fsdp + "  gather_dtype: " + value + "\n") ==
          absl::StrCat("t.yaml:5: parallel.gather_dtype: expected auto, fp32 or bf16, got '", value,
                       "'"));
  }
  CHECK(ErrorOf(fsdp + "  gather_dtype: [bf16]\n") ==
        "t.yaml:5: parallel.gather_dtype: expected a string, got a list");
}

TEST_CASE("parallel: fsdp with every ZeRO stage, sharding degrees, reshard_after_forward") {
  struct Case {
    std::string yaml;
    int zero;
    bool reshard;
    int replicate, shard;
  };
  const std::string fsdp = std::string(kMinimal) + "parallel:\n  strategy: fsdp\n";
  const std::vector<Case> cases = {
      // Both degrees auto: resolved against the world by ParallelDimsFor.
      {fsdp, 3, true, 0, 0},
      {fsdp + "  zero: 1\n", 1, true, 0, 0},
      {fsdp + "  zero: 2\n", 2, true, 0, 0},
      {fsdp + "  zero: 3\n  reshard_after_forward: false\n", 3, false, 0, 0},
      {fsdp + "  reshard_after_forward: true\n", 3, true, 0, 0},
      // YAML 1.2's other spellings of the booleans.
      {fsdp + "  reshard_after_forward: False\n", 3, false, 0, 0},
      {fsdp + "  reshard_after_forward: TRUE\n", 3, true, 0, 0},
      {fsdp + "  dp_shard: 8\n", 3, true, 0, 8},
      // HSDP: replicated over dp_replicate groups, sharded within each.
      {fsdp + "  dp_replicate: 2\n", 3, true, 2, 0},
      {fsdp + "  dp_replicate: 2\n  dp_shard: 4\n", 3, true, 2, 4},
      // ddp: the fsdp fields are read (and ignored); dp_shard 1 is allowed.
      {std::string(kMinimal) + "parallel:\n  zero: 1\n  reshard_after_forward: false\n", 1, false,
       0, 0},
      {std::string(kMinimal) + "parallel:\n  dp_shard: 1\n  dp_replicate: 4\n", 3, true, 4, 1},
  };
  for (const Case& c : cases) {
    INFO(c.yaml);
    absl::StatusOr<TrainConfig> parsed = ParseConfig(c.yaml, "t.yaml", "");
    INFO(parsed.status().ToString());
    REQUIRE(parsed.ok());
    CHECK(parsed->parallel.zero == c.zero);
    CHECK(parsed->parallel.reshard_after_forward == c.reshard);
    CHECK(parsed->parallel.dp_replicate == c.replicate);
    CHECK(parsed->parallel.dp_shard == c.shard);
  }
}

TEST_CASE("parallel.pp_split: blocks per stage, flow or block list, round-trips") {
  const std::string pipeline =
      "data:\n  train: x.bin\nmodel:\n  layers: 12\nparallel:\n  pp: 3\n  microbatches: 3\n";
  struct Case {
    std::string yaml;
    std::vector<int> split;
  };
  const std::vector<Case> cases = {
      {pipeline, {}},
      {pipeline + "  pp_split: []\n", {}},
      {pipeline + "  pp_split:\n", {}},  // an empty value: the empty list
      {pipeline + "  pp_split: [4, 4, 4]\n", {4, 4, 4}},
      {pipeline + "  pp_split: [6,5,1]\n", {6, 5, 1}},
      {pipeline + "  pp_split:\n    - 2\n    - 3\n    - 7\n", {2, 3, 7}},
  };
  for (const Case& c : cases) {
    INFO(c.yaml);
    absl::StatusOr<TrainConfig> parsed = ParseConfig(c.yaml, "t.yaml", "");
    INFO(parsed.status().ToString());
    REQUIRE(parsed.ok());
    CHECK(parsed->parallel.pp_split == c.split);
    const std::string yaml = ConfigToYaml(*parsed);
    INFO(yaml);
    std::string written = "[";
    for (size_t i = 0; i < c.split.size(); ++i) {
      written += (i ? ", " : "") + std::to_string(c.split[i]);
    }
    CHECK_THAT(yaml, Catch::Contains("  pp_split: " + written + "]\n"));
    absl::StatusOr<TrainConfig> again = ParseConfig(yaml, "t.yaml", "");
    REQUIRE(again.ok());
    CHECK(*again == *parsed);
    TrainConfig other = *parsed;
    other.parallel.pp_split = {5, 5, 2};
    CHECK_FALSE(other == *parsed);
  }
}

TEST_CASE("with several errors, a field's own checks come before those across fields") {
  // heads 5 does not divide dim 768, but vocab's own range is checked first.
  const std::string both = "model:\n  dim: 768\n  heads: 5\n  vocab: 70000\n";
  CHECK_THAT(ErrorOf(std::string(kMinimal) + both),
             Catch::Contains("t.yaml:6: model.vocab: 70000 is more than 65536"));
  // Within the own checks, the order of the file's fields (ConfigToYaml's).
  CHECK_THAT(ErrorOf(std::string(kMinimal) + "device: tpu\nmodel:\n  layers: 0\n"),
             Catch::Contains("t.yaml:5: model.layers: must be > 0, got 0"));
}

TEST_CASE("parallel.timeout_s: 0.01 to 1e6 seconds; optim's smallest 32-bit floats") {
  for (const char* value : {"0.01", "30", "300.0", "1e6", "1000000"}) {
    INFO(value);
    CHECK(
        ParseConfig(std::string(kMinimal) + "parallel:\n  timeout_s: " + value + "\n", "t.yaml", "")
            .ok());
  }
  CHECK(
      ParseConfig(std::string(kMinimal) + "optim:\n  lr: 1e-44\n  min_lr: 0\n", "t.yaml", "").ok());
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
  odd.optim.min_lr = 1e-30;  // 1e-300 would be 0 as the optimizer's float
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
  on_cuda.attention = "cudnn";
  on_cuda.parallel.backend = "gloo";
  configs.push_back(on_cuda);
  TrainConfig hsdp = odd;
  hsdp.parallel.strategy = "fsdp";
  hsdp.parallel.zero = 2;
  hsdp.parallel.reshard_after_forward = false;
  hsdp.parallel.gather_dtype = "bf16";
  hsdp.parallel.dp_replicate = 2;
  hsdp.parallel.dp_shard = 4;
  configs.push_back(hsdp);

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
  for (const char* key : {"model:",
                          "layers:",
                          "heads:",
                          "dim:",
                          "vocab:",
                          "seq_len:",
                          "data:",
                          "train:",
                          "val:",
                          "micro_batch:",
                          "grad_accumulation:",
                          "optim:",
                          "lr:",
                          "warmup_steps:",
                          "schedule:",
                          "min_lr:",
                          "weight_decay:",
                          "beta1:",
                          "beta2:",
                          "eps:",
                          "grad_clip:",
                          "steps:",
                          "seed:",
                          "log_every:",
                          "eval_every:",
                          "eval_batches:",
                          "metrics_file:",
                          "device:",
                          "precision:",
                          "attention: \"auto\"\n",
                          "parallel:",
                          "strategy:",
                          "backend:",
                          "bucket_mb:",
                          "zero: 3\n",
                          "reshard_after_forward: true\n",
                          "gather_dtype: \"auto\"\n",
                          "timeout_s:",
                          "dp_replicate: 0\n",
                          "dp_shard: 0\n",
                          "pp: 1\n",
                          "schedule: \"1f1b\"\n",
                          "microbatches: 0\n",
                          "pp_split: []\n",
                          "checkpoint:",
                          "dir:",
                          "every:",
                          "keep_last:",
                          "keep_every:",
                          "resume:"}) {
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

// LoadConfig's error for `yaml` written to dir/train.yaml.
std::string LoadError(const std::filesystem::path& dir, const std::string& yaml) {
  std::ofstream(dir / "train.yaml") << yaml;
  absl::StatusOr<TrainConfig> config = LoadConfig((dir / "train.yaml").string());
  REQUIRE_FALSE(config.ok());
  CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(config.status().message());
}

// A run from step 0 truncates train.metrics_file: pointed at a shard, the
// config or the checkpoints' LOCK, it destroyed them.
TEST_CASE("train.metrics_file may not name the config, a shard or anything in checkpoint.dir") {
  const std::filesystem::path dir = TestDir("config_test_metrics_file");
  std::filesystem::create_directories(dir / "d");
  std::filesystem::create_directories(dir / "ck");
  std::ofstream(dir / "d/train_000.bin") << "shard";
  std::ofstream(dir / "d/val_000.bin") << "shard";
  std::ofstream(dir / "ck/LOCK") << "lock";
  const std::string head = "data:\n  train: d/train_*.bin\n  val: d/val_*.bin\n";
  const std::string file = (dir / "train.yaml").string();
  struct Case {
    std::string metrics_file, tail, message;
  };
  const std::vector<Case> cases = {
      {"train.yaml", "",
       "train.yaml:5: train.metrics_file: '" + file +
           "' is the config file itself; the metrics file would overwrite it"},
      // Another spelling of the same file.
      {"d/../train.yaml", "", "' is the config file itself"},
      {"d/train_000.bin", "",
       "train.metrics_file: '" + (dir / "d/train_000.bin").string() +
           "' is a shard of data.train ('" + (dir / "d/train_*.bin").string() +
           "'); the metrics file would overwrite it"},
      {"d/val_000.bin", "", "' is a shard of data.val ('"},
      {"d/train_999.bin", "",
       "matches data.train ('" + (dir / "d/train_*.bin").string() +
           "'); the run would read its own metrics file as a shard"},
      {"ck/LOCK", "checkpoint:\n  dir: ck\n",
       "train.metrics_file: '" + (dir / "ck/LOCK").string() + "' is inside checkpoint.dir ('" +
           (dir / "ck").string() + "')"},
      {"ck/new/metrics.jsonl", "checkpoint:\n  dir: ck/\n", "' is inside checkpoint.dir"},
      {"ck", "checkpoint:\n  dir: ck\n", "' is checkpoint.dir itself"},
  };
  for (const Case& c : cases) {
    INFO(c.metrics_file);
    CHECK_THAT(LoadError(dir, head + "train:\n  metrics_file: " + c.metrics_file + "\n" + c.tail),
               Catch::Contains(c.message));
  }
  // A symbolic link to a shard is the shard.
  std::filesystem::create_symlink(dir / "d/train_000.bin", dir / "link.jsonl");
  CHECK_THAT(LoadError(dir, head + "train:\n  metrics_file: link.jsonl\n"),
             Catch::Contains("' is a shard of data.train"));
  // Beside them all is fine, and so is a checkpoint.dir named like it.
  std::ofstream(dir / "train.yaml")
      << head << "train:\n  metrics_file: ck.jsonl\ncheckpoint:\n  dir: ck\n";
  absl::StatusOr<TrainConfig> fine = LoadConfig((dir / "train.yaml").string());
  INFO(fine.status().ToString());
  CHECK(fine.ok());
}

TEST_CASE("ModelConfigHash is stable and covers exactly the model's shape") {
  ModelConfig base;
  // FNV-1a 64 over (4, 4, 256, 256, 128) as little-endian int32: fixed for
  // every platform and build, since checkpoints store it.
  CHECK(ModelConfigHash(base) == 4111355433892761413ull);
  CHECK(ModelConfigHash(base) == ModelConfigHash(ModelConfig{}));

  std::vector<std::function<void(ModelConfig&)>> changes = {
      [](ModelConfig& m) { m.layers += 1; },  [](ModelConfig& m) { m.heads = 8; },
      [](ModelConfig& m) { m.dim = 384; },    [](ModelConfig& m) { m.vocab = 257; },
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

// ---- The field tables (worker/config/fields.h): ConfigFields() is what the
// reader, ConfigToYaml and operator== walk, so checking it covers them all.

// Converts to anything, so T{AnyMember{}...} compiles with at most as many
// values as the aggregate T has members: a count that needs no names, and
// so notices a member that the tables (and so ConfigFields) lack.
struct AnyMember {
  template <typename T>
  operator T&() const;
};

template <typename T, typename... A>
auto BraceInitializes(int) -> decltype(T{std::declval<A>()...}, std::true_type{});
template <typename T, typename... A>
std::false_type BraceInitializes(...);

template <typename T, typename... A>
constexpr size_t MemberCount() {
  if constexpr (decltype(BraceInitializes<T, A..., AnyMember>(0))::value) {
    return MemberCount<T, A..., AnyMember>();
  } else {
    return sizeof...(A);
  }
}

// The listed fields by their first path component ("optim" -> its 9).
std::map<std::string, size_t> FieldsPerSection() {
  std::map<std::string, size_t> count;
  for (const ConfigField& field : ConfigFields()) {
    ++count[field.path.substr(0, field.path.find('.'))];
  }
  return count;
}

TEST_CASE("ConfigFields lists every member of every config struct") {
  struct Three {
    int a;
    std::string b;
    ModelConfig c;
  };
  static_assert(MemberCount<Three>() == 3, "the counting trick counts");
  std::map<std::string, size_t> listed = FieldsPerSection();
  const std::vector<std::pair<std::string, size_t>> sections = {
      {"model", MemberCount<ModelConfig>()},
      {"data", MemberCount<DataConfig>()},
      {"optim", MemberCount<OptimConfig>()},
      {"train", MemberCount<TrainLoopConfig>()},
      {"device", 1},
      {"precision", 1},
      {"attention", 1},
      {"parallel", MemberCount<ParallelConfig>()},
      {"checkpoint", MemberCount<CheckpointConfig>()},
  };
  for (const auto& [section, members] : sections) {
    INFO("section " << section << ": a member missing from its table in worker/config/fields.h?");
    CHECK(listed[section] == members);
  }
  // TrainConfig: the sections and top-level strings above, plus `source`
  // (where it came from, not a yaml field).
  INFO("a TrainConfig member missing from its table in worker/config/fields.h?");
  CHECK(listed.size() == sections.size());
  CHECK(MemberCount<TrainConfig>() == sections.size() + 1);
}

TEST_CASE("ConfigFields: unique paths, defaults as ConfigToYaml writes them, typed set") {
  std::set<std::string> paths;
  const TrainConfig defaults;
  for (const ConfigField& field : ConfigFields()) {
    INFO(field.path);
    CHECK(paths.insert(field.path).second);
    CHECK_FALSE(field.description.empty());
    CHECK(field.get(defaults) == field.default_text);
  }
  CHECK(ConfigFields().front().path == "model.layers");
  const ConfigField* lr = nullptr;
  const ConfigField* layers = nullptr;
  for (const ConfigField& field : ConfigFields()) {
    if (field.path == "optim.lr") lr = &field;
    if (field.path == "model.layers") layers = &field;
  }
  REQUIRE(lr != nullptr);
  REQUIRE(layers != nullptr);
  CHECK(lr->type == "number");
  CHECK(lr->default_text == "3e-04");  // std::to_chars: the shortest
  TrainConfig config;
  REQUIRE(lr->set("6e-4", &config).ok());
  CHECK(config.optim.lr == 6e-4);
  absl::Status bad = layers->set("four", &config);
  CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(bad.message() == "model.layers: expected an integer, got 'four'");
  CHECK(layers->set("[1,", &config).message().find("model.layers: invalid yaml") == 0);
  CHECK(config.model.layers == 4);
}

// yaml-schema.md's number: an integer or a decimal, nothing else absl
// reads (0x10 was 16); a value tagged with its field's own type reads.
TEST_CASE("a number is any decimal spelling; a tag of the field's own type reads") {
  std::map<std::string, const ConfigField*> by_path;
  for (const ConfigField& field : ConfigFields()) by_path[field.path] = &field;
  TrainConfig config;
  const ConfigField& lr = *by_path.at("optim.lr");
  const std::vector<std::pair<std::string, double>> numbers = {
      {"6e-4", 6e-4}, {"6E-4", 6e-4},         {".5", 0.5},     {"5.", 5.0},
      {"+1", 1.0},    {"-0.5", -0.5},         {"1", 1.0},      {"1.5e+2", 150.0},
      {"007", 7.0},   {"!!float 0.25", 0.25}, {"!!int 3", 3.0}};
  for (const auto& [text, value] : numbers) {
    INFO(text);
    REQUIRE(lr.set(text, &config).ok());
    CHECK(config.optim.lr == value);
  }
  for (const char* text : {"0x10",  "0x1p-10", "0o20",     "0b1",   ".inf",    "-.inf",   ".nan",
                           "inf",   "nan",     "infinity", "1e",    "e5",      ".",       "+",
                           "1.2.3", "1_000",   "1e400",    "\"1\"", "!!str 1", "!!bool 1"}) {
    INFO(text);
    absl::Status refused = lr.set(text, &config);
    CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(refused.message()),
               Catch::StartsWith("optim.lr: expected a number, got"));
  }
  const ConfigField& layers = *by_path.at("model.layers");
  REQUIRE(layers.set("!!int 8", &config).ok());
  CHECK(config.model.layers == 8);
  REQUIRE(layers.set("+6", &config).ok());
  CHECK(config.model.layers == 6);
  CHECK(layers.set("'6'", &config).message() ==
        "model.layers: expected an integer, got the string '6'");
  CHECK(layers.set("|\n  6\n", &config).message() ==
        "model.layers: expected an integer, got the string '6\n'");
  REQUIRE(by_path.at("parallel.reshard_after_forward")->set("!!bool false", &config).ok());
  CHECK_FALSE(config.parallel.reshard_after_forward);
  REQUIRE(by_path.at("parallel.pp_split")->set("[!!int 2, 2]", &config).ok());
  CHECK(config.parallel.pp_split == std::vector<int>{2, 2});
}

TEST_CASE("ConfigFields: the parallel fields' types, defaults, words and typed set") {
  std::map<std::string, const ConfigField*> by_path;
  for (const ConfigField& field : ConfigFields()) by_path[field.path] = &field;
  for (const char* path : {"parallel.strategy", "parallel.zero", "parallel.reshard_after_forward",
                           "parallel.dp_replicate", "parallel.dp_shard", "parallel.pp"}) {
    INFO(path);
    REQUIRE(by_path.count(path) == 1);
  }
  const ConfigField& strategy = *by_path["parallel.strategy"];
  CHECK(strategy.words == std::vector<std::string>{"ddp", "fsdp"});
  CHECK(strategy.default_text == "\"ddp\"");
  CHECK(by_path["parallel.zero"]->type == "integer");
  CHECK(by_path["parallel.zero"]->default_text == "3");
  CHECK(by_path["parallel.dp_shard"]->default_text == "0");
  CHECK(by_path["parallel.dp_replicate"]->default_text == "0");

  const ConfigField& reshard = *by_path["parallel.reshard_after_forward"];
  CHECK(reshard.type == "boolean");
  CHECK(reshard.default_text == "true");
  TrainConfig config;
  REQUIRE(reshard.set("false", &config).ok());
  CHECK_FALSE(config.parallel.reshard_after_forward);
  CHECK(reshard.get(config) == "false");
  REQUIRE(reshard.set("true", &config).ok());
  CHECK(config.parallel.reshard_after_forward);
  absl::Status bad = reshard.set("off", &config);
  CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(bad.message() == "parallel.reshard_after_forward: expected true or false, got 'off'");
  CHECK(config.parallel.reshard_after_forward);

  REQUIRE(by_path.count("parallel.pp_split") == 1);
  const ConfigField& split = *by_path["parallel.pp_split"];
  CHECK(split.type == "list of integers");
  CHECK(split.default_text == "[]");
  REQUIRE(split.set("[4, 4, 4]", &config).ok());
  CHECK(config.parallel.pp_split == std::vector<int>{4, 4, 4});
  CHECK(split.get(config) == "[4, 4, 4]");
  REQUIRE(split.set("- 1\n- 3\n", &config).ok());
  CHECK(split.get(config) == "[1, 3]");
  bad = split.set("[1, x]", &config);
  CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(bad.message() == "parallel.pp_split: expected a list of integers, got 'x' at entry 2");
  CHECK(split.get(config) == "[1, 3]");
  REQUIRE(split.set("[]", &config).ok());
  CHECK(config.parallel.pp_split.empty());
}

// A value of `field` other than the one in `base`, valid where the field
// allows more than one value.
std::string OtherValue(const ConfigField& field, const TrainConfig& base) {
  const std::string now = field.get(base);
  if (!field.words.empty()) {
    for (const std::string& word : field.words) {
      if ("\"" + word + "\"" != now) return "\"" + word + "\"";
    }
    return "\"not-" + field.words.front() + "\"";  // one word only: none valid
  }
  if (field.type == "boolean") return now == "true" ? "false" : "true";
  if (field.type == "list of integers") return now == "[]" ? "[2, 2]" : "[]";
  // Doubled, the ZeRO stage (3) is out of range; 2 is a stage too.
  if (field.path == "parallel.zero") return now == "2" ? "1" : "2";
  if (field.type == "integer") {
    const unsigned long long value = std::stoull(now);
    return std::to_string(value == 0 ? 1 : value * 2);
  }
  if (field.type == "number") {
    // Halved stays in every range (min_lr below lr, betas below 1).
    const double value = std::strtod(now.c_str(), nullptr);
    char text[64];
    std::snprintf(text, sizeof(text), "%.17g", value == 0 ? 1e-5 : value / 2);
    return text;
  }
  return "\"changed/" + field.path + "\"";
}

TEST_CASE("every field: a changed value round-trips, and operator== sees it") {
  // Every check across fields satisfied whatever one field becomes.
  absl::StatusOr<TrainConfig> parsed_base = ParseConfig(
      "data:\n  train: base_*.bin\n  val: val_*.bin\ncheckpoint:\n  dir: ckpt\n", "base.yaml", "");
  REQUIRE(parsed_base.ok());
  const TrainConfig base = *parsed_base;
  for (const ConfigField& field : ConfigFields()) {
    const std::string value = OtherValue(field, base);
    INFO(field.path << " = " << value);
    TrainConfig changed = base;
    REQUIRE(field.set(value, &changed).ok());
    CHECK(field.get(changed) != field.get(base));
    CHECK_FALSE(changed == base);
    for (const ConfigField& other : ConfigFields()) {
      if (other.path != field.path) CHECK(other.get(changed) == other.get(base));
    }
    const std::string yaml = ConfigToYaml(changed);
    INFO(yaml);
    const std::string key = field.path.substr(field.path.rfind('.') + 1);
    CHECK_THAT(yaml, Catch::Contains(key + ": " + field.get(changed) + "\n"));
    absl::StatusOr<TrainConfig> parsed = ParseConfig(yaml, changed.source, "");
    // A pipeline of 2 stages needs 2 micro-batches a step under 1f1b, and a
    // split and micro-batches need a pipeline (pp > 1): their checks name
    // the field they look at.
    std::string named = field.path;
    if (field.path == "parallel.pp") named = "parallel.microbatches";
    const bool refused = field.path == "parallel.pp" || field.path == "parallel.pp_split" ||
                         field.path == "parallel.microbatches";
    if (field.words.size() == 1 || refused) {
      // No other valid value: the reader did read it, and the check named it.
      REQUIRE_FALSE(parsed.ok());
      CHECK_THAT(std::string(parsed.status().message()), Catch::Contains(named + ": "));
    } else {
      REQUIRE(parsed.ok());
      CHECK(*parsed == changed);
    }
  }
  TrainConfig renamed = base;
  renamed.source = "other.yaml";
  CHECK_FALSE(renamed == base);
}

// ---- docs/yaml-schema.md against ConfigFields

std::vector<std::string> Lines(const std::string& file) {
  std::ifstream in(RunfilePath(file));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  REQUIRE_FALSE(lines.empty());
  return lines;
}

std::string Trim(const std::string& text) {
  const size_t begin = text.find_first_not_of(' ');
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(' ') - begin + 1);
}

std::string Unquote(std::string text, char quote) {
  if (text.size() >= 2 && text.front() == quote && text.back() == quote) {
    text = text.substr(1, text.size() - 2);
  }
  return text;
}

struct DocRow {
  int line;
  std::string type;
  std::string default_text;
};

// Every row of the doc's "| field | type | default | constraint |" tables,
// by path: a row's field under "## `section`" is section.field; a top-level
// string is a row whose field is the section's own name.
std::map<std::string, DocRow> DocumentedFields(const std::vector<std::string>& lines) {
  std::map<std::string, DocRow> rows;
  std::string section;
  bool in_table = false;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    if (line.rfind("## ", 0) == 0) {
      section = line.rfind("## `", 0) == 0 ? line.substr(4, line.find('`', 4) - 4) : "";
      in_table = false;
      continue;
    }
    if (line.rfind("| field | type | default |", 0) == 0) {
      INFO("docs/yaml-schema.md:" << i + 1 << ": a field table outside a \"## `section`\"");
      CHECK_FALSE(section.empty());
      in_table = true;
      ++i;  // the | --- | line
      continue;
    }
    if (line.rfind("|", 0) != 0) in_table = false;
    if (!in_table) continue;
    std::vector<std::string> cells;
    std::stringstream row(line.substr(1));
    for (std::string cell; std::getline(row, cell, '|');) cells.push_back(Trim(cell));
    REQUIRE(cells.size() >= 3);
    const std::string field = Unquote(cells[0], '`');
    const std::string path = field == section ? field : section + "." + field;
    INFO("docs/yaml-schema.md:" << i + 1 << ": " << path << " is documented twice");
    CHECK(rows.emplace(path, DocRow{static_cast<int>(i + 1), cells[1], cells[2]}).second);
  }
  return rows;
}

TEST_CASE("docs/yaml-schema.md's field tables list exactly ConfigFields") {
  std::map<std::string, DocRow> documented = DocumentedFields(Lines("docs/yaml-schema.md"));
  for (const ConfigField& field : ConfigFields()) {
    auto it = documented.find(field.path);
    if (it == documented.end()) {
      FAIL_CHECK(field.path << " is a field (worker/config/fields.h) that docs/yaml-schema.md's "
                               "tables do not document");
      continue;
    }
    const DocRow& row = it->second;
    INFO("docs/yaml-schema.md:" << row.line << ": " << field.path);
    CHECK(row.type == field.type);
    const std::string doc_default = Unquote(Unquote(row.default_text, '`'), '"');
    if (field.required) {
      CHECK(row.default_text == "—");  // no default
    } else if (field.type == "number") {
      CHECK(std::strtod(doc_default.c_str(), nullptr) ==
            std::strtod(field.default_text.c_str(), nullptr));
    } else {
      CHECK(doc_default == Unquote(field.default_text, '"'));
    }
    documented.erase(it);
  }
  for (const auto& [path, row] : documented) {
    FAIL_CHECK("docs/yaml-schema.md:" << row.line << ": documents " << path
                                      << ", which is no field (worker/config/fields.h)");
  }
}

TEST_CASE("docs/yaml-schema.md's complete example is ConfigToYaml's output") {
  const std::vector<std::string> lines = Lines("docs/yaml-schema.md");
  size_t at = 0;
  while (at < lines.size() && lines[at] != "## A complete example") ++at;
  while (at < lines.size() && lines[at] != "```yaml") ++at;
  REQUIRE(at < lines.size());
  // The example without its comments, and which lines had one (a value
  // other than the default says so in a comment).
  std::string example;
  std::vector<std::pair<std::string, bool>> values;  // line, commented
  for (++at; at < lines.size() && lines[at] != "```"; ++at) {
    std::string line = lines[at];
    const size_t comment = line.find(" #");
    const bool commented = comment != std::string::npos;
    if (commented) line = line.substr(0, comment);
    line = line.substr(0, line.find_last_not_of(' ') + 1);
    example += line + "\n";
    values.emplace_back(line, commented);
  }
  absl::StatusOr<TrainConfig> config = ParseConfig(example, "", "");
  REQUIRE(config.ok());
  CHECK(ConfigToYaml(*config) == example);

  std::map<std::string, std::string> defaults;
  for (const ConfigField& field : ConfigFields()) defaults[field.path] = field.default_text;
  std::string section;
  for (const auto& [line, commented] : values) {
    const size_t colon = line.find(':');
    if (colon + 1 == line.size()) {
      section = line.substr(0, colon);
      continue;
    }
    const bool nested = line.rfind("  ", 0) == 0;
    const std::string path =
        nested ? section + "." + Trim(line.substr(0, colon)) : line.substr(0, colon);
    INFO("the example's " << path << " is not the default and says nothing");
    if (!commented) CHECK(Trim(line.substr(colon + 1)) == defaults[path]);
  }
}

}  // namespace
}  // namespace muster::worker
