// The training loop on tiny models and tiny shards: it learns, gradient
// accumulation is exact, runs are deterministic, evaluation and logging
// happen at the documented steps, and the JSONL file says what happened.
#include "worker/trainer/trainer.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/checkpoint/env.h"
#include "worker/data/data.h"
#include "worker/trainer/generate.h"
#include "worker/trainer/metrics.h"

namespace muster::worker {
namespace {

// Each byte names the next. The period (13) is prime to T (16), so windows
// start at every phase and the model must learn the bigrams, not positions.
constexpr char kPattern[] = "abcdefghijklm";

std::string FreshDir(const std::string& name) {
  static int counter = 0;
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base ? base : "/tmp", "/trainer_test_", name, "_", ++counter);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Train and val shards of kPattern repeated (val starts mid-pattern so its
// windows differ from train's).
void WritePatternShards(const std::string& dir) {
  std::vector<uint16_t> train, val;
  const int period = sizeof(kPattern) - 1;
  for (int i = 0; i < 8000; ++i) train.push_back(kPattern[i % period]);
  for (int i = 0; i < 2000; ++i) val.push_back(kPattern[(i + 5) % period]);
  REQUIRE(WriteTokenShard(dir + "/train_000.bin", train).ok());
  REQUIRE(WriteTokenShard(dir + "/val_000.bin", val).ok());
}

// L=2, C=32, NH=2, T=16, B=4, byte vocabulary, constant lr.
TrainConfig TinyConfig(const std::string& dir) {
  TrainConfig config;
  config.model.layers = 2;
  config.model.heads = 2;
  config.model.dim = 32;
  config.model.vocab = 256;
  config.model.seq_len = 16;
  config.data.train = dir + "/train_*.bin";
  config.data.val = dir + "/val_*.bin";
  config.data.micro_batch = 4;
  config.optim.lr = 1e-2;
  config.optim.schedule = "constant";
  config.optim.grad_clip = 1.0;
  config.train.steps = 10;
  config.train.log_every = 5;
  config.train.eval_every = 0;
  config.train.eval_batches = 2;
  config.device = "cpu";
  return config;
}

// Human lines go to a scratch file, not the test log.
TrainerOptions QuietOptions() {
  TrainerOptions options;
  options.log = std::tmpfile();
  options.progress_bar = false;
  return options;
}

std::unique_ptr<Trainer> MakeTrainer(const TrainConfig& config,
                                     TrainerOptions options = QuietOptions()) {
  auto trainer = Trainer::Create(config, std::move(options));
  INFO(trainer.status().ToString());
  REQUIRE(trainer.ok());
  return *std::move(trainer);
}

std::vector<float> StepLosses(Trainer* trainer, int steps) {
  std::vector<float> losses;
  for (int i = 0; i < steps; ++i) {
    auto metrics = trainer->Step();
    REQUIRE(metrics.ok());
    losses.push_back(metrics->loss);
  }
  return losses;
}

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The value of "key" in a flat JSON object line, as written.
std::string JsonField(const std::string& line, const std::string& key) {
  std::smatch match;
  std::regex field("\"" + key + "\":([^,}]+)");
  if (!std::regex_search(line, match, field)) return "";
  return match[1];
}

TEST_CASE("the loss falls in 40 steps on a pattern, and greedy sampling continues it") {
  std::string dir = FreshDir("learns");
  WritePatternShards(dir);
  TrainConfig config = TinyConfig(dir);
  config.train.steps = 40;
  auto trainer = MakeTrainer(config);
  std::vector<float> losses = StepLosses(trainer.get(), config.train.steps);
  CHECK(losses.front() > 4.5f);  // about ln(256) = 5.55 at initialisation
  float last = (losses[35] + losses[36] + losses[37] + losses[38] + losses[39]) / 5;
  INFO("first " << losses.front() << " last " << last);
  CHECK(last < 0.5f);
  CHECK(trainer->state().step == 40);
  CHECK(trainer->state().sample_index == 40u * 4);

  GenerateOptions sample;
  sample.prompt = "efg";
  sample.tokens = 8;
  sample.temperature = 0;
  auto text = GenerateText(trainer->model(), sample);
  REQUIRE(text.ok());
  CHECK(*text == "efghijklmab");
}

TEST_CASE("grad accumulation A with micro-batch B equals batch A*B") {
  std::string dir = FreshDir("accum");
  WritePatternShards(dir);
  TrainConfig accumulated = TinyConfig(dir);
  accumulated.data.micro_batch = 2;
  accumulated.data.grad_accumulation = 2;
  TrainConfig whole = TinyConfig(dir);
  whole.data.micro_batch = 4;
  whole.data.grad_accumulation = 1;
  auto a = MakeTrainer(accumulated);
  auto b = MakeTrainer(whole);
  std::vector<float> la = StepLosses(a.get(), 4);
  std::vector<float> lb = StepLosses(b.get(), 4);
  for (int i = 0; i < 4; ++i) {
    INFO("step " << i << ": " << la[i] << " vs " << lb[i]);
    CHECK(std::fabs(la[i] - lb[i]) <= 1e-5 * std::fabs(lb[i]));
  }
  CHECK(a->state().sample_index == b->state().sample_index);
}

TEST_CASE("two runs of one config write bitwise-identical losses") {
  std::string dir = FreshDir("determinism");
  WritePatternShards(dir);
  std::vector<std::vector<std::string>> runs;
  for (int run = 0; run < 2; ++run) {
    TrainConfig config = TinyConfig(dir);
    config.train.steps = 12;
    config.train.log_every = 1;
    config.train.eval_every = 4;
    config.train.metrics_file = absl::StrCat(dir, "/run", run, "/metrics.jsonl");
    auto trainer = MakeTrainer(config);
    REQUIRE(trainer->Run().ok());
    trainer.reset();  // closes the file
    runs.push_back(ReadLines(config.train.metrics_file));
  }
  REQUIRE(runs[0].size() == 12 + 3);
  REQUIRE(runs[0].size() == runs[1].size());
  for (size_t i = 0; i < runs[0].size(); ++i) {
    INFO(runs[0][i] << "\n" << runs[1][i]);
    for (const char* key : {"step", "loss", "lr", "grad_norm", "val_loss"}) {
      CHECK(JsonField(runs[0][i], key) == JsonField(runs[1][i], key));
    }
  }
}

TEST_CASE("evaluation and log lines come at the documented steps") {
  CHECK(ShouldLog(1, 7, 3));
  CHECK_FALSE(ShouldLog(2, 7, 3));
  CHECK(ShouldLog(6, 7, 3));
  CHECK(ShouldLog(7, 7, 3));
  CHECK_FALSE(ShouldEvaluate(7, 7, 0));
  CHECK(ShouldEvaluate(7, 7, 3));

  std::string dir = FreshDir("eval");
  WritePatternShards(dir);
  TrainConfig config = TinyConfig(dir);
  config.train.steps = 7;
  config.train.log_every = 3;
  config.train.eval_every = 3;
  std::vector<int> evals, steps;
  TrainerOptions options = QuietOptions();
  options.on_eval = [&](const EvalMetrics& eval) {
    evals.push_back(eval.step);
    CHECK(std::isfinite(eval.val_loss));
    CHECK(eval.val_loss > 0);
  };
  options.on_step = [&](const StepMetrics& step) { steps.push_back(step.step); };
  auto trainer = MakeTrainer(config, options);
  REQUIRE(trainer->has_validation());
  REQUIRE(trainer->Run().ok());
  CHECK(evals == std::vector<int>{3, 6, 7});
  CHECK(steps == std::vector<int>{1, 2, 3, 4, 5, 6, 7});

  // Evaluation reads fixed samples and changes nothing: twice, same loss.
  auto first = trainer->Evaluate();
  auto second = trainer->Evaluate();
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(*first == *second);

  config.data.val.clear();
  auto without_val = MakeTrainer(config);
  CHECK_FALSE(without_val->has_validation());
  CHECK(without_val->Evaluate().status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("the metrics file holds one object per logged step and per evaluation") {
  std::string dir = FreshDir("jsonl");
  WritePatternShards(dir);
  TrainConfig config = TinyConfig(dir);
  config.train.steps = 10;
  config.train.log_every = 5;
  config.train.eval_every = 5;
  config.train.metrics_file = dir + "/out/metrics.jsonl";  // out/ does not exist yet
  TrainerOptions options = QuietOptions();
  std::string log_path = dir + "/log.txt";
  options.log = std::fopen(log_path.c_str(), "w");
  auto trainer = MakeTrainer(config, options);
  REQUIRE(trainer->Run().ok());
  trainer.reset();
  std::fclose(options.log);

  std::vector<std::string> lines = ReadLines(config.train.metrics_file);
  // steps 1, 5, eval 5, 10, eval 10
  REQUIRE(lines.size() == 5);
  std::regex step_line(
      R"(\{"step":\d+,"loss":[-0-9.e+]+,"lr":[-0-9.e+]+,"grad_norm":[-0-9.e+]+,"ms":[-0-9.e+]+,"tokens_per_s":[-0-9.e+]+,"mfu":[-0-9.e+]+,"comm_wait_ms":[0-9.e+-]+\})");
  std::regex eval_line(R"(\{"step":\d+,"val_loss":[-0-9.e+]+\})");
  CHECK(std::regex_match(lines[0], step_line));
  CHECK(JsonField(lines[0], "step") == "1");
  CHECK(JsonField(lines[1], "step") == "5");
  CHECK(std::regex_match(lines[2], eval_line));
  CHECK(JsonField(lines[2], "step") == "5");
  CHECK(std::regex_match(lines[3], step_line));
  CHECK(std::regex_match(lines[4], eval_line));
  CHECK(std::stof(JsonField(lines[0], "lr")) == Approx(1e-2));
  CHECK(std::stof(JsonField(lines[3], "tokens_per_s")) > 0);
  CHECK(std::stof(JsonField(lines[3], "mfu")) > 0);
  CHECK(std::stof(JsonField(lines[3], "mfu")) < 1);
  // One process: its strategy waits on no collective, and the step line
  // leaves the wait out.
  CHECK(JsonField(lines[3], "comm_wait_ms") == "0");

  std::vector<std::string> human = ReadLines(log_path);
  REQUIRE(human.size() == 5);
  std::regex human_step(
      R"(step 10/10 \| loss \d+\.\d{4} \| lr 1\.0e-02 \| norm \d+\.\d\d \| \d+ ms \| \d+ tok/s \| MFU \d+\.\d%)");
  CHECK(std::regex_match(human[3], human_step));
}

TEST_CASE(
    "a metrics file on a full disk stops the run as a full disk, and one not writable names why") {
  std::string dir = FreshDir("metrics_full");
  WritePatternShards(dir);
  TrainConfig config = TinyConfig(dir);
  config.train.steps = 4;
  config.train.log_every = 1;
  // /dev/full: every write fails with ENOSPC, as a full disk's does.
  config.train.metrics_file = "/dev/full";
  auto trainer = MakeTrainer(config, QuietOptions());
  const absl::Status status = trainer->Run();
  INFO(status.ToString());
  CHECK(status.code() == absl::StatusCode::kResourceExhausted);
  CHECK(IsNoSpace(status));  // not restartable (worker_main.cc)
  CHECK(status.message() ==
        "train.metrics_file: writing /dev/full failed: No space left on device");

  // A path through a file is the config's mistake: INVALID_ARGUMENT, with the OS's reason.
  std::ofstream(dir + "/plain") << "x";
  config.train.metrics_file = dir + "/plain/metrics.jsonl";
  auto refused = Trainer::Create(config, QuietOptions());
  INFO(refused.status().ToString());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(refused.status().message() == "train.metrics_file: cannot open " + dir +
                                          "/plain/metrics.jsonl for writing: Not a directory");
}

TEST_CASE("validation or training data smaller than one pass or step says so at the start") {
  std::string dir = FreshDir("small_val");
  WritePatternShards(dir);  // val: 2000 tokens, (2000 - 1) / 16 = 124 windows
  TrainConfig config = TinyConfig(dir);
  config.train.eval_every = 5;
  auto created_log = [&](int eval_batches) {
    config.train.eval_batches = eval_batches;
    const std::string log_path = dir + "/log.txt";
    TrainerOptions options = QuietOptions();
    options.log = std::fopen(log_path.c_str(), "w");
    MakeTrainer(config, options).reset();
    std::fclose(options.log);
    std::ifstream in(log_path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  // 40 batches of 4 samples: 160 > 124.
  CHECK(created_log(40) ==
        "data: warning: data.val holds 124 windows of seq_len + 1 tokens, fewer than the 160 "
        "samples a validation pass reads (train.eval_batches 40 x data.micro_batch 4 x 1 replica), "
        "so each pass reads some more than once; train.eval_batches 31 reads each at most once\n");
  CHECK(created_log(31).empty());  // 124 samples: each window once

  // Training data smaller than one optimizer step: train holds (8000 - 1) / 16 = 499 windows.
  config.data.val.clear();
  config.data.grad_accumulation = 125;  // 500 samples a step
  CHECK(created_log(0) ==
        "data: warning: data.train holds 499 windows of seq_len + 1 tokens, fewer than the 500 "
        "samples one optimizer step reads (125 micro-batches of data.micro_batch 4, x 1 replica), "
        "so every step reads some more than once\n");
  config.data.grad_accumulation = 124;
  CHECK(created_log(0).empty());
}

TEST_CASE("a resumed run's metrics file is cut back to the step it resumed from") {
  std::string dir = FreshDir("trim");
  const std::string path = dir + "/metrics.jsonl";
  auto write = [&](const std::string& text) { std::ofstream(path, std::ios::binary) << text; };
  auto read = [&] {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string kept =
      "{\"step\":1,\"loss\":5}\n{\"step\":5,\"loss\":4}\n{\"step\":5,\"val_loss\":4.5}\n"
      "{\"note\":\"no step\"}\n{\"step\":10,\"loss\":3}\n{\"step\":10,\"val_loss\":3.5}\n";

  SECTION("lines after the step, and a torn last line, are cut; new lines follow") {
    // Killed after step 20, partway through writing step 21's line.
    write(kept + "{\"step\":15,\"loss\":2}\n{\"step\":15,\"val_loss\":2.5}\n" +
          "{\"step\":20,\"loss\":1}\n{\"step\":21,\"lo");
    MetricsTrim trimmed;
    auto writer = MetricsWriter::Open(path, 10, &trimmed);
    REQUIRE(writer.ok());
    CHECK(trimmed.lines == 4);
    CHECK(trimmed.first_step == 15);
    CHECK(trimmed.last_step == 21);
    REQUIRE((*writer)->Write("{\"step\":15,\"loss\":2}").ok());
    CHECK(read() == kept + "{\"step\":15,\"loss\":2}\n");
  }
  SECTION("a step number is read whole: step 100 is after step 10") {
    write(kept + "{\"step\":100,\"loss\":1}\n");
    MetricsTrim trimmed;
    REQUIRE(MetricsWriter::Open(path, 10, &trimmed).ok());
    CHECK(trimmed.lines == 1);
    CHECK(trimmed.first_step == 100);
    CHECK(read() == kept);
  }
  SECTION("only a torn line: it is cut, and named as torn") {
    write(kept + "{\"st");
    MetricsTrim trimmed;
    REQUIRE(MetricsWriter::Open(path, 10, &trimmed).ok());
    CHECK(trimmed.lines == 1);
    CHECK(trimmed.first_step == 0);
    CHECK(read() == kept);
  }
  SECTION("nothing after the step: the file is left as it was") {
    write(kept);
    MetricsTrim trimmed;
    REQUIRE(MetricsWriter::Open(path, 10, &trimmed).ok());
    CHECK(trimmed.lines == 0);
    CHECK(read() == kept);
  }
  SECTION("resumed, but no file yet: one is made") {
    MetricsTrim trimmed;
    auto writer = MetricsWriter::Open(dir + "/new/metrics.jsonl", 10, &trimmed);
    REQUIRE(writer.ok());
    CHECK(trimmed.lines == 0);
    CHECK(std::filesystem::exists(dir + "/new/metrics.jsonl"));
  }
  SECTION("a run from step 0 starts the file afresh, and counts what it dropped") {
    write(kept);
    MetricsTrim trimmed;
    REQUIRE(MetricsWriter::Open(path, std::nullopt, &trimmed).ok());
    CHECK(read().empty());
    CHECK(trimmed.dropped_lines == 6);
  }
}

TEST_CASE("a metrics file of another run's lineage is kept whole, not cut or truncated") {
  // A run forked from step 20 of another (checkpoint.resume: a path), then
  // the original resumed from its step 30: the fork used to cut the
  // original's steps 21..30 for good, and the original appended 31.. after
  // the fork's 21..25.
  std::string dir = FreshDir("metrics_lineage");
  const std::string path = dir + "/metrics.jsonl";
  auto read = [](const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  auto lines = [](const char* run, int first, int last) {
    std::string text;
    for (int step = first; step <= last; ++step) {
      absl::StrAppend(&text, "{\"step\":", step, ",\"run\":\"", run, "\"}\n");
    }
    return text;
  };
  auto write = [&](MetricsWriter& writer, const char* run, int first, int last) {
    for (int step = first; step <= last; ++step) {
      REQUIRE(writer.Write(absl::StrCat("{\"step\":", step, ",\"run\":\"", run, "\"}")).ok());
    }
  };
  {
    auto original = MetricsWriter::Open(path, std::nullopt, nullptr, "aaaa");
    REQUIRE(original.ok());
    write(**original, "a", 1, 30);
  }
  const std::string aside_a = dir + "/metrics.lineage_aaaa.jsonl";
  const std::string aside_b = dir + "/metrics.lineage_bbbb.jsonl";
  CHECK(MetricsAsidePath(path, "aaaa") == aside_a);
  {
    MetricsTrim trimmed;
    auto fork = MetricsWriter::Open(path, 20, &trimmed, "bbbb");
    REQUIRE(fork.ok());
    CHECK(trimmed.set_aside == aside_a);
    CHECK(trimmed.set_aside_lineage == "aaaa");
    CHECK(trimmed.restored.empty());
    CHECK(read(aside_a) == lines("a", 1, 30));  // whole
    CHECK(read(path) == lines("a", 1, 20));     // the fork's history
    write(**fork, "b", 21, 25);
  }
  {
    MetricsTrim trimmed;
    auto back = MetricsWriter::Open(path, 30, &trimmed, "aaaa");
    REQUIRE(back.ok());
    CHECK(trimmed.set_aside == aside_b);
    CHECK(trimmed.restored == aside_a);
    CHECK(trimmed.lines == 0);
    write(**back, "a", 31, 32);
  }
  CHECK(read(path) == lines("a", 1, 32));
  CHECK(read(aside_b) == lines("a", 1, 20) + lines("b", 21, 25));
  CHECK(!std::filesystem::exists(aside_a));

  SECTION("a fresh start keeps the previous run's file instead of truncating it") {
    REQUIRE(MetricsWriter::Open(path, std::nullopt, nullptr, "cccc").ok());
    CHECK(read(path).empty());
    CHECK(read(aside_a) == lines("a", 1, 32));
  }
  SECTION("the same run starting again from step 0 truncates its own file") {
    REQUIRE(MetricsWriter::Open(path, std::nullopt, nullptr, "aaaa").ok());
    CHECK(read(path).empty());
    CHECK(!std::filesystem::exists(aside_a));
  }
  SECTION("a device is no run's file: nothing is recorded beside it, nothing read from it") {
    for (int resumed : {0, 1}) {
      auto null = MetricsWriter::Open("/dev/null", resumed ? std::optional<int>(5) : std::nullopt,
                                      nullptr, "aaaa");
      REQUIRE(null.ok());
      auto full = MetricsWriter::Open("/dev/full", resumed ? std::optional<int>(5) : std::nullopt,
                                      nullptr, "aaaa");  // reads zeros for ever
      REQUIRE(full.ok());
    }
    CHECK(!std::filesystem::exists("/dev/null.lineage"));
    CHECK(!std::filesystem::exists("/dev/full.lineage"));
  }
  SECTION("a file with no record of its lineage is taken as the run's own") {
    std::filesystem::remove(path + ".lineage");
    MetricsTrim trimmed;
    REQUIRE(MetricsWriter::Open(path, 30, &trimmed, "dddd").ok());
    CHECK(trimmed.set_aside.empty());
    CHECK(trimmed.lines == 2);
    CHECK(read(path) == lines("a", 1, 30));
  }
}

TEST_CASE("sampling is reproducible and byte-level only") {
  std::string dir = FreshDir("generate");
  WritePatternShards(dir);
  auto trainer = MakeTrainer(TinyConfig(dir));
  GenerateOptions sample;
  sample.prompt = "";
  sample.tokens = 40;  // more than seq_len: the window slides
  sample.temperature = 1.0f;
  sample.seed = 7;
  auto a = GenerateText(trainer->model(), sample);
  auto b = GenerateText(trainer->model(), sample);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->size() == 40);
  CHECK(*a == *b);

  TrainConfig big_vocab = TinyConfig(dir);
  big_vocab.model.vocab = 512;
  auto other = MakeTrainer(big_vocab);
  CHECK(GenerateText(other->model(), sample).status().code() == absl::StatusCode::kInvalidArgument);
}

// "cpu", and "auto" where it resolves to the CPU (no GPU here).
std::vector<std::string> DevicesThatAreTheCpu() {
  std::vector<std::string> devices = {"cpu"};
  if (auto resolved = ResolveDevice("auto"); resolved.ok() && *resolved == Device::kCpu) {
    devices.push_back("auto");
  }
  return devices;
}

TEST_CASE("a precision the device cannot do is INVALID_ARGUMENT naming precision") {
  std::string dir = FreshDir("precision");
  WritePatternShards(dir);
  TrainConfig config = TinyConfig(dir);  // device: cpu
  // ParseConfig refuses cpu with tf32 or bf16 already; a config built in
  // code (or device auto on a machine without a GPU) meets the trainer's
  // check.
  const std::vector<std::string> devices = DevicesThatAreTheCpu();
  for (const std::string& device : devices) {
    for (const char* precision : {"tf32", "bf16"}) {
      INFO("device " << device << ", precision " << precision);
      config.device = device;
      config.precision = precision;
      auto trainer = Trainer::Create(config, QuietOptions());
      REQUIRE_FALSE(trainer.ok());
      CHECK(trainer.status().code() == absl::StatusCode::kInvalidArgument);
      CHECK_THAT(std::string(trainer.status().message()),
                 Catch::StartsWith(absl::StrCat("precision: ", precision, " needs device cuda")));
    }
  }

  // auto on the CPU is fp32, the precision the CPU model computes in.
  config.device = "cpu";
  config.precision = "auto";
  CHECK(MakeTrainer(config)->model()->precision() == Precision::kFp32);
}

TEST_CASE("an attention the device or precision cannot run is INVALID_ARGUMENT naming attention") {
  std::string dir = FreshDir("attention");
  WritePatternShards(dir);
  TrainConfig config = TinyConfig(dir);  // device: cpu
  // ParseConfig refuses cudnn with an explicit cpu already; a config built
  // in code (or device auto on a machine without a GPU) meets the
  // trainer's check.
  const std::vector<std::string> devices = DevicesThatAreTheCpu();
  for (const std::string& device : devices) {
    INFO("device " << device);
    config.device = device;
    config.precision = "auto";
    for (const std::string attention : {"cudnn", "gemm"}) {
      config.attention = attention;
      auto trainer = Trainer::Create(config, QuietOptions());
      REQUIRE_FALSE(trainer.ok());
      CHECK(trainer.status().code() == absl::StatusCode::kInvalidArgument);
      CHECK_THAT(std::string(trainer.status().message()),
                 Catch::StartsWith("attention: " + attention + " needs device cuda"));
    }
  }

  // auto and muster are muster's own attention, on any device.
  config.device = "cpu";
  for (const char* attention : {"auto", "muster"}) {
    INFO(attention);
    config.attention = attention;
    CHECK(MakeTrainer(config)->model()->attention() == Attention::kMuster);
  }
}

TEST_CASE("the CPU peak for MFU says its clock, vector unit and GEMM kernels") {
  unsetenv("MUSTER_PEAK_FLOPS");
  std::string description;
  const double peak = PeakFlops(Device::kCpu, Precision::kFp32, &description);
  INFO(description);
  // threads x clock x FLOPs per cycle: at least one 1 GHz SSE core.
  CHECK(peak >= 8e9);
  // The clock is in the sum: "N cores x F GHz ... = P GFLOP/s".
  std::smatch parts;
  REQUIRE(std::regex_search(
      description, parts,
      std::regex(R"(^(\d+) cores x (\d+\.\d+) GHz.* x (\d+) FLOP/cycle .* = (\d+\.\d) GFLOP/s)")));
  const double product = std::stod(parts[1]) * std::stod(parts[2]) * 1e9 * std::stod(parts[3]);
  CHECK(std::fabs(product - peak) <= 0.01 * peak);  // the GHz shown are rounded
  CHECK(std::fabs(std::stod(parts[4]) * 1e9 - peak) <= 0.05e9);
  CHECK_THAT(description, Catch::Contains("GEMMs: OpenBLAS "));
  CHECK_THAT(description, Catch::Contains(" kernels"));

  setenv("MUSTER_PEAK_FLOPS", "1.5e11", 1);
  CHECK(PeakFlops(Device::kCpu, Precision::kFp32, &description) == 1.5e11);
  CHECK(description == "MUSTER_PEAK_FLOPS=1.5e+11");
  unsetenv("MUSTER_PEAK_FLOPS");
}

}  // namespace
}  // namespace muster::worker
