#include "tools/fsdp/threads.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "parallel/forwarding_group.h"
#include "parallel/local_ranks.h"
#include "parallel/parallel_dims.h"
#include "parallel/process_group.h"
#include "rendezvous/client/store.h"
#include "tools/bench_util.h"
#include "worker/strategy/ddp/ddp.h"
#include "worker/strategy/fsdp/fsdp.h"
#include "worker/trainer/trainer.h"

namespace muster::tools {
namespace {

using Clock = std::chrono::steady_clock;

// One collective as Fsdp issued it: enough to issue it again.
struct Collective {
  bool gather = false;  // AllGather; else ReduceScatter (mean)
  std::vector<size_t> counts;
  bool bf16 = false;  // AllGatherBf16: 2-byte elements
};

// When one rank issued a collective of a timed step and waited for it (the
// first Wait; a collective never waited for has waited == false). Ranks are
// threads of this process, so their steady_clock times compare.
struct Timing {
  int step = 0;
  Clock::time_point issued, wait_start, wait_end;
  bool waited = false;
};

// A Work that notes its first Wait's start and end into `timing`. Only the
// training thread waits on Fsdp's works.
class TimedWork final : public parallel::Work {
 public:
  TimedWork(std::shared_ptr<parallel::Work> inner, Timing* timing)
      : inner_(std::move(inner)), timing_(timing) {}
  absl::Status Wait() override {
    const Clock::time_point start = Clock::now();
    absl::Status status = inner_->Wait();
    if (!timing_->waited) {
      timing_->waited = true;
      timing_->wait_start = start;
      timing_->wait_end = Clock::now();
    }
    return status;
  }
  bool Done() const override { return inner_->Done(); }

 private:
  std::shared_ptr<parallel::Work> inner_;
  Timing* const timing_;
};

// A ProcessGroup that passes everything to `inner` and, while recording,
// notes each AllGather and ReduceScatter; while timing step `step` (>= 0),
// also when each of those and each AllReduce (DDP's buckets) is issued and
// waited for. Only the training thread issues, so the lists need no lock.
class RecordingGroup final : public parallel::ForwardingGroup {
 public:
  explicit RecordingGroup(parallel::ProcessGroup* inner) : ForwardingGroup(inner) {}

  void set_recording(bool on) { recording_ = on; }
  void set_timing_step(int step) { timing_step_ = step; }
  const std::vector<Collective>& recorded() const { return recorded_; }
  const std::deque<Timing>& timings() const { return timings_; }

  std::shared_ptr<parallel::Work> ReduceScatter(absl::Span<const float> input,
                                                absl::Span<float> output,
                                                std::vector<size_t> counts,
                                                parallel::ReduceOp op) override {
    if (recording_) recorded_.push_back({false, counts});
    return Timed(inner().ReduceScatter(input, output, counts, op));
  }
  std::shared_ptr<parallel::Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                            std::vector<size_t> counts) override {
    if (recording_) recorded_.push_back({true, counts});
    return Timed(inner().AllGather(input, output, counts));
  }
  std::shared_ptr<parallel::Work> AllGatherBf16(absl::Span<const uint16_t> input,
                                                absl::Span<uint16_t> output,
                                                std::vector<size_t> counts) override {
    if (recording_) recorded_.push_back({true, counts, true});
    return Timed(inner().AllGatherBf16(input, output, counts));
  }
  // Timed, not recorded: DDP's waits are measured, not replayed.
  std::shared_ptr<parallel::Work> AllReduce(absl::Span<float> data,
                                            parallel::ReduceOp op) override {
    return Timed(inner().AllReduce(data, op));
  }

 private:
  std::shared_ptr<parallel::Work> Timed(std::shared_ptr<parallel::Work> work) {
    if (timing_step_ < 0) return work;
    Timing& timing = timings_.emplace_back();
    timing.step = timing_step_;
    timing.issued = Clock::now();
    return std::make_shared<TimedWork>(std::move(work), &timing);
  }

  bool recording_ = false;
  int timing_step_ = -1;
  std::vector<Collective> recorded_;
  std::deque<Timing> timings_;  // stable addresses for the TimedWorks
};

struct RankSamples {
  double elapsed_ms = 0;             // the timed steps
  std::vector<double> exposed_ms;    // per timed step
  std::vector<double> alone_ms;      // per replay
  worker::FsdpWaits waits_per_step;  // of the last timed step
  std::vector<Collective> replayed;
  std::vector<Timing> timings;  // of the timed steps, in issue order
};

// Issues `collectives` back to back on `group` and waits for all of them,
// `rounds` times after a barrier each; the times of the issue-to-done.
absl::Status Replay(parallel::ProcessGroup* group, const std::vector<Collective>& collectives,
                    int rounds, std::vector<double>* times_ms) {
  // Separate buffers: the operations are in flight together (bf16
  // gathers use the 16-bit ones, the others the floats).
  std::vector<std::vector<float>> inputs, outputs;
  std::vector<std::vector<uint16_t>> inputs16, outputs16;
  for (const Collective& collective : collectives) {
    const size_t total =
        std::accumulate(collective.counts.begin(), collective.counts.end(), static_cast<size_t>(0));
    const size_t mine = collective.counts[group->rank()];
    const size_t in = collective.gather ? mine : total, out = collective.gather ? total : mine;
    inputs.emplace_back(collective.bf16 ? 0 : in, 1.0f);
    outputs.emplace_back(collective.bf16 ? 0 : out, 0.0f);
    inputs16.emplace_back(collective.bf16 ? in : 0, uint16_t{0x3f80});
    outputs16.emplace_back(collective.bf16 ? out : 0, uint16_t{0});
  }
  for (int round = 0; round < rounds; ++round) {
    if (absl::Status status = group->Barrier()->Wait(); !status.ok()) return status;
    const Clock::time_point start = Clock::now();
    std::vector<std::shared_ptr<parallel::Work>> works;
    for (size_t i = 0; i < collectives.size(); ++i) {
      const Collective& collective = collectives[i];
      works.push_back(
          collective.bf16
              ? group->AllGatherBf16(inputs16[i], absl::MakeSpan(outputs16[i]), collective.counts)
          : collective.gather
              ? group->AllGather(inputs[i], absl::MakeSpan(outputs[i]), collective.counts)
              : group->ReduceScatter(inputs[i], absl::MakeSpan(outputs[i]), collective.counts,
                                     parallel::ReduceOp::kAvg));
    }
    for (auto& work : works) {
      if (absl::Status status = work->Wait(); !status.ok()) return status;
    }
    times_ms->push_back(Ms(Clock::now() - start));
  }
  return absl::OkStatus();
}

// Pins the calling thread to the `index`-th CPU this process may use
// (modulo their count).
absl::Status PinToCpu(int index) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
    return absl::InternalError("sched_getaffinity failed");
  }
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  }
  if (cpus.empty()) return absl::InternalError("no CPU to pin to");
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpus[index % cpus.size()], &one);
  if (pthread_setaffinity_np(pthread_self(), sizeof(one), &one) != 0) {
    return absl::InternalError("pthread_setaffinity_np failed");
  }
  return absl::OkStatus();
}

absl::Status RunRank(worker::TrainConfig config, int zero, worker::GatherDtype gather,
                     parallel::ProcessGroup* group, parallel::ProcessGroup* control, int warmup,
                     int steps, int replays, bool pin, RankSamples* samples) {
  // Only the training thread: the groups' threads (made before) still float.
  if (pin) {
    if (absl::Status pinned = PinToCpu(group->rank()); !pinned.ok()) return pinned;
  }
  std::unique_ptr<FILE, int (*)(FILE*)> sink(std::fopen("/dev/null", "w"), &std::fclose);
  RecordingGroup recorder(group);
  std::unique_ptr<worker::ParallelStrategy> strategy;
  worker::Fsdp* fsdp = nullptr;
  if (zero == 0) {
    config.parallel.strategy = "ddp";
    strategy = std::make_unique<worker::Ddp>(&recorder, control,
                                             worker::BucketOptionsFor(config.parallel), "gloo");
  } else {
    config.parallel.strategy = "fsdp";
    config.parallel.zero = zero;
    auto dims = parallel::ParallelDims::Create(group->size(), 1, group->size(), 1);
    if (!dims.ok()) return dims.status();
    worker::FsdpOptions options;
    options.zero = zero;
    options.gather = gather;
    auto owned =
        std::make_unique<worker::Fsdp>(&recorder, nullptr, control, *dims, options, "gloo");
    fsdp = owned.get();
    strategy = std::move(owned);
  }
  config.train.steps = warmup + steps;
  config.train.log_every = config.train.steps;
  config.train.eval_every = 0;
  config.train.metrics_file.clear();
  worker::TrainerOptions options;
  options.log = sink.get();
  options.strategy = strategy.get();
  // Declared after the strategy: destroyed before it.
  auto trainer = worker::Trainer::Create(config, options);
  if (!trainer.ok()) return trainer.status();
  Clock::time_point timed_start;
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) timed_start = Clock::now();
    const bool last = step == warmup + steps - 1;
    recorder.set_recording(last);
    recorder.set_timing_step(step >= warmup ? step - warmup : -1);
    const worker::FsdpWaits before = fsdp != nullptr ? fsdp->waits() : worker::FsdpWaits{};
    auto metrics = (*trainer)->Step();
    if (!metrics.ok()) return metrics.status();
    if (step < warmup || fsdp == nullptr) continue;
    const worker::FsdpWaits& after = fsdp->waits();
    samples->exposed_ms.push_back(
        1e3 * (after.gather_s - before.gather_s + after.reduce_s - before.reduce_s));
    if (last) {
      samples->waits_per_step.gathers = after.gathers - before.gathers;
      samples->waits_per_step.reduces = after.reduces - before.reduces;
    }
  }
  samples->elapsed_ms = Ms(Clock::now() - timed_start);
  recorder.set_recording(false);
  recorder.set_timing_step(-1);
  samples->timings.assign(recorder.timings().begin(), recorder.timings().end());
  if (fsdp == nullptr) {
    // DDP: the training thread's waits on its buckets, per timed step.
    samples->exposed_ms.assign(steps, 0.0);
    for (const Timing& timing : samples->timings) {
      if (timing.waited && timing.step < steps) {
        samples->exposed_ms[timing.step] += Ms(timing.wait_end - timing.wait_start);
      }
    }
    return absl::OkStatus();
  }
  samples->replayed = recorder.recorded();
  // Two untimed rounds first, as the steps had their warm-up: the first
  // rounds are 3-4x slower (fresh memory for the group's scratch buffers).
  std::vector<double> untimed;
  if (absl::Status status = Replay(group, samples->replayed, 2, &untimed); !status.ok()) {
    return status;
  }
  return Replay(group, samples->replayed, replays, &samples->alone_ms);
}

// Per sample i, over ranks: the mean (or the least) of (rank.*field)[i].
std::vector<double> AcrossRanks(const std::vector<RankSamples>& ranks,
                                std::vector<double> RankSamples::*field, bool least) {
  std::vector<double> out;
  for (size_t i = 0; i < (ranks[0].*field).size(); ++i) {
    double sum = 0, min = (ranks[0].*field)[i];
    for (const RankSamples& rank : ranks) {
      sum += (rank.*field)[i];
      min = std::min(min, (rank.*field)[i]);
    }
    out.push_back(least ? min : sum / ranks.size());
  }
  return out;
}

// Splits each rank's waits into the part before every rank had issued the
// collective (waiting for a peer to arrive: skew) and the part after
// (communication compute did not hide). Per step, the mean over ranks of
// the part after; false if the ranks' collectives do not line up.
bool ExposedAfterArrival(const std::vector<RankSamples>& ranks, int steps,
                         std::vector<double>* per_step_ms) {
  const size_t count = ranks[0].timings.size();
  for (const RankSamples& rank : ranks) {
    if (rank.timings.size() != count) return false;
  }
  std::vector<double> sums(steps, 0.0);
  for (size_t i = 0; i < count; ++i) {
    Clock::time_point last = ranks[0].timings[i].issued;
    for (const RankSamples& rank : ranks) {
      const Timing& timing = rank.timings[i];
      if (timing.step != ranks[0].timings[i].step) return false;
      last = std::max(last, timing.issued);
    }
    for (const RankSamples& rank : ranks) {
      const Timing& timing = rank.timings[i];
      if (!timing.waited || timing.step >= steps) continue;
      // The wait from when the last rank issued it (or from its start).
      const Clock::time_point from = std::max(timing.wait_start, last);
      if (timing.wait_end > from) sums[timing.step] += Ms(timing.wait_end - from);
    }
  }
  for (double& sum : sums) sum /= ranks.size();
  *per_step_ms = std::move(sums);
  return true;
}

}  // namespace

absl::StatusOr<ThreadsRun> RunThreadsJob(const worker::TrainConfig& config, int zero,
                                         worker::GatherDtype gather, int ranks, int warmup,
                                         int steps, int replays, bool pin) {
  rdzv::InMemoryStore store;
  // As in the worker: the strategy's data group, and a control group of
  // its own for the loss and the stop vote.
  auto groups = parallel::ConnectLocalGroups(&store, ranks, "data/");
  if (!groups.ok()) return groups.status();
  auto controls = parallel::ConnectLocalGroups(&store, ranks, "control/");
  if (!controls.ok()) return controls.status();
  std::vector<RankSamples> samples(ranks);
  absl::Status status = parallel::FirstError(parallel::OnEveryRank(ranks, [&](int rank) {
    return RunRank(config, zero, gather, (*groups)[rank].get(), (*controls)[rank].get(), warmup,
                   steps, replays, pin, &samples[rank]);
  }));
  if (!status.ok()) return status;
  ThreadsRun run;
  double elapsed_ms = 0;
  for (const RankSamples& rank : samples) elapsed_ms = std::max(elapsed_ms, rank.elapsed_ms);
  const double tokens = static_cast<double>(ranks) * config.data.micro_batch *
                        config.data.grad_accumulation * config.model.seq_len * steps;
  run.tokens_per_s = tokens / (elapsed_ms / 1e3);
  run.ms_per_step = elapsed_ms / steps;
  run.exposed_ms = Median(AcrossRanks(samples, &RankSamples::exposed_ms, false));
  run.exposed_least_ms = Median(AcrossRanks(samples, &RankSamples::exposed_ms, true));
  for (const RankSamples& rank : samples) run.exposed_rank_ms.push_back(Median(rank.exposed_ms));
  std::vector<double> after_arrival;
  if (ExposedAfterArrival(samples, steps, &after_arrival)) {
    run.exposed_arrived_ms = Median(after_arrival);
  } else {
    run.exposed_arrived_ms = -1;
  }
  if (zero == 0) return run;  // DDP: nothing replayed alone
  run.alone_ms = Median(AcrossRanks(samples, &RankSamples::alone_ms, true));
  run.gathers = static_cast<int>(samples[0].waits_per_step.gathers);
  run.reduces = static_cast<int>(samples[0].waits_per_step.reduces);
  run.replayed = static_cast<int>(samples[0].replayed.size());
  for (const Collective& collective : samples[0].replayed) {
    const size_t total =
        std::accumulate(collective.counts.begin(), collective.counts.end(), static_cast<size_t>(0));
    (collective.gather ? run.gathered_mb : run.reduced_mb) +=
        total * (collective.bf16 ? 2 : 4) / 1048576.0;
  }
  return run;
}

}  // namespace muster::tools
