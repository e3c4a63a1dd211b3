// The worker's watchdog with real processes: a real `rendezvous` server,
// two real `worker` processes training over Gloo, and this test in the
// launcher agents' place (it joins the two members and keeps their
// leases), so that nothing but the worker itself can end its run.
//
// Rank 1 is SIGSTOPped: its sockets stay open, so rank 0 blocks in its
// allreduce with no transport error to see, and its Gloo timeout (300 s)
// is far away. Then node 1 is lost (its lease lapses) or reports a
// failure. Rank 0 must notice through its round watch and exit non-zero
// with a message naming the cause, within the lease TTL plus 2 s.
#include <signal.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "launcher/worker_env.h"
#include "rendezvous/client/client.h"
#include "tests/launcher/harness.h"
#include "worker/data/data.h"

namespace muster::testing {
namespace {

using launcher::Child;
namespace pb = rdzv::pb;

constexpr int64_t kLeaseTtlMs = 1500;

void WriteCorpus(const std::string& dir) {
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 20000; ++i) tokens.push_back(static_cast<uint16_t>((i * 7 + i / 13) % 97));
  REQUIRE(worker::WriteTokenShard(dir + "/train_000.bin", tokens).ok());
}

std::unique_ptr<rdzv::Client> Connect(const std::string& endpoint) {
  rdzv::ClientOptions options;
  options.endpoint = endpoint;
  options.rpc_timeout = absl::Seconds(5);
  auto client = rdzv::Client::Connect(options);
  REQUIRE(client.ok());
  return *std::move(client);
}

pb::JoinRequest Join(const std::string& job, int node) {
  pb::JoinRequest request;
  request.set_job_id(job);
  pb::JobConfig* config = request.mutable_config();
  config->set_min_nodes(2);
  config->set_max_nodes(2);
  config->set_join_timeout_ms(30000);
  config->set_last_call_timeout_ms(100);
  config->set_lease_ttl_ms(kLeaseTtlMs);
  config->set_max_restarts(3);
  request.set_address("127.0.0.1");
  request.set_hostname(absl::StrCat("node", node));
  request.set_nproc(1);
  request.set_requested_rank(node);
  return request;
}

// Two members in a RUNNING round, their leases kept, and one worker each.
struct TwoNodes {
  TempDir dir;
  std::unique_ptr<tools::ServerProcess> server = StartServer();
  std::string job = "watched";
  std::unique_ptr<rdzv::Client> clients[2];
  rdzv::RoundAssignment rounds[2];
  std::unique_ptr<rdzv::LeaseKeeper> keepers[2];
  std::vector<Child> workers;

  TwoNodes() {
    WriteCorpus(dir.path());
    // Many steps: the run is stopped long before it could finish.
    WriteFile(dir.File("train.yaml"),
              R"(model: {layers: 2, heads: 2, dim: 32, vocab: 256, seq_len: 16}
data: {train: train_*.bin, micro_batch: 2}
optim: {lr: 1.0e-2}
train: {steps: 1000000, log_every: 1, metrics_file: metrics.jsonl}
device: cpu
parallel: {strategy: ddp, bucket_mb: 0.01, timeout_s: 300}
)");
    for (int node = 0; node < 2; ++node) clients[node] = Connect(server->endpoint());
    absl::StatusOr<rdzv::RoundAssignment> joined[2];
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    std::thread other([&] {
      joined[1] = rdzv::JoinAndWaitForRound(*clients[1], Join(job, 1), nullptr, deadline);
    });
    joined[0] = rdzv::JoinAndWaitForRound(*clients[0], Join(job, 0), nullptr, deadline);
    other.join();
    for (int node = 0; node < 2; ++node) {
      INFO("node " << node << ": " << joined[node].status().ToString());
      REQUIRE(joined[node].ok());
      rounds[node] = *joined[node];
      keepers[node] = std::make_unique<rdzv::LeaseKeeper>(
          clients[node].get(), job, rounds[node].member_id, absl::Milliseconds(kLeaseTtlMs));
    }
    for (int rank = 0; rank < 2; ++rank) workers.push_back(StartWorker(rank));
  }

  std::string Log(int rank) const { return dir.File(absl::StrCat("rank", rank, ".log")); }

  Child StartWorker(int rank) {
    launcher::SpawnSpec spec;
    std::string command = "cd \"$1\" && exec \"$0\" train.yaml >" + Log(rank) + " 2>&1";
    spec.argv = {"/bin/sh", "-c", command, BinaryPath("worker/worker"), dir.path()};
    for (const auto& [key, value] : launcher::CurrentEnvironment()) {
      spec.env.push_back(key + "=" + value);
    }
    for (std::string entry :
         {absl::StrCat("RANK=", rank), std::string("WORLD_SIZE=2"), std::string("LOCAL_RANK=0"),
          std::string("LOCAL_WORLD_SIZE=1"), std::string("MASTER_ADDR=127.0.0.1"),
          std::string("MUSTER_LOCAL_ADDR=127.0.0.1"),
          absl::StrCat("MUSTER_RDZV_ENDPOINT=", server->endpoint()),
          absl::StrCat("MUSTER_JOB=", job), absl::StrCat("MUSTER_ROUND=", rounds[0].state.round()),
          std::string("OMP_NUM_THREADS=1")}) {
      spec.env.push_back(entry);
    }
    absl::StatusOr<Child> child = Child::Spawn(spec);
    REQUIRE(child.ok());
    return *std::move(child);
  }

  // Rank 0 has written step 3's metrics (it writes them; every step takes
  // both ranks): the group is connected and collectives are flowing.
  void WaitUntilTraining() {
    bool training = WaitUntil(
        [&] {
          if (!workers[0].running() || !workers[1].running()) return true;  // fails below
          return Losses(dir.File("metrics.jsonl")).count(3) > 0;
        },
        absl::Seconds(120));
    INFO(ReadFile(Log(0)) << ReadFile(Log(1)));
    REQUIRE(training);
    REQUIRE(workers[0].running());
    REQUIRE(workers[1].running());
  }
};

TEST_CASE("a lost node: the survivor leaves its blocked allreduce within the lease TTL") {
  TwoNodes nodes;
  nodes.WaitUntilTraining();
  nodes.workers[1].SignalGroup(SIGSTOP);  // its sockets stay open
  nodes.keepers[1]->Stop();               // and node 1 goes silent
  const absl::Time lost = absl::Now();

  std::optional<launcher::ExitInfo> exit = nodes.workers[0].WaitFor(absl::Seconds(60));
  const absl::Duration took = absl::Now() - lost;
  const std::string log = ReadFile(nodes.Log(0));
  INFO(log);
  REQUIRE(exit.has_value());
  CHECK(exit->exit_code == 1);
  CHECK(exit->signal == 0);
  CHECK_THAT(log, Catch::Contains("rendezvous round 0 of job 'watched' ended (MEMBER_LOST: "
                                  "lease of node1-"));
  std::printf("lost node: rank 0 exited %s after node 1's lease keeper stopped (TTL %lld ms)\n",
              absl::FormatDuration(took).c_str(), static_cast<long long>(kLeaseTtlMs));
  // The lease lapses at most one TTL after the last renewal; the worker
  // then needs the watch push and the abort.
  CHECK(took < absl::Milliseconds(kLeaseTtlMs) + absl::Seconds(2));
  nodes.workers[1].SignalGroup(SIGKILL);
}

TEST_CASE("a failure reported by the other node ends the round; the survivor exits within 2 s") {
  TwoNodes nodes;
  nodes.WaitUntilTraining();
  nodes.workers[1].SignalGroup(SIGSTOP);
  pb::ReportFailureRequest failure;
  failure.set_job_id(nodes.job);
  failure.set_round(nodes.rounds[1].state.round());
  failure.set_member_id(nodes.rounds[1].member_id);
  failure.set_exit_code(137);
  failure.set_message("rank 1 (local rank 0) exited with signal 9 (SIGKILL)");
  const absl::Time reported = absl::Now();
  REQUIRE(nodes.clients[1]->ReportFailure(failure).ok());

  std::optional<launcher::ExitInfo> exit = nodes.workers[0].WaitFor(absl::Seconds(60));
  const absl::Duration took = absl::Now() - reported;
  const std::string log = ReadFile(nodes.Log(0));
  INFO(log);
  REQUIRE(exit.has_value());
  CHECK(exit->exit_code == 1);
  CHECK_THAT(log, Catch::Contains("ended (MEMBER_FAILED: member") &&
                      Catch::Contains("exited with signal 9 (SIGKILL)"));
  CHECK(took < absl::Seconds(2));
  std::printf("reported failure: rank 0 exited %s after the report\n",
              absl::FormatDuration(took).c_str());
  nodes.workers[1].SignalGroup(SIGKILL);
}

}  // namespace
}  // namespace muster::testing
