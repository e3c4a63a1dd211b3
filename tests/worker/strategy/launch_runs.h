// Runs that the strategies' launch tests (fsdp_launch_test.cc,
// pipeline_launch_test.cc) make alike, over each test's own Job: a
// JobFields with the strategy's fields added. Each test declares, beside
// its Job, the two functions these call, found by argument-dependent
// lookup (so each test's own checks in Train run here too):
//   std::string JobYaml(const Job& job);
//   std::map<int, double> Train(const TempDir& dir, const std::string& name, int world, Job job);
// Train runs a job that must succeed, metrics to <name>.jsonl, and returns
// rank 0's losses.
#pragma once

#include <catch2/catch.hpp>
#include <cstddef>
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "tests/launcher/harness.h"
#include "tests/worker/launch_job.h"

namespace muster::testing {

// What every strategy's Job has, and the runs here set.
struct JobFields {
  int steps = 20;
  int timeout_s = 30;      // parallel.timeout_s
  std::string metrics;     // metrics_file, relative to the yaml
  std::string checkpoint;  // the yaml's checkpoint section, or "" for none
};

// RefusedYaml for `job`, its metrics to <name>.jsonl.
template <typename Job>
std::string RefusedJob(const TempDir& dir, const std::string& name, int world, Job job) {
  job.metrics = name + ".jsonl";
  return RefusedYaml(dir, name, world, JobYaml(job));
}

// RefusedJob for `job`, whose degrees do not cover the world: CHECKs that
// the refusal names each of them.
template <typename Job>
void CheckRefusedNamingDegrees(const TempDir& dir, const std::string& name, int world,
                               const Job& job) {
  const std::string log = RefusedJob(dir, name, world, job);
  INFO(log);
  for (const char* field : {"parallel.dp_replicate", "parallel.dp_shard", "parallel.pp"}) {
    CHECK(absl::StrContains(log, field));
  }
}

// Resumes `saved` as `job` on `world` ranks (checkpoints to <name>_ckpt)
// and returns its losses, REQUIREing that it logged the resume and trained
// exactly the steps after the checkpoint's: the data stream continues.
template <typename Job>
std::map<int, double> Resume(const TempDir& dir, const std::string& name, int world, Job job,
                             const std::string& saved, int saved_step) {
  job.checkpoint = CheckpointYaml(dir, name + "_ckpt", job.steps, saved);
  std::map<int, double> losses = Train(dir, name, world, job);
  CheckResumed(dir, name, losses, job.steps, saved_step);
  return losses;
}

// The SIGKILL tests' uninterrupted run "reference" of `job` on `world`
// ranks, checkpointing only its last step (checkpoint.resume `resume`):
// REQUIREs every step.
template <typename Job>
void TrainReference(const TempDir& dir, int world, Job job, const std::string& resume = "") {
  job.checkpoint = CheckpointYaml(dir, "reference_ckpt", job.steps, resume);
  REQUIRE(Train(dir, "reference", world, job).size() == job.steps);
}

// KillRankMidRun on "killed", `job` on `world` ranks under rendezvous id
// `rdzv_id`, checkpointing every `every` steps (checkpoint.resume
// `resume`): rank 1 is SIGKILLed mid-run.
template <typename Job>
KilledJob KillRankOne(const TempDir& dir, int world, Job job, const std::string& rdzv_id, int every,
                      const std::string& resume = "") {
  job.metrics = "killed.jsonl";
  job.checkpoint = CheckpointYaml(dir, "killed_ckpt", every, resume);
  return KillRankMidRun(dir, "killed", world, JobYaml(job), rdzv_id, 1, every);
}

// The end of a KillRankOne job: CHECKs that launch finished within 40 s of
// the kill and REQUIREs exit 0, then CheckRestartedExact against
// "reference" (`files` .bin files a checkpoint).
inline void CheckKilledRunEndedExact(const TempDir& dir, const KilledJob& killed, int steps,
                                     int every, size_t files) {
  CHECK(killed.finished < absl::Seconds(40));
  REQUIRE(killed.exit_code == 0);
  CheckRestartedExact(dir, "killed", killed, "reference", steps, every, files);
}

}  // namespace muster::testing
