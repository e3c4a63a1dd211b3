// FSDP as users run it: the real `worker` under the real `launch
// --standalone`, ranks as processes talking Gloo over loopback on the CPU
// (worker/fsdp.h; the same combinations as threads: fsdp_test.cc).
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
#include "absl/strings/str_split.h"
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
  std::string strategy = "fsdp";
  int zero = 3;
  int dp_replicate = 0;  // 0: auto
  int dp_shard = 0;      // 0: auto
  int micro_batch = 1;
  int accumulation = 1;
  int steps = 20;
  int timeout_s = 30;
  std::string metrics;     // metrics_file, relative to the yaml
  std::string checkpoint;  // the yaml's checkpoint section, or "" for none
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
      ", dp_replicate: ", job.dp_replicate, ", dp_shard: ", job.dp_shard,
      ", bucket_mb: 0.01, timeout_s: ", job.timeout_s, "}\n",
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

// Runs a job that must succeed and returns rank 0's losses.
std::map<int, double> Train(const TempDir& dir, const std::string& name, int world,
                            const Job& job) {
  int code = RunJob(dir, name, world, job);
  INFO(name << ":\n" << ReadFile(dir.File(name + ".log")));
  REQUIRE(code == 0);
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
    CheckMemoryLines(ReadFile(dir.File(name + ".log")), config.world);
  }
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
  std::map<std::string, std::string> expected =
      CheckpointFiles(dir.File("fsdp2_ckpt/" + StepDir(kSteps)));
  CHECK(expected.size() == 2);
  CHECK(CheckpointFiles(dir.File("fsdp2_again_ckpt/" + StepDir(kSteps))) == expected);
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

TEST_CASE("an FSDP rank SIGKILLed mid-run: the other leaves, launch restarts, the run ends exact") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 60, kEvery = 5;
  Job job;
  job.micro_batch = 3;
  job.steps = kSteps;
  // Far beyond what the restart may take: a survivor that waited for the
  // collective's timeout would fail the bounds below.
  job.timeout_s = 120;
  job.checkpoint = CheckpointYaml(dir, "reference_ckpt", kSteps);
  REQUIRE(Train(dir, "reference", 2, job).size() == kSteps);

  job.metrics = "killed.jsonl";
  job.checkpoint = CheckpointYaml(dir, "killed_ckpt", kEvery);
  WriteFile(dir.File("killed.yaml"), JobYaml(job));
  // shutdown_timeout past the bounds below: launch's SIGKILL of the
  // survivor cannot pass for the survivor leaving by itself (the worker
  // takes SIGTERM as a request to stop after the step under way).
  Child launch = StartLaunch(
      {"--standalone", "--nproc_per_node=2", "--max_restarts=1", "--shutdown_timeout=60",
       "--rdzv_id=fsdpkill", BinaryPath("worker/worker"), dir.File("killed.yaml")},
      dir.File("killed.log"));
  // Past the second checkpoint (step 10), so the resume has one to load.
  REQUIRE(
      WaitUntil([&] { return Losses(dir.File("killed.jsonl")).size() >= 12; }, absl::Seconds(30)));
  const int victim = RankPid(launch.pid(), 1);
  const int survivor = RankPid(launch.pid(), 0);
  REQUIRE(victim > 0);
  REQUIRE(survivor > 0);
  const absl::Time killed = absl::Now();
  REQUIRE(::kill(victim, SIGKILL) == 0);
  const int killed_after = Losses(dir.File("killed.jsonl")).rbegin()->first;

  // The survivor's peer socket closes: it leaves its gather or
  // reduce-scatter at once, not after timeout_s.
  REQUIRE(ExitsWithin(survivor, absl::Seconds(30)));
  const absl::Duration left = absl::Now() - killed;
  auto exit = launch.WaitFor(kJobTimeout);
  const absl::Duration finished = absl::Now() - killed;
  std::string log = ReadFile(dir.File("killed.log"));
  INFO(log);
  REQUIRE(exit.has_value());
  WARN("the survivor left " << absl::FormatDuration(left) << " after the SIGKILL; the job finished "
                            << absl::FormatDuration(finished) << " after it");
  CHECK(left < absl::Seconds(10));
  CHECK(finished < absl::Seconds(40));
  REQUIRE(exit->ShellCode() == 0);
  INFO("killed after step " << killed_after);
  CHECK(killed_after < kSteps);
  // Attempt 1 resumed from the last checkpoint before the kill, not from
  // scratch (which would give the same losses too).
  const size_t resumed = log.find("resumed from ");
  REQUIRE(resumed != std::string::npos);
  const size_t step_at = log.find("(step ", resumed);
  int resumed_step = 0;
  REQUIRE(step_at != std::string::npos);
  REQUIRE(absl::SimpleAtoi(log.substr(step_at + 6, log.find(',', step_at) - step_at - 6),
                           &resumed_step));
  INFO("resumed from step " << resumed_step);
  CHECK(resumed_step >= 10);
  CHECK(resumed_step <= killed_after);
  CHECK(resumed_step % kEvery == 0);
  // Every step's loss as written, and the final weights and AdamW moments
  // (both ranks' files of step 60), bit for bit.
  CHECK(LossTexts(dir.File("killed.jsonl")) == LossTexts(dir.File("reference.jsonl")));
  std::map<std::string, std::string> expected =
      CheckpointFiles(dir.File("reference_ckpt/" + StepDir(kSteps)));
  CHECK(expected.size() == 2);
  CHECK(CheckpointFiles(dir.File("killed_ckpt/" + StepDir(kSteps))) == expected);
}

TEST_CASE("bad FSDP configs exit 2 naming the fields") {
  TempDir dir;
  WriteCorpus(dir.path());
  Job job;
  job.micro_batch = 2;
  job.steps = 2;

  SECTION("parallel.zero: 4") {
    job.zero = 4;
    int code = RunJob(dir, "zero4", 2, job, {"--max_restarts=0"});
    std::string log = ReadFile(dir.File("zero4.log"));
    INFO(log);
    CHECK(code == 2);
    CHECK(absl::StrContains(log, "parallel.zero"));
  }
  SECTION("dp_shard: 2 on a world of 3") {
    job.dp_shard = 2;
    int code = RunJob(dir, "shard2_world3", 3, job, {"--max_restarts=0"});
    std::string log = ReadFile(dir.File("shard2_world3.log"));
    INFO(log);
    CHECK(code == 2);
    for (const char* field : {"parallel.dp_replicate", "parallel.dp_shard", "parallel.pp"}) {
      CHECK(absl::StrContains(log, field));
    }
  }
}

}  // namespace
}  // namespace muster::testing
