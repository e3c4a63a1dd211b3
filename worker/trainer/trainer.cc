#include "worker/trainer/trainer.h"

#include <string.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/grad_norm.h"
#include "worker/trainer/checkpoint_manager.h"
#include "worker/trainer/config_agreement.h"

namespace muster::worker {

bool ShouldLog(int step, int total_steps, int log_every) {
  if (step == 1 || step == total_steps) return true;
  return log_every > 0 && step % log_every == 0;
}

bool ShouldEvaluate(int step, int total_steps, int eval_every) {
  if (eval_every <= 0) return false;
  return step % eval_every == 0 || step == total_steps;
}

Trainer::Trainer(const TrainConfig& config, TrainerOptions options)
    : config_(config),
      options_(std::move(options)),
      progress_(options_.progress, options_.progress_bar && (options_.strategy == nullptr ||
                                                             options_.strategy->rank() == 0)) {
  if (options_.strategy == nullptr) single_process_ = std::make_unique<SingleProcess>();
  strategy_ = options_.strategy != nullptr ? options_.strategy : single_process_.get();
}

Trainer::~Trainer() { progress_.Clear(); }

namespace {

// A data error names the field whose glob it came from: data.train and
// data.val fail alike ("no token shards match '...'").
absl::Status NameField(const char* field, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(field, ": ", status.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainConfig& config,
                                                         TrainerOptions options) {
  std::unique_ptr<Trainer> trainer(new Trainer(config, std::move(options)));
  const ModelConfig& model = config.model;
  const int B = config.data.micro_batch, T = model.seq_len;

  if (trainer->options_.sample_only && config.train.steps != 0) {
    return absl::InvalidArgumentError("a trainer that only samples trains no steps");
  }
  // Data first: a wrong glob is the most common mistake and the cheapest
  // to report.
  if (!trainer->options_.sample_only) {
    auto train = TokenStream::Open(config.data.train, T, model.vocab, config.train.seed);
    if (!train.ok()) return NameField("data.train", train.status());
    trainer->train_ = *std::move(train);
  }
  if (!trainer->options_.sample_only && !config.data.val.empty() && config.train.eval_every > 0) {
    auto val = TokenStream::Open(config.data.val, T, model.vocab, config.train.seed);
    if (!val.ok()) return NameField("data.val", val.status());
    trainer->val_ = *std::move(val);
  }

  auto device = ResolveDevice(config.device);
  if (!device.ok()) return device.status();
  // After the device: "auto" depends on it, and with device auto a tf32 or
  // bf16 on a machine without a GPU is only found out here.
  auto precision = ResolvePrecision(config.precision, *device);
  if (!precision.ok()) return precision.status();
  // After both: cudnn needs cuda and bf16, which auto may or may not be.
  auto attention = ResolveAttention(config.attention, *device, *precision);
  if (!attention.ok()) return attention.status();
  // Every rank's config, and what this node made of it, must be rank 0's
  // before the first collective that depends on it (config_agreement.h).
  std::vector<ConfigLine> resolved = {{"device (resolved)", DeviceName(*device)},
                                      {"precision (resolved)", PrecisionName(*precision)},
                                      {"attention (resolved)", AttentionName(*attention)}};
  if (trainer->train_ != nullptr) {
    resolved.push_back(
        {"data.train (windows)", absl::StrCat(trainer->train_->samples_per_epoch())});
  }
  if (trainer->val_ != nullptr) {
    resolved.push_back({"data.val (windows)", absl::StrCat(trainer->val_->samples_per_epoch())});
  }
  if (absl::Status agreed = AgreeOnConfig(trainer->strategy_->control(),
                                          ComparedConfig(config, resolved), config.source);
      !agreed.ok()) {
    return agreed;
  }
  // A validation pass reads samples 0, 1, 2, ... of the val stream, eval_batches x B on each
  // replica; from fewer windows it reads some more than once, so its loss is over fewer
  // distinct samples than the config says. Allowed (a small held-out set), never silent.
  if (trainer->val_ != nullptr && trainer->strategy_->rank() == 0) {
    const int dp = trainer->strategy_->dims().dp();
    const uint64_t pass = static_cast<uint64_t>(config.train.eval_batches) * B * dp;
    const uint64_t windows = trainer->val_->samples_per_epoch();
    if (windows < pass) {
      const uint64_t fit = std::max<uint64_t>(1, windows / (static_cast<uint64_t>(B) * dp));
      std::fprintf(trainer->options_.log,
                   "data: warning: data.val holds %llu windows of seq_len + 1 tokens, fewer than "
                   "the %llu samples a validation pass reads (train.eval_batches %d x "
                   "data.micro_batch %d x %d replica%s), so each pass reads some more than once; "
                   "train.eval_batches %llu reads each at most once\n",
                   static_cast<unsigned long long>(windows), static_cast<unsigned long long>(pass),
                   config.train.eval_batches, B, dp, dp == 1 ? "" : "s",
                   static_cast<unsigned long long>(fit));
      std::fflush(trainer->options_.log);
    }
  }
  // Likewise a training set smaller than one optimizer step's samples: every
  // step then reads some windows more than once (an epoch is shorter than a
  // step), which a smoke test may want and a real run never does.
  if (trainer->train_ != nullptr && trainer->strategy_->rank() == 0) {
    const uint64_t dp = trainer->strategy_->dims().dp();
    const uint64_t step = static_cast<uint64_t>(MicroSteps(config)) * B * dp;
    const uint64_t windows = trainer->train_->samples_per_epoch();
    if (windows < step) {
      std::fprintf(trainer->options_.log,
                   "data: warning: data.train holds %llu windows of seq_len + 1 tokens, fewer "
                   "than the %llu samples one optimizer step reads (%d micro-batches of "
                   "data.micro_batch %d, x %llu replica%s), so every step reads some more than "
                   "once\n",
                   static_cast<unsigned long long>(windows), static_cast<unsigned long long>(step),
                   MicroSteps(config), B, static_cast<unsigned long long>(dp), dp == 1 ? "" : "s");
      std::fflush(trainer->options_.log);
    }
  }
  // The strategy builds the model's storage and the optimizer over this
  // rank's parameters, with weights agreed over ranks.
  BuildSpec spec;
  spec.model = model;
  spec.micro_batch = B;
  spec.micro_steps = MicroSteps(config);
  spec.device = *device;
  spec.precision = *precision;
  spec.attention = *attention;
  spec.optim = config.optim;
  spec.seed = config.train.seed;
  auto built = trainer->strategy_->Build(spec);
  if (!built.ok()) return built.status();
  trainer->model_ = std::move(built->model);
  trainer->optimizer_ = std::move(built->optimizer);
  // train.cuda_graphs: each pass captured at its second run, replayed
  // after (worker/model/model_cuda.cc, RunPass).
  if (config.train.cuda_graphs != "false" && *device == Device::kCuda) {
    if (absl::Status enabled = trainer->model_->EnableCudaGraphs(); !enabled.ok()) return enabled;
  }
  trainer->checkpoints_ = std::make_unique<CheckpointManager>(
      config, trainer->strategy_, trainer->options_.log, trainer->options_.env);
  trainer->checkpoints_->set_run(trainer->options_.run_job, trainer->options_.run_round);
  trainer->checkpoints_->set_sample_only(trainer->options_.sample_only);
  trainer->state_.data_windows =
      trainer->train_ != nullptr ? trainer->train_->samples_per_epoch() : 0;
  {
    const uint64_t dp = trainer->strategy_->dims().dp();
    trainer->state_.global_batch = static_cast<uint64_t>(MicroSteps(config)) * dp * B;
    trainer->state_.val_samples =
        trainer->val_ != nullptr ? static_cast<uint64_t>(config.train.eval_batches) * B * dp : 0;
  }
  auto resumed = trainer->checkpoints_->Resume(trainer->model_.get(), trainer->optimizer_.get(),
                                               &trainer->state_);
  if (!resumed.ok()) return resumed.status();

  // Rank 0 speaks for the job: the loss it logs is already the mean over
  // ranks, and one metrics file has one writer.
  if (!config.train.metrics_file.empty() && trainer->strategy_->rank() == 0) {
    MetricsTrim trimmed;
    // The lineage tells this run's file from another's: without checkpoints
    // every start is a fresh run of the one file.
    auto writer = MetricsWriter::Open(
        config.train.metrics_file,
        *resumed ? std::optional<int>(trainer->state_.step) : std::nullopt, &trimmed,
        config.checkpoint.dir.empty() ? std::string() : trainer->checkpoints_->lineage());
    if (!writer.ok()) return writer.status();
    if (!trimmed.set_aside.empty()) {
      std::string line =
          absl::StrFormat("metrics: %s held another run's steps (lineage %s): kept it whole as %s",
                          config.train.metrics_file, trimmed.set_aside_lineage, trimmed.set_aside);
      if (!trimmed.restored.empty()) {
        absl::StrAppend(&line, "; this run's own file is back from ", trimmed.restored);
      } else if (*resumed) {
        absl::StrAppend(&line, "; this run's file starts with its lines up to step ",
                        trainer->state_.step);
      }
      std::fprintf(trainer->options_.log, "%s\n", line.c_str());
    }
    if (trimmed.dropped_lines > 0) {
      std::fprintf(trainer->options_.log,
                   "metrics: %s starts afresh with this run from step 0; it held %d line(s) "
                   "of an earlier start%s\n",
                   config.train.metrics_file.c_str(), trimmed.dropped_lines,
                   config.checkpoint.dir.empty()
                       ? " (without checkpoint.dir every start is step 0 of the one file)"
                       : "");
    }
    // A fork's cut is of its copy: the other run's file keeps those lines.
    if (trimmed.lines > 0 && (trimmed.set_aside.empty() || !trimmed.restored.empty())) {
      std::string steps = trimmed.first_step == 0 ? std::string("a torn line")
                          : trimmed.first_step == trimmed.last_step
                              ? absl::StrCat("step ", trimmed.first_step)
                              : absl::StrCat("steps ", trimmed.first_step, "..", trimmed.last_step);
      std::fprintf(trainer->options_.log,
                   "metrics: cut %d line(s) (%s) from %s: logged after step %d, which this run "
                   "resumes from and logs again\n",
                   trimmed.lines, steps.c_str(), config.train.metrics_file.c_str(),
                   trainer->state_.step);
      std::fflush(trainer->options_.log);
    }
    trainer->metrics_ = *std::move(writer);
  }
  trainer->peak_flops_ = PeakFlops(*device, *precision, &trainer->peak_description_);
  return trainer;
}

absl::StatusOr<StepMetrics> Trainer::Step() {
  using Clock = std::chrono::steady_clock;
  const int B = config_.data.micro_batch, T = config_.model.seq_len;
  const int A = MicroSteps(config_);
  const int dp = strategy_->dims().dp();
  const int step = state_.step;  // 0-based index of this step
  auto start = Clock::now();
  const double wait_before = strategy_->CommWaitSeconds();

  MicroBatches batches;
  batches.count = A;
  batches.B = B;
  batches.T = T;
  const uint64_t step_first = state_.sample_index;
  batches.fill = [&](int m, int* inputs, int* targets) {
    const uint64_t global = step_first + static_cast<uint64_t>(m) * dp * B;
    train_->Batch(RankFirstSample(global, strategy_->dp_rank(), B), B, inputs, targets);
  };
  auto loss = strategy_->ForwardBackward(model_.get(), batches);
  if (!loss.ok()) return loss.status();
  state_.sample_index += static_cast<uint64_t>(A) * dp * B;
  absl::Status reduced = strategy_->ReduceGradients(model_.get());
  if (!reduced.ok()) return reduced;
  // The clip factor goes into AdamW's read of the gradients: the same
  // values as scaling them first, without a pass over them.
  auto sum_of_squares = strategy_->GradSumOfSquares(model_.get());
  if (!sum_of_squares.ok()) return sum_of_squares.status();
  const double norm = std::sqrt(*sum_of_squares);
  const float max_norm = static_cast<float>(config_.optim.grad_clip);
  const float clip = max_norm > 0.0f ? kernels::ClipScale(norm, max_norm) : 1.0f;
  float lr = LearningRate(config_.optim, step, config_.train.steps);
  absl::Status stepped =
      strategy_->OptimizerStep(model_.get(), optimizer_.get(), lr, step + 1, clip);
  if (!stepped.ok()) return stepped;
  strategy_->ZeroGrad(model_.get());
  // A failed kernel launch or copy is sticky: caught here, once per step,
  // it names the step instead of surfacing as a NaN loss later.
  if (absl::Status device = model_->DeviceStatus(); !device.ok()) {
    return absl::Status(device.code(), absl::StrCat("step ", step + 1, ": ", device.message()));
  }
  state_.step = step + 1;
  // The stop vote rides on the loss's all-reduce: its sum is positive when
  // any rank was asked to stop. The loss is the mean over every loss any
  // rank computed (a pipeline's stages without the head compute none). So
  // does this step's wait on the strategy's collectives, in ms.
  const int signal = options_.stop_signal ? options_.stop_signal() : 0;
  const double wait_after = strategy_->CommWaitSeconds();
  const bool waits_measured = wait_after >= 0;
  float sums[4] = {static_cast<float>(loss->sum), static_cast<float>(loss->count),
                   signal != 0 ? 1.0f : 0.0f,
                   waits_measured ? static_cast<float>((wait_after - wait_before) * 1e3) : 0.0f};
  if (absl::Status reduced =
          strategy_->control().AllReduce(absl::MakeSpan(sums), parallel::ReduceOp::kSum);
      !reduced.ok()) {
    return reduced;
  }
  stop_signal_ = sums[2] > 0.0f ? (signal != 0 ? signal : kPeerSignalled) : 0;
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  StepMetrics metrics;
  metrics.step = state_.step;
  metrics.total_steps = config_.train.steps;
  metrics.loss = sums[1] > 0.0f ? sums[0] / sums[1] : 0.0f;
  metrics.lr = lr;
  metrics.grad_norm = norm;
  metrics.ms = seconds * 1e3;
  metrics.world = strategy_->dims().world();
  metrics.comm_wait_ms = waits_measured ? sums[3] / metrics.world : -1.0;
  double tokens = static_cast<double>(dp) * A * B * T;
  metrics.tokens_per_s = seconds > 0 ? tokens / seconds : 0;
  if (peak_flops_ > 0) {
    // tokens/s is the whole job's and peak_flops_ one process's (its
    // threads' cores), so the job's peak is world times that.
    metrics.mfu = FlopsPerToken(config_.model, T) * metrics.tokens_per_s /
                  (peak_flops_ * strategy_->dims().world());
  }
  return metrics;
}

absl::StatusOr<float> Trainer::Evaluate() {
  if (val_ == nullptr) {
    return absl::FailedPreconditionError("evaluation needs data.val and train.eval_every > 0");
  }
  const int B = config_.data.micro_batch, T = config_.model.seq_len;
  const int dp = strategy_->dims().dp();
  MicroBatches batches;
  batches.count = config_.train.eval_batches;
  batches.B = B;
  batches.T = T;
  batches.fill = [&](int m, int* inputs, int* targets) {
    const uint64_t global_first = static_cast<uint64_t>(m) * dp * B;
    val_->Batch(RankFirstSample(global_first, strategy_->dp_rank(), B), B, inputs, targets);
  };
  auto loss = strategy_->ForwardOnly(model_.get(), batches);
  if (!loss.ok()) return loss.status();
  float sums[2] = {static_cast<float>(loss->sum), static_cast<float>(loss->count)};
  if (absl::Status reduced =
          strategy_->control().AllReduce(absl::MakeSpan(sums), parallel::ReduceOp::kSum);
      !reduced.ok()) {
    return reduced;
  }
  return sums[1] > 0.0f ? sums[0] / sums[1] : 0.0f;
}

absl::Status Trainer::Log(const StepMetrics& metrics, bool to_metrics_file) {
  if (strategy_->rank() != 0) return absl::OkStatus();
  progress_.Clear();
  std::fprintf(options_.log, "%s\n", FormatStepLine(metrics).c_str());
  std::fflush(options_.log);
  if (metrics_ != nullptr && to_metrics_file) return metrics_->Write(StepJson(metrics));
  return absl::OkStatus();
}

absl::Status Trainer::LogEval(const EvalMetrics& metrics) {
  if (strategy_->rank() != 0) return absl::OkStatus();
  progress_.Clear();
  std::fprintf(options_.log, "%s\n", FormatEvalLine(metrics).c_str());
  std::fflush(options_.log);
  if (metrics_ != nullptr) return metrics_->Write(EvalJson(metrics));
  return absl::OkStatus();
}

std::string Trainer::StopCause() const {
  if (stop_signal_ == kPeerSignalled) return "a signal to another rank";
  const char* name = sigabbrev_np(stop_signal_);
  return name != nullptr ? absl::StrCat("SIG", name) : absl::StrCat("signal ", stop_signal_);
}

absl::Status Trainer::Preempt(std::chrono::steady_clock::time_point since) {
  progress_.Clear();
  if (strategy_->rank() == 0) {
    std::fprintf(options_.log, "preempted: %s after step %d of %d; %s\n", StopCause().c_str(),
                 state_.step, config_.train.steps,
                 config_.checkpoint.dir.empty() ? "no checkpoint.dir, so nothing is saved"
                                                : "saving a checkpoint");
    std::fflush(options_.log);
  }
  absl::Status saved = checkpoints_->SaveNow(*model_, *optimizer_, state_);
  if (!saved.ok()) return saved;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  return absl::CancelledError(absl::StrCat(
      "preempted by ", StopCause(), " after step ", state_.step,
      config_.checkpoint.dir.empty()
          ? std::string("; nothing saved (no checkpoint.dir)")
          : absl::StrFormat("; checkpoint step %d committed in %.2f s", state_.step, seconds)));
}

absl::Status Trainer::Run() {
  using Clock = std::chrono::steady_clock;
  const int total = config_.train.steps;
  const int first = state_.step;
  if (first >= total && strategy_->rank() == 0 && !options_.sample_only) {
    // A finished run started again, or train.steps lowered below a
    // checkpoint's step: say so rather than exit 0 without a word.
    std::fprintf(options_.log, "nothing to train: resumed at step %d, and train.steps is %d\n",
                 first, total);
    std::fflush(options_.log);
  }
  auto start = Clock::now();
  while (state_.step < total) {
    auto metrics = Step();
    if (!metrics.ok()) return metrics.status();
    if (!std::isfinite(metrics->loss)) {
      return absl::InternalError(absl::StrCat("step ", metrics->step, ": the loss is ",
                                              metrics->loss, "; lower optim.lr or check the data"));
    }
    if (options_.on_step) options_.on_step(*metrics);
    const bool scheduled = ShouldLog(metrics->step, total, config_.train.log_every);
    if (scheduled || metrics->step == first + 1) {
      // A resumed run's first step is shown, so that its log says at once
      // that it trains and how fast.
      absl::Status logged = Log(*metrics, scheduled);
      if (!logged.ok()) return logged;
    }
    if (val_ != nullptr && ShouldEvaluate(metrics->step, total, config_.train.eval_every)) {
      auto val_loss = Evaluate();
      if (!val_loss.ok()) return val_loss.status();
      EvalMetrics eval{metrics->step, *val_loss};
      if (options_.on_eval) options_.on_eval(eval);
      absl::Status logged = LogEval(eval);
      if (!logged.ok()) return logged;
    }
    // A save's lines ("checkpoint: saved ...") take the bar's place, as the
    // step lines do; it is drawn again below.
    progress_.Clear();
    absl::Status saved = checkpoints_->AfterStep(*model_, *optimizer_, state_);
    if (!saved.ok()) return saved;
    if (stop_signal_ != 0 && state_.step < total) return Preempt(Clock::now());
    double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    progress_.Draw(state_.step, first, total, elapsed);
  }
  progress_.Clear();
  absl::Status saved = checkpoints_->SaveFinal(*model_, *optimizer_, state_);
  if (!saved.ok()) return saved;
  return strategy_->AfterRun(model_.get());
}

}  // namespace muster::worker
