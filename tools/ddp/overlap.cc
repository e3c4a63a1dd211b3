#include "tools/ddp/overlap.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "parallel/gradient_reducer.h"
#include "parallel/local_ranks.h"
#include "parallel/nccl/group.h"
#include "parallel/staged/group.h"
#include "tools/bench_util.h"
#include "worker/model/ops.h"
#include "worker/strategy/ddp/ddp.h"
#include "worker/strategy/strategy.h"
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

namespace {

// The data group of a world of one on `backend`, over `gloo` (a Gloo group
// of one rank) where the backend is Gloo.
absl::StatusOr<std::unique_ptr<parallel::ProcessGroup>> WorldOfOneGroup(
    parallel::DataBackend backend, parallel::ProcessGroup* gloo, rdzv::Store* store) {
  switch (backend) {
    case parallel::DataBackend::kGloo:
      return std::unique_ptr<parallel::ProcessGroup>();  // gloo itself
    case parallel::DataBackend::kNccl:
      return parallel::CreateNcclGroup(store, 0, 1, parallel::NcclOptions{});
    case parallel::DataBackend::kStagedGloo:
      return parallel::CreateHostStagedGroup(gloo, parallel::StagedOptions{});
  }
  return absl::InvalidArgumentError("unknown data backend");
}

// Waits for every kernel queued on the model's device: a 4-byte copy to
// the host on the stream the engine runs on (the CPU's is immediate).
void DeviceDone(worker::GptModel* model) {
  float probe;
  model->ops().ToHost(&probe, model->stages().front().grads, sizeof probe);
}

}  // namespace

absl::StatusOr<WorldOfOneFigures> MeasureWorldOfOne(const worker::TrainConfig& config,
                                                    parallel::DataBackend backend, int warmup,
                                                    int steps, int rounds) {
  worker::TrainConfig train = config;
  train.train.steps = 2 * (warmup + rounds * steps) + 1;  // the schedule outlasts the run
  train.train.log_every = 0;
  train.train.eval_every = 0;
  if (train.device == "cuda") {
    // As the worker does, before the model, cuBLAS or NCCL touch the GPU.
    auto choice = worker::SelectCudaDevice(0);
    if (!choice.ok()) return choice.status();
  }
  rdzv::InMemoryStore store;
  auto gloo = parallel::ConnectLocalGroups(&store, 1, "world_of_one/");
  if (!gloo.ok()) return gloo.status();
  parallel::ProcessGroup* control = (*gloo)[0].get();
  auto made = WorldOfOneGroup(backend, control, &store);
  if (!made.ok()) return made.status();
  std::unique_ptr<parallel::ProcessGroup> owned = *std::move(made);
  parallel::ProcessGroup* data = owned != nullptr ? owned.get() : control;

  const parallel::BucketOptions buckets = worker::BucketOptionsFor(train.parallel);
  // A staged data group wraps the Gloo one, which then must carry nothing
  // else (parallel/staged/group.h): the control messages go through it too.
  worker::Ddp ddp(data, backend == parallel::DataBackend::kStagedGloo ? data : control, buckets,
                  worker::DataBackendName(backend));
  worker::TrainerOptions with_ddp;
  with_ddp.strategy = &ddp;
  auto single = worker::Trainer::Create(train, worker::TrainerOptions{});
  if (!single.ok()) return single.status();
  auto reduced = worker::Trainer::Create(train, with_ddp);
  if (!reduced.ok()) return reduced.status();

  std::vector<double> single_ms, ddp_ms;
  auto run = [&](worker::Trainer* trainer, int count, std::vector<double>* times) -> absl::Status {
    for (int i = 0; i < count; ++i) {
      const auto start = Clock::now();
      auto metrics = trainer->Step();
      if (!metrics.ok()) return metrics.status();
      if (times != nullptr) times->push_back(Ms(Clock::now() - start));
    }
    return absl::OkStatus();
  };
  if (absl::Status status = run(single->get(), warmup, nullptr); !status.ok()) return status;
  if (absl::Status status = run(reduced->get(), warmup, nullptr); !status.ok()) return status;
  for (int round = 0; round < rounds; ++round) {
    const bool single_first = round % 2 == 0;
    for (int turn = 0; turn < 2; ++turn) {
      const bool plain = (turn == 0) == single_first;
      absl::Status status =
          plain ? run(single->get(), steps, &single_ms) : run(reduced->get(), steps, &ddp_ms);
      if (!status.ok()) return status;
    }
  }

  // The Ddp model's buckets, reduced alone.
  worker::GptModel* model = (*reduced)->model();
  std::vector<absl::Span<float>> segments;
  for (worker::Stage& stage : model->stages()) segments.emplace_back(stage.grads, stage.size);
  parallel::GradientReducer bare(data, segments, buckets);
  WorldOfOneFigures figures;
  figures.buckets = static_cast<int>(bare.buckets().size());
  for (const parallel::Bucket& bucket : bare.buckets()) figures.gradient_floats += bucket.floats;
  std::vector<double> bare_ms;
  for (int round = 0; round < warmup + steps; ++round) {
    DeviceDone(model);
    bare.Arm();
    const auto start = Clock::now();
    if (absl::Status status = bare.Finish(); !status.ok()) return status;
    if (round >= warmup) bare_ms.push_back(Ms(Clock::now() - start));
  }
  figures.single_ms = Median(single_ms);
  figures.ddp_ms = Median(ddp_ms);
  figures.bare_ms = Median(bare_ms);
  figures.overhead_ms = figures.ddp_ms - figures.single_ms;
  figures.hidden = figures.bare_ms > 0 ? 1.0 - figures.overhead_ms / figures.bare_ms : 0;
  return figures;
}

}  // namespace muster::tools
