// The chaos suite: a 2-node x 2-worker DDP job under a real rendezvous
// server, all on loopback, while the test SIGKILLs a worker, an agent (and
// starts it again, as a supervisor would) or the server (and starts it
// again on its port with its state directory) at random moments, several
// times a run; then it preempts the job (SIGTERM to both agents) and starts
// it once more to the end.
//
// Passing means: every step's loss equals an uninterrupted run's bit for
// bit, no process of the job is left behind, and the newest checkpoint
// verifies. The seed is printed; CHAOS_SEED=<n> replays a run and
// CHAOS_EVENTS=<n> sets the number of kills (the `manual` soak target runs
// more steps and kills).
#include <signal.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "launcher/worker_env.h"
#include "tests/launcher/harness.h"
#include "worker/checkpoint/reader.h"
#include "worker/data/data.h"

namespace muster::testing {
namespace {

namespace fs = std::filesystem;
using launcher::Child;

int EnvInt(const char* name, int fallback) {
  const char* text = std::getenv(name);
  int value = 0;
  return text != nullptr && absl::SimpleAtoi(text, &value) ? value : fallback;
}

// L=2, C=64, T=32, B=4 per rank: a few ms a step on 4 ranks.
void WriteConfig(const TempDir& dir, const std::string& name, int steps) {
  if (!fs::exists(dir.File("train_000.bin"))) {
    std::vector<uint16_t> tokens;
    for (int i = 0; i < 40000; ++i) tokens.push_back("abcdefghijklm"[i % 13]);
    REQUIRE(worker::WriteTokenShard(dir.File("train_000.bin"), tokens).ok());
  }
  WriteFile(dir.File(name + ".yaml"),
            absl::StrCat("model: {layers: 2, heads: 2, dim: 64, vocab: 256, seq_len: 32}\n",
                         "data: {train: \"", dir.File("train_*.bin"), "\", micro_batch: 4}\n",
                         "optim: {lr: 0.003}\n", "train: {steps: ", steps,
                         ", log_every: 1, metrics_file: \"", dir.File(name + ".jsonl"), "\"}\n",
                         "device: cpu\n", "parallel: {timeout_s: 20}\n", "checkpoint: {dir: \"",
                         dir.File(name + "_ckpt"), "\", every: 5, keep_last: 3}\n"));
}

int LastStep(const std::string& metrics) {
  auto losses = LossTexts(metrics);
  return losses.empty() ? 0 : losses.rbegin()->first;
}

// One job: a server with a state directory, and one agent per node.
class Job {
 public:
  Job(const TempDir& dir, std::string name, int steps) : dir_(dir), name_(std::move(name)) {
    WriteConfig(dir, name_, steps);
    StartServer(0);
  }

  void StartServer(int port) {
    tools::ServerProcessOptions options;
    options.binary = BinaryPath("rendezvous/rendezvous");
    options.listen = absl::StrCat("127.0.0.1:", port);
    options.extra_args = {"--log-level", "warn", "--state-dir", dir_.File(name_ + "_state")};
    auto server = tools::ServerProcess::Start(options);
    INFO(server.status().ToString());
    REQUIRE(server.ok());
    server_ = *std::move(server);
  }

  void KillServer() {
    const int port = server_->port();
    REQUIRE(server_->Kill(SIGKILL).ok());
    REQUIRE(server_->Wait(absl::Now() + absl::Seconds(10)).ok());
    StartServer(port);  // the agents know this address only
  }

  Child StartAgent(int node) {
    return StartLaunch({"--nnodes=2", "--nproc_per_node=2", "--rdzv_endpoint", server_->endpoint(),
                        "--rdzv_id=" + name_, "--rdzv_conf=lease_ttl=2,keep_alive_interval=0.3",
                        "--max_restarts=30", "--monitor_interval=0.05", "--no_python",
                        BinaryPath("worker/worker"), dir_.File(name_ + ".yaml")},
                       dir_.File(absl::StrCat(name_, "_agent", node, ".log")),
                       {"OMP_WAIT_POLICY=passive", Mark()});
  }

  void StartAgents() {
    agents_.clear();
    for (int node = 0; node < 2; ++node) agents_.push_back(StartAgent(node));
  }

  void KillAgent(int node) {
    REQUIRE(kill(agents_[node].pid(), SIGKILL) == 0);
    REQUIRE(agents_[node].WaitFor(absl::Seconds(10)).has_value());
    agents_[node] = StartAgent(node);
  }

  // SIGKILLs one worker of `node`'s agent; false if it has none right now.
  bool KillWorker(int node) {
    const int worker =
        FindChild(agents_[node].pid(), [](int pid) { return ProcessName(pid) == "worker"; });
    return worker > 0 && kill(worker, SIGKILL) == 0;
  }

  void SignalAgents(int signal) {
    for (Child& agent : agents_) REQUIRE(kill(agent.pid(), signal) == 0);
  }

  std::vector<int> WaitAgents(absl::Duration timeout) {
    std::vector<int> codes;
    for (Child& agent : agents_) {
      auto exit = agent.WaitFor(timeout);
      codes.push_back(exit.has_value() ? exit->ShellCode() : -1);
    }
    return codes;
  }

  std::string Logs() const {
    std::string text;
    for (int node = 0; node < 2; ++node) {
      absl::StrAppend(&text, "--- agent ", node, "\n",
                      ReadFile(dir_.File(absl::StrCat(name_, "_agent", node, ".log"))));
    }
    return absl::StrCat(text, "--- server\n", server_->output());
  }

  std::string Metrics() const { return dir_.File(name_ + ".jsonl"); }
  std::string CheckpointDir() const { return dir_.File(name_ + "_ckpt"); }
  // Every process of this job carries it in its environment.
  std::string Mark() const { return "MUSTER_CHAOS_JOB=" + dir_.path() + "/" + name_; }

 private:
  const TempDir& dir_;
  const std::string name_;
  std::unique_ptr<tools::ServerProcess> server_;
  std::vector<Child> agents_;
};

// The pids of live processes whose environment holds `entry`.
std::vector<int> ProcessesWith(const std::string& entry) {
  std::vector<int> pids;
  for (const auto& proc : fs::directory_iterator("/proc")) {
    int pid = 0;
    if (!absl::SimpleAtoi(proc.path().filename().string(), &pid)) continue;
    if (!ProcessGone(pid) && HasEnvironmentEntry(pid, entry)) pids.push_back(pid);
  }
  return pids;
}

TEST_CASE("kills of workers, agents and the server, then a preemption: nothing lost") {
  const int steps = EnvInt("CHAOS_STEPS", 60);
  const int events = EnvInt("CHAOS_EVENTS", 4);
  const unsigned seed =
      static_cast<unsigned>(EnvInt("CHAOS_SEED", static_cast<int>(time(nullptr))));
  std::printf("chaos: seed %u (CHAOS_SEED=%u replays it), %d kills, %d steps\n", seed, seed, events,
              steps);
  std::fflush(stdout);
  std::mt19937 random(seed);
  TempDir dir;

  Job reference(dir, "reference", steps);
  reference.StartAgents();
  {
    const std::vector<int> codes = reference.WaitAgents(absl::Seconds(240));
    INFO(reference.Logs());
    REQUIRE(codes == std::vector<int>{0, 0});
  }

  Job chaos(dir, "chaos", steps);
  chaos.StartAgents();
  std::vector<std::string> done;
  int progress = 0;  // the step the job had reached after the last kill
  for (int event = 0; event < events; ++event) {
    // Wait for 0 to 5 steps of progress past the previous kill: 0 kills
    // again while the job is still forming its next round.
    const int target = progress + static_cast<int>(random() % 6);
    if (target >= steps - 8) break;  // leave steps for the preemption
    INFO(chaos.Logs());
    REQUIRE(WaitUntil([&] { return LastStep(chaos.Metrics()) >= target; }, absl::Seconds(120)));
    const int node = static_cast<int>(random() % 2);
    std::string what;
    switch (random() % 3) {
      case 0:
        if (!chaos.KillWorker(node)) continue;
        what = absl::StrCat("a worker of node ", node);
        break;
      case 1:
        chaos.KillAgent(node);
        what = absl::StrCat("the agent of node ", node, " (started again)");
        break;
      default:
        chaos.KillServer();
        what = "the server (started again with its state)";
        break;
    }
    progress = LastStep(chaos.Metrics());
    done.push_back(absl::StrCat("after step ", progress, ": SIGKILL ", what));
    std::printf("chaos: %s\n", done.back().c_str());
    std::fflush(stdout);
  }

  // The preemption, once the job trains again after the last kill.
  {
    INFO(chaos.Logs());
    REQUIRE(
        WaitUntil([&] { return LastStep(chaos.Metrics()) >= progress + 2; }, absl::Seconds(120)));
  }
  const int preempted_at = LastStep(chaos.Metrics());
  chaos.SignalAgents(SIGTERM);
  {
    const std::vector<int> codes = chaos.WaitAgents(absl::Seconds(60));
    INFO(chaos.Logs());
    const int preempted = launcher::kPreemptedExitCode;
    CHECK(codes == std::vector<int>{preempted, preempted});
  }
  std::printf("chaos: preempted after step %d (SIGTERM to both agents)\n", preempted_at);

  chaos.StartAgents();  // the next allocation
  {
    const std::vector<int> codes = chaos.WaitAgents(absl::Seconds(240));
    INFO(chaos.Logs());
    REQUIRE(codes == std::vector<int>{0, 0});
  }

  INFO("seed " << seed);
  CHECK(LossTexts(chaos.Metrics()) == LossTexts(reference.Metrics()));
  CHECK(LossTexts(reference.Metrics()).size() == static_cast<size_t>(steps));
  // Each step logged once, in order, however often the run was killed.
  CHECK(LoggedSteps(chaos.Metrics()) == LoggedSteps(reference.Metrics()));
  std::vector<std::string> skipped;
  auto newest = worker::FindLatestValid(worker::Env::Default(), chaos.CheckpointDir(), &skipped);
  REQUIRE(newest.ok());
  CHECK(newest->step == steps);
  CHECK(worker::VerifyCheckpoint(worker::Env::Default(), newest->path).ok());
  // The kills and the preemption leave no process of the job behind.
  CHECK(WaitUntil([&] { return ProcessesWith(chaos.Mark()).empty(); }, absl::Seconds(10)));
  CHECK(ProcessesWith(reference.Mark()).empty());
  // Rank 0's resumes: the kills after the first checkpoint and the
  // preemption each cost one.
  const std::string logs = chaos.Logs();
  int resumes = 0;
  for (size_t at = 0; (at = logs.find("checkpoint: resumed from", at)) != std::string::npos; ++at) {
    ++resumes;
  }
  CHECK(resumes >= 1);
  std::printf("chaos: %zu kills survived, %d resumes; losses of %d steps bitwise equal; seed %u\n",
              done.size(), resumes, steps, seed);
}

}  // namespace
}  // namespace muster::testing
