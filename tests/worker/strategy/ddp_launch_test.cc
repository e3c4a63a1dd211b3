// DDP as users run it: the real `worker` under the real `launch
// --standalone`, ranks as processes talking Gloo over loopback.
//   - equivalence: 2 and 3 ranks follow the 1-process loss curve, with the
//     global batch held constant;
//   - failure: SIGKILL one rank mid-run; the survivors leave their
//     collective with an error by themselves, and launch restarts the job.
#include <signal.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "tests/launcher/harness.h"
#include "tests/worker/launch_job.h"
#include "worker/data/data.h"

namespace muster::testing {
namespace {

using launcher::Child;

// `checkpoint`: the yaml's checkpoint section, or "" for none.
std::string JobYaml(int micro_batch, int accumulation, int steps, const std::string& metrics,
                    const std::string& checkpoint = "") {
  return absl::StrCat(R"(model: {layers: 2, heads: 2, dim: 32, vocab: 256, seq_len: 16}
data:
  train: train_*.bin
  micro_batch: )",
                      micro_batch, R"(
  grad_accumulation: )",
                      accumulation, R"(
optim: {lr: 1.0e-2, warmup_steps: 2}
train:
  steps: )",
                      steps, R"(
  log_every: 1
  metrics_file: )",
                      metrics, R"(
device: cpu
parallel: {strategy: ddp, bucket_mb: 0.01, timeout_s: 30}
)",
                      checkpoint.empty() ? "" : absl::StrCat("checkpoint: ", checkpoint, "\n"));
}

int ExitCodeWithin(Child& child, absl::Duration timeout) {
  auto exit = child.WaitFor(timeout);
  REQUIRE(exit.has_value());
  return exit->ShellCode();
}

TEST_CASE("2 and 3 DDP ranks follow the 1-process loss curve at the same global batch") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 20;
  // Global batch 12 every time: 1 x 12, 2 ranks x 3 x 2 micro-steps (the
  // accumulation path), 3 ranks x 4.
  WriteFile(dir.File("one.yaml"), JobYaml(12, 1, kSteps, "one.jsonl"));
  WriteFile(dir.File("two.yaml"), JobYaml(3, 2, kSteps, "two.jsonl"));
  WriteFile(dir.File("three.yaml"), JobYaml(4, 1, kSteps, "three.jsonl"));
  const std::string worker = BinaryPath("worker/worker");

  Child single = StartLaunch({"--standalone", "--nproc_per_node=1", worker, dir.File("one.yaml")},
                             dir.File("one.log"));
  REQUIRE(ExitCodeWithin(single, absl::Seconds(120)) == 0);
  std::map<int, double> reference = Losses(dir.File("one.jsonl"));
  REQUIRE(reference.size() == kSteps);

  for (int world : {2, 3}) {
    std::string name = world == 2 ? "two" : "three";
    Child job = StartLaunch({"--standalone", absl::StrCat("--nproc_per_node=", world), "--log_dir",
                             dir.File("logs"), worker, dir.File(name + ".yaml")},
                            dir.File(name + ".log"));
    int code = ExitCodeWithin(job, absl::Seconds(120));
    INFO(ReadFile(dir.File(name + ".log")));
    REQUIRE(code == 0);
    std::map<int, double> losses = Losses(dir.File(name + ".jsonl"));
    REQUIRE(losses.size() == kSteps);
    for (int step = 1; step <= kSteps; ++step) {
      INFO("world " << world << " step " << step << ": " << losses[step] << " vs "
                    << reference[step]);
      CHECK(std::abs(losses[step] - reference[step]) <= 1e-5 * std::abs(reference[step]));
    }
    CheckCommWait(dir, name);
  }
  // The loss moved: the comparison is not between two flat lines.
  CHECK(reference[kSteps] < reference[1] - 0.5);
}

// The pid of `launch`'s worker with `RANK=rank` in its environment, or -1.
int RankPid(int launch, int rank) {
  const std::string entry = absl::StrCat("RANK=", rank);
  return FindChild(launch, [&](int pid) { return HasEnvironmentEntry(pid, entry); });
}

TEST_CASE("SIGKILL of one rank: the others fail out of their collective and launch restarts") {
  TempDir dir;
  WriteCorpus(dir.path());
  // Attempt 0 trains "forever"; the restarted attempt 1 a few steps.
  WriteFile(dir.File("long.yaml"), JobYaml(2, 1, 1000000, "long.jsonl"));
  WriteFile(dir.File("short.yaml"), JobYaml(2, 1, 3, "short.jsonl"));
  const std::string worker = BinaryPath("worker/worker");
  // The workers ignore SIGTERM (kept across exec), so when launch stops the
  // job the survivors still have to leave their collective by themselves:
  // the test then sees whether they do, and how fast.
  std::string script = absl::StrCat(
      "trap '' TERM; if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exec ", worker, " ",
      dir.File("long.yaml"), "; else exec ", worker, " ", dir.File("short.yaml"), "; fi");
  Child job = StartLaunch(
      {"--standalone", "--nproc_per_node=3", "--max_restarts=1", "--shutdown_timeout=60",
       "--log_dir", dir.File("logs"), "--rdzv_id=ddpkill", "--no_python", "/bin/sh", "-c", script},
      dir.File("launch.log"));
  // Training is under way once rank 0 has logged a few steps.
  REQUIRE(WaitUntil([&] { return Losses(dir.File("long.jsonl")).size() >= 3; }, absl::Seconds(60)));
  int victim = RankPid(job.pid(), 1);
  int survivor0 = RankPid(job.pid(), 0);
  int survivor2 = RankPid(job.pid(), 2);
  REQUIRE(victim > 0);
  REQUIRE(survivor0 > 0);
  REQUIRE(survivor2 > 0);
  absl::Time killed = absl::Now();
  REQUIRE(::kill(victim, SIGKILL) == 0);
  // Well inside parallel.timeout_s (30 s): a dead peer's sockets close.
  REQUIRE(WaitUntil([&] { return ProcessGone(survivor0) && ProcessGone(survivor2); },
                    absl::Seconds(20)));
  absl::Duration took = absl::Now() - killed;
  WARN("the survivors left their collective " << absl::FormatDuration(took)
                                              << " after the SIGKILL");
  CHECK(took < absl::Seconds(10));

  int code = ExitCodeWithin(job, absl::Seconds(120));
  INFO(ReadFile(dir.File("launch.log")));
  CHECK(code == 0);
  CHECK(Losses(dir.File("short.jsonl")).size() == 3);
  // Each survivor said which collective failed and why (console lines
  // carry launch's "[host rankN]:" prefix).
  std::string console = ReadFile(dir.File("launch.log"));
  for (int rank : {0, 2}) {
    bool reported = false;
    for (absl::string_view line : absl::StrSplit(console, '\n')) {
      reported |= absl::StrContains(line, absl::StrCat(" rank", rank, "]: worker: ")) &&
                  absl::StrContains(line, "connection");
    }
    INFO("rank " << rank);
    CHECK(reported);
  }
}

TEST_CASE("a 2-rank DDP job SIGKILLed mid-run resumes under launch and ends bitwise identical") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 60;
  auto checkpoint = [&](const std::string& name, int every) {
    return absl::StrCat("{dir: \"", dir.File(name), "\", every: ", every, ", keep_last: 2}");
  };
  WriteFile(dir.File("reference.yaml"),
            JobYaml(3, 1, kSteps, "reference.jsonl", checkpoint("reference_ckpt", kSteps)));
  WriteFile(dir.File("killed.yaml"),
            JobYaml(3, 1, kSteps, "killed.jsonl", checkpoint("killed_ckpt", 5)));
  const std::string worker = BinaryPath("worker/worker");
  Child reference =
      StartLaunch({"--standalone", "--nproc_per_node=2", worker, dir.File("reference.yaml")},
                  dir.File("reference.log"));
  REQUIRE(ExitCodeWithin(reference, absl::Seconds(120)) == 0);

  Child job = StartLaunch({"--standalone", "--nproc_per_node=2", "--max_restarts=1",
                           "--rdzv_id=ddpresume", worker, dir.File("killed.yaml")},
                          dir.File("killed.log"));
  // Partway through a step after step 17 (checkpointed at 15).
  REQUIRE(
      WaitUntil([&] { return Losses(dir.File("killed.jsonl")).size() >= 17; }, absl::Seconds(60)));
  int victim = RankPid(job.pid(), 1);
  REQUIRE(victim > 0);
  int killed_after = Losses(dir.File("killed.jsonl")).rbegin()->first;
  REQUIRE(::kill(victim, SIGKILL) == 0);
  int code = ExitCodeWithin(job, absl::Seconds(120));
  INFO(ReadFile(dir.File("killed.log")));
  REQUIRE(code == 0);
  INFO("killed after step " << killed_after);
  CHECK(killed_after < kSteps);
  CHECK(absl::StrContains(ReadFile(dir.File("killed.log")), "resumed from"));
  // Every step's loss, and the final weights and AdamW moments (both
  // ranks' files of the last checkpoint), bit for bit.
  CHECK(Losses(dir.File("killed.jsonl")) == Losses(dir.File("reference.jsonl")));
  for (const char* file : {"rank_00000.bin", "rank_00001.bin"}) {
    std::string a = ReadFile(dir.File("reference_ckpt/step_00000060/") + file);
    std::string b = ReadFile(dir.File("killed_ckpt/step_00000060/") + file);
    CHECK(!a.empty());
    CHECK(a == b);
  }
}

TEST_CASE("a 2-rank checkpoint resumes at 3 ranks and at 1, continuing the same loss curve") {
  TempDir dir;
  WriteCorpus(dir.path());
  const int kSteps = 30, kSaved = 15;
  const std::string worker = BinaryPath("worker/worker");
  // The 2-rank run, global batch 6, saving at step 15 (and 30).
  WriteFile(dir.File("two.yaml"),
            JobYaml(3, 1, kSteps, "two.jsonl",
                    absl::StrCat("{dir: \"", dir.File("two_ckpt"), "\", every: ", kSaved, "}")));
  Child two = StartLaunch({"--standalone", "--nproc_per_node=2", worker, dir.File("two.yaml")},
                          dir.File("two.log"));
  REQUIRE(ExitCodeWithin(two, absl::Seconds(120)) == 0);
  std::map<int, double> reference = Losses(dir.File("two.jsonl"));
  REQUIRE(reference.size() == kSteps);
  const std::string saved = dir.File("two_ckpt/step_00000015");
  REQUIRE(std::filesystem::exists(saved + "/manifest.json"));

  // Resume that checkpoint at 3 ranks x 2 and at 1 rank x 6: the same
  // global batch, so the same samples in every step.
  for (int world : {3, 1}) {
    std::string name = absl::StrCat("world", world);
    WriteFile(dir.File(name + ".yaml"), JobYaml(6 / world, 1, kSteps, name + ".jsonl",
                                                absl::StrCat("{dir: \"", dir.File(name + "_ckpt"),
                                                             "\", resume: \"", saved, "\"}")));
    Child job = StartLaunch({"--standalone", absl::StrCat("--nproc_per_node=", world), worker,
                             dir.File(name + ".yaml")},
                            dir.File(name + ".log"));
    int code = ExitCodeWithin(job, absl::Seconds(120));
    INFO(ReadFile(dir.File(name + ".log")));
    REQUIRE(code == 0);
    std::map<int, double> losses = Losses(dir.File(name + ".jsonl"));
    // It trained steps 16..30 only, and each matches the 2-rank run.
    REQUIRE(losses.size() == kSteps - kSaved);
    CHECK(losses.begin()->first == kSaved + 1);
    for (const auto& [step, loss] : losses) {
      INFO("world " << world << " step " << step << ": " << loss << " vs " << reference[step]);
      CHECK(std::abs(loss - reference[step]) <= 1e-5 * std::abs(reference[step]));
    }
  }
}

// The newest committed checkpoint in `dir` whose manifest says it was
// saved by `world` ranks: its step, or 0.
int NewestCheckpointOfWorld(const std::string& dir, int world) {
  int newest = 0;
  if (!std::filesystem::exists(dir)) return 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::string name = entry.path().filename().string();
    int step = 0;
    if (name.rfind("step_", 0) != 0 || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    std::string manifest = ReadFile(entry.path().string() + "/manifest.json");
    if (absl::StrContains(manifest, absl::StrCat("\"world_size\": ", world, ","))) {
      newest = std::max(newest, step);
    }
  }
  return newest;
}

TEST_CASE("scale-up and scale-down under launch resume from the last checkpoint") {
  TempDir dir;
  WriteCorpus(dir.path());
  auto server = StartServer();
  const std::string checkpoints = dir.File("ckpt");
  auto yaml = [&](int steps) {
    return JobYaml(3, 1, steps, "metrics.jsonl",
                   absl::StrCat("{dir: \"", checkpoints, "\", every: 10, keep_last: 3}"));
  };
  // Long enough never to finish before the test has scaled the job.
  WriteFile(dir.File("job.yaml"), yaml(1000000));
  std::vector<std::string> command = {"--nnodes=1:2",
                                      "--nproc_per_node=1",
                                      "--rdzv_endpoint",
                                      server->endpoint(),
                                      "--rdzv_id=elastic_ckpt",
                                      "--max_restarts=3",
                                      "--rdzv_conf=last_call_timeout=0.3,lease_ttl=1",
                                      "--shutdown_timeout=2",
                                      BinaryPath("worker/worker"),
                                      dir.File("job.yaml")};
  Child a = StartLaunch(command, dir.File("a.log"));
  REQUIRE(
      WaitUntil([&] { return NewestCheckpointOfWorld(checkpoints, 1) >= 10; }, absl::Seconds(60)));

  // Scale-up: a second node joins; the job restarts at world 2 from the
  // world-1 checkpoint and goes on saving.
  Child b = StartLaunch(command, dir.File("b.log"));
  REQUIRE(
      WaitUntil([&] { return NewestCheckpointOfWorld(checkpoints, 2) > 0; }, absl::Seconds(60)));
  CHECK(absl::StrContains(ReadFile(dir.File("a.log")), "resumed from"));

  // Scale-down: the second node dies. After the lease ttl the job restarts
  // at world 1 from a world-2 checkpoint, and this time it finishes soon:
  // the restarted worker reads the shorter run from the yaml.
  int total = NewestCheckpointOfWorld(checkpoints, 2) + 200;
  WriteFile(dir.File("job.yaml"), yaml(total));
  REQUIRE(::kill(b.pid(), SIGKILL) == 0);
  b.WaitFor(absl::Seconds(10));
  int code = ExitCodeWithin(a, absl::Seconds(120));
  std::string log = ReadFile(dir.File("a.log"));
  INFO(log);
  REQUIRE(code == 0);
  // Resumed twice: at world 2 and back at world 1.
  size_t first = log.find("resumed from");
  REQUIRE(first != std::string::npos);
  CHECK(log.find("resumed from", first + 1) != std::string::npos);
  std::map<int, double> losses = Losses(dir.File("metrics.jsonl"));
  REQUIRE(!losses.empty());
  CHECK(losses.rbegin()->first == total);
  CHECK(NewestCheckpointOfWorld(checkpoints, 1) == total);
}

TEST_CASE("a config error fails the job at once, with restarts left: no restart can mend it") {
  TempDir dir;
  WriteCorpus(dir.path());
  // A key the worker does not know: every rank exits 2, and says in its
  // error file that a restart cannot help.
  WriteFile(dir.File("bad.yaml"), absl::StrReplaceAll(JobYaml(3, 1, 10, "bad.jsonl"),
                                                      {{"micro_batch:", "micro_batches:"}}));
  Child job = StartLaunch({"--standalone", "--nproc_per_node=2", "--max_restarts=3",
                           BinaryPath("worker/worker"), dir.File("bad.yaml")},
                          dir.File("job.log"));
  const int code = ExitCodeWithin(job, absl::Seconds(60));
  const std::string log = ReadFile(dir.File("job.log"));
  INFO(log);
  CHECK(code == 2);
  CHECK(absl::StrContains(log, "data.micro_batches: unknown key; did you mean 'micro_batch'?"));
  CHECK(absl::StrContains(log, "failed without a restart (0 of 3 used)"));
  CHECK_FALSE(absl::StrContains(log, "in round 1"));  // one attempt, not four
}

TEST_CASE("two nodes with different train.yaml: both stop before training, naming the fields") {
  struct Case {
    std::string name;
    std::string a_yaml, b_yaml;  // node a's and node b's
    int nproc;
    std::string a_differs, b_differs;  // what each says when it is the one that differs
  };
  const std::string ddp = JobYaml(3, 1, 1000, "a.jsonl");
  const std::string fsdp = absl::StrReplaceAll(
      ddp, {{"{strategy: ddp, bucket_mb: 0.01,", "{strategy: fsdp, dp_replicate: 2,"}});
  const std::vector<Case> cases = {
      // Node b's copy is stale: another micro-batch and learning rate.
      {"lr and batch", ddp,
       absl::StrReplaceAll(ddp,
                           {{"micro_batch: 3", "micro_batch: 4"}, {"lr: 1.0e-2", "lr: 2.0e-2"}}),
       1, "data.micro_batch is 3 here and 4 on rank 0; optim.lr is 0.01 here and 0.02 on rank 0",
       "data.micro_batch is 4 here and 3 on rank 0; optim.lr is 0.02 here and 0.01 on rank 0"},
      // HSDP on one node and pure FSDP on the other: the sub-groups node a
      // would make are never made by node b. Found before any is made.
      {"group layout", fsdp, absl::StrReplaceAll(fsdp, {{"dp_replicate: 2", "dp_replicate: 1"}}), 2,
       "parallel.dp_replicate is 2 here and 1 on rank 0",
       "parallel.dp_replicate is 1 here and 2 on rank 0"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      TempDir dir;
      WriteCorpus(dir.path());
      auto server = StartServer();
      WriteFile(dir.File("a.yaml"), c.a_yaml);
      WriteFile(dir.File("b.yaml"), absl::StrReplaceAll(c.b_yaml, {{"a.jsonl", "b.jsonl"}}));
      auto command = [&](const std::string& yaml) {
        return std::vector<std::string>{"--nnodes=2",
                                        absl::StrCat("--nproc_per_node=", c.nproc),
                                        "--rdzv_endpoint",
                                        server->endpoint(),
                                        "--rdzv_id=stale_yaml",
                                        "--max_restarts=0",
                                        BinaryPath("worker/worker"),
                                        dir.File(yaml)};
      };
      Child a = StartLaunch(command("a.yaml"), dir.File("a.log"));
      Child b = StartLaunch(command("b.yaml"), dir.File("b.log"));
      // Both exit within seconds. A missed layout check would hang them on
      // a group until parallel.timeout_s (30 s) and then fail without
      // naming a field, which the checks below catch.
      const int code_a = ExitCodeWithin(a, absl::Seconds(60));
      const int code_b = ExitCodeWithin(b, absl::Seconds(60));
      const std::string logs = ReadFile(dir.File("a.log")) + ReadFile(dir.File("b.log"));
      INFO(logs);
      CHECK(code_a != 0);
      CHECK(code_b != 0);
      // Whichever node is rank 0, the other names the fields, each side's value.
      const bool a_differs =
          absl::StrContains(logs, "differs from rank 0's: " + c.a_differs + ". Every rank must");
      const bool b_differs =
          absl::StrContains(logs, "differs from rank 0's: " + c.b_differs + ". Every rank must");
      CHECK(a_differs != b_differs);
      CHECK(absl::StrContains(logs, "differs from rank 0's (see its log)"));
      CHECK_FALSE(std::filesystem::exists(dir.File("a.jsonl")));
      CHECK_FALSE(std::filesystem::exists(dir.File("b.jsonl")));
    }
  }
}

}  // namespace
}  // namespace muster::testing
