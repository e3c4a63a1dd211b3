#include "tools/pp/threads.h"

#include <time.h>

#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "parallel/local_ranks.h"
#include "parallel/parallel_dims.h"
#include "parallel/process_group.h"
#include "rendezvous/client/store.h"
#include "tools/pp/cpu.h"
#include "worker/trainer/trainer.h"

namespace muster::tools {
namespace {

double ThreadCpuSeconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return now.tv_sec + now.tv_nsec * 1e-9;
}

// Passes everything to the Pipeline and times its ForwardBackward on the
// job's clock (`epoch`) and in thread CPU time.
class TimedPipeline final : public worker::ParallelStrategy {
 public:
  TimedPipeline(worker::Pipeline* inner, absl::Time epoch) : inner_(inner), epoch_(epoch) {}

  const RankStep& last() const { return last_; }

  std::string Describe() const override { return inner_->Describe(); }
  const parallel::ParallelDims& dims() const override { return inner_->dims(); }
  int rank() const override { return inner_->rank(); }
  int dp_rank() const override { return inner_->dp_rank(); }
  parallel::Collectives& control() override { return inner_->control(); }
  absl::StatusOr<worker::BuiltModel> Build(const worker::BuildSpec& spec) override {
    return inner_->Build(spec);
  }
  absl::StatusOr<worker::StepLoss> ForwardBackward(worker::GptModel* model,
                                                   const worker::MicroBatches& batches) override {
    const double cpu = ThreadCpuSeconds();
    const absl::Time began = absl::Now();
    auto loss = inner_->ForwardBackward(model, batches);
    last_.wall_s = absl::ToDoubleSeconds(absl::Now() - began);
    last_.cpu_s = ThreadCpuSeconds() - cpu;
    last_.began_s = absl::ToDoubleSeconds(began - epoch_);
    last_.times = inner_->last_step_times();
    return loss;
  }
  absl::StatusOr<worker::StepLoss> ForwardOnly(worker::GptModel* model,
                                               const worker::MicroBatches& batches) override {
    return inner_->ForwardOnly(model, batches);
  }
  void BeginBackward(worker::GptModel* model, bool last) override {
    inner_->BeginBackward(model, last);
  }
  absl::Status ReduceGradients(worker::GptModel* model) override {
    return inner_->ReduceGradients(model);
  }
  absl::StatusOr<double> GradSumOfSquares(worker::GptModel* model) override {
    return inner_->GradSumOfSquares(model);
  }
  absl::Status OptimizerStep(worker::GptModel* model, worker::AdamW* optimizer, float lr, int step,
                             float grad_scale) override {
    return inner_->OptimizerStep(model, optimizer, lr, step, grad_scale);
  }
  void ZeroGrad(worker::GptModel* model) override { inner_->ZeroGrad(model); }
  std::vector<std::vector<worker::FlatRange>> CheckpointFiles(uint64_t total) const override {
    return inner_->CheckpointFiles(total);
  }
  std::vector<worker::FlatRange> CheckpointLoad(uint64_t total) const override {
    return inner_->CheckpointLoad(total);
  }
  absl::Status StateLoaded(worker::GptModel* model) override { return inner_->StateLoaded(model); }
  absl::Status AfterRun(worker::GptModel* model) override { return inner_->AfterRun(model); }

 private:
  worker::Pipeline* const inner_;
  const absl::Time epoch_;
  RankStep last_;
};

// The groups of one pipeline of `pp` ranks (dp 1): what each rank's
// PipelineGroups points at, and the groups themselves.
struct Groups {
  std::vector<worker::PipelineGroups> of;  // per rank
  std::vector<std::unique_ptr<parallel::ProcessGroup>> owned;
};

absl::StatusOr<Groups> ConnectPipeline(rdzv::Store* store, int pp, bool ring) {
  Groups groups;
  groups.of.resize(pp);
  auto keep = [&](std::vector<std::unique_ptr<parallel::ProcessGroup>>& made,
                  const std::vector<int>& ranks,
                  parallel::ProcessGroup* worker::PipelineGroups::*field) {
    for (size_t i = 0; i < ranks.size(); ++i) {
      groups.of[ranks[i]].*field = made[i].get();
      groups.owned.push_back(std::move(made[i]));
    }
  };
  auto pipeline = parallel::ConnectLocalGroups(store, pp, "pipeline/");
  if (!pipeline.ok()) return pipeline.status();
  std::vector<int> all;
  for (int rank = 0; rank < pp; ++rank) all.push_back(rank);
  keep(*pipeline, all, &worker::PipelineGroups::pipeline);
  auto tied = parallel::ConnectLocalGroups(store, 2, "tied/");
  if (!tied.ok()) return tied.status();
  keep(*tied, {0, pp - 1}, &worker::PipelineGroups::tied);
  // The channels: one 2-rank group per direction, rank 0 the rank that
  // sends the activations. With virtual stages the last rank's chunks feed
  // the first rank's next chunks, so a channel from rank pp - 1 to rank 0
  // closes the ring.
  const int channels = ring ? pp : pp - 1;
  for (int p = 0; p < channels; ++p) {
    const int next = (p + 1) % pp;
    auto activations = parallel::ConnectLocalGroups(store, 2, absl::StrCat("act.", p, "/"));
    if (!activations.ok()) return activations.status();
    groups.of[p].activations_out = (*activations)[0].get();
    groups.of[next].activations_in = (*activations)[1].get();
    auto gradients = parallel::ConnectLocalGroups(store, 2, absl::StrCat("grad.", p, "/"));
    if (!gradients.ok()) return gradients.status();
    groups.of[p].gradients_in = (*gradients)[0].get();
    groups.of[next].gradients_out = (*gradients)[1].get();
    for (auto* made : {&*activations, &*gradients}) {
      for (auto& group : *made) groups.owned.push_back(std::move(group));
    }
  }
  return groups;
}

// One rank's training: `warmup` steps, then run->steps.size() timed,
// their times into run->steps[step][rank].
absl::Status TrainRank(const worker::TrainConfig& config, const worker::PipelineGroups& groups,
                       parallel::ProcessGroup* world, const parallel::ParallelDims& dims,
                       parallel::ScheduleKind schedule, int virtual_stages, absl::Time epoch,
                       int warmup, int rank, PipelineRun* run) {
  std::unique_ptr<FILE, int (*)(FILE*)> sink(std::fopen("/dev/null", "w"), &std::fclose);
  worker::PipelineOptions options;
  options.schedule = schedule;
  options.virtual_stages = virtual_stages;
  worker::Pipeline pipeline(groups, world, dims, options, "gloo");
  TimedPipeline timed(&pipeline, epoch);
  worker::TrainerOptions trainer_options;
  trainer_options.log = sink.get();
  trainer_options.strategy = &timed;
  // Declared after the strategy: destroyed before it.
  auto trainer = worker::Trainer::Create(config, trainer_options);
  if (!trainer.ok()) return trainer.status();
  const int steps = static_cast<int>(run->steps.size());
  for (int step = 0; step < warmup + steps; ++step) {
    auto metrics = (*trainer)->Step();
    if (!metrics.ok()) return metrics.status();
    if (step >= warmup) run->steps[step - warmup][rank] = timed.last();
  }
  // Every chunk's activations: with virtual stages the trainer's model is
  // only chunk 0.
  run->activation_bytes[rank] = pipeline.ActivationBytes();
  run->peak_in_flight[rank] = pipeline.peak_in_flight();
  if (rank == 0) run->split = pipeline.split();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PipelineRun> RunPipelineJob(worker::TrainConfig config, int pp,
                                           parallel::ScheduleKind schedule, int virtual_stages,
                                           int warmup, int steps) {
  const absl::Time epoch = absl::Now();
  auto dims = parallel::ParallelDims::Create(pp, 1, 1, pp);
  if (!dims.ok()) return dims.status();
  rdzv::InMemoryStore store;
  auto worlds = parallel::ConnectLocalGroups(&store, pp, "world/");
  if (!worlds.ok()) return worlds.status();
  // A ring only with two ranks or more: a single rank has no neighbours.
  auto groups = ConnectPipeline(&store, pp, virtual_stages > 1 && pp > 1);
  if (!groups.ok()) return groups.status();
  config.train.steps = warmup + steps;
  config.train.log_every = config.train.steps;
  config.train.eval_every = 0;
  config.train.metrics_file.clear();

  PipelineRun run;
  run.steps.assign(steps, std::vector<RankStep>(pp));
  run.activation_bytes.assign(pp, 0);
  run.peak_in_flight.assign(pp, 0);
  ThreadCpuSampler sampler(pp, epoch, absl::Milliseconds(1));
  absl::Status status = parallel::FirstError(parallel::OnEveryRank(pp, [&](int rank) {
    sampler.Register(rank);
    absl::Status trained = TrainRank(config, groups->of[rank], (*worlds)[rank].get(), *dims,
                                     schedule, virtual_stages, epoch, warmup, rank, &run);
    sampler.Unregister(rank);
    return trained;
  }));
  sampler.Stop();
  if (!status.ok()) return status;
  for (std::vector<RankStep>& step : run.steps) {
    for (int rank = 0; rank < pp; ++rank) {
      RankStep& mine = step[rank];
      for (const worker::Pipeline::ActionTime& time : mine.times) {
        mine.action_cpu_s.push_back(sampler.CpuAt(rank, mine.began_s + time.end) -
                                    sampler.CpuAt(rank, mine.began_s + time.start));
      }
    }
  }
  run.seconds = absl::ToDoubleSeconds(absl::Now() - epoch);
  return run;
}

}  // namespace muster::tools
