// The `worker` program (worker_main.h): trains a train.yaml (usually
// started by `launch`), prints the resolved config, or samples text from a
// freshly trained model.
//
// Exit codes: 0 success; 2 a usage, config or data error (the message is
// one line on stderr); 75 (launcher::kPreemptedExitCode) preempted: a
// SIGTERM or SIGUSR1 stopped training after a step, whose checkpoint was
// committed, or came before training began (below, "Preemption"); 1 any
// other failure. A failure's message also goes to
// TORCHELASTIC_ERROR_FILE when the launcher set it; under a launcher, a
// failure that no restart can mend whose error file cannot be written (a
// full disk) exits 78 (launcher::kNotRestartableExitCode) instead of 1 or
// 2.
#include "worker/worker_main.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "launcher/worker_env.h"
#include "parallel/bootstrap.h"
#include "parallel/nccl/group.h"
#include "parallel/nccl/transport.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/reader.h"
#include "worker/config/config.h"
#include "worker/model/ops.h"
#include "worker/strategy/ddp/ddp.h"
#include "worker/strategy/fsdp/fsdp.h"
#include "worker/strategy/pipeline/pipeline.h"
#include "worker/trainer/config_agreement.h"
#include "worker/trainer/generate.h"
#include "worker/trainer/trainer.h"
#include "worker/trainer/training_settings.h"

namespace muster::worker {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Config and data mistakes are the user's to fix: exit 2, like a usage
// error. Anything else (out of memory, a diverged loss) is 1.
int ExitCodeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
      return kExitUsage;
    default:
      return kExitFailure;
  }
}

// torch's error file (torch.distributed.elastic's ErrorHandler format),
// which `launch` shows in its failure table. `restartable` false adds
// "restartable": "false" to extraInfo: the failure is the config's or the
// input's, which a restart of the job cannot mend, so `launch` fails the
// job at once instead of spending its restart budget on it. Returns why
// the file launch asked for was not written (a full disk; what was
// written of it is removed), or nullopt: written, or none asked for (no
// TORCHELASTIC_ERROR_FILE: not under a launcher; empty, for a restartable
// failure, whose exit code says all).
std::optional<std::string> WriteErrorFile(const std::string& message, bool restartable = true) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr) return std::nullopt;
  // launch leaves it empty for a rank whose log directory it could not
  // make (a full disk too), and has said so: only what the file would say
  // that the exit code does not (not restartable) is worth a word.
  if (*path == '\0') {
    if (restartable) return std::nullopt;
    return std::string("launch gave this rank no error file (it could not make its log directory)");
  }
  std::string escaped =
      absl::StrReplaceAll(message, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}, {"\t", "\\t"}});
  FILE* file = std::fopen(path, "w");
  if (file == nullptr) {
    return absl::StrCat("cannot write the error file ", path, ": ", std::strerror(errno));
  }
  const bool printed =
      std::fprintf(file, "{\"message\": {\"message\": \"%s\", \"extraInfo\": {%s}}}\n",
                   escaped.c_str(), restartable ? "" : "\"restartable\": \"false\"") >= 0;
  const int print_errno = errno;
  // fclose flushes: on a full disk that is where ENOSPC shows.
  const bool closed = std::fclose(file) == 0;
  if (printed && closed) return std::nullopt;
  const std::string why = absl::StrCat("cannot write the error file ", path, ": ",
                                       std::strerror(printed ? errno : print_errno));
  // Half a file would read as an unreadable report, which launch restarts.
  // Only a regular file: not a device the variable may name (a symbolic
  // link goes, not what it leads to).
  struct stat info;
  if (lstat(path, &info) == 0 && (S_ISREG(info.st_mode) || S_ISLNK(info.st_mode))) unlink(path);
  return why;
}

// Reports a failure and returns the exit code. When the failure is not
// restartable but launch asked for an error file that could not say so,
// the exit code says it instead: launcher::kNotRestartableExitCode.
int Fail(int code, const std::string& message, bool restartable = true) {
  std::fprintf(stderr, "worker: %s\n", message.c_str());
  const std::optional<std::string> unwritten = WriteErrorFile(message, restartable);
  if (!unwritten.has_value()) return code;
  if (restartable) {
    std::fprintf(stderr, "worker: %s\n", unwritten->c_str());
    return code;
  }
  std::fprintf(stderr, "worker: %s; exiting %d, which tells launch that no restart can mend this\n",
               unwritten->c_str(), launcher::kNotRestartableExitCode);
  return launcher::kNotRestartableExitCode;
}

// INVALID_ARGUMENT is a config or an input that is wrong (a bad key, ranks
// with different configs, a checkpoint of another model, a shard with a
// bad header, a checkpoint.dir through a file): restarting cannot mend it.
// Nor can it mend PERMISSION_DENIED (a directory not ours to write, a
// read-only mount) or a full file system (IsNoSpace: a checkpoint or the
// metrics file that does not fit), which every restart would meet again,
// after redoing the steps since the last checkpoint. NOT_FOUND (a file
// that is not there yet: a shared file system mounted late) and
// everything else may.
int Fail(const absl::Status& status) {
  return Fail(ExitCodeFor(status), std::string(status.message()),
              /*restartable=*/!absl::IsInvalidArgument(status) &&
                  !absl::IsPermissionDenied(status) && !IsNoSpace(status));
}

// Preemption. Once training runs, the handler only records the signal; the
// trainer polls it once per step (TrainerOptions::stop_signal), so the step
// under way finishes and its checkpoint is written by the training thread
// itself.
//
// Before the first step there is nothing to save, but the worker goes on
// starting: every rank then trains one step, agrees to stop and saves, so
// a preemption of some nodes stops the whole job cleanly. A start-up that
// cannot finish (its peers' agents were preempted before they started
// theirs, so it waits for peers who never come) must not outlast the
// launcher's grace, after which it is SIGKILLed and the preemption counts
// as not clean. So the first signal before training also arms an alarm at
// half the grace (MUSTER_PREEMPT_GRACE_S; 30 s without it), and if training
// has not begun when it rings the worker exits kPreemptedExitCode at once:
// nothing was trained since the last checkpoint, so nothing is lost.
volatile sig_atomic_t stop_signal = 0;
volatile sig_atomic_t training = 0;    // set just before the first step
unsigned int startup_deadline_s = 15;  // half the grace, read once at start

void RecordStopSignal(int signal_number) {
  if (stop_signal == 0 && training == 0) alarm(startup_deadline_s);
  stop_signal = signal_number;
}

// Async-signal-safe: write(2) and _exit(2) only.
void ExitIfStillStarting(int) {
  if (training != 0) return;
  static constexpr char kMessage[] =
      "worker: preempted before training began (still starting at half the preemption grace); "
      "nothing was trained since the last checkpoint, so nothing is lost\n";
  ssize_t ignored = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
  (void)ignored;
  _exit(launcher::kPreemptedExitCode);
}

sigset_t PreemptionSignalSet() {
  sigset_t set;
  sigemptyset(&set);
  for (int signal_number : launcher::kPreemptionSignals) sigaddset(&set, signal_number);
  return set;
}

// Unblocks what HoldPreemptionSignals blocked: a signal held meanwhile is
// delivered now, to the handlers installed or, outside training, to the
// default action.
void ReleasePreemptionSignals() {
  const sigset_t held = PreemptionSignalSet();
  sigprocmask(SIG_UNBLOCK, &held, nullptr);
}

void HandlePreemptionSignals() {
  double grace_s = 30;
  if (const char* text = std::getenv("MUSTER_PREEMPT_GRACE_S")) {
    double parsed = 0;
    if (absl::SimpleAtod(text, &parsed) && parsed > 0) grace_s = parsed;
  }
  startup_deadline_s = std::max(1u, static_cast<unsigned int>(grace_s / 2));
  struct sigaction action = {};
  action.sa_handler = RecordStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // reads, writes and waits carry on
  for (int signal_number : launcher::kPreemptionSignals) sigaction(signal_number, &action, nullptr);
  action.sa_handler = ExitIfStillStarting;
  sigaction(SIGALRM, &action, nullptr);
  ReleasePreemptionSignals();  // one held since the start is handled now
}

// Training begins: from now on a preemption signal is answered after a step.
void BeginTraining() {
  training = 1;
  alarm(0);
}

// A start-up that failed while a preemption signal was pending failed
// because of it, most likely (its peers were stopped before they
// connected), and nothing was trained: exit kPreemptedExitCode, as a
// preempted run does. A config or data error still exits 2.
int FailToStart(const absl::Status& status) {
  if (stop_signal != 0 && ExitCodeFor(status) == kExitFailure) {
    std::fprintf(stderr, "worker: preempted before training began (%s)\n",
                 std::string(status.message()).c_str());
    return launcher::kPreemptedExitCode;
  }
  return Fail(status);
}

// Run()'s outcome as an exit code: CANCELLED is a preemption, whose state
// is saved: a line on stderr, not an error file.
int Finish(const absl::Status& status) {
  if (status.ok()) return 0;
  if (absl::IsCancelled(status)) {
    std::fprintf(stderr, "worker: %s\n", std::string(status.message()).c_str());
    return launcher::kPreemptedExitCode;
  }
  return Fail(status);
}

// How this process trains: alone (a world of one) or as one DDP or FSDP
// rank whose peers it finds through the launcher's rendezvous round. Owns
// the communicator, which must outlive the trainer that uses `strategy`.
struct Parallelism {
  std::unique_ptr<parallel::Communicator> communicator;
  std::unique_ptr<ParallelStrategy> owned;
  std::string description;  // for the banner: the ranks, the GPU, the backend ("" alone)
  // Rank 0 over NCCL without the user's NCCL_DEBUG: NCCL's INIT log, read
  // after the first step for the transports (parallel/nccl/transport.h).
  std::optional<std::string> nccl_log;
  ParallelStrategy* strategy() const { return owned.get(); }  // nullptr: alone
};

// The watchdog's last resort (parallel/watchdog.h): the communicator was
// aborted, yet the process is still here seconds later. Exit now with the
// cause rather than wait on whatever is stuck.
void ExitStuck(const absl::Status& cause) {
  std::string message =
      absl::StrCat(cause.message(), " (still running after aborting the communicator: exiting)");
  std::fprintf(stderr, "worker: %s\n", message.c_str());
  if (const std::optional<std::string> unwritten = WriteErrorFile(message)) {
    std::fprintf(stderr, "worker: %s\n", unwritten->c_str());
  }
  std::fflush(nullptr);
  _exit(kExitFailure);
}

// The pipeline's groups (worker/strategy/pipeline/pipeline.h, PipelineGroups), each made
// with NewGroup in an order every member follows: the pipeline, the dp
// group, the tied ends, then the channels to the previous stage and to the
// next (a chain from stage 0, so no two ranks wait on different groups).
absl::StatusOr<std::unique_ptr<ParallelStrategy>> JoinPipeline(const TrainConfig& config,
                                                               const parallel::ParallelDims& dims,
                                                               const parallel::WorldInfo& world,
                                                               parallel::Communicator* communicator,
                                                               const std::string& backend) {
  using Dim = parallel::ParallelDims::Dim;
  const int rank = world.rank;
  const std::vector<int> stages = dims.GroupRanks(Dim::kPp, rank);
  const std::string name = dims.GroupName(Dim::kPp, rank);
  const int P = dims.pp, p = dims.Of(rank).pp;
  PipelineGroups groups;
  auto make = [&](const std::string& group, const std::vector<int>& ranks,
                  parallel::ProcessGroup** into) -> absl::Status {
    auto made = communicator->NewGroup(group, ranks);
    if (!made.ok()) return made.status();
    *into = *made;
    return absl::OkStatus();
  };
  absl::Status status = make(name, stages, &groups.pipeline);
  // The dp ranks of a stage: a replica's shard ranks (under fsdp), and the
  // replicas of each shard (every dp rank under ddp).
  for (auto [dim, into] :
       {std::pair{Dim::kDpShard, &groups.shard}, std::pair{Dim::kDpReplicate, &groups.replicate}}) {
    if (status.ok() && dims.GroupRanks(dim, rank).size() > 1) {
      status = make(dims.GroupName(dim, rank), dims.GroupRanks(dim, rank), into);
    }
  }
  if (status.ok() && (p == 0 || p == P - 1)) {
    status = make("tied." + name, {stages.front(), stages.back()}, &groups.tied);
  }
  PipelineOptions options;
  auto schedule = parallel::ParseSchedule(config.parallel.schedule);
  if (!schedule.ok()) return schedule.status();
  options.schedule = *schedule;
  options.virtual_stages = VirtualStages(config.parallel);
  options.split = config.parallel.pp_split;
  options.zero = config.parallel.zero;
  options.log = stdout;
  // The channels from rank q to rank q + 1 (worker/strategy/pipeline/pipeline.h, "Channels"),
  // and with virtual stages the one from the last rank back to the first,
  // made last: each rank makes its channels in ring order, so no two ranks
  // wait for each other on different ones.
  const bool ring = options.virtual_stages > 1 && P > 1;
  std::vector<int> channels = {p - 1, p};  // rank q's channel to the next rank
  if (ring && p == 0) channels.push_back(P - 1);
  for (int q : channels) {
    if (!status.ok() || q < 0 || (q == P - 1 && !ring)) continue;
    const int next = (q + 1) % P;
    const std::vector<int> pair = {stages[q], stages[next]};
    const bool sender = q == p;
    status = make(absl::StrCat("act.", name, ".", q), pair,
                  sender ? &groups.activations_out : &groups.activations_in);
    if (status.ok()) {
      status = make(absl::StrCat("grad.", name, ".", q), pair,
                    sender ? &groups.gradients_in : &groups.gradients_out);
    }
  }
  if (!status.ok()) return status;
  return std::unique_ptr<ParallelStrategy>(
      std::make_unique<Pipeline>(groups, &communicator->control_group(), dims, options, backend));
}

absl::StatusOr<Parallelism> JoinPeers(const TrainConfig& config) {
  auto world = parallel::WorldFromEnvironment();
  if (!world.ok()) return world.status();
  // The degrees must cover the world before anything connects.
  auto dims = ParallelDimsFor(config.parallel, world->world_size);
  if (!dims.ok()) return dims.status();
  auto device = ResolveDevice(config.device);
  if (!device.ok()) return device.status();
  Parallelism result;
  int cuda_device = 0;
  bool shares_gpu = false;
  if (*device == Device::kCuda) {
    // Before the model, cuBLAS or NCCL touch the GPU.
    auto choice = SelectCudaDevice(world->local_rank);
    if (!choice.ok()) return choice.status();
    cuda_device = choice->device;
    shares_gpu = world->local_rank >= choice->visible;
    if (shares_gpu) {
      std::fprintf(stderr, "worker: LOCAL_RANK %d shares CUDA device %d (%d visible)\n",
                   world->local_rank, cuda_device, choice->visible);
    }
  }
  const bool fsdp = config.parallel.strategy == "fsdp";
  const bool pipeline = dims->pp > 1;
  if (pipeline && *device == Device::kCuda) {
    // Model parts run on the CPU only (worker/model/model.h, CreatePart).
    return absl::InvalidArgumentError(
        "parallel.pp: pipeline stages run on the CPU in this build (device cpu); on CUDA they "
        "are planned");
  }
  // A world of one reduces nothing, unless a backend was asked for by name
  // (a world of one over NCCL must match one process bit for bit) or the
  // strategy is FSDP (whose checkpoints are written by shard).
  if (world->world_size == 1 && config.parallel.backend == "auto" && !fsdp) return result;
  auto backend = ChooseDataBackend(config.parallel.backend, *device);
  if (!backend.ok()) return backend.status();

  if (*backend == parallel::DataBackend::kNccl && world->rank == 0) {
    const char* tmp = std::getenv("TMPDIR");
    result.nccl_log = parallel::NcclTransportLog(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp");
  }
  parallel::CommunicatorOptions options;
  options.timeout = absl::Seconds(config.parallel.timeout_s);
  options.data_backend = *backend;
  options.cuda_device = cuda_device;
  options.compute_stream = nullptr;  // the CUDA engine runs on the default stream
  options.on_stuck = ExitStuck;
  auto communicator = parallel::Communicator::Connect(*world, options);
  if (!communicator.ok()) {
    std::string hint;
    if (*backend == parallel::DataBackend::kNccl && shares_gpu) {
      hint = "; NCCL refuses two ranks on one GPU: use parallel.backend: gloo to share one";
    }
    return absl::Status(
        communicator.status().code(),
        absl::StrCat("rank ", world->rank, " of ", world->world_size,
                     ": joining the peers: ", communicator.status().message(), hint));
  }
  result.communicator = *std::move(communicator);
  // The fields that shape the groups made next (pipeline and HSDP
  // sub-groups) must agree before any is made, or ranks wait on groups the
  // others never make. The trainer compares the rest (config_agreement.h).
  std::vector<ConfigLine> layout;
  for (ConfigLine& line : ComparedConfig(config, {{"device (resolved)", DeviceName(*device)}})) {
    if (absl::StartsWith(line.first, "parallel.") || absl::StartsWith(line.first, "device")) {
      layout.push_back(std::move(line));
    }
  }
  parallel::Collectives control(&result.communicator->control_group());
  if (absl::Status agreed = AgreeOnConfig(control, layout, config.source); !agreed.ok()) {
    return agreed;
  }
  std::string backend_name = DataBackendName(*backend);
  if (*backend == parallel::DataBackend::kNccl) {
    absl::StrAppend(&backend_name, " ", parallel::NcclVersionString());
  }
  if (pipeline) {
    auto built =
        JoinPipeline(config, *dims, *world, result.communicator.get(), DataBackendName(*backend));
    if (!built.ok()) return built.status();
    result.owned = *std::move(built);
    // The banner names the split, which Build decides: see Train.
    return result;
  }
  if (fsdp) {
    // HSDP: a sub-group per replica to shard over, and one per shard
    // index to average across replicas, created in the same order on
    // every rank, on the data backend (device memory on CUDA). Pure FSDP
    // shards over the world's data group.
    parallel::ProcessGroup* shard = &result.communicator->data_group();
    parallel::ProcessGroup* replicate = nullptr;
    if (dims->dp_replicate > 1) {
      using Dim = parallel::ParallelDims::Dim;
      for (Dim dim : {Dim::kDpShard, Dim::kDpReplicate}) {
        auto group = result.communicator->NewDataGroup(dims->GroupName(dim, world->rank),
                                                       dims->GroupRanks(dim, world->rank));
        if (!group.ok()) return group.status();
        (dim == Dim::kDpShard ? shard : replicate) = *group;
      }
    }
    FsdpOptions options;
    options.zero = config.parallel.zero;
    options.reshard_after_forward = config.parallel.reshard_after_forward;
    // Checked against auto|fp32|bf16 when the file loaded.
    options.gather = config.parallel.gather_dtype == "bf16"   ? GatherDtype::kBf16
                     : config.parallel.gather_dtype == "fp32" ? GatherDtype::kFp32
                                                              : GatherDtype::kAuto;
    options.log = stdout;
    result.owned = std::make_unique<Fsdp>(shard, replicate, &result.communicator->control_group(),
                                          *dims, options, backend_name);
    result.description = absl::StrCat(world->world_size, " rank(s), FSDP (ZeRO-",
                                      config.parallel.zero, ") over ", DataBackendName(*backend));
    if (dims->dp_replicate > 1) {
      absl::StrAppend(&result.description, ", ", dims->dp_replicate, " replicas x ", dims->dp_shard,
                      " shards");
    }
    return result;
  }
  result.owned = std::make_unique<Ddp>(&result.communicator->data_group(),
                                       &result.communicator->control_group(),
                                       BucketOptionsFor(config.parallel), backend_name);
  result.description = absl::StrCat(
      world->world_size, " rank(s), ",
      *device == Device::kCuda ? absl::StrCat("cuda:", cuda_device, " on rank 0, ") : "",
      "DDP over ", DataBackendName(*backend));
  if (*backend == parallel::DataBackend::kNccl) {
    absl::StrAppend(&result.description, " ", parallel::NcclVersionString());
  }
  return result;
}

void PrintBanner(Trainer& trainer, const std::string& parallelism, FILE* out) {
  const TrainConfig& config = trainer.config();
  const ModelConfig& m = config.model;
  const bool cuda = trainer.model()->device() == Device::kCuda;
  // On CUDA, which attention kernels ("muster flash", "cudnn", ...) and
  // whether passes are replayed as CUDA graphs (train.cuda_graphs; FSDP's
  // external storage keeps every pass eager: GptModel::EnableCudaGraphs).
  const bool graphs = config.train.cuda_graphs != "false" && config.parallel.strategy != "fsdp";
  const std::string attention = cuda ? absl::StrCat(" with ", trainer.model()->DescribeAttention(),
                                                    " attention", graphs ? " and CUDA graphs" : "")
                                     : "";
  std::fprintf(out,
               "worker: GPT-2 L=%d C=%d NH=%d T=%d V=%d (%.2fM parameters), B=%d x %d "
               "micro-steps, %d steps on %s in %s%s\n",
               m.layers, m.dim, m.heads, m.seq_len, m.vocab,
               trainer.model()->num_parameters() / 1e6, config.data.micro_batch, MicroSteps(config),
               config.train.steps, cuda ? "cuda" : "cpu",
               PrecisionName(trainer.model()->precision()), attention.c_str());
  if (!parallelism.empty()) std::fprintf(out, "worker: %s\n", parallelism.c_str());
  std::fprintf(out, "worker: MFU peak %s\n", trainer.peak_flops_description().c_str());
  std::fflush(out);
}

// A config that is valid but most likely not what was meant: a warning
// line, not an error (a short trial run of a long recipe is legitimate).
void WarnAboutSchedule(const TrainConfig& config) {
  const int warmup = config.optim.warmup_steps, steps = config.train.steps;
  if (warmup < steps) return;
  std::fprintf(stderr, "worker: warning: optim.warmup_steps %d is not below train.steps %d: %s\n",
               warmup, steps,
               warmup > steps ? "the run ends within its warmup and never reaches optim.lr"
                              : "the run reaches optim.lr only at its last step, with no decay");
  std::fflush(stderr);
}

int Train(const std::string& config_path, Env* env) {
  HandlePreemptionSignals();
  auto config = LoadConfig(config_path);
  if (!config.ok()) return Fail(config.status());
  WarnAboutSchedule(*config);
  auto parallelism = JoinPeers(*config);
  if (!parallelism.ok()) return FailToStart(parallelism.status());
  TrainerOptions options;
  options.progress_bar = isatty(STDERR_FILENO) == 1;
  options.env = env;
  options.strategy = parallelism->strategy();
  options.stop_signal = [] { return static_cast<int>(stop_signal); };
  // Under launch: the job and its round, which checkpoint.resume never
  // reads to tell a restart of the run from a fresh start.
  if (const char* job = std::getenv("MUSTER_JOB"); job != nullptr && *job != '\0') {
    uint64_t round = 0;
    const char* round_text = std::getenv("MUSTER_ROUND");
    if (round_text != nullptr && absl::SimpleAtoi(round_text, &round)) {
      options.run_job = job;
      options.run_round = round;
    }
  }
  if (parallelism->nccl_log.has_value()) {
    // NCCL connects its channels in the first collectives: after step one
    // the log names every transport.
    options.on_step = [path = *parallelism->nccl_log,
                       reported = false](const StepMetrics&) mutable {
      if (std::exchange(reported, true)) return;
      std::ifstream file(path);
      std::stringstream text;
      text << file.rdbuf();
      std::fprintf(
          stdout, "worker: NCCL transports: %s\n",
          parallel::DescribeNcclTransports(parallel::ParseNcclTransports(text.str())).c_str());
      std::fflush(stdout);
      std::remove(path.c_str());
    };
  }
  // cuDNN is loaded by the first step's attention: its version is known
  // only after that step.
  Trainer* started = nullptr;
  if ((config->attention == "cudnn" || config->attention == "auto") &&
      (options.strategy == nullptr || options.strategy->rank() == 0)) {
    options.on_step = [previous = std::move(options.on_step), &started,
                       reported = false](const StepMetrics& metrics) mutable {
      if (previous) previous(metrics);
      if (started == nullptr || std::exchange(reported, true)) return;
      if (started->model()->attention() != Attention::kCudnn) return;  // auto chose muster's
      std::fprintf(stdout, "worker: attention %s\n", started->model()->DescribeAttention().c_str());
      std::fflush(stdout);
    };
  }
  auto trainer = Trainer::Create(*config, options);
  if (!trainer.ok()) return FailToStart(trainer.status());
  started = trainer->get();
  const bool speaks = options.strategy == nullptr || options.strategy->rank() == 0;
  if (speaks && !options.run_job.empty() && config->checkpoint.dir.empty()) {
    // Under launch every restart starts the workers again: a failure, a
    // node joining or leaving, a preemption.
    std::fprintf(stdout,
                 "worker: warning: no checkpoint.dir, so a restart of job %s (a failure, a node "
                 "joining or leaving, a preemption) starts again at step 0\n",
                 options.run_job.c_str());
  }
  if (speaks) {
    if (parallelism->description.empty() && options.strategy != nullptr) {
      parallelism->description = absl::StrCat(options.strategy->dims().world(), " rank(s), ",
                                              options.strategy->Describe());
    }
    PrintBanner(**trainer, parallelism->description, stdout);
  }
  BeginTraining();
  return Finish((*trainer)->Run());
}

struct GenerateArgs {
  std::string config;
  GenerateOptions sample;
  int steps_before = -1;   // -1: the config's train.steps
  std::string checkpoint;  // load this instead of training
};

int Generate(const GenerateArgs& args, Env* env) {
  auto config = LoadConfig(args.config);
  if (!config.ok()) return Fail(config.status());
  // Before any data or checkpoint is read.
  if (absl::Status checked = CheckGenerateOptions(config->model, args.sample); !checked.ok()) {
    return Fail(checked);
  }
  // Without --checkpoint the model is trained here first. Its log goes
  // to stderr so stdout carries only the text, and it writes no metrics
  // file (that belongs to the training run).
  if (args.steps_before >= 0) config->train.steps = args.steps_before;
  CheckpointConfig& c = config->checkpoint;
  if (!args.checkpoint.empty()) {  // load it; train no steps
    c.resume = args.checkpoint;
    config->train.steps = 0;
  } else if (c.resume == "auto" && !c.dir.empty()) {
    // The run's checkpoints are read, never written: a run training
    // beside this one keeps its LOCK, its saves and its retention to
    // itself. The newest saved at or before the step to sample at, by a
    // run with the same settings (train.steps decides the schedule: a
    // checkpoint of a longer run is not a step of this one), saves
    // training those steps again, since a resume is bit-exact.
    const int steps = config->train.steps;
    const TrainingSettings settings = TrainingSettingsOf(*config);
    std::vector<std::string> skipped;
    std::optional<Manifest> other;  // the newest passed over for its settings
    auto latest = FindLatestValid(env, c.dir, &skipped, [&](const Manifest& m) {
      if (m.step > steps) return false;
      if (m.training == settings) return true;
      if (!other.has_value() || m.step > other->step) other = m;
      return false;
    });
    if (other.has_value() && (!latest.ok() || latest->step < other->step)) {
      std::fprintf(stderr,
                   "generate: passing over %s/%s: saved by a run with other training settings "
                   "(%s), so not a step of the model asked for\n",
                   c.dir.c_str(), StepDirName(other->step).c_str(),
                   DescribeSettingChanges(other->training, *config, other->step).c_str());
    }
    for (const std::string& why : skipped)
      std::fprintf(stderr, "generate: skipping %s\n", why.c_str());
    if (latest.ok()) {
      c.resume = latest->path;
    } else if (absl::IsNotFound(latest.status())) {
      c.resume = "never";
    } else {
      return Fail(latest.status());
    }
  }
  c.dir.clear();  // exactly the checkpoint chosen, and no saves
  c.every = 0;
  config->train.metrics_file.clear();
  config->train.eval_every = 0;
  TrainerOptions options;
  options.log = stderr;
  options.progress_bar = isatty(STDERR_FILENO) == 1;
  options.env = env;
  options.sample_only = !args.checkpoint.empty();  // no data read: data.train need not exist
  auto trainer = Trainer::Create(*config, options);
  if (!trainer.ok()) return Fail(trainer.status());
  PrintBanner(**trainer, "", stderr);
  absl::Status status = (*trainer)->Run();
  if (!status.ok()) return Fail(status);
  auto text = GenerateText((*trainer)->model(), args.sample);
  if (!text.ok()) return Fail(text.status());
  std::fwrite(text->data(), 1, text->size(), stdout);
  std::fputc('\n', stdout);
  return 0;
}

int Main(int argc, char** argv, Env* env) {
  CLI::App app("worker: train a GPT-2 from a train.yaml (usually started by `launch`)");
  std::string config_path;
  bool print_config = false;
  // The config as a positional or as --config, in both commands: docs and
  // habits from other tools use either.
  app.add_option("config,--config", config_path, "train.yaml to train");
  app.add_flag("--print-config", print_config, "Print the resolved config as yaml and exit");

  GenerateArgs gen;
  CLI::App* generate = app.add_subcommand(
      "generate", "Sample text from a checkpoint, or from the config's model trained first");
  generate->add_option("config,--config", gen.config, "train.yaml")->required();
  generate->add_option("--prompt", gen.sample.prompt, "Text to continue");
  generate->add_option("--tokens", gen.sample.tokens, "Bytes to sample")->capture_default_str();
  generate->add_option("--temperature", gen.sample.temperature, "0: greedy")->capture_default_str();
  // Read as text: CLI11 saturates an unsigned value out of range ("-1" and
  // 99999999999999999999 were both 2^64 - 1) instead of refusing it.
  std::string seed_text = absl::StrCat(gen.sample.seed);
  generate->add_option("--seed", seed_text, "Sampling seed, 0 to 2^64 - 1")->capture_default_str();
  CLI::Option* steps_before =
      generate
          ->add_option("--steps-before", gen.steps_before,
                       "Training steps before sampling (default: the config's train.steps)")
          ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  generate
      ->add_option("--checkpoint", gen.checkpoint,
                   "Sample from this checkpoint (a step_XXXXXXXX directory) instead of "
                   "training first")
      ->excludes(steps_before);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    int code = app.exit(error);
    return code == 0 ? 0 : kExitUsage;
  }
  // Only training answers a preemption signal; anything else ends on one.
  if (generate->parsed() || config_path.empty() || print_config) ReleasePreemptionSignals();

  if (generate->parsed()) {
    // `worker a.yaml generate b.yaml` or `worker --print-config generate
    // b.yaml`: what comes before the word generate would not be used.
    if (!config_path.empty() || print_config) {
      return Fail(kExitUsage,
                  absl::StrCat(print_config ? "--print-config" : config_path,
                               " before `generate` is not used: generate takes its config after "
                               "it (`worker generate CONFIG.yaml`)"));
    }
    if (generate->count("--checkpoint") > 0 && gen.checkpoint.empty()) {
      return Fail(kExitUsage, "--checkpoint '': expected a step_XXXXXXXX checkpoint directory");
    }
    if (!absl::SimpleAtoi(seed_text, &gen.sample.seed) || seed_text.empty() ||
        seed_text[0] == '+' || seed_text[0] == '-') {
      return Fail(kExitUsage,
                  absl::StrCat("--seed '", seed_text, "': expected an integer from 0 to ",
                               std::numeric_limits<uint64_t>::max()));
    }
    auto world = parallel::WorldFromEnvironment();
    if (!world.ok()) return Fail(world.status());
    if (world->world_size > 1) {
      return Fail(kExitUsage, absl::StrCat("generate runs in one process, not under WORLD_SIZE=",
                                           world->world_size));
    }
    return Generate(gen, env);
  }
  if (config_path.empty()) {
    return Fail(kExitUsage, "missing CONFIG.yaml; run `worker --help`");
  }
  if (print_config) {
    auto config = LoadConfig(config_path);
    if (!config.ok()) return Fail(config.status());
    std::fputs(ConfigToYaml(*config).c_str(), stdout);
    return 0;
  }
  return Train(config_path, env);
}

}  // namespace

void HoldPreemptionSignals() {
  const sigset_t held = PreemptionSignalSet();
  sigprocmask(SIG_BLOCK, &held, nullptr);
}

void WaitPassivelyUnlessChosen(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv);
  // exec failed: carry on with spinning threads.
}

int WorkerMain(int argc, char** argv, Env* env) {
  // Ops::Alloc reports the model's own buffers that do not fit; anything
  // else the worker allocates (per-layer tables, the data's index, a
  // string) throws std::bad_alloc, which would abort with a message of the
  // C++ runtime's and no error file. It fails as Ops::Alloc's does instead:
  // exit 1, restartable (the memory may be there after a restart).
  try {
    return Main(argc, argv, env);
  } catch (const std::bad_alloc&) {
    try {
      return Fail(kExitFailure,
                  "out of host memory: an allocation failed (std::bad_alloc); lower "
                  "data.micro_batch or model.seq_len, or the model's size");
    } catch (const std::bad_alloc&) {
      // Not even the message fits: what needs no allocation.
      std::fputs("worker: out of host memory: an allocation failed (std::bad_alloc)\n", stderr);
      return kExitFailure;
    }
  }
}

}  // namespace muster::worker
