// FSDP: the ParallelStrategy (worker/strategy/strategy.h) that shards the
// training state over the ranks of a replica, at ZeRO stage 1, 2 or 3, and
// replicates the shards across replicas (HSDP) when parallel.dp_replicate
// is above 1 (docs/parallel.md, "FSDP").
//
// The sharding unit is the stage (worker/model/model.h): rank j of a
// replica's n shard ranks owns the j-th chunk of parallel::EvenCounts(size,
// n) of every stage's flat buffer (uneven when n does not divide it). It
// keeps the fp32 master copy of those parameters, their gradient and the
// AdamW moments in its own arrays (the "shard"), and AdamW updates only
// them. What else it holds depends on the stage:
//
//            full parameters              full gradients
//   ZeRO-1   kept, all-gathered after     kept, accumulated over the
//            each optimizer step          micro-steps, reduce-scattered on
//                                         the last one
//   ZeRO-2   kept, as ZeRO-1              one stage at a time: zeroed at its
//                                         backward, reduce-scattered into
//                                         the shard as soon as it ends
//   ZeRO-3   one stage at a time:         as ZeRO-2
//            all-gathered before its
//            forward (the next stage's
//            gather is prefetched while
//            it computes), freed after
//            it unless reshard_after_
//            forward is off, gathered
//            again for its backward;
//            stages 0 and 1 gathered
//            for the next step during
//            the optimizer step
//
// OptimizerStep updates the shard one stage at a time and sends each
// stage's new parameters (ZeRO-1/2: every stage; ZeRO-3: stages 0 and 1)
// while the later stages update.
// The head uses stage 0's wte (tied), so the head's forward and backward
// need stage 0's parameters too, and stage 0's gradient buffer lives from
// the head's backward to the embedding's, where both shares are added.
// Under ZeRO-2/3 each micro-step's gradients are reduce-scattered as
// backward goes and summed into the shard.
//
// Gradients are averaged over the replica's shard ranks by the
// reduce-scatter and then over replicas by an all-reduce of the shard
// (HSDP). The norm for clipping is the sum of the shards' sums of
// squares, gathered in double. Checkpoints: every rank writes its own
// slices of every stage (params, m, v), split further between the
// replicas that hold the same shard, and a resume loads exactly the
// slices it owns, from a checkpoint of any strategy and world size.
//
// Devices: every buffer comes from the model's back end (worker/model/ops.h):
// host memory on the CPU, device memory on CUDA, where the groups must take
// device memory (NCCL, or Gloo staged through the host).
//
// Gather type (parallel.gather_dtype). fp32: each stage's parameters are
// gathered as they are; with precision bf16 they are then cast to the
// bf16 copy the engine's GEMMs read, next to the fp32 ones its LayerNorms
// and encoder read. bf16 (auto's choice under precision bf16): each rank
// keeps a bf16 copy of its slice, which AdamW refreshes as it updates the
// fp32 master slice; the stages are gathered from those copies, half the
// bytes, into the bf16 buffer, and widened into the fp32 one (exactly),
// so every parameter the model reads is the master's bf16 rounding, on
// every rank alike (PyTorch FSDP2's param_dtype). Under ZeRO-1/2 the kept
// full copy starts rounded the same way. Gradients are reduce-scattered in
// fp32 either way. Gathered and gradient buffers are transient
// (Ops::AllocTransient: on CUDA stream ordered, so a stage's parameters
// are freed after its queued kernels without waiting for them). Under
// HSDP both groups must take the same memory (the worker makes them with
// Communicator::NewDataGroup). On CUDA: run on a lent GPU by
// scripts/gpu_run.sh (fsdp1, fsdp2, hsdp, fsdpspeed).
//
// Errors: the groups' (parallel/process_group.h). An error inside a stage
// hook (a failed gather) is kept and returned by the next
// ReduceGradients, GradSumOfSquares, OptimizerStep or StateLoaded; the
// model meanwhile computes on whatever the buffers hold.
// Thread-safety: none; the training thread drives it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/collectives.h"
#include "parallel/parallel_dims.h"
#include "parallel/process_group.h"
#include "worker/strategy/strategy.h"

namespace muster::worker {

// parallel.gather_dtype: kAuto is kBf16 when the model computes in bf16.
enum class GatherDtype { kAuto, kFp32, kBf16 };

struct FsdpOptions {
  int zero = 3;                       // parallel.zero: 1, 2 or 3
  bool reshard_after_forward = true;  // parallel.reshard_after_forward (ZeRO-3)
  GatherDtype gather = GatherDtype::kAuto;
  // Each rank prints its memory line here after its first optimizer step
  // (nullptr: nowhere).
  FILE* log = nullptr;
};

// The bytes one rank holds, by kind. params and grads include the shard
// and any full copy kept between steps; `gathered` is what the stage hooks
// hold at the moment (gathered parameters, stage gradient buffers,
// accumulation scratch) and `gathered_peak` its maximum so far.
struct FsdpMemory {
  uint64_t params = 0;
  uint64_t grads = 0;
  uint64_t moments = 0;
  uint64_t gathered = 0;
  uint64_t gathered_peak = 0;
};

// Where the training thread waited on communication: the part of the
// gathers and reductions that compute did not hide (benchmarks).
struct FsdpWaits {
  double gather_s = 0;  // waiting for parameters (hooks, GatherAll)
  double reduce_s = 0;  // waiting for gradient reductions (ReduceGradients)
  int64_t gathers = 0;  // all-gathers issued
  int64_t reduces = 0;  // reduce-scatters issued
};

// What FsdpMemory's params, grads and moments must equal, from the
// stage sizes alone: for a rank that owns `owned` floats of a model of
// `total` floats, 4-byte floats, computing in bf16 (`bf16`) or not, and
// gathering in bf16 (`gather_bf16`) or not,
//   params  = 4 * owned + (gather_bf16 ? 2 * owned : 0)   (the slice's bf16 copy)
//             + (zero <= 2 ? 4 * total : 0)
//             + ((bf16 || gather_bf16) && zero <= 2 ? 2 * total : 0)
//                                                  (the kept full bf16 copy)
//   grads   = 4 * owned + (zero == 1 ? 4 * total : 0)
//   moments = 8 * owned
FsdpMemory FsdpMemoryFormula(int zero, uint64_t owned, uint64_t total, bool bf16 = false,
                             bool gather_bf16 = false);

class Fsdp final : public ParallelStrategy {
 public:
  // `shard`: the dims.dp_shard ranks one replica is sharded over;
  // `replicate`: the dims.dp_replicate ranks holding the same shard
  // (nullptr when dims.dp_replicate is 1); `control`: the world, host
  // memory. Not owned; they outlive this object, and their ranks agree
  // with `dims` (REQUIRES). `backend` names the data groups' back end in
  // Describe.
  Fsdp(parallel::ProcessGroup* shard, parallel::ProcessGroup* replicate,
       parallel::ProcessGroup* control, const parallel::ParallelDims& dims,
       const FsdpOptions& options, std::string backend);
  ~Fsdp() override;

  std::string Describe() const override;
  const parallel::ParallelDims& dims() const override { return dims_; }
  int rank() const override { return control_.rank(); }
  int dp_rank() const override { return dims_.Of(control_.rank()).dp; }
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
  // Prints "worker: fsdp rank R parameters: fnv1a64 <16 hex digits>", the
  // hash of every stage's gathered parameters in order (ParamsFingerprint):
  // the same on every rank, HSDP's replicas too, when the shards agree.
  absl::Status AfterRun(GptModel* model) override;

  const FsdpMemory& memory() const { return memory_; }
  const FsdpWaits& waits() const { return waits_; }
  double CommWaitSeconds() const override { return waits_.gather_s + waits_.reduce_s; }
  // Floats of the flat parameter layout this rank owns.
  uint64_t owned_floats() const;
  // Whether parameters are all-gathered in bf16 (known after Build).
  bool gathers_bf16() const { return gather_bf16_; }
  // Stage `stage`'s full parameters as this rank sees them now, gathered
  // for the call if needed (tests: every rank must see the same bits).
  // A collective over the shard group.
  absl::StatusOr<std::vector<float>> GatheredParams(int stage);
  // FNV-1a (64-bit) of the bytes of GatheredParams(0), (1), ... in order.
  // A collective over the shard group.
  absl::StatusOr<uint64_t> ParamsFingerprint();

 private:
  class Buffer;  // memory of the model's back end (fsdp.cc)
  struct StageShard;
  struct PendingReduce;

  // The flat ranges of the parameters shard rank `shard_rank` owns, one per
  // stage (possibly empty), in order.
  std::vector<FlatRange> OwnedParamRanges(int shard_rank) const;
  void Fail(const absl::Status& status);
  // Stage hooks.
  void PreForward(int stage);
  void PostForward(int stage);
  void PreBackward(int stage);
  void PostBackward(int stage);
  // The stages whose parameters stage `stage`'s forward (and backward)
  // reads: itself, and stage 0 for the head.
  std::vector<int> ParamsNeeded(int stage) const;
  // ZeRO-3: starts gathering stage s's parameters unless they are there or
  // on their way; waits for them (and makes the bf16 copy).
  void StartGather(int stage);
  // Issues the all-gather of stage s's slices into its `params` (which
  // must be there) and counts it.
  std::shared_ptr<parallel::Work> IssueGather(int stage);
  void WaitGathered(int stage);
  // A transient buffer of the back end; exits naming the bytes if there is
  // no memory (a stage hook cannot return an error).
  std::unique_ptr<Buffer> TransientOrExit(size_t bytes, const char* what, int stage);
  // After stage s's parameters arrived: the fp32 view of the gathered bf16
  // ones (bf16 gathers; the receive buffer is freed then when the model
  // does not read bf16), or the bf16 copy of the gathered fp32 ones
  // (fp32 gathers under precision bf16).
  void FinishGather(int stage);
  // What the model gets to read as stage s's bf16 copy: nullptr unless it
  // computes in bf16.
  uint16_t* ModelBf16(int stage) const;
  void BindModel(int stage);
  void ReleaseParams(int stage);
  // Gathers every stage into the full copies ZeRO-1/2 keep; waits.
  absl::Status GatherAll();
  void BindGrads(int stage);
  void StartReduce(int stage);
  // Finishes reductions in order: all of them, or only those already done.
  absl::Status RetireReduces(bool wait);

  parallel::ProcessGroup* const shard_;
  parallel::ProcessGroup* const replicate_;
  parallel::Collectives control_;
  const parallel::ParallelDims dims_;
  const FsdpOptions options_;
  const std::string backend_;
  GptModel* model_ = nullptr;  // the one Build made
  std::shared_ptr<Ops> ops_;   // its back end; every Buffer holds it too
  bool bf16_ = false;          // the model computes in bf16: stages get a bf16 copy
  bool gather_bf16_ = false;   // parameters travel in bf16 (GatherDtype)
  std::vector<StageShard> stages_;
  std::vector<PendingReduce> reduces_;
  // The owned slices, stage after stage, their gradient (same layout) and,
  // for bf16 gathers, their bf16 copy (what this rank sends).
  std::unique_ptr<Buffer> shard_params_storage_, shard_grads_storage_, shard_bf16_storage_;
  float* shard_params_ = nullptr;
  float* shard_grads_ = nullptr;
  uint16_t* shard_bf16_ = nullptr;
  size_t shard_floats_ = 0;
  // Every stage end to end: the parameters ZeRO-1/2 keep (and their bf16
  // copy, under precision bf16 or bf16 gathers), the gradient ZeRO-1 keeps.
  std::unique_ptr<Buffer> full_params_storage_, full_grads_storage_, full_bf16_storage_;
  float* full_params_ = nullptr;
  float* full_grads_ = nullptr;
  uint16_t* full_bf16_ = nullptr;
  size_t total_floats_ = 0;
  int micro_step_ = 0;  // micro-steps begun since ZeroGrad
  bool last_micro_step_ = false;
  bool logged_memory_ = false;
  absl::Status error_;
  FsdpMemory memory_;
  FsdpWaits waits_;
};

}  // namespace muster::worker
