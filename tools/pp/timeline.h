// The idle time of one pipeline step of tools/bench_pp, from the ranks'
// action times (tools/pp/threads.h).
//
// Busy: a rank's compute actions, Forwards and Backwards, the latter
// whole (B) or split in two passes (zb_h1's Bi and Bw): busy = F + B + Bi
// + Bw. Sends and receives are not work: posting a send takes
// microseconds, and a receive waits for the peer. Span: from the first
// compute's start (a Forward) to the last one's end (a Backward, or
// zb_h1's last Bw) over every rank of the pipeline, on the job's clock: the
// pipeline's makespan, as parallel::SimulateSchedule counts it and as the
// bubble (P-1)/(M+P-1) does. idle = 1 - busy / span, per rank.
//
// Measured three ways:
//   wall        the timeline as it ran.
//   normalized  the same timeline with processor sharing undone: while
//               n > `cores` ranks compute at once, each gets cores/n of a
//               core and its compute stretches by n/cores. The normalized
//               clock runs at min(1, cores/n) of the wall clock (n counting
//               the ranks inside a compute action), which turns the
//               timeline into the one with a core per rank: every compute
//               at full speed, every wait still ending when the action it
//               waits for ends. Equal to the wall clock while n <= cores.
//               Assumes nothing else runs on the machine.
//   replay      each rank's list (the actions of its last_step_times(), in
//               order) run against the others as SimulateSchedule does,
//               communication free, every action taking the CPU time the
//               rank's thread used in it (RankStep::action_cpu_s): the
//               bubble of the measured costs, whatever else loaded the
//               machine, without the time messages take.
// Also: the replay with every Forward of rank r taking r's mean, and every
// B, Bi and Bw the rank's mean of its kind (the bubble of the stages'
// imbalance alone).
#pragma once

#include <vector>

#include "tools/pp/threads.h"

namespace muster::tools {

struct StepIdle {
  // Per rank.
  std::vector<double> idle_wall, idle_normalized, idle_replay, idle_mean_replay;
  std::vector<double> busy_normalized_s;  // compute actions, normalized clock
  std::vector<double> busy_cpu_s;         // the same in CPU time
  // One F, B, Bi, Bw: CPU time, means (0 for a kind the rank never ran:
  // a schedule runs either B or Bi and Bw).
  std::vector<double> forward_cpu_s, backward_cpu_s, backward_input_cpu_s, backward_weight_cpu_s;
  double span_wall_s = 0;
  // Over every rank: one F, B, Bi, Bw, CPU time, means (0 as above).
  double forward_s = 0, backward_s = 0, backward_input_s = 0, backward_weight_s = 0;
  // Rank `rank`'s compute for one micro-batch, F + B + Bi + Bw (means).
  double MicroBatchCpu(int rank) const {
    return forward_cpu_s[rank] + backward_cpu_s[rank] + backward_input_cpu_s[rank] +
           backward_weight_cpu_s[rank];
  }
};

// `ranks`: one step, element r rank r's. REQUIRES: cores >= 1; every rank
// ran at least one Forward and one Backward (whole or split); the lists
// are deadlock-free (they are the ones that ran).
StepIdle MeasureStep(const std::vector<RankStep>& ranks, int cores);

}  // namespace muster::tools
