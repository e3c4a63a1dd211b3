#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muster::parallel {
namespace {

using Type = PipelineAction::Type;

// One compute step of a rank's order, before the communication around it
// is added.
struct Compute {
  bool forward = true;
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
  return {forward, group * P + within % P, chunk * P + rank};
}

std::vector<Compute> ComputeOrder(const ScheduleSpec& spec, int rank) {
  const int P = spec.pp, M = spec.microbatches;
  std::vector<Compute> order;
  if (spec.kind == ScheduleKind::kGpipe) {
    for (int m = 0; m < M; ++m) order.push_back({true, m, rank});
    for (int m = 0; m < M; ++m) order.push_back({false, m, rank});
    return order;
  }
  // 1F1B, plain or interleaved: warm-up forwards, then one forward and one
  // backward in turn, then the remaining backwards.
  const bool interleaved = spec.kind == ScheduleKind::kInterleaved1F1B;
  const int total = interleaved ? M * spec.virtual_stages : M;
  const int warmup = std::min(
      total, interleaved ? 2 * (P - rank - 1) + (spec.virtual_stages - 1) * P : P - rank - 1);
  auto at = [&](int k, bool forward) {
    return interleaved ? Virtual(spec, rank, k, forward) : Compute{forward, k, rank};
  };
  for (int k = 0; k < warmup; ++k) order.push_back(at(k, true));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(at(warmup + k, true));
    order.push_back(at(k, false));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(at(k, false));
  return order;
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
  }
  return "?";
}

absl::StatusOr<ScheduleKind> ParseSchedule(const std::string& name) {
  for (ScheduleKind kind :
       {ScheduleKind::kGpipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    if (name == ScheduleName(kind)) return kind;
  }
  return Invalid("parallel.schedule",
                 absl::StrCat("expected gpipe, 1f1b or interleaved_1f1b, got '", name, "'"));
}

std::string ActionName(const PipelineAction& action) {
  const std::string at = absl::StrCat(action.microbatch, "@s", action.stage);
  switch (action.type) {
    case Type::kForward:
      return absl::StrCat("F", at);
    case Type::kBackward:
      return absl::StrCat("B", at);
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
      if (c.forward) {
        if (c.stage > 0) out.push_back({Type::kRecvActivation, c.microbatch, c.stage, previous});
        out.push_back({Type::kForward, c.microbatch, c.stage, -1});
        if (c.stage + 1 < stages) {
          out.push_back({Type::kSendActivation, c.microbatch, c.stage, next});
        }
      } else {
        if (c.stage + 1 < stages) {
          out.push_back({Type::kRecvGradient, c.microbatch, c.stage, next});
        }
        out.push_back({Type::kBackward, c.microbatch, c.stage, -1});
        if (c.stage > 0) out.push_back({Type::kSendGradient, c.microbatch, c.stage, previous});
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
  }
  return 0;
}

absl::StatusOr<SimulatedSchedule> SimulateSchedule(
    const ScheduleSpec& spec, const std::vector<std::vector<PipelineAction>>& ranks, double forward,
    double backward) {
  const int P = spec.pp, M = spec.microbatches, stages = P * spec.virtual_stages;
  if (static_cast<int>(ranks.size()) != P) {
    return absl::InvalidArgumentError(absl::StrCat(ranks.size(), " lists for ", P, " ranks"));
  }
  SimulatedSchedule result;
  result.busy.assign(P, 0.0);
  result.peak_in_flight.assign(P, 0);
  std::vector<double> clock(P, 0.0);
  std::vector<size_t> next(P, 0);
  std::vector<int> in_flight(P, 0);
  // (microbatch, stage) -> done; (type, microbatch, stage) of a send -> when.
  std::set<std::pair<int, int>> forwarded, backwarded;
  std::map<std::tuple<Type, int, int>, double> sent;
  auto where = [](const PipelineAction& a, int rank) {
    return absl::StrCat("rank ", rank, ": ", ActionName(a));
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int rank = 0; rank < P; ++rank) {
      while (next[rank] < ranks[rank].size()) {
        const PipelineAction& a = ranks[rank][next[rank]];
        if (a.stage < 0 || a.stage >= stages || a.stage % P != rank || a.microbatch < 0 ||
            a.microbatch >= M) {
          return absl::InvalidArgumentError(
              absl::StrCat(where(a, rank), " names a stage or micro-batch not on this rank"));
        }
        const std::pair<int, int> key{a.microbatch, a.stage};
        if (a.type == Type::kRecvActivation || a.type == Type::kRecvGradient) {
          const bool activation = a.type == Type::kRecvActivation;
          const int from = activation ? a.stage - 1 : a.stage + 1;
          if (from < 0 || from >= stages || a.peer != from % P) {
            return absl::InvalidArgumentError(
                absl::StrCat(where(a, rank), " receives from a rank that has no such stage"));
          }
          auto found = sent.find(
              {activation ? Type::kSendActivation : Type::kSendGradient, a.microbatch, from});
          if (found == sent.end()) break;  // blocked: try the other ranks
          clock[rank] = std::max(clock[rank], found->second);
        } else if (a.type == Type::kSendActivation || a.type == Type::kSendGradient) {
          const int to = a.type == Type::kSendActivation ? a.stage + 1 : a.stage - 1;
          if (to < 0 || to >= stages || a.peer != to % P) {
            return absl::InvalidArgumentError(
                absl::StrCat(where(a, rank), " sends to a rank that has no such stage"));
          }
          if (!sent.emplace(std::make_tuple(a.type, a.microbatch, a.stage), clock[rank]).second) {
            return absl::InvalidArgumentError(absl::StrCat(where(a, rank), " is repeated"));
          }
        } else if (a.type == Type::kForward) {
          if (!forwarded.insert(key).second) {
            return absl::InvalidArgumentError(absl::StrCat(where(a, rank), " is repeated"));
          }
          clock[rank] += forward;
          result.busy[rank] += forward;
          result.peak_in_flight[rank] = std::max(result.peak_in_flight[rank], ++in_flight[rank]);
        } else {
          if (forwarded.count(key) == 0) {
            return absl::InvalidArgumentError(
                absl::StrCat(where(a, rank), " comes before its forward"));
          }
          if (!backwarded.insert(key).second) {
            return absl::InvalidArgumentError(absl::StrCat(where(a, rank), " is repeated"));
          }
          clock[rank] += backward;
          result.busy[rank] += backward;
          --in_flight[rank];
        }
        ++next[rank];
        progress = true;
      }
    }
  }
  std::vector<std::string> stuck;
  for (int rank = 0; rank < P; ++rank) {
    if (next[rank] < ranks[rank].size()) stuck.push_back(where(ranks[rank][next[rank]], rank));
  }
  if (!stuck.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("deadlock: ", absl::StrJoin(stuck, "; "), " wait forever"));
  }
  const size_t want = static_cast<size_t>(M) * stages;
  if (forwarded.size() != want || backwarded.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        forwarded.size(), " forwards and ", backwarded.size(), " backwards; every one of the ",
        stages, " stages must run each of the ", M, " micro-batches: ", want, " of each"));
  }
  result.makespan = *std::max_element(clock.begin(), clock.end());
  return result;
}

}  // namespace muster::parallel
