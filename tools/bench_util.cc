#include "tools/bench_util.h"

#include <algorithm>

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "launcher/process.h"
#include "launcher/worker_env.h"
#include "worker/data/data.h"

namespace muster::tools {

void OneThreadPerRank(char** argv) {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return;
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  setenv("OMP_WAIT_POLICY", "passive", 0);
  execv("/proc/self/exe", argv);
}

worker::TrainConfig SmallGpt(int micro_batch, double bucket_mb) {
  worker::TrainConfig config;
  config.model.layers = 4;
  config.model.dim = 256;
  config.model.heads = 4;
  config.model.vocab = 256;
  config.model.seq_len = 128;
  config.data.micro_batch = micro_batch;
  config.device = "cpu";
  config.parallel.bucket_mb = bucket_mb;
  return config;
}

worker::TrainConfig Gpt2Small(int seq_len, int micro_batch) {
  worker::TrainConfig config;
  config.model = {12, 12, 768, 50257, seq_len};  // layers, heads, dim, vocab, seq_len
  config.data.micro_batch = micro_batch;
  config.device = "cpu";
  return config;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::Status RunLogged(const std::vector<std::string>& argv, const std::string& log,
                       absl::Duration limit, const std::vector<std::string>& extra_env,
                       size_t tail_chars) {
  launcher::SpawnSpec spec;
  spec.argv = {"/bin/sh", "-c", "exec \"$0\" \"$@\" >\"$BENCH_LOG\" 2>&1"};
  spec.argv.insert(spec.argv.end(), argv.begin(), argv.end());
  for (const auto& [key, value] : launcher::CurrentEnvironment()) {
    spec.env.push_back(key + "=" + value);
  }
  spec.env.push_back("BENCH_LOG=" + log);
  spec.env.insert(spec.env.end(), extra_env.begin(), extra_env.end());
  auto child = launcher::Child::Spawn(spec);
  if (!child.ok()) return child.status();
  auto exit = child->WaitFor(limit);
  if (exit.has_value() && exit->Succeeded()) return absl::OkStatus();
  std::string text = Slurp(log);
  if (text.size() > tail_chars) text = "..." + text.substr(text.size() - tail_chars);
  return absl::InternalError(
      absl::StrCat(argv[0],
                   exit.has_value() ? absl::StrCat(" exited with code ", exit->ShellCode())
                                    : absl::StrCat(" ran past ", absl::FormatDuration(limit)),
                   "; log ", log, ":\n", text));
}

std::string BuiltFile(const std::string& workspace_relative) {
  std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  for (const std::filesystem::path& candidate :
       {std::filesystem::path(self.string() + ".runfiles/muster") / workspace_relative,
        self.parent_path().parent_path() / workspace_relative,
        self.parent_path() / std::filesystem::path(workspace_relative).filename()}) {
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
