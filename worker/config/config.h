// train.yaml: what the worker trains, on what data, how.
//
// Every field has a default (see docs/yaml-schema.md); a yaml file sets
// what it needs. LoadConfig validates everything: an unknown key, a wrong
// type or an impossible value is INVALID_ARGUMENT whose message names the
// key path and the line, e.g.
//   train.yaml:7: model.heads: 5 does not divide model.dim 768
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muster::worker {

struct ModelConfig {
  int layers = 4;     // L
  int heads = 4;      // NH
  int dim = 256;      // C; heads must divide it
  int vocab = 256;    // V; padded to a multiple of 128 (Vp) in memory
  int seq_len = 128;  // T, the longest context (maxT)
  int padded_vocab() const { return (vocab + 127) / 128 * 128; }
};

struct DataConfig {
  std::string train;          // glob of llm.c token shards
  std::string val;            // glob; empty: no validation
  int micro_batch = 8;        // B, sequences per rank per micro-step
  int grad_accumulation = 1;  // micro-steps per optimizer step
};

struct OptimConfig {
  double lr = 3e-4;
  int warmup_steps = 0;
  std::string schedule = "cosine";  // cosine | constant
  double min_lr = 0.0;              // cosine decays to this
  double weight_decay = 0.0;        // decoupled; not on biases, LayerNorm, wpe
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // global-norm clip; 0 disables
};

struct TrainLoopConfig {
  int steps = 100;
  uint64_t seed = 1337;
  int log_every = 10;
  int eval_every = 0;  // 0: no evaluation
  int eval_batches = 4;
  std::string metrics_file;  // JSONL; empty: none
  // The model's passes captured once and replayed as CUDA graphs
  // (GptModel::EnableCudaGraphs); passes that a parallel strategy acts
  // between, and FSDP's, stay eager. auto: on wherever the device is CUDA;
  // true: the same, and an error with device cpu; false: never.
  std::string cuda_graphs = "auto";
};

struct ParallelConfig {
  // ddp: every rank holds the whole model. fsdp: parameters, gradients and
  // optimizer state are sharded over dp_shard ranks (ZeRO, `zero`), and
  // replicated over dp_replicate groups of them (HSDP when both exceed 1).
  // A single process is a world of 1 under either.
  std::string strategy = "ddp";
  // The ZeRO stage under fsdp: 1 shards the AdamW moments, 2 also the
  // gradients, 3 also the parameters. Ignored under ddp.
  int zero = 3;
  // Under ZeRO-3: true frees a stage's gathered parameters after its forward
  // and gathers them again for its backward (memory); false keeps them from
  // forward to backward (one all-gather per stage per micro-step fewer).
  bool reshard_after_forward = true;
  // The type FSDP all-gathers parameters in (gradients are always
  // reduce-scattered in fp32): auto (bf16 when precision is bf16, else
  // fp32) | fp32 | bf16. bf16 sends half the bytes, and the model then
  // computes with every parameter rounded to bf16 (LayerNorms and biases
  // too), as PyTorch FSDP2's param_dtype does; the master copy AdamW
  // updates stays fp32. Ignored under ddp.
  std::string gather_dtype = "auto";
  // Where gradients are reduced: auto (NCCL on CUDA, Gloo on the CPU) |
  // nccl | gloo (on CUDA: staged through pinned host memory).
  std::string backend = "auto";
  double bucket_mb = 25.0;
  // Bound on every collective (and on joining the peers): a peer that
  // hangs turns into an error after this long, and the launcher restarts
  // the job. A peer that dies is noticed at once (its sockets close).
  double timeout_s = 300.0;
  // The degrees of the world, dp_replicate x dp_shard x pp
  // (parallel/parallel_dims.h); 0 is "auto", resolved against the world by
  // ParallelDimsFor (worker/strategy/strategy.h): dp_shard is 1 under ddp and the rest of
  // the world under fsdp; dp_replicate is the rest of the world, or 1 under
  // fsdp when dp_shard is auto too. pp above 1 is pipeline parallelism
  // (worker/strategy/pipeline/pipeline.h), under ddp.
  int dp_replicate = 0;
  int dp_shard = 0;
  int pp = 1;
  // Under pp > 1: the pipeline schedule, gpipe | 1f1b | interleaved_1f1b |
  // zb_h1, and the micro-batches of a step (M; 0: data.grad_accumulation).
  std::string schedule = "1f1b";
  int microbatches = 0;
  // Under interleaved_1f1b: pipeline stages per rank (V >= 2; 0: auto, 2).
  // Every other schedule runs one per rank (0 or 1).
  int virtual_stages = 0;
  // Under pp > 1: blocks per pipeline stage, in stage order (pp x V
  // entries, each at least 1, summing to model.layers); empty: balanced
  // automatically (PipelineSplit, worker/strategy/pipeline/pipeline.h).
  std::vector<int> pp_split;
};

struct CheckpointConfig {
  std::string dir;  // empty: no checkpoints
  int every = 0;    // steps between saves; 0: never
  int keep_last = 3;
  int keep_every = 0;
  std::string resume = "auto";  // auto | never | <path>
  // Seconds rank 0 waits for dir's LOCK while a run on another host holds
  // it (worker/checkpoint/dir_lock.h), at most half of parallel.timeout_s;
  // 0: refuse at once.
  int lock_wait = 120;
};

struct TrainConfig {
  std::string source;  // the file it came from ("" if built in code)
  ModelConfig model;
  DataConfig data;
  OptimConfig optim;
  TrainLoopConfig train;
  std::string device = "auto";     // cpu | cuda | auto
  std::string precision = "auto";  // auto | fp32 | tf32 | bf16 (worker/model/model.h)
  // The CUDA model's attention (worker/model/model.h, Attention): auto
  // (cuDNN's in bf16 where it loads and takes the head size, else
  // muster's) | muster (muster's own kernels) | gemm (muster's GEMM
  // attention in every shape and precision: device cuda) | cudnn (cuDNN's
  // fused attention: device cuda, precision bf16, head size a multiple of
  // 8 up to 128).
  std::string attention = "auto";
  ParallelConfig parallel;
  CheckpointConfig checkpoint;
};

// Micro-batches per optimizer step: parallel.microbatches under pipeline
// parallelism when set, else data.grad_accumulation.
int MicroSteps(const TrainConfig& config);
// Pipeline stages per rank: parallel.virtual_stages, with 0 read as 2 under
// interleaved_1f1b and 1 otherwise.
int VirtualStages(const ParallelConfig& parallel);

// Reads and validates a yaml file. Relative data globs and paths resolve
// against the yaml file's directory. Then checks the resolved paths on the
// file system: train.metrics_file, which a run from step 0 truncates, may
// not be the config file itself, a file data.train or data.val matches, or
// checkpoint.dir or anything in it. The file is a regular one or a pipe
// being written; NOT_FOUND with the reason when it cannot be read,
// INVALID_ARGUMENT when it is not a config file (a directory, a device, a
// FIFO that nothing writes to, more than 1 MiB) or its config is wrong.
absl::StatusOr<TrainConfig> LoadConfig(const std::string& path);
// The same from text, without the checks on the file system; `name` is
// used in messages.
absl::StatusOr<TrainConfig> ParseConfig(const std::string& yaml_text, const std::string& name,
                                        const std::string& base_dir);

// What every world size must be a multiple of under this layout:
// dp_replicate x dp_shard x pp, an auto degree (0) counting as 1, so 1
// under plain DDP (ParallelDimsFor in worker/strategy resolves the auto
// degree against such a world). launch asks the rendezvous for rounds of
// these worlds only.
int64_t WorldSizeMultiple(const ParallelConfig& parallel);
// Whether no degree is auto, so that the world must be WorldSizeMultiple
// exactly rather than any multiple of it.
bool WorldSizeFixed(const ParallelConfig& parallel);

// The resolved config, every field, as yaml (worker --print-config).
std::string ConfigToYaml(const TrainConfig& config);

// A stable hash of the fields that fix the model's shape (checkpoints
// record it to refuse a checkpoint of another model).
uint64_t ModelConfigHash(const ModelConfig& model);

// One train.yaml field, as the field tables in config.cc define it (the same tables drive
// LoadConfig, ConfigToYaml and operator==). docs/yaml-schema.md's tables are checked against
// this list, and a tool can read or set a field by its path.
struct ConfigField {
  std::string path;  // "optim.lr"; a top-level string is just its key ("device")
  // integer | number | boolean | list of integers | string | string (glob) | string (path)
  std::string type;
  std::string default_text;  // the default, as ConfigToYaml writes it
  std::string description;
  bool required = false;           // no default: a file must set it (data.train)
  std::vector<std::string> words;  // a string's allowed words; empty: any string
  // The field's value in `config`, as ConfigToYaml writes it.
  std::function<std::string(const TrainConfig& config)> get;
  // Reads `yaml_value` (a scalar or a list, written as in a file) into the field with
  // LoadConfig's type check; INVALID_ARGUMENT naming the path otherwise. The checks of the value
  // itself (ranges, words, other fields) are LoadConfig's alone.
  std::function<absl::Status(const std::string& yaml_value, TrainConfig* config)> set;
};

// Every field, in the order ConfigToYaml writes them.
const std::vector<ConfigField>& ConfigFields();

// Field-by-field equality (every field, `source` included), e.g. to check
// that ConfigToYaml's output parses back to the same config.
bool operator==(const ModelConfig& a, const ModelConfig& b);
bool operator==(const DataConfig& a, const DataConfig& b);
bool operator==(const OptimConfig& a, const OptimConfig& b);
bool operator==(const TrainLoopConfig& a, const TrainLoopConfig& b);
bool operator==(const ParallelConfig& a, const ParallelConfig& b);
bool operator==(const CheckpointConfig& a, const CheckpointConfig& b);
bool operator==(const TrainConfig& a, const TrainConfig& b);

}  // namespace muster::worker
