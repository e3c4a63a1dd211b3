// The training loop: data stream -> GptModel forward/backward -> gradient
// clip -> AdamW, with evaluation, the log line, the progress bar and the
// JSONL metrics file (docs/worker.md).
//
// One optimizer step s (0-based) of grad_accumulation (A) micro-steps:
//   for m in [0, A): the rank reads samples
//       RankFirstSample(sample_index, rank, B) .. + B - 1,
//     Forward, Backward(1/A); sample_index += world_size * B
//   ReduceGradients; ClipGradNorm(grad_clip); AdamW.Step(LearningRate(s), s+1);
//   ZeroGrad.
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
#include "worker/config.h"
#include "worker/data.h"
#include "worker/metrics.h"
#include "worker/model.h"
#include "worker/optim.h"

namespace muster::worker {

// How this process takes part in data parallelism. The base class is a
// world of one, where every call is the identity; worker/data_parallel.h
// supplies the ProcessGroup-backed DDP.
class DataParallel {
 public:
  virtual ~DataParallel() = default;
  virtual int rank() const { return 0; }
  virtual int world_size() const { return 1; }
  // Called before each micro-step's Backward. `last` is set on the last
  // micro-step of an optimizer step: only then may an implementation start
  // reducing gradients, during that backward pass (through the model's
  // grad-ready callback). Earlier micro-steps only accumulate locally.
  virtual void BeginBackward(GptModel* model, bool last) {}
  // After the last micro-step's Backward: returns when the gradient
  // buffers hold the mean over ranks.
  virtual absl::Status ReduceGradients(GptModel* model) { return absl::OkStatus(); }
  // Averages each of `values` over ranks in place, in one collective
  // where the implementation can (the step's loss and the stop vote).
  virtual absl::Status MeanOverRanks(absl::Span<float> values) { return absl::OkStatus(); }
  // Averages a scalar (a validation loss, a checkpoint vote) over ranks.
  absl::StatusOr<float> MeanOverRanks(float value) {
    float values[1] = {value};
    if (absl::Status status = MeanOverRanks(absl::MakeSpan(values)); !status.ok()) return status;
    return values[0];
  }
  // Makes every rank's parameters equal to rank 0's (start-up, resume).
  virtual absl::Status SyncParameters(GptModel* model) { return absl::OkStatus(); }
  // Returns once every rank has called it (a checkpoint's commit).
  virtual absl::Status Barrier() { return absl::OkStatus(); }
};

// The first sample this rank reads in a micro-step that starts at global
// sample `global_first`: ranks read consecutive blocks of B samples.
inline uint64_t RankFirstSample(uint64_t global_first, int rank, int micro_batch) {
  return global_first + static_cast<uint64_t>(rank) * micro_batch;
}

// What a checkpoint must save to resume exactly.
struct TrainState {
  int step = 0;               // optimizer steps completed
  uint64_t sample_index = 0;  // global index of the next training sample
};

struct TrainerOptions {
  FILE* log = stdout;                  // human log lines
  FILE* progress = stderr;             // progress bar, when enabled
  bool progress_bar = false;           // main() sets isatty(stderr)
  DataParallel* parallel = nullptr;    // nullptr: a world of one
  // Polled once per optimizer step: a signal number (SIGTERM, SIGUSR1)
  // once the process has been asked to stop, else 0. Ranks agree on it in
  // the step's loss all-reduce, so all of them stop after the same step
  // even when only one was signalled. Empty: never stops early.
  std::function<int()> stop_signal;
  // Called after every completed step and evaluation (tests, tools).
  std::function<void(const StepMetrics&)> on_step;
  std::function<void(const EvalMetrics&)> on_eval;
};

class CheckpointManager;  // worker/checkpoint_manager.h

class Trainer {
 public:
  // Opens the streams (data errors are INVALID_ARGUMENT / NOT_FOUND from
  // worker/data.h), resolves the device and then the precision (one the
  // device cannot do, bf16 on the CPU, is INVALID_ARGUMENT naming
  // `precision`), builds the model with InitWeights(train.seed) and the
  // optimizer, resumes from a checkpoint per checkpoint.resume
  // (worker/checkpoint_manager.h; its errors), and opens the metrics file
  // (appending after a resume).
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
  absl::Status Log(const StepMetrics& metrics);
  absl::Status LogEval(const EvalMetrics& metrics);
  // Saves the state after the step under way (ranks agreed to stop) and
  // returns CANCELLED; `since` is when the stop was agreed.
  absl::Status Preempt(std::chrono::steady_clock::time_point since);
  std::string StopCause() const;  // "SIGTERM", "a signal to another rank"
  static constexpr int kPeerSignalled = -1;

  TrainConfig config_;
  TrainerOptions options_;
  DataParallel single_process_;  // used when options_.parallel is nullptr
  DataParallel* parallel_ = nullptr;
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
  std::vector<int> inputs_, targets_;  // (B, T)
  double peak_flops_ = 0;
  std::string peak_description_;
};

// Whether optimizer step `step` (1-based, completed) is logged / followed
// by an evaluation: the first and last steps and every `every`-th are
// logged; evaluations run every eval_every steps and after the last step
// (never with eval_every 0).
bool ShouldLog(int step, int total_steps, int log_every);
bool ShouldEvaluate(int step, int total_steps, int eval_every);

}  // namespace muster::worker
