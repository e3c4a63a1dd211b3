// The seam every parallelism plugs into: how a worker process takes part
// in a job (docs/architecture.md, "The parallel seam").
//
// A strategy shapes construction, as torchtitan's parallelize_fn runs
// before the optimizer is built, and owns the step's communication:
//
//   Build              the model's parameter and gradient storage, its
//                      initial weights (equal on every rank that must
//                      hold the same ones), and the optimizer over the
//                      parameters this rank updates;
//   BeginBackward,     the gradient reduction, driven by the model's stage
//   ReduceGradients    hooks (model.h, StageHooks);
//   GradSumOfSquares   the squared global gradient norm, over the right
//                      group, for clipping;
//   OptimizerStep      the update of this rank's parameters;
//   ZeroGrad           the gradients cleared for the next step;
//   CheckpointFiles,   what each rank writes to a checkpoint, what this
//   CheckpointLoad,    rank reads back at a resume (through its AdamW,
//   StateLoaded        which holds the parameters it owns), and what it
//                      does once they are loaded;
//   AfterRun           its report at the end of a run (FSDP: a fingerprint
//                      of the gathered parameters).
//
// It also gives the job's control plane (control(): losses, votes, the
// checkpoint's agreement, over host memory) and where the rank sits
// (dims(), dp_rank(): the data stream is indexed by the dp rank).
//
// The trainer's step, for A micro-steps:
//   ForwardBackward over the A micro-batches: for strategies whose every
//     rank runs the whole model, RunMicroSteps's loop, for m in [0, A):
//     Forward; BeginBackward(model, m == A - 1); Backward; a pipeline runs
//     its schedule instead
//   ReduceGradients; clip from GradSumOfSquares; OptimizerStep; ZeroGrad
//
// Implementations: SingleProcess (below), Ddp (worker/strategy/ddp/ddp.h), Fsdp
// (worker/strategy/fsdp/fsdp.h), Pipeline (worker/strategy/pipeline/pipeline.h). Every method
// but CommWaitSeconds is pure: a strategy states what it does at each
// point, even "nothing". CommWaitSeconds defaults to -1, "not measured"
// (Pipeline keeps that default).
//
// Errors: those of the strategy's process groups (parallel/process_group.h)
// and of the model and optimizer's construction.
// Thread-safety: none; the training thread drives a strategy.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/bootstrap.h"
#include "parallel/collectives.h"
#include "parallel/parallel_dims.h"
#include "parallel/process_group.h"
#include "worker/checkpoint/layout.h"
#include "worker/config/config.h"
#include "worker/model/model.h"
#include "worker/optim/optim.h"

namespace muster::worker {

// What Build makes.
struct BuildSpec {
  ModelConfig model;
  int micro_batch = 1;  // the largest batch a Forward takes
  int micro_steps = 1;  // micro-batches per optimizer step (a pipeline's schedule)
  Device device = Device::kCpu;
  Precision precision = Precision::kFp32;
  Attention attention = Attention::kMuster;
  OptimConfig optim;
  uint64_t seed = 0;  // GptModel::InitWeights
};

// One step's micro-batches, as the trainer hands them to ForwardBackward.
struct MicroBatches {
  int count = 1;  // micro-steps (A)
  int B = 1, T = 1;
  // Fills micro-batch m's token ids (host, (B, T) each) from this rank's
  // share of the data.
  std::function<void(int m, int* inputs, int* targets)> fill;
};

// The losses a rank computed in ForwardBackward: their sum and how many
// (every micro-batch, or none on a pipeline stage without the head). The
// step's loss is the sum over ranks divided by the count over ranks.
struct StepLoss {
  double sum = 0;
  int count = 0;
};

struct BuiltModel {
  std::unique_ptr<GptModel> model;
  std::unique_ptr<AdamW> optimizer;
};

class ParallelStrategy {
 public:
  virtual ~ParallelStrategy() = default;

  // "single process", "ddp over gloo, 2 ranks", ...: the start-up banner.
  virtual std::string Describe() const = 0;
  virtual const parallel::ParallelDims& dims() const = 0;
  virtual int rank() const = 0;     // in the world
  virtual int dp_rank() const = 0;  // in [0, dims().dp()): which share of the data
  // The job's control plane: every rank of the world.
  virtual parallel::Collectives& control() = 0;

  // Builds the model (storage, weights from spec.seed, agreed over ranks)
  // and the optimizer over this rank's parameters. Called once.
  virtual absl::StatusOr<BuiltModel> Build(const BuildSpec& spec) = 0;

  // The forward and backward passes of one step over `batches`, each
  // backward scaled by 1/count, gradients accumulating in the model.
  virtual absl::StatusOr<StepLoss> ForwardBackward(GptModel* model,
                                                   const MicroBatches& batches) = 0;
  // The forward passes alone (evaluation): no gradient, no BeginBackward.
  virtual absl::StatusOr<StepLoss> ForwardOnly(GptModel* model, const MicroBatches& batches) = 0;
  // Before each micro-step's Backward; `last` on the last micro-step of an
  // optimizer step, the one whose backward may start communicating.
  virtual void BeginBackward(GptModel* model, bool last) = 0;
  // After the last micro-step's Backward: returns when this rank's
  // gradients are the ones its optimizer step needs (DDP: the mean over
  // ranks).
  virtual absl::Status ReduceGradients(GptModel* model) = 0;
  // The sum of squares of the whole model's gradient (after
  // ReduceGradients), the same on every rank.
  virtual absl::StatusOr<double> GradSumOfSquares(GptModel* model) = 0;
  // One AdamW update (optim.h: lr, 1-based step, the clip factor) of this
  // rank's parameters, leaving every parameter the next Forward reads
  // up to date.
  virtual absl::Status OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                                     float grad_scale) = 0;

  // Clears the gradients the next step accumulates into.
  virtual void ZeroGrad(GptModel* model) = 0;

  // The flat checkpoint state (worker/checkpoint/layout.h) of `total`
  // floats. CheckpointFiles: element r is rank r's file, the concatenation
  // of its ranges in order (rank 0 describes every file in the manifest).
  // CheckpointLoad: the ranges this rank reads at a resume, sorted and
  // disjoint; their parameters and moments go into the AdamW, which holds
  // the parameters this rank updates. Both lie inside what the AdamW owns.
  virtual std::vector<std::vector<FlatRange>> CheckpointFiles(uint64_t total) const = 0;
  virtual std::vector<FlatRange> CheckpointLoad(uint64_t total) const = 0;
  // After a resume has written the loaded state into the AdamW: brings
  // every parameter copy the next Forward reads up to date. A collective
  // on every rank.
  virtual absl::Status StateLoaded(GptModel* model) = 0;

  // After the last step and the final checkpoint (not on a preemption
  // exit), on every rank: the strategy's closing report. FSDP prints each
  // rank's fingerprint of the parameters it gathers, which every rank
  // must share (a collective); the others do nothing.
  virtual absl::Status AfterRun(GptModel* model) = 0;

  // Seconds the training thread has spent blocked on the strategy's
  // gradient and parameter collectives since it was made: the part of
  // their time that compute did not hide, plus any wait for a slower rank
  // to reach them. The trainer logs each step's share, as the mean over
  // ranks. Negative where the strategy does not measure it (pipeline,
  // whose waits are its schedule's bubbles more than communication).
  virtual double CommWaitSeconds() const { return -1; }
};

// ForwardBackward (and ForwardOnly, with `backward` false) for a strategy
// whose every rank runs the whole model: for each micro-batch, Forward,
// then strategy->BeginBackward (last on the last one) and Backward.
absl::StatusOr<StepLoss> RunMicroSteps(ParallelStrategy* strategy, GptModel* model,
                                       const MicroBatches& batches, bool backward);

// A world of one: no communication; the control plane is a group of one.
class SingleProcess final : public ParallelStrategy {
 public:
  SingleProcess();
  ~SingleProcess() override;

  std::string Describe() const override { return "single process"; }
  const parallel::ParallelDims& dims() const override { return dims_; }
  int rank() const override { return 0; }
  int dp_rank() const override { return 0; }
  parallel::Collectives& control() override { return *control_; }
  absl::StatusOr<BuiltModel> Build(const BuildSpec& spec) override;
  absl::StatusOr<StepLoss> ForwardBackward(GptModel* model, const MicroBatches& batches) override {
    return RunMicroSteps(this, model, batches, /*backward=*/true);
  }
  absl::StatusOr<StepLoss> ForwardOnly(GptModel* model, const MicroBatches& batches) override {
    return RunMicroSteps(this, model, batches, /*backward=*/false);
  }
  void BeginBackward(GptModel* model, bool last) override;
  absl::Status ReduceGradients(GptModel* model) override;
  absl::StatusOr<double> GradSumOfSquares(GptModel* model) override;
  absl::Status OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                             float grad_scale) override;
  void ZeroGrad(GptModel* model) override;
  std::vector<std::vector<FlatRange>> CheckpointFiles(uint64_t total) const override;
  std::vector<FlatRange> CheckpointLoad(uint64_t total) const override;
  absl::Status StateLoaded(GptModel* model) override;
  absl::Status AfterRun(GptModel* model) override;
  double CommWaitSeconds() const override { return 0; }  // no collectives to wait on

 private:
  parallel::ParallelDims dims_;
  std::unique_ptr<parallel::ProcessGroup> group_;
  std::unique_ptr<parallel::Collectives> control_;
};

// The build of a strategy whose every rank holds the whole model: created,
// initialised from spec.seed, then `agree` (may be empty: nothing to agree
// on) makes the ranks' weights equal, then AdamW over every parameter.
absl::StatusOr<BuiltModel> BuildWholeModel(const BuildSpec& spec,
                                           const std::function<absl::Status(GptModel*)>& agree);

// ---- How a worker joins its peers: the degrees and the data back end.

// parallel.backend on `device`: auto is NCCL on CUDA and Gloo on the CPU;
// gloo on CUDA stages device buffers through pinned host memory.
// INVALID_ARGUMENT for nccl on the CPU or an unknown name.
absl::StatusOr<parallel::DataBackend> ChooseDataBackend(const std::string& backend, Device device);
const char* DataBackendName(parallel::DataBackend backend);

// The degrees of parallel.dp_replicate x dp_shard x pp for a world of
// `world_size` ranks, with the auto degrees (0) resolved:
//   ddp:  dp_shard is 1 (above 1 is INVALID_ARGUMENT); dp_replicate 0 is
//         world / pp.
//   fsdp: both 0: dp_replicate 1, dp_shard world / pp; one 0: it is
//         world / (the other x pp).
// INVALID_ARGUMENT naming parallel.dp_replicate, parallel.dp_shard and
// parallel.pp with their resolved values when their product is not the
// world (or an auto degree cannot make it so).
absl::StatusOr<parallel::ParallelDims> ParallelDimsFor(const ParallelConfig& config,
                                                       int world_size);

}  // namespace muster::worker
