// The training state of the model stages one pipeline rank runs
// (worker/strategy/pipeline/pipeline.h): where their parameters and gradients live, what
// the rank's optimizer updates, what its dp ranks reduce, and what it
// writes to and reads from a checkpoint (docs/parallel.md, "Pipeline
// parallelism" and "FSDP x PP").
//
// Storage. A rank holds the parameters and gradients of the model stages
// it runs and nothing else: two arrays with those stages end to end, to
// which every model part of the rank is bound (ParamStorage::kExternal).
// The first rank's stage 0 is the embedding; the last rank's is the tied
// wte's copy, which the head reads (its wpe is allocated but unused).
// Initial weights are computed stage by stage from the seed.
//
// Sharding (dims.dp_shard above 1). The dp ranks running the same stages
// shard their state as FSDP does (worker/strategy/fsdp/fsdp.h): each owns an even slice
// of the stages' flat parameters and keeps that slice's fp32 parameters,
// its gradient and the AdamW moments. The wte, which two ranks hold, is
// sharded as a piece of its own, so both copies' slices line up: the same
// reduce-scatter of the same summed gradient, the same update, the same
// bits. A schedule needs every parameter of the rank's stages for every
// micro-batch, and the gradients accumulate over the micro-batches, so:
//   ZeRO-1, 2   the full parameters are kept and all-gathered after each
//               optimizer step;
//   ZeRO-3      they are all-gathered before a schedule and freed after
//               it (as torchtitan does under a pipeline: resharding after
//               every micro-batch's forward would gather M times);
//   every level the full gradients accumulate over the schedule and are
//               reduce-scattered (mean) into the owned slice after it;
//               ZeRO-2 and 3 free them until the next step.
// Replicas (dp_replicate above 1) then average the slice. The norm sums
// each slice's squares once (the first replica's, the wte copy left out)
// over the world.
//
// Unsharded, the dp ranks (every one a replica) average each held stage's
// gradient, and the norm sums the held stages' squares (the wte copy left
// out) over the pipeline.
//
// Errors: the groups' (parallel/process_group.h).
// Thread-safety: none; the training thread drives it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/collectives.h"
#include "parallel/parallel_dims.h"
#include "parallel/process_group.h"
#include "worker/checkpoint/layout.h"
#include "worker/model/model.h"
#include "worker/optim/optim.h"

namespace muster::worker {

// What every rank of a pipeline job agrees on.
struct PipelineLayout {
  std::vector<size_t> stage_sizes;  // every model stage, in floats
  size_t wte_floats = 0;            // wte leads stage 0
  // Per pipeline rank: the model stages it runs, sorted; stage 0 on the
  // first rank (the embedding) and on the last (the wte copy).
  std::vector<std::vector<int>> held;
};

class PipelineState {
 public:
  // This rank is `rank` of the world `dims`. `pipeline`: the dims.pp ranks
  // of its pipeline; `shard`, `replicate`: the dp groups of
  // worker/strategy/pipeline/pipeline.h's PipelineGroups (nullptr where the degree is 1);
  // `control`: the world. Not owned; they outlive this object. `zero`: 1,
  // 2 or 3 when sharded (REQUIRES).
  PipelineState(PipelineLayout layout, const parallel::ParallelDims& dims, int rank, int zero,
                parallel::ProcessGroup* pipeline, parallel::ProcessGroup* shard,
                parallel::ProcessGroup* replicate, parallel::Collectives* control);

  bool sharded() const { return dims_.dp_shard > 1; }
  const std::vector<int>& held() const { return layout_.held[pp_rank_]; }

  // The held stages' initial weights from `seed` (`model`: any part of
  // this rank computes them), and the owned slices when sharded. Returns
  // what AdamW updates. Call once, before AddPart.
  ParamShard Init(const GptModel& model, uint64_t seed);
  // Points `part`'s held stages at the arrays, now and whenever they move.
  // Not owned; it outlives this object.
  void AddPart(GptModel* part);

  // Before a schedule: the full parameters (ZeRO-3 gathers them) and, with
  // `backward`, the gradients (zeroed anew where they were freed). Returns
  // whether it gathered, for AfterForwardOnly. A collective under ZeRO-3.
  absl::StatusOr<bool> BeforeSchedule(bool backward);
  // After a forward-only schedule that BeforeSchedule gathered for: frees
  // the parameters again.
  void AfterForwardOnly(bool gathered);

  // The gradient of held stage `stage` (the tied wte's sum is taken on it).
  float* grads(int stage) { return &part_grads_[part_offset_[stage]]; }
  // After the schedules of a step (and the tied sum): the gradients the
  // optimizer reads, averaged over the dp ranks (see "Sharding").
  absl::Status ReduceGradients();
  // The sum of squares of the whole model's gradient, the same on every
  // rank (after ReduceGradients). A collective.
  absl::StatusOr<double> GradSumOfSquares(Ops& ops);
  // After the optimizer's step: ZeRO-1/2 gather the updated slices.
  absl::Status AfterOptimizerStep() {
    return KeepsFullParams() ? GatherParams() : absl::OkStatus();
  }
  // After a resume wrote the owned state into the optimizer's arrays.
  absl::Status StateLoaded() { return KeepsFullParams() ? GatherParams() : absl::OkStatus(); }
  void ZeroGrad();

  // ParallelStrategy's checkpoint ranges (worker/strategy/strategy.h).
  std::vector<std::vector<FlatRange>> CheckpointFiles(uint64_t total) const;
  std::vector<FlatRange> CheckpointLoad(uint64_t total) const;

  // The tied wte as this rank holds it (empty unless it holds stage 0),
  // gathered for the call where ZeRO-3 freed it: a collective over the
  // shard group.
  absl::StatusOr<std::vector<float>> Wte();
  // "params N B, grads N B (...)": what it keeps now, for the memory line.
  std::string Describe() const;

 private:
  // A run of the flat parameter layout sharded on its own: the wte (on the
  // first and the last rank: `copy` marks the last's), or the rest.
  struct Piece {
    std::vector<FlatRange> ranges;
    bool copy = false;
  };
  struct OwnedPiece {
    Piece piece;
    std::vector<FlatRange> owned;  // this rank's slice
    std::vector<size_t> counts;    // every shard rank's, in floats
    size_t at = 0;                 // where it starts in the shard arrays
  };

  bool KeepsFullParams() const { return sharded() && zero_ <= 2; }
  // Pipeline rank `p`'s parameters as flat ranges (`copy`: with the last
  // rank's wte copy, which it loads but does not write), and in pieces.
  std::vector<FlatRange> HeldRanges(int p, bool copy) const;
  std::vector<Piece> Pieces(int p) const;
  // What shard rank `j` of pipeline rank `p` owns (`copy`: with the wte
  // copy's slice).
  std::vector<FlatRange> OwnedRanges(int p, int j, bool copy) const;
  void Bind();
  void FreeParams();
  absl::Status GatherParams();

  const PipelineLayout layout_;
  const parallel::ParallelDims dims_;
  const parallel::ParallelDims::Coordinates me_;
  const int pp_rank_;
  const int zero_;
  parallel::ProcessGroup* const pipeline_;
  parallel::ProcessGroup* const shard_;
  parallel::ProcessGroup* const replicate_;
  parallel::Collectives* const control_;
  std::vector<GptModel*> parts_;
  std::vector<size_t> stage_flat_;   // where each model stage starts, then the total
  std::vector<size_t> part_offset_;  // per model stage: where it starts in the arrays (held ones)
  size_t part_floats_ = 0;
  // The held stages end to end; empty while freed (sharded, ZeRO-2/3).
  std::vector<float> part_params_, part_grads_;
  // Sharded: the owned slices' parameters and gradient, piece after piece.
  std::vector<OwnedPiece> pieces_;
  std::vector<float> shard_params_, shard_grads_;
};

}  // namespace muster::worker
