// ckpt: inspect, check and convert muster checkpoints
// (docs/checkpoint-format.md).
//
//   ckpt ls DIR                      every checkpoint in DIR, oldest first, with its lineage
//   ckpt verify PATH                 manifest and every file's size and CRC-32
//   ckpt consolidate PATH -o FILE    the weights as one llm.c model file (v3, fp32)
//   ckpt diff A B                    the largest |a - b| of every tensor
//
// Exit codes: 0 success (diff: whatever the values' differences); 1 a
// checkpoint is missing, torn or corrupt, a write failed, or diff's two
// checkpoints hold different tensors or shapes; 2 bad usage. All file I/O
// but the model file's own writing goes through Env::Default().
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/files.h"
#include "worker/checkpoint/layout.h"
#include "worker/checkpoint/reader.h"
#include "worker/model/model.h"

namespace muster::worker {
namespace {

constexpr int kExitBad = 1;
constexpr int kExitUsage = 2;

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "ckpt: %s\n", std::string(status.message()).c_str());
  return kExitBad;
}

uint64_t TotalBytes(const Manifest& manifest) {
  uint64_t bytes = 0;
  for (const FileRecord& file : manifest.files) bytes += file.bytes;
  return bytes;
}

int List(Env* env, const std::string& dir) {
  std::error_code error;
  if (std::filesystem::exists(std::filesystem::path(dir) / "manifest.json", error)) {
    std::fprintf(stderr,
                 "ckpt: %s is one checkpoint (it has a manifest.json), not a directory of them: "
                 "`ckpt ls %s` lists it with the others, `ckpt verify %s` checks it\n",
                 dir.c_str(), std::filesystem::path(dir).parent_path().c_str(), dir.c_str());
    return kExitUsage;
  }
  auto entries = ListCheckpoints(env, dir);
  if (!entries.ok()) return Fail(entries.status());
  // The lineage tells runs apart in one directory (a run forked from another
  // run's step, or started afresh with resume: never); its first 8 digits.
  std::printf("%-14s %8s %12s %6s %10s %-8s  %s\n", "CHECKPOINT", "STEP", "SAMPLE", "WORLD", "MiB",
              "LINEAGE", "STATE");
  for (const CheckpointEntry& entry : *entries) {
    const std::string name = std::filesystem::path(entry.path).filename().string();
    auto manifest = ReadManifest(env, entry.path);
    if (!manifest.ok()) {
      std::printf("%-14s %8d %12s %6s %10s %-8s  %s\n", name.c_str(), entry.step, "-", "-", "-",
                  "-", std::string(manifest.status().message()).c_str());
      continue;
    }
    const std::string lineage = manifest->lineage.empty() ? "-" : manifest->lineage.substr(0, 8);
    // Resume orders by the name, so VerifyCheckpoint refuses a mismatch.
    const std::string state = manifest->step == entry.step
                                  ? "committed (ckpt verify checks the data)"
                                  : absl::StrCat("named for step ", entry.step, ", holds step ",
                                                 manifest->step, ": resume skips it");
    std::printf("%-14s %8d %12llu %6d %10.1f %-8s  %s\n", name.c_str(), manifest->step,
                static_cast<unsigned long long>(manifest->sample_index), manifest->world_size,
                TotalBytes(*manifest) / 1048576.0, lineage.c_str(), state.c_str());
  }
  if (entries->empty()) std::printf("(no checkpoints)\n");
  // What resume and retention pass over, named so that a listing accounts
  // for the directory's disk use (docs/checkpoint-format.md).
  std::vector<std::pair<std::string, const char*>> aside;
  for (auto it = std::filesystem::directory_iterator(dir, error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (absl::StartsWith(name, ".tmp_step_")) {
      aside.emplace_back(name, "a save in progress, or left by a crash: the next run removes it");
    } else if (absl::StartsWith(name, ".old_step_")) {
      aside.emplace_back(
          name, "a checkpoint being replaced, or left by a crash then: the next run removes it");
    } else if (absl::StartsWith(name, "step_") && absl::StrContains(name, ".lineage_")) {
      aside.emplace_back(name,
                         "another run's checkpoint kept aside: never resumed from or deleted; "
                         "`ckpt verify` takes it");
    }
  }
  std::sort(aside.begin(), aside.end());
  for (const auto& [name, what] : aside) std::printf("also %s: %s\n", name.c_str(), what);
  return 0;
}

int Verify(Env* env, const std::string& path) {
  auto manifest = VerifyCheckpoint(env, path);
  if (!manifest.ok()) return Fail(manifest.status());
  std::printf("%s: OK (step %d, %zu tensors, %zu files, %.1f MiB, saved by %d rank%s)\n",
              path.c_str(), manifest->step, manifest->tensors.size(), manifest->files.size(),
              TotalBytes(*manifest) / 1048576.0, manifest->world_size,
              manifest->world_size == 1 ? "" : "s");
  return 0;
}

int Consolidate(Env* env, const std::string& path, const std::string& out) {
  auto manifest = ReadManifest(env, path);
  if (!manifest.ok()) return Fail(manifest.status());
  auto model = GptModel::Create(manifest->model, 1, Device::kCpu);
  if (!model.ok()) return Fail(model.status());
  // Only the parameters: the files holding just moments are not read.
  std::vector<StateTensor> params;
  for (StateTensor& tensor : StateTensors((*model)->stages())) {
    if (tensor.name.rfind("params/", 0) == 0) params.push_back(tensor);
  }
  const uint64_t floats = StateFloats(params);
  std::vector<float> host(floats);
  absl::Status loaded = LoadFlatRange(env, path, *manifest, params, 0, floats, host.data());
  if (!loaded.ok()) return Fail(loaded);
  (*model)->CopyParamsFromHost(host);
  // Written beside `out`, made durable and renamed over it: a consolidate
  // that fails or dies part-way leaves an existing `out` whole. SaveLlmc
  // writes the file itself (stdio), hence the fsync by path.
  const std::string partial = out + ".partial";
  absl::Status saved = (*model)->SaveLlmc(partial);
  if (saved.ok()) saved = env->SyncFile(partial);
  if (saved.ok()) saved = env->RenameFile(partial, out);
  if (saved.ok()) {
    const std::string parent = std::filesystem::path(out).parent_path().string();
    saved = env->SyncDir(parent.empty() ? "." : parent);
  }
  if (!saved.ok()) {
    (void)env->RemoveFile(partial);  // may not exist: the error to report is `saved`
    return Fail(saved);
  }
  std::printf("%s: wrote %s (llm.c model v3 fp32, step %d, %.2fM parameters)\n", path.c_str(),
              out.c_str(), manifest->step, (*model)->num_parameters() / 1e6);
  return 0;
}

absl::StatusOr<std::vector<float>> LoadWhole(Env* env, const std::string& path,
                                             Manifest* manifest) {
  auto read = ReadManifest(env, path);
  if (!read.ok()) return read.status();
  *manifest = *std::move(read);
  std::vector<StateTensor> tensors = ManifestStateTensors(*manifest);
  std::vector<float> host(StateFloats(tensors));
  absl::Status loaded = LoadFlatRange(env, path, *manifest, tensors, 0, host.size(), host.data());
  if (!loaded.ok()) return loaded;
  return host;
}

int Diff(Env* env, const std::string& a_path, const std::string& b_path) {
  Manifest a, b;
  auto a_data = LoadWhole(env, a_path, &a);
  if (!a_data.ok()) return Fail(a_data.status());
  auto b_data = LoadWhole(env, b_path, &b);
  if (!b_data.ok()) return Fail(b_data.status());
  std::vector<StateTensor> a_tensors = ManifestStateTensors(a), b_tensors = ManifestStateTensors(b);
  std::printf("step %d vs step %d, sample index %llu vs %llu\n", a.step, b.step,
              static_cast<unsigned long long>(a.sample_index),
              static_cast<unsigned long long>(b.sample_index));
  std::printf("%-32s %14s\n", "TENSOR", "MAX |A-B|");
  double overall = 0;
  // Tensors that cannot be compared: the checkpoints are of other models.
  int only_in_one = 0, reshaped = 0;
  for (const StateTensor& ta : a_tensors) {
    auto tb = std::find_if(b_tensors.begin(), b_tensors.end(),
                           [&](const StateTensor& t) { return t.name == ta.name; });
    if (tb == b_tensors.end()) {
      std::printf("%-32s %14s\n", ta.name.c_str(), "only in A");
      ++only_in_one;
      continue;
    }
    if (tb->shape != ta.shape) {
      std::printf("%-32s %14s [%s] vs [%s]\n", ta.name.c_str(), "shapes differ",
                  absl::StrJoin(ta.shape, ",").c_str(), absl::StrJoin(tb->shape, ",").c_str());
      ++reshaped;
      continue;
    }
    double largest = 0;
    for (uint64_t i = 0; i < ta.count; ++i) {
      double d = std::fabs(static_cast<double>((*a_data)[ta.flat_begin + i]) -
                           (*b_data)[tb->flat_begin + i]);
      if (std::isnan(d)) d = INFINITY;
      largest = std::max(largest, d);
    }
    overall = std::max(overall, largest);
    std::printf("%-32s %14.6g\n", ta.name.c_str(), largest);
  }
  for (const StateTensor& tb : b_tensors) {
    if (a.Find(tb.name) == nullptr) {
      std::printf("%-32s %14s\n", tb.name.c_str(), "only in B");
      ++only_in_one;
    }
  }
  if (only_in_one > 0 || reshaped > 0) {
    // A maximum over the tensors that do compare would read as "identical"
    // to a script that checks the (all) line.
    std::printf("%-32s %14s\n", "(all)", reshaped > 0 ? "shapes differ" : "tensors differ");
    std::fprintf(stderr,
                 "ckpt: %s and %s are checkpoints of different models: %d tensor%s differ in "
                 "shape, %d %s in only one\n",
                 a_path.c_str(), b_path.c_str(), reshaped, reshaped == 1 ? "" : "s", only_in_one,
                 only_in_one == 1 ? "is" : "are");
    return kExitBad;
  }
  std::printf("%-32s %14.6g\n", "(all)", overall);
  return 0;
}

int Main(int argc, char** argv) {
  CLI::App app("ckpt: inspect, verify and convert muster checkpoints");
  app.require_subcommand(1);
  std::string dir, path, out, a, b;
  CLI::App* ls = app.add_subcommand("ls", "List the checkpoints in a directory");
  ls->alias("list");  // rdzvctl's word for the same thing
  ls->add_option("dir", dir, "checkpoint.dir")->required();
  CLI::App* verify = app.add_subcommand("verify", "Check a checkpoint's manifest and checksums");
  verify->add_option("path", path, "a step_XXXXXXXX directory")->required();
  CLI::App* consolidate =
      app.add_subcommand("consolidate", "Write the weights as one llm.c model file (v3, fp32)");
  consolidate->add_option("path", path, "a step_XXXXXXXX directory")->required();
  consolidate->add_option("-o,--output", out, "model file to write")->required();
  CLI::App* diff = app.add_subcommand("diff", "Largest absolute difference of every tensor");
  diff->add_option("a", a, "a checkpoint")->required();
  diff->add_option("b", b, "another checkpoint")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    int code = app.exit(error);
    return code == 0 ? 0 : kExitUsage;
  }
  Env* env = Env::Default();
  if (ls->parsed()) return List(env, dir);
  if (verify->parsed()) return Verify(env, path);
  if (consolidate->parsed()) {
    if (out.empty()) {
      std::fprintf(stderr, "ckpt: -o is empty: name the model file to write\n");
      return kExitUsage;
    }
    return Consolidate(env, path, out);
  }
  return Diff(env, a, b);
}

}  // namespace
}  // namespace muster::worker

int main(int argc, char** argv) { return muster::worker::Main(argc, argv); }
