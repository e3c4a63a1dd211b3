#include "tests/worker/launch_job.h"

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
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "launcher/process.h"
#include "worker/data/data.h"

namespace muster::testing {
namespace {

// The .bin files of a checkpoint directory: name -> contents (empty if the
// directory is missing).
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

// The step of the first "resumed from ... (step N, ..." in a launch log;
// REQUIREs that there is one.
int ResumedStep(const std::string& log) {
  const size_t resumed = log.find("resumed from ");
  REQUIRE(resumed != std::string::npos);
  const size_t step_at = log.find("(step ", resumed);
  int resumed_step = 0;
  REQUIRE(step_at != std::string::npos);
  REQUIRE(absl::SimpleAtoi(log.substr(step_at + 6, log.find(',', step_at) - step_at - 6),
                           &resumed_step));
  return resumed_step;
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

}  // namespace

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

std::string CheckpointYaml(const TempDir& dir, const std::string& name, int every,
                           const std::string& resume) {
  return absl::StrCat("{dir: \"", dir.File(name), "\", every: ", every,
                      resume.empty() ? "" : absl::StrCat(", resume: \"", resume, "\""), "}");
}

int RunYaml(const TempDir& dir, const std::string& name, int world, const std::string& yaml,
            const std::vector<std::string>& launch_flags) {
  WriteFile(dir.File(name + ".yaml"), yaml);
  std::vector<std::string> args = {"--standalone", absl::StrCat("--nproc_per_node=", world)};
  args.insert(args.end(), launch_flags.begin(), launch_flags.end());
  args.push_back(BinaryPath("worker/worker"));
  args.push_back(dir.File(name + ".yaml"));
  launcher::Child launch = StartLaunch(args, dir.File(name + ".log"));
  auto exit = launch.WaitFor(kJobTimeout);
  INFO(name << ":\n" << ReadFile(dir.File(name + ".log")));
  REQUIRE(exit.has_value());
  return exit->ShellCode();
}

std::string RefusedYaml(const TempDir& dir, const std::string& name, int world,
                        const std::string& yaml) {
  const int code = RunYaml(dir, name, world, yaml, {"--max_restarts=0"});
  std::string log = ReadFile(dir.File(name + ".log"));
  INFO(name << ":\n" << log);
  CHECK(code == 2);
  return log;
}

std::map<int, double> TrainYaml(const TempDir& dir, const std::string& name, int world,
                                const std::string& yaml) {
  int code = RunYaml(dir, name, world, yaml);
  INFO(name << ":\n" << ReadFile(dir.File(name + ".log")));
  REQUIRE(code == 0);
  return Losses(dir.File(name + ".jsonl"));
}

void CheckCommWait(const TempDir& dir, const std::string& name) {
  int steps = 0;
  for (absl::string_view line : absl::StrSplit(ReadFile(dir.File(name + ".jsonl")), '\n')) {
    if (!absl::StrContains(line, "\"loss\"")) continue;
    ++steps;
    INFO(line);
    constexpr absl::string_view kField = "\"comm_wait_ms\":";
    const size_t at = line.find(kField);
    REQUIRE(at != absl::string_view::npos);
    const size_t value = at + kField.size();
    double ms = -1;
    CHECK(absl::SimpleAtod(line.substr(value, line.find('}', value) - value), &ms));
    CHECK(ms >= 0);
  }
  CHECK(steps > 0);
  const std::string console = ReadFile(dir.File(name + ".log"));
  INFO(console.substr(console.size() > 3000 ? console.size() - 3000 : 0));
  CHECK(absl::StrContains(console, "% | comm wait "));
}

void CheckResumed(const TempDir& dir, const std::string& name, const std::map<int, double>& losses,
                  int steps, int saved_step) {
  const std::string log = ReadFile(dir.File(name + ".log"));
  INFO(name << ":\n" << log);
  CHECK(absl::StrContains(log, "resumed from"));
  CHECK(losses.size() == static_cast<size_t>(steps - saved_step));
  CHECK((!losses.empty() && losses.begin()->first == saved_step + 1));
}

void CheckFollows(const std::map<int, double>& losses, const std::map<int, double>& reference,
                  const std::string& what, double relative) {
  for (const auto& [step, loss] : losses) {
    auto expected = reference.find(step);
    INFO(what << " step " << step << ": " << loss << " vs "
              << (expected == reference.end() ? NAN : expected->second));
    REQUIRE(expected != reference.end());
    CHECK(std::abs(loss - expected->second) <= relative * std::abs(expected->second));
  }
}

std::string StepDir(int step) { return absl::StrFormat("step_%08d", step); }

void CheckSameCheckpoint(const std::string& checkpoint_dir, const std::string& reference_dir,
                         int step, size_t files) {
  std::map<std::string, std::string> expected =
      CheckpointFiles(reference_dir + "/" + StepDir(step));
  CHECK(expected.size() == files);
  CHECK(CheckpointFiles(checkpoint_dir + "/" + StepDir(step)) == expected);
}

KilledJob KillRankMidRun(const TempDir& dir, const std::string& name, int world,
                         const std::string& yaml, const std::string& rdzv_id, int victim_rank,
                         int every) {
  WriteFile(dir.File(name + ".yaml"), yaml);
  launcher::Child launch =
      StartLaunch({"--standalone", absl::StrCat("--nproc_per_node=", world), "--max_restarts=1",
                   "--shutdown_timeout=60", absl::StrCat("--rdzv_id=", rdzv_id),
                   BinaryPath("worker/worker"), dir.File(name + ".yaml")},
                  dir.File(name + ".log"));
  // The manifest is renamed into place once every rank's file is durable.
  // The save runs in the background, some steps behind the loss log, so a
  // count of logged losses would not do; no event announces it: poll.
  const std::string second = dir.File(name + "_ckpt/" + StepDir(2 * every) + "/manifest.json");
  REQUIRE(WaitUntil([&] { return std::filesystem::exists(second); }, absl::Seconds(30)));
  std::map<int, int> pids;  // rank -> pid
  for (int rank = 0; rank < world; ++rank) {
    pids[rank] = RankPid(launch.pid(), rank);
    INFO("rank " << rank);
    REQUIRE(pids[rank] > 0);
  }
  KilledJob killed;
  killed.saved_before = NewestCheckpoint(dir.File(name + "_ckpt"));
  const absl::Time kill_time = absl::Now();
  REQUIRE(::kill(pids[victim_rank], SIGKILL) == 0);
  killed.killed_after = Losses(dir.File(name + ".jsonl")).rbegin()->first;

  for (const auto& [rank, pid] : pids) {
    if (rank == victim_rank) continue;
    INFO("rank " << rank);
    REQUIRE(ExitsWithin(pid, absl::Seconds(30)));
    killed.left[rank] = absl::Now() - kill_time;
  }
  auto exit = launch.WaitFor(kJobTimeout);
  killed.finished = absl::Now() - kill_time;
  killed.log = ReadFile(dir.File(name + ".log"));
  INFO(killed.log);
  REQUIRE(exit.has_value());
  killed.exit_code = exit->ShellCode();
  return killed;
}

void CheckRestartedExact(const TempDir& dir, const std::string& name, const KilledJob& killed,
                         const std::string& reference, int steps, int every, size_t files) {
  INFO(killed.log);
  INFO("killed after step " << killed.killed_after);
  CHECK(killed.killed_after < steps);
  const int resumed_step = ResumedStep(killed.log);
  INFO("resumed from step " << resumed_step);
  CHECK(resumed_step >= killed.saved_before);
  CHECK(resumed_step >= 2 * every);
  CHECK(resumed_step <= killed.killed_after);
  CHECK(resumed_step % every == 0);
  CHECK(LossTexts(dir.File(name + ".jsonl")) == LossTexts(dir.File(reference + ".jsonl")));
  CheckSameCheckpoint(dir.File(name + "_ckpt"), dir.File(reference + "_ckpt"), steps, files);
}

}  // namespace muster::testing
