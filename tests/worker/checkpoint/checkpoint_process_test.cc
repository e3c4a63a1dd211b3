// Checkpoints with real processes: a worker SIGKILLed mid-training under
// `launch --max_restarts=1` resumes and ends bitwise where an uninterrupted
// run ends; a worker SIGKILLed in each phase of a save resumes from the
// previous checkpoint (the save stopped there by fault_worker's file
// system, tests/worker/checkpoint/fault_worker.cc). Every wait has a deadline;
// nothing sleeps. A second run on a checkpoint.dir in use is refused,
// and the SIGKILL of the first frees the directory for the next.
#include <signal.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "launcher/worker_env.h"
#include "tests/launcher/harness.h"
#include "worker/checkpoint/dir_lock.h"
#include "worker/checkpoint/env.h"
#include "worker/data/data.h"

namespace muster::testing {
namespace {

namespace fs = std::filesystem;

// L=2, C=64, T=32, B=8: a few ms a step, enough steps to kill one mid-run.
void WriteSetup(const TempDir& dir, const std::string& name, int steps, int every) {
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 20000; ++i) tokens.push_back("abcdefghijklm"[i % 13]);
  if (!fs::exists(dir.File("train_000.bin"))) {
    REQUIRE(worker::WriteTokenShard(dir.File("train_000.bin"), tokens).ok());
  }
  WriteFile(dir.File(name + ".yaml"),
            absl::StrCat("model: {layers: 2, heads: 2, dim: 64, vocab: 256, seq_len: 32}\n",
                         "data: {train: \"", dir.File("train_*.bin"), "\", micro_batch: 8}\n",
                         "optim: {lr: 0.003}\n", "train: {steps: ", steps,
                         ", log_every: 1, metrics_file: \"", dir.File(name + ".jsonl"), "\"}\n",
                         "device: cpu\n", "checkpoint: {dir: \"", dir.File(name + "_ckpt"),
                         "\", every: ", every, ", keep_last: 2}\n"));
}

std::vector<std::string> Environment(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (const auto& [key, value] : launcher::CurrentEnvironment()) {
    if (key == "WORLD_SIZE" || key == "RANK") continue;
    env.push_back(key + "=" + value);
  }
  env.push_back("OMP_WAIT_POLICY=passive");
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

// `binary` (a workspace path) with `flags`, then dir/name.yaml; its output
// is appended to dir/name.log.
launcher::Child StartProgram(const TempDir& dir, const std::string& name, const std::string& binary,
                             const std::vector<std::string>& flags,
                             const std::vector<std::string>& extra_env) {
  launcher::SpawnSpec spec;
  spec.argv = {"/bin/sh", "-c", "exec \"$0\" \"$@\" >>" + dir.File(name + ".log") + " 2>&1",
               BinaryPath(binary)};
  spec.argv.insert(spec.argv.end(), flags.begin(), flags.end());
  spec.argv.push_back(dir.File(name + ".yaml"));
  spec.env = Environment(extra_env);
  auto child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  return std::move(*child);
}

launcher::Child StartWorker(const TempDir& dir, const std::string& name,
                            const std::vector<std::string>& extra_env = {}) {
  return StartProgram(dir, name, "worker/worker", {}, extra_env);
}

// The worker on a file system that blocks the save of `step` at `phase`,
// after creating dir/paused (tests/worker/checkpoint/fault_worker.cc).
launcher::Child StartPausingWorker(const TempDir& dir, const std::string& name,
                                   const std::string& phase, int step) {
  return StartProgram(
      dir, name, "tests/worker/checkpoint/fault_worker",
      {absl::StrCat("--pause_at=", phase, "@", step), "--pause_marker=" + dir.File("paused")}, {});
}

int ExitCode(launcher::Child& child) {
  auto exit = child.WaitFor(absl::Seconds(120));
  REQUIRE(exit.has_value());
  return exit->ShellCode();
}

int LastStep(const std::string& path) {
  auto losses = LossTexts(path);
  return losses.empty() ? 0 : losses.rbegin()->first;
}

TEST_CASE("SIGKILLed mid-run under launch, the worker resumes and ends bitwise identical") {
  TempDir dir;
  const int steps = 60, every = 10;
  WriteSetup(dir, "reference", steps, steps);
  launcher::Child reference = StartWorker(dir, "reference");
  REQUIRE(ExitCode(reference) == 0);

  WriteSetup(dir, "killed", steps, every);
  launcher::Child launch = StartLaunch(
      {"--standalone", "--nproc_per_node=1", "--max_restarts=1", "--monitor_interval=0.05",
       "--no_python", BinaryPath("worker/worker"), dir.File("killed.yaml")},
      dir.File("launch.log"), {"OMP_WAIT_POLICY=passive"});
  // Kill partway through the step after step 22 (N = 20 checkpointed, k = 3).
  REQUIRE(WaitUntil([&] { return LastStep(dir.File("killed.jsonl")) >= 22; }, absl::Seconds(60)));
  const int worker = FindChild(launch.pid(), [](int pid) { return ProcessName(pid) == "worker"; });
  INFO(ReadFile(dir.File("launch.log")));
  REQUIRE(worker > 0);
  const int killed_after = LastStep(dir.File("killed.jsonl"));
  REQUIRE(kill(worker, SIGKILL) == 0);
  REQUIRE(ExitCode(launch) == 0);

  const std::string log = ReadFile(dir.File("launch.log"));
  INFO("killed after step " << killed_after);
  CHECK(killed_after < steps);
  CHECK(absl::StrContains(log, "checkpoint: resumed from " + dir.File("killed_ckpt/step_000000")));
  CHECK(LossTexts(dir.File("killed.jsonl")) == LossTexts(dir.File("reference.jsonl")));
  CHECK(LossTexts(dir.File("reference.jsonl")).size() == steps);
  // The steps from the checkpoint to the kill were logged twice, and the
  // resumed run cut the first time's lines: each step is in the file once,
  // in order.
  CHECK(LoggedSteps(dir.File("killed.jsonl")) == LoggedSteps(dir.File("reference.jsonl")));
  std::smatch resumed;
  REQUIRE(std::regex_search(log, resumed, std::regex(R"(resumed from \S+ \(step (\d+),)")));
  if (std::stoi(resumed[1]) < killed_after) {
    CHECK(absl::StrContains(log,
                            absl::StrCat("from ", dir.File("killed.jsonl"), ": logged after step ",
                                         resumed[1].str(), ", which this run resumes from")));
  }
  // Weights and both AdamW moments: the final checkpoints' bytes.
  const std::string a = ReadFile(dir.File("reference_ckpt/step_00000060/rank_00000.bin"));
  const std::string b = ReadFile(dir.File("killed_ckpt/step_00000060/rank_00000.bin"));
  CHECK(!a.empty());
  CHECK(a == b);
}

TEST_CASE("SIGTERM: the worker saves the step it was on, exits 75, and the next run continues") {
  TempDir dir;
  const int steps = 60;
  WriteSetup(dir, "reference", steps, steps);
  launcher::Child reference = StartWorker(dir, "reference");
  REQUIRE(ExitCode(reference) == 0);

  WriteSetup(dir, "preempted", steps, 1000);  // no periodic save: only the preemption's
  launcher::Child worker = StartWorker(dir, "preempted");
  REQUIRE(
      WaitUntil([&] { return LastStep(dir.File("preempted.jsonl")) >= 10; }, absl::Seconds(60)));
  REQUIRE(kill(worker.pid(), SIGTERM) == 0);
  REQUIRE(ExitCode(worker) == launcher::kPreemptedExitCode);
  const int stopped_after = LastStep(dir.File("preempted.jsonl"));
  const std::string step_dir = dir.File(absl::StrFormat("preempted_ckpt/step_%08d", stopped_after));
  std::string log = ReadFile(dir.File("preempted.log"));
  INFO(log);
  CHECK(stopped_after < steps);
  CHECK(
      absl::StrContains(log, absl::StrCat("worker: preempted by SIGTERM after step ", stopped_after,
                                          "; checkpoint step ", stopped_after, " committed in ")));
  CHECK(fs::exists(step_dir + "/manifest.json"));

  launcher::Child resumed = StartWorker(dir, "preempted");
  REQUIRE(ExitCode(resumed) == 0);
  log = ReadFile(dir.File("preempted.log"));
  CHECK(absl::StrContains(log, "checkpoint: resumed from " + step_dir));
  // No step lost or repeated: the metrics file is the uninterrupted run's.
  CHECK(LossTexts(dir.File("preempted.jsonl")) == LossTexts(dir.File("reference.jsonl")));
  const std::string a = ReadFile(dir.File("reference_ckpt/step_00000060/rank_00000.bin"));
  const std::string b = ReadFile(dir.File("preempted_ckpt/step_00000060/rank_00000.bin"));
  CHECK(!a.empty());
  CHECK(a == b);
}

TEST_CASE("SIGTERM to launch: 2 ranks save one step, launch exits 75, the next launch continues") {
  TempDir dir;
  const int steps = 40;
  auto run_launch = [&](const std::string& name) {
    return StartLaunch({"--standalone", "--nproc_per_node=2", "--monitor_interval=0.05",
                        "--no_python", BinaryPath("worker/worker"), dir.File(name + ".yaml")},
                       dir.File(name + ".log"), {"OMP_WAIT_POLICY=passive"});
  };
  WriteSetup(dir, "reference", steps, steps);
  launcher::Child reference = run_launch("reference");
  REQUIRE(ExitCode(reference) == 0);

  WriteSetup(dir, "preempted", steps, 1000);
  launcher::Child launch = run_launch("preempted");
  REQUIRE(WaitUntil([&] { return LastStep(dir.File("preempted.jsonl")) >= 8; }, absl::Seconds(60)));
  REQUIRE(kill(launch.pid(), SIGTERM) == 0);
  const int code = ExitCode(launch);
  std::string log = ReadFile(dir.File("preempted.log"));
  INFO(log);
  REQUIRE(code == launcher::kPreemptedExitCode);
  const int stopped_after = LastStep(dir.File("preempted.jsonl"));
  CHECK(stopped_after < steps);
  CHECK(absl::StrContains(log, "preempted"));
  CHECK(fs::exists(
      dir.File(absl::StrFormat("preempted_ckpt/step_%08d/manifest.json", stopped_after))));

  launcher::Child resumed = run_launch("preempted");
  REQUIRE(ExitCode(resumed) == 0);
  CHECK(LossTexts(dir.File("preempted.jsonl")) == LossTexts(dir.File("reference.jsonl")));
  for (const char* file : {"rank_00000.bin", "rank_00001.bin"}) {
    const std::string a = ReadFile(dir.File(absl::StrCat("reference_ckpt/step_00000040/", file)));
    const std::string b = ReadFile(dir.File(absl::StrCat("preempted_ckpt/step_00000040/", file)));
    CHECK(!a.empty());
    CHECK(a == b);
  }
}

TEST_CASE("SIGKILLed in any phase of a save, the worker resumes from the previous checkpoint") {
  for (const char* phase : {"data", "manifest", "rename"}) {
    DYNAMIC_SECTION("phase " << phase) {
      TempDir dir;
      WriteSetup(dir, "run", 12, 4);
      launcher::Child paused = StartPausingWorker(dir, "run", phase, 8);
      REQUIRE(WaitUntil([&] { return fs::exists(dir.File("paused")); }, absl::Seconds(60)));
      paused.SignalGroup(SIGKILL);
      REQUIRE(ExitCode(paused) == 128 + SIGKILL);
      INFO(ReadFile(dir.File("run.log")));
      CHECK(fs::exists(dir.File("run_ckpt/step_00000004/manifest.json")));
      CHECK_FALSE(fs::exists(dir.File("run_ckpt/step_00000008")));
      CHECK(fs::exists(dir.File("run_ckpt/.tmp_step_00000008")));
      // Killed where the phase says: the same state is of the same size.
      const std::string tmp = dir.File("run_ckpt/.tmp_step_00000008/");
      const uintmax_t full = fs::file_size(dir.File("run_ckpt/step_00000004/rank_00000.bin"));
      const std::string phase_name = phase;
      if (phase_name == "data") {
        REQUIRE(fs::exists(tmp + "rank_00000.bin"));
        CHECK(fs::file_size(tmp + "rank_00000.bin") > 0);
        CHECK(fs::file_size(tmp + "rank_00000.bin") < full);
        CHECK_FALSE(fs::exists(tmp + "rank_00000.bin.done"));
      } else {
        REQUIRE(fs::exists(tmp + "rank_00000.bin"));
        CHECK(fs::file_size(tmp + "rank_00000.bin") == full);
        CHECK(fs::exists(tmp + "manifest.json") == (phase_name == "rename"));
      }

      launcher::Child resumed = StartWorker(dir, "run");
      REQUIRE(ExitCode(resumed) == 0);
      const std::string log = ReadFile(dir.File("run.log"));
      INFO(log);
      CHECK(absl::StrContains(
          log, "checkpoint: resumed from " + dir.File("run_ckpt/step_00000004") + " (step 4"));
      CHECK(fs::exists(dir.File("run_ckpt/step_00000012/manifest.json")));
      CHECK_FALSE(fs::exists(dir.File("run_ckpt/.tmp_step_00000008")));
    }
  }
}

// A copy of dir/from.yaml as dir/to.yaml, its own metrics file and `steps`,
// the same checkpoint.dir.
void CopySetup(const TempDir& dir, const std::string& from, const std::string& to, int steps) {
  std::string yaml = ReadFile(dir.File(from + ".yaml"));
  yaml = absl::StrReplaceAll(yaml, {{from + ".jsonl", to + ".jsonl"}});
  const size_t at = yaml.find("steps: ");
  REQUIRE(at != std::string::npos);
  yaml.replace(at, yaml.find(',', at) - at, absl::StrCat("steps: ", steps));
  WriteFile(dir.File(to + ".yaml"), yaml);
}

// The newest committed step in `ckpt`, 0 if none.
int NewestCheckpoint(const std::string& ckpt) {
  int newest = 0;
  for (const auto& entry : fs::directory_iterator(ckpt)) {
    const std::string name = entry.path().filename().string();
    int step = 0;
    if (absl::StartsWith(name, "step_") && fs::exists(entry.path() / "manifest.json") &&
        absl::SimpleAtoi(name.substr(5), &step)) {
      newest = std::max(newest, step);
    }
  }
  return newest;
}

TEST_CASE("a second run on a checkpoint.dir in use is refused at once; the first's kill frees it") {
  TempDir dir;
  WriteSetup(dir, "first", 1000000, 10);
  launcher::Child first = StartWorker(dir, "first");
  REQUIRE(WaitUntil([&] { return LastStep(dir.File("first.jsonl")) >= 12; }, absl::Seconds(60)));

  CopySetup(dir, "first", "second", 1000000);
  launcher::Child second = StartWorker(dir, "second");
  const int code = ExitCode(second);
  const std::string refused = ReadFile(dir.File("second.log"));
  INFO(refused);
  CHECK(code == 1);
  CHECK(absl::StrContains(
      refused, absl::StrCat("worker: checkpoint.dir ", dir.File("first_ckpt"),
                            " is in use by another run: pid ", first.pid(), " on host ")));
  CHECK_FALSE(absl::StrContains(refused, "deleted"));
  CHECK_FALSE(fs::exists(dir.File("second.jsonl")));

  // The first goes on training and saving.
  const int before = LastStep(dir.File("first.jsonl"));
  REQUIRE(WaitUntil([&] { return NewestCheckpoint(dir.File("first_ckpt")) >= before + 10; },
                    absl::Seconds(60)));
  REQUIRE(kill(first.pid(), SIGKILL) == 0);
  REQUIRE(ExitCode(first) == 128 + SIGKILL);

  // Its lock went with it: the next run takes it and resumes there.
  const int newest = NewestCheckpoint(dir.File("first_ckpt"));
  CopySetup(dir, "first", "third", newest + 3);
  launcher::Child third = StartWorker(dir, "third");
  REQUIRE(ExitCode(third) == 0);
  const std::string resumed = ReadFile(dir.File("third.log"));
  INFO(resumed);
  CHECK(absl::StrContains(resumed, absl::StrFormat("checkpoint: resumed from %s/step_%08d",
                                                   dir.File("first_ckpt"), newest)));
  CHECK(LastStep(dir.File("third.jsonl")) == newest + 3);
}

// launch's log (--max_restarts=3) of a job that failed at once, as one
// that no restart can mend must: none of its restarts spent, no round 1.
void CheckFailedWithoutRestart(const std::string& log) {
  CHECK(absl::StrContains(log, "failed without a restart (0 of 3 used)"));
  CHECK_FALSE(absl::StrContains(log, "round 1"));
}

// A real full disk: `launch` (`launch_args`, its output to `log`) runs in
// a mount namespace of its own (unshare -rm: no privilege needed where
// user namespaces are allowed, as on Debian) in which `ckpt` is a tmpfs of
// `kib` KiB, filled to the last byte first with `fill`. What `ckpt` held
// when launch ended is listed into `listing`, since the tmpfs goes with
// the namespace.
launcher::Child StartLaunchOnTmpfs(const std::string& ckpt, uint64_t kib,
                                   const std::vector<std::string>& launch_args,
                                   const std::string& log, const std::string& listing,
                                   bool fill = false) {
  launcher::SpawnSpec spec;
  spec.argv = {"/usr/bin/unshare",
               "-rm",
               "/bin/sh",
               "-c",
               "size=$1 ckpt=$2 log=$3 listing=$4 fill=$5; shift 5\n"
               "mount -t tmpfs -o size=${size}k tmpfs \"$ckpt\" || exit 97\n"
               "if [ \"$fill\" = 1 ]; then cat /dev/zero >\"$ckpt/filler\" 2>/dev/null; fi\n"
               "\"$@\" >>\"$log\" 2>&1; code=$?\n"
               "ls -a \"$ckpt\" >\"$listing\"\n"
               "exit $code",
               "sh",
               absl::StrCat(kib),
               ckpt,
               log,
               listing,
               fill ? "1" : "0",
               BinaryPath("launcher/launch")};
  spec.argv.insert(spec.argv.end(), launch_args.begin(), launch_args.end());
  spec.env = Environment({});
  auto child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  return std::move(*child);
}

TEST_CASE("a full checkpoint disk fails the job at once under launch, says why, leaves no debris") {
  TempDir dir;
  // What one checkpoint of this model takes (2 ranks write half each).
  WriteSetup(dir, "probe", 1, 1);
  launcher::Child probe = StartWorker(dir, "probe");
  REQUIRE(ExitCode(probe) == 0);
  const uint64_t bytes = fs::file_size(dir.File("probe_ckpt/step_00000001/rank_00000.bin"));

  // Room for two checkpoints and half a third: keep_last 2 holds three
  // while a save is written, so step 30's save finds the disk full.
  WriteSetup(dir, "full", 60, 10);
  fs::create_directories(dir.File("full_ckpt"));
  launcher::Child launch = StartLaunchOnTmpfs(
      dir.File("full_ckpt"), bytes * 5 / 2 / 1024,
      {"--standalone", "--nproc_per_node=2", "--max_restarts=3", "--monitor_interval=0.05",
       "--no_python", BinaryPath("worker/worker"), dir.File("full.yaml")},
      dir.File("full.log"), dir.File("listing"));
  const int code = ExitCode(launch);
  const std::string log = ReadFile(dir.File("full.log"));
  INFO(log);
  REQUIRE(code != 97);  // the tmpfs was mounted
  CHECK(code == 1);     // the worker's code for a failure that is not the config's

  // Warned when it started...
  CHECK(absl::StrContains(
      log, "checkpoint: warning: the file system of " + dir.File("full_ckpt") + " has "));
  CHECK(absl::StrContains(log, "keep_last 2 keeps up to 3 while a save is written (0 there now)"));
  // ...failed at step 30's save, saying why and where a rerun resumes...
  CHECK(absl::StrContains(log, "saving checkpoint step 30"));
  CHECK(absl::StrContains(log, "No space left on device"));
  CHECK(absl::StrContains(log, "start the run again, which resumes from step 20"));
  // ...and failed the job without spending its restarts, which would each
  // redo 10 steps to fail the same way.
  CheckFailedWithoutRestart(log);
  // The save is written beside the steps after it: its failure surfaces a
  // step or more later, and before the next save.
  CHECK(LastStep(dir.File("full.jsonl")) >= 30);
  CHECK(LastStep(dir.File("full.jsonl")) < 40);

  // The failed save's files are gone: the full disk has its space back.
  const std::string listing = ReadFile(dir.File("listing"));
  INFO(listing);
  CHECK(absl::StrContains(listing, "step_00000010\n"));
  CHECK(absl::StrContains(listing, "step_00000020\n"));
  CHECK_FALSE(absl::StrContains(listing, "step_00000030"));
}

// A checkpoint.dir that cannot be: a file on its way. Rank 0 finds it
// taking the directory's LOCK; rank 1 learns rank 0's error from the
// collective both wait in. Both fail as a config error, which no restart
// mends, so the job fails at once, and whichever failure launch's table
// shows names the cause (before: rank 1's "failed on rank 0 (see its log)",
// restarted until the budget was spent).
TEST_CASE("a checkpoint.dir through a file fails the job at once, naming the cause on every rank") {
  TempDir dir;
  WriteSetup(dir, "file", 10, 5);
  WriteFile(dir.File("file_ckpt"), "a file, not a directory\n");
  launcher::Child launch = StartLaunch(
      {"--standalone", "--nproc_per_node=2", "--max_restarts=3", "--monitor_interval=0.05",
       "--no_python", BinaryPath("worker/worker"), dir.File("file.yaml")},
      dir.File("file.log"), {"OMP_WAIT_POLICY=passive"});
  const int code = ExitCode(launch);
  const std::string log = ReadFile(dir.File("file.log"));
  INFO(log);
  CHECK(code == 2);  // a config error
  const std::string cause =
      "checkpoint.dir: " + dir.File("file_ckpt") + ": cannot create directory: Not a directory";
  CHECK(absl::StrContains(log, "rank0]: worker: " + cause));
  CHECK(absl::StrContains(
      log, "rank1]: worker: taking checkpoint.dir's LOCK failed on rank 0: " + cause));
  CheckFailedWithoutRestart(log);
  CHECK_FALSE(absl::StrContains(log, "see its log"));
}

// The worker says "no restart can mend this" in its error file, under
// --log_dir. With that on a full disk too the file cannot be written, and
// the exit code says it instead (78): launch fails the job at once rather
// than restarting it three times into the same failure.
TEST_CASE(
    "with the log directory on a full disk, a failure no restart can mend still fails at once") {
  TempDir dir;
  WriteFile(dir.File("bad.yaml"), "model:\n  layerz: 4\n");
  fs::create_directories(dir.File("logs"));
  launcher::Child launch = StartLaunchOnTmpfs(
      dir.File("logs"), 256,
      {"--standalone", "--nproc_per_node=1", "--max_restarts=3", "--monitor_interval=0.05",
       "--log_dir", dir.File("logs"), "--rdzv_id=fulllogs", "--no_python",
       BinaryPath("worker/worker"), dir.File("bad.yaml")},
      dir.File("bad.log"), dir.File("listing"), /*fill=*/true);
  const int code = ExitCode(launch);
  const std::string log = ReadFile(dir.File("bad.log"));
  INFO(log);
  REQUIRE(code != 97);  // the tmpfs was mounted
  CHECK(code == 78);
  CHECK(absl::StrContains(log, "layerz"));
  CHECK(absl::StrContains(log, "; exiting 78, which tells launch that no restart can mend this"));
  CHECK(absl::StrContains(log, "rank 0's exit code 78 says no restart can mend its failure"));
  CheckFailedWithoutRestart(log);
}

// The agent starts muster's worker with its preemption signals blocked, and
// the worker holds them until it handles them: a SIGTERM while the worker
// is still loading (a job preempted as it starts or restarts) is answered
// after the first step, not fatal (it was exit 143, "not clean", then).
TEST_CASE("SIGTERM to launch as its workers start: they save step 1 and launch exits 75") {
  TempDir dir;
  WriteSetup(dir, "early", 40, 1000);
  launcher::Child launch = StartLaunch(
      {"--standalone", "--nproc_per_node=2", "--monitor_interval=0.05", dir.File("early.yaml")},
      dir.File("early.log"), {"OMP_WAIT_POLICY=passive"});
  // The moment the first worker process exists: it has not even loaded.
  REQUIRE(WaitUntil([&] { return FindChild(launch.pid(), [](int) { return true; }) > 0; },
                    absl::Seconds(30)));
  REQUIRE(kill(launch.pid(), SIGTERM) == 0);
  const int code = ExitCode(launch);
  INFO(ReadFile(dir.File("early.log")));
  CHECK(code == launcher::kPreemptedExitCode);
  CHECK(NewestCheckpoint(dir.File("early_ckpt")) == 1);
}

TEST_CASE("SIGTERM before the first step: a start that cannot go on exits 75, losing nothing") {
  TempDir dir;
  WriteSetup(dir, "first", 20, 10);
  launcher::Child first = StartWorker(dir, "first");
  REQUIRE(ExitCode(first) == 0);
  // A run on another host holds the directory (this test, as it): the next
  // start waits for its LOCK, with no step trained.
  auto lock = worker::Env::Default()->LockFile(dir.File("first_ckpt/LOCK"));
  REQUIRE(lock.ok());
  worker::LockHolder elsewhere;
  elsewhere.pid = 4242;
  elsewhere.host = "elsewhere";
  elsewhere.token = 7;
  REQUIRE((*lock)->SetContents(worker::FormatLockHolder(elsewhere)).ok());
  auto start_waiting = [&](const std::string& name, int lock_wait, const std::string& grace) {
    CopySetup(dir, "first", name, 40);
    std::string yaml = ReadFile(dir.File(name + ".yaml"));
    yaml = absl::StrReplaceAll(
        yaml, {{"keep_last: 2}", absl::StrCat("keep_last: 2, lock_wait: ", lock_wait, "}")}});
    WriteFile(dir.File(name + ".yaml"), yaml);
    launcher::Child worker = StartWorker(dir, name, {"MUSTER_PREEMPT_GRACE_S=" + grace});
    REQUIRE(WaitUntil(
        [&] { return absl::StrContains(ReadFile(dir.File(name + ".log")), "waiting up to"); },
        absl::Seconds(60)));
    return worker;
  };

  SECTION("still starting at half the grace: it leaves then, before the launcher's SIGKILL") {
    launcher::Child worker = start_waiting("stuck", 60, "2");
    absl::Time sent = absl::Now();
    REQUIRE(kill(worker.pid(), SIGTERM) == 0);
    CHECK(ExitCode(worker) == launcher::kPreemptedExitCode);
    const absl::Duration took = absl::Now() - sent;
    CHECK(took >= absl::Seconds(1));
    CHECK(took < absl::Seconds(2));  // the grace: the launcher would SIGKILL it there
    const std::string log = ReadFile(dir.File("stuck.log"));
    INFO(log);
    CHECK(absl::StrContains(log,
                            "worker: preempted before training began (still starting at "
                            "half the preemption grace)"));
  }
  SECTION("a start that fails while the signal is pending exits 75, not 1") {
    launcher::Child worker = start_waiting("refused", 1, "30");
    REQUIRE(kill(worker.pid(), SIGTERM) == 0);
    CHECK(ExitCode(worker) == launcher::kPreemptedExitCode);
    const std::string log = ReadFile(dir.File("refused.log"));
    INFO(log);
    CHECK(absl::StrContains(log, "worker: preempted before training began (checkpoint.dir " +
                                     dir.File("first_ckpt") + " is in use by another run"));
  }
  // Nothing was trained or saved: the newest checkpoint is the first run's.
  CHECK(NewestCheckpoint(dir.File("first_ckpt")) == 20);
}

}  // namespace
}  // namespace muster::testing
