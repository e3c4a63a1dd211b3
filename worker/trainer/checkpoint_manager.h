// The trainer's side of checkpoints: resume at start-up, an asynchronous
// save every checkpoint.every steps and at the end, and the atomic commit
// across ranks (docs/checkpoint-format.md).
//
// A save at step s, called by every rank after the same step:
//   1. the previous save is finished and committed first (one in flight);
//   2. rank 0 makes dir/.tmp_step_s (removing a stale one); every rank
//      agrees it exists (a collective, so it is also the barrier);
//   3. each rank snapshots its part of the flat state (layout.h; the
//      ranges the strategy's CheckpointFiles gives it, end to end: one
//      even share under DDP, its slice of every stage under FSDP) from its
//      AdamW, which holds the parameters it owns, to host memory, and a
//      background thread writes it, fsyncs it and leaves a sidecar with
//      its size and CRC-32;
//   4. after each later step the ranks vote (one integer all-reduce, read
//      by DecideCommit) whether every rank's file is durable or any failed;
//      once all are durable, rank 0 writes the manifest, fsyncs it, renames
//      the directory to dir/step_s and fsyncs dir: the save is committed;
//   5. rank 0 applies retention on a background thread, so the training
//      thread does not wait for it (unlinking a 1.5 GB checkpoint takes
//      about 0.5 s on the development disk). It is joined, and its error
//      returned on every rank, by the next StartSave, by SaveFinal and by
//      WaitForRetention.
// A crash before the rename leaves only a .tmp_ directory, which resume
// ignores; after it, a complete checkpoint.
//
// Collectives only run on the calling (trainer) thread, in the same order
// on every rank: the background thread touches files only. The decision of
// which checkpoint to resume is rank 0's and is broadcast, so all ranks
// load the same one even if their views of the disk differ.
//
// Errors: a failed background write, commit or load is returned by the
// next call on every rank (the failing rank with its own message). An
// abandoned save's files are deleted (each rank its own, rank 0 the
// directory), so a full disk gets its space back; a failure because the
// file system is full says how much a checkpoint needs and how much is
// free, and is IsNoSpace() on every rank.
// Thread-safety: one thread (the trainer's) calls every method.
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/layout.h"
#include "worker/checkpoint/reader.h"
#include "worker/checkpoint/writer.h"
#include "worker/config/config.h"
#include "worker/model/model.h"
#include "worker/optim/optim.h"
#include "worker/strategy/strategy.h"

namespace muster::worker {

// What a checkpoint must save, besides the model and optimizer, to resume
// exactly.
struct TrainState {
  int step = 0;               // optimizer steps completed
  uint64_t sample_index = 0;  // global index of the next training sample
  // data.train's windows per epoch (TokenStream::samples_per_epoch), set by
  // the trainer: saved, and compared at resume, where another count means
  // the sample order is no longer the saved run's (0: not known).
  uint64_t data_windows = 0;
  // Samples an optimizer step reads (micro-steps x dp x micro_batch) and a
  // validation pass reads (0: no validation), set by the trainer: saved,
  // and compared at resume, where another count means the run goes on at
  // another global batch, or its val losses stop comparing with the
  // earlier ones; said, never refused (0: not known).
  uint64_t global_batch = 0;
  uint64_t val_samples = 0;
};

// A size as the manager's messages give it: "812 KiB", "9.5 MiB", "1.42 GiB".
std::string FormatBytes(uint64_t bytes);

// The commit vote of step 4: each rank contributes CommitVote(its write),
// three integers, to one int64 sum over ranks; DecideCommit reads the sums:
// any failed rank abandons the save, all durable commits it, else wait.
// Counted, not averaged, so no mix of votes can hide a failure.
// kNoSpace is a failure because the file system is full (IsNoSpace), which
// every rank then reports as such (not restartable: docs/worker.md).
enum class LocalWrite { kWriting, kDurable, kFailed, kNoSpace };
enum class CommitDecision { kWait, kCommit, kAbandon };
struct CommitTally {
  int64_t durable = 0;   // ranks whose file is durable
  int64_t failed = 0;    // ranks whose write failed, for any reason
  int64_t no_space = 0;  // of those, the ones whose file system was full
};
CommitTally CommitVote(LocalWrite write);
CommitDecision DecideCommit(const CommitTally& sum, int world_size);

class CheckpointManager {
 public:
  // REQUIRES: `strategy` and `env` outlive the manager. `log` gets one
  // line per resume, skipped checkpoint and commit (rank 0 only). Every
  // file-system call goes through `env` (nullptr: Env::Default()).
  CheckpointManager(const TrainConfig& config, ParallelStrategy* strategy, FILE* log, Env* env);
  ~CheckpointManager();  // waits for the retention in flight
  // The launch job this process runs in and its round (MUSTER_JOB,
  // MUSTER_ROUND), before Resume. With checkpoint.resume never, a later
  // round of the same job (a restart after a failure, a node joining, a
  // requeue after a preemption) continues the run's own progress, which
  // its first round recorded in checkpoint.dir/RUN; by hand ("" job),
  // every start is a fresh one.
  void set_run(std::string job, uint64_t round) {
    run_job_ = std::move(job);
    run_round_ = round;
  }
  // Before Resume: the checkpoint is loaded to sample from, not to train
  // on (`worker generate --checkpoint`), so how this config's training
  // settings, global batch or validation pass differ from the saved run's
  // is not said, and another train.seed is no error: none is used.
  void set_sample_only(bool sample_only) { sample_only_ = sample_only; }
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // First, whenever checkpoint.dir is set, rank 0 creates it and takes its
  // LOCK for the manager's lifetime (worker/checkpoint/dir_lock.h): one
  // run per directory. FAILED_PRECONDITION on every rank, naming the
  // holder, when another run keeps it; also when a rank does not see the
  // LOCK rank 0 holds (its checkpoint.dir is another directory).
  // Then follows checkpoint.resume: "never"; "auto", the newest checkpoint in
  // checkpoint.dir that verifies (none: a fresh start, returns false); or
  // a path, which must load, unless checkpoint.dir holds a newer
  // checkpoint that this run (started from that path) wrote: a restart
  // continues from that one. Each rank loads the ranges the strategy's
  // CheckpointLoad names, from a checkpoint of any strategy and world
  // size, into the optimizer (and so the parameters it owns) and *state;
  // once every rank's load succeeded, every rank calls the strategy's
  // StateLoaded (a collective: FSDP gathers its parameters there), and
  // returns its error. INVALID_ARGUMENT for a checkpoint of another model
  // config or data seed; NOT_FOUND / DATA_LOSS for a missing or corrupt
  // explicit path.
  // Rank 0 also removes what a save that never committed left in the
  // directory (.tmp_step_N, .old_step_N: the LOCK says no other run is
  // writing there), and warns when the file system has less space free
  // than the checkpoints still to come need (SpaceNote).
  absl::StatusOr<bool> Resume(GptModel* model, AdamW* optimizer, TrainState* state);

  // After every optimizer step, on every rank: commits a finished save and
  // starts one when state.step is a multiple of checkpoint.every.
  absl::Status AfterStep(const GptModel& model, const AdamW& optimizer, const TrainState& state);

  // Saves the current state (unless it was just saved) and waits for its
  // commit and retention: the end of training. A no-op while
  // checkpoint.every is 0.
  absl::Status SaveFinal(const GptModel& model, const AdamW& optimizer, const TrainState& state);

  // Preemption: saves the current state (unless it was just saved) and
  // waits for its commit and retention, whenever checkpoint.dir is set,
  // whatever checkpoint.every is. A no-op without checkpoint.dir.
  absl::Status SaveNow(const GptModel& model, const AdamW& optimizer, const TrainState& state);

  // Starts a save of the current state (step 1-3 above).
  absl::Status StartSave(const GptModel& model, const AdamW& optimizer, const TrainState& state);
  // Waits for the save in flight and commits it. Retention may still be
  // running when this returns.
  absl::Status Finish() { return Commit(/*wait=*/true); }
  // Waits for the retention in flight (none: returns at once); returns its
  // error on every rank. A collective: every rank calls it.
  absl::Status WaitForRetention();

  // This run's lineage (docs/checkpoint-format.md), once Resume returned.
  const std::string& lineage() const { return lineage_; }
  bool enabled() const { return !config_.checkpoint.dir.empty() && config_.checkpoint.every > 0; }
  int last_committed_step() const { return last_committed_; }

 private:
  absl::Status Commit(bool wait);
  // Resume after the directory is claimed: picks the checkpoint and loads it.
  absl::StatusOr<bool> ChooseAndLoad(GptModel* model, AdamW* optimizer, TrainState* state);
  // checkpoint.resume never under launch: "" on the run's first round (a
  // fresh start, which records the run in checkpoint.dir's RUN file), or
  // on a later round the run's own newest checkpoint ("" if none yet).
  absl::StatusOr<std::string> NeverRunsOwn();
  // Rank 0: FindLatestValid in checkpoint.dir, logging each checkpoint it
  // skips and noting its step in unverified_steps_ for retention.
  absl::StatusOr<CheckpointEntry> FindNewestVerified(
      const std::function<bool(const Manifest&)>& accept);
  // Rank 0, once the directory is claimed: deletes leftovers of saves that
  // never committed, logging each.
  void RemoveUncommitted();
  // Rank 0, after Resume: the warning line when checkpoint.dir's file
  // system has less free than this run's checkpoints still need there, or
  // "" (also when the space cannot be told).
  std::string SpaceNote(uint64_t checkpoint_bytes);
  // What a save that failed because the file system is full adds to its
  // error: the space free now, what a checkpoint needs, what to do.
  std::string NoSpaceAdvice(uint64_t checkpoint_bytes);
  // An abandoned save at `tmp`: this rank's file and sidecar, once its
  // write has stopped, and on rank 0 the directory, are deleted.
  // `together`: every rank calls it at once (a barrier), so that a rank
  // whose write failed counts the space free with every rank's file gone.
  void DiscardSave(const std::string& tmp, bool together);
  // Whenever checkpoint.dir is set, on every rank: rank 0 creates it and
  // takes its lock into dir_lock_ (LockDir), and every other rank checks
  // that it sees rank 0's token there (SeesLock): one directory for all.
  absl::Status ClaimDir();
  absl::Status LockDir(uint64_t token);
  absl::Status WriteManifest(int step, const std::string& tmp);
  // Every rank learns whether all ranks' `local` is OK; returns `local`, or
  // when another rank failed, an error naming `what` and that rank (the
  // lowest that failed), with its code, full-disk mark and message.
  absl::Status Agree(absl::Status local, const std::string& what);
  // Rank 0's `value`, on every rank.
  absl::StatusOr<int64_t> Broadcast(int64_t value);
  void Log(const std::string& line);
  // Rank 0: joins the retention thread, logs what it deleted and returns
  // its error. Other ranks: OK.
  absl::Status JoinRetention();
  parallel::Collectives& control() { return strategy_->control(); }

  TrainConfig config_;
  // Says which part of the state each rank writes and loads; its control
  // plane carries the ranks' agreement.
  ParallelStrategy* strategy_;
  FILE* log_;
  Env* const env_;  // before writer_, which is given it
  // Rank 0's hold on checkpoint.dir/LOCK. Declared before writer_ and
  // retention_, so it is released only after their threads stopped.
  std::unique_ptr<FileLock> dir_lock_;
  // This run's Manifest::lineage: new, or set by Resume.
  std::string lineage_;
  // Steps the resume passed over because they did not verify: retention
  // does not count them.
  std::vector<int> unverified_steps_;
  std::string run_job_;  // set_run: the launch job, "" for a process run by hand
  uint64_t run_round_ = 0;
  bool sample_only_ = false;  // set_sample_only
  ShardWriter writer_;
  int pending_step_ = -1;  // save in flight, -1: none
  int last_started_ = -1;
  int last_committed_ = -1;
  absl::StatusOr<FileRecord> local_result_;  // this rank's finished write
  bool local_done_ = false;
  uint64_t sample_index_ = 0;         // of the save in flight
  uint64_t data_windows_ = 0;         // of the save in flight
  uint64_t global_batch_ = 0;         // of the save in flight
  uint64_t val_samples_ = 0;          // of the save in flight
  std::vector<StateTensor> tensors_;  // the model's flat state
  // Rank 0's retention in flight. The thread writes the two fields below
  // and the trainer thread reads them only after joining it.
  std::thread retention_;
  absl::Status retention_status_;
  std::vector<std::string> retention_deleted_;
};

}  // namespace muster::worker
