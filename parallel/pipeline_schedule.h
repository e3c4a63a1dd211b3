// Pipeline schedules as data (docs/parallel.md, "Pipeline schedules"): a
// pure function gives each pipeline rank the ordered list of what it does,
// forwards, backwards, sends and receives of micro-batches, and a
// simulator runs those lists against each other to check them (no
// deadlock, every forward before its backward, the in-flight bound) and to
// predict the bubble. The pipeline runtime (planned) executes the lists.
//
// Stages. With P ranks and V virtual stages per rank the model is cut into
// P * V pipeline stages; stage s lives on rank s % P, as chunk s / P of that
// rank (Megatron-LM's interleaved placement). V is 1 except for
// interleaved 1F1B.
//
// Communication. Before a forward of stage s > 0 the rank receives its input
// activation from stage s - 1's rank; after it, it sends its output to
// stage s + 1's. Backwards mirror that with gradients. A receive blocks
// until the matching send was issued; a send never blocks (the runtime
// posts them early and lets them finish in the background). Two actions
// of one rank on one stage and micro-batch never both touch the network.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::parallel {

enum class ScheduleKind { kGpipe, k1F1B, kInterleaved1F1B };

// "gpipe", "1f1b", "interleaved_1f1b" (parallel.schedule's words) and back.
const char* ScheduleName(ScheduleKind kind);
absl::StatusOr<ScheduleKind> ParseSchedule(const std::string& name);

struct PipelineAction {
  enum class Type {
    kForward,
    kBackward,
    kSendActivation,  // to the rank of stage + 1
    kRecvActivation,  // from the rank of stage - 1
    kSendGradient,    // to the rank of stage - 1
    kRecvGradient,    // from the rank of stage + 1
  };
  Type type = Type::kForward;
  int microbatch = 0;
  int stage = 0;  // the pipeline stage computed (for send/recv: the one on this rank)
  int peer = -1;  // the other rank of a send or receive; -1 for compute
  bool operator==(const PipelineAction& other) const {
    return type == other.type && microbatch == other.microbatch && stage == other.stage &&
           peer == other.peer;
  }
};

// "F3@s1", "B0@s2", "sendA2@s0->1", "recvG2@s1<-2": for messages and tests.
std::string ActionName(const PipelineAction& action);

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int pp = 1;              // P: pipeline ranks
  int microbatches = 1;    // M
  int virtual_stages = 1;  // V: stages per rank (interleaved 1F1B only)
};

// Each rank's ordered actions (element r: rank r). INVALID_ARGUMENT naming
// the config field (parallel.pp, parallel.microbatches,
// parallel.virtual_stages) when:
//   P, M or V is below 1;
//   V is not 1 for gpipe or 1f1b, or below 2 for interleaved_1f1b;
//   M < P for 1f1b and interleaved_1f1b (the pipeline never fills: use
//   gpipe, or more micro-batches);
//   M is not a multiple of P for interleaved_1f1b (micro-batches go round
//   the ranks in groups of P, as in Megatron-LM).
absl::StatusOr<std::vector<std::vector<PipelineAction>>> BuildSchedule(const ScheduleSpec& spec);

// The micro-batches a rank may hold activations for at once under `spec`
// (forward done, backward not yet): M for gpipe, P - rank for 1f1b, and
// for interleaved 1f1b Megatron-LM's warm-up depth plus one, in virtual
// micro-batches (one per chunk and micro-batch),
// min(M V, 2 (P - rank - 1) + (V - 1) P + 1).
int InFlightBound(const ScheduleSpec& spec, int rank);

// What running the lists gives, with a forward of one stage taking
// `forward` time units and a backward `backward`, communication free.
struct SimulatedSchedule {
  double makespan = 0;              // when the last rank finishes
  std::vector<double> busy;         // per rank: time computing
  std::vector<int> peak_in_flight;  // per rank: most micro-batch-stages held
  double BubbleFraction(int rank) const { return 1.0 - busy[rank] / makespan; }
};

// Runs the lists, every rank at once. FAILED_PRECONDITION naming the
// stuck actions on a deadlock; INVALID_ARGUMENT for a backward before its
// forward, an action missing or repeated (every stage must run forward and
// backward for every micro-batch exactly once, each on its own rank), or
// a receive whose send has another length of list (it never comes).
absl::StatusOr<SimulatedSchedule> SimulateSchedule(
    const ScheduleSpec& spec, const std::vector<std::vector<PipelineAction>>& ranks,
    double forward = 1.0, double backward = 2.0);

}  // namespace muster::parallel
