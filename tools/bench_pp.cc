// bench_pp: what pipeline parallelism (worker/strategy/pipeline/pipeline.h) idles and holds
// on this machine's CPU, GPipe against 1F1B, interleaved 1F1B (V virtual
// stages per rank, --virtual-stages; skipped where M is not a multiple of
// P or the model has fewer than P x V blocks) and zb_h1 (every backward
// split into Bi, the input's gradient, and a deferred Bw, the weights';
// skipped where M < P).
//   1. the bubble: P ranks as threads (tools/pp/threads.h), M
//      micro-batches, each rank's idle fraction of the step from
//      Pipeline::last_step_times() (tools/pp/timeline.h: busy =
//      its F + B + Bi + Bw, span = the pipeline's first compute to its
//      last), median over the timed steps, next to (P-1)/(M+P-1),
//      (P-1)/(VM+P-1) for interleaved (a Forward and Backward there are
//      of one chunk, 1/V of the rank's blocks), or (P-1)/(3M+P-1) for
//      zb_h1 (the paper's, which assumes F = Bi = Bw). On the wall clock;
//      with processor sharing undone (P ranks on fewer cores); and
//      replayed from each action's CPU time (tools/pp/cpu.h), which
//      other load on the machine does not change. zb_h1 also next to
//      SimulateSchedule with its measured mean F, Bi and Bw, the theory
//      for the costs it really has;
//   2. activation memory per rank: each rank's Pipeline::ActivationBytes()
//      (every chunk's slots and scratch) and Pipeline::peak_in_flight(),
//      the slots split from the backward scratch with parts built
//      directly (GptModel::CreatePart with 1 and 2 slots, split_backward
//      for zb_h1; tools/pp/memory.h), interleaved and zb_h1 against
//      1F1B and GPipe.
// Every rank computes with one thread.
//
//   bazel build -c opt //tools:bench_pp && bazel-bin/tools/bench_pp
//       [--pp 2 4] [--microbatches 4 8 16] [--steps 5] [--warmup 1]
//       [--micro-batch 4] [--layers 8] [--virtual-stages 2] [--cores N]
//       [--timeline]
#include <sched.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "parallel/pipeline_schedule.h"
#include "tools/bench_util.h"
#include "tools/pp/memory.h"
#include "tools/pp/threads.h"
#include "tools/pp/timeline.h"
#include "worker/data/data.h"

namespace muster::tools {
namespace {

using parallel::ScheduleKind;

std::string LoadAverage() {
  std::ifstream file("/proc/loadavg");
  std::string one, five, fifteen;
  file >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

// One job of the tables.
struct Job {
  int pp = 0, microbatches = 0;
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int virtual_stages = 1;
  PipelineRun run;
  std::vector<StepIdle> steps;
};

// The bubble table's figures of one job: medians over its steps.
struct Bubble {
  // Per rank.
  std::vector<double> wall, normalized, replay, mean_replay;
  std::vector<double> compute_ms;  // one micro-batch's F + B + Bi + Bw, CPU time
  // CPU time, means over ranks: one F, B, Bi, Bw (B is 0 for zb_h1, which
  // splits every backward; Bi and Bw are 0 for the others).
  double forward_ms = 0, backward_ms = 0, backward_input_ms = 0, backward_weight_ms = 0;
  double span_ms = 0;           // wall
  double cpu_per_busy = 0;      // compute's CPU time / its normalized time, over ranks
  double sampled_per_call = 0;  // every action's sampled CPU time / the call's
  // SimulateSchedule with the mean F and B (Bi = Bw = B/2), or for zb_h1
  // the mean F, Bi and Bw; mean over ranks.
  double simulated = 0;
  // One micro-batch's whole backward: B, or Bi + Bw.
  double WholeBackwardMs() const { return backward_ms + backward_input_ms + backward_weight_ms; }
};

// The communication-free bubble with equal stages: the pipeline fills and
// drains over P - 1 stage-steps, out of M stage-steps of work per rank, or
// V M with V chunks per rank, each 1/V of the rank's blocks. zb_h1 (with F
// = Bi = Bw, the paper's Table 2): the bubble is (P - 1) passes, out of
// 3 M passes of work per rank.
double Theory(const Job& job) {
  if (job.schedule == ScheduleKind::kZeroBubbleH1) {
    return static_cast<double>(job.pp - 1) / (3 * job.microbatches + job.pp - 1);
  }
  const int work = job.microbatches * job.virtual_stages;
  return static_cast<double>(job.pp - 1) / (work + job.pp - 1);
}

// The schedule's column: interleaved_1f1b is too wide for the tables.
std::string Label(const Job& job) {
  if (job.schedule != ScheduleKind::kInterleaved1F1B) return parallel::ScheduleName(job.schedule);
  return "int-V" + std::to_string(job.virtual_stages);
}

double Mean(const std::vector<double>& values) {
  double sum = 0;
  for (double value : values) sum += value;
  return values.empty() ? 0 : sum / values.size();
}

double Sum(const std::vector<double>& values) { return Mean(values) * values.size(); }

absl::StatusOr<Bubble> Summarise(const Job& job) {
  Bubble bubble;
  std::vector<double> forward, backward, backward_input, backward_weight, span, cpu_per_busy,
      sampled_per_call;
  for (size_t s = 0; s < job.steps.size(); ++s) {
    const StepIdle& step = job.steps[s];
    forward.push_back(step.forward_s);
    backward.push_back(step.backward_s);
    backward_input.push_back(step.backward_input_s);
    backward_weight.push_back(step.backward_weight_s);
    span.push_back(step.span_wall_s);
    cpu_per_busy.push_back(Sum(step.busy_cpu_s) / Sum(step.busy_normalized_s));
    double sampled = 0, call = 0;
    for (const RankStep& rank : job.run.steps[s]) {
      sampled += Sum(rank.action_cpu_s);
      call += rank.cpu_s;
    }
    sampled_per_call.push_back(sampled / call);
  }
  for (int rank = 0; rank < job.pp; ++rank) {
    std::vector<double> per_step[5];
    for (const StepIdle& step : job.steps) {
      per_step[0].push_back(step.idle_wall[rank]);
      per_step[1].push_back(step.idle_normalized[rank]);
      per_step[2].push_back(step.idle_replay[rank]);
      per_step[3].push_back(step.idle_mean_replay[rank]);
      per_step[4].push_back(step.MicroBatchCpu(rank));
    }
    bubble.wall.push_back(Median(per_step[0]));
    bubble.normalized.push_back(Median(per_step[1]));
    bubble.replay.push_back(Median(per_step[2]));
    bubble.mean_replay.push_back(Median(per_step[3]));
    bubble.compute_ms.push_back(1e3 * Median(per_step[4]));
  }
  bubble.forward_ms = 1e3 * Median(forward);
  bubble.backward_ms = 1e3 * Median(backward);
  bubble.backward_input_ms = 1e3 * Median(backward_input);
  bubble.backward_weight_ms = 1e3 * Median(backward_weight);
  bubble.span_ms = 1e3 * Median(span);
  bubble.cpu_per_busy = Median(cpu_per_busy);
  bubble.sampled_per_call = Median(sampled_per_call);
  const parallel::ScheduleSpec spec{job.schedule, job.pp, job.microbatches, job.virtual_stages};
  auto lists = parallel::BuildSchedule(spec);
  if (!lists.ok()) return lists.status();
  // A list holds either whole backwards or split ones: the kinds it does
  // not hold have a mean of 0 and go unused.
  const bool split = job.schedule == ScheduleKind::kZeroBubbleH1;
  const parallel::ActionCosts costs{bubble.forward_ms,
                                    split ? bubble.backward_input_ms : bubble.backward_ms / 2,
                                    split ? bubble.backward_weight_ms : bubble.backward_ms / 2};
  auto simulated = parallel::SimulateSchedule(spec, *lists, costs);
  if (!simulated.ok()) return simulated.status();
  std::vector<double> fractions;
  for (int rank = 0; rank < job.pp; ++rank) fractions.push_back(simulated->BubbleFraction(rank));
  bubble.simulated = Mean(fractions);
  return bubble;
}

// "21.3% [19.2, 23.5]": the mean over ranks [the least, the most].
std::string Spread(const std::vector<double>& values) {
  char text[64];
  std::snprintf(text, sizeof(text), "%5.1f%% [%4.1f, %4.1f]", 100 * Mean(values),
                100 * *std::min_element(values.begin(), values.end()),
                100 * *std::max_element(values.begin(), values.end()));
  return text;
}

int PrintBubble(const std::vector<Job>& jobs, int cores, int virtual_stages) {
  std::printf(
      "\nbubble: idle fraction per rank = 1 - (its F + B + Bi + Bw time) / (the pipeline's "
      "first compute to its\nlast); median over steps; mean [least, most] over ranks "
      "(tools/pp/timeline.h).\n  wall: as it ran; normalized: processor sharing undone "
      "for %d cores; replay: the lists run with each\n  action's sampled CPU time, "
      "communication free; imbalance: the replay with each rank's mean F, B, Bi, Bw.\n  int-V%d: "
      "interleaved_1f1b, %d virtual stages per rank, theory (P-1)/(VM+P-1); zb_h1: theory "
      "(P-1)/(3M+P-1)\n  (F = Bi = Bw; B ms is its Bi + Bw); gpipe and 1f1b: (P-1)/(M+P-1).\n",
      cores, virtual_stages, virtual_stages);
  std::printf("  %2s %-6s %3s %7s  %-21s %-21s %-21s %9s %8s %8s %6s %6s %7s %8s  %s\n", "P",
              "sched", "M", "theory", "idle, wall", "idle, normalized", "idle, replay", "imbalance",
              "norm-th", "repl-th", "F ms", "B ms", "step ms", "cpu/busy", "F+B ms per rank");
  int status = 0;
  int normalized_within = 0, replay_within = 0, total = 0, simulated_off = 0;
  // The same for the interleaved jobs alone, and for zb_h1's.
  int interleaved_normalized = 0, interleaved_replay = 0, interleaved_total = 0;
  int zero_bubble_normalized = 0, zero_bubble_replay = 0, zero_bubble_total = 0;
  double sampled_least = 1e9, sampled_most = 0;
  for (const Job& job : jobs) {
    auto bubble = Summarise(job);
    if (!bubble.ok()) {
      std::printf("  %2d %-6s %3d failed: %s\n", job.pp, Label(job).c_str(), job.microbatches,
                  bubble.status().ToString().c_str());
      status = 1;
      continue;
    }
    const double theory = Theory(job);
    const double normalized_off = 100 * (Mean(bubble->normalized) - theory);
    const double replay_off = 100 * (Mean(bubble->replay) - theory);
    ++total;
    normalized_within += std::abs(normalized_off) <= 5;
    replay_within += std::abs(replay_off) <= 5;
    if (job.schedule == ScheduleKind::kInterleaved1F1B) {
      ++interleaved_total;
      interleaved_normalized += std::abs(normalized_off) <= 5;
      interleaved_replay += std::abs(replay_off) <= 5;
    }
    if (job.schedule == ScheduleKind::kZeroBubbleH1) {
      ++zero_bubble_total;
      zero_bubble_normalized += std::abs(normalized_off) <= 5;
      zero_bubble_replay += std::abs(replay_off) <= 5;
    } else {
      // zb_h1's theory holds for F = Bi = Bw only; its own table compares.
      simulated_off += std::abs(bubble->simulated - theory) > 1e-9;
    }
    sampled_least = std::min(sampled_least, bubble->sampled_per_call);
    sampled_most = std::max(sampled_most, bubble->sampled_per_call);
    std::string per_rank;
    for (double ms : bubble->compute_ms) {
      per_rank += (per_rank.empty() ? "" : " ") + std::to_string(static_cast<int>(ms + 0.5));
    }
    std::printf(
        "  %2d %-6s %3d %6.1f%%  %-21s %-21s %-21s %8.1f%% %+6.1fpp %+6.1fpp %6.1f %6.1f %7.0f "
        "%8.2f  %s\n",
        job.pp, Label(job).c_str(), job.microbatches, 100 * theory, Spread(bubble->wall).c_str(),
        Spread(bubble->normalized).c_str(), Spread(bubble->replay).c_str(),
        100 * Mean(bubble->mean_replay), normalized_off, replay_off, bubble->forward_ms,
        bubble->WholeBackwardMs(), bubble->span_ms, bubble->cpu_per_busy, per_rank.c_str());
  }
  std::printf(
      "  F, B, F+B: one micro-batch through one rank's part (int-V: one chunk's; zb_h1: B = Bi + "
      "Bw), CPU time.\n  cpu/busy: the computes' CPU time over their normalized time (below 1: "
      "something else took the CPU,\n  or the normalization does not hold). Sampled CPU time of "
      "the actions over the CPU time of the\n  whole ForwardBackward: %.3f to %.3f. "
      "SimulateSchedule with the mean F, B %s theory for every job\n  but zb_h1's (its "
      "table below).\n",
      sampled_least, sampled_most, simulated_off == 0 ? "gives" : "does NOT give");
  std::printf(
      "  goal: measured bubble (mean over ranks) within 5 percentage points of theory: "
      "normalized %d of %d,\n  replay %d of %d; of which interleaved: normalized %d of %d, replay "
      "%d of %d; zb_h1: normalized %d of %d,\n  replay %d of %d\n",
      normalized_within, total, replay_within, total, interleaved_normalized, interleaved_total,
      interleaved_replay, interleaved_total, zero_bubble_normalized, zero_bubble_total,
      zero_bubble_replay, zero_bubble_total);
  return status;
}

// zb_h1's measured bubble against two predictions: the paper's
// (P-1)/(3M+P-1), which assumes F = Bi = Bw, and SimulateSchedule with the
// F, Bi and Bw it measured (CPU time, means over ranks), which is what its
// lists give with the costs they really have, communication free and the
// stages equal. Next to them, 1F1B's replay of the same (P, M) in this run.
int PrintZeroBubble(const std::vector<Job>& jobs) {
  std::map<std::pair<int, int>, const Job*> one_f;
  for (const Job& job : jobs) {
    if (job.schedule == ScheduleKind::k1F1B) one_f[{job.pp, job.microbatches}] = &job;
  }
  bool header = false;
  int within[2][3] = {{0, 0, 0}, {0, 0, 0}}, total = 0;  // [theory, sim][wall, norm, replay]
  for (const Job& job : jobs) {
    if (job.schedule != ScheduleKind::kZeroBubbleH1) continue;
    auto bubble = Summarise(job);
    if (!bubble.ok()) continue;  // reported in the bubble table
    if (!header) {
      std::printf(
          "\nzb_h1, measured: idle mean over ranks against theory = (P-1)/(3M+P-1) (the paper's, "
          "F = Bi = Bw) and\n  sim = SimulateSchedule with the measured mean F, Bi, Bw (CPU time, "
          "over ranks; communication free);\n  off: measured minus theory / minus sim, pp; 1f1b: "
          "the same (P, M)'s replay in this run (its theory)\n");
      std::printf("  %2s %3s %7s %7s %7s %7s %7s %9s %13s %13s %13s %6s %6s %6s %15s\n", "P", "M",
                  "theory", "sim", "wall", "norm", "replay", "imbalance", "wall off", "norm off",
                  "replay off", "F ms", "Bi ms", "Bw ms", "1f1b replay");
      header = true;
    }
    const double theory = Theory(job);
    const double measured[3] = {Mean(bubble->wall), Mean(bubble->normalized), Mean(bubble->replay)};
    std::string off[3];
    for (int i = 0; i < 3; ++i) {
      const double from_theory = 100 * (measured[i] - theory);
      const double from_sim = 100 * (measured[i] - bubble->simulated);
      within[0][i] += std::abs(from_theory) <= 5;
      within[1][i] += std::abs(from_sim) <= 5;
      char text[32];
      std::snprintf(text, sizeof(text), "%+5.1f/%+5.1f", from_theory, from_sim);
      off[i] = text;
    }
    ++total;
    std::string reference = "-";
    auto found = one_f.find({job.pp, job.microbatches});
    if (found != one_f.end()) {
      auto theirs = Summarise(*found->second);
      if (theirs.ok()) {
        char text[32];
        std::snprintf(text, sizeof(text), "%.1f%% (%.1f%%)", 100 * Mean(theirs->replay),
                      100 * Theory(*found->second));
        reference = text;
      }
    }
    std::printf(
        "  %2d %3d %6.1f%% %6.1f%% %6.1f%% %6.1f%% %6.1f%% %8.1f%% %13s %13s %13s %6.1f %6.1f "
        "%6.1f %15s\n",
        job.pp, job.microbatches, 100 * theory, 100 * bubble->simulated, 100 * measured[0],
        100 * measured[1], 100 * measured[2], 100 * Mean(bubble->mean_replay), off[0].c_str(),
        off[1].c_str(), off[2].c_str(), bubble->forward_ms, bubble->backward_input_ms,
        bubble->backward_weight_ms, reference.c_str());
  }
  if (header) {
    std::printf(
        "  within 5 pp of theory: wall %d, normalized %d, replay %d of %d; of sim: wall %d, "
        "normalized %d,\n  replay %d of %d\n",
        within[0][0], within[0][1], within[0][2], total, within[1][0], within[1][1], within[1][2],
        total);
  }
  return 0;
}

int PrintMemory(const std::vector<Job>& jobs, const worker::TrainConfig& config,
                int virtual_stages) {
  PrintMemoryHeader();
  std::map<std::tuple<int, int, ScheduleKind>, const Job*> by;
  for (const Job& job : jobs) by[{job.pp, job.microbatches, job.schedule}] = &job;
  int status = 0, met = 0, compared = 0;
  for (const Job& job : jobs) {
    if (job.schedule != ScheduleKind::kGpipe) continue;
    auto one_f = by.find({job.pp, job.microbatches, ScheduleKind::k1F1B});
    if (one_f == by.end()) continue;
    status |= PrintMemoryRows(config.model, config.data.micro_batch, job.microbatches, job.run,
                              one_f->second->run, &met, &compared);
  }
  std::printf("  goal: 1F1B's slots at most P/M of GPipe's, per rank: %d of %d\n", met, compared);
  bool header = false;
  int below = 0, interleaved_ranks = 0;
  for (const Job& job : jobs) {
    if (job.schedule != ScheduleKind::kInterleaved1F1B) continue;
    auto gpipe = by.find({job.pp, job.microbatches, ScheduleKind::kGpipe});
    auto one_f = by.find({job.pp, job.microbatches, ScheduleKind::k1F1B});
    if (gpipe == by.end() || one_f == by.end()) continue;
    if (!header) PrintInterleavedMemoryHeader(virtual_stages);
    header = true;
    status |= PrintInterleavedMemoryRows(config.model, config.data.micro_batch, job.microbatches,
                                         job.virtual_stages, gpipe->second->run, one_f->second->run,
                                         job.run, &below, &interleaved_ranks);
  }
  if (header) {
    std::printf("  ranks whose interleaved slots take no more than 1F1B's: %d of %d\n", below,
                interleaved_ranks);
  }
  header = false;
  int zero_bubble_below = 0, zero_bubble_ranks = 0;
  for (const Job& job : jobs) {
    if (job.schedule != ScheduleKind::kZeroBubbleH1) continue;
    auto gpipe = by.find({job.pp, job.microbatches, ScheduleKind::kGpipe});
    auto one_f = by.find({job.pp, job.microbatches, ScheduleKind::k1F1B});
    if (gpipe == by.end() || one_f == by.end()) continue;
    if (!header) PrintZeroBubbleMemoryHeader();
    header = true;
    status |= PrintZeroBubbleMemoryRows(config.model, config.data.micro_batch, job.microbatches,
                                        gpipe->second->run, one_f->second->run, job.run,
                                        &zero_bubble_below, &zero_bubble_ranks);
  }
  if (header) {
    std::printf("  ranks whose zb_h1 slots take no more than 1F1B's: %d of %d\n", zero_bubble_below,
                zero_bubble_ranks);
  }
  return status;
}

// The last timed step, rank by rank: each action's wall start and end (ms
// on the job's clock) and its CPU time.
void PrintTimeline(const std::vector<RankStep>& ranks) {
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const RankStep& step = ranks[rank];
    std::printf("    rank %zu:", rank);
    for (size_t i = 0; i < step.times.size(); ++i) {
      const worker::Pipeline::ActionTime& time = step.times[i];
      std::printf("%s %s %.1f-%.1f (%.1f)", i % 6 == 0 ? "\n     " : ",",
                  parallel::ActionName(time.action).c_str(), 1e3 * (step.began_s + time.start),
                  1e3 * (step.began_s + time.end), 1e3 * step.action_cpu_s[i]);
    }
    std::printf("\n");
  }
}

int CoresOfThisProcess() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

int Main(int argc, char** argv) {
  std::vector<int> pps = {2, 4}, microbatches = {4, 8, 16};
  int steps = 5, warmup = 1, micro_batch = 4, layers = 8, virtual_stages = 2;
  int cores = CoresOfThisProcess();
  bool timeline = false;
  CLI::App app(
      "bench_pp: pipeline bubble and activation memory, GPipe against 1F1B, interleaved 1F1B and "
      "zb_h1");
  app.add_option("--pp", pps, "Pipeline ranks (P), as threads")->capture_default_str();
  app.add_option("--microbatches", microbatches, "Micro-batches per step (M)")
      ->capture_default_str();
  app.add_option("--steps", steps, "Timed steps per job (median)")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--micro-batch", micro_batch, "B per micro-batch")->capture_default_str();
  app.add_option("--layers", layers, "L (at least P; interleaved: at least P x V)")
      ->capture_default_str();
  app.add_option("--virtual-stages", virtual_stages,
                 "V, stages per rank for interleaved_1f1b (below 2: not run)")
      ->capture_default_str();
  app.add_option("--cores", cores, "Cores the ranks share (normalized clock)")
      ->capture_default_str();
  app.add_flag("--timeline", timeline,
               "Print every action of each job's last step: wall start-end ms (CPU ms)");
  CLI11_PARSE(app, argc, argv);

  const std::string dir = MakeTempDir("bench_pp_");
  worker::TrainConfig config;
  config.model = {layers, 4, 256, 256, 128};  // layers, heads, dim, vocab, seq_len
  config.data.train = dir + "/train_*.bin";
  config.data.micro_batch = micro_batch;
  config.device = "cpu";
  if (absl::Status data = WriteRandomTokens(dir + "/train_000.bin", config.model.vocab);
      !data.ok()) {
    std::fprintf(stderr, "bench_pp: %s\n", data.ToString().c_str());
    return 1;
  }
  const worker::ModelConfig& m = config.model;
  std::printf(
      "pipeline on GPT L=%d C=%d NH=%d T=%d V=%d, B=%d per micro-batch; ranks as threads, one "
      "compute thread each,\non %d cores; %d timed steps after %d; load average %s\n",
      m.layers, m.dim, m.heads, m.seq_len, m.vocab, micro_batch, cores, steps, warmup,
      LoadAverage().c_str());
  std::fflush(stdout);
  std::vector<Job> jobs;
  int status = 0;
  for (int pp : pps) {
    for (int M : microbatches) {
      for (ScheduleKind schedule : {ScheduleKind::kGpipe, ScheduleKind::k1F1B,
                                    ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubbleH1}) {
        const bool interleaved = schedule == ScheduleKind::kInterleaved1F1B;
        Job job{pp, M, schedule, interleaved ? virtual_stages : 1};
        if (schedule == ScheduleKind::kZeroBubbleH1 && M < pp) {
          // BuildSchedule refuses it: the pipeline would never fill.
          std::printf("  P %d M %2d %-6s: skipped (M below P)\n", pp, M, Label(job).c_str());
          continue;
        }
        if (interleaved) {
          // What BuildSchedule and PipelineSplit would refuse: said once
          // here rather than as a failure.
          const char* skip = virtual_stages < 2             ? "--virtual-stages below 2"
                             : pp < 2                       ? "one rank"
                             : M < pp || M % pp != 0        ? "M not a multiple of P"
                             : layers < pp * virtual_stages ? "fewer blocks than P x V"
                                                            : nullptr;
          if (skip != nullptr) {
            std::printf("  P %d M %2d %-6s: skipped (%s)\n", pp, M, Label(job).c_str(), skip);
            continue;
          }
        }
        config.data.grad_accumulation = M;
        auto run = RunPipelineJob(config, pp, schedule, job.virtual_stages, warmup, steps);
        if (!run.ok()) {
          std::printf("  P %d M %d %s failed: %s\n", pp, M, Label(job).c_str(),
                      run.status().ToString().c_str());
          status = 1;
          continue;
        }
        job.run = *std::move(run);
        for (const std::vector<RankStep>& step : job.run.steps) {
          job.steps.push_back(MeasureStep(step, cores));
        }
        std::printf("  P %d M %2d %-6s: %.1f s, split", pp, M, Label(job).c_str(), job.run.seconds);
        for (int blocks : job.run.split) std::printf(" %d", blocks);
        std::printf("\n");
        if (timeline) PrintTimeline(job.run.steps.back());
        std::fflush(stdout);
        jobs.push_back(std::move(job));
      }
    }
  }
  status |= PrintBubble(jobs, cores, virtual_stages);
  status |= PrintZeroBubble(jobs);
  status |= PrintMemory(jobs, config, virtual_stages);
  std::printf("\nload average at the end: %s\n", LoadAverage().c_str());
  std::filesystem::remove_all(dir);
  return status;
}

}  // namespace
}  // namespace muster::tools

int main(int argc, char** argv) {
  muster::tools::OneThreadPerRank(argv);
  return muster::tools::Main(argc, argv);
}
