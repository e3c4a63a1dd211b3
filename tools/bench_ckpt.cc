// bench_ckpt: checkpoint save and load throughput against sequential `dd`
// to the same disk in the same run, and how much a training step stalls
// while an asynchronous save is in flight. A program, not a test:
//
//   bazel run -c opt //tools:bench_ckpt -- [--model gpt2_124m|small|tiny] [--dir D]
//
// State = weights + AdamW m + v (fp32): about 1.5 GB for GPT-2 124M.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "worker/checkpoint_manager.h"
#include "worker/data.h"
#include "worker/trainer.h"

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
  int stall_steps = 2;
  app.add_option("--model", model_name, "gpt2_124m | small | tiny")->capture_default_str();
  app.add_option("--dir", dir, "scratch directory on the disk to measure")->capture_default_str();
  app.add_option("--stall-steps", stall_steps, "baseline steps for the stall measure")
      ->capture_default_str();
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
  auto trainer = Trainer::Create(config, options);
  if (!trainer.ok()) return Fail(trainer.status());
  GptModel& model = *(*trainer)->model();
  AdamW& optimizer = *(*trainer)->optimizer();
  DataParallel world_of_one;
  CheckpointManager manager(config, &world_of_one, nullptr);
  const double bytes = 3.0 * model.CopyParamsToHost().size() * sizeof(float);
  std::printf("model %s: %.1fM parameters, state (weights + AdamW m, v) %.2f GB, dir %s\n",
              model_name.c_str(), model.num_parameters() / 1e6, bytes / 1e9, dir.c_str());

  // dd: the same number of bytes, written sequentially and fsynced.
  const long mib = static_cast<long>(bytes / (1 << 20)) + 1;
  std::string dd = absl::StrCat("dd if=/dev/zero of=", dir, "/dd.bin bs=1M count=", mib,
                                " conv=fsync status=none");
  auto start = Clock::now();
  if (std::system(dd.c_str()) != 0) return Fail(absl::InternalError("dd failed: " + dd));
  const double dd_gbs = mib * 1048576.0 / Since(start) / 1e9;
  std::filesystem::remove(dir + "/dd.bin");
  std::printf("dd write (conv=fsync)         %6.2f GB/s\n", dd_gbs);

  TrainState state = (*trainer)->state();
  double best_save = 0;
  for (int rep = 0; rep < 3; ++rep) {
    state.step = rep + 1;
    start = Clock::now();
    if (absl::Status s = manager.StartSave(model, optimizer, state); !s.ok()) return Fail(s);
    if (absl::Status s = manager.Finish(); !s.ok()) return Fail(s);
    best_save = std::max(best_save, bytes / Since(start) / 1e9);
  }
  std::printf("save (snapshot+write+commit)  %6.2f GB/s  = %3.0f%% of dd (best of 3)\n",
              best_save, 100 * best_save / dd_gbs);

  const bool dropped = DropPageCache();
  TrainConfig load_config = config;
  load_config.checkpoint.resume = config.checkpoint.dir + "/step_00000003";
  CheckpointManager loader(load_config, &world_of_one, nullptr);
  TrainState loaded;
  start = Clock::now();
  auto resumed = loader.Resume(&model, &optimizer, &loaded);
  if (!resumed.ok()) return Fail(resumed.status());
  const double load_gbs = bytes / Since(start) / 1e9;
  std::printf("load (read+CRC+copy in)       %6.2f GB/s  (%s)\n", load_gbs,
              dropped ? "page cache dropped first" : "page cache NOT dropped: cannot");

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
  start = Clock::now();
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
  std::printf("step %.3f s alone; snapshot %.3f s; %d step(s) overlapping the save took %.3f s "
              "with the snapshot: stall %.1f%%\n",
              baseline, snapshot, overlapped, during, 100 * stall);
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace muster::worker

int main(int argc, char** argv) { return muster::worker::Main(argc, argv); }
