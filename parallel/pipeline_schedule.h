// Pipeline schedules as data (docs/parallel.md, "Pipeline schedules"): a
// pure function gives each pipeline rank the ordered list of what it does,
// forwards, backwards, sends and receives of micro-batches, and a
// simulator runs those lists against each other to check them (no
// deadlock, channel order, every forward before its backward, the
// in-flight bound) and to predict the bubble. The pipeline runtime
// (worker/strategy/pipeline/pipeline.h) executes the lists.
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
// Channel order. The runtime carries messages over channels, one process
// group per message type (activation or gradient), sending rank and
// receiving rank; with interleaving, activations also go from rank P - 1
// to rank 0 and gradients from rank 0 to rank P - 1. A group runs its
// operations one at a time and a send completes only when the receiver
// posts the matching receive, so a receiver that waits for a message the
// sender has queued behind another deadlocks both. Hence the rule: on each
// channel, the receiver's list receives the messages in exactly the order
// the sender's list sends them (and receives every one). The simulator
// checks that on the lists themselves, before running them, since the
// order is fixed by the lists and not by when a receive happens to run.
//
// Split backward (zero bubble). A backward may run whole (B) or as two
// parts: Bi, the gradient with respect to the stage's input, which the
// previous stage waits for (the gradient send follows it), and Bw, the
// gradient with respect to the stage's weights, which nothing downstream
// waits for and so may be deferred. Bw still needs the activations F kept,
// so a micro-batch stays in flight from its F until its Bw (or B).
//
// ZB-H1 (Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism",
// arXiv:2401.10241: section 2.1, Figure 3 top, Table 2). Rank r runs 1F1B's
// order of forwards and backwards, P - r - 1 warm-up forwards and then one
// forward and one backward in turn, with every backward split: Bi takes
// B's place, and the Bw of micro-batch j goes right after the Bi of
// micro-batch j + r; the last r Bw passes close the list. The later ranks,
// which 1F1B leaves idle at the end, thus defer their Bw passes into what
// would be the cool-down bubble, and every rank's Bi comes earlier, since
// a Bi waits only for the next stage's Bi. With F, Bi and Bw equally long
// the bubble is (P - 1)(F + Bi - Bw), a third of 1F1B's (P - 1)(F + Bi + Bw)
// (the paper's Table 2; with Bw <= F <= Bi it stays within that bound).
// Every rank then holds up to P micro-batches from F to Bw (the paper: "all
// workers maintain the same number of in-flight microbatches"), but rank r
// only P - r of them from F to Bi; between Bi and Bw a micro-batch needs
// only what Bw reads, less than B does, so the peak is rank 0's, as in
// 1F1B. (worker/strategy/pipeline/pipeline.h's runtime keeps what Bw reads
// in activations Bi is done with, so a slot is the size of a 1F1B slot.)
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::parallel {

enum class ScheduleKind { kGpipe, k1F1B, kInterleaved1F1B, kZeroBubbleH1 };

// "gpipe", "1f1b", "interleaved_1f1b", "zb_h1" (parallel.schedule's words)
// and back.
const char* ScheduleName(ScheduleKind kind);
absl::StatusOr<ScheduleKind> ParseSchedule(const std::string& name);

struct PipelineAction {
  enum class Type {
    kForward,
    kBackward,        // the whole backward: input and weight gradients at once
    kSendActivation,  // to the rank of stage + 1
    kRecvActivation,  // from the rank of stage - 1
    kSendGradient,    // to the rank of stage - 1
    kRecvGradient,    // from the rank of stage + 1
    kBackwardInput,   // Bi: the gradient of the stage's input (sent on after it)
    kBackwardWeight,  // Bw: the gradient of the stage's weights (after its Bi)
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

// "F3@s1", "B0@s2", "Bi0@s2", "Bw0@s2", "sendA2@s0->1", "recvG2@s1<-2": for
// messages and tests.
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
//   V is not 1 for gpipe, 1f1b or zb_h1, or below 2 for interleaved_1f1b;
//   M < P for 1f1b, interleaved_1f1b and zb_h1 (the pipeline never fills:
//   use gpipe, or more micro-batches);
//   M is not a multiple of P for interleaved_1f1b (micro-batches go round
//   the ranks in groups of P, as in Megatron-LM).
absl::StatusOr<std::vector<std::vector<PipelineAction>>> BuildSchedule(const ScheduleSpec& spec);

// The micro-batches a rank may hold activations for at once under `spec`
// (forward done, backward, or Bw, not yet): M for gpipe, P - rank for
// 1f1b, min(M, P) on every rank for zb_h1 (its later ranks defer Bw, see
// above), and for interleaved 1f1b Megatron-LM's warm-up depth plus one,
// in virtual micro-batches (one per chunk and micro-batch),
// min(M V, 2 (P - rank - 1) + (V - 1) P + 1).
int InFlightBound(const ScheduleSpec& spec, int rank);

// Time units per action of one stage; communication is free. A whole
// backward (B) takes backward_input + backward_weight.
struct ActionCosts {
  double forward = 1.0;
  double backward_input = 1.0;   // Bi
  double backward_weight = 1.0;  // Bw
};

// What running the lists gives.
struct SimulatedSchedule {
  double makespan = 0;              // when the last rank finishes
  std::vector<double> busy;         // per rank: time computing
  std::vector<int> peak_in_flight;  // per rank: most micro-batch-stages held, F to B or Bw
  // Per rank: most micro-batch-stages held from F to B or Bi, when all of
  // the forward's activations are still needed (for 1F1B schedules, the
  // same as peak_in_flight).
  std::vector<int> peak_before_input_gradient;
  double BubbleFraction(int rank) const { return 1.0 - busy[rank] / makespan; }
};

// Runs the lists, every rank at once. First, INVALID_ARGUMENT for an
// action on a stage or micro-batch not of its rank, or a message to or
// from a rank without the neighbouring stage; then for a channel out of
// order (see "Channel order" above): a receive that is not its channel's
// next message, naming what it should receive, a receive never sent, or a
// send never received. While running, FAILED_PRECONDITION naming the
// stuck actions on a deadlock; INVALID_ARGUMENT for an action before what
// it needs (B or Bi before its F or its received gradient, Bw before its
// Bi, F before its received activation, a send before the F, B or Bi that
// computes it), or an action missing or repeated (every stage must run,
// for every micro-batch exactly once, F, and either one B or one Bi and
// one Bw, each on its own rank).
absl::StatusOr<SimulatedSchedule> SimulateSchedule(
    const ScheduleSpec& spec, const std::vector<std::vector<PipelineAction>>& ranks,
    const ActionCosts& costs);

// The same with a forward taking `forward` and a backward `backward`: a
// whole one, or Bi and Bw half of it each.
absl::StatusOr<SimulatedSchedule> SimulateSchedule(
    const ScheduleSpec& spec, const std::vector<std::vector<PipelineAction>>& ranks,
    double forward = 1.0, double backward = 2.0);

}  // namespace muster::parallel
