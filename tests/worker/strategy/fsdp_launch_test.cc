// FSDP as users run it: the real `worker` under the real `launch
// --standalone`, ranks as processes talking Gloo over loopback on the CPU
// (worker/strategy/fsdp/fsdp.h; the same combinations as threads: fsdp_test.cc).
//   - equivalence: ZeRO-1/2/3 at 2 and 3 ranks and HSDP 2x2 follow the
//     1-process loss curve at the same global batch, and every rank's
//     memory matches the formula;
//   - resume across strategies and world sizes: FSDP -> DDP, DDP -> FSDP,
//     2 -> 3 ranks continue the curve; FSDP -> the same FSDP is bit-exact;
//   - failure: SIGKILL one rank; the other leaves its collective long
//     before parallel.timeout_s, launch restarts the job, and it ends bit
//     for bit as an uninterrupted run;
//   - bad configs exit 2 naming the fields.
//
// The model is sized so that 2 and 3 ranks split the stages unevenly:
// C = 35, T = 15, Vp = 256 make the embedding (256 + 15) x 35 = 9485
// floats and each block 35 x (12 x 35 + 13) = 15155, neither divisible by
// 2 or 3 (the head, 2C = 70, is even whatever C is).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "tests/launcher/harness.h"
#include "tests/worker/launch_job.h"
#include "tests/worker/strategy/launch_runs.h"

namespace muster::testing {
namespace {

struct Job : JobFields {
  std::string strategy = "fsdp";
  int zero = 3;
  std::string gather_dtype = "auto";
  int dp_replicate = 0;  // 0: auto
  int dp_shard = 0;      // 0: auto
  int micro_batch = 1;
  int accumulation = 1;
};

std::string JobYaml(const Job& job) {
  return absl::StrCat(
      "model: {layers: 2, heads: 5, dim: 35, vocab: 256, seq_len: 15}\n",
      "data: {train: train_*.bin, micro_batch: ", job.micro_batch,
      ", grad_accumulation: ", job.accumulation, "}\n",
      // grad_clip below the norm (about 2): the norm summed over the
      // shards is used. lr 1e-2 spikes the loss near step 11, which blows
      // reduction-order rounding up past 1e-5 at any world size (DDP too).
      "optim: {lr: 5.0e-3, warmup_steps: 2, grad_clip: 0.5}\n", "train: {steps: ", job.steps,
      ", log_every: 1, metrics_file: ", job.metrics, "}\n", "device: cpu\n",
      "parallel: {strategy: ", job.strategy, ", zero: ", job.zero,
      ", gather_dtype: ", job.gather_dtype, ", dp_replicate: ", job.dp_replicate,
      ", dp_shard: ", job.dp_shard, ", bucket_mb: 0.01, timeout_s: ", job.timeout_s, "}\n",
      job.checkpoint.empty() ? "" : absl::StrCat("checkpoint: ", job.checkpoint, "\n"));
}

// Runs a job that must succeed and returns rank 0's losses.
std::map<int, double> Train(const TempDir& dir, const std::string& name, int world, Job job) {
  job.metrics = name + ".jsonl";
  return TrainYaml(dir, name, world, JobYaml(job));
}

// The console lines (launch prefixes each with "[host rankN]:") holding
// "worker: fsdp rank R memory:".
std::vector<std::string> MemoryLines(const std::string& console) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(console, '\n')) {
    if (absl::StrContains(line, "worker: fsdp rank ") && absl::StrContains(line, " memory: ")) {
      lines.emplace_back(line);
    }
  }
  return lines;
}

// One memory line per rank, each matching the formula.
void CheckMemoryLines(const std::string& console, int world) {
  std::vector<std::string> lines = MemoryLines(console);
  INFO(console);
  CHECK(static_cast<int>(lines.size()) == world);
  for (int rank = 0; rank < world; ++rank) {
    int found = 0;
    for (const std::string& line : lines) {
      if (!absl::StrContains(line, absl::StrCat("worker: fsdp rank ", rank, " memory: "))) continue;
      ++found;
      INFO(line);
      CHECK(absl::StrContains(line, ": equal)"));
    }
    INFO("rank " << rank);
    CHECK(found == 1);
  }
}

// One parameter fingerprint per rank (Fsdp::AfterRun), all the same: every
// rank gathered the same bits, HSDP's replicas too.
void CheckFingerprints(const std::string& console, int world) {
  std::map<int, std::string> by_rank;
  for (absl::string_view line : absl::StrSplit(console, '\n')) {
    const size_t at = line.find("worker: fsdp rank ");
    if (at == absl::string_view::npos || !absl::StrContains(line, " parameters: fnv1a64 ")) {
      continue;
    }
    int rank = -1;
    absl::string_view rest = line.substr(at + std::strlen("worker: fsdp rank "));
    REQUIRE(absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &rank));
    by_rank[rank] = std::string(rest.substr(rest.rfind(' ') + 1));
  }
  INFO(console);
  REQUIRE(static_cast<int>(by_rank.size()) == world);
  for (const auto& [rank, fingerprint] : by_rank) {
    INFO("rank " << rank);
    CHECK(fingerprint.size() == 16);
    CHECK(fingerprint == by_rank.begin()->second);
  }
}

TEST_CASE("ZeRO-1/2/3 at 2 and 3 ranks and HSDP 2x2 follow the 1-process loss curve") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 20;
  // Global batch 12 every time: 1 x 12; 2 ranks x 3 x 2 micro-steps (the
  // accumulation path); 3 ranks x 4; 2 replicas x 2 shards x 3.
  Job one;
  one.strategy = "ddp";
  one.micro_batch = 12;
  std::map<int, double> reference = Train(dir, "one", 1, one);
  REQUIRE(reference.size() == kSteps);
  // The loss moved: the comparisons are not between flat lines.
  CHECK(reference[kSteps] < reference[1] - 0.5);

  struct Config {
    int world, zero, replicate, micro_batch, accumulation;
  };
  for (const Config& config :
       {Config{2, 1, 0, 3, 2}, Config{2, 2, 0, 3, 2}, Config{2, 3, 0, 3, 2}, Config{3, 1, 0, 4, 1},
        Config{3, 2, 0, 4, 1}, Config{3, 3, 0, 4, 1}, Config{4, 3, 2, 3, 1}}) {
    const std::string name = absl::StrCat("zero", config.zero, "_world", config.world,
                                          config.replicate > 1 ? "_hsdp" : "");
    Job job;
    job.zero = config.zero;
    job.dp_replicate = config.replicate;
    job.micro_batch = config.micro_batch;
    job.accumulation = config.accumulation;
    std::map<int, double> losses = Train(dir, name, config.world, job);
    CHECK(losses.size() == kSteps);
    CheckFollows(losses, reference, name);
    CheckCommWait(dir, name);
    CheckMemoryLines(ReadFile(dir.File(name + ".log")), config.world);
    CheckFingerprints(ReadFile(dir.File(name + ".log")), config.world);
  }
}

TEST_CASE("checkpoints resume across DDP and FSDP and across 2 and 3 ranks") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 30, kSaved = 15;
  // Global batch 6 everywhere: 2 ranks x 3, 3 ranks x 2.
  Job fsdp2;
  fsdp2.micro_batch = 3;
  fsdp2.steps = kSteps;
  Job ddp2 = fsdp2;
  ddp2.strategy = "ddp";
  Job fsdp3 = fsdp2;
  fsdp3.micro_batch = 2;

  // The uninterrupted runs, which also write the checkpoints resumed below.
  Job job = fsdp2;
  job.checkpoint = CheckpointYaml(dir, "fsdp2_ckpt", kSaved);
  std::map<int, double> fsdp2_losses = Train(dir, "fsdp2", 2, job);
  job = ddp2;
  job.checkpoint = CheckpointYaml(dir, "ddp2_ckpt", kSaved);
  std::map<int, double> ddp2_losses = Train(dir, "ddp2", 2, job);
  REQUIRE(fsdp2_losses.size() == kSteps);
  REQUIRE(ddp2_losses.size() == kSteps);
  CheckFollows(ddp2_losses, fsdp2_losses, "ddp2 vs fsdp2");
  const std::string fsdp2_saved = dir.File("fsdp2_ckpt/" + StepDir(kSaved));
  const std::string ddp2_saved = dir.File("ddp2_ckpt/" + StepDir(kSaved));
  REQUIRE(std::filesystem::exists(fsdp2_saved + "/manifest.json"));
  REQUIRE(std::filesystem::exists(ddp2_saved + "/manifest.json"));

  // Sequential, not SECTIONs: Catch2 would run the two runs above again
  // for each.
  // (a) FSDP at 2 ranks -> DDP at 2 ranks.
  CheckFollows(Resume(dir, "fsdp2_to_ddp2", 2, ddp2, fsdp2_saved, kSaved), ddp2_losses,
               "fsdp2 -> ddp2");
  // (b) DDP at 2 ranks -> FSDP at 2 ranks.
  CheckFollows(Resume(dir, "ddp2_to_fsdp2", 2, fsdp2, ddp2_saved, kSaved), fsdp2_losses,
               "ddp2 -> fsdp2");
  // (c) FSDP at 2 ranks -> FSDP at 3 ranks.
  CheckFollows(Resume(dir, "fsdp2_to_fsdp3", 3, fsdp3, fsdp2_saved, kSaved), fsdp2_losses,
               "fsdp2 -> fsdp3");
  // (d) FSDP ZeRO-3 at 2 ranks -> the same: every resumed step's loss as
  // written, and the final weights and AdamW moments (every rank's file of
  // the last checkpoint), bit for bit.
  Resume(dir, "fsdp2_again", 2, fsdp2, fsdp2_saved, kSaved);
  std::map<int, std::string> resumed = LossTexts(dir.File("fsdp2_again.jsonl"));
  std::map<int, std::string> uninterrupted = LossTexts(dir.File("fsdp2.jsonl"));
  for (const auto& [step, loss] : resumed) {
    INFO("fsdp2 -> fsdp2 step " << step);
    CHECK(loss == uninterrupted[step]);
  }
  CheckSameCheckpoint(dir.File("fsdp2_again_ckpt"), dir.File("fsdp2_ckpt"), kSteps, 2);
}

TEST_CASE("bf16 gathers: 2 and 3 ranks follow a world of 1 gathering in bf16; resume is exact") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 20, kSaved = 10;
  // Global batch 6: 1 x 6, 2 x 3, 3 x 2. Every rank rounds the same master
  // weights the same way, so the sharding changes only the reductions'
  // order, as with fp32 gathers. But rounding to bf16 is a step function: a
  // master weight one fp32 ulp off the reference's can land on the next bf16
  // value, 2^-8 relative away, so over 20 steps the curves part by a little
  // more than fp32 gathers' 1e-5 (1.1e-5 measured): 1e-4 here.
  const double kBf16Follows = 1e-4;
  Job one;
  one.gather_dtype = "bf16";
  one.micro_batch = 6;
  std::map<int, double> reference = Train(dir, "bf16_world1", 1, one);
  REQUIRE(reference.size() == kSteps);
  Job fp32 = one;
  fp32.gather_dtype = "fp32";
  std::map<int, double> unrounded = Train(dir, "fp32_world1", 1, fp32);
  for (int step = 1; step <= kSteps; ++step) {
    INFO("step " << step);
    // Rounded weights: near the fp32 curve, not on it.
    CHECK(std::abs(reference[step] - unrounded[step]) <= 1e-2 * unrounded[step]);
  }
  CHECK(reference != unrounded);

  Job two = one;
  two.micro_batch = 3;
  two.checkpoint = CheckpointYaml(dir, "bf16_world2_ckpt", kSaved);
  std::map<int, double> two_losses = Train(dir, "bf16_world2", 2, two);
  CheckFollows(two_losses, reference, "bf16 gathers, 2 ranks", kBf16Follows);
  CheckMemoryLines(ReadFile(dir.File("bf16_world2.log")), 2);
  Job three = one;
  three.zero = 1;
  three.micro_batch = 2;
  CheckFollows(Train(dir, "bf16_world3", 3, three), reference, "bf16 gathers, ZeRO-1, 3 ranks",
               kBf16Follows);

  // The resumed run sends the bf16 copies of the slices it loaded: every
  // step as the uninterrupted run wrote it.
  two.checkpoint = "";
  const std::string saved = dir.File("bf16_world2_ckpt/" + StepDir(kSaved));
  Resume(dir, "bf16_world2_again", 2, two, saved, kSaved);
  std::map<int, std::string> resumed = LossTexts(dir.File("bf16_world2_again.jsonl"));
  std::map<int, std::string> uninterrupted = LossTexts(dir.File("bf16_world2.jsonl"));
  REQUIRE(resumed.size() == kSteps - kSaved);
  for (const auto& [step, loss] : resumed) {
    INFO("step " << step);
    CHECK(loss == uninterrupted[step]);
  }
}

// The SIGKILL tests' job of `steps` steps. Its collectives' timeout is far
// beyond what the restart may take: a survivor that waited for it would
// fail the tests' bounds.
Job KilledRunJob(int steps) {
  Job job;
  job.micro_batch = 3;
  job.steps = steps;
  job.timeout_s = 120;
  return job;
}

TEST_CASE("an FSDP rank SIGKILLed mid-run: the other leaves, launch restarts, the run ends exact") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 60, kEvery = 5;
  const Job job = KilledRunJob(kSteps);
  TrainReference(dir, 2, job);

  const KilledJob killed = KillRankOne(dir, 2, job, "fsdpkill", kEvery);
  INFO(killed.log);
  // The survivor's peer socket closes: it leaves its gather or
  // reduce-scatter at once, not after timeout_s.
  WARN("the survivor left " << absl::FormatDuration(killed.left.at(0))
                            << " after the SIGKILL; the job finished "
                            << absl::FormatDuration(killed.finished) << " after it");
  CHECK(killed.left.at(0) < absl::Seconds(10));
  // Both ranks' files of step 60.
  CheckKilledRunEndedExact(dir, killed, kSteps, kEvery, 2);
}

// checkpoint.resume never starts the run afresh, past another run's
// checkpoint in the directory; a restart of the run (launch's next round)
// continues the run's own progress, not the other run's and not step 0.
TEST_CASE("resume: never, a rank SIGKILLed: the restart continues the run's own checkpoint") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 30, kEvery = 5;
  const Job job = KilledRunJob(kSteps);
  TrainReference(dir, 2, job, "never");
  // Another run's checkpoint, newer than any the killed run saves before
  // its last step: never must pass it over, at the start and the restart.
  std::filesystem::create_directories(dir.File("killed_ckpt"));
  std::filesystem::copy(dir.File("reference_ckpt/" + StepDir(kSteps)),
                        dir.File("killed_ckpt/" + StepDir(kSteps)),
                        std::filesystem::copy_options::recursive);

  const KilledJob killed = KillRankOne(dir, 2, job, "neverkill", kEvery, "never");
  INFO(killed.log);
  REQUIRE(killed.exit_code == 0);
  CHECK(absl::StrContains(killed.log,
                          "checkpoint.resume never started job neverkill at step 0; "
                          "in its round 1 it continues from the run's own"));
  // The newest checkpoint at the kill was the other run's step 30, which
  // is not this run's to resume: the bound is the run's own first save
  // past the first (KillRankMidRun waits for it).
  KilledJob own = killed;
  own.saved_before = 2 * kEvery;
  CheckRestartedExact(dir, "killed", own, "reference", kSteps, kEvery, 2);
  // The other run's checkpoint was kept beside the run's own step 30.
  int kept = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.File("killed_ckpt"))) {
    if (entry.path().filename().string().rfind(StepDir(kSteps) + ".lineage_", 0) == 0) ++kept;
  }
  CHECK(kept == 1);
}

TEST_CASE("bad FSDP configs exit 2 naming the fields") {
  TempDir dir;
  WriteCorpus(dir.path());
  Job job;
  job.micro_batch = 2;
  job.steps = 2;

  SECTION("parallel.zero: 4") {
    job.zero = 4;
    const std::string log = RefusedJob(dir, "zero4", 2, job);
    INFO(log);
    CHECK(absl::StrContains(log, "parallel.zero"));
  }
  SECTION("parallel.gather_dtype: fp16") {
    job.gather_dtype = "fp16";
    const std::string log = RefusedJob(dir, "gather_fp16", 2, job);
    INFO(log);
    CHECK(absl::StrContains(log, "parallel.gather_dtype: expected auto, fp32 or bf16"));
  }
  SECTION("dp_shard: 2 on a world of 3") {
    job.dp_shard = 2;
    CheckRefusedNamingDegrees(dir, "shard2_world3", 3, job);
  }
}

}  // namespace
}  // namespace muster::testing
