#include "worker/config/validate.h"

#include <fnmatch.h>
#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "worker/config/walk.h"

namespace muster::worker::config_detail {
namespace {

namespace fs = std::filesystem;

// One file by any spelling: the same inode where both exist (hard and
// symbolic links, "..", another relative form), else the same path once
// symbolic links and ".." are resolved.
bool SameFile(const std::string& a, const std::string& b) {
  struct stat info_a, info_b;
  if (stat(a.c_str(), &info_a) == 0 && stat(b.c_str(), &info_b) == 0) {
    return info_a.st_dev == info_b.st_dev && info_a.st_ino == info_b.st_ino;
  }
  std::error_code error_a, error_b;
  const fs::path canonical_a = fs::weakly_canonical(a, error_a);
  const fs::path canonical_b = fs::weakly_canonical(b, error_b);
  return !error_a && !error_b && canonical_a == canonical_b;
}

// A path with symbolic links and ".." resolved, and no trailing separator.
std::optional<fs::path> Canonical(const std::string& path) {
  std::error_code error;
  fs::path canonical = fs::weakly_canonical(path, error).lexically_normal();
  if (error) return std::nullopt;
  if (canonical.filename().empty() && canonical.has_parent_path()) {
    canonical = canonical.parent_path();
  }
  return canonical;
}

// `path` is `dir` or lies somewhere under it.
bool WithinDir(const std::string& path, const std::string& dir) {
  const std::optional<fs::path> inner = Canonical(path), outer = Canonical(dir);
  if (!inner || !outer) return false;
  auto at = inner->begin();
  for (const fs::path& part : *outer) {
    if (at == inner->end() || *at != part) return false;
    ++at;
  }
  return true;
}

// Whether `pattern` matches `path`: by name (a file not written yet that a
// later run would read as a shard), or as one of the files it matches now.
bool GlobMatches(const std::string& pattern, const std::string& path) {
  if (pattern.empty()) return false;
  if (fnmatch(pattern.c_str(), path.c_str(), FNM_PATHNAME) == 0) return true;
  glob_t matches;
  bool found = false;
  if (::glob(pattern.c_str(), 0, nullptr, &matches) == 0) {
    for (size_t i = 0; i < matches.gl_pathc && !found; ++i) {
      found = SameFile(path, matches.gl_pathv[i]);
    }
  }
  ::globfree(&matches);
  return found;
}

}  // namespace

absl::Status ValidatePaths(const TrainConfig& config, const ConfigReader& reader,
                           const std::string& config_file) {
  const std::string& metrics = config.train.metrics_file;
  if (metrics.empty()) return absl::OkStatus();
  auto fail = [&](const std::string& what) {
    return reader.Error(reader.LineFor({"train.metrics_file"}), "train.metrics_file",
                        absl::StrCat("'", metrics, "' ", what));
  };
  if (!config_file.empty() && SameFile(metrics, config_file)) {
    return fail("is the config file itself; the metrics file would overwrite it");
  }
  for (const auto& [field, pattern] :
       {std::pair<const char*, const std::string&>{"data.train", config.data.train},
        std::pair<const char*, const std::string&>{"data.val", config.data.val}}) {
    if (!GlobMatches(pattern, metrics)) continue;
    std::error_code error;
    if (fs::exists(metrics, error)) {
      return fail(absl::StrCat("is a shard of ", field, " ('", pattern,
                               "'); the metrics file would overwrite it"));
    }
    return fail(absl::StrCat("matches ", field, " ('", pattern,
                             "'); the run would read its own metrics file as a shard"));
  }
  const std::string& dir = config.checkpoint.dir;
  if (!dir.empty() && WithinDir(metrics, dir)) {
    if (WithinDir(dir, metrics)) {
      return fail("is checkpoint.dir itself; keep the metrics file outside it");
    }
    return fail(absl::StrCat("is inside checkpoint.dir ('", dir,
                             "'), whose files are the checkpoints' and their LOCK; the metrics "
                             "file would overwrite one, so keep it outside"));
  }
  return absl::OkStatus();
}

absl::Status Validate(const TrainConfig& config, const ConfigReader& reader) {
  auto fail = [&](const std::string& path, const std::string& what,
                  std::initializer_list<std::string> also = {}) {
    std::vector<std::string> paths = {path};
    paths.insert(paths.end(), also.begin(), also.end());
    return reader.Error(reader.LineFor(paths), path, what);
  };
  absl::Status own = absl::OkStatus();
  ForEachScalar(config, "", [&](const std::string& path, const Rule& rule, const auto& value) {
    if (!own.ok()) return;
    if (std::optional<std::string> what = CheckValue(rule, value, reader.TextFor(path))) {
      own = fail(path, *what);
    }
  });
  if (!own.ok()) return own;

  const ModelConfig& m = config.model;
  const DataConfig& d = config.data;
  const OptimConfig& o = config.optim;
  const TrainLoopConfig& t = config.train;
  const CheckpointConfig& c = config.checkpoint;
  if (m.dim % m.heads != 0) {
    return fail("model.heads", absl::StrCat(m.heads, " does not divide model.dim ", m.dim),
                {"model.dim"});
  }
  if (o.min_lr > o.lr) {
    return fail("optim.min_lr", absl::StrCat(o.min_lr, " is above optim.lr ", o.lr), {"optim.lr"});
  }
  if (t.eval_every > 0 && d.val.empty()) {
    return fail("train.eval_every", "evaluation needs data.val (a glob of token shards)");
  }
  // Only an explicit cpu is known here; with device auto the same mistake
  // surfaces when the trainer resolves both (ResolvePrecision).
  if (config.device == "cpu" && (config.precision == "tf32" || config.precision == "bf16")) {
    return fail("precision",
                absl::StrCat(config.precision, " needs device cuda; the CPU computes in fp32 only"),
                {"device"});
  }
  // train.cuda_graphs: the CUDA model's (GptModel::EnableCudaGraphs). An
  // explicit true asks for them; with device auto on a machine without a
  // GPU it has nothing to act on, and is ignored, as auto always is there.
  if (config.train.cuda_graphs == "true" && config.device == "cpu") {
    return fail("train.cuda_graphs", "true needs device cuda; the CPU runs no CUDA graphs",
                {"device"});
  }
  // attention: cudnn is cuDNN's fused attention (kernels/fast/cudnn_attention.h),
  // which the CUDA model alone runs, on bf16 activations. As with precision,
  // only an explicit cpu is known here; device auto on a machine without a
  // GPU, or a config built in code, meets ResolveAttention
  // (worker/model/model.h) when the trainer resolves the device.
  if (config.attention == "gemm" && config.device == "cpu") {
    return fail("attention", "gemm needs device cuda; the CPU runs muster's own attention",
                {"device"});
  }
  if (config.attention == "cudnn") {
    if (config.device == "cpu") {
      return fail("attention", "cudnn needs device cuda; the CPU runs muster's own attention",
                  {"device"});
    }
    // auto is bf16 on CUDA, the only device cudnn runs on.
    if (config.precision == "fp32" || config.precision == "tf32") {
      return fail("attention",
                  absl::StrCat("cudnn needs precision bf16 (or auto, bf16 on CUDA), not ",
                               config.precision),
                  {"precision"});
    }
    // The rule of CudnnAttentionSupports (kernels/fast/cudnn_attention.h),
    // restated: kernels/fast is built only under --config=cuda, and this
    // check runs in every build. Keep the two in step.
    const int head_size = m.dim / m.heads;
    if (head_size % 8 != 0 || head_size > 128) {
      return fail("attention",
                  absl::StrCat("cudnn needs a head size (model.dim / model.heads) that is a "
                               "multiple of 8 and at most 128; ",
                               m.dim, " / ", m.heads, " is ", head_size),
                  {"model.dim", "model.heads"});
    }
  }
  if (config.device == "cpu" && config.parallel.backend == "nccl") {
    return fail("parallel.backend",
                "nccl needs device cuda; on the CPU gradients are reduced over gloo", {"device"});
  }
  // The degrees' product is checked against the world when the worker
  // joins its peers (ParallelDimsFor, worker/strategy/strategy.h): the world size is not
  // known here. What no world can fix is refused now.
  const ParallelConfig& p = config.parallel;
  if (p.strategy == "ddp" && p.dp_shard > 1) {
    return fail("parallel.dp_shard",
                absl::StrCat(p.dp_shard,
                             " shards each replica, which needs parallel.strategy: fsdp; ddp "
                             "replicates the whole model: 0 (auto) or 1"),
                {"parallel.strategy"});
  }
  // bf16 gathers are Fsdp's (worker/strategy/fsdp): DDP gathers nothing,
  // and a pipeline stage's shards gather in fp32 (pipeline_state.cc). An
  // explicit bf16 that would change nothing is refused rather than ignored.
  if (p.gather_dtype == "bf16" && p.strategy == "ddp") {
    return fail("parallel.gather_dtype",
                "bf16 all-gathers fsdp's parameters, which needs parallel.strategy: fsdp; ddp "
                "gathers none",
                {"parallel.strategy"});
  }
  if (p.gather_dtype == "bf16" && p.pp > 1) {
    return fail("parallel.gather_dtype",
                absl::StrCat("bf16 with parallel.pp ", p.pp,
                             ": a pipeline stage's shards are gathered in fp32; use fp32 or auto"),
                {"parallel.pp"});
  }
  const bool interleaved = p.schedule == "interleaved_1f1b";
  const int V = VirtualStages(p);
  if (interleaved && V < 2) {
    return fail("parallel.virtual_stages",
                absl::StrCat(V,
                             " with interleaved_1f1b, which runs 2 or more pipeline stages per "
                             "rank (0: auto, 2)"),
                {"parallel.schedule"});
  }
  if (!interleaved && V != 1) {
    return fail("parallel.virtual_stages",
                absl::StrCat(V, " with parallel.schedule ", p.schedule,
                             ", which runs one pipeline stage per rank: 0 or 1, or use "
                             "interleaved_1f1b"),
                {"parallel.schedule"});
  }
  // Ignored without a pipeline, as parallel.microbatches would be (below):
  // refused alike, rather than run as something else unseen.
  if (interleaved && p.pp < 2) {
    return fail(
        "parallel.schedule",
        absl::StrCat("interleaved_1f1b runs ", V,
                     " pipeline stages per rank, which needs parallel.pp above 1 (it is ", p.pp,
                     "); without a pipeline leave parallel.schedule and "
                     "parallel.virtual_stages unset"),
        {"parallel.pp", "parallel.virtual_stages"});
  }
  // In 64 bits: pp x virtual_stages of two 32-bit fields wrapped negative
  // (and then passed, to fail later with a false message).
  const int64_t stages = static_cast<int64_t>(p.pp) * V;
  if (p.pp > 1) {
    if (stages > config.model.layers) {
      return fail("parallel.pp",
                  absl::StrCat(
                      stages, " pipeline stages",
                      V > 1 ? absl::StrCat(" (", p.pp, " ranks x ", V, " virtual stages)") : "",
                      " for ", config.model.layers, " blocks (model.layers): each stage needs one"),
                  {"model.layers", "parallel.virtual_stages"});
    }
    if (p.microbatches > 0 && config.data.grad_accumulation > 1) {
      return fail("data.grad_accumulation",
                  absl::StrCat(config.data.grad_accumulation, " with parallel.microbatches ",
                               p.microbatches,
                               ": a pipeline's micro-batches per step are parallel.microbatches "
                               "alone; leave data.grad_accumulation at 1"),
                  {"parallel.microbatches"});
    }
    const int M = MicroSteps(config);
    if (p.schedule != "gpipe" && M < p.pp) {
      return fail(
          "parallel.microbatches",
          absl::StrCat(M,
                       " micro-batches per step (parallel.microbatches, or "
                       "data.grad_accumulation when it is 0) is fewer than parallel.pp (",
                       p.pp, "): ", p.schedule, " never fills the pipeline; use more, or gpipe"),
          {"parallel.pp"});
    }
    if (interleaved && M % p.pp != 0) {
      return fail(
          "parallel.microbatches",
          absl::StrCat(M, " micro-batches per step is not a multiple of parallel.pp (", p.pp,
                       "): interleaved_1f1b sends micro-batches round in groups of pp"),
          {"parallel.pp"});
    }
  }
  // Ignored, it would change the global batch unseen (a pipeline's config
  // run with pp: 1, or resumed without the pipeline).
  if (p.pp < 2 && p.microbatches > 0) {
    return fail("parallel.microbatches",
                absl::StrCat(p.microbatches,
                             " sets a pipeline's micro-batches per step, which needs parallel.pp "
                             "above 1 (it is ",
                             p.pp,
                             "); without a pipeline the micro-batches per step are "
                             "data.grad_accumulation: set that, and leave this at 0"),
                {"parallel.pp"});
  }
  if (!p.pp_split.empty()) {
    const std::string split = WriteScalar(p.pp_split);
    if (p.pp < 2) {
      return fail("parallel.pp_split",
                  absl::StrCat(split, " splits a pipeline, which needs parallel.pp above 1 (it is ",
                               p.pp, "); leave it empty ([])"),
                  {"parallel.pp"});
    }
    if (static_cast<int64_t>(p.pp_split.size()) != stages) {
      return fail("parallel.pp_split",
                  absl::StrCat(split, " has ", p.pp_split.size(),
                               " entries; expected one per pipeline stage, parallel.pp ", p.pp,
                               V > 1 ? absl::StrCat(" x parallel.virtual_stages ", V) : ""),
                  {"parallel.pp"});
    }
    int64_t blocks = 0;
    for (size_t i = 0; i < p.pp_split.size(); ++i) {
      if (p.pp_split[i] < 1) {
        return fail("parallel.pp_split",
                    absl::StrCat(split, ": entry ", i + 1, " is ", p.pp_split[i],
                                 "; each stage needs at least 1 block"));
      }
      blocks += p.pp_split[i];
    }
    if (blocks != m.layers) {
      return fail(
          "parallel.pp_split",
          absl::StrCat(split, " sums to ", blocks, " blocks, but model.layers is ", m.layers),
          {"model.layers"});
    }
  }
  if (c.every > 0 && c.dir.empty()) {
    return fail("checkpoint.every", "saving checkpoints needs checkpoint.dir");
  }
  if (!c.dir.empty() && c.every > 0 && c.keep_last < 2) {
    return fail("checkpoint.keep_last",
                absl::StrCat(c.keep_last,
                             " is too few while checkpoints are on; keep at "
                             "least 2, so that one survives a bad newest one"),
                {"checkpoint.every", "checkpoint.dir"});
  }
  return absl::OkStatus();
}
}  // namespace muster::worker::config_detail
