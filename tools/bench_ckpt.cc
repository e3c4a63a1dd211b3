// bench_ckpt: checkpoint save and load throughput against sequential `dd`
// to the same disk in the same run, and how much a training step stalls
// while an asynchronous save is in flight. A program, not a test:
//
//   bazel run -c opt //tools:bench_ckpt -- [--model gpt2_124m|small|tiny] [--dir D]
//                                          [--rounds 3] [--stall-steps 2]
//
// State = weights + AdamW m + v (fp32): about 1.5 GB for GPT-2 124M.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/layout.h"
#include "worker/checkpoint/manifest.h"
#include "worker/checkpoint/reader.h"
#include "worker/data/data.h"
#include "worker/trainer/checkpoint_manager.h"
#include "worker/trainer/trainer.h"

namespace muster::worker {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool DropPageCache() {
  ::sync();
  FILE* file = std::fopen("/proc/sys/vm/drop_caches", "w");
  if (file == nullptr) return false;
  bool ok = std::fputs("3\n", file) >= 0;
  return std::fclose(file) == 0 && ok;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "bench_ckpt: %s\n", status.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  CLI::App app("bench_ckpt: checkpoint save/load GB/s vs dd, and the async-save step stall");
  std::string model_name = "gpt2_124m", dir = "/tmp/bench_ckpt";
  int stall_steps = 2, rounds = 3;
  app.add_option("--model", model_name, "gpt2_124m | small | tiny")->capture_default_str();
  app.add_option("--dir", dir, "scratch directory on the disk to measure")->capture_default_str();
  app.add_option("--stall-steps", stall_steps, "baseline steps for the stall measure")
      ->capture_default_str();
  app.add_option("--rounds", rounds, "repetitions of each throughput figure (median reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // figures appear as they come

  TrainConfig config;
  if (model_name == "gpt2_124m") {
    config.model = {12, 12, 768, 50257, 1024};
  } else if (model_name == "small") {
    config.model = {6, 8, 512, 50257, 512};
  } else if (model_name == "tiny") {
    config.model = {4, 4, 256, 256, 128};
  } else {
    std::fprintf(stderr, "bench_ckpt: --model %s: expected gpt2_124m, small or tiny\n",
                 model_name.c_str());
    return 2;
  }
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<uint16_t> tokens(200000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (i * 7919) % config.model.vocab;
  if (absl::Status s = WriteTokenShard(dir + "/train_000.bin", tokens); !s.ok()) return Fail(s);
  config.data.train = dir + "/train_*.bin";
  config.data.micro_batch = 1;
  config.device = "cpu";
  config.train.steps = 1000;
  config.checkpoint.dir = dir + "/ckpt";
  config.checkpoint.every = 1000000;  // saves are started by hand
  config.checkpoint.keep_last = 2;
  TrainerOptions options;
  options.log = std::tmpfile();
  // The trainer only makes the model and optimizer: the saves and loads
  // timed below are the managers', and each Resume takes the directory's
  // LOCK, which a trainer of this config would hold.
  TrainConfig model_only = config;
  model_only.checkpoint = {};
  auto trainer = Trainer::Create(model_only, options);
  if (!trainer.ok()) return Fail(trainer.status());
  GptModel& model = *(*trainer)->model();
  AdamW& optimizer = *(*trainer)->optimizer();
  SingleProcess world_of_one;
  CheckpointManager manager(config, &world_of_one, nullptr, Env::Default());
  const double bytes = 3.0 * model.CopyParamsToHost().size() * sizeof(float);
  std::printf("model %s: %.1fM parameters, state (weights + AdamW m, v) %.2f GB, dir %s\n",
              model_name.c_str(), model.num_parameters() / 1e6, bytes / 1e9, dir.c_str());

  // Each figure is the median of `rounds`; within a round the yardstick
  // and the measured operation run back to back, so load from elsewhere on
  // the machine falls on both alike.
  auto median = [](std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
  };
  auto time_command = [](const std::string& command) -> absl::StatusOr<double> {
    auto start = Clock::now();
    if (std::system(command.c_str()) != 0) return absl::InternalError("failed: " + command);
    return Since(start);
  };
  // dd: the same number of bytes, written sequentially and fsynced.
  const long mib = static_cast<long>(bytes / (1 << 20)) + 1;
  const std::string dd_file = dir + "/dd.bin";
  const std::string dd_write =
      absl::StrCat("dd if=/dev/zero of=", dd_file, " bs=1M count=", mib, " conv=fsync status=none");
  TrainState state = (*trainer)->state();
  std::vector<double> dd_write_gbs, save_gbs;
  // A save is timed to its commit. The retention that follows it (from the
  // third round on, deleting a 1.5 GB checkpoint: about 0.5 s of unlink on
  // the development disk) runs on a background thread in training; here it
  // is waited for after the timing, and shown, so that it does not overlap
  // the next round's dd.
  for (int round = 0; round < rounds; ++round) {
    auto seconds = time_command(dd_write);
    if (!seconds.ok()) return Fail(seconds.status());
    dd_write_gbs.push_back(mib * 1048576.0 / *seconds / 1e9);
    std::filesystem::remove(dd_file);
    state.step = round + 1;
    auto start = Clock::now();
    if (absl::Status s = manager.StartSave(model, optimizer, state); !s.ok()) return Fail(s);
    const double snapshot = Since(start);
    if (absl::Status s = manager.Finish(); !s.ok()) return Fail(s);
    const double save_seconds = Since(start);
    save_gbs.push_back(bytes / save_seconds / 1e9);
    auto retention_start = Clock::now();
    if (absl::Status s = manager.WaitForRetention(); !s.ok()) return Fail(s);
    const double retention_seconds = Since(retention_start);
    std::printf(
        "  round %d: dd write %.2f GB/s, save %.2f GB/s = %3.0f%% (snapshot %.3f s, "
        "write + commit %.3f s); then retention %.3f s\n",
        round + 1, dd_write_gbs.back(), save_gbs.back(),
        100 * save_gbs.back() / dd_write_gbs.back(), snapshot, save_seconds - snapshot,
        retention_seconds);
  }
  const double dd_write_median = median(dd_write_gbs), save_median = median(save_gbs);
  std::printf("dd write (conv=fsync)         %6.2f GB/s\n", dd_write_median);
  std::printf("save (snapshot+write+commit)  %6.2f GB/s  = %3.0f%% of dd write (best %.2f)\n",
              save_median, 100 * save_median / dd_write_median,
              *std::max_element(save_gbs.begin(), save_gbs.end()));

  // Load: dd reading the checkpoint's data file, the reader alone (read +
  // CRC into a host buffer) and a whole Resume (that plus the copy into
  // the model and optimizer), each after the same drop of the page cache.
  const std::string step_dir = config.checkpoint.dir + "/" + StepDirName(rounds);
  const std::string dd_read =
      absl::StrCat("dd if=", step_dir, "/", RankFileName(0), " of=/dev/null bs=1M status=none");
  TrainConfig load_config = config;
  load_config.checkpoint.resume = step_dir;
  auto manifest = ReadManifest(Env::Default(), step_dir);
  if (!manifest.ok()) return Fail(manifest.status());
  const std::vector<StateTensor> tensors = StateTensors(model.stages());
  const uint64_t floats = StateFloats(tensors);
  std::unique_ptr<float[]> host(new float[floats]);
  bool dropped = true;
  std::vector<double> dd_read_gbs, read_gbs, load_gbs;
  for (int round = 0; round < rounds; ++round) {
    dropped = DropPageCache() && dropped;
    auto seconds = time_command(dd_read);
    if (!seconds.ok()) return Fail(seconds.status());
    dd_read_gbs.push_back(bytes / *seconds / 1e9);
    dropped = DropPageCache() && dropped;
    auto start = Clock::now();
    if (absl::Status s =
            LoadFlatRange(Env::Default(), step_dir, *manifest, tensors, 0, floats, host.get());
        !s.ok()) {
      return Fail(s);
    }
    read_gbs.push_back(bytes / Since(start) / 1e9);
    dropped = DropPageCache() && dropped;
    CheckpointManager loader(load_config, &world_of_one, nullptr, Env::Default());
    TrainState loaded;
    start = Clock::now();
    auto resumed = loader.Resume(&model, &optimizer, &loaded);
    if (!resumed.ok()) return Fail(resumed.status());
    load_gbs.push_back(bytes / Since(start) / 1e9);
  }
  host.reset();
  const double dd_read_median = median(dd_read_gbs), load_median = median(load_gbs);
  const char* cache = dropped ? "page cache dropped first" : "page cache NOT dropped: cannot";
  std::printf("dd read (bs=1M)               %6.2f GB/s  (%s)\n", dd_read_median, cache);
  std::printf("read + CRC (LoadFlatRange)    %6.2f GB/s  = %3.0f%% of dd read\n", median(read_gbs),
              100 * median(read_gbs) / dd_read_median);
  std::printf(
      "load (read+CRC+copy in)       %6.2f GB/s  = %3.0f%% of dd read, %3.0f%% of dd "
      "write\n",
      load_median, 100 * load_median / dd_read_median, 100 * load_median / dd_write_median);

  // Stall: mean step time alone, then the step(s) that overlap a save.
  auto step_seconds = [&]() -> double {
    auto t = Clock::now();
    auto metrics = (*trainer)->Step();
    return metrics.ok() ? Since(t) : -1;
  };
  step_seconds();  // warm-up
  double baseline = 0;
  for (int i = 0; i < stall_steps; ++i) baseline += step_seconds();
  baseline /= stall_steps;
  state.step = 100;
  auto start = Clock::now();
  if (absl::Status s = manager.StartSave(model, optimizer, state); !s.ok()) return Fail(s);
  const double snapshot = Since(start);
  int overlapped = 0;
  double during = snapshot;
  // Steps run until the save is committed: AfterStep polls it without
  // blocking, as Trainer::Run does.
  state.step = 101;
  while (manager.last_committed_step() != 100) {
    during += step_seconds();
    ++overlapped;
    if (absl::Status s = manager.AfterStep(model, optimizer, state); !s.ok()) return Fail(s);
  }
  const double stall = during / (overlapped * baseline) - 1;
  std::printf(
      "step %.3f s alone; snapshot %.3f s; %d step(s) overlapping the save took %.3f s "
      "with the snapshot: stall %.1f%%\n",
      baseline, snapshot, overlapped, during, 100 * stall);
  if (absl::Status s = manager.WaitForRetention(); !s.ok()) return Fail(s);
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace muster::worker

int main(int argc, char** argv) { return muster::worker::Main(argc, argv); }
