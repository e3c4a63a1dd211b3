// What the benchmarks in tools/ share: setting up ranks as threads, data,
// the small GPT they train, running a program with its output to a log,
// and the statistics they print.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/config/config.h"

namespace muster::tools {

// The in-process ranks must compute with one thread each, like launched
// workers; OpenMP and OpenBLAS read these variables when they load, before
// main(), hence one re-exec of this program with them set (none when
// OMP_NUM_THREADS is already set).
void OneThreadPerRank(char** argv);

// A file of this build, given its workspace-relative path: in the binary's
// runfiles, under bazel-bin, or by its name beside the binary (a GPU
// bundle's bin/, scripts/gpu_bundle.sh). "" when none exists.
std::string BuiltFile(const std::string& workspace_relative);

// A fresh directory /tmp/<prefix>XXXXXX for a benchmark's data; exits
// naming the error when none can be made (a benchmark has no way on).
std::string MakeTempDir(const std::string& prefix);

// A token shard at `path` of 2^20 uniformly random ids below `vocab`,
// the same for every run (a fixed seed): throughput benchmarks do not need
// text, only tokens in range.
absl::Status WriteRandomTokens(const std::string& path, int vocab);

// The model bench_ddp and bench_fsdp train on the CPU: GPT L=4 C=256 NH=4
// T=128 V=256, `micro_batch` sequences per rank, DDP's parallel.bucket_mb
// `bucket_mb`.
worker::TrainConfig SmallGpt(int micro_batch, double bucket_mb);

// GPT-2 124M (L=12, C=768, NH=12, V=50257) at `seq_len` tokens,
// `micro_batch` sequences per rank, on the CPU.
worker::TrainConfig Gpt2Small(int seq_len, int micro_batch);

// The whole text of the file at `path` ("" if it cannot be read).
std::string Slurp(const std::string& path);

// Runs `argv` with this process's environment plus `extra_env`
// ("KEY=value"), stdout and stderr to the file `log`, and waits at most
// `limit`. INTERNAL naming the program, its exit code (or the limit) and
// the log's last `tail_chars` characters if it fails or runs past it
// (its process group is killed then).
absl::Status RunLogged(const std::vector<std::string>& argv, const std::string& log,
                       absl::Duration limit, const std::vector<std::string>& extra_env = {},
                       size_t tail_chars = 600);

// The median of `values` (the mean of the middle two for an even count);
// 0 for none.
double Median(std::vector<double> values);

// A steady_clock duration in milliseconds.
double Ms(std::chrono::steady_clock::duration duration);

}  // namespace muster::tools
