// What every ranks-as-threads benchmark in tools/ needs before it starts.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace muster::tools {

// The in-process ranks must compute with one thread each, like launched
// workers; OpenMP and OpenBLAS read these variables when they load, before
// main(), hence one re-exec of this program with them set (none when
// OMP_NUM_THREADS is already set).
void OneThreadPerRank(char** argv);

// A file of this build, given its workspace-relative path: next to the
// binary's runfiles, or under bazel-bin. "" when neither exists.
std::string BuiltFile(const std::string& workspace_relative);

// A fresh directory /tmp/<prefix>XXXXXX for a benchmark's data; exits
// naming the error when none can be made (a benchmark has no way on).
std::string MakeTempDir(const std::string& prefix);

// A token shard at `path` of 2^20 uniformly random ids below `vocab`,
// the same for every run (a fixed seed): throughput benchmarks do not need
// text, only tokens in range.
absl::Status WriteRandomTokens(const std::string& path, int vocab);

// The median of `values` (the mean of the middle two for an even count);
// 0 for none.
double Median(std::vector<double> values);

// A steady_clock duration in milliseconds.
double Ms(std::chrono::steady_clock::duration duration);

}  // namespace muster::tools
