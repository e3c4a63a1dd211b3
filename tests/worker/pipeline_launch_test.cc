// Pipeline parallelism as users run it: the real `worker` under the real
// `launch --standalone`, ranks as processes talking Gloo over loopback on
// the CPU (worker/pipeline.h; the same combinations as threads:
// pipeline_test.cc).
//   - equivalence: PP=2 and PP=4 under GPipe and 1F1B, and DP=2 x PP=2,
//     follow the 1-process loss curve at the same global batch;
//   - resume across pipeline degrees: a PP=2 checkpoint resumed under
//     PP=2 is bit-exact, under 1 process and PP=4 continues the curve;
//   - failure: SIGKILL the middle stage of a PP=3 job; the stages on
//     either side leave long before parallel.timeout_s, launch restarts
//     the job, and it ends bit for bit as an uninterrupted run;
//   - bad configs exit 2 naming the fields.
//
// Samples line up between layouts: micro-batch m of dp rank r reads the
// global samples first + (m x dp + r) x B .. + B, which is micro-step
// m x dp + r of one process with micro_batch B and grad_accumulation
// dp x M.
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/launcher/harness.h"
#include "worker/data.h"

namespace muster::testing {
namespace {

using launcher::Child;

// Every launch in this file must end well within this; a hang fails the
// test instead of the test's own timeout.
constexpr absl::Duration kJobTimeout = absl::Seconds(60);

// A byte-level corpus with some structure (so the loss moves) and no
// period short enough to repeat within a global batch.
void WriteCorpus(const std::string& dir) {
  std::vector<uint16_t> tokens;
  uint64_t state = 42;
  const std::string words[] = {"alpha ", "beta ", "gamma ", "delta ", "sigma ", "omega. "};
  while (tokens.size() < 20000) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    for (char c : words[(state >> 33) % 6]) tokens.push_back(static_cast<unsigned char>(c));
  }
  REQUIRE(worker::WriteTokenShard(dir + "/train_000.bin", tokens).ok());
}

struct Job {
  int layers = 4;
  int pp = 1;
  std::string schedule = "1f1b";
  int microbatches = 0;  // 0: data.grad_accumulation
  int micro_batch = 2;
  int accumulation = 1;
  int steps = 20;
  int timeout_s = 30;
  std::string metrics;     // metrics_file, relative to the yaml
  std::string checkpoint;  // the yaml's checkpoint section, or "" for none
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
      "parallel: {strategy: ddp, pp: ", job.pp, ", schedule: ", job.schedule,
      ", microbatches: ", job.microbatches, ", bucket_mb: 0.01, timeout_s: ", job.timeout_s, "}\n",
      job.checkpoint.empty() ? "" : absl::StrCat("checkpoint: ", job.checkpoint, "\n"));
}

// checkpoint: {dir: <dir>/<name>, every: <every>[, resume: <resume>]}
std::string CheckpointYaml(const TempDir& dir, const std::string& name, int every,
                           const std::string& resume = "") {
  return absl::StrCat("{dir: \"", dir.File(name), "\", every: ", every,
                      resume.empty() ? "" : absl::StrCat(", resume: \"", resume, "\""), "}");
}

// Writes <name>.yaml for `job` (metrics to <name>.jsonl) and runs it under
// `launch --standalone` on `world` ranks, console to <name>.log. Returns
// launch's exit code; REQUIREs that it exits within kJobTimeout.
int RunJob(const TempDir& dir, const std::string& name, int world, Job job,
           const std::vector<std::string>& launch_flags = {}) {
  job.metrics = name + ".jsonl";
  WriteFile(dir.File(name + ".yaml"), JobYaml(job));
  std::vector<std::string> args = {"--standalone", absl::StrCat("--nproc_per_node=", world)};
  args.insert(args.end(), launch_flags.begin(), launch_flags.end());
  args.push_back(BinaryPath("worker/worker"));
  args.push_back(dir.File(name + ".yaml"));
  Child launch = StartLaunch(args, dir.File(name + ".log"));
  auto exit = launch.WaitFor(kJobTimeout);
  INFO(name << ":\n" << ReadFile(dir.File(name + ".log")));
  REQUIRE(exit.has_value());
  return exit->ShellCode();
}

// Runs a job that must succeed and returns rank 0's losses. A pipeline
// job must say so in its banner: "pipeline (<schedule>, <pp> stages".
std::map<int, double> Train(const TempDir& dir, const std::string& name, int world,
                            const Job& job) {
  int code = RunJob(dir, name, world, job);
  const std::string log = ReadFile(dir.File(name + ".log"));
  INFO(name << ":\n" << log);
  REQUIRE(code == 0);
  if (job.pp > 1) {
    CHECK(
        absl::StrContains(log, absl::StrCat("pipeline (", job.schedule, ", ", job.pp, " stages")));
  }
  return Losses(dir.File(name + ".jsonl"));
}

// Every step of `losses` within 1e-5 relative of the same step of
// `reference`.
void CheckFollows(const std::map<int, double>& losses, const std::map<int, double>& reference,
                  const std::string& what) {
  for (const auto& [step, loss] : losses) {
    auto expected = reference.find(step);
    INFO(what << " step " << step << ": " << loss << " vs "
              << (expected == reference.end() ? NAN : expected->second));
    REQUIRE(expected != reference.end());
    CHECK(std::abs(loss - expected->second) <= 1e-5 * std::abs(expected->second));
  }
}

// A checkpoint's directory name under checkpoint.dir.
std::string StepDir(int step) { return absl::StrFormat("step_%08d", step); }

// The .bin files of a checkpoint directory: name -> contents.
std::map<std::string, std::string> CheckpointFiles(const std::string& step_dir) {
  std::map<std::string, std::string> files;
  if (!std::filesystem::exists(step_dir)) return files;
  for (const auto& entry : std::filesystem::directory_iterator(step_dir)) {
    if (entry.path().extension() == ".bin") {
      files[entry.path().filename().string()] = ReadFile(entry.path().string());
    }
  }
  return files;
}

// The step of the newest checkpoint under `checkpoint_dir` whose manifest
// is in place (a save still being written has none), or 0.
int NewestCheckpoint(const std::string& checkpoint_dir) {
  int newest = 0;
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator(checkpoint_dir, ignored)) {
    const std::string name = entry.path().filename().string();
    int step = 0;
    if (absl::StartsWith(name, "step_") && absl::SimpleAtoi(name.substr(5), &step) &&
        std::filesystem::exists(entry.path() / "manifest.json")) {
      newest = std::max(newest, step);
    }
  }
  return newest;
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
       {Config{1, 2, "gpipe"}, Config{1, 2, "1f1b"}, Config{1, 4, "1f1b"}, Config{1, 4, "gpipe"}}) {
    Job job = pipeline;
    job.pp = config.pp;
    job.schedule = config.schedule;
    const std::string name = absl::StrCat("pp", config.pp, "_", config.schedule);
    std::map<int, double> losses = Train(dir, name, config.dp * config.pp, job);
    CHECK(losses.size() == kSteps);
    CheckFollows(losses, reference, name);
  }

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
}

// Resumes `saved` as `job` on `world` ranks (checkpoints to <name>_ckpt)
// and returns its losses, REQUIREing that it logged the resume and trained
// exactly the steps after the checkpoint's: the data stream continues.
std::map<int, double> Resume(const TempDir& dir, const std::string& name, int world, Job job,
                             const std::string& saved, int saved_step) {
  job.checkpoint = CheckpointYaml(dir, name + "_ckpt", job.steps, saved);
  std::map<int, double> losses = Train(dir, name, world, job);
  std::string log = ReadFile(dir.File(name + ".log"));
  INFO(name << ":\n" << log);
  CHECK(absl::StrContains(log, "resumed from"));
  CHECK(losses.size() == static_cast<size_t>(job.steps - saved_step));
  CHECK((!losses.empty() && losses.begin()->first == saved_step + 1));
  return losses;
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
  std::map<std::string, std::string> expected_files =
      CheckpointFiles(dir.File("pp2_ckpt/" + StepDir(kSteps)));
  CHECK(expected_files.size() == 2);
  CHECK(CheckpointFiles(dir.File("pp2_again_ckpt/" + StepDir(kSteps))) == expected_files);
  // (b) PP=2 -> 1 process.
  CheckFollows(Resume(dir, "pp2_to_one", 1, one, saved, kSaved), uninterrupted, "pp2 -> one");
  // (c) PP=2 -> PP=4.
  CheckFollows(Resume(dir, "pp2_to_pp4", 4, pp4, saved, kSaved), uninterrupted, "pp2 -> pp4");
}

// The pid of `launch`'s worker with `RANK=rank` in its environment, or -1.
int RankPid(int launch, int rank) {
  const std::string entry = absl::StrCat("RANK=", rank);
  return FindChild(launch, [&](int pid) { return HasEnvironmentEntry(pid, entry); });
}

// Waits, up to `timeout`, for a process that is not this one's child to
// exit: its pidfd polls readable then. True if it is gone.
bool ExitsWithin(int pid, absl::Duration timeout) {
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) return errno == ESRCH;
  const absl::Time deadline = absl::Now() + timeout;
  int ready = 0;
  do {
    pollfd event = {pidfd, POLLIN, 0};
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    ready = poll(&event, 1, static_cast<int>(std::max<int64_t>(left, 0)));
  } while (ready < 0 && errno == EINTR);
  close(pidfd);
  return ready == 1;
}

TEST_CASE("the middle stage SIGKILLed: the others leave, launch restarts, the run ends exact") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 60, kEvery = 5;
  Job job;
  job.pp = 3;
  job.microbatches = 3;
  job.steps = kSteps;
  // Far beyond what the restart may take: a stage that waited for its
  // receive's timeout would fail the bounds below.
  job.timeout_s = 120;
  job.checkpoint = CheckpointYaml(dir, "reference_ckpt", kSteps);
  REQUIRE(Train(dir, "reference", 3, job).size() == kSteps);

  job.metrics = "killed.jsonl";
  job.checkpoint = CheckpointYaml(dir, "killed_ckpt", kEvery);
  WriteFile(dir.File("killed.yaml"), JobYaml(job));
  // shutdown_timeout past the bounds below: launch's SIGKILL of a
  // survivor cannot pass for it leaving by itself (the worker takes
  // SIGTERM as a request to stop after the step under way).
  Child launch = StartLaunch(
      {"--standalone", "--nproc_per_node=3", "--max_restarts=1", "--shutdown_timeout=60",
       "--rdzv_id=ppkill", BinaryPath("worker/worker"), dir.File("killed.yaml")},
      dir.File("killed.log"));
  // Past the second checkpoint (step 10), so the resume has one to load:
  // its manifest, renamed into place once every stage's file is durable
  // (the save runs in the background, some steps behind the loss log).
  const std::string second = dir.File("killed_ckpt/" + StepDir(2 * kEvery) + "/manifest.json");
  REQUIRE(WaitUntil([&] { return std::filesystem::exists(second); }, absl::Seconds(30)));
  const int first = RankPid(launch.pid(), 0);
  const int victim = RankPid(launch.pid(), 1);
  const int last = RankPid(launch.pid(), 2);
  REQUIRE(first > 0);
  REQUIRE(victim > 0);
  REQUIRE(last > 0);
  const int saved_before = NewestCheckpoint(dir.File("killed_ckpt"));
  const absl::Time killed = absl::Now();
  REQUIRE(::kill(victim, SIGKILL) == 0);
  const int killed_after = Losses(dir.File("killed.jsonl")).rbegin()->first;

  // Both neighbours' channels to the middle stage close: each leaves its
  // send or receive at once, not after timeout_s.
  REQUIRE(ExitsWithin(first, absl::Seconds(30)));
  const absl::Duration first_left = absl::Now() - killed;
  REQUIRE(ExitsWithin(last, absl::Seconds(30)));
  const absl::Duration last_left = absl::Now() - killed;
  auto exit = launch.WaitFor(kJobTimeout);
  const absl::Duration finished = absl::Now() - killed;
  std::string log = ReadFile(dir.File("killed.log"));
  INFO(log);
  REQUIRE(exit.has_value());
  WARN("the first stage left " << absl::FormatDuration(first_left) << " and the last "
                               << absl::FormatDuration(last_left)
                               << " after the SIGKILL; the job finished "
                               << absl::FormatDuration(finished) << " after it");
  CHECK(first_left < absl::Seconds(10));
  CHECK(last_left < absl::Seconds(10));
  CHECK(finished < absl::Seconds(40));
  REQUIRE(exit->ShellCode() == 0);
  INFO("killed after step " << killed_after);
  CHECK(killed_after < kSteps);
  // Attempt 1 resumed from the newest checkpoint saved before the kill,
  // not from an older one or from scratch (which would give the same
  // losses too).
  const size_t resumed = log.find("resumed from ");
  REQUIRE(resumed != std::string::npos);
  const size_t step_at = log.find("(step ", resumed);
  int resumed_step = 0;
  REQUIRE(step_at != std::string::npos);
  REQUIRE(absl::SimpleAtoi(log.substr(step_at + 6, log.find(',', step_at) - step_at - 6),
                           &resumed_step));
  INFO("resumed from step " << resumed_step);
  CHECK(resumed_step >= saved_before);
  CHECK(resumed_step >= 2 * kEvery);
  CHECK(resumed_step <= killed_after);
  CHECK(resumed_step % kEvery == 0);
  // Every step's loss as written, and the final weights and AdamW moments
  // (every stage's file of step 60), bit for bit.
  CHECK(LossTexts(dir.File("killed.jsonl")) == LossTexts(dir.File("reference.jsonl")));
  std::map<std::string, std::string> expected =
      CheckpointFiles(dir.File("reference_ckpt/" + StepDir(kSteps)));
  CHECK(expected.size() == 3);
  CHECK(CheckpointFiles(dir.File("killed_ckpt/" + StepDir(kSteps))) == expected);
}

TEST_CASE("bad pipeline configs exit 2 naming the fields") {
  TempDir dir;
  WriteCorpus(dir.path());
  Job job;
  job.microbatches = 4;
  job.steps = 2;

  SECTION("pp: 2 on a world of 3") {
    job.pp = 2;
    int code = RunJob(dir, "pp2_world3", 3, job, {"--max_restarts=0"});
    std::string log = ReadFile(dir.File("pp2_world3.log"));
    INFO(log);
    CHECK(code == 2);
    for (const char* field : {"parallel.dp_replicate", "parallel.dp_shard", "parallel.pp"}) {
      CHECK(absl::StrContains(log, field));
    }
  }
  SECTION("pp: 4 over 3 blocks") {
    // 4 ranks: the degrees cover the world; only the blocks are too few.
    job.layers = 3;
    job.pp = 4;
    int code = RunJob(dir, "pp4_layers3", 4, job, {"--max_restarts=0"});
    std::string log = ReadFile(dir.File("pp4_layers3.log"));
    INFO(log);
    CHECK(code == 2);
    CHECK(absl::StrContains(log, "parallel.pp"));
    CHECK(absl::StrContains(log, "model.layers"));
  }
  SECTION("1f1b with 1 micro-batch over 2 stages") {
    job.pp = 2;
    job.schedule = "1f1b";
    job.microbatches = 1;
    int code = RunJob(dir, "1f1b_m1", 2, job, {"--max_restarts=0"});
    std::string log = ReadFile(dir.File("1f1b_m1.log"));
    INFO(log);
    CHECK(code == 2);
    CHECK(absl::StrContains(log, "parallel.microbatches"));
  }
}

}  // namespace
}  // namespace muster::testing
