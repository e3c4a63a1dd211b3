#include "tools/ddp/overlap.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "parallel/gradient_reducer.h"
#include "parallel/local_ranks.h"
#include "tools/bench_util.h"
#include "worker/strategy/ddp/ddp.h"
#include "worker/trainer/trainer.h"

namespace muster::tools {
namespace {

using Clock = std::chrono::steady_clock;

// A wait that began at `start` and lasted `ms`: a step's reduction after
// backward, or a bare reduction.
struct Wait {
  Clock::time_point start;
  double ms = 0;
};

// Ddp noting when this rank's backward ended: the trainer calls
// ReduceGradients right after the last micro-step's Backward.
class TimedDdp : public worker::Ddp {
 public:
  using Ddp::Ddp;
  absl::Status ReduceGradients(worker::GptModel* model) override {
    backward_end_ = Clock::now();
    return Ddp::ReduceGradients(model);
  }
  Clock::time_point backward_end() const { return backward_end_; }

 private:
  Clock::time_point backward_end_;
};

// One rank's samples, one per timed step (or bare reduction).
struct RankSamples {
  std::vector<double> step_ms;
  std::vector<Wait> exposed, bare;
  int buckets = 0;
  size_t floats = 0;
};

absl::Status RunRank(const worker::TrainConfig& config, parallel::ProcessGroup* group, int warmup,
                     int steps, RankSamples* samples) {
  const parallel::BucketOptions buckets = worker::BucketOptionsFor(config.parallel);
  TimedDdp ddp(group, group, buckets, "gloo");
  worker::TrainerOptions options;
  options.strategy = &ddp;
  auto trainer = worker::Trainer::Create(config, options);
  if (!trainer.ok()) return trainer.status();
  for (int step = 0; step < warmup + steps; ++step) {
    auto start = Clock::now();
    auto metrics = (*trainer)->Step();
    if (!metrics.ok()) return metrics.status();
    if (step < warmup) continue;
    samples->step_ms.push_back(Ms(Clock::now() - start));
    samples->exposed.push_back(
        {ddp.backward_end(), absl::ToDoubleMilliseconds(ddp.reducer()->last_exposed_wait())});
  }

  // The same buckets over the same gradient memory, reduced bare.
  std::vector<absl::Span<float>> segments;
  for (worker::Stage& stage : (*trainer)->model()->stages()) {
    segments.emplace_back(stage.grads, stage.size);
  }
  parallel::GradientReducer bare(group, segments, buckets);
  samples->buckets = static_cast<int>(bare.buckets().size());
  for (const parallel::Bucket& bucket : bare.buckets()) samples->floats += bucket.floats;
  for (int round = 0; round < warmup + steps; ++round) {
    bare.Arm();
    auto start = Clock::now();
    if (absl::Status status = bare.Finish(); !status.ok()) return status;
    if (round >= warmup) samples->bare.push_back({start, Ms(Clock::now() - start)});
  }
  return absl::OkStatus();
}

// Medians: the machine is shared, and one step stalled by another
// process's burst should not decide the figure.
// Per sample i: the wait of the rank that started waiting last (earlier
// ranks also wait for it to get there, which is skew, not communication),
// and the skew itself.
void LastArrivals(const std::vector<RankSamples>& ranks, std::vector<Wait> RankSamples::*waits,
                  std::vector<double>* last_ms, std::vector<double>* skew_ms) {
  for (size_t i = 0; i < (ranks[0].*waits).size(); ++i) {
    const Wait* last = &(ranks[0].*waits)[i];
    Clock::time_point first_start = last->start;
    for (const RankSamples& rank : ranks) {
      const Wait& wait = (rank.*waits)[i];
      if (wait.start > last->start) last = &wait;
      first_start = std::min(first_start, wait.start);
    }
    last_ms->push_back(last->ms);
    if (skew_ms != nullptr) skew_ms->push_back(Ms(last->start - first_start));
  }
}

}  // namespace

absl::StatusOr<OverlapFigures> MeasureOverlap(const worker::TrainConfig& config, int ranks,
                                              int warmup, int steps) {
  rdzv::InMemoryStore store;
  auto groups = parallel::ConnectLocalGroups(&store, ranks);
  if (!groups.ok()) return groups.status();
  std::vector<RankSamples> samples(ranks);
  absl::Status status = parallel::FirstError(parallel::OnEveryRank(ranks, [&](int rank) {
    return RunRank(config, (*groups)[rank].get(), warmup, steps, &samples[rank]);
  }));
  if (!status.ok()) return status;
  OverlapFigures figures;
  figures.buckets = samples[0].buckets;
  figures.gradient_floats = samples[0].floats;
  std::vector<double> step_ms, exposed_ms, skew_ms, bare_ms;
  for (const RankSamples& rank : samples) {
    step_ms.insert(step_ms.end(), rank.step_ms.begin(), rank.step_ms.end());
  }
  LastArrivals(samples, &RankSamples::exposed, &exposed_ms, &skew_ms);
  LastArrivals(samples, &RankSamples::bare, &bare_ms, nullptr);
  figures.step_ms = Median(step_ms);
  figures.exposed_ms = Median(exposed_ms);
  figures.skew_ms = Median(skew_ms);
  figures.bare_ms = Median(bare_ms);
  figures.hidden = figures.bare_ms > 0 ? 1.0 - figures.exposed_ms / figures.bare_ms : 0;
  return figures;
}

}  // namespace muster::tools
