#include "worker/strategy/pipeline/pipeline_state.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/model/ops.h"

namespace muster::worker {
namespace {

// Calls f(stage, in_stage, count, at) for each run of the flat ranges
// `ranges` (sorted, disjoint) cut at the stages' boundaries (`stage_flat`:
// where each stage starts, then the total); `at` counts floats from the
// start of the ranges' concatenation.
template <typename F>
void ForEachStageRun(const std::vector<size_t>& stage_flat, const std::vector<FlatRange>& ranges,
                     F f) {
  size_t at = 0;
  size_t stage = 0;
  for (const FlatRange& range : ranges) {
    uint64_t begin = range.begin, left = range.count;
    while (left > 0) {
      while (stage_flat[stage + 1] <= begin) ++stage;
      const uint64_t n = std::min<uint64_t>(left, stage_flat[stage + 1] - begin);
      f(static_cast<int>(stage), static_cast<size_t>(begin - stage_flat[stage]),
        static_cast<size_t>(n), at);
      begin += n;
      left -= n;
      at += n;
    }
  }
}

uint64_t Floats(const std::vector<FlatRange>& ranges) {
  uint64_t total = 0;
  for (const FlatRange& range : ranges) total += range.count;
  return total;
}

void Free(std::vector<float>* array) {
  array->clear();
  array->shrink_to_fit();
}

// Waits for every one of `works`, then returns the first error.
absl::Status WaitAll(std::vector<std::shared_ptr<parallel::Work>>* works) {
  absl::Status first_error;
  for (auto& work : *works) {
    absl::Status status = work->Wait();
    if (!status.ok() && first_error.ok()) first_error = status;
  }
  works->clear();
  return first_error;
}

}  // namespace

PipelineState::PipelineState(PipelineLayout layout, const parallel::ParallelDims& dims, int rank,
                             int zero, parallel::ProcessGroup* pipeline,
                             parallel::ProcessGroup* shard, parallel::ProcessGroup* replicate,
                             parallel::Collectives* control)
    : layout_(std::move(layout)),
      dims_(dims),
      me_(dims.Of(rank)),
      pp_rank_(me_.pp),
      zero_(zero),
      pipeline_(pipeline),
      shard_(shard),
      replicate_(replicate),
      control_(control) {
  stage_flat_.assign(1, 0);
  for (size_t size : layout_.stage_sizes) stage_flat_.push_back(stage_flat_.back() + size);
  part_offset_.assign(layout_.stage_sizes.size(), 0);
  for (int stage : held()) {
    part_offset_[stage] = part_floats_;
    part_floats_ += layout_.stage_sizes[stage];
  }
}

ParamShard PipelineState::Init(const GptModel& model, uint64_t seed) {
  // Every rank computes the same weights, so the wte copies start equal.
  part_params_.assign(part_floats_, 0.0f);
  for (int stage : held()) {
    model.InitStageWeights(stage, seed, &part_params_[part_offset_[stage]]);
  }
  ParamShard shard;
  ParamShard::Group group;
  if (!sharded()) {
    // AdamW over the held stages, in the arrays; only the wte of the last
    // rank's stage 0.
    part_grads_.assign(part_floats_, 0.0f);
    group.params = part_params_.data();
    group.grads = part_grads_.data();
    ForEachStageRun(stage_flat_, HeldRanges(pp_rank_, /*copy=*/true),
                    [&](int stage, size_t in_stage, size_t n, size_t) {
                      group.slices.push_back({stage, in_stage, n, part_offset_[stage] + in_stage});
                    });
  } else {
    // AdamW over the owned slices, in the shard arrays.
    const int n = dims_.dp_shard, j = me_.shard;
    size_t at = 0;
    for (Piece& piece : Pieces(pp_rank_)) {
      OwnedPiece owned;
      for (int k = 0; k < n; ++k) owned.counts.push_back(Floats(SplitRanges(piece.ranges, n, k)));
      owned.owned = SplitRanges(piece.ranges, n, j);
      owned.piece = std::move(piece);
      owned.at = at;
      at += owned.counts[j];
      pieces_.push_back(std::move(owned));
    }
    shard_params_.assign(at, 0.0f);
    shard_grads_.assign(at, 0.0f);
    for (const OwnedPiece& piece : pieces_) {
      ForEachStageRun(stage_flat_, piece.owned,
                      [&](int stage, size_t in_stage, size_t count, size_t pos) {
                        std::copy_n(&part_params_[part_offset_[stage] + in_stage], count,
                                    &shard_params_[piece.at + pos]);
                        group.slices.push_back({stage, in_stage, count, piece.at + pos});
                      });
    }
    group.params = shard_params_.data();
    group.grads = shard_grads_.data();
    if (zero_ == 1) part_grads_.assign(part_floats_, 0.0f);
    if (zero_ == 3) Free(&part_params_);  // gathered again before the first schedule
  }
  shard.groups.push_back(std::move(group));
  return shard;
}

void PipelineState::AddPart(GptModel* part) {
  parts_.push_back(part);
  Bind();
}

void PipelineState::Bind() {
  for (GptModel* part : parts_) {
    for (int stage : held()) {
      part->BindStage(stage, part_params_.empty() ? nullptr : &part_params_[part_offset_[stage]],
                      part_grads_.empty() ? nullptr : &part_grads_[part_offset_[stage]]);
    }
  }
}

void PipelineState::FreeParams() {
  Free(&part_params_);
  Bind();
}

absl::StatusOr<bool> PipelineState::BeforeSchedule(bool backward) {
  const bool gather = part_params_.empty();  // ZeRO-3
  if (gather) {
    if (absl::Status gathered = GatherParams(); !gathered.ok()) return gathered;
  }
  if (backward && part_grads_.empty()) {  // ZeRO-2/3: freed since the last step
    part_grads_.assign(part_floats_, 0.0f);
    Bind();
  }
  return gather;
}

void PipelineState::AfterForwardOnly(bool gathered) {
  if (gathered) FreeParams();
}

absl::Status PipelineState::GatherParams() {
  if (part_params_.empty()) {
    part_params_.assign(part_floats_, 0.0f);
    Bind();
  }
  std::vector<std::vector<float>> gathered(pieces_.size());
  std::vector<std::shared_ptr<parallel::Work>> works;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const OwnedPiece& piece = pieces_[k];
    gathered[k].resize(Floats(piece.piece.ranges));
    works.push_back(
        shard_->AllGather(absl::MakeConstSpan(&shard_params_[piece.at], piece.counts[me_.shard]),
                          absl::MakeSpan(gathered[k]), piece.counts));
  }
  if (absl::Status status = WaitAll(&works); !status.ok()) return status;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    ForEachStageRun(stage_flat_, pieces_[k].piece.ranges,
                    [&](int stage, size_t in_stage, size_t n, size_t pos) {
                      std::copy_n(&gathered[k][pos], n,
                                  &part_params_[part_offset_[stage] + in_stage]);
                    });
  }
  return absl::OkStatus();
}

absl::Status PipelineState::ReduceGradients() {
  std::vector<std::shared_ptr<parallel::Work>> works;
  if (!sharded()) {
    if (replicate_ == nullptr) return absl::OkStatus();
    ForEachStageRun(stage_flat_, HeldRanges(pp_rank_, /*copy=*/true),
                    [&](int stage, size_t in_stage, size_t n, size_t) {
                      works.push_back(replicate_->AllReduce(
                          absl::MakeSpan(&part_grads_[part_offset_[stage] + in_stage], n),
                          parallel::ReduceOp::kAvg));
                    });
    return WaitAll(&works);
  }
  // Each piece's full gradient, packed, reduce-scattered into the owned
  // slice; then the replicas' mean of the slice.
  std::vector<std::vector<float>> packed(pieces_.size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const OwnedPiece& piece = pieces_[k];
    packed[k].resize(Floats(piece.piece.ranges));
    ForEachStageRun(stage_flat_, piece.piece.ranges,
                    [&](int stage, size_t in_stage, size_t n, size_t pos) {
                      std::copy_n(&part_grads_[part_offset_[stage] + in_stage], n, &packed[k][pos]);
                    });
    works.push_back(
        shard_->ReduceScatter(absl::MakeConstSpan(packed[k]),
                              absl::MakeSpan(&shard_grads_[piece.at], piece.counts[me_.shard]),
                              piece.counts, parallel::ReduceOp::kAvg));
  }
  if (absl::Status reduced = WaitAll(&works); !reduced.ok()) return reduced;
  if (replicate_ != nullptr) {
    works.push_back(replicate_->AllReduce(absl::MakeSpan(shard_grads_), parallel::ReduceOp::kAvg));
    if (absl::Status reduced = WaitAll(&works); !reduced.ok()) return reduced;
  }
  // Until the next step: ZeRO-2/3 keep no full gradient, ZeRO-3 no full
  // parameters.
  if (zero_ >= 2) Free(&part_grads_);
  if (zero_ == 3) Free(&part_params_);
  Bind();
  return absl::OkStatus();
}

absl::StatusOr<double> PipelineState::GradSumOfSquares(Ops& ops) {
  double local = 0.0;
  if (sharded()) {
    // Each slice once: the first replica's, without the wte copy.
    for (const OwnedPiece& piece : pieces_) {
      if (piece.piece.copy || me_.replicate != 0) continue;
      local += ops.SumOfSquares(&shard_grads_[piece.at], piece.counts[me_.shard]);
    }
    return control_->SumDouble(local);
  }
  ForEachStageRun(stage_flat_, HeldRanges(pp_rank_, /*copy=*/false),
                  [&](int stage, size_t in_stage, size_t n, size_t) {
                    local += ops.SumOfSquares(&part_grads_[part_offset_[stage] + in_stage], n);
                  });
  parallel::Collectives pipeline(pipeline_);
  return pipeline.SumDouble(local);
}

void PipelineState::ZeroGrad() { std::fill(part_grads_.begin(), part_grads_.end(), 0.0f); }

std::vector<FlatRange> PipelineState::HeldRanges(int p, bool copy) const {
  std::vector<FlatRange> ranges;
  for (int stage : layout_.held[p]) {
    if (stage != 0) {
      AppendRange(&ranges, {stage_flat_[stage], layout_.stage_sizes[stage]});
    } else if (p == 0) {
      AppendRange(&ranges, {0, layout_.stage_sizes[0]});  // the embedding
    } else if (copy) {
      AppendRange(&ranges, {0, layout_.wte_floats});  // the wte copy
    }
  }
  return ranges;
}

std::vector<PipelineState::Piece> PipelineState::Pieces(int p) const {
  std::vector<Piece> pieces;
  Piece rest;
  for (int stage : layout_.held[p]) {
    if (stage != 0) {
      AppendRange(&rest.ranges, {stage_flat_[stage], layout_.stage_sizes[stage]});
      continue;
    }
    pieces.push_back({{{0, layout_.wte_floats}}, /*copy=*/p != 0});
    if (p == 0) {  // the wpe
      rest.ranges.push_back({layout_.wte_floats, layout_.stage_sizes[0] - layout_.wte_floats});
    }
  }
  pieces.push_back(std::move(rest));
  return pieces;
}

std::vector<FlatRange> PipelineState::OwnedRanges(int p, int j, bool copy) const {
  std::vector<FlatRange> owned;
  for (const Piece& piece : Pieces(p)) {
    if (piece.copy && !copy) continue;
    for (const FlatRange& range : SplitRanges(piece.ranges, dims_.dp_shard, j)) {
      AppendRange(&owned, range);
    }
  }
  return owned;
}

std::vector<std::vector<FlatRange>> PipelineState::CheckpointFiles(uint64_t total) const {
  std::vector<std::vector<FlatRange>> files;
  for (int rank = 0; rank < dims_.world(); ++rank) {
    const parallel::ParallelDims::Coordinates at = dims_.Of(rank);
    if (sharded()) {
      // A shard's replicas hold the same slices: each writes its share.
      const std::vector<FlatRange> state =
          StateRanges(OwnedRanges(at.pp, at.shard, /*copy=*/false), total);
      files.push_back(SplitRanges(state, dims_.dp_replicate, at.replicate));
    } else {
      // The pipelines hold the same stages: each writes its share.
      const std::vector<FlatRange> state = StateRanges(HeldRanges(at.pp, /*copy=*/false), total);
      files.push_back(SplitRanges(state, dims_.dp(), at.dp));
    }
  }
  return files;
}

std::vector<FlatRange> PipelineState::CheckpointLoad(uint64_t total) const {
  if (sharded()) return StateRanges(OwnedRanges(pp_rank_, me_.shard, /*copy=*/true), total);
  return StateRanges(HeldRanges(pp_rank_, /*copy=*/true), total);
}

absl::StatusOr<std::vector<float>> PipelineState::Wte() {
  if (held().empty() || held().front() != 0) return std::vector<float>();
  auto gathered = BeforeSchedule(/*backward=*/false);
  if (!gathered.ok()) return gathered.status();
  std::vector<float> wte(part_params_.begin() + part_offset_[0],
                         part_params_.begin() + part_offset_[0] + layout_.wte_floats);
  AfterForwardOnly(*gathered);
  return wte;
}

std::string PipelineState::Describe() const {
  auto bytes = [](size_t floats) { return static_cast<unsigned long long>(floats) * 4; };
  return absl::StrCat("params ", bytes(part_params_.size() + shard_params_.size()), " B, grads ",
                      bytes(part_grads_.size() + shard_grads_.size()), " B (", held().size(),
                      " model stages held, ", part_floats_, " floats",
                      sharded() ? absl::StrCat(", ", shard_params_.size(), " of them owned") : "",
                      ")");
}

}  // namespace muster::worker
