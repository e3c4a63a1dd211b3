#include "worker/trainer/checkpoint_manager.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "worker/checkpoint/dir_lock.h"
#include "worker/checkpoint/files.h"
#include "worker/checkpoint/layout.h"
#include "worker/checkpoint/reader.h"
#include "worker/checkpoint/retention.h"
#include "worker/trainer/training_settings.h"

namespace muster::worker {
namespace {

// Copies [first, first + count) of the flat state (params | m | v) between
// the model and optimizer and host memory.
template <typename ParamsFn, typename MomentsFn>
void ForEachStatePart(uint64_t params, uint64_t first, uint64_t count, ParamsFn on_params,
                      MomentsFn on_moments) {
  for (int part = 0; part < 3; ++part) {
    const uint64_t lo = std::max(first, part * params);
    const uint64_t hi = std::min(first + count, (part + 1) * params);
    if (lo >= hi) continue;
    const uint64_t in_part = lo - part * params, in_range = lo - first, floats = hi - lo;
    if (part == 0) {
      on_params(in_part, in_range, floats);
    } else {
      on_moments(part == 2, in_part, in_range, floats);
    }
  }
}

// The index of the range of `ranges` (sorted, disjoint) that holds flat
// element `flat`: the last one starting at or before it. REQUIRES: one
// does (LoadFlatRanges only asks for wanted elements).
size_t RangeHolding(const std::vector<FlatRange>& ranges, uint64_t flat) {
  auto after = std::upper_bound(ranges.begin(), ranges.end(), flat,
                                [](uint64_t i, const FlatRange& range) { return i < range.begin; });
  return static_cast<size_t>(after - ranges.begin()) - 1;
}

// The bytes one checkpoint of `model` takes: its flat state in fp32.
uint64_t CheckpointBytes(const GptModel& model) {
  return StateFloats(StateTensors(model.stages())) * sizeof(float);
}

std::string ResumedLine(const std::string& path, const Manifest& manifest) {
  return absl::StrCat("resumed from ", path, " (step ", manifest.step, ", sample index ",
                      manifest.sample_index, ", saved by ", manifest.world_size, " rank",
                      manifest.world_size == 1 ? "" : "s", ")");
}

// "data.micro_batch 4 x 1 micro-steps x 2 data-parallel ranks".
std::string GlobalBatchTerms(const TrainConfig& config, uint64_t global_batch) {
  const uint64_t B = config.data.micro_batch, A = MicroSteps(config);
  return absl::StrCat("data.micro_batch ", B, " x ", A, " micro-step", A == 1 ? "" : "s", " x ",
                      global_batch / (A * B), " data-parallel rank",
                      global_batch / (A * B) == 1 ? "" : "s");
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes < (uint64_t{1} << 20)) return absl::StrFormat("%.0f KiB", b / (1 << 10));
  if (bytes < (uint64_t{1} << 30)) return absl::StrFormat("%.1f MiB", b / (1 << 20));
  return absl::StrFormat("%.2f GiB", b / (1 << 30));
}

CommitTally CommitVote(LocalWrite write) {
  CommitTally vote;
  vote.durable = write == LocalWrite::kDurable ? 1 : 0;
  vote.failed = write == LocalWrite::kFailed || write == LocalWrite::kNoSpace ? 1 : 0;
  vote.no_space = write == LocalWrite::kNoSpace ? 1 : 0;
  return vote;
}

CommitDecision DecideCommit(const CommitTally& sum, int world_size) {
  if (sum.failed > 0) return CommitDecision::kAbandon;
  if (sum.durable == world_size) return CommitDecision::kCommit;
  return CommitDecision::kWait;
}

CheckpointManager::CheckpointManager(const TrainConfig& config, ParallelStrategy* strategy,
                                     FILE* log, Env* env)
    : config_(config),
      strategy_(strategy),
      log_(log),
      env_(env != nullptr ? env : Env::Default()),
      lineage_(NewLineage()),
      writer_(env_),
      local_result_(FileRecord{}) {}

CheckpointManager::~CheckpointManager() {
  if (retention_.joinable()) retention_.join();
}

absl::Status CheckpointManager::JoinRetention() {
  if (!retention_.joinable()) return absl::OkStatus();
  retention_.join();
  for (const std::string& path : retention_deleted_) Log("deleted " + path + " (retention)");
  retention_deleted_.clear();
  return std::exchange(retention_status_, absl::OkStatus());
}

absl::Status CheckpointManager::WaitForRetention() {
  return Agree(JoinRetention(), "checkpoint retention");
}

void CheckpointManager::Log(const std::string& line) {
  if (control().rank() != 0 || log_ == nullptr) return;
  std::fprintf(log_, "checkpoint: %s\n", line.c_str());
  std::fflush(log_);
}

absl::Status CheckpointManager::Agree(absl::Status local, const std::string& what) {
  // The lowest failed rank (as size - rank, so the max names it).
  const int size = control().size();
  int64_t vote = local.ok() ? 0 : size - control().rank();
  if (absl::Status agreed = control().AllReduce(absl::MakeSpan(&vote, 1), parallel::ReduceOp::kMax);
      !agreed.ok()) {
    return agreed;
  }
  if (vote == 0) return absl::OkStatus();
  // That rank's code, full-disk mark and message, for every rank: each
  // rank's failure then says what went wrong, whichever one launch's table
  // shows, and is as restartable as the cause (a checkpoint.dir that is a
  // file fails every rank as a config error, not just rank 0).
  const int failed = size - static_cast<int>(vote);
  std::string cause;
  if (control().rank() == failed) {
    cause =
        absl::StrCat(static_cast<int>(local.code()), IsNoSpace(local) ? "+" : " ", local.message());
  }
  if (absl::Status sent = control().Broadcast(&cause, failed); !sent.ok()) return sent;
  if (!local.ok()) return local;
  int code = static_cast<int>(absl::StatusCode::kAborted);
  const size_t mark = cause.find_first_of(" +");
  if (mark == std::string::npos || !absl::SimpleAtoi(cause.substr(0, mark), &code) ||
      absl::StatusCode(code) == absl::StatusCode::kOk) {
    code = static_cast<int>(absl::StatusCode::kAborted);
  }
  absl::Status status(
      static_cast<absl::StatusCode>(code),
      absl::StrCat(what, " failed on rank ", failed, ": ",
                   mark == std::string::npos ? absl::string_view(cause)
                                             : absl::string_view(cause).substr(mark + 1)));
  return mark != std::string::npos && cause[mark] == '+' ? MarkNoSpace(std::move(status)) : status;
}

absl::StatusOr<int64_t> CheckpointManager::Broadcast(int64_t value) {
  return control().Broadcast(value, /*root=*/0);
}

absl::Status CheckpointManager::LockDir(uint64_t token) {
  const CheckpointConfig& c = config_.checkpoint;
  // The Env's errors name the path, not the field: named here.
  auto named = [](const absl::Status& status) {
    return absl::Status(status.code(), absl::StrCat("checkpoint.dir: ", status.message()));
  };
  if (absl::Status made = env_->CreateDir(c.dir); !made.ok()) return named(made);
  // The other ranks wait inside a collective meanwhile, which fails after
  // parallel.timeout_s: rank 0 gives up well before.
  const absl::Duration collective_bound = absl::Seconds(config_.parallel.timeout_s / 2);
  const bool bounded = absl::Seconds(c.lock_wait) > collective_bound;
  auto lock = LockCheckpointDir(
      env_, c.dir, bounded ? collective_bound : absl::Seconds(c.lock_wait),
      bounded ? "checkpoint.lock_wait, at most half of parallel.timeout_s" : "checkpoint.lock_wait",
      token, [this](const std::string& line) { Log(line); });
  if (absl::IsFailedPrecondition(lock.status())) return lock.status();  // names it
  if (!lock.ok()) return named(lock.status());
  dir_lock_ = *std::move(lock);
  return absl::OkStatus();
}

absl::Status CheckpointManager::ClaimDir() {
  const std::string& dir = config_.checkpoint.dir;
  if (dir.empty()) return absl::OkStatus();
  const bool root = control().rank() == 0;
  const uint64_t token = root ? NewLockToken() : 0;
  absl::Status locked =
      Agree(root ? LockDir(token) : absl::OkStatus(), "taking checkpoint.dir's LOCK");
  if (!locked.ok()) return locked;
  auto agreed = Broadcast(static_cast<int64_t>(token));
  if (!agreed.ok()) return agreed.status();
  return Agree(root ? absl::OkStatus()
                    : SeesLock(env_, dir, static_cast<uint64_t>(*agreed), control().rank()),
               "checking that every rank sees checkpoint.dir");
}

absl::StatusOr<bool> CheckpointManager::Resume(GptModel* model, AdamW* optimizer,
                                               TrainState* state) {
  if (absl::Status claimed = ClaimDir(); !claimed.ok()) return claimed;
  const bool root = control().rank() == 0 && !config_.checkpoint.dir.empty();
  if (root) RemoveUncommitted();
  auto resumed = ChooseAndLoad(model, optimizer, state);
  if (resumed.ok() && root) {
    const std::string note = SpaceNote(CheckpointBytes(*model));
    if (!note.empty()) Log(note);
  }
  return resumed;
}

void CheckpointManager::RemoveUncommitted() {
  const std::string& dir = config_.checkpoint.dir;
  auto names = env_->GetChildren(dir);
  if (!names.ok()) return;  // the resume that follows lists it again and says why
  for (const std::string& name : *names) {
    if (!absl::StartsWith(name, ".tmp_step_") && !absl::StartsWith(name, ".old_step_")) continue;
    const std::string path = dir + "/" + name;
    absl::Status removed = env_->RemoveAll(path);
    Log(removed.ok() ? absl::StrCat("deleted ", path, ": a save that never committed")
                     : absl::StrCat("warning: cannot delete ", path,
                                    ", a save that never committed: ", removed.message()));
  }
}

std::string CheckpointManager::SpaceNote(uint64_t checkpoint_bytes) {
  const CheckpointConfig& c = config_.checkpoint;
  auto free = env_->AvailableBytes(c.dir);
  if (!free.ok()) return "";
  // Retention keeps keep_last (at least one, the newest) and the save being
  // written is one more; those of this run already there count.
  const int at_once = std::max(c.keep_last, 1) + 1;
  auto found = LineageSteps(env_, c.dir, lineage_);
  const int there =
      found.ok() ? std::min(static_cast<int>(found->committed.size()), at_once - 1) : 0;
  const uint64_t needed = static_cast<uint64_t>(at_once - there) * checkpoint_bytes;
  if (*free >= needed) return "";
  return absl::StrCat("warning: the file system of ", c.dir, " has ", FormatBytes(*free),
                      " free, and this run needs ", FormatBytes(needed),
                      " more there: a checkpoint takes ", FormatBytes(checkpoint_bytes),
                      ", and checkpoint.keep_last ", c.keep_last, " keeps up to ", at_once,
                      " while a save is written (", there,
                      " there now). A save that finds the disk full fails the run");
}

std::string CheckpointManager::NoSpaceAdvice(uint64_t checkpoint_bytes) {
  const CheckpointConfig& c = config_.checkpoint;
  std::string advice = "; ";
  if (auto free = env_->AvailableBytes(c.dir); free.ok()) {
    absl::StrAppend(&advice, "the file system of ", c.dir, " has ", FormatBytes(*free),
                    " free with this save's files deleted. ");
  }
  absl::StrAppend(&advice, "A checkpoint of this run takes ", FormatBytes(checkpoint_bytes),
                  " and checkpoint.keep_last ", c.keep_last, " keeps up to ",
                  std::max(c.keep_last, 1) + 1,
                  " of them while a save is written: free space there (or lower "
                  "checkpoint.keep_last) and start the run again, which resumes ",
                  last_committed_ >= 0 ? absl::StrCat("from step ", last_committed_)
                                       : std::string("from the start"));
  return advice;
}

void CheckpointManager::DiscardSave(const std::string& tmp, bool together) {
  if (!local_done_) {
    local_result_ = writer_.Wait();
    local_done_ = true;
  }
  const std::string file = RankFileName(control().rank());
  (void)env_->RemoveFile(tmp + "/" + file);  // not there: never begun, or rank 0 went first
  (void)env_->RemoveFile(tmp + "/" + SidecarName(file));
  // Every rank's file is gone before a failed rank counts the space free.
  // A barrier that fails (a peer gone) only means that count is low.
  if (together) (void)control().Barrier();
  // Anything left (a rank that could not delete its own) goes with the
  // directory, or at the next start (RemoveUncommitted).
  if (control().rank() == 0) (void)env_->RemoveAll(tmp);
}

absl::StatusOr<CheckpointEntry> CheckpointManager::FindNewestVerified(
    const std::function<bool(const Manifest&)>& accept) {
  std::vector<std::string> skipped;
  auto found = FindLatestValid(env_, config_.checkpoint.dir, &skipped, accept, &unverified_steps_);
  for (const std::string& why : skipped) Log("skipping " + why);
  return found;
}

absl::StatusOr<std::string> CheckpointManager::NeverRunsOwn() {
  const CheckpointConfig& c = config_.checkpoint;
  const std::string marker = c.dir + "/RUN";
  // 1: nothing of this run's to resume, step + 2: its checkpoint of that step.
  int64_t choice = 1;
  absl::Status rank0_status;
  if (control().rank() == 0) {
    // The lineage of this job's run, if its RUN file says so: in any round,
    // the first too, since a requeue may find the job gone from the service
    // (an agent's embedded one, or one that dropped it) and start it anew
    // with the same id.
    std::string recorded;
    {
      auto text = ReadSmallFile(env_, marker);
      if (text.ok()) {
        std::string job, lineage;
        for (absl::string_view line : absl::StrSplit(*text, '\n')) {
          if (absl::ConsumePrefix(&line, "job ")) job = std::string(line);
          if (absl::ConsumePrefix(&line, "lineage ")) lineage = std::string(line);
        }
        if (job == run_job_) recorded = lineage;
      }
    }
    if (!recorded.empty()) {
      lineage_ = recorded;
      auto own = FindNewestVerified(
          [&](const Manifest& candidate) { return candidate.lineage == recorded; });
      if (own.ok()) {
        choice = own->step + 2;
        Log(absl::StrCat("checkpoint.resume never started job ", run_job_,
                         " at step 0; in its round ", run_round_,
                         " it continues from the run's own ", own->path));
      } else if (!absl::IsNotFound(own.status())) {
        rank0_status = own.status();  // unlisted, the run's progress would be lost
      }
    } else {
      // A fresh start: the RUN file tells this job's later rounds which
      // checkpoints are the run's. Without it they start again at 0.
      const std::string text = absl::StrCat("job ", run_job_, "\nlineage ", lineage_, "\n");
      uint32_t crc = 0;
      absl::Status written = WriteFileDurably(env_, marker, text.data(), text.size(), &crc);
      if (!written.ok()) {
        Log(absl::StrCat("warning: cannot record this run in ", marker, " (", written.message(),
                         "): a restart of it will start again at step 0"));
      }
    }
  }
  if (absl::Status chosen = Agree(rank0_status, "choosing a checkpoint to resume"); !chosen.ok()) {
    return chosen;
  }
  auto agreed = Broadcast(choice);
  if (!agreed.ok()) return agreed.status();
  if (*agreed < 2) return std::string();
  return c.dir + "/" + StepDirName(static_cast<int>(*agreed - 2));
}

absl::StatusOr<bool> CheckpointManager::ChooseAndLoad(GptModel* model, AdamW* optimizer,
                                                      TrainState* state) {
  const CheckpointConfig& c = config_.checkpoint;
  if (c.resume == "auto" && c.dir.empty()) return false;
  std::string path = c.resume;
  if (c.resume == "never") {
    if (c.dir.empty() || run_job_.empty()) return false;
    auto own = NeverRunsOwn();
    if (!own.ok()) return own.status();
    if (own->empty()) return false;
    path = *own;
  } else if (c.resume == "auto") {
    // 1: nothing to resume, step + 2: that step (rank 0's).
    int64_t choice = 1;
    absl::Status rank0_status;
    if (control().rank() == 0) {
      auto latest = FindNewestVerified(nullptr);
      if (latest.ok()) {
        choice = latest->step + 2;
      } else if (absl::IsNotFound(latest.status())) {
        choice = 1;
        Log(absl::StrCat("nothing to resume in ", c.dir, "; starting at step 0"));
      } else {
        rank0_status = latest.status();
      }
    }
    // Rank 0's failure reaches every rank with its code and message.
    if (absl::Status chosen = Agree(rank0_status, "choosing a checkpoint to resume");
        !chosen.ok()) {
      return chosen;
    }
    auto agreed = Broadcast(choice);
    if (!agreed.ok()) return agreed.status();
    if (*agreed == 1) return false;
    path = c.dir + "/" + StepDirName(static_cast<int>(*agreed - 2));
  } else if (!c.dir.empty()) {
    // An explicit path starts a run; a restart of that run (elastic, or
    // after a preemption) continues from the run's own newest checkpoint,
    // found by the lineage forked from the path. 1: load the path,
    // step + 2: this run's checkpoint of that step.
    int64_t choice = 1;
    absl::Status rank0_status;
    if (control().rank() == 0) {
      auto source = ReadManifest(env_, path);  // an error is reported by the load below
      if (source.ok()) {
        const std::string fork = ForkLineage(*source);
        auto own = FindNewestVerified([&](const Manifest& candidate) {
          return candidate.lineage == fork && candidate.step > source->step;
        });
        if (own.ok()) {
          choice = own->step + 2;
          Log(absl::StrCat("checkpoint.resume ", path, " started this run at step ", source->step,
                           "; continuing from the run's own ", own->path));
        } else if (!absl::IsNotFound(own.status())) {
          // Unlisted, the run's own progress would be lost to the path's.
          rank0_status = own.status();
        }
      }
    }
    if (absl::Status chosen = Agree(rank0_status, "choosing a checkpoint to resume");
        !chosen.ok()) {
      return chosen;
    }
    auto agreed = Broadcast(choice);
    if (!agreed.ok()) return agreed.status();
    if (*agreed >= 2) path = c.dir + "/" + StepDirName(static_cast<int>(*agreed - 2));
  }
  const bool forks = c.resume != "auto" && c.resume != "never" && path == c.resume;

  auto load = [&]() -> absl::Status {
    auto manifest = ReadManifest(env_, path);
    if (!manifest.ok()) return manifest.status();
    const uint64_t hash = ModelConfigHash(config_.model);
    if (manifest->config_hash != hash) {
      const ModelConfig& m = manifest->model;
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": a checkpoint of another model (layers ", m.layers, ", heads ", m.heads, ", dim ",
          m.dim, ", vocab ", m.vocab, ", seq_len ", m.seq_len, "); the config has layers ",
          config_.model.layers, ", heads ", config_.model.heads, ", dim ", config_.model.dim,
          ", vocab ", config_.model.vocab, ", seq_len ", config_.model.seq_len));
    }
    if (manifest->data_seed != config_.train.seed && !sample_only_) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": saved with train.seed ", manifest->data_seed, ", the config has ",
                       config_.train.seed, "; the data stream would not continue"));
    }
    const std::vector<StateTensor> tensors = StateTensors(model->stages());
    const uint64_t total = StateFloats(tensors), params = total / 3;
    const std::vector<FlatRange> wanted = strategy_->CheckpointLoad(total);
    auto loaded = [&]() {
      state->step = manifest->step;
      state->sample_index = manifest->sample_index;
      lineage_ = forks ? ForkLineage(*manifest) : manifest->lineage;
      Log(ResumedLine(path, *manifest));
      if (sample_only_) return absl::OkStatus();
      const std::string changes = DescribeSettingChanges(manifest->training, config_, state->step);
      if (!changes.empty()) {
        Log(absl::StrCat("this run's settings differ from those that saved step ", manifest->step,
                         ": ", changes));
      }
      // Another world size, micro-batch, micro-steps or pipeline depth may
      // change how many samples a step reads: legitimate (a resume at
      // another scale), but the run is then no longer step for step the
      // saved one's, and its validation passes may read other samples.
      const uint64_t batch = manifest->global_batch, now = state->global_batch;
      if (batch != 0 && now != 0 && batch != now) {
        Log(absl::StrCat("note: the global batch changes from ", batch, " to ", now,
                         " samples a step (", GlobalBatchTerms(config_, now),
                         "): the run goes on, no longer step for step the saved one; ", batch,
                         " again continues it exactly"));
      }
      const uint64_t val = manifest->val_samples, val_now = state->val_samples;
      if (val != 0 && val_now != 0 && val != val_now) {
        Log(absl::StrCat("note: a validation pass now reads ", val_now, " samples, ", val,
                         " when step ", manifest->step,
                         " was saved (train.eval_batches x data.micro_batch x data-parallel "
                         "ranks): val losses from here on do not compare with the earlier ones"));
      }
      // Sample i is window pi(i mod W) of a permutation over all W windows
      // (docs/data.md): with another W the order from here on is the new
      // data's, not a continuation. Legitimate (new data), but never silent.
      if (manifest->data_windows != 0 && state->data_windows != 0 &&
          manifest->data_windows != state->data_windows) {
        Log(absl::StrCat("warning: ", path, " was saved with data.train of ",
                         manifest->data_windows, " windows and this run's has ",
                         state->data_windows,
                         " (shards added, removed or changed?): the sample order from index ",
                         manifest->sample_index,
                         " is the new data's, so some samples of the epoch under way may be "
                         "seen twice and others not at all"));
      }
      return absl::OkStatus();
    };
    // On the CPU, loading everything, the state is read straight into the
    // parameters and the moments, each one array in the flat state's
    // order: no staging buffer, no 1.5 GB copy (docs/benchmarks.md).
    const bool whole = wanted.size() == 1 && wanted[0].begin == 0 && wanted[0].count == total;
    float* const direct[3] = {optimizer->HostParams(), optimizer->HostMoments(false),
                              optimizer->HostMoments(true)};
    if (whole && direct[0] != nullptr && direct[1] != nullptr && direct[2] != nullptr) {
      absl::Status read = LoadFlatRange(env_, path, *manifest, tensors, 0, total, [&](uint64_t i) {
        return direct[i / params] + i % params;
      });
      if (!read.ok()) return read;
      return loaded();
    }
    // Otherwise (device memory, or FSDP's many ranges into its shards) the
    // wanted ranges go end to end into one host buffer, read in one call
    // so each file is read once, then into the AdamW, which holds the
    // parameters this rank owns. at[k]: where range k starts in the buffer.
    std::vector<uint64_t> at;
    uint64_t floats = 0;
    for (const FlatRange& range : wanted) {
      at.push_back(floats);
      floats += range.count;
    }
    auto host = AllocateHostFloats(floats);
    if (!host.ok()) return host.status();
    float* const buffer = host->get();
    absl::Status read = LoadFlatRanges(env_, path, *manifest, tensors, wanted, [&](uint64_t i) {
      const size_t k = RangeHolding(wanted, i);
      return buffer + at[k] + (i - wanted[k].begin);
    });
    if (!read.ok()) return read;
    for (size_t k = 0; k < wanted.size(); ++k) {
      const float* from = buffer + at[k];
      ForEachStatePart(
          params, wanted[k].begin, wanted[k].count,
          [&](uint64_t in_part, uint64_t in_range, uint64_t count) {
            optimizer->CopyParamsRangeFromHost(in_part, count, from + in_range);
          },
          [&](bool second, uint64_t in_part, uint64_t in_range, uint64_t count) {
            optimizer->CopyMomentsRangeFromHost(second, in_part, count, from + in_range);
          });
    }
    return loaded();
  };
  absl::Status status = Agree(load(), "loading checkpoint " + path);
  if (!status.ok()) return status;
  // Every rank loaded its part: now the strategy brings every parameter
  // copy a Forward reads up to date (FSDP gathers its shards). Not after a
  // failed load: the other ranks would wait in a collective that never
  // comes.
  if (status = strategy_->StateLoaded(model); !status.ok()) return status;
  last_committed_ = state->step;
  last_started_ = state->step;
  return true;
}

absl::Status CheckpointManager::AfterStep(const GptModel& model, const AdamW& optimizer,
                                          const TrainState& state) {
  if (!enabled()) return absl::OkStatus();
  if (absl::Status committed = Commit(/*wait=*/false); !committed.ok()) return committed;
  if (state.step % config_.checkpoint.every != 0) return absl::OkStatus();
  return StartSave(model, optimizer, state);
}

absl::Status CheckpointManager::SaveFinal(const GptModel& model, const AdamW& optimizer,
                                          const TrainState& state) {
  if (!enabled()) return absl::OkStatus();
  return SaveNow(model, optimizer, state);
}

absl::Status CheckpointManager::SaveNow(const GptModel& model, const AdamW& optimizer,
                                        const TrainState& state) {
  if (config_.checkpoint.dir.empty()) return absl::OkStatus();
  if (last_started_ != state.step) {
    if (absl::Status started = StartSave(model, optimizer, state); !started.ok()) return started;
  }
  if (absl::Status finished = Finish(); !finished.ok()) return finished;
  return WaitForRetention();
}

absl::Status CheckpointManager::StartSave(const GptModel& model, const AdamW& optimizer,
                                          const TrainState& state) {
  if (absl::Status previous = Finish(); !previous.ok()) return previous;
  const std::string& dir = config_.checkpoint.dir;
  const std::string tmp = dir + "/" + TempStepDirName(state.step);
  // The previous save's retention first: it lists and deletes in `dir`.
  absl::Status prepared = JoinRetention();
  if (control().rank() == 0 && prepared.ok()) {
    absl::Status made = env_->CreateDir(dir);
    if (made.ok()) made = env_->RemoveAll(tmp);
    if (made.ok()) made = env_->CreateDir(tmp);
    if (IsNoSpace(made)) {
      prepared = MarkNoSpace(absl::ResourceExhaustedError(
          absl::StrCat("checkpoint.dir: cannot create ", tmp, ": ", made.message(),
                       NoSpaceAdvice(CheckpointBytes(model)))));
    } else if (!made.ok()) {
      // UNAVAILABLE whatever the cause: not a config mistake (exit 1, docs/worker.md).
      prepared =
          absl::UnavailableError(absl::StrCat("checkpoint.dir: cannot create ", tmp, ": ",
                                              made.message(), " (expected a writable directory)"));
    }
  }
  if (absl::Status agreed = Agree(prepared, "preparing " + tmp); !agreed.ok()) return agreed;

  tensors_ = StateTensors(model.stages());
  const uint64_t total = StateFloats(tensors_), params = total / 3;
  // This rank's file: its ranges end to end. The parameters come from the
  // AdamW, which holds the ones this rank owns (under FSDP they are not in
  // the model's stage buffers).
  const std::vector<FlatRange> mine = strategy_->CheckpointFiles(total)[control().rank()];
  uint64_t floats = 0;
  for (const FlatRange& range : mine) floats += range.count;
  auto buffer = writer_.Buffer(floats);
  if (!buffer.ok()) return buffer.status();
  float* host = *buffer;
  for (const FlatRange& range : mine) {
    ForEachStatePart(
        params, range.begin, range.count,
        [&](uint64_t in_part, uint64_t in_range, uint64_t count) {
          optimizer.CopyParamsRangeToHost(in_part, count, host + in_range);
        },
        [&](bool second, uint64_t in_part, uint64_t in_range, uint64_t count) {
          optimizer.CopyMomentsRangeToHost(second, in_part, count, host + in_range);
        });
    host += range.count;
  }
  writer_.Start(tmp, RankFileName(control().rank()));
  pending_step_ = state.step;
  last_started_ = state.step;
  sample_index_ = state.sample_index;
  data_windows_ = state.data_windows;
  global_batch_ = state.global_batch;
  val_samples_ = state.val_samples;
  local_done_ = false;
  return absl::OkStatus();
}

absl::Status CheckpointManager::Commit(bool wait) {
  if (pending_step_ < 0) return absl::OkStatus();
  if (!local_done_ && (wait || writer_.Idle())) {
    local_result_ = writer_.Wait();
    local_done_ = true;
  }
  const LocalWrite mine = !local_done_                        ? LocalWrite::kWriting
                          : local_result_.ok()                ? LocalWrite::kDurable
                          : IsNoSpace(local_result_.status()) ? LocalWrite::kNoSpace
                                                              : LocalWrite::kFailed;
  const CommitTally vote = CommitVote(mine);
  int64_t tally[3] = {vote.durable, vote.failed, vote.no_space};
  if (absl::Status summed = control().AllReduce(absl::MakeSpan(tally), parallel::ReduceOp::kSum);
      !summed.ok()) {
    return summed;
  }
  const CommitDecision decision =
      DecideCommit(CommitTally{tally[0], tally[1], tally[2]}, control().size());
  const int step = pending_step_;
  const std::string tmp = config_.checkpoint.dir + "/" + TempStepDirName(step);
  // For the advice of a save that met a full disk only.
  auto checkpoint_bytes = [this] { return StateFloats(tensors_) * sizeof(float); };
  if (decision == CommitDecision::kCommit) {
    pending_step_ = -1;
    absl::Status committed = control().rank() == 0 ? WriteManifest(step, tmp) : absl::OkStatus();
    // Every rank's write is durable here, so rank 0 can delete them all, and
    // before the advice, which counts the space that frees.
    if (!committed.ok()) DiscardSave(tmp, /*together=*/false);
    if (IsNoSpace(committed)) {
      committed = MarkNoSpace(absl::Status(
          committed.code(), absl::StrCat(committed.message(), NoSpaceAdvice(checkpoint_bytes()))));
    }
    committed = Agree(committed, "committing " + tmp);
    if (!committed.ok()) {
      DiscardSave(tmp, /*together=*/false);
      return committed;
    }
    last_committed_ = step;
    return committed;
  }
  if (decision == CommitDecision::kAbandon) {
    pending_step_ = -1;
    DiscardSave(tmp, /*together=*/true);  // every rank abandons together
    absl::Status local;
    if (!local_result_.ok()) {
      const absl::Status& failed = local_result_.status();
      local = absl::Status(
          failed.code(), absl::StrCat(failed.message(),
                                      IsNoSpace(failed) ? NoSpaceAdvice(checkpoint_bytes()) : ""));
      if (IsNoSpace(failed)) local = MarkNoSpace(std::move(local));
    }
    // Every rank fails as the lowest failed rank did: its code (a full disk
    // or a directory not ours to write is not restartable on any rank),
    // its mark and its message, advice included.
    const std::string what = absl::StrCat("saving checkpoint step ", step);
    absl::Status agreed = Agree(local, what);
    if (!local.ok()) {
      absl::Status status(local.code(), absl::StrCat(what, ": ", local.message()));
      return IsNoSpace(local) ? MarkNoSpace(std::move(status)) : status;
    }
    if (agreed.ok()) {  // cannot be: some rank's write failed
      agreed = absl::AbortedError(absl::StrCat(what, " failed on another rank"));
    }
    return agreed;
  }
  return absl::OkStatus();  // some rank is still writing
}

absl::Status CheckpointManager::WriteManifest(int step, const std::string& tmp) {
  const CheckpointConfig& c = config_.checkpoint;
  Manifest manifest;
  manifest.step = step;
  manifest.optimizer_step = step;
  manifest.sample_index = sample_index_;
  manifest.data_windows = data_windows_;
  manifest.global_batch = global_batch_;
  manifest.val_samples = val_samples_;
  manifest.data_seed = config_.train.seed;
  manifest.config_hash = ModelConfigHash(config_.model);
  manifest.model = config_.model;
  manifest.world_size = control().size();
  manifest.strategy = config_.parallel.strategy;
  manifest.lineage = lineage_;
  manifest.training = TrainingSettingsOf(config_);
  for (int rank = 0; rank < manifest.world_size; ++rank) {
    auto record = ReadSidecar(env_, tmp, RankFileName(rank));
    if (!record.ok()) return record.status();
    manifest.files.push_back(*record);
  }
  manifest.tensors = SliceTensors(tensors_, strategy_->CheckpointFiles(StateFloats(tensors_)));
  for (const FileRecord& file : manifest.files) {
    (void)env_->RemoveFile(tmp + "/" + SidecarName(file.name));  // a leftover one is harmless
  }
  const std::string json = ManifestToJson(manifest);
  uint32_t crc;
  absl::Status status =
      WriteFileDurably(env_, tmp + "/" + kManifestName, json.data(), json.size(), &crc);
  if (status.ok()) status = env_->SyncDir(tmp);
  if (!status.ok()) return status;

  // A checkpoint of the same step may exist (a resumed run reaching it
  // again, or a corrupt one). Move it aside first: rename cannot replace a
  // non-empty directory. A crash between the renames leaves an older
  // checkpoint to resume from.
  const std::string final_path = c.dir + "/" + StepDirName(step);
  const std::string aside = c.dir + "/.old_" + StepDirName(step);
  // Unless it is another run's: a run forked from an earlier checkpoint
  // into the same directory reaches a step the original saved. That one is
  // not this run's to delete, so it is kept beside, under a name that no
  // resume, listing or retention takes for a checkpoint.
  if (env_->FileExists(final_path)) {
    auto existing = ReadManifest(env_, final_path);
    if (existing.ok() && existing->lineage != lineage_) {
      std::string kept = absl::StrCat(final_path, ".lineage_", existing->lineage);
      for (int n = 2; env_->FileExists(kept); ++n) {
        kept = absl::StrCat(final_path, ".lineage_", existing->lineage, ".", n);
      }
      status = env_->RenameFile(final_path, kept);
      if (!status.ok()) return absl::UnavailableError(status.message());
      Log(absl::StrCat("kept ", final_path, ", another run's checkpoint (lineage ",
                       existing->lineage, "), as ", kept, ": this run saves its own step ", step,
                       " there"));
    }
  }
  status = env_->RemoveAll(aside);
  if (status.ok() && env_->FileExists(final_path)) status = env_->RenameFile(final_path, aside);
  if (status.ok()) status = env_->RenameFile(tmp, final_path);
  // UNAVAILABLE even for a path that vanished: a failed commit, not a
  // config mistake (exit 1, docs/worker.md).
  if (!status.ok()) return absl::UnavailableError(status.message());
  if (status = env_->SyncDir(c.dir); !status.ok()) return status;
  (void)env_->RemoveAll(aside);  // the old copy; a leftover one is harmless
  uint64_t bytes = 0;
  for (const FileRecord& file : manifest.files) bytes += file.bytes;
  Log(absl::StrCat("saved ", final_path, " (", bytes >> 20, " MiB in ", manifest.files.size(),
                   " file", manifest.files.size() == 1 ? "" : "s", ")"));
  // Committed. Deleting old checkpoints is not part of the save: it runs
  // beside the training steps that follow.
  if (status = JoinRetention(); !status.ok()) return status;  // none in flight, normally
  retention_ = std::thread([this, dir = c.dir, keep_last = c.keep_last, keep_every = c.keep_every,
                            step, lineage = lineage_, unverified = unverified_steps_] {
    retention_status_ = ApplyRetention(env_, dir, keep_last, keep_every, step, lineage, unverified,
                                       &retention_deleted_);
  });
  return absl::OkStatus();
}

}  // namespace muster::worker
