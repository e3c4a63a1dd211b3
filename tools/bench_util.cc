#include "tools/bench_util.h"

#include <algorithm>

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "worker/data/data.h"

namespace muster::tools {

void OneThreadPerRank(char** argv) {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return;
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  setenv("OMP_WAIT_POLICY", "passive", 0);
  execv("/proc/self/exe", argv);
}

std::string BuiltFile(const std::string& workspace_relative) {
  std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  for (const std::filesystem::path& candidate :
       {std::filesystem::path(self.string() + ".runfiles/muster") / workspace_relative,
        self.parent_path().parent_path() / workspace_relative}) {
    if (access(candidate.c_str(), R_OK) == 0) return candidate.string();
  }
  return "";
}

std::string MakeTempDir(const std::string& prefix) {
  std::string name = "/tmp/" + prefix + "XXXXXX";
  if (mkdtemp(name.data()) == nullptr) {
    std::fprintf(stderr, "cannot make a directory %s: %s\n", name.c_str(), std::strerror(errno));
    std::exit(1);
  }
  return name;
}

absl::Status WriteRandomTokens(const std::string& path, int vocab) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> token(0, vocab - 1);
  std::vector<uint16_t> tokens(1 << 20);
  for (uint16_t& value : tokens) value = static_cast<uint16_t>(token(rng));
  return worker::WriteTokenShard(path, tokens);
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

double Ms(std::chrono::steady_clock::duration duration) {
  return std::chrono::duration<double, std::milli>(duration).count();
}

}  // namespace muster::tools
