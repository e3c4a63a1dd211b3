#include "worker/pipeline.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/model/ops.h"

namespace muster::worker {

using parallel::PipelineAction;
using Type = PipelineAction::Type;

// Each in-flight micro-batch's boundary buffers (host, B x T x C floats):
// the activation received and sent, and the gradient sent and received.
// A slot is taken by a micro-batch's first action and given back after its
// backward; the sends still reading it are waited for before its next use.
struct Pipeline::Slots {
  size_t floats = 0;
  std::vector<std::vector<float>> act_in, act_out, grad_in, grad_out;
  std::vector<std::vector<std::shared_ptr<parallel::Work>>> sending;
  std::vector<int> free;
  std::map<int, int> of;  // micro-batch -> slot
  int in_flight = 0;
};

namespace {

// The tag of a micro-batch's message on a channel (one direction between
// two neighbours): the channel carries one message per micro-batch, in
// order, so the tag only checks that order.
int Tag(int microbatch) { return microbatch; }

absl::Status Invalid(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

}  // namespace

absl::StatusOr<std::vector<int>> PipelineSplit(const ModelConfig& config, int pp,
                                               const std::vector<int>& explicit_split) {
  const int L = config.layers;
  if (pp < 1) return Invalid("parallel.pp", absl::StrCat("must be >= 1, got ", pp));
  if (!explicit_split.empty()) {
    int sum = 0;
    bool positive = true;
    for (int blocks : explicit_split) {
      sum += blocks;
      positive = positive && blocks > 0;
    }
    if (static_cast<int>(explicit_split.size()) != pp || !positive || sum != L) {
      return Invalid(
          "parallel.pp_split",
          absl::StrCat("[", absl::StrJoin(explicit_split, ", "), "] must be ", pp,
                       " positive block counts (parallel.pp) summing to model.layers (", L, ")"));
    }
    return explicit_split;
  }
  if (L < pp) {
    return Invalid("parallel.pp", absl::StrCat(pp, " pipeline stages for ", L,
                                               " blocks (model.layers): each stage needs one"));
  }
  // Per token: a block's matmuls 24 C^2 (forward; the backward is twice
  // that on every block alike), the classifier 2 C Vp on the last rank.
  const double block = 24.0 * config.dim * config.dim;
  const double head = 2.0 * config.dim * config.padded_vocab();
  // cost[p][i]: the least possible largest rank cost when ranks 0..p-1
  // run blocks 0..i-1; cut[p][i] where rank p-1's range starts.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> cost(pp + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> cut(pp + 1, std::vector<int>(L + 1, 0));
  cost[0][0] = 0;
  for (int p = 1; p <= pp; ++p) {
    for (int i = p; i <= L; ++i) {
      for (int j = p - 1; j < i; ++j) {
        const double mine = block * (i - j) + (p == pp ? head : 0.0);
        const double worst = std::max(cost[p - 1][j], mine);
        if (worst < cost[p][i]) {
          cost[p][i] = worst;
          cut[p][i] = j;
        }
      }
    }
  }
  std::vector<int> split(pp);
  for (int p = pp, i = L; p >= 1; --p) {
    split[p - 1] = i - cut[p][i];
    i = cut[p][i];
  }
  return split;
}

Pipeline::Pipeline(const PipelineGroups& groups, parallel::ProcessGroup* control,
                   const parallel::ParallelDims& dims, const PipelineOptions& options,
                   std::string backend)
    : groups_(groups),
      control_(control),
      dims_(dims),
      options_(options),
      backend_(std::move(backend)) {}

Pipeline::~Pipeline() {
  if (slots_ == nullptr) return;
  for (auto& sending : slots_->sending) {
    for (auto& work : sending) (void)work->Wait();
  }
}

std::string Pipeline::Describe() const {
  // Before Build the split is not known yet.
  const std::string blocks = split_.empty() ? "" : ": blocks " + absl::StrJoin(split_, "/");
  std::string text = absl::StrCat("pipeline (", parallel::ScheduleName(options_.schedule), ", ",
                                  dims_.pp, " stages", blocks, ") over ", backend_);
  if (dims_.dp() > 1) absl::StrAppend(&text, ", ", dims_.dp(), " pipelines (dp)");
  return text;
}

absl::StatusOr<BuiltModel> Pipeline::Build(const BuildSpec& spec) {
  if (model_ != nullptr) return absl::FailedPreconditionError("Pipeline::Build called twice");
  if (spec.device != Device::kCpu) {
    return absl::UnimplementedError(
        "parallel.pp: pipeline stages run on the CPU in this build; on CUDA they are planned");
  }
  const parallel::ParallelDims::Coordinates me = dims_.Of(control_.rank());
  const int P = dims_.pp;
  const PipelineGroups& g = groups_;
  auto channel = [](parallel::ProcessGroup* group, bool wanted, int rank) {
    return wanted ? group != nullptr && group->size() == 2 && group->rank() == rank
                  : group == nullptr;
  };
  if (dims_.dp_shard != 1 || g.pipeline == nullptr || g.pipeline->size() != P ||
      g.pipeline->rank() != me.pp ||
      (g.tied == nullptr) != (P == 1 || (me.pp > 0 && me.pp < P - 1)) ||
      (g.dp == nullptr) != (dims_.dp() == 1) ||
      (g.dp != nullptr && (g.dp->size() != dims_.dp() || g.dp->rank() != me.dp)) ||
      !channel(g.activations_in, me.pp > 0, 1) || !channel(g.gradients_out, me.pp > 0, 1) ||
      !channel(g.activations_out, me.pp < P - 1, 0) || !channel(g.gradients_in, me.pp < P - 1, 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline: the process groups do not match the degrees (dp ", dims_.dp(),
                     " x pp ", P, ") for pipeline stage ", me.pp));
  }
  const parallel::ScheduleSpec schedule{options_.schedule, P, spec.micro_steps, 1};
  if (auto checked = parallel::BuildSchedule(schedule); !checked.ok()) return checked.status();
  auto split = PipelineSplit(spec.model, P, options_.split);
  if (!split.ok()) return split.status();
  split_ = *split;
  ModelPart part;
  for (int p = 0; p < stage(); ++p) part.first_block += split_[p];
  part.end_block = part.first_block + split_[stage()];
  part.slots = parallel::InFlightBound(schedule, stage());
  auto made = GptModel::CreatePart(spec.model, spec.micro_batch, spec.device, part);
  if (!made.ok()) return made.status();
  BuiltModel built;
  built.model = *std::move(made);
  GptModel* model = built.model.get();
  // Every rank computes the same initial weights from the seed, so the
  // wte copies start equal.
  model->InitWeights(spec.seed);
  for (const Stage& s : model->stages()) stage_sizes_.push_back(s.size);
  wte_floats_ = model->stages()[0].tensors[0].size;  // wte leads stage 0

  // AdamW over this rank's stages only, the wte copy included.
  ParamShard shard = WholeModel(model);
  std::vector<ParamShard::Slice> mine;
  const int head = static_cast<int>(stage_sizes_.size()) - 1;
  for (ParamShard::Slice slice : shard.groups[0].slices) {
    const bool block = slice.stage >= 1 + part.first_block && slice.stage < 1 + part.end_block;
    if (slice.stage == 0 && first()) {
      mine.push_back(slice);
    } else if (slice.stage == 0 && last()) {
      slice.count = wte_floats_;
      mine.push_back(slice);
    } else if (block || (slice.stage == head && last())) {
      mine.push_back(slice);
    }
  }
  shard.groups[0].slices = std::move(mine);
  auto optimizer = AdamW::Create(model, spec.optim, std::move(shard));
  if (!optimizer.ok()) return optimizer.status();
  built.optimizer = *std::move(optimizer);

  slots_ = std::make_unique<Slots>();
  slots_->floats = static_cast<size_t>(spec.micro_batch) * spec.model.seq_len * spec.model.dim;
  for (int s = part.slots - 1; s >= 0; --s) slots_->free.push_back(s);
  for (auto* buffers : {&slots_->act_in, &slots_->act_out, &slots_->grad_in, &slots_->grad_out}) {
    buffers->assign(part.slots, std::vector<float>(slots_->floats));
  }
  slots_->sending.resize(part.slots);
  model_ = model;
  return built;
}

absl::StatusOr<StepLoss> Pipeline::Run(GptModel* model, const MicroBatches& batches,
                                       const std::vector<PipelineAction>& actions) {
  Slots& slots = *slots_;
  const size_t tokens = static_cast<size_t>(batches.B) * batches.T;
  const size_t floats = tokens * model->config().dim;
  std::vector<int> inputs(tokens), targets(tokens);
  auto take = [&](int m) -> absl::StatusOr<int> {
    auto found = slots.of.find(m);
    if (found != slots.of.end()) return found->second;
    if (slots.free.empty()) {
      return absl::InternalError(absl::StrCat("pipeline: no activation slot free for micro-batch ",
                                              m, " (the schedule holds more than its bound)"));
    }
    const int slot = slots.free.back();
    slots.free.pop_back();
    for (auto& work : slots.sending[slot]) {
      if (absl::Status sent = work->Wait(); !sent.ok()) return sent;
    }
    slots.sending[slot].clear();
    slots.of[m] = slot;
    return slot;
  };
  auto give_back = [&](int m) {
    slots.free.push_back(slots.of[m]);
    slots.of.erase(m);
  };
  StepLoss loss;
  times_.clear();
  const absl::Time began = absl::Now();
  auto since = [&] { return absl::ToDoubleSeconds(absl::Now() - began); };
  for (const PipelineAction& action : actions) {
    const int m = action.microbatch;
    times_.push_back({action, since(), 0});
    auto slot = take(m);
    if (!slot.ok()) return slot.status();
    const int s = *slot;
    switch (action.type) {
      case Type::kRecvActivation:
      case Type::kRecvGradient: {
        // On the channel from that neighbour: the other rank of the pair.
        const bool gradient = action.type == Type::kRecvGradient;
        parallel::ProcessGroup* from = gradient ? groups_.gradients_in : groups_.activations_in;
        std::vector<float>& into = gradient ? slots.grad_out[s] : slots.act_in[s];
        absl::Status received =
            from->Recv(absl::MakeSpan(into.data(), floats), 1 - from->rank(), Tag(m))->Wait();
        if (!received.ok()) return received;
        break;
      }
      case Type::kSendActivation:
      case Type::kSendGradient: {
        const bool gradient = action.type == Type::kSendGradient;
        parallel::ProcessGroup* to = gradient ? groups_.gradients_out : groups_.activations_out;
        const std::vector<float>& from = gradient ? slots.grad_in[s] : slots.act_out[s];
        slots.sending[s].push_back(
            to->Send(absl::MakeConstSpan(from.data(), floats), 1 - to->rank(), Tag(m)));
        // The gradient is a micro-batch's last message: it leaves its
        // slot (the send is waited for when the slot is taken again).
        if (gradient) give_back(m);
        break;
      }
      case Type::kForward: {
        batches.fill(m, inputs.data(), targets.data());
        const float value =
            model->PartForward(s, inputs.data(), last() ? targets.data() : nullptr,
                               first() ? nullptr : slots.act_in[s].data(),
                               last() ? nullptr : slots.act_out[s].data(), batches.B, batches.T);
        if (last()) {
          loss.sum += value;
          ++loss.count;
        }
        peak_in_flight_ = std::max(peak_in_flight_, ++slots.in_flight);
        break;
      }
      case Type::kBackward: {
        model->PartBackward(s, 1.0f / batches.count, last() ? nullptr : slots.grad_out[s].data(),
                            first() ? nullptr : slots.grad_in[s].data());
        --slots.in_flight;
        if (first()) give_back(m);  // nothing to send: done with it
        break;
      }
    }
    times_.back().end = since();
  }
  // Every send of the step has finished before the step's reductions.
  for (auto& sending : slots.sending) {
    for (auto& work : sending) {
      if (absl::Status sent = work->Wait(); !sent.ok()) return sent;
    }
    sending.clear();
  }
  return loss;
}

absl::StatusOr<StepLoss> Pipeline::ForwardBackward(GptModel* model, const MicroBatches& batches) {
  auto schedule =
      parallel::BuildSchedule({options_.schedule, dims_.pp, batches.count, /*virtual_stages=*/1});
  if (!schedule.ok()) return schedule.status();
  return Run(model, batches, (*schedule)[stage()]);
}

absl::StatusOr<StepLoss> Pipeline::ForwardOnly(GptModel* model, const MicroBatches& batches) {
  // Each micro-batch down the pipeline in turn: receive, forward, send.
  std::vector<PipelineAction> actions;
  for (int m = 0; m < batches.count; ++m) {
    if (!first()) actions.push_back({Type::kRecvActivation, m, stage(), stage() - 1});
    actions.push_back({Type::kForward, m, stage(), -1});
    if (!last()) actions.push_back({Type::kSendActivation, m, stage(), stage() + 1});
  }
  // Without backwards the slots are given back after each forward (or
  // its send).
  Slots& slots = *slots_;
  StepLoss loss;
  for (size_t i = 0; i < actions.size();) {
    size_t end = i + 1;
    while (end < actions.size() && actions[end].microbatch == actions[i].microbatch) ++end;
    std::vector<PipelineAction> one(actions.begin() + i, actions.begin() + end);
    auto part = Run(model, batches, one);
    if (!part.ok()) return part.status();
    loss.sum += part->sum;
    loss.count += part->count;
    const int m = actions[i].microbatch;
    if (slots.of.count(m) > 0) {
      slots.free.push_back(slots.of[m]);
      slots.of.erase(m);
    }
    slots.in_flight = 0;
    i = end;
  }
  return loss;
}

absl::Status Pipeline::ReduceGradients(GptModel* model) {
  std::vector<Stage>& stages = model->stages();
  if (groups_.tied != nullptr && (first() || last())) {
    // The tied wte: the encoder's share (first rank) plus the head's (last).
    absl::Status summed =
        groups_.tied
            ->AllReduce(absl::MakeSpan(stages[0].grads, wte_floats_), parallel::ReduceOp::kSum)
            ->Wait();
    if (!summed.ok()) return summed;
  }
  if (groups_.dp == nullptr) return absl::OkStatus();
  std::vector<std::shared_ptr<parallel::Work>> works;
  for (const FlatRange& range : ParamRanges(stage(), /*copy=*/true)) {
    // Flat ranges of whole stages (or wte): back to each stage's buffer.
    size_t flat = 0;
    for (size_t s = 0; s < stages.size(); ++s) {
      if (range.begin >= flat && range.begin < flat + stages[s].size) {
        uint64_t left = range.count;
        for (size_t t = s; left > 0; ++t) {
          const size_t skip = t == s ? range.begin - flat : 0;
          const size_t n = std::min<uint64_t>(left, stages[t].size - skip);
          works.push_back(groups_.dp->AllReduce(absl::MakeSpan(stages[t].grads + skip, n),
                                                parallel::ReduceOp::kAvg));
          left -= n;
        }
        break;
      }
      flat += stages[s].size;
    }
  }
  absl::Status first_error;
  for (auto& work : works) {
    absl::Status status = work->Wait();
    if (!status.ok() && first_error.ok()) first_error = status;
  }
  return first_error;
}

absl::StatusOr<double> Pipeline::GradSumOfSquares(GptModel* model) {
  std::vector<Stage>& stages = model->stages();
  double local = 0.0;
  size_t flat = 0;
  std::vector<FlatRange> mine = ParamRanges(stage(), /*copy=*/false);
  for (size_t s = 0; s < stages.size(); ++s) {
    for (const FlatRange& range : mine) {
      const uint64_t lo = std::max<uint64_t>(range.begin, flat);
      const uint64_t hi = std::min<uint64_t>(range.begin + range.count, flat + stages[s].size);
      if (lo < hi) local += model->ops().SumOfSquares(stages[s].grads + (lo - flat), hi - lo);
    }
    flat += stages[s].size;
  }
  parallel::Collectives pipeline(groups_.pipeline);
  return pipeline.SumDouble(local);
}

absl::Status Pipeline::OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                                     float grad_scale) {
  // The wte copies have the same gradient and moments: the same step.
  optimizer->Step(lr, step, grad_scale);
  return absl::OkStatus();
}

void Pipeline::ZeroGrad(GptModel* model) { model->ZeroGrad(); }

std::vector<FlatRange> Pipeline::ParamRanges(int p, bool copy) const {
  const int P = dims_.pp;
  std::vector<FlatRange> ranges;
  std::vector<uint64_t> flat(stage_sizes_.size() + 1, 0);
  for (size_t s = 0; s < stage_sizes_.size(); ++s) flat[s + 1] = flat[s] + stage_sizes_[s];
  if (p == 0) {
    AppendRange(&ranges, {0, stage_sizes_[0]});
  } else if (copy && p == P - 1) {
    AppendRange(&ranges, {0, wte_floats_});
  }
  int first_block = 0;
  for (int q = 0; q < p; ++q) first_block += split_[q];
  for (int b = first_block; b < first_block + split_[p]; ++b) {
    AppendRange(&ranges, {flat[1 + b], stage_sizes_[1 + b]});
  }
  if (p == P - 1) {
    const size_t head = stage_sizes_.size() - 1;
    AppendRange(&ranges, {flat[head], stage_sizes_[head]});
  }
  return ranges;
}

std::vector<std::vector<FlatRange>> Pipeline::CheckpointFiles(uint64_t total) const {
  std::vector<std::vector<FlatRange>> files;
  for (int rank = 0; rank < dims_.world(); ++rank) {
    const parallel::ParallelDims::Coordinates at = dims_.Of(rank);
    const std::vector<FlatRange> state = StateRanges(ParamRanges(at.pp, /*copy=*/false), total);
    // The pipelines hold the same stages: each writes its share.
    files.push_back(SplitRanges(state, dims_.dp(), at.dp));
  }
  return files;
}

std::vector<FlatRange> Pipeline::CheckpointLoad(uint64_t total) const {
  return StateRanges(ParamRanges(stage(), /*copy=*/true), total);
}

absl::Status Pipeline::StateLoaded(GptModel* model) {
  // Loaded straight into the part's buffers, the wte copy with them.
  return absl::OkStatus();
}

}  // namespace muster::worker
