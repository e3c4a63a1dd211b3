#include "worker/strategy/pipeline/pipeline.h"

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
  if (dims_.dp_shard > 1) {
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
  if (dims_.dp_shard > 1 && (options_.zero < 1 || options_.zero > 3)) {
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
  PipelineLayout layout;
  for (const Stage& st : model->stages()) layout.stage_sizes.push_back(st.size);
  layout.wte_floats = model->stages()[0].tensors[0].size;  // wte leads stage 0
  for (int p = 0; p < P; ++p) layout.held.push_back(HeldStages(p));
  state_ = std::make_unique<PipelineState>(std::move(layout), dims_, control_.rank(), options_.zero,
                                           g.pipeline, g.shard, g.replicate, &control_);
  ParamShard shard = state_->Init(*model, spec.seed);
  for (auto& chunk : chunks_) state_->AddPart(chunk->model);
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
  if (p == P - 1) held.push_back(1 + model_->config().layers);  // the head
  return held;
}

absl::StatusOr<std::vector<float>> Pipeline::Wte() { return state_->Wte(); }

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
      // Its sends are still on their way: they keep their buffers, and the
      // slot gets new ones of the same (largest micro-batch's) size.
      const size_t size = chunk.act_out[slot].size();
      Chunk::Sending old{std::vector<float>(size), std::vector<float>(size), {}};
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
  if (auto ready = state_->BeforeSchedule(/*backward=*/true); !ready.ok()) return ready.status();
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
  auto gathered = state_->BeforeSchedule(/*backward=*/false);
  if (!gathered.ok()) return gathered.status();
  auto loss = Run(batches, actions, /*forward_only=*/true);
  state_->AfterForwardOnly(*gathered);
  return loss;
}

absl::Status Pipeline::ReduceGradients(GptModel* model) {
  if (groups_.tied != nullptr && (first() || last())) {
    // The tied wte: the encoder's share (first rank) plus the head's (last).
    const size_t wte = model->stages()[0].tensors[0].size;
    absl::Status summed =
        groups_.tied->AllReduce(absl::MakeSpan(state_->grads(0), wte), parallel::ReduceOp::kSum)
            ->Wait();
    if (!summed.ok()) return summed;
  }
  return state_->ReduceGradients();
}

absl::StatusOr<double> Pipeline::GradSumOfSquares(GptModel* model) {
  return state_->GradSumOfSquares(model->ops());
}

absl::Status Pipeline::OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                                     float grad_scale) {
  // The wte copies have the same gradient and moments: the same step.
  optimizer->Step(lr, step, grad_scale);
  absl::Status status = state_->AfterOptimizerStep();
  if (!logged_memory_ && options_.log != nullptr) {
    logged_memory_ = true;
    std::fprintf(options_.log,
                 "worker: pipeline rank %d (stage %d) memory between steps: %s, moments %llu B; "
                 "activations %zu B\n",
                 control_.rank(), stage(), state_->Describe().c_str(),
                 static_cast<unsigned long long>(optimizer->moment_floats()) * 8,
                 ActivationBytes());
    std::fflush(options_.log);
  }
  return status;
}

void Pipeline::ZeroGrad(GptModel* model) { state_->ZeroGrad(); }

std::vector<std::vector<FlatRange>> Pipeline::CheckpointFiles(uint64_t total) const {
  return state_->CheckpointFiles(total);
}

std::vector<FlatRange> Pipeline::CheckpointLoad(uint64_t total) const {
  return state_->CheckpointLoad(total);
}

absl::Status Pipeline::StateLoaded(GptModel* model) {
  // Loaded straight into the arrays AdamW updates, the wte copy with them.
  return state_->StateLoaded();
}

}  // namespace muster::worker
