// The training loop: data stream -> GptModel forward/backward -> gradient
// clip -> AdamW, with evaluation, the log line, the progress bar and the
// JSONL metrics file (docs/worker.md).
//
// One optimizer step s (0-based) of grad_accumulation (A) micro-steps, the
// parallel work done by the ParallelStrategy (worker/strategy/strategy.h):
//   for m in [0, A): the rank reads samples
//       RankFirstSample(sample_index, dp_rank, B) .. + B - 1,
//     Forward, BeginBackward(last = m == A-1), Backward(1/A);
//     sample_index += dp * B
//   ReduceGradients; clip factor from GradSumOfSquares and grad_clip;
//   OptimizerStep(LearningRate(s), s+1); ZeroGrad; the device's status;
//   the loss averaged over ranks (with the stop vote).
// For a world of 1 the batch of micro-step m starts at (s*A + m)*B. The
// global sample index is part of the state, so a resumed job (any world
// size) continues the same stream.
//
// Thread-safety: none; one thread drives a Trainer.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/checkpoint/env.h"
#include "worker/config/config.h"
#include "worker/data/data.h"
#include "worker/model/model.h"
#include "worker/optim/optim.h"
#include "worker/strategy/strategy.h"
#include "worker/trainer/checkpoint_manager.h"
#include "worker/trainer/metrics.h"

namespace muster::worker {

// The first sample this rank reads in a micro-step that starts at global
// sample `global_first`: the dp ranks read consecutive blocks of B samples
// (ranks that share a dp rank, pipeline stages, read the same block).
inline uint64_t RankFirstSample(uint64_t global_first, int dp_rank, int micro_batch) {
  return global_first + static_cast<uint64_t>(dp_rank) * micro_batch;
}

struct TrainerOptions {
  FILE* log = stdout;         // human log lines
  FILE* progress = stderr;    // progress bar, when enabled
  bool progress_bar = false;  // main() sets isatty(stderr)
  // How this process takes part in the job; not owned, outlives the
  // Trainer. nullptr: a single process.
  ParallelStrategy* strategy = nullptr;
  // Checkpoint I/O; tests wrap it to inject faults (worker/checkpoint/env.h).
  Env* env = nullptr;  // nullptr: Env::Default()
  // Polled once per optimizer step: a signal number (SIGTERM, SIGUSR1)
  // once the process has been asked to stop, else 0. Ranks agree on it in
  // the step's loss all-reduce, so all of them stop after the same step
  // even when only one was signalled. Empty: never stops early.
  std::function<int()> stop_signal;
  // Called after every completed step and evaluation (tests, tools).
  std::function<void(const StepMetrics&)> on_step;
  std::function<void(const EvalMetrics&)> on_eval;
  // The launch job this process runs in and its round (MUSTER_JOB,
  // MUSTER_ROUND; "" by hand): CheckpointManager::set_run.
  std::string run_job;
  uint64_t run_round = 0;
  // The model is only loaded, to sample from (`worker generate
  // --checkpoint`): train.steps must be 0, no data is read (data.train
  // need not exist), and the resume says nothing of training settings
  // (CheckpointManager::set_sample_only).
  bool sample_only = false;
};

class Trainer {
 public:
  // Opens the streams (data errors are INVALID_ARGUMENT / NOT_FOUND from
  // worker/data/data.h), resolves the device, then the precision (one the
  // device cannot do, bf16 on the CPU, is INVALID_ARGUMENT naming
  // `precision`) and the attention (cudnn off CUDA or outside bf16 is
  // INVALID_ARGUMENT naming `attention`), builds the model with
  // InitWeights(train.seed) and the optimizer, resumes from a checkpoint
  // per checkpoint.resume (worker/trainer/checkpoint_manager.h; its
  // errors), and opens the metrics file (appending after a resume).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainConfig& config,
                                                         TrainerOptions options = {});
  ~Trainer();

  // Trains steps [state().step, train.steps), evaluating every eval_every
  // steps and after the last one, saving a checkpoint every
  // checkpoint.every steps and after the last one (waiting for its commit).
  // Preemption: once a rank's options.stop_signal returns non-zero, every
  // rank finishes the step under way, saves a checkpoint of it when
  // checkpoint.dir is set (whatever checkpoint.every is), waits for its
  // commit and returns CANCELLED naming the signal and the step.
  absl::Status Run();
  // One optimizer step; returns its metrics (also logged when due).
  absl::StatusOr<StepMetrics> Step();
  // Mean loss over eval_batches batches of the validation stream, samples
  // 0.. in order (this rank's share), with no backward. FAILED_PRECONDITION
  // without a validation stream.
  absl::StatusOr<float> Evaluate();

  const TrainConfig& config() const { return config_; }
  const TrainState& state() const { return state_; }
  TrainState* mutable_state() { return &state_; }
  GptModel* model() { return model_.get(); }
  AdamW* optimizer() { return optimizer_.get(); }
  bool has_validation() const { return val_ != nullptr; }
  double peak_flops() const { return peak_flops_; }
  const std::string& peak_flops_description() const { return peak_description_; }

 private:
  Trainer(const TrainConfig& config, TrainerOptions options);
  // The step's line on the log and, with `to_metrics_file`, its record in
  // train.metrics_file.
  absl::Status Log(const StepMetrics& metrics, bool to_metrics_file = true);
  absl::Status LogEval(const EvalMetrics& metrics);
  // Saves the state after the step under way (ranks agreed to stop) and
  // returns CANCELLED; `since` is when the stop was agreed.
  absl::Status Preempt(std::chrono::steady_clock::time_point since);
  std::string StopCause() const;  // "SIGTERM", "a signal to another rank"
  static constexpr int kPeerSignalled = -1;

  TrainConfig config_;
  TrainerOptions options_;
  std::unique_ptr<ParallelStrategy> single_process_;  // when options_.strategy is nullptr
  ParallelStrategy* strategy_ = nullptr;
  std::unique_ptr<TokenStream> train_;
  std::unique_ptr<TokenStream> val_;  // nullptr without data.val
  std::unique_ptr<GptModel> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<CheckpointManager> checkpoints_;
  ProgressBar progress_;
  TrainState state_;
  // From the last Step: 0 go on; else this rank's signal, or kPeerSignalled.
  int stop_signal_ = 0;
  double peak_flops_ = 0;
  std::string peak_description_;
};

// Whether optimizer step `step` (1-based, completed) is logged / followed
// by an evaluation: the first and last steps and every `every`-th are
// logged; evaluations run every eval_every steps and after the last step
// (never with eval_every 0). A resumed run also shows its own first step
// on the log (Trainer::Run), though not in the metrics file, which keeps
// the lines a run never stopped writes.
bool ShouldLog(int step, int total_steps, int log_every);
bool ShouldEvaluate(int step, int total_steps, int eval_every);

}  // namespace muster::worker
