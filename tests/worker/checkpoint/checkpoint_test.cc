// Checkpoints in one process: the manifest and retention rules, exact
// resume at the same world size, resharding across world sizes with
// threads as ranks, corrupt and torn checkpoints, bad input, and failed
// background writes.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/worker/checkpoint/tiny_job.h"
#include "tests/worker/thread_ranks.h"
#include "worker/checkpoint/dir_lock.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/layout.h"
#include "worker/checkpoint/manifest.h"
#include "worker/checkpoint/reader.h"
#include "worker/checkpoint/retention.h"
#include "worker/checkpoint/writer.h"
#include "worker/data/data.h"
#include "worker/trainer/checkpoint_manager.h"
#include "worker/trainer/trainer.h"
#include "worker/trainer/training_settings.h"

namespace muster::worker {
namespace {

namespace fs = std::filesystem;

std::string FreshDir(const std::string& name) { return testing::FreshDir("checkpoint_test", name); }

using testing::TinyConfig;
using testing::WriteShard;

struct RunResult {
  absl::Status status;
  std::vector<float> losses;      // of the steps this run took
  std::vector<float> params;      // at the end
  std::vector<float> m, v;        // at the end
  std::vector<float> params_at4;  // after step 4 (when it was taken)
  TrainState resumed_at;          // the state right after Create
  std::string log;
};

// Creates a Trainer (resuming per config) and runs it; `parallel` may be
// nullptr, `stop_signal` and `env` as in TrainerOptions. Never REQUIREs:
// it may run on a rank thread.
RunResult RunTrainer(const TrainConfig& config, ParallelStrategy* parallel = nullptr,
                     std::function<int()> stop_signal = nullptr, Env* env = nullptr) {
  RunResult result;
  TrainerOptions options;
  options.env = env;
  FILE* log = std::tmpfile();
  options.log = log;
  options.strategy = parallel;
  options.stop_signal = std::move(stop_signal);
  Trainer* trainer_ptr = nullptr;
  options.on_step = [&](const StepMetrics& step) {
    result.losses.push_back(step.loss);
    if (step.step == 4) result.params_at4 = trainer_ptr->model()->CopyParamsToHost();
  };
  auto trainer = Trainer::Create(config, options);
  if (trainer.ok()) {
    trainer_ptr = trainer->get();
    result.resumed_at = (*trainer)->state();
    result.status = (*trainer)->Run();
    result.params = (*trainer)->model()->CopyParamsToHost();
    result.m = (*trainer)->optimizer()->CopyMomentsToHost(false);
    result.v = (*trainer)->optimizer()->CopyMomentsToHost(true);
  } else {
    result.status = trainer.status();
  }
  std::fflush(log);
  std::rewind(log);
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), log)) > 0;)
    result.log.append(buffer, n);
  std::fclose(log);
  return result;
}

// TinyConfig's run, in a fresh directory `name` with the shard, trained to
// its end (REQUIREd): its checkpoints of steps 4, 8 and 12 are in the
// returned config's checkpoint.dir.
TrainConfig TrainedTinyConfig(const std::string& name) {
  const std::string dir = FreshDir(name);
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  REQUIRE(RunTrainer(config).status.ok());
  return config;
}

TEST_CASE("a manifest round-trips through JSON and inconsistent slices are refused") {
  Manifest m;
  m.step = 7;
  m.optimizer_step = 7;
  m.sample_index = 1ull << 40;
  m.data_seed = 1337;
  m.data_windows = 499;
  m.config_hash = 0xfedcba9876543210ull;
  m.world_size = 2;
  m.training = {{"optim.lr", "3e-04"}, {"optim.schedule", "\"cosine\""}, {"odd", "a\\b"}};
  m.files = {{"rank_00000.bin", 12, 0xdeadbeef}, {"rank_00001.bin", 12, 1}};
  std::vector<StateTensor> tensors = {{"params/a", {2, 3}, 0, 6}};
  m.tensors = SliceTensors(tensors, {{FlatRange{0, 3}}, {FlatRange{3, 3}}});
  REQUIRE(m.tensors[0].slices.size() == 2);
  auto parsed = ParseManifest(ManifestToJson(m), "test");
  INFO(parsed.status().ToString());
  REQUIRE(parsed.ok());
  CHECK(parsed->sample_index == m.sample_index);
  CHECK(parsed->data_windows == 499);
  CHECK(parsed->training == m.training);  // in order, quotes and backslashes intact
  CHECK(parsed->config_hash == m.config_hash);
  CHECK(parsed->files[0].crc32 == 0xdeadbeef);
  CHECK(parsed->tensors[0].slices[1].offset == 0);
  CHECK(parsed->tensors[0].slices[1].start == 3);
  CHECK(ManifestToJson(*parsed) == ManifestToJson(m));
  // The manifest's own checksum catches a change to a field no other
  // check can tell (here the sample index, 1099511627776 -> ...7).
  std::string changed = ManifestToJson(m);
  const size_t sample = changed.find("1099511627776");
  REQUIRE(sample != std::string::npos);
  changed[sample + 12] = '7';
  auto refused_change = ParseManifest(changed, "changed");
  CHECK(refused_change.status().code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StartsWith(refused_change.status().message(), "changed: manifest_crc32 is "));
  CHECK(absl::StrContains(refused_change.status().message(),
                          "it was changed or damaged after it was written"));
  // A manifest from before the checksum existed is read without one...
  std::string older = ManifestToJson(m);
  const size_t checksum = older.find("  \"manifest_crc32\"");
  REQUIRE(checksum == 2);  // the second line
  older.erase(checksum, older.find('\n', checksum) + 1 - checksum);
  // ... one from before data_windows existed reads it as 0 (not known).
  const size_t line = older.find("  \"data_windows\"");
  REQUIRE(line != std::string::npos);
  older.erase(line, older.find('\n', line) + 1 - line);
  // ... and one from before the settings were recorded, as none.
  const size_t training = older.find("  \"training\"");
  REQUIRE(training != std::string::npos);
  older.erase(training, older.find('\n', training) + 1 - training);
  auto parsed_older = ParseManifest(older, "older");
  REQUIRE(parsed_older.ok());
  CHECK(parsed_older->data_windows == 0);
  CHECK(parsed_older->training.empty());

  Manifest gap = m;
  gap.tensors[0].slices[1].start = 4;
  CHECK(ParseManifest(ManifestToJson(gap), "gap").status().code() == absl::StatusCode::kDataLoss);
  Manifest past_end = m;
  past_end.files[1].bytes = 8;
  auto bad = ParseManifest(ManifestToJson(past_end), "past_end");
  CHECK(absl::StrContains(bad.status().message(), "rank_00001.bin"));
  auto cut = ParseManifest("{\"format_version\": 1", "cut");
  CHECK(cut.status().code() == absl::StatusCode::kDataLoss);
  // JSON to its reader: the parser underneath is not named.
  CHECK(absl::StrContains(cut.status().message(), "cut: not valid JSON at line 1, column"));
  CHECK_FALSE(absl::StrContains(cut.status().message(), "yaml"));
  auto kind = ParseManifest("{\"format_version\": {\"a\": 1}}", "kind");
  CHECK(kind.status().code() == absl::StatusCode::kDataLoss);
  CHECK_FALSE(absl::StrContains(kind.status().message(), "yaml"));
  CHECK(kind.status().message() ==
        "kind: not a valid checkpoint manifest: field \"format_version\" is not a number");

  // Each file is its slices end to end, as SliceTensors lays them, and
  // nothing is listed twice: a damaged slice would load other floats.
  struct Damage {
    const char* what;
    std::function<void(Manifest&)> edit;
    const char* says;
  };
  for (const Damage& damage : std::vector<Damage>{
           {"a slice moved into the other file",
            [](Manifest& d) { d.tensors[0].slices[1].file = 0; },
            "file rank_00000.bin: tensor params/a's slice at byte 0 overlaps tensor params/a's"},
           {"a slice that starts past a gap",
            [](Manifest& d) {
              d.files[0].bytes = 16;
              d.tensors[0].slices[0].offset = 4;
            },
            "file rank_00000.bin: bytes 0 to 4 belong to no tensor's slice"},
           {"a file longer than its slices", [](Manifest& d) { d.files[1].bytes = 16; },
            "file rank_00001.bin: bytes 12 to 16 belong to no tensor's slice"},
           {"a tensor listed twice", [](Manifest& d) { d.tensors.push_back(d.tensors[0]); },
            "tensor params/a is listed twice"},
           {"a file listed twice", [](Manifest& d) { d.files[1].name = d.files[0].name; },
            "file rank_00000.bin is listed twice"},
           {"a world size that is not the file count", [](Manifest& d) { d.world_size = 5; },
            "world_size 5 but 2 files (one per rank)"},
       }) {
    INFO(damage.what);
    Manifest damaged = m;
    damage.edit(damaged);
    auto refused = ParseManifest(ManifestToJson(damaged), "damaged");
    CHECK(refused.status().code() == absl::StatusCode::kDataLoss);
    CHECK(refused.status().message() == absl::StrCat("damaged: ", damage.says));
  }
  CHECK(ParseStepDirName("step_00000012") == 12);
  CHECK_FALSE(ParseStepDirName(".tmp_step_00000012").has_value());
  CHECK_FALSE(ParseStepDirName("step_12").has_value());
}

TEST_CASE("retention keeps the newest keep_last and the multiples of keep_every") {
  CHECK(StepsToDelete({4, 8, 12, 16, 20}, 3, 0) == std::vector<int>{4, 8});
  CHECK(StepsToDelete({20, 4, 16, 8, 12}, 2, 8) == std::vector<int>{4, 12});
  CHECK(StepsToDelete({4}, 3, 0).empty());
}

TEST_CASE("same world size: a resumed run continues bitwise, losses and weights") {
  std::string dir = FreshDir("exact");
  WriteShard(dir);
  TrainConfig plain = TinyConfig(dir);
  plain.checkpoint.dir.clear();
  plain.checkpoint.every = 0;
  RunResult reference = RunTrainer(plain);
  REQUIRE(reference.status.ok());

  TrainConfig config = TinyConfig(dir);
  RunResult saving = RunTrainer(config);
  REQUIRE(saving.status.ok());
  CHECK(saving.losses == reference.losses);  // saving does not perturb training
  auto listed = ListCheckpoints(Env::Default(), config.checkpoint.dir);
  REQUIRE(listed.ok());
  REQUIRE(listed->size() == 3);  // 4, 8, 12
  CHECK(saving.log.find("resumed") == std::string::npos);

  // The crash: everything after step 4 is lost.
  fs::remove_all(config.checkpoint.dir + "/step_00000008");
  fs::remove_all(config.checkpoint.dir + "/step_00000012");
  RunResult resumed = RunTrainer(config);
  INFO(resumed.log);
  REQUIRE(resumed.status.ok());
  CHECK(resumed.resumed_at.step == 4);
  CHECK(resumed.resumed_at.sample_index == 4u * 4);
  REQUIRE(resumed.losses.size() == 8);
  CHECK(resumed.losses == std::vector<float>(reference.losses.begin() + 4, reference.losses.end()));
  CHECK(resumed.params == reference.params);
  CHECK(resumed.m == reference.m);
  CHECK(resumed.v == reference.v);
}

// A single process whose checkpoint file holds the flat state as five
// ranges out of flat order, and whose resume loads it as four ranges: the
// manager's path for a rank of several ranges (FSDP's), without FSDP.
class ScatteredSingleProcess final : public ParallelStrategy {
 public:
  std::string Describe() const override { return "single process, scattered checkpoint"; }
  const parallel::ParallelDims& dims() const override { return single_.dims(); }
  int rank() const override { return 0; }
  int dp_rank() const override { return 0; }
  parallel::Collectives& control() override { return single_.control(); }
  absl::StatusOr<BuiltModel> Build(const BuildSpec& spec) override { return single_.Build(spec); }
  absl::StatusOr<StepLoss> ForwardBackward(GptModel* model, const MicroBatches& batches) override {
    return RunMicroSteps(this, model, batches, /*backward=*/true);
  }
  absl::StatusOr<StepLoss> ForwardOnly(GptModel* model, const MicroBatches& batches) override {
    return RunMicroSteps(this, model, batches, /*backward=*/false);
  }
  void BeginBackward(GptModel* model, bool last) override { single_.BeginBackward(model, last); }
  absl::Status ReduceGradients(GptModel* model) override { return single_.ReduceGradients(model); }
  absl::StatusOr<double> GradSumOfSquares(GptModel* model) override {
    return single_.GradSumOfSquares(model);
  }
  absl::Status OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                             float grad_scale) override {
    return single_.OptimizerStep(model, optimizer, lr, step, grad_scale);
  }
  void ZeroGrad(GptModel* model) override { single_.ZeroGrad(model); }
  std::vector<std::vector<FlatRange>> CheckpointFiles(uint64_t total) const override {
    const std::vector<FlatRange> fifths = EvenShards(total, 5);
    return {{fifths[3], fifths[0], fifths[4], fifths[1], fifths[2]}};
  }
  std::vector<FlatRange> CheckpointLoad(uint64_t total) const override {
    return EvenShards(total, 4);
  }
  absl::Status StateLoaded(GptModel* model) override {
    ++state_loaded;
    return single_.StateLoaded(model);
  }
  absl::Status AfterRun(GptModel* model) override { return single_.AfterRun(model); }

  int state_loaded = 0;  // calls of StateLoaded

 private:
  SingleProcess single_;
};

TEST_CASE("a file of several ranges saves, and a resume of several ranges continues bitwise") {
  std::string dir = FreshDir("scattered");
  WriteShard(dir);
  TrainConfig plain = TinyConfig(dir);
  plain.checkpoint.dir.clear();
  plain.checkpoint.every = 0;
  RunResult reference = RunTrainer(plain);
  REQUIRE(reference.status.ok());

  TrainConfig config = TinyConfig(dir);
  ScatteredSingleProcess saver;
  RunResult saving = RunTrainer(config, &saver);
  REQUIRE(saving.status.ok());
  CHECK(saving.losses == reference.losses);
  CHECK(saver.state_loaded == 0);  // nothing was resumed
  const std::string step4 = config.checkpoint.dir + "/step_00000004";
  auto manifest = VerifyCheckpoint(Env::Default(), step4);
  REQUIRE(manifest.ok());
  REQUIRE(manifest->files.size() == 1);
  // The flat state, reordered: what the manifest says is where it is.
  auto loaded = GptModel::Create(config.model, 1, Device::kCpu);
  REQUIRE(loaded.ok());
  const std::vector<StateTensor> tensors = StateTensors((*loaded)->stages());
  const uint64_t total = StateFloats(tensors);
  CHECK(manifest->files[0].bytes == total * sizeof(float));
  std::vector<float> flat(total);
  REQUIRE(LoadFlatRange(Env::Default(), step4, *manifest, tensors, 0, total, flat.data()).ok());
  CHECK(std::vector<float>(flat.begin(), flat.begin() + total / 3) == saving.params_at4);

  fs::remove_all(config.checkpoint.dir + "/step_00000008");
  fs::remove_all(config.checkpoint.dir + "/step_00000012");
  SECTION("resumed by ranges into the optimizer") {
    ScatteredSingleProcess resumer;
    RunResult resumed = RunTrainer(config, &resumer);
    INFO(resumed.log);
    REQUIRE(resumed.status.ok());
    CHECK(resumer.state_loaded == 1);
    CHECK(resumed.resumed_at.step == 4);
    CHECK(resumed.losses ==
          std::vector<float>(reference.losses.begin() + 4, reference.losses.end()));
    CHECK(resumed.params == reference.params);
    CHECK(resumed.m == reference.m);
    CHECK(resumed.v == reference.v);
  }
  SECTION("resumed whole, straight into the CPU arrays") {
    RunResult resumed = RunTrainer(config);
    INFO(resumed.log);
    REQUIRE(resumed.status.ok());
    CHECK(resumed.resumed_at.step == 4);
    CHECK(resumed.params == reference.params);
    CHECK(resumed.m == reference.m);
    CHECK(resumed.v == reference.v);
  }
  SECTION("a failed load does not reach StateLoaded") {
    const std::string data = step4 + "/rank_00000.bin";
    {
      std::fstream file(data, std::ios::in | std::ios::out | std::ios::binary);
      char byte = 0;
      file.seekg(100);
      file.read(&byte, 1);
      byte ^= 0x40;
      file.seekp(100);
      file.write(&byte, 1);
    }
    TrainConfig explicit_path = config;
    explicit_path.checkpoint.resume = step4;
    ScatteredSingleProcess resumer;
    RunResult failed = RunTrainer(explicit_path, &resumer);
    CHECK(failed.status.code() == absl::StatusCode::kDataLoss);
    CHECK(absl::StrContains(failed.status.message(), data));
    CHECK(resumer.state_loaded == 0);
  }
}

// Runs `config` on `world` thread-ranks; returns rank 0's result and
// checks every rank succeeded.
RunResult RunWorld(const TrainConfig& config, int world) {
  std::vector<RunResult> results(world);
  testing::RunRanks(world, [&](int rank, ParallelStrategy* parallel) {
    results[rank] = RunTrainer(config, parallel);
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << results[r].status.ToString());
    CHECK(results[r].status.ok());
    CHECK(results[r].params == results[0].params);  // DDP: every rank holds the same state
  }
  return results[0];
}

// The decision every rank reads from the sum of `writes`' votes, summed
// as the all-reduce sums them.
CommitDecision Decide(const std::vector<LocalWrite>& writes) {
  CommitTally sum;
  for (LocalWrite write : writes) {
    const CommitTally vote = CommitVote(write);
    sum.durable += vote.durable;
    sum.failed += vote.failed;
    sum.no_space += vote.no_space;
  }
  return DecideCommit(sum, static_cast<int>(writes.size()));
}

TEST_CASE("the commit vote never averages a failure away") {
  using W = LocalWrite;
  // The case that committed before: a failed rank and a rank still
  // writing averaged to "all durable".
  CHECK(Decide({W::kFailed, W::kWriting}) == CommitDecision::kAbandon);
  CHECK(Decide({W::kWriting, W::kFailed}) == CommitDecision::kAbandon);
  // A full disk is a failure, and counted as such besides.
  CHECK(Decide({W::kDurable, W::kNoSpace}) == CommitDecision::kAbandon);
  CHECK(CommitVote(W::kNoSpace).failed == 1);
  CHECK(CommitVote(W::kNoSpace).no_space == 1);
  CHECK(CommitVote(W::kFailed).no_space == 0);
  // Every combination of every world up to 7 ranks, and a few big worlds.
  const W kStates[] = {W::kWriting, W::kDurable, W::kFailed, W::kNoSpace};
  for (int world = 1; world <= 7; ++world) {
    for (int combination = 0; combination < std::pow(4, world); ++combination) {
      std::vector<W> writes;
      bool failed = false, all_durable = true;
      for (int rank = 0, rest = combination; rank < world; ++rank, rest /= 4) {
        const W write = kStates[rest % 4];
        writes.push_back(write);
        failed |= write == W::kFailed || write == W::kNoSpace;
        all_durable &= write == W::kDurable;
      }
      const CommitDecision expected = failed        ? CommitDecision::kAbandon
                                      : all_durable ? CommitDecision::kCommit
                                                    : CommitDecision::kWait;
      INFO("world " << world << ", combination " << combination);
      CHECK(Decide(writes) == expected);
    }
  }
  for (int world : {1024, 4095, 65536}) {
    INFO("world " << world);
    std::vector<W> writes(world, W::kDurable);
    CHECK(Decide(writes) == CommitDecision::kCommit);
    writes[world / 2] = W::kWriting;
    CHECK(Decide(writes) == CommitDecision::kWait);
    writes[world / 3] = W::kFailed;
    CHECK(Decide(writes) == CommitDecision::kAbandon);
  }
}

TEST_CASE("preemption: one signalled rank stops every rank after the same step, saved") {
  std::string dir = FreshDir("preempt");
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  config.checkpoint.every = 5;  // the preemption's step 7 is not one of them
  TrainConfig plain = config;
  plain.checkpoint.dir.clear();
  plain.checkpoint.every = 0;
  const int world = 2;
  std::vector<RunResult> reference(world);
  testing::RunRanks(world, [&](int rank, ParallelStrategy* parallel) {
    reference[rank] = RunTrainer(plain, parallel);
  });
  REQUIRE(reference[0].status.ok());

  // Rank 1 alone is signalled, during step 7.
  std::vector<RunResult> stopped(world);
  testing::RunRanks(world, [&](int rank, ParallelStrategy* parallel) {
    int polls = 0;
    stopped[rank] = RunTrainer(config, parallel,
                               [&polls, rank] { return rank == 1 && ++polls >= 7 ? SIGTERM : 0; });
  });
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank << ": " << stopped[rank].status.ToString() << "\n" << stopped[rank].log);
    CHECK(stopped[rank].status.code() == absl::StatusCode::kCancelled);
    CHECK(stopped[rank].losses.size() == 7);
  }
  CHECK(absl::StrContains(stopped[1].status.message(),
                          "preempted by SIGTERM after step 7; checkpoint step 7 committed"));
  CHECK(absl::StrContains(stopped[0].status.message(), "preempted by a signal to another rank"));
  CHECK(
      absl::StrContains(stopped[0].log, "preempted: a signal to another rank after step 7 of 12"));
  REQUIRE(VerifyCheckpoint(Env::Default(), config.checkpoint.dir + "/step_00000007").ok());

  // The next run resumes there and ends bitwise where the uninterrupted one ends.
  std::vector<RunResult> resumed(world);
  testing::RunRanks(world, [&](int rank, ParallelStrategy* parallel) {
    resumed[rank] = RunTrainer(config, parallel);
  });
  REQUIRE(resumed[0].status.ok());
  CHECK(resumed[0].resumed_at.step == 7);
  CHECK(resumed[0].losses ==
        std::vector<float>(reference[0].losses.begin() + 7, reference[0].losses.end()));
  CHECK(resumed[0].params == reference[0].params);
  CHECK(resumed[1].params == reference[1].params);
}

TEST_CASE("preemption without checkpoint.dir stops and says nothing was saved") {
  std::string dir = FreshDir("preempt_nodir");
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  config.checkpoint.dir.clear();
  config.checkpoint.every = 0;
  RunResult result = RunTrainer(config, nullptr, [] { return SIGUSR1; });
  CHECK(result.status.code() == absl::StatusCode::kCancelled);
  CHECK(result.status.message() ==
        "preempted by SIGUSR1 after step 1; nothing saved (no checkpoint.dir)");
  CHECK(result.losses.size() == 1);
}

TEST_CASE("an explicit resume path starts a run; a restart continues the run's own progress") {
  std::string dir = FreshDir("resume_path");
  WriteShard(dir);
  TrainConfig first = TinyConfig(dir);
  REQUIRE(RunTrainer(first).status.ok());
  const std::string source = first.checkpoint.dir + "/step_00000004";

  TrainConfig plain = TinyConfig(dir);
  plain.checkpoint.dir = dir + "/plain";
  plain.checkpoint.resume = source;
  plain.checkpoint.every = 0;
  RunResult reference = RunTrainer(plain);  // steps 5..12 from the source, uninterrupted
  REQUIRE(reference.status.ok());

  TrainConfig config = TinyConfig(dir);
  config.checkpoint.dir = dir + "/finetune";
  config.checkpoint.resume = source;
  config.checkpoint.every = 3;
  int polls = 0;
  RunResult stopped = RunTrainer(config, nullptr, [&polls] { return ++polls >= 3 ? SIGTERM : 0; });
  REQUIRE(stopped.status.code() == absl::StatusCode::kCancelled);
  CHECK(stopped.resumed_at.step == 4);
  REQUIRE(VerifyCheckpoint(Env::Default(), config.checkpoint.dir + "/step_00000007").ok());

  // The restart, with the same config: step 7, not the path's step 4.
  RunResult restarted = RunTrainer(config);
  INFO(restarted.log);
  REQUIRE(restarted.status.ok());
  CHECK(restarted.resumed_at.step == 7);
  CHECK(absl::StrContains(restarted.log, "checkpoint.resume " + source +
                                             " started this run at step 4; continuing from the "
                                             "run's own " +
                                             config.checkpoint.dir + "/step_00000007"));
  CHECK(restarted.losses ==
        std::vector<float>(reference.losses.begin() + 3, reference.losses.end()));
  CHECK(restarted.params == reference.params);
}

// The steps of the checkpoints ListCheckpoints finds in `dir`, oldest first.
std::vector<int> ListedSteps(const std::string& dir) {
  auto listed = ListCheckpoints(Env::Default(), dir);
  REQUIRE(listed.ok());
  std::vector<int> steps;
  for (const CheckpointEntry& entry : *listed) steps.push_back(entry.step);
  return steps;
}

TEST_CASE("retention deletes only this run's checkpoints, never the resume source") {
  TrainConfig abandoned = TrainedTinyConfig("retention_lineage");
  const std::string source = abandoned.checkpoint.dir + "/step_00000004";

  // Rewind to step 4 in the same directory, keeping only the newest one.
  TrainConfig rewound = abandoned;
  rewound.checkpoint.resume = source;
  rewound.checkpoint.every = 3;
  rewound.checkpoint.keep_last = 1;
  rewound.train.steps = 11;  // saves 6, 9 and 11
  RunResult result = RunTrainer(rewound);
  INFO(result.log);
  REQUIRE(result.status.ok());
  const std::vector<int> steps = ListedSteps(abandoned.checkpoint.dir);
  // The source and the abandoned run's 8 and 12 are untouched; of this
  // run's 6, 9 and 11, only 11 is kept.
  CHECK(steps == std::vector<int>{4, 8, 11, 12});
  CHECK(VerifyCheckpoint(Env::Default(), source).ok());
  auto source_manifest = ReadManifest(Env::Default(), source);
  auto newest = ReadManifest(Env::Default(), abandoned.checkpoint.dir + "/step_00000011");
  REQUIRE(source_manifest.ok());
  REQUIRE(newest.ok());
  CHECK(newest->lineage == ForkLineage(*source_manifest));
  CHECK(source_manifest->lineage.size() == 16);
}

TEST_CASE("a run forked into the same directory keeps the other run's checkpoint of a step") {
  TrainConfig original = TrainedTinyConfig("fork_collides");
  const std::string ckpt = original.checkpoint.dir;
  auto theirs = ReadManifest(Env::Default(), ckpt + "/step_00000008");
  REQUIRE(theirs.ok());

  // Back to step 4 with another learning rate, saving into the same
  // directory: its steps 8 and 12 meet the original's.
  TrainConfig fork = original;
  fork.checkpoint.resume = ckpt + "/step_00000004";
  fork.optim.lr = 2e-2;
  RunResult result = RunTrainer(fork);
  INFO(result.log);
  REQUIRE(result.status.ok());
  auto ours = ReadManifest(Env::Default(), ckpt + "/step_00000008");
  REQUIRE(ours.ok());
  CHECK(ours->lineage != theirs->lineage);
  for (const std::string step : {"step_00000008", "step_00000012"}) {
    const std::string kept = ckpt + "/" + step + ".lineage_" + theirs->lineage;
    INFO(kept);
    auto verified = VerifyCheckpoint(Env::Default(), kept);
    REQUIRE(verified.ok());
    CHECK(verified->lineage == theirs->lineage);
    CHECK(absl::StrContains(result.log, "kept " + ckpt + "/" + step +
                                            ", another run's checkpoint (lineage " +
                                            theirs->lineage + "), as " + kept));
  }
  // The kept ones are not checkpoints to list, resume or retain.
  CHECK(ListedSteps(ckpt) == std::vector<int>{4, 8, 12});
}

TEST_CASE("retention counts only checkpoints that read: a torn one never pushes one out") {
  TrainConfig config = TrainedTinyConfig("retention_torn");
  const std::string ckpt = config.checkpoint.dir;
  // Step 12's manifest is not one, step 16 has none, and neither does an
  // older step 2: the resume skips 16 and 12 and starts from 8.
  std::ofstream(ckpt + "/step_00000012/manifest.json", std::ios::trunc) << "{ torn";
  fs::create_directories(ckpt + "/step_00000016");
  fs::create_directories(ckpt + "/step_00000002");

  TrainConfig resumed = config;
  resumed.train.steps = 10;
  resumed.checkpoint.every = 2;
  resumed.checkpoint.keep_last = 2;
  RunResult result = RunTrainer(resumed);  // saves 10
  INFO(result.log);
  REQUIRE(result.status.ok());
  CHECK(result.resumed_at.step == 8);
  const std::vector<int> steps = ListedSteps(ckpt);
  // keep_last 2 keeps the two newest that read, 8 and 10; 4 goes, and so
  // does the torn 2 below them. The torn 12 and 16 above the run's newest
  // are left for a save of their step to replace.
  CHECK(steps == std::vector<int>{8, 10, 12, 16});
  CHECK(VerifyCheckpoint(Env::Default(), ckpt + "/step_00000008").ok());
  CHECK(VerifyCheckpoint(Env::Default(), ckpt + "/step_00000010").ok());
  CHECK(absl::StrContains(result.log, "deleted " + ckpt + "/step_00000002 (retention)"));
}

TEST_CASE("retention does not count a checkpoint the resume found corrupt") {
  TrainConfig config = TrainedTinyConfig("retention_corrupt");
  const std::string ckpt = config.checkpoint.dir;
  // A flipped bit in step 12's data: its manifest reads, its CRC does not
  // match, and the resume starts from 8.
  const std::string data = ckpt + "/step_00000012/rank_00000.bin";
  {
    std::fstream file(data, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(100);
    char byte = 0;
    file.get(byte);
    file.seekp(100);
    file.put(static_cast<char>(byte ^ 1));
  }
  TrainConfig resumed = config;
  resumed.train.steps = 14;
  resumed.checkpoint.every = 7;  // saves 14 only
  resumed.checkpoint.keep_last = 2;
  RunResult result = RunTrainer(resumed);
  INFO(result.log);
  REQUIRE(result.status.ok());
  CHECK(result.resumed_at.step == 8);
  CHECK(absl::StrContains(result.log, "skipping " + data));
  // keep_last 2 keeps 8, the one the run resumed from, and 14. Counted,
  // the corrupt 12 pushed 8 out and left one checkpoint that loads.
  CHECK(ListedSteps(ckpt) == std::vector<int>{8, 12, 14});
  CHECK(VerifyCheckpoint(Env::Default(), ckpt + "/step_00000008").ok());
}

TEST_CASE("reshard: saved by 2 thread-ranks, resumed by 1 and by 3") {
  std::string dir = FreshDir("reshard");
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  RunResult two = RunWorld(config, 2);
  REQUIRE(two.status.ok());
  const std::string step4 = config.checkpoint.dir + "/step_00000004";
  auto manifest = VerifyCheckpoint(Env::Default(), step4);
  REQUIRE(manifest.ok());
  CHECK(manifest->world_size == 2);
  REQUIRE(manifest->files.size() == 2);
  // Each rank wrote half of the flat state (params, m, v), to a float.
  CHECK(manifest->files[0].bytes - manifest->files[1].bytes <= sizeof(float));
  CHECK(manifest->sample_index == 4u * 2 * 4);

  for (int world : {1, 3}) {
    DYNAMIC_SECTION("resumed by " << world) {
      TrainConfig resume = config;
      resume.checkpoint.dir = absl::StrCat(dir, "/ckpt_world", world);
      resume.checkpoint.resume = step4;
      // Hold the global batch: B * world stays 8 for world 1; world 3 has 12.
      if (world == 1) resume.data.micro_batch = 8;
      RunResult result = RunWorld(resume, world);
      REQUIRE(result.status.ok());
      CHECK(result.resumed_at.step == 4);
      CHECK(result.resumed_at.sample_index == 32);
      // The state is restored exactly...
      auto loaded = GptModel::Create(config.model, 1, Device::kCpu);
      REQUIRE(loaded.ok());
      std::vector<StateTensor> tensors = StateTensors((*loaded)->stages());
      std::vector<float> flat(StateFloats(tensors));
      REQUIRE(LoadFlatRange(Env::Default(), step4, *manifest, tensors, 0, flat.size(), flat.data())
                  .ok());
      CHECK(std::vector<float>(flat.begin(), flat.begin() + flat.size() / 3) == two.params_at4);
      // ...and the loss continues where world 2 left it.
      REQUIRE(result.losses.size() == 8);
      for (int i = 0; i < 8; ++i) {
        INFO("step " << 5 + i << ": world 2 " << two.losses[4 + i] << ", world " << world << " "
                     << result.losses[i]);
        CHECK(std::fabs(result.losses[i] - two.losses[4 + i]) < 0.1f * two.losses[4 + i] + 0.05f);
      }
      if (world == 1) {
        // Same global batch and the same samples: equal up to summation order.
        CHECK(std::fabs(result.losses[0] - two.losses[4]) < 1e-4f);
      }
    }
  }
}

TEST_CASE("a resume at another global batch or validation pass says so; at the same, nothing") {
  std::string dir = FreshDir("global_batch");
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  config.data.val = config.data.train;
  config.train.eval_batches = 2;
  config.train.eval_every = 4;
  config.train.steps = 4;
  RunResult two = RunWorld(config, 2);  // 2 ranks x 4 samples a step
  REQUIRE(two.status.ok());
  const std::string step4 = config.checkpoint.dir + "/step_00000004";
  auto manifest = ReadManifest(Env::Default(), step4);
  REQUIRE(manifest.ok());
  CHECK(manifest->global_batch == 8);
  CHECK(manifest->val_samples == 2 * 4 * 2);

  TrainConfig resume = config;
  resume.checkpoint.dir = dir + "/resumed";
  resume.checkpoint.resume = step4;
  resume.train.steps = 5;
  SECTION("one rank of 8 samples: the same step and validation pass") {
    resume.data.micro_batch = 8;
    RunResult same = RunTrainer(resume);
    INFO(same.log);
    REQUIRE(same.status.ok());
    CHECK(same.resumed_at.step == 4);
    CHECK_FALSE(absl::StrContains(same.log, "note:"));
  }
  SECTION("one rank of 4 samples: both change") {
    RunResult half = RunTrainer(resume);
    INFO(half.log);
    REQUIRE(half.status.ok());
    CHECK(absl::StrContains(
        half.log,
        "note: the global batch changes from 8 to 4 samples a step (data.micro_batch 4 x 1 "
        "micro-step x 1 data-parallel rank): the run goes on, no longer step for step the saved "
        "one; 8 again continues it exactly"));
    CHECK(absl::StrContains(half.log,
                            "note: a validation pass now reads 8 samples, 16 when step 4 "
                            "was saved"));
  }
}

// Resumes `config`'s finished run (checkpoints 4, 8, 12) to step 14 and
// checks that it started from step 8: the newer ones are damaged.
RunResult ResumeFromStep8(const TrainConfig& config) {
  TrainConfig resume = config;
  resume.train.steps = 14;
  RunResult result = RunTrainer(resume);
  INFO(result.log);
  REQUIRE(result.status.ok());
  CHECK(result.resumed_at.step == 8);
  return result;
}

TEST_CASE("a corrupt or torn newest checkpoint is skipped with a message naming it") {
  TrainConfig config = TrainedTinyConfig("corrupt");
  const std::string data = config.checkpoint.dir + "/step_00000012/rank_00000.bin";
  {
    std::fstream file(data, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    char byte = 0;
    file.read(&byte, 1);
    file.seekp(100);
    byte ^= 0x40;
    file.write(&byte, 1);
  }
  auto verified = VerifyCheckpoint(Env::Default(), config.checkpoint.dir + "/step_00000012");
  CHECK(verified.status().code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StrContains(verified.status().message(), data));
  // A torn one: a directory whose manifest was never written.
  fs::create_directories(config.checkpoint.dir + "/step_00000016");
  std::ofstream(config.checkpoint.dir + "/step_00000016/rank_00000.bin") << "partial";

  RunResult result = ResumeFromStep8(config);
  INFO(result.log);
  CHECK(absl::StrContains(
      result.log, "skipping " + config.checkpoint.dir + "/step_00000016: no manifest.json"));
  CHECK(absl::StrContains(result.log, "skipping " + data + ": CRC-32"));
}

// Its files intact and its checksum right, but one tensor's entry gone:
// it verified, so resume picked it and then failed the job on the load.
TEST_CASE("a newest checkpoint whose manifest lacks a tensor is skipped, not loaded") {
  TrainConfig config = TrainedTinyConfig("lacking");
  const std::string newest = config.checkpoint.dir + "/step_00000012";
  auto manifest = ReadManifest(Env::Default(), newest);
  REQUIRE(manifest.ok());
  manifest->tensors.erase(manifest->tensors.begin() + 5);
  std::ofstream(newest + "/manifest.json", std::ios::trunc) << ManifestToJson(*manifest);

  RunResult result = ResumeFromStep8(config);
  INFO(result.log);
  CHECK(absl::StrContains(result.log,
                          "skipping " + newest + "/manifest.json: file rank_00000.bin: bytes "));
}

TEST_CASE("bad input gets a clear error and deletes nothing") {
  std::string dir = FreshDir("bad");
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  config.train.steps = 4;
  REQUIRE(RunTrainer(config).status.ok());
  const std::string saved = config.checkpoint.dir + "/step_00000004";
  REQUIRE(fs::exists(saved + "/manifest.json"));

  SECTION("a resume path that does not exist") {
    TrainConfig bad = config;
    bad.checkpoint.resume = dir + "/nowhere/step_00000004";
    RunResult result = RunTrainer(bad);
    CHECK(result.status.code() == absl::StatusCode::kNotFound);
    CHECK(absl::StrContains(result.status.message(), dir + "/nowhere/step_00000004"));
  }
  SECTION("a checkpoint of another model config") {
    TrainConfig other = config;
    other.model.dim = 64;
    RunResult result = RunTrainer(other);
    CHECK(result.status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(result.status.message(), "another model"));
    CHECK(absl::StrContains(result.status.message(), "dim 32"));
  }
  SECTION("a checkpoint directory under a regular file") {
    TrainConfig bad = config;
    std::ofstream(dir + "/plain_file") << "x";
    bad.checkpoint.dir = dir + "/plain_file/ckpt";
    RunResult result = RunTrainer(bad);
    CHECK(result.status.code() == absl::StatusCode::kInvalidArgument);  // not restartable
    CHECK(absl::StrContains(result.status.message(), "checkpoint.dir"));
    CHECK(absl::StrContains(result.status.message(), dir + "/plain_file/ckpt"));
  }
  SECTION("a read-only checkpoint directory") {
    if (geteuid() == 0) {
      WARN("running as root, where chmod does not stop writes: sub-case skipped");
    } else {
      fs::permissions(config.checkpoint.dir, fs::perms::owner_read | fs::perms::owner_exec);
      TrainConfig more = config;
      more.train.steps = 8;
      RunResult result = RunTrainer(more);
      fs::permissions(config.checkpoint.dir, fs::perms::owner_all);
      CHECK(result.status.code() == absl::StatusCode::kPermissionDenied);  // not restartable
      CHECK(absl::StrContains(result.status.message(), config.checkpoint.dir));
    }
  }
  CHECK(VerifyCheckpoint(Env::Default(), saved).ok());  // still there, still good
}

// What a node whose checkpoint.dir is a disk of its own sees: every path
// under `from` is under `to` instead.
class OtherDiskEnv : public EnvWrapper {
 public:
  OtherDiskEnv(std::string from, std::string to)
      : EnvWrapper(Env::Default()), from_(std::move(from)), to_(std::move(to)) {}

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    return target()->NewWritableFile(Map(path));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override {
    return target()->NewRandomAccessFile(Map(path));
  }
  absl::Status SyncFile(const std::string& path) override { return target()->SyncFile(Map(path)); }
  absl::Status SyncDir(const std::string& path) override { return target()->SyncDir(Map(path)); }
  bool FileExists(const std::string& path) override { return target()->FileExists(Map(path)); }
  bool IsDirectory(const std::string& path) override { return target()->IsDirectory(Map(path)); }
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    return target()->GetChildren(Map(dir));
  }
  absl::Status CreateDir(const std::string& path) override {
    return target()->CreateDir(Map(path));
  }
  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    return target()->RenameFile(Map(from), Map(to));
  }
  absl::Status RemoveFile(const std::string& path) override {
    return target()->RemoveFile(Map(path));
  }
  absl::Status RemoveAll(const std::string& path) override {
    return target()->RemoveAll(Map(path));
  }
  absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& path) override {
    return target()->LockFile(Map(path));
  }

 private:
  std::string Map(const std::string& path) const {
    return absl::StartsWith(path, from_) ? to_ + path.substr(from_.size()) : path;
  }
  const std::string from_, to_;
};

TEST_CASE("a rank whose checkpoint.dir is another directory stops every rank before step 1") {
  const std::string dir = FreshDir("other_disk");
  WriteShard(dir);
  const TrainConfig config = TinyConfig(dir);
  const std::string node_b = FreshDir("other_disk_b") + "/ckpt";
  std::string found = "cannot read it";
  SECTION("nothing there") {}
  SECTION("an earlier run's LOCK there") {
    LockHolder earlier;
    earlier.pid = 99;
    earlier.host = "node-b";
    earlier.token = 12345;
    fs::create_directories(node_b);
    std::ofstream(node_b + "/LOCK") << FormatLockHolder(earlier);
    found = "finds another run's there, that of pid 99 on host node-b";
  }
  OtherDiskEnv other_disk(config.checkpoint.dir, node_b);
  std::vector<RunResult> results(2);
  testing::RunRanks(2, [&](int rank, ParallelStrategy* parallel) {
    results[rank] = RunTrainer(config, parallel, nullptr, rank == 1 ? &other_disk : nullptr);
  });
  INFO(results[0].status.ToString() << "\n" << results[1].status.ToString());
  CHECK(absl::IsFailedPrecondition(results[1].status));
  CHECK(absl::StrContains(results[1].status.message(),
                          "checkpoint.dir " + config.checkpoint.dir +
                              " is not one directory for every rank: rank 0 holds " +
                              config.checkpoint.dir + "/LOCK, and rank 1 on host "));
  CHECK(absl::StrContains(results[1].status.message(), found));
  // Rank 0's failure is rank 1's, as restartable, and says what it was.
  CHECK(absl::IsFailedPrecondition(results[0].status));
  CHECK(absl::StrContains(results[0].status.message(),
                          "checking that every rank sees checkpoint.dir failed on rank 1: "
                          "checkpoint.dir " +
                              config.checkpoint.dir + " is not one directory for every rank"));
  for (const RunResult& result : results) CHECK(result.losses.empty());
  CHECK(fs::exists(config.checkpoint.dir + "/LOCK"));
  CHECK_FALSE(fs::exists(config.checkpoint.dir + "/step_00000004"));
}

// Rank 0 alone lists checkpoint.dir to choose what to resume; where that
// fails, the other ranks fail with its code and message (Agree), not a
// restartable "could not choose" of their own: here a directory that is
// not ours to read, which no restart mends.
class UnlistableEnv : public EnvWrapper {
 public:
  explicit UnlistableEnv(std::string dir) : EnvWrapper(Env::Default()), dir_(std::move(dir)) {}
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    if (dir == dir_) return FileSystemError(EACCES, dir + ": cannot list: Permission denied");
    return target()->GetChildren(dir);
  }

 private:
  const std::string dir_;
};

TEST_CASE("rank 0's failure to choose a checkpoint fails every rank with its cause") {
  const std::string dir = FreshDir("unlistable");
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  SECTION("resume: auto") {}
  SECTION("resume: a path, whose run's own newer checkpoints are looked for") {
    // A checkpoint to start from, outside checkpoint.dir.
    const std::string source = FreshDir("unlistable_source");
    WriteShard(source);
    const TrainConfig first = TinyConfig(source);
    REQUIRE(RunTrainer(first).status.ok());
    auto start = FindLatestValid(Env::Default(), first.checkpoint.dir, nullptr);
    REQUIRE(start.ok());
    config.checkpoint.resume = start->path;
  }
  UnlistableEnv unlistable(config.checkpoint.dir);
  std::vector<RunResult> results(2);
  testing::RunRanks(2, [&](int rank, ParallelStrategy* parallel) {
    results[rank] = RunTrainer(config, parallel, nullptr, rank == 0 ? &unlistable : nullptr);
  });
  INFO(results[0].status.ToString() << "\n" << results[1].status.ToString());
  for (const RunResult& result : results) {
    CHECK(absl::IsPermissionDenied(result.status));  // not restartable (worker_main.cc)
    CHECK(result.losses.empty());
  }
  CHECK(absl::StrContains(results[0].status.message(), "cannot list: Permission denied"));
  CHECK(results[1].status.message() == "choosing a checkpoint to resume failed on rank 0: " +
                                           std::string(results[0].status.message()));
}

TEST_CASE("a run resumed at or past train.steps trains nothing and says so") {
  const std::string dir = FreshDir("finished");
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  config.train.steps = 8;
  REQUIRE(RunTrainer(config).status.ok());
  for (int steps : {8, 4}) {
    config.train.steps = steps;
    RunResult again = RunTrainer(config);
    REQUIRE(again.status.ok());
    CHECK(again.losses.empty());
    CHECK(absl::StrContains(again.log, absl::StrCat("nothing to train: resumed at step 8, and "
                                                    "train.steps is ",
                                                    steps)));
  }
  // Nothing saved over the step-8 checkpoint, and nothing newer.
  auto newest = FindLatestValid(Env::Default(), config.checkpoint.dir, nullptr);
  REQUIRE(newest.ok());
  CHECK(newest->step == 8);
}

// A run of the tiny config for 4 steps in a fresh directory `name`, which
// `dir` receives; `config` is that run's, and the step-4 manifest returned.
Manifest SavedAfterFourSteps(const std::string& name, std::string* dir, TrainConfig* config) {
  *dir = FreshDir(name);
  WriteShard(*dir);
  *config = TinyConfig(*dir);
  config->train.steps = 4;
  REQUIRE(RunTrainer(*config).status.ok());
  auto saved = ReadManifest(Env::Default(), config->checkpoint.dir + "/step_00000004");
  REQUIRE(saved.ok());
  return *saved;
}

TEST_CASE("a resume over data of another size says so; over the same data it does not") {
  std::string dir;
  TrainConfig config;
  const Manifest saved = SavedAfterFourSteps("data_windows", &dir, &config);
  CHECK(saved.data_windows == 499);  // (8000 - 1) / 16

  config.train.steps = 6;
  RunResult same = RunTrainer(config);
  REQUIRE(same.status.ok());
  CHECK(absl::StrContains(same.log, "resumed from"));
  CHECK_FALSE(absl::StrContains(same.log, "warning"));

  // A second shard appears while the run is down: the order changes.
  fs::copy_file(dir + "/train_000.bin", dir + "/train_001.bin");
  config.train.steps = 8;
  RunResult grown = RunTrainer(config);
  REQUIRE(grown.status.ok());
  INFO(grown.log);
  CHECK(absl::StrContains(
      grown.log, "checkpoint: warning: " + config.checkpoint.dir +
                     "/step_00000006 was saved with data.train of 499 windows and this run's has "
                     "998 (shards added, removed or changed?): the sample order from index 24 is "
                     "the new data's"));
}

TEST_CASE("a resume with other training settings says what changed; with the same, nothing") {
  std::string dir;
  TrainConfig config;
  const Manifest saved = SavedAfterFourSteps("settings", &dir, &config);
  CHECK(saved.training == TrainingSettingsOf(config));

  // Only what a resume may change without changing the course: quiet.
  config.checkpoint.every = 1;
  config.train.log_every = 1;
  RunResult same = RunTrainer(config);
  REQUIRE(same.status.ok());
  CHECK_FALSE(absl::StrContains(same.log, "settings differ"));

  config.train.steps = 6;
  config.optim.lr *= 2;
  RunResult changed = RunTrainer(config);
  REQUIRE(changed.status.ok());
  INFO(changed.log);
  CHECK(absl::StrContains(
      changed.log, absl::StrCat("checkpoint: this run's settings differ from those that saved step "
                                "4: ",
                                DescribeSettingChanges(saved.training, config, 4), "\n")));
  CHECK(absl::StrContains(changed.log, "train.steps 4 -> 6"));
  // The next checkpoint records the new settings.
  auto next = ReadManifest(Env::Default(), config.checkpoint.dir + "/step_00000006");
  REQUIRE(next.ok());
  CHECK(next->training == TrainingSettingsOf(config));
}

// The POSIX file system, but with `free` bytes available whatever statvfs says.
class FreeSpaceEnv : public EnvWrapper {
 public:
  explicit FreeSpaceEnv(uint64_t free) : EnvWrapper(Env::Default()), free_(free) {}
  absl::StatusOr<uint64_t> AvailableBytes(const std::string&) override { return free_; }

 private:
  const uint64_t free_;
};

TEST_CASE("a start with too little space free for the checkpoints to come warns") {
  std::string dir = FreshDir("space");
  WriteShard(dir);
  TrainConfig config = TinyConfig(dir);
  config.checkpoint.keep_last = 2;
  config.train.steps = 4;
  // One checkpoint: the flat state (parameters and both moments) in fp32.
  auto model = GptModel::Create(config.model, 1, Device::kCpu);
  REQUIRE(model.ok());
  const uint64_t bytes = StateFloats(StateTensors((*model)->stages())) * sizeof(float);
  CHECK(FormatBytes(0) == "0 KiB");
  CHECK(FormatBytes(812 << 10) == "812 KiB");
  CHECK(FormatBytes(uint64_t{19} << 19) == "9.5 MiB");
  CHECK(FormatBytes(uint64_t{1525} << 20) == "1.49 GiB");

  // A fresh run will hold keep_last + 1 = 3 at once while a save is written.
  FreeSpaceEnv short_of_three(3 * bytes - 1);
  RunResult fresh = RunTrainer(config, nullptr, nullptr, &short_of_three);
  REQUIRE(fresh.status.ok());
  CHECK(absl::StrContains(
      fresh.log,
      absl::StrCat("checkpoint: warning: the file system of ", config.checkpoint.dir, " has ",
                   FormatBytes(3 * bytes - 1), " free, and this run needs ", FormatBytes(3 * bytes),
                   " more there: a checkpoint takes ", FormatBytes(bytes),
                   ", and checkpoint.keep_last 2 keeps up to 3 while a save is "
                   "written (0 there now). A save that finds the disk full fails the "
                   "run")));
  FreeSpaceEnv room_for_three(3 * bytes);
  CHECK_FALSE(
      absl::StrContains(RunTrainer(config, nullptr, nullptr, &room_for_three).log, "warning"));

  // Resumed, its own checkpoint there counts (step 4): two more are needed.
  config.train.steps = 8;
  FreeSpaceEnv short_of_two(2 * bytes - 1);
  RunResult resumed = RunTrainer(config, nullptr, nullptr, &short_of_two);
  REQUIRE(resumed.status.ok());
  CHECK(resumed.resumed_at.step == 4);
  CHECK(absl::StrContains(resumed.log,
                          absl::StrCat("this run needs ", FormatBytes(2 * bytes), " more there")));
  CHECK(absl::StrContains(resumed.log, "(1 there now)"));
}

TEST_CASE("a start deletes what saves that never committed left, and only that") {
  std::string dir;
  TrainConfig config;
  SavedAfterFourSteps("uncommitted", &dir, &config);
  const std::string& ckpt = config.checkpoint.dir;
  // A save SIGKILLed at step 9 (a preemption's, at a step no later save
  // reaches), and a checkpoint moved aside by a commit that crashed.
  fs::create_directories(ckpt + "/.tmp_step_00000009");
  std::ofstream(ckpt + "/.tmp_step_00000009/rank_00000.bin") << std::string(1000, 'x');
  fs::create_directories(ckpt + "/.old_step_00000004");
  std::ofstream(ckpt + "/notes.txt") << "the user's";

  config.train.steps = 8;
  RunResult resumed = RunTrainer(config);
  REQUIRE(resumed.status.ok());
  CHECK(resumed.resumed_at.step == 4);
  for (const std::string name : {".tmp_step_00000009", ".old_step_00000004"}) {
    CHECK_FALSE(fs::exists(ckpt + "/" + name));
    CHECK(absl::StrContains(resumed.log, absl::StrCat("checkpoint: deleted ", ckpt, "/", name,
                                                      ": a save that never committed")));
  }
  CHECK(fs::exists(ckpt + "/notes.txt"));
  CHECK(VerifyCheckpoint(Env::Default(), ckpt + "/step_00000008").ok());
}

TEST_CASE("a failed background write is reported once, by the next call") {
  std::string dir = FreshDir("writer");
  ShardWriter writer(Env::Default());
  auto buffer = writer.Buffer(1000);
  REQUIRE(buffer.ok());
  writer.Start(dir + "/missing", "rank_00000.bin");
  auto result = writer.Wait();
  CHECK(result.status().code() == absl::StatusCode::kNotFound);
  CHECK(absl::StrContains(result.status().message(), dir + "/missing/rank_00000.bin"));

  REQUIRE(writer.Buffer(1000).ok());
  writer.Start(dir, "rank_00000.bin");
  CHECK(writer.Buffer(10).ok());  // waits for that write, which succeeds
  auto record = ReadSidecar(Env::Default(), dir, "rank_00000.bin");
  REQUIRE(record.ok());
  CHECK(record->bytes == 4000);
}

}  // namespace
}  // namespace muster::worker
