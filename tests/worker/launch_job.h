// Helpers for tests that run the real `worker` under the real `launch
// --standalone` (fsdp_launch_test.cc, pipeline_launch_test.cc): the
// corpus, running a job, comparing loss curves and checkpoints, and a job
// with one rank SIGKILLed mid-run. Each test keeps its own Job struct and
// yaml; what is here takes the yaml as text and finds a job's files by its
// name: <name>.yaml, <name>.log (launch's console), <name>.jsonl (the
// metrics) and <name>_ckpt (checkpoint.dir), all in one TempDir.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tests/launcher/harness.h"

namespace muster::testing {

// Every launch of these tests must end well within this; a hang fails the
// test instead of the test's own timeout.
inline constexpr absl::Duration kJobTimeout = absl::Seconds(60);

// Writes <dir>/train_000.bin: a byte-level corpus with some structure (so
// the loss moves) and no period short enough to repeat within a global
// batch. REQUIREs the write.
void WriteCorpus(const std::string& dir);

// A yaml checkpoint section:
//   {dir: <dir>/<name>, every: <every>[, resume: <resume>]}
std::string CheckpointYaml(const TempDir& dir, const std::string& name, int every,
                           const std::string& resume = "");

// Writes `yaml` to <name>.yaml and runs it under `launch --standalone` on
// `world` ranks, `launch_flags` before the worker, console to <name>.log.
// Returns launch's exit code; REQUIREs that it exits within kJobTimeout.
int RunYaml(const TempDir& dir, const std::string& name, int world, const std::string& yaml,
            const std::vector<std::string>& launch_flags = {});

// RunYaml, without restarts, for a config the worker must refuse: CHECKs
// that launch exits 2, as the worker does on a bad config, and returns
// launch's console (<name>.log) for the caller to look for the fields.
std::string RefusedYaml(const TempDir& dir, const std::string& name, int world,
                        const std::string& yaml);

// RunYaml for a job that must succeed (REQUIREd); returns rank 0's losses
// from <name>.jsonl, so the yaml's metrics_file must be that.
std::map<int, double> TrainYaml(const TempDir& dir, const std::string& name, int world,
                                const std::string& yaml);

// CHECKs that every step of <name>.jsonl has a comm_wait_ms of at least
// 0 (the mean over ranks of the step's wait on the strategy's
// collectives) and that the console's step lines show it: a job of more
// than one rank under DDP or FSDP.
void CheckCommWait(const TempDir& dir, const std::string& name);

// CHECKs that <name>.log says it resumed and that `losses` are exactly the
// steps after `saved_step` up to `steps`: the data stream continued.
void CheckResumed(const TempDir& dir, const std::string& name, const std::map<int, double>& losses,
                  int steps, int saved_step);

// Every step of `losses` within `relative` (1e-5 unless told) of the same
// step of `reference`; `what` names the comparison in failures.
void CheckFollows(const std::map<int, double>& losses, const std::map<int, double>& reference,
                  const std::string& what, double relative = 1e-5);

// A checkpoint's directory name under checkpoint.dir.
std::string StepDir(int step);

// CHECKs that the step-`step` checkpoints under `checkpoint_dir` and
// `reference_dir` hold the same `files` .bin files (every rank's weights
// and AdamW moments), bit for bit.
void CheckSameCheckpoint(const std::string& checkpoint_dir, const std::string& reference_dir,
                         int step, size_t files);

// What KillRankMidRun saw.
struct KilledJob {
  std::string log;       // launch's console, <name>.log
  int exit_code = -1;    // launch's
  int saved_before = 0;  // the newest committed checkpoint at the kill
  int killed_after = 0;  // the last step rank 0 had logged at the kill
  // Each rank but the victim: how long after the kill it exited.
  std::map<int, absl::Duration> left;
  // How long after the kill launch exited.
  absl::Duration finished;
};

// Writes `yaml` to <name>.yaml and runs it under `launch --standalone` on
// `world` ranks with one restart, rendezvous id `rdzv_id`. The yaml must
// log every step to <name>.jsonl and checkpoint every `every` steps to
// <name>_ckpt. Once the checkpoint of step 2 x `every` is committed (so the
// restart has one to load past the first), SIGKILLs rank `victim_rank`,
// then waits for each other rank to exit (REQUIREd within 30 s each, in
// rank order) and for launch (REQUIREd within kJobTimeout).
//
// launch's shutdown_timeout is 60 s, past any bound a caller puts on
// `left`: launch's SIGKILL of a rank cannot pass for the rank leaving by
// itself (the worker takes SIGTERM as a request to stop after the step
// under way).
KilledJob KillRankMidRun(const TempDir& dir, const std::string& name, int world,
                         const std::string& yaml, const std::string& rdzv_id, int victim_rank,
                         int every);

// CHECKs that `killed` (KillRankMidRun's report on <name>) was killed
// before its last step `steps`; that its restart resumed from the newest
// checkpoint committed before the kill, not from an older one or from
// scratch (which would give the same losses too); and that it ended bit
// for bit as the uninterrupted run <reference>: every step's loss as
// written, and the step-`steps` checkpoints' `files` .bin files under
// <name>_ckpt and <reference>_ckpt.
void CheckRestartedExact(const TempDir& dir, const std::string& name, const KilledJob& killed,
                         const std::string& reference, int steps, int every, size_t files);

}  // namespace muster::testing
