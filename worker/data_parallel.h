// DDP for the trainer: worker::DataParallel over a parallel::ProcessGroup.
//
// Every rank holds the whole model. SyncParameters broadcasts rank 0's
// parameters, so ranks start identical whatever their seeds or files. On
// the last micro-step of each optimizer step BeginBackward arms a
// parallel::GradientReducer over the model's stage gradient buffers and
// hooks it to the model's grad-ready callback: each bucket's allreduce
// (mean) starts as soon as backward has finished its stages, on the
// group's communication thread. Earlier micro-steps accumulate locally and
// communicate nothing.
//
// Two groups: gradients and parameters go over `data` (NCCL or staged Gloo
// on CUDA: device memory), the scalars of MeanOverRanks and Barrier over
// `control` (host memory). On the CPU both are the one Gloo group.
//
// Errors: the ProcessGroup's (parallel/process_group.h); after one, the
// group is broken and every later call fails with it.
//
// Thread-safety: none; the training thread drives it.
#pragma once

#include <memory>

#include "absl/time/time.h"
#include "absl/status/statusor.h"
#include "parallel/bootstrap.h"
#include "parallel/gradient_reducer.h"
#include "parallel/process_group.h"
#include "worker/trainer.h"

namespace muster::worker {

class DdpDataParallel : public DataParallel {
 public:
  // The groups are not owned and must outlive this object; they have the
  // same ranks (they may be one group). The buckets are planned over the
  // model first passed to BeginBackward, which must then be the only model
  // and outlive this object.
  DdpDataParallel(parallel::ProcessGroup* data, parallel::ProcessGroup* control,
                  const parallel::BucketOptions& options);

  int rank() const override { return group_->rank(); }
  int world_size() const override { return group_->size(); }
  void BeginBackward(GptModel* model, bool last) override;
  absl::Status ReduceGradients(GptModel* model) override;
  absl::Status MeanOverRanks(absl::Span<float> values) override;
  using DataParallel::MeanOverRanks;
  absl::Status SyncParameters(GptModel* model) override;
  absl::Status Barrier() override;

  // nullptr until the first BeginBackward.
  const parallel::GradientReducer* reducer() const { return reducer_.get(); }

 private:
  parallel::ProcessGroup* const group_;    // data
  parallel::ProcessGroup* const control_;
  const parallel::BucketOptions options_;
  GptModel* model_ = nullptr;
  std::unique_ptr<parallel::GradientReducer> reducer_;
};

// parallel.backend on `device`: auto is NCCL on CUDA and Gloo on the CPU;
// gloo on CUDA stages device buffers through pinned host memory.
// INVALID_ARGUMENT for nccl on the CPU or an unknown name.
absl::StatusOr<parallel::DataBackend> ChooseDataBackend(const std::string& backend,
                                                        Device device);
const char* DataBackendName(parallel::DataBackend backend);

// The buckets of parallel.bucket_mb for a model: segments are the stages'
// gradient buffers.
parallel::BucketOptions BucketOptionsFor(const ParallelConfig& config);

}  // namespace muster::worker
