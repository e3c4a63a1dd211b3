// Pipeline parallelism: the ParallelStrategy (worker/strategy/strategy.h)
// that cuts the model into pipeline stages spread over pp ranks and runs a
// step as a schedule of micro-batches (docs/parallel.md, "Pipeline
// parallelism"). Composes with data parallelism: the dp ranks that run
// the same stages average their gradients (ddp) or shard their state
// (fsdp, "Sharding" below).
//
// Split. The model is cut into pp x V pipeline stages, each a contiguous
// range of blocks (V, the virtual stages per rank, is 1 except for
// interleaved 1F1B). Stage s runs on pipeline rank s % pp as its chunk
// s / pp (Megatron-LM's interleaved placement), each chunk a model part
// (GptModel::CreatePart; chunk 0 is the model Build returns). The
// first stage also runs the embedding, the last the final LayerNorm, the
// LM head and the loss. The ranges are given, or balanced by FLOPs with
// the head's classifier counted on the last stage (PipelineSplit). The LM
// head is the tied wte: the last rank keeps a copy of it, and after the
// backward passes the two copies' gradients (the encoder's share and the
// head's) are summed between the first and last rank, as Megatron-LM
// does, so the copies take the same AdamW step and stay bitwise equal.
//
// Schedule. The step's ForwardBackward runs this rank's list of
// parallel::BuildSchedule (gpipe, 1f1b, interleaved_1f1b or zb_h1):
// forwards and backwards of micro-batches into each chunk's activation
// slots (as many as the list holds at once; zb_h1 splits each backward
// into the input's gradient, sent on at once, and the weights', run later
// from what the first pass kept: GptModel::PartBackwardInput and
// PartBackwardWeight), and the activations and their gradients
// sent and received over the pipeline channels, tagged by stage and
// micro-batch. Sends run in the background while the rank computes, and
// each channel's next receive is posted as soon as the one before it is
// taken, so messages move while the rank computes.
//
// Channels. A process group runs its operations one at a time, and a Gloo
// send completes only once the receiver has posted the receive, so sends
// and receives to both neighbours in one group can wait for each other in
// a cycle (rank 0's queue blocked on sending activation 1 while rank 1's is
// blocked on sending gradient 0). Each direction between two neighbours
// is therefore a group of its own: the sender's queue holds only sends,
// the receiver's only receives, in the same order, so from the training
// threads every channel is a buffered FIFO, as the schedule simulator
// (parallel/pipeline_schedule.h) assumes. With V > 1 the channels form a
// ring: the last rank's chunks feed the first rank's next chunks.
//
// Storage and sharding (worker/strategy/pipeline/pipeline_state.h). A rank holds the
// parameters and gradients of the model stages it runs and nothing else;
// under parallel.strategy fsdp (dims.dp_shard above 1) the dp ranks that
// run the same stages shard that state at ZeRO-1, 2 or 3.
//
// Loss and norm. Only the last stage computes losses (StepLoss::count is
// 0 on other ranks). The gradient norm is the sum of each rank's stages'
// sums of squares over the pipeline group (the wte copy counted once, on
// the first rank).
//
// Checkpoints. Each rank writes its own stages' parameters and moments
// (the first rank writes wte; the last does not write its copy), or its
// slices of them when sharded, split between the ranks that hold the same
// state (the dp ranks, or the replicas of a shard); a resume loads what
// this rank keeps, the last rank's wte copy included, from a checkpoint of
// any layout.
//
// CPU only for now (model parts are). Errors: the groups'
// (parallel/process_group.h); a peer that dies fails this rank's next
// receive or send at once.
// Thread-safety: none; the training thread drives it.
#pragma once

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/collectives.h"
#include "parallel/parallel_dims.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/process_group.h"
#include "worker/strategy/pipeline/pipeline_state.h"
#include "worker/strategy/strategy.h"

namespace muster::worker {

// Blocks per pipeline stage for `config` cut into `stages` stages:
// `explicit_split` when given (INVALID_ARGUMENT naming parallel.pp_split
// unless it has `stages` positive entries summing to the layers), else the
// contiguous split that minimises the most FLOPs any stage runs, counting
// per token 24 C^2 for a block and 2 C Vp for the classifier on the last
// stage. INVALID_ARGUMENT naming parallel.pp when there are fewer blocks
// than stages.
absl::StatusOr<std::vector<int>> PipelineSplit(const ModelConfig& config, int stages,
                                               const std::vector<int>& explicit_split);

// The activation slots each of a rank's `chunks` (model parts) needs to
// run `actions`, its list under `pp` pipeline ranks (at least 1 each): the
// most micro-batches live on a chunk at once, from a micro-batch's first
// action on the chunk's stage to its last, as Pipeline runs them.
std::vector<int> PipelineSlots(const std::vector<parallel::PipelineAction>& actions, int pp,
                               int chunks);

// The groups a pipeline rank talks over; see "Channels" above. A channel
// is a 2-rank group whose rank 0 sends the activations (and receives the
// gradients): the lower pipeline rank, or the last one on the channel that
// closes the ring (V > 1) to the first. nullptr where the rank has no
// such neighbour.
struct PipelineGroups {
  parallel::ProcessGroup* activations_in = nullptr;   // from the previous rank
  parallel::ProcessGroup* activations_out = nullptr;  // to the next rank
  parallel::ProcessGroup* gradients_in = nullptr;     // from the next rank
  parallel::ProcessGroup* gradients_out = nullptr;    // to the previous rank
  // The pipeline's dims.pp ranks in stage order: the gradient norm.
  parallel::ProcessGroup* pipeline = nullptr;
  // The pipeline's first and last rank: the tied wte (nullptr when pp is 1,
  // and on the stages between).
  parallel::ProcessGroup* tied = nullptr;
  // The ranks running the same stages in the other pipelines that hold
  // the same shard: every dp rank unless sharded (nullptr when there is
  // no other: dims.dp_replicate is 1).
  parallel::ProcessGroup* replicate = nullptr;
  // The dp ranks a replica's state is sharded over (nullptr when
  // dims.dp_shard is 1).
  parallel::ProcessGroup* shard = nullptr;
};

struct PipelineOptions {
  parallel::ScheduleKind schedule = parallel::ScheduleKind::k1F1B;
  int virtual_stages = 1;  // V: stages per rank (interleaved_1f1b: 2 or more)
  std::vector<int> split;  // blocks per pipeline stage (pp x V); empty: balanced
  int zero = 3;            // the ZeRO stage when sharded (dims.dp_shard > 1): 1, 2 or 3
  // Each rank prints its memory line here after its first optimizer step:
  // what it keeps between steps (nullptr: nowhere).
  FILE* log = nullptr;
};

class Pipeline final : public ParallelStrategy {
 public:
  // `control`: the world, host memory. The groups are not owned; they
  // outlive this object and agree with `dims`.
  Pipeline(const PipelineGroups& groups, parallel::ProcessGroup* control,
           const parallel::ParallelDims& dims, const PipelineOptions& options, std::string backend);
  ~Pipeline() override;

  std::string Describe() const override;
  const parallel::ParallelDims& dims() const override { return dims_; }
  int rank() const override { return control_.rank(); }
  int dp_rank() const override { return dims_.Of(control_.rank()).dp; }
  parallel::Collectives& control() override { return control_; }
  absl::StatusOr<BuiltModel> Build(const BuildSpec& spec) override;
  absl::StatusOr<StepLoss> ForwardBackward(GptModel* model, const MicroBatches& batches) override;
  absl::StatusOr<StepLoss> ForwardOnly(GptModel* model, const MicroBatches& batches) override;
  void BeginBackward(GptModel* model, bool last) override {}  // the schedule runs backward
  absl::Status ReduceGradients(GptModel* model) override;
  absl::StatusOr<double> GradSumOfSquares(GptModel* model) override;
  absl::Status OptimizerStep(GptModel* model, AdamW* optimizer, float lr, int step,
                             float grad_scale) override;
  void ZeroGrad(GptModel* model) override;
  std::vector<std::vector<FlatRange>> CheckpointFiles(uint64_t total) const override;
  std::vector<FlatRange> CheckpointLoad(uint64_t total) const override;
  absl::Status StateLoaded(GptModel* model) override;
  // Nothing: each stage's ranks hold different parameters.
  absl::Status AfterRun(GptModel* model) override { return absl::OkStatus(); }

  // Blocks per pipeline stage, pp x V of them (after Build).
  const std::vector<int>& split() const { return split_; }
  // The most micro-batches this rank held activations for in a step,
  // counted once per chunk (virtual micro-batches).
  int peak_in_flight() const { return peak_in_flight_; }
  // The tied wte as this rank holds it (the first and the last rank; empty
  // elsewhere), gathered for the call when ZeRO-3 has released it: a
  // collective over the shard group (tests: the copies must be equal).
  absl::StatusOr<std::vector<float>> Wte();
  // The activation memory of every chunk this rank runs
  // (GptModel::ActivationBytes summed).
  size_t ActivationBytes() const;
  // When each action of the last ForwardBackward started and ended, in
  // seconds from its start (benchmarks: the idle time between computes).
  struct ActionTime {
    parallel::PipelineAction action;
    double start = 0, end = 0;
  };
  const std::vector<ActionTime>& last_step_times() const { return times_; }

 private:
  struct Chunk;

  int stage() const { return groups_.pipeline->rank(); }  // this rank's place in the pipeline
  bool first() const { return stage() == 0; }             // runs the embedding
  bool last() const { return stage() == groups_.pipeline->size() - 1; }  // runs the head
  int stages() const { return dims_.pp * options_.virtual_stages; }
  // Block range [first, end) of pipeline stage `s`.
  std::pair<int, int> Blocks(int s) const;
  // Runs `actions` (this rank's); `forward_only`: they have no backwards,
  // so a micro-batch leaves the in-flight count with its slot.
  // The model stages pipeline rank `p` runs, in order (stage 0 on the last
  // rank: the wte copy).
  std::vector<int> HeldStages(int p) const;
  // Drops the chunk's finished sends, returning the first error among
  // them; `wait`: waits for every send first.
  static absl::Status Sweep(Chunk* chunk, bool wait);
  absl::StatusOr<StepLoss> Run(const MicroBatches& batches,
                               const std::vector<parallel::PipelineAction>& actions,
                               bool forward_only);

  const PipelineGroups groups_;
  parallel::Collectives control_;
  const parallel::ParallelDims dims_;
  const PipelineOptions options_;
  const std::string backend_;
  GptModel* model_ = nullptr;
  std::vector<int> split_;
  std::vector<std::unique_ptr<Chunk>> chunks_;  // chunk c runs pipeline stage c * pp + stage()
  // The receive posted ahead on each incoming channel (activations,
  // gradients), into `buffer`; work is nullptr when none is.
  struct Posted {
    parallel::PipelineAction action;
    std::vector<float> buffer;
    std::shared_ptr<parallel::Work> work;
  };
  Posted posted_[2];
  std::unique_ptr<PipelineState> state_;  // after Build
  bool logged_memory_ = false;
  int peak_in_flight_ = 0;
  std::vector<ActionTime> times_;
};

}  // namespace muster::worker
