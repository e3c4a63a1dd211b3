#include "worker/pipeline.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/model/ops.h"

namespace muster::worker {

using parallel::PipelineAction;
using Type = PipelineAction::Type;

// One model part this rank runs (pipeline stage `stage`), and each
// in-flight micro-batch's boundary buffers for it (host, B x T x C
// floats): the activation received and sent, and the gradient sent and
// received. A slot is taken by a micro-batch's first action on the stage
// and given back after its last (Releases).
//
// Sends never block the schedule, as the simulator assumes: a slot taken
// again while its sends are still on their way gets fresh send buffers,
// and the old ones wait in `retired` until their sends finish. (Waiting
// for them instead can close a cycle: under interleaved 1F1B the receiver
// may post that receive only after something this rank has yet to send.)
struct Pipeline::Chunk {
  struct Sending {
    std::vector<float> act_out, grad_in;
    std::vector<std::shared_ptr<parallel::Work>> works;
  };
  int stage = 0;
  GptModel* model = nullptr;        // chunk 0: the model Build returns
  std::unique_ptr<GptModel> owned;  // the other chunks, bound to chunk 0's buffers
  std::vector<std::vector<float>> act_in, act_out, grad_in, grad_out;
  std::vector<std::vector<std::shared_ptr<parallel::Work>>> sending;
  std::vector<Sending> retired;
  std::vector<int> free;
  std::map<int, int> of;  // micro-batch -> slot
};

namespace {

// The tag of micro-batch m's message from pipeline stage `from` (the
// sender's), M micro-batches a step: a channel carries one message per
// stage and micro-batch, in order, so the tag only checks that order.
int Tag(int from, int m, int M) { return from * M + m; }

// For each of `actions`, whether it is the last one of its micro-batch on
// its stage, after which the slot is free: the gradient sent to the
// previous stage (or the first stage's backward, or the weight pass of a
// split backward); in a forward-only run, the activation sent, or the last
// stage's forward.
std::vector<bool> Releases(const std::vector<PipelineAction>& actions) {
  std::vector<bool> last(actions.size(), false);
  std::set<std::pair<int, int>> seen;  // (stage, micro-batch), from the end
  for (size_t i = actions.size(); i-- > 0;) {
    last[i] = seen.insert({actions[i].stage, actions[i].microbatch}).second;
  }
  return last;
}

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

absl::Status Invalid(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

}  // namespace

absl::StatusOr<std::vector<int>> PipelineSplit(const ModelConfig& config, int stages,
                                               const std::vector<int>& explicit_split) {
  const int L = config.layers;
  const int pp = stages;  // the dynamic programme below cuts the blocks into `pp` ranges
  if (pp < 1) return Invalid("parallel.pp", absl::StrCat("must be >= 1, got ", pp));
  if (!explicit_split.empty()) {
    int sum = 0;
    bool positive = true;
    for (int blocks : explicit_split) {
      sum += blocks;
      positive = positive && blocks > 0;
    }
    if (static_cast<int>(explicit_split.size()) != pp || !positive || sum != L) {
      return Invalid("parallel.pp_split",
                     absl::StrCat("[", absl::StrJoin(explicit_split, ", "), "] must be ", pp,
                                  " positive block counts (one per pipeline stage: parallel.pp x "
                                  "parallel.virtual_stages) summing to model.layers (",
                                  L, ")"));
    }
    return explicit_split;
  }
  if (L < pp) {
    return Invalid("parallel.pp", absl::StrCat(pp, " pipeline stages for ", L,
                                               " blocks (model.layers): each stage needs one"));
    // (pp: parallel.pp x parallel.virtual_stages)
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

std::vector<int> PipelineSlots(const std::vector<PipelineAction>& actions, int pp, int chunks) {
  std::vector<int> peak(chunks, 1);
  std::vector<std::set<int>> live(chunks);
  const std::vector<bool> releases = Releases(actions);
  for (size_t i = 0; i < actions.size(); ++i) {
    const PipelineAction& action = actions[i];
    const int c = action.stage / pp;
    live[c].insert(action.microbatch);
    peak[c] = std::max(peak[c], static_cast<int>(live[c].size()));
    if (releases[i]) live[c].erase(action.microbatch);
  }
  return peak;
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
  for (auto& chunk : chunks_) (void)Sweep(chunk.get(), /*wait=*/true);
  // A receive posted ahead of a step that failed writes into its buffer.
  for (Posted& posted : posted_) {
    if (posted.work != nullptr) (void)posted.work->Wait();
  }
}

std::string Pipeline::Describe() const {
  // Before Build the split is not known yet.
  const std::string blocks = split_.empty() ? "" : ": blocks " + absl::StrJoin(split_, "/");
  const int V = options_.virtual_stages;
  std::string text = absl::StrCat(
      "pipeline (", parallel::ScheduleName(options_.schedule), ", ", dims_.pp, " ranks",
      V > 1 ? absl::StrCat(" x ", V, " virtual stages") : "", blocks, ") over ", backend_);
  if (sharded()) {
    absl::StrAppend(&text, ", each stage sharded over ", dims_.dp_shard, " ranks (ZeRO-",
                    options_.zero, ")");
    if (dims_.dp_replicate > 1) absl::StrAppend(&text, " x ", dims_.dp_replicate, " replicas");
  } else if (dims_.dp() > 1) {
    absl::StrAppend(&text, ", ", dims_.dp(), " pipelines (dp)");
  }
  return text;
}

std::pair<int, int> Pipeline::Blocks(int s) const {
  int first = 0;
  for (int q = 0; q < s; ++q) first += split_[q];
  return {first, first + split_[s]};
}

size_t Pipeline::ActivationBytes() const {
  size_t bytes = 0;
  for (const auto& chunk : chunks_) bytes += chunk->model->ActivationBytes();
  return bytes;
}

absl::StatusOr<BuiltModel> Pipeline::Build(const BuildSpec& spec) {
  if (model_ != nullptr) return absl::FailedPreconditionError("Pipeline::Build called twice");
  if (spec.device != Device::kCpu) {
    return absl::UnimplementedError(
        "parallel.pp: pipeline stages run on the CPU in this build; on CUDA they are planned");
  }
  const parallel::ParallelDims::Coordinates me = dims_.Of(control_.rank());
  const int P = dims_.pp, V = options_.virtual_stages;
  const PipelineGroups& g = groups_;
  auto channel = [](parallel::ProcessGroup* group, bool wanted, int rank) {
    return wanted ? group != nullptr && group->size() == 2 && group->rank() == rank
                  : group == nullptr;
  };
  // With V > 1 the channels close a ring: every rank has both neighbours.
  const bool has_previous = me.pp > 0 || (V > 1 && P > 1);
  const bool has_next = me.pp < P - 1 || (V > 1 && P > 1);
  auto member = [](parallel::ProcessGroup* group, int size, int rank) {
    return size == 1 ? group == nullptr
                     : group != nullptr && group->size() == size && group->rank() == rank;
  };
  if (V < 1 || g.pipeline == nullptr || g.pipeline->size() != P || g.pipeline->rank() != me.pp ||
      (g.tied == nullptr) != (P == 1 || (me.pp > 0 && me.pp < P - 1)) ||
      !member(g.replicate, dims_.dp_replicate, me.replicate) ||
      !member(g.shard, dims_.dp_shard, me.shard) || !channel(g.activations_in, has_previous, 1) ||
      !channel(g.gradients_out, has_previous, 1) || !channel(g.activations_out, has_next, 0) ||
      !channel(g.gradients_in, has_next, 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline: the process groups do not match the degrees (dp ", dims_.dp(),
                     " x pp ", P, ", ", V, " virtual stages) for pipeline rank ", me.pp));
  }
  if (sharded() && (options_.zero < 1 || options_.zero > 3)) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.zero: ", options_.zero, "; the ZeRO stages are 1, 2 and 3"));
  }
  const parallel::ScheduleSpec schedule{options_.schedule, P, spec.micro_steps, V};
  auto actions = parallel::BuildSchedule(schedule);
  if (!actions.ok()) return actions.status();
  auto split = PipelineSplit(spec.model, stages(), options_.split);
  if (!split.ok()) return split.status();
  split_ = *split;
  const std::vector<int> slots = PipelineSlots((*actions)[stage()], P, V);
  BuiltModel built;
  for (int c = 0; c < V; ++c) {
    auto chunk = std::make_unique<Chunk>();
    chunk->stage = c * P + stage();
    const auto [first_block, end_block] = Blocks(chunk->stage);
    // Zero-bubble schedules split each backward in two passes.
    const ModelPart part{first_block, end_block, slots[c],
                         options_.schedule == parallel::ScheduleKind::kZeroBubbleH1};
    // Every chunk computes on the rank's arrays (Bind, below).
    auto made = GptModel::CreatePart(spec.model, spec.micro_batch, spec.device, part,
                                     ParamStorage::kExternal);
    if (!made.ok()) return made.status();
    if (c == 0) {
      built.model = *std::move(made);
      chunk->model = built.model.get();
    } else {
      chunk->owned = *std::move(made);
      chunk->model = chunk->owned.get();
    }
    const size_t floats =
        static_cast<size_t>(spec.micro_batch) * spec.model.seq_len * spec.model.dim;
    for (int s = slots[c] - 1; s >= 0; --s) chunk->free.push_back(s);
    for (auto* buffers : {&chunk->act_in, &chunk->act_out, &chunk->grad_in, &chunk->grad_out}) {
      buffers->assign(slots[c], std::vector<float>(floats));
    }
    chunk->sending.resize(slots[c]);
    chunks_.push_back(std::move(chunk));
  }
  GptModel* model = built.model.get();
  model_ = model;
  stage_flat_.assign(1, 0);
  for (const Stage& st : model->stages()) {
    stage_sizes_.push_back(st.size);
    stage_flat_.push_back(stage_flat_.back() + st.size);
  }
  wte_floats_ = model->stages()[0].tensors[0].size;  // wte leads stage 0

  // The held stages end to end, each initialised from the seed on its own
  // (every rank computes the same weights, so the wte copies start equal).
  held_ = HeldStages(stage());
  part_offset_.assign(stage_sizes_.size(), 0);
  for (int st : held_) {
    part_offset_[st] = part_floats_;
    part_floats_ += stage_sizes_[st];
  }
  part_params_.assign(part_floats_, 0.0f);
  for (int st : held_) model->InitStageWeights(st, spec.seed, &part_params_[part_offset_[st]]);

  ParamShard shard;
  ParamShard::Group group;
  // The last rank's stage 0 is the wte copy: its wpe is never used.
  auto held_count = [&](int st) { return st == 0 && !first() ? wte_floats_ : stage_sizes_[st]; };
  if (!sharded()) {
    // AdamW over the held stages, in the arrays.
    part_grads_.assign(part_floats_, 0.0f);
    group.params = part_params_.data();
    group.grads = part_grads_.data();
    for (int st : held_) group.slices.push_back({st, 0, held_count(st), part_offset_[st]});
  } else {
    // AdamW over the owned slices, in the shard arrays.
    const int n = dims_.dp_shard, j = me.shard;
    size_t at = 0;
    for (Piece& piece : Pieces(stage())) {
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
      ForEachStageRun(stage_flat_, piece.owned, [&](int st, size_t in_stage, size_t n, size_t pos) {
        std::copy_n(&part_params_[part_offset_[st] + in_stage], n, &shard_params_[piece.at + pos]);
        group.slices.push_back({st, in_stage, n, piece.at + pos});
      });
    }
    group.params = shard_params_.data();
    group.grads = shard_grads_.data();
    if (options_.zero == 3) {
      // Gathered again before the first step's first forward.
      part_params_.clear();
      part_params_.shrink_to_fit();
    }
  }
  Bind();
  shard.groups.push_back(std::move(group));
  auto optimizer = AdamW::Create(model, spec.optim, std::move(shard));
  if (!optimizer.ok()) return optimizer.status();
  built.optimizer = *std::move(optimizer);
  return built;
}

std::vector<int> Pipeline::HeldStages(int p) const {
  const int P = dims_.pp;
  std::vector<int> held;
  if (p == 0 || p == P - 1) held.push_back(0);  // the embedding, or the head's wte copy
  for (int s = p; s < stages(); s += P) {
    const auto [first_block, end_block] = Blocks(s);
    for (int b = first_block; b < end_block; ++b) held.push_back(1 + b);
  }
  if (p == P - 1) held.push_back(static_cast<int>(stage_sizes_.size()) - 1);  // the head
  return held;
}

std::vector<Pipeline::Piece> Pipeline::Pieces(int p) const {
  const int P = dims_.pp;
  std::vector<Piece> pieces;
  Piece rest;
  if (p == 0 || p == P - 1) {
    pieces.push_back({{{0, wte_floats_}}, /*copy=*/p != 0});
    if (p == 0) rest.ranges.push_back({wte_floats_, stage_sizes_[0] - wte_floats_});  // wpe
  }
  for (int st : HeldStages(p)) {
    if (st != 0) AppendRange(&rest.ranges, {stage_flat_[st], stage_sizes_[st]});
  }
  pieces.push_back(std::move(rest));
  return pieces;
}

std::vector<FlatRange> Pipeline::OwnedRanges(int p, int j, bool copy) const {
  std::vector<FlatRange> owned;
  for (const Piece& piece : Pieces(p)) {
    if (piece.copy && !copy) continue;
    for (const FlatRange& range : SplitRanges(piece.ranges, dims_.dp_shard, j)) {
      AppendRange(&owned, range);
    }
  }
  return owned;
}

void Pipeline::Bind() {
  if (part_grads_.empty() && !(sharded() && options_.zero >= 2)) {
    part_grads_.assign(part_floats_, 0.0f);
  }
  for (auto& chunk : chunks_) {
    for (int st : held_) {
      chunk->model->BindStage(st, part_params_.empty() ? nullptr : &part_params_[part_offset_[st]],
                              part_grads_.empty() ? nullptr : &part_grads_[part_offset_[st]]);
    }
  }
}

absl::StatusOr<std::vector<float>> Pipeline::Wte() {
  if (!first() && !last()) return std::vector<float>();
  const bool gather = part_params_.empty();
  if (gather) {
    if (absl::Status gathered = GatherParams(); !gathered.ok()) return gathered;
  }
  std::vector<float> wte(part_params_.begin() + part_offset_[0],
                         part_params_.begin() + part_offset_[0] + wte_floats_);
  if (gather) {
    part_params_.clear();
    part_params_.shrink_to_fit();
    Bind();
  }
  return wte;
}

absl::Status Pipeline::GatherParams() {
  if (part_params_.empty()) {
    part_params_.assign(part_floats_, 0.0f);
    Bind();
  }
  std::vector<std::vector<float>> gathered(pieces_.size());
  std::vector<std::shared_ptr<parallel::Work>> works;
  const int j = dims_.Of(control_.rank()).shard;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const OwnedPiece& piece = pieces_[k];
    gathered[k].resize(Floats(piece.piece.ranges));
    works.push_back(
        groups_.shard->AllGather(absl::MakeConstSpan(&shard_params_[piece.at], piece.counts[j]),
                                 absl::MakeSpan(gathered[k]), piece.counts));
  }
  for (size_t k = 0; k < pieces_.size(); ++k) {
    if (absl::Status status = works[k]->Wait(); !status.ok()) return status;
    ForEachStageRun(stage_flat_, pieces_[k].piece.ranges,
                    [&](int st, size_t in_stage, size_t n, size_t pos) {
                      std::copy_n(&gathered[k][pos], n, &part_params_[part_offset_[st] + in_stage]);
                    });
  }
  return absl::OkStatus();
}

absl::StatusOr<StepLoss> Pipeline::Run(const MicroBatches& batches,
                                       const std::vector<PipelineAction>& actions,
                                       bool forward_only) {
  const int P = dims_.pp, S = stages(), M = batches.count;
  const size_t tokens = static_cast<size_t>(batches.B) * batches.T;
  const size_t floats = tokens * model_->config().dim;
  std::vector<int> inputs(tokens), targets(tokens);
  auto take = [&](Chunk& chunk, int m) -> absl::StatusOr<int> {
    auto found = chunk.of.find(m);
    if (found != chunk.of.end()) return found->second;
    if (chunk.free.empty()) {
      return absl::InternalError(absl::StrCat("pipeline: no activation slot free for micro-batch ",
                                              m, " on stage ", chunk.stage,
                                              " (the schedule holds more than was planned)"));
    }
    const int slot = chunk.free.back();
    chunk.free.pop_back();
    if (absl::Status swept = Sweep(&chunk, /*wait=*/false); !swept.ok()) return swept;
    std::vector<std::shared_ptr<parallel::Work>>& works = chunk.sending[slot];
    if (!works.empty()) {
      // Its sends are still on their way: they keep their buffers.
      Chunk::Sending old{std::vector<float>(floats), std::vector<float>(floats), {}};
      old.act_out.swap(chunk.act_out[slot]);
      old.grad_in.swap(chunk.grad_in[slot]);
      old.works.swap(works);
      chunk.retired.push_back(std::move(old));
    }
    chunk.of[m] = slot;
    return slot;
  };
  // Receives are posted ahead: the next one on each channel as soon as the
  // one before it is taken, into a spare buffer that the receive action
  // then swaps with its slot's, so the transfer overlaps the compute
  // before it. A channel delivers in order, so its next receive is known.
  std::deque<size_t> pending[2];  // per channel (activations, gradients): receive actions
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].type == Type::kRecvActivation) pending[0].push_back(i);
    if (actions[i].type == Type::kRecvGradient) pending[1].push_back(i);
  }
  auto post = [&](int channel) {
    Posted& next = posted_[channel];
    next.work = nullptr;
    if (pending[channel].empty()) return;
    const PipelineAction& action = actions[pending[channel].front()];
    pending[channel].pop_front();
    const bool gradient = channel == 1;
    parallel::ProcessGroup* from = gradient ? groups_.gradients_in : groups_.activations_in;
    next.buffer.resize(chunks_[0]->act_in[0].size());
    next.action = action;
    next.work =
        from->Recv(absl::MakeSpan(next.buffer.data(), floats), 1 - from->rank(),
                   Tag(gradient ? action.stage + 1 : action.stage - 1, action.microbatch, M));
  };
  post(0);
  post(1);
  StepLoss loss;
  int in_flight = 0;
  times_.clear();
  const absl::Time began = absl::Now();
  auto since = [&] { return absl::ToDoubleSeconds(absl::Now() - began); };
  const std::vector<bool> releases = Releases(actions);
  for (size_t index = 0; index < actions.size(); ++index) {
    const PipelineAction& action = actions[index];
    const int m = action.microbatch;
    const bool first_stage = action.stage == 0, last_stage = action.stage == S - 1;
    Chunk& chunk = *chunks_[action.stage / P];
    times_.push_back({action, since(), 0});
    auto slot = take(chunk, m);
    if (!slot.ok()) return slot.status();
    const int s = *slot;
    switch (action.type) {
      case Type::kRecvActivation:
      case Type::kRecvGradient: {
        // Posted ahead on the channel from that neighbour.
        const int channel = action.type == Type::kRecvGradient ? 1 : 0;
        Posted& mine = posted_[channel];
        if (mine.work == nullptr || !(mine.action == action)) {
          return absl::InternalError(absl::StrCat("pipeline: ", parallel::ActionName(action),
                                                  " was not the receive posted on its channel"));
        }
        absl::Status received = mine.work->Wait();
        mine.work = nullptr;
        if (!received.ok()) return received;
        (channel == 1 ? chunk.grad_out[s] : chunk.act_in[s]).swap(mine.buffer);
        post(channel);
        break;
      }
      case Type::kSendActivation:
      case Type::kSendGradient: {
        const bool gradient = action.type == Type::kSendGradient;
        parallel::ProcessGroup* to = gradient ? groups_.gradients_out : groups_.activations_out;
        const std::vector<float>& from = gradient ? chunk.grad_in[s] : chunk.act_out[s];
        chunk.sending[s].push_back(to->Send(absl::MakeConstSpan(from.data(), floats),
                                            1 - to->rank(), Tag(action.stage, m, M)));
        break;
      }
      case Type::kForward: {
        batches.fill(m, inputs.data(), targets.data());
        const float value = chunk.model->PartForward(
            s, inputs.data(), last_stage ? targets.data() : nullptr,
            first_stage ? nullptr : chunk.act_in[s].data(),
            last_stage ? nullptr : chunk.act_out[s].data(), batches.B, batches.T);
        if (last_stage) {
          loss.sum += value;
          ++loss.count;
        }
        peak_in_flight_ = std::max(peak_in_flight_, ++in_flight);
        break;
      }
      case Type::kBackward: {
        chunk.model->PartBackward(s, 1.0f / batches.count,
                                  last_stage ? nullptr : chunk.grad_out[s].data(),
                                  first_stage ? nullptr : chunk.grad_in[s].data());
        --in_flight;
        break;
      }
      case Type::kBackwardInput: {
        // The input's gradient now (sent on at once); the weights' at the
        // matching kBackwardWeight, from what this pass keeps in the slot.
        chunk.model->PartBackwardInput(s, 1.0f / batches.count,
                                       last_stage ? nullptr : chunk.grad_out[s].data(),
                                       first_stage ? nullptr : chunk.grad_in[s].data());
        break;
      }
      case Type::kBackwardWeight: {
        chunk.model->PartBackwardWeight(s);
        --in_flight;
        break;
      }
    }
    if (releases[index]) {
      // Done with the micro-batch on this stage (a send still reading the
      // slot is waited for when it is taken again).
      chunk.free.push_back(s);
      chunk.of.erase(m);
      if (forward_only) --in_flight;
    }
    times_.back().end = since();
  }
  // Every send of the step has finished before the step's reductions.
  for (auto& chunk : chunks_) {
    if (absl::Status swept = Sweep(chunk.get(), /*wait=*/true); !swept.ok()) return swept;
  }
  return loss;
}

absl::Status Pipeline::Sweep(Chunk* chunk, bool wait) {
  // A finished send's error is returned here (a failed receive on the other
  // side fails that rank at once).
  auto done = [wait](std::vector<std::shared_ptr<parallel::Work>>* works) -> absl::Status {
    for (auto& work : *works) {
      if (!wait && !work->Done()) return absl::OkStatus();
    }
    for (auto& work : *works) {
      if (absl::Status sent = work->Wait(); !sent.ok()) return sent;
    }
    works->clear();
    return absl::OkStatus();
  };
  for (size_t slot = 0; slot < chunk->sending.size(); ++slot) {
    // Only slots not in use: a slot in use may still be sending its
    // activation while it waits for its gradient.
    if (!wait && chunk->of.end() != std::find_if(chunk->of.begin(), chunk->of.end(),
                                                 [slot](const std::pair<const int, int>& used) {
                                                   return used.second == static_cast<int>(slot);
                                                 })) {
      continue;
    }
    if (absl::Status status = done(&chunk->sending[slot]); !status.ok()) return status;
  }
  for (auto it = chunk->retired.begin(); it != chunk->retired.end();) {
    if (absl::Status status = done(&it->works); !status.ok()) return status;
    it = it->works.empty() ? chunk->retired.erase(it) : it + 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepLoss> Pipeline::ForwardBackward(GptModel* model, const MicroBatches& batches) {
  auto schedule = parallel::BuildSchedule(
      {options_.schedule, dims_.pp, batches.count, options_.virtual_stages});
  if (!schedule.ok()) return schedule.status();
  if (part_params_.empty()) {  // ZeRO-3: gathered for the step
    if (absl::Status gathered = GatherParams(); !gathered.ok()) return gathered;
  }
  if (part_grads_.empty()) {  // ZeRO-2/3: released since the last step
    part_grads_.assign(part_floats_, 0.0f);
    Bind();
  }
  return Run(batches, (*schedule)[stage()], /*forward_only=*/false);
}

absl::StatusOr<StepLoss> Pipeline::ForwardOnly(GptModel* model, const MicroBatches& batches) {
  // Each micro-batch down the pipeline in turn, through every stage this
  // rank runs: receive, forward, send.
  const int P = dims_.pp, S = stages();
  std::vector<PipelineAction> actions;
  for (int m = 0; m < batches.count; ++m) {
    for (int s = stage(); s < S; s += P) {
      if (s > 0) actions.push_back({Type::kRecvActivation, m, s, (s - 1) % P});
      actions.push_back({Type::kForward, m, s, -1});
      if (s + 1 < S) actions.push_back({Type::kSendActivation, m, s, (s + 1) % P});
    }
  }
  const bool gather = part_params_.empty();  // ZeRO-3 between steps
  if (gather) {
    if (absl::Status gathered = GatherParams(); !gathered.ok()) return gathered;
  }
  auto loss = Run(batches, actions, /*forward_only=*/true);
  if (gather) {
    part_params_.clear();
    part_params_.shrink_to_fit();
    Bind();
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
  std::vector<std::shared_ptr<parallel::Work>> works;
  auto wait_all = [&works]() {
    absl::Status first_error;
    for (auto& work : works) {
      absl::Status status = work->Wait();
      if (!status.ok() && first_error.ok()) first_error = status;
    }
    works.clear();
    return first_error;
  };
  if (!sharded()) {
    if (groups_.replicate == nullptr) return absl::OkStatus();
    ForEachStageRun(
        stage_flat_, ParamRanges(stage(), /*copy=*/true),
        [&](int st, size_t in_stage, size_t n, size_t) {
          works.push_back(groups_.replicate->AllReduce(
              absl::MakeSpan(stages[st].grads + in_stage, n), parallel::ReduceOp::kAvg));
        });
    return wait_all();
  }
  // Each piece's full gradient, packed, reduce-scattered into the owned
  // slice; then the replicas' mean of the slice.
  const int j = dims_.Of(control_.rank()).shard;
  std::vector<std::vector<float>> packed(pieces_.size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const OwnedPiece& piece = pieces_[k];
    packed[k].resize(Floats(piece.piece.ranges));
    ForEachStageRun(stage_flat_, piece.piece.ranges,
                    [&](int st, size_t in_stage, size_t n, size_t pos) {
                      std::copy_n(&part_grads_[part_offset_[st] + in_stage], n, &packed[k][pos]);
                    });
    works.push_back(groups_.shard->ReduceScatter(
        absl::MakeConstSpan(packed[k]), absl::MakeSpan(&shard_grads_[piece.at], piece.counts[j]),
        piece.counts, parallel::ReduceOp::kAvg));
  }
  if (absl::Status reduced = wait_all(); !reduced.ok()) return reduced;
  if (groups_.replicate != nullptr) {
    works.push_back(
        groups_.replicate->AllReduce(absl::MakeSpan(shard_grads_), parallel::ReduceOp::kAvg));
    if (absl::Status reduced = wait_all(); !reduced.ok()) return reduced;
  }
  // Until the next step: ZeRO-2/3 keep no full gradient, ZeRO-3 no full
  // parameters.
  if (options_.zero >= 2) {
    part_grads_.clear();
    part_grads_.shrink_to_fit();
  }
  if (options_.zero == 3) {
    part_params_.clear();
    part_params_.shrink_to_fit();
  }
  Bind();
  return absl::OkStatus();
}

absl::StatusOr<double> Pipeline::GradSumOfSquares(GptModel* model) {
  if (sharded()) {
    // Each slice once: the first replica's, without the wte copy.
    double local = 0.0;
    const parallel::ParallelDims::Coordinates me = dims_.Of(control_.rank());
    for (const OwnedPiece& piece : pieces_) {
      if (piece.piece.copy || me.replicate != 0) continue;
      local += model->ops().SumOfSquares(&shard_grads_[piece.at], piece.counts[me.shard]);
    }
    return control_.SumDouble(local);
  }
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
  // ZeRO-1/2 keep the full parameters: the new slices go round now.
  absl::Status status = absl::OkStatus();
  if (sharded() && options_.zero <= 2) status = GatherParams();
  if (!logged_memory_ && options_.log != nullptr) {
    logged_memory_ = true;
    auto bytes = [](size_t floats) { return static_cast<unsigned long long>(floats) * 4; };
    const std::string owned =
        sharded() ? absl::StrCat(", ", shard_params_.size(), " of them owned") : "";
    std::fprintf(options_.log,
                 "worker: pipeline rank %d (stage %d) memory between steps: params %llu B, grads "
                 "%llu B, moments %llu B (%zu model stages held, %zu floats%s); activations "
                 "%zu B\n",
                 control_.rank(), stage(), bytes(part_params_.size() + shard_params_.size()),
                 bytes(part_grads_.size() + shard_grads_.size()),
                 2 * bytes(optimizer->moment_floats()), held_.size(), part_floats_, owned.c_str(),
                 ActivationBytes());
    std::fflush(options_.log);
  }
  return status;
}

void Pipeline::ZeroGrad(GptModel* model) {
  std::fill(part_grads_.begin(), part_grads_.end(), 0.0f);
}

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
  // Rank p's pipeline stages p, p + P, ... run increasing block ranges.
  for (int s = p; s < stages(); s += P) {
    const auto [first_block, end_block] = Blocks(s);
    for (int b = first_block; b < end_block; ++b) {
      AppendRange(&ranges, {flat[1 + b], stage_sizes_[1 + b]});
    }
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
    if (sharded()) {
      // A shard's replicas hold the same slices: each writes its share.
      const std::vector<FlatRange> state =
          StateRanges(OwnedRanges(at.pp, at.shard, /*copy=*/false), total);
      files.push_back(SplitRanges(state, dims_.dp_replicate, at.replicate));
    } else {
      // The pipelines hold the same stages: each writes its share.
      const std::vector<FlatRange> state = StateRanges(ParamRanges(at.pp, /*copy=*/false), total);
      files.push_back(SplitRanges(state, dims_.dp(), at.dp));
    }
  }
  return files;
}

std::vector<FlatRange> Pipeline::CheckpointLoad(uint64_t total) const {
  if (sharded()) {
    const int j = dims_.Of(control_.rank()).shard;
    return StateRanges(OwnedRanges(stage(), j, /*copy=*/true), total);
  }
  return StateRanges(ParamRanges(stage(), /*copy=*/true), total);
}

absl::Status Pipeline::StateLoaded(GptModel* model) {
  // Loaded straight into the arrays AdamW updates, the wte copy with them;
  // ZeRO-1/2 keep the full parameters, gathered from the loaded slices now
  // (ZeRO-3 gathers before the next step).
  if (sharded() && options_.zero <= 2) return GatherParams();
  return absl::OkStatus();
}

}  // namespace muster::worker
