// DDP: the ParallelStrategy (worker/strategy/strategy.h) where every rank
// holds the whole model and gradients are averaged over ranks.
//
// Build creates and initialises the model on every rank and broadcasts
// rank 0's parameters, so ranks start identical whatever their seeds or
// files; the optimizer covers every parameter. On the last micro-step of
// each optimizer step BeginBackward arms a parallel::GradientReducer over
// the model's stage gradient buffers and hooks it to the model's
// post_backward hook: each bucket's allreduce (mean) starts as soon as
// backward has finished its stages, on the group's communication thread.
// Earlier micro-steps accumulate locally and communicate nothing. The
// gradients are then equal on every rank, so the norm is computed locally
// and every rank takes the same optimizer step.
//
// Two groups: gradients and parameters go over `data` (NCCL or staged Gloo
// on CUDA: device memory), the control plane over `control` (host
// memory). On the CPU both are the one Gloo group.
//
// Checkpoints: rank r writes the r-th even share of the flat state, so a
// save costs the same on every rank, and every rank loads all of it.
//
// Errors: the ProcessGroup's (parallel/process_group.h); after one, the
// group is broken and every later call fails with it.
// Thread-safety: none; the training thread drives it.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/collectives.h"
#include "parallel/gradient_reducer.h"
#include "parallel/parallel_dims.h"
#include "parallel/process_group.h"
#include "worker/strategy/strategy.h"

namespace muster::worker {

class Ddp : public ParallelStrategy {
 public:
  // The groups are not owned and must outlive this object; they have the
  // same ranks (they may be one group). The buckets are planned over the
  // model Build makes. `backend` names the data group's back end in
  // Describe ("gloo", "nccl 2.28.9", ...).
  Ddp(parallel::ProcessGroup* data, parallel::ProcessGroup* control,
      const parallel::BucketOptions& options, std::string backend);
  ~Ddp() override;

  std::string Describe() const override;
  const parallel::ParallelDims& dims() const override { return dims_; }
  int rank() const override { return data_->rank(); }
  int dp_rank() const override { return data_->rank(); }
  parallel::Collectives& control() override { return control_; }
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
  // Nothing: every rank holds the whole model, kept equal by the reduction.
  absl::Status AfterRun(GptModel* model) override { return absl::OkStatus(); }
  double CommWaitSeconds() const override { return comm_wait_s_; }

  // nullptr until Build.
  const parallel::GradientReducer* reducer() const { return reducer_.get(); }

 private:
  // Makes every rank's parameters equal to rank 0's.
  absl::Status SyncParameters(GptModel* model);

  parallel::ProcessGroup* const data_;
  parallel::Collectives control_;
  const parallel::BucketOptions options_;
  const std::string backend_;
  parallel::ParallelDims dims_;
  GptModel* model_ = nullptr;  // the one Build made
  std::unique_ptr<parallel::GradientReducer> reducer_;
  double comm_wait_s_ = 0;  // the reducer's exposed waits, summed
};

// The buckets of parallel.bucket_mb for a model: segments are the stages'
// gradient buffers.
parallel::BucketOptions BucketOptionsFor(const ParallelConfig& config);

}  // namespace muster::worker
