#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muster::parallel {
namespace {

using Type = PipelineAction::Type;

// One compute step of a rank's order (kForward, kBackward,
// kBackwardInput or kBackwardWeight), before the communication around it
// is added.
struct Compute {
  Type type = Type::kForward;
  int microbatch = 0;
  int stage = 0;
};

// Megatron-LM's order of virtual micro-batches on rank `rank`: index k
// walks groups of P micro-batches through every chunk (forward: chunk 0
// first; backward: the last chunk first).
Compute Virtual(const ScheduleSpec& spec, int rank, int k, bool forward) {
  const int P = spec.pp, V = spec.virtual_stages;
  const int group = k / (P * V), within = k % (P * V);
  int chunk = within / P;
  if (!forward) chunk = V - 1 - chunk;
  return {forward ? Type::kForward : Type::kBackward, group * P + within % P, chunk * P + rank};
}

// ZB-H1 from 1F1B's order (the header): each B becomes a Bi, and the Bw of
// micro-batch j follows the Bi of j + rank, so rank r defers its weight
// gradients by r backwards, into the time 1F1B leaves idle at its end;
// the last r close the list.
std::vector<Compute> SplitBackwards(const std::vector<Compute>& order, int microbatches, int rank) {
  std::vector<Compute> split;
  for (const Compute& c : order) {
    if (c.type != Type::kBackward) {
      split.push_back(c);
      continue;
    }
    split.push_back({Type::kBackwardInput, c.microbatch, c.stage});
    if (c.microbatch >= rank) {
      split.push_back({Type::kBackwardWeight, c.microbatch - rank, c.stage});
    }
  }
  for (int m = std::max(0, microbatches - rank); m < microbatches; ++m) {
    split.push_back({Type::kBackwardWeight, m, rank});
  }
  return split;
}

std::vector<Compute> ComputeOrder(const ScheduleSpec& spec, int rank) {
  const int P = spec.pp, M = spec.microbatches;
  std::vector<Compute> order;
  if (spec.kind == ScheduleKind::kGpipe) {
    for (int m = 0; m < M; ++m) order.push_back({Type::kForward, m, rank});
    for (int m = 0; m < M; ++m) order.push_back({Type::kBackward, m, rank});
    return order;
  }
  // 1F1B, plain or interleaved: warm-up forwards, then one forward and one
  // backward in turn, then the remaining backwards.
  const bool interleaved = spec.kind == ScheduleKind::kInterleaved1F1B;
  const int total = interleaved ? M * spec.virtual_stages : M;
  const int warmup = std::min(
      total, interleaved ? 2 * (P - rank - 1) + (spec.virtual_stages - 1) * P : P - rank - 1);
  auto at = [&](int k, bool forward) {
    return interleaved ? Virtual(spec, rank, k, forward)
                       : Compute{forward ? Type::kForward : Type::kBackward, k, rank};
  };
  for (int k = 0; k < warmup; ++k) order.push_back(at(k, true));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(at(warmup + k, true));
    order.push_back(at(k, false));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(at(k, false));
  if (spec.kind == ScheduleKind::kZeroBubbleH1) return SplitBackwards(order, M, rank);
  return order;
}

// A channel (the header's "Channel order"): whether it carries gradients,
// the sending rank and the receiving rank.
using Channel = std::tuple<bool, int, int>;

bool IsSend(const PipelineAction& a) {
  return a.type == Type::kSendActivation || a.type == Type::kSendGradient;
}
bool IsRecv(const PipelineAction& a) {
  return a.type == Type::kRecvActivation || a.type == Type::kRecvGradient;
}
bool CarriesGradient(const PipelineAction& a) {
  return a.type == Type::kSendGradient || a.type == Type::kRecvGradient;
}

// The stage on the other end of a send or receive: activations flow to
// higher stages, gradients to lower ones.
int PeerStage(const PipelineAction& a) {
  const bool towards_higher = a.type == Type::kSendActivation || a.type == Type::kRecvGradient;
  return towards_higher ? a.stage + 1 : a.stage - 1;
}

std::string Where(const PipelineAction& a, int rank) {
  return absl::StrCat("rank ", rank, ": ", ActionName(a));
}

// Every receive is its channel's next message in the sender's list order,
// and every send is received. Checked on the lists rather than while
// simulating: when a receive runs depends on the timing, but which message
// it gets on the runtime's channel is fixed by the order the sender queued
// them, so a mismatch is a deadlock (or a wrong message) whatever the
// timing. Assumes every action passed the checks on stages and peers.
absl::Status CheckChannelOrder(const std::vector<std::vector<PipelineAction>>& ranks) {
  struct Sent {
    const PipelineAction* action;
    int rank;
  };
  std::map<Channel, std::vector<Sent>> sends;
  for (int rank = 0; rank < static_cast<int>(ranks.size()); ++rank) {
    for (const PipelineAction& a : ranks[rank]) {
      if (IsSend(a)) sends[{CarriesGradient(a), rank, a.peer}].push_back({&a, rank});
    }
  }
  std::map<Channel, size_t> received;
  for (int rank = 0; rank < static_cast<int>(ranks.size()); ++rank) {
    for (const PipelineAction& a : ranks[rank]) {
      if (!IsRecv(a)) continue;
      const Channel channel{CarriesGradient(a), a.peer, rank};
      const std::vector<Sent>& queue = sends[channel];
      size_t& next = received[channel];
      if (next == queue.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(Where(a, rank), " is never sent: rank ", a.peer, " sends ", queue.size(),
                         " messages on the channel, all received before it"));
      }
      const PipelineAction& expected = *queue[next].action;
      if (expected.microbatch != a.microbatch || expected.stage != PeerStage(a)) {
        return absl::InvalidArgumentError(absl::StrCat(
            Where(a, rank), " out of channel order: the channel's next message is rank ", a.peer,
            "'s ", ActionName(expected)));
      }
      ++next;
    }
  }
  for (const auto& [channel, queue] : sends) {
    const size_t taken = received[channel];
    if (taken < queue.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(*queue[taken].action, queue[taken].rank), " is never received: rank ",
                       std::get<2>(channel), " receives ", taken, " messages on the channel"));
    }
  }
  return absl::OkStatus();
}

absl::Status Invalid(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

}  // namespace

const char* ScheduleName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved_1f1b";
    case ScheduleKind::kZeroBubbleH1:
      return "zb_h1";
  }
  return "?";
}

absl::StatusOr<ScheduleKind> ParseSchedule(const std::string& name) {
  for (ScheduleKind kind : {ScheduleKind::kGpipe, ScheduleKind::k1F1B,
                            ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubbleH1}) {
    if (name == ScheduleName(kind)) return kind;
  }
  return Invalid("parallel.schedule",
                 absl::StrCat("expected gpipe, 1f1b, interleaved_1f1b or zb_h1, got '", name, "'"));
}

std::string ActionName(const PipelineAction& action) {
  const std::string at = absl::StrCat(action.microbatch, "@s", action.stage);
  switch (action.type) {
    case Type::kForward:
      return absl::StrCat("F", at);
    case Type::kBackward:
      return absl::StrCat("B", at);
    case Type::kBackwardInput:
      return absl::StrCat("Bi", at);
    case Type::kBackwardWeight:
      return absl::StrCat("Bw", at);
    case Type::kSendActivation:
      return absl::StrCat("sendA", at, "->", action.peer);
    case Type::kRecvActivation:
      return absl::StrCat("recvA", at, "<-", action.peer);
    case Type::kSendGradient:
      return absl::StrCat("sendG", at, "->", action.peer);
    case Type::kRecvGradient:
      return absl::StrCat("recvG", at, "<-", action.peer);
  }
  return "?";
}

absl::StatusOr<std::vector<std::vector<PipelineAction>>> BuildSchedule(const ScheduleSpec& spec) {
  const int P = spec.pp, M = spec.microbatches, V = spec.virtual_stages;
  if (P < 1) return Invalid("parallel.pp", absl::StrCat("must be >= 1, got ", P));
  if (M < 1) return Invalid("parallel.microbatches", absl::StrCat("must be >= 1, got ", M));
  const char* name = ScheduleName(spec.kind);
  if (spec.kind == ScheduleKind::kInterleaved1F1B) {
    if (V < 2) {
      return Invalid("parallel.virtual_stages",
                     absl::StrCat(V, " with interleaved_1f1b, which needs 2 or more per rank"));
    }
    if (P < 2) return Invalid("parallel.pp", "interleaved_1f1b needs 2 or more pipeline ranks");
    if (M % P != 0) {
      return Invalid(
          "parallel.microbatches",
          absl::StrCat(M, " is not a multiple of parallel.pp (", P,
                       "): interleaved_1f1b sends micro-batches round in groups of ", P));
    }
  } else if (V != 1) {
    return Invalid("parallel.virtual_stages",
                   absl::StrCat(V, " with ", name, ", which runs one stage per rank: 1"));
  }
  if (spec.kind != ScheduleKind::kGpipe && M < P) {
    return Invalid("parallel.microbatches",
                   absl::StrCat(M, " is fewer than parallel.pp (", P, "): ", name,
                                " never fills the pipeline; use gpipe or more micro-batches"));
  }
  const int stages = P * V;
  std::vector<std::vector<PipelineAction>> ranks(P);
  for (int rank = 0; rank < P; ++rank) {
    std::vector<PipelineAction>& out = ranks[rank];
    for (const Compute& c : ComputeOrder(spec, rank)) {
      const int previous = (c.stage + stages - 1) % P, next = (c.stage + 1) % P;
      const bool first = c.stage == 0, last = c.stage + 1 == stages;
      switch (c.type) {
        case Type::kForward:
          if (!first) out.push_back({Type::kRecvActivation, c.microbatch, c.stage, previous});
          out.push_back({Type::kForward, c.microbatch, c.stage, -1});
          if (!last) out.push_back({Type::kSendActivation, c.microbatch, c.stage, next});
          break;
        case Type::kBackward:
        case Type::kBackwardInput:
          // Both produce the input's gradient, which the previous stage waits for.
          if (!last) out.push_back({Type::kRecvGradient, c.microbatch, c.stage, next});
          out.push_back({c.type, c.microbatch, c.stage, -1});
          if (!first) out.push_back({Type::kSendGradient, c.microbatch, c.stage, previous});
          break;
        default:  // kBackwardWeight: local, nothing to send or receive
          out.push_back({c.type, c.microbatch, c.stage, -1});
          break;
      }
    }
  }
  return ranks;
}

int InFlightBound(const ScheduleSpec& spec, int rank) {
  const int P = spec.pp, M = spec.microbatches, V = spec.virtual_stages;
  switch (spec.kind) {
    case ScheduleKind::kGpipe:
      return M;
    case ScheduleKind::k1F1B:
      return std::min(M, P - rank);
    case ScheduleKind::kInterleaved1F1B:
      return std::min(M * V, 2 * (P - rank - 1) + (V - 1) * P + 1);
    case ScheduleKind::kZeroBubbleH1:
      // Rank r's P - r - 1 warm-up forwards, and r more before its first
      // Bw, which follows the Bi of micro-batch r: P on every rank.
      return std::min(M, P);
  }
  return 0;
}

absl::StatusOr<SimulatedSchedule> SimulateSchedule(
    const ScheduleSpec& spec, const std::vector<std::vector<PipelineAction>>& ranks, double forward,
    double backward) {
  return SimulateSchedule(spec, ranks, ActionCosts{forward, backward / 2, backward / 2});
}

absl::StatusOr<SimulatedSchedule> SimulateSchedule(
    const ScheduleSpec& spec, const std::vector<std::vector<PipelineAction>>& ranks,
    const ActionCosts& costs) {
  const int P = spec.pp, M = spec.microbatches, stages = P * spec.virtual_stages;
  if (static_cast<int>(ranks.size()) != P) {
    return absl::InvalidArgumentError(absl::StrCat(ranks.size(), " lists for ", P, " ranks"));
  }
  // Every action on a stage of its rank, every message between neighbours,
  // before the channel check relies on both.
  for (int rank = 0; rank < P; ++rank) {
    for (const PipelineAction& a : ranks[rank]) {
      if (a.stage < 0 || a.stage >= stages || a.stage % P != rank || a.microbatch < 0 ||
          a.microbatch >= M) {
        return absl::InvalidArgumentError(
            absl::StrCat(Where(a, rank), " names a stage or micro-batch not on this rank"));
      }
      if (IsSend(a) || IsRecv(a)) {
        const int other = PeerStage(a);
        if (other < 0 || other >= stages || a.peer != other % P) {
          return absl::InvalidArgumentError(absl::StrCat(Where(a, rank),
                                                         IsSend(a) ? " sends to" : " receives from",
                                                         " a rank that has no such stage"));
        }
      }
    }
  }
  if (absl::Status order = CheckChannelOrder(ranks); !order.ok()) return order;

  SimulatedSchedule result;
  result.busy.assign(P, 0.0);
  result.peak_in_flight.assign(P, 0);
  result.peak_before_input_gradient.assign(P, 0);
  std::vector<double> clock(P, 0.0);
  std::vector<size_t> next(P, 0);
  std::vector<int> in_flight(P, 0), before_input_gradient(P, 0);
  // What each (microbatch, stage) has done, as bits; when each message was
  // sent, by (gradient?, microbatch, sending stage).
  enum Done { kF = 1, kWhole = 2, kInput = 4, kWeight = 8, kGotActivation = 16, kGotGradient = 32 };
  std::map<std::pair<int, int>, int> done;
  std::map<std::tuple<bool, int, int>, double> sent;
  auto needs = [](const PipelineAction& a, int rank, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(Where(a, rank), " comes before ", what));
  };
  auto repeated = [](const PipelineAction& a, int rank) {
    return absl::InvalidArgumentError(absl::StrCat(Where(a, rank), " is repeated"));
  };
  auto mixed = [](const PipelineAction& a, int rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(a, rank), " mixes a whole backward with Bi and Bw"));
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int rank = 0; rank < P; ++rank) {
      while (next[rank] < ranks[rank].size()) {
        const PipelineAction& a = ranks[rank][next[rank]];
        int& state = done[{a.microbatch, a.stage}];
        const bool first = a.stage == 0, last = a.stage + 1 == stages;
        double cost = 0;
        bool blocked = false;
        switch (a.type) {
          case Type::kRecvActivation:
          case Type::kRecvGradient: {
            const bool gradient = a.type == Type::kRecvGradient;
            auto found = sent.find({gradient, a.microbatch, PeerStage(a)});
            if (found == sent.end()) {
              blocked = true;  // try the other ranks
              break;
            }
            clock[rank] = std::max(clock[rank], found->second);
            state |= gradient ? kGotGradient : kGotActivation;
            break;
          }
          case Type::kSendActivation:
          case Type::kSendGradient: {
            const bool gradient = a.type == Type::kSendGradient;
            if (!gradient && !(state & kF)) return needs(a, rank, "its forward");
            if (gradient && !(state & (kWhole | kInput))) {
              return needs(a, rank, "the backward (B or Bi) that computes it");
            }
            if (!sent.emplace(std::make_tuple(gradient, a.microbatch, a.stage), clock[rank])
                     .second) {
              return repeated(a, rank);
            }
            break;
          }
          case Type::kForward:
            if (state & kF) return repeated(a, rank);
            if (!first && !(state & kGotActivation)) return needs(a, rank, "its input activation");
            state |= kF;
            cost = costs.forward;
            result.peak_in_flight[rank] = std::max(result.peak_in_flight[rank], ++in_flight[rank]);
            result.peak_before_input_gradient[rank] =
                std::max(result.peak_before_input_gradient[rank], ++before_input_gradient[rank]);
            break;
          case Type::kBackward:
          case Type::kBackwardInput:
            if (!(state & kF)) return needs(a, rank, "its forward");
            if (!last && !(state & kGotGradient)) return needs(a, rank, "its output's gradient");
            if (state & (a.type == Type::kBackward ? kWhole : kInput)) return repeated(a, rank);
            if (state & (kWhole | kInput | kWeight)) return mixed(a, rank);
            state |= a.type == Type::kBackward ? kWhole : kInput;
            --before_input_gradient[rank];
            if (a.type == Type::kBackward) {
              cost = costs.backward_input + costs.backward_weight;
              --in_flight[rank];
            } else {
              cost = costs.backward_input;
            }
            break;
          case Type::kBackwardWeight:
            if (state & kWeight) return repeated(a, rank);
            if (state & kWhole) return mixed(a, rank);
            if (!(state & kInput)) return needs(a, rank, "its Bi");
            state |= kWeight;
            cost = costs.backward_weight;
            --in_flight[rank];
            break;
        }
        if (blocked) break;
        clock[rank] += cost;
        result.busy[rank] += cost;
        ++next[rank];
        progress = true;
      }
    }
  }
  std::vector<std::string> stuck;
  for (int rank = 0; rank < P; ++rank) {
    if (next[rank] < ranks[rank].size()) stuck.push_back(Where(ranks[rank][next[rank]], rank));
  }
  if (!stuck.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("deadlock: ", absl::StrJoin(stuck, "; "), " wait forever"));
  }
  size_t forwards = 0, backwards = 0;
  for (const auto& [key, state] : done) {
    forwards += (state & kF) ? 1 : 0;
    backwards += (state & kWhole) || ((state & kInput) && (state & kWeight)) ? 1 : 0;
  }
  const size_t want = static_cast<size_t>(M) * stages;
  if (forwards != want || backwards != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        forwards, " forwards and ", backwards, " backwards (B, or Bi and Bw); every one of the ",
        stages, " stages must run each of the ", M, " micro-batches: ", want, " of each"));
  }
  result.makespan = *std::max_element(clock.begin(), clock.end());
  return result;
}

}  // namespace muster::parallel
