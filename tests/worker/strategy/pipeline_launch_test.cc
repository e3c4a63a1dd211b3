// Pipeline parallelism as users run it: the real `worker` under the real
// `launch --standalone`, ranks as processes talking Gloo over loopback on
// the CPU (worker/strategy/pipeline/pipeline.h; the same combinations as threads:
// pipeline_test.cc).
//   - equivalence: PP=2 and PP=4 under GPipe, 1F1B and interleaved 1F1B,
//     PP=4 under ZB-H1, DP=2 x PP=2 and FSDP (2 shards, ZeRO-3) x PP=2
//     follow the 1-process loss curve at the same global batch;
//   - resume across pipeline layouts: a PP=2 checkpoint resumed under
//     PP=2 is bit-exact, under 1 process, PP=4, DDP on 2 ranks and PP=2
//     interleaved continues the curve;
//   - failure: SIGKILL stage 1 of a PP=4 job; every other stage, the one
//     that never talks to it included, leaves long before
//     parallel.timeout_s, launch restarts the job, and it ends bit for
//     bit as an uninterrupted run;
//   - bad configs exit 2 naming the fields.
//
// Samples line up between layouts: micro-batch m of dp rank r reads the
// global samples first + (m x dp + r) x B .. + B, which is micro-step
// m x dp + r of one process with micro_batch B and grad_accumulation
// dp x M.
#include <catch2/catch.hpp>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "tests/launcher/harness.h"
#include "tests/worker/launch_job.h"
#include "tests/worker/strategy/launch_runs.h"

namespace muster::testing {
namespace {

struct Job : JobFields {
  int layers = 4;
  int pp = 1;
  std::string schedule = "1f1b";
  std::string strategy = "ddp";  // fsdp: the dp ranks shard each stage's state (ZeRO-3)
  int microbatches = 0;          // 0: data.grad_accumulation
  int micro_batch = 2;
  int accumulation = 1;
};

// One process reading the same samples as `dp` pipelines of `job`.
Job OneProcess(const Job& job, int dp) {
  Job one = job;
  one.pp = 1;
  one.microbatches = 0;
  one.accumulation = dp * job.microbatches;
  return one;
}

std::string JobYaml(const Job& job) {
  return absl::StrCat(
      // Tiny, so that 4 stages on 2 loaded cores take a few seconds.
      "model: {layers: ", job.layers, ", heads: 2, dim: 32, vocab: 256, seq_len: 16}\n",
      "data: {train: train_*.bin, micro_batch: ", job.micro_batch,
      ", grad_accumulation: ", job.accumulation, "}\n",
      // grad_clip below the norm: the norm summed over the stages is used.
      "optim: {lr: 5.0e-3, warmup_steps: 2, grad_clip: 0.5}\n", "train: {steps: ", job.steps,
      ", log_every: 1, metrics_file: ", job.metrics, "}\n", "device: cpu\n",
      "parallel: {strategy: ", job.strategy, ", pp: ", job.pp, ", schedule: ", job.schedule,
      ", microbatches: ", job.microbatches, ", bucket_mb: 0.01, timeout_s: ", job.timeout_s, "}\n",
      job.checkpoint.empty() ? "" : absl::StrCat("checkpoint: ", job.checkpoint, "\n"));
}

// Runs a job that must succeed and returns rank 0's losses. A pipeline
// job must say so in its banner: "pipeline (<schedule>, <pp> ranks".
std::map<int, double> Train(const TempDir& dir, const std::string& name, int world, Job job) {
  job.metrics = name + ".jsonl";
  std::map<int, double> losses = TrainYaml(dir, name, world, JobYaml(job));
  const std::string log = ReadFile(dir.File(name + ".log"));
  INFO(name << ":\n" << log);
  if (job.pp > 1) {
    CHECK(absl::StrContains(log, absl::StrCat("pipeline (", job.schedule, ", ", job.pp, " ranks")));
  }
  return losses;
}

TEST_CASE("PP=2 and PP=4 under GPipe and 1F1B, and DP=2 x PP=2, follow the 1-process curve") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 20;
  // Global batch 8 every time: 1 process x 2 x 4 micro-steps; one
  // pipeline x 4 micro-batches of 2; 2 pipelines x 4 micro-batches of 1.
  Job pipeline;
  pipeline.microbatches = 4;
  pipeline.micro_batch = 2;
  std::map<int, double> reference = Train(dir, "one", 1, OneProcess(pipeline, 1));
  REQUIRE(reference.size() == kSteps);
  // The loss moved: the comparisons are not between flat lines.
  CHECK(reference[kSteps] < reference[1] - 0.5);

  struct Config {
    int dp, pp;
    std::string schedule;
  };
  for (const Config& config :
       {Config{1, 2, "gpipe"}, Config{1, 2, "1f1b"}, Config{1, 4, "1f1b"}, Config{1, 4, "gpipe"},
        // Two virtual stages per rank: a block per pipeline stage.
        Config{1, 2, "interleaved_1f1b"}, Config{1, 4, "zb_h1"}}) {
    Job job = pipeline;
    job.pp = config.pp;
    job.schedule = config.schedule;
    const std::string name = absl::StrCat("pp", config.pp, "_", config.schedule);
    std::map<int, double> losses = Train(dir, name, config.dp * config.pp, job);
    CHECK(losses.size() == kSteps);
    CheckFollows(losses, reference, name);
  }

  // PP=4 under interleaved 1F1B: 8 pipeline stages, so 8 blocks, against
  // its own 1-process run.
  Job deep = pipeline;
  deep.layers = 8;
  std::map<int, double> deep_reference = Train(dir, "one_l8", 1, OneProcess(deep, 1));
  deep.pp = 4;
  deep.schedule = "interleaved_1f1b";
  std::map<int, double> deep_losses = Train(dir, "pp4_interleaved", 4, deep);
  CHECK(deep_losses.size() == kSteps);
  CheckFollows(deep_losses, deep_reference, "pp4_interleaved");

  // DP=2 x PP=2 against its own 1-process run: micro_batch 1, 2 x 4
  // micro-steps.
  Job dp_pp = pipeline;
  dp_pp.pp = 2;
  dp_pp.micro_batch = 1;
  std::map<int, double> dp_reference = Train(dir, "one_b1", 1, OneProcess(dp_pp, 2));
  REQUIRE(dp_reference.size() == kSteps);
  std::map<int, double> losses = Train(dir, "dp2_pp2", 4, dp_pp);
  CHECK(absl::StrContains(ReadFile(dir.File("dp2_pp2.log")), "2 pipelines (dp)"));
  CHECK(losses.size() == kSteps);
  CheckFollows(losses, dp_reference, "dp2_pp2");
  // The same with the two dp ranks of each stage sharding its state.
  Job fsdp_pp = dp_pp;
  fsdp_pp.strategy = "fsdp";
  losses = Train(dir, "fsdp2_pp2", 4, fsdp_pp);
  CHECK(absl::StrContains(ReadFile(dir.File("fsdp2_pp2.log")),
                          "each stage sharded over 2 ranks (ZeRO-3)"));
  CHECK(losses.size() == kSteps);
  CheckFollows(losses, dp_reference, "fsdp2_pp2");
}

TEST_CASE("a PP=2 checkpoint resumes under PP=2 bit for bit, and under 1 process and PP=4") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 20, kSaved = 10;
  // Global batch 8 everywhere: 4 micro-batches of 2.
  Job pp2;
  pp2.pp = 2;
  pp2.microbatches = 4;
  pp2.steps = kSteps;
  Job pp4 = pp2;
  pp4.pp = 4;
  const Job one = OneProcess(pp2, 1);

  // The uninterrupted run, which also writes the checkpoint resumed below.
  Job job = pp2;
  job.checkpoint = CheckpointYaml(dir, "pp2_ckpt", kSaved);
  std::map<int, double> uninterrupted = Train(dir, "pp2", 2, job);
  REQUIRE(uninterrupted.size() == kSteps);
  const std::string saved = dir.File("pp2_ckpt/" + StepDir(kSaved));
  REQUIRE(std::filesystem::exists(saved + "/manifest.json"));

  // Sequential, not SECTIONs: Catch2 would run the run above again for
  // each.
  // (a) PP=2 -> PP=2: every resumed step's loss as written, and the final
  // weights and AdamW moments (every rank's file of the last checkpoint),
  // bit for bit.
  Resume(dir, "pp2_again", 2, pp2, saved, kSaved);
  std::map<int, std::string> expected_texts = LossTexts(dir.File("pp2.jsonl"));
  for (const auto& [step, loss] : LossTexts(dir.File("pp2_again.jsonl"))) {
    INFO("pp2 -> pp2 step " << step);
    CHECK(loss == expected_texts[step]);
  }
  CheckSameCheckpoint(dir.File("pp2_again_ckpt"), dir.File("pp2_ckpt"), kSteps, 2);
  // (b) PP=2 -> 1 process.
  CheckFollows(Resume(dir, "pp2_to_one", 1, one, saved, kSaved), uninterrupted, "pp2 -> one");
  // (c) PP=2 -> PP=4.
  CheckFollows(Resume(dir, "pp2_to_pp4", 4, pp4, saved, kSaved), uninterrupted, "pp2 -> pp4");
  // (d) PP=2 -> DDP on 2 ranks (no pipeline): 2 micro-steps of 2 each.
  Job ddp = OneProcess(pp2, 1);
  ddp.accumulation = 2;
  CheckFollows(Resume(dir, "pp2_to_ddp2", 2, ddp, saved, kSaved), uninterrupted, "pp2 -> ddp2");
  // (e) PP=2 -> PP=2 interleaved: each rank now runs two block ranges.
  Job interleaved = pp2;
  interleaved.schedule = "interleaved_1f1b";
  CheckFollows(Resume(dir, "pp2_to_interleaved", 2, interleaved, saved, kSaved), uninterrupted,
               "pp2 -> pp2 interleaved");
}

TEST_CASE("a stage SIGKILLed: every other stage leaves, launch restarts, the run ends exact") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 60, kEvery = 5;
  Job job;
  job.pp = 4;
  job.microbatches = 4;
  job.steps = kSteps;
  // Far beyond what the restart may take: a stage that waited for its
  // receive's timeout would fail the bounds below.
  job.timeout_s = 120;
  TrainReference(dir, 4, job);

  const KilledJob killed = KillRankOne(dir, 4, job, "ppkill", kEvery);
  INFO(killed.log);
  // Stage 1's neighbours (0 and 2) find their channels to it closed; stage
  // 3, which never talks to it, finds its channels to stage 2 closed when
  // stage 2 leaves. Each leaves its send or receive at once, not after
  // timeout_s.
  WARN("stages 0, 2 and 3 left " << absl::FormatDuration(killed.left.at(0)) << ", "
                                 << absl::FormatDuration(killed.left.at(2)) << " and "
                                 << absl::FormatDuration(killed.left.at(3))
                                 << " after the SIGKILL; the job finished "
                                 << absl::FormatDuration(killed.finished) << " after it");
  for (int rank : {0, 2, 3}) CHECK(killed.left.at(rank) < absl::Seconds(10));
  // Every stage's file of step 60.
  CheckKilledRunEndedExact(dir, killed, kSteps, kEvery, 4);
}

TEST_CASE("bad pipeline configs exit 2 naming the fields") {
  TempDir dir;
  WriteCorpus(dir.path());
  Job job;
  job.microbatches = 4;
  job.steps = 2;

  SECTION("pp: 2 on a world of 3") {
    job.pp = 2;
    CheckRefusedNamingDegrees(dir, "pp2_world3", 3, job);
  }
  SECTION("pp: 4 over 3 blocks") {
    // 4 ranks: the degrees cover the world; only the blocks are too few.
    job.layers = 3;
    job.pp = 4;
    const std::string log = RefusedJob(dir, "pp4_layers3", 4, job);
    INFO(log);
    CHECK(absl::StrContains(log, "parallel.pp"));
    CHECK(absl::StrContains(log, "model.layers"));
  }
  SECTION("1f1b with 1 micro-batch over 2 stages") {
    job.pp = 2;
    job.schedule = "1f1b";
    job.microbatches = 1;
    const std::string log = RefusedJob(dir, "1f1b_m1", 2, job);
    INFO(log);
    CHECK(absl::StrContains(log, "parallel.microbatches"));
  }
  SECTION("interleaved_1f1b with 3 micro-batches over 2 ranks") {
    job.pp = 2;
    job.schedule = "interleaved_1f1b";
    job.microbatches = 3;
    const std::string log = RefusedJob(dir, "interleaved_m3", 2, job);
    INFO(log);
    CHECK(absl::StrContains(log,
                            "parallel.microbatches: 3 micro-batches per step is not a "
                            "multiple of parallel.pp (2)"));
  }
}

}  // namespace
}  // namespace muster::testing
