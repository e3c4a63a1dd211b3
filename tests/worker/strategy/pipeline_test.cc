// Pipeline parallelism (worker/strategy/pipeline/pipeline.h) with ranks as threads of one
// process on real Gloo groups over an in-memory store: PP=2 and PP=4 under
// GPipe, 1F1B and interleaved 1F1B, DP=2 x PP=2, FSDP x PP (ZeRO-1/2/3,
// even and uneven shards) and HSDP x PP, against one process at the same
// global batch; the tied wte copies bitwise equal; 1F1B holding fewer
// micro-batches than GPipe; the FLOP-balanced split and its errors.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "parallel/local_ranks.h"
#include "parallel/parallel_dims.h"
#include "rendezvous/client/store.h"
#include "tests/worker/test_corpus.h"
#include "worker/data/data.h"
#include "worker/strategy/pipeline/pipeline.h"
#include "worker/trainer/trainer.h"

namespace muster::worker {
namespace {

using parallel::ScheduleKind;
using Dim = parallel::ParallelDims::Dim;

TrainConfig SmallJob(int micro_batch, int micro_steps) {
  TrainConfig config;
  config.model = {4, 2, 32, 101, 16};  // layers, heads, dim, vocab, seq_len
  config.data.train = testing::TestCorpus("pipeline_test");
  config.data.micro_batch = micro_batch;
  config.data.grad_accumulation = micro_steps;
  config.optim.lr = 1e-2;
  config.optim.grad_clip = 0.5;
  config.train.steps = 6;
  config.train.seed = 11;
  config.device = "cpu";
  return config;
}

struct RankResult {
  std::string error;
  std::vector<float> losses, norms;
  // The tied wte after each step, as the first and the last rank hold it.
  std::vector<std::vector<float>> wte;
  int peak_in_flight = 0;
};

RankResult OneProcess(const TrainConfig& config) {
  RankResult result;
  std::unique_ptr<FILE, int (*)(FILE*)> sink(std::fopen("/dev/null", "w"), &std::fclose);
  TrainerOptions options;
  options.log = sink.get();
  auto trainer = Trainer::Create(config, options);
  REQUIRE(trainer.ok());
  for (int step = 0; step < config.train.steps; ++step) {
    auto metrics = (*trainer)->Step();
    REQUIRE(metrics.ok());
    result.losses.push_back(metrics->loss);
    result.norms.push_back(metrics->grad_norm);
  }
  return result;
}

// Trains `config` on dp x pp ranks as threads: step by step, or (`run`)
// with Trainer::Run, which saves and resumes checkpoints as configured.
std::vector<RankResult> Train(const TrainConfig& config, int dp, int pp, ScheduleKind schedule,
                              bool run = false, int virtual_stages = 1, int shard = 1,
                              int zero = 3) {
  const int world = dp * shard * pp;
  auto dims = parallel::ParallelDims::Create(world, dp, shard, pp);
  REQUIRE(dims.ok());
  rdzv::InMemoryStore store;
  auto worlds = parallel::ConnectLocalGroups(&store, world, "world/");
  REQUIRE(worlds.ok());
  std::vector<std::unique_ptr<parallel::ProcessGroup>> owned;
  // Each sub-group along `dim`, made with its lowest rank's name; `pick`
  // chooses the members (the tied group: a pipeline's ends).
  auto connect = [&](Dim dim, bool ends_only, std::vector<parallel::ProcessGroup*>* into) {
    into->assign(world, nullptr);
    for (int rank = 0; rank < world; ++rank) {
      std::vector<int> members = dims->GroupRanks(dim, rank);
      if (members.front() != rank || members.size() == 1) continue;
      if (ends_only) members = {members.front(), members.back()};
      auto groups = parallel::ConnectLocalGroups(
          &store, static_cast<int>(members.size()),
          absl::StrCat(ends_only ? "tied." : "", dims->GroupName(dim, rank), "/"));
      REQUIRE(groups.ok());
      for (size_t i = 0; i < members.size(); ++i) {
        (*into)[members[i]] = (*groups)[i].get();
        owned.push_back(std::move((*groups)[i]));
      }
    }
  };
  std::vector<parallel::ProcessGroup*> pipelines, tied, replicas, shards;
  connect(Dim::kPp, false, &pipelines);
  connect(Dim::kPp, true, &tied);
  connect(Dim::kDpReplicate, false, &replicas);
  connect(Dim::kDpShard, false, &shards);
  // The channels: one 2-rank group per direction between neighbours, and
  // with virtual stages the ring closed from the last rank to the first.
  std::vector<PipelineGroups> groups(world);
  for (int rank = 0; rank < world; ++rank) {
    groups[rank].pipeline = pipelines[rank];
    groups[rank].tied = tied[rank];
    groups[rank].replicate = replicas[rank];
    groups[rank].shard = shards[rank];
  }
  for (int rank = 0; rank < world; ++rank) {
    const std::vector<int> members = dims->GroupRanks(Dim::kPp, rank);
    if (members.front() != rank) continue;
    const size_t channels = members.size() - (virtual_stages > 1 ? 0 : 1);
    for (size_t p = 0; p < channels; ++p) {
      for (bool gradient : {false, true}) {
        auto pair = parallel::ConnectLocalGroups(
            &store, 2,
            absl::StrCat(gradient ? "grad." : "act.", dims->GroupName(Dim::kPp, rank), ".", p,
                         "/"));
        REQUIRE(pair.ok());
        PipelineGroups& lower = groups[members[p]];
        PipelineGroups& upper = groups[members[(p + 1) % members.size()]];
        (gradient ? lower.gradients_in : lower.activations_out) = (*pair)[0].get();
        (gradient ? upper.gradients_out : upper.activations_in) = (*pair)[1].get();
        owned.push_back(std::move((*pair)[0]));
        owned.push_back(std::move((*pair)[1]));
      }
    }
  }
  std::vector<RankResult> results(world);
  std::unique_ptr<FILE, int (*)(FILE*)> sink(std::fopen("/dev/null", "w"), &std::fclose);
  parallel::OnEveryRank(world, [&](int rank) {
    RankResult& result = results[rank];
    PipelineOptions options;
    options.schedule = schedule;
    options.virtual_stages = virtual_stages;
    options.zero = zero;
    Pipeline pipeline(groups[rank], (*worlds)[rank].get(), *dims, options, "gloo");
    TrainerOptions trainer_options;
    trainer_options.log = sink.get();
    trainer_options.strategy = &pipeline;
    auto trainer = Trainer::Create(config, trainer_options);
    if (!trainer.ok()) {
      result.error = trainer.status().ToString();
      return 0;
    }
    if (run) {
      if (absl::Status ran = (*trainer)->Run(); !ran.ok()) result.error = ran.ToString();
      return 0;
    }
    for (int step = 0; step < config.train.steps; ++step) {
      auto metrics = (*trainer)->Step();
      if (!metrics.ok()) {
        result.error = metrics.status().ToString();
        return 0;
      }
      result.losses.push_back(metrics->loss);
      result.norms.push_back(metrics->grad_norm);
      auto wte = pipeline.Wte();
      if (!wte.ok()) {
        result.error = wte.status().ToString();
        return 0;
      }
      result.wte.push_back(*std::move(wte));
    }
    result.peak_in_flight = pipeline.peak_in_flight();
    return 0;
  });
  for (const RankResult& result : results) REQUIRE(result.error == "");
  return results;
}

void CheckMatches(const std::vector<RankResult>& ranks, const RankResult& one, int pp) {
  for (size_t step = 0; step < one.losses.size(); ++step) {
    INFO("step " << step + 1);
    for (const RankResult& rank : ranks) {
      CHECK(rank.losses[step] == ranks[0].losses[step]);
      CHECK(std::abs(rank.losses[step] - one.losses[step]) <= 1e-5 * one.losses[step]);
      CHECK(std::abs(rank.norms[step] - one.norms[step]) <= 1e-4 * one.norms[step]);
    }
  }
  // The tied wte: the first rank's and the last rank's copies, bit for bit.
  const RankResult& first = ranks[0];
  const RankResult& last = ranks[(pp - 1) * (ranks.size() / pp)];
  REQUIRE(first.wte.size() == one.losses.size());
  for (size_t step = 0; step < first.wte.size(); ++step) {
    INFO("after step " << step + 1);
    REQUIRE_FALSE(first.wte[step].empty());
    CHECK(first.wte[step] == last.wte[step]);
  }
}

TEST_CASE("PP=2 and PP=4 under GPipe and 1F1B match one process at the same global batch") {
  const int M = 4, B = 2;
  const RankResult one = OneProcess(SmallJob(B, M));
  for (ScheduleKind schedule : {ScheduleKind::kGpipe, ScheduleKind::k1F1B}) {
    for (int pp : {2, 4}) {
      INFO(parallel::ScheduleName(schedule) << ", pp " << pp);
      std::vector<RankResult> ranks = Train(SmallJob(B, M), 1, pp, schedule);
      CheckMatches(ranks, one, pp);
      // GPipe holds every micro-batch; 1F1B at most P - rank.
      for (int rank = 0; rank < pp; ++rank) {
        CHECK(ranks[rank].peak_in_flight ==
              (schedule == ScheduleKind::kGpipe ? M : std::min(M, pp - rank)));
      }
    }
  }
}

TEST_CASE("ZB-H1 at PP=2 and PP=4 gives 1F1B's bits, within its in-flight bound") {
  // The weight passes run later but in the same order, into the same sums.
  const int M = 8, B = 2;
  for (int pp : {2, 4}) {
    INFO("pp " << pp);
    std::vector<RankResult> one_f = Train(SmallJob(B, M), 1, pp, ScheduleKind::k1F1B);
    std::vector<RankResult> zb = Train(SmallJob(B, M), 1, pp, ScheduleKind::kZeroBubbleH1);
    for (int rank = 0; rank < pp; ++rank) {
      CHECK(zb[rank].losses == one_f[rank].losses);
      CHECK(zb[rank].norms == one_f[rank].norms);
      CHECK(zb[rank].peak_in_flight ==
            parallel::InFlightBound({ScheduleKind::kZeroBubbleH1, pp, M, 1}, rank));
    }
    CHECK(zb[0].wte == zb[pp - 1].wte);
  }
}

TEST_CASE("interleaved 1F1B at PP=2 and PP=4 matches one process, within its in-flight bound") {
  const int M = 4, B = 2;
  for (int pp : {2, 4}) {
    // Two virtual stages per rank: a block per pipeline stage.
    TrainConfig config = SmallJob(B, M);
    config.model.layers = 2 * pp;
    const RankResult one = OneProcess(config);
    INFO("pp " << pp);
    std::vector<RankResult> ranks =
        Train(config, 1, pp, ScheduleKind::kInterleaved1F1B, /*run=*/false, /*virtual_stages=*/2);
    CheckMatches(ranks, one, pp);
    const parallel::ScheduleSpec spec{ScheduleKind::kInterleaved1F1B, pp, M, 2};
    for (int rank = 0; rank < pp; ++rank) {
      CHECK(ranks[rank].peak_in_flight == parallel::InFlightBound(spec, rank));
    }
  }
}

TEST_CASE("DP=2 x PP=2 under interleaved 1F1B matches one process") {
  const RankResult one = OneProcess(SmallJob(2, 8));
  std::vector<RankResult> ranks = Train(SmallJob(2, 4), 2, 2, ScheduleKind::kInterleaved1F1B,
                                        /*run=*/false, /*virtual_stages=*/2);
  CheckMatches(ranks, one, 2);
}

TEST_CASE("FSDP x PP: ZeRO-1, 2 and 3 over 2 and 3 shards (uneven) match one process") {
  for (int shard : {2, 3}) {
    // Global batch shard x M x B = shard x 4 x 2.
    const RankResult one = OneProcess(SmallJob(2, 4 * shard));
    for (int zero : {1, 2, 3}) {
      INFO(shard << " shards, ZeRO-" << zero);
      std::vector<RankResult> ranks = Train(SmallJob(2, 4), 1, 2, ScheduleKind::k1F1B,
                                            /*run=*/false, /*virtual_stages=*/1, shard, zero);
      CheckMatches(ranks, one, 2);
    }
  }
}

TEST_CASE("HSDP x PP: 2 replicas x 2 shards x PP=2 under interleaved 1F1B match one process") {
  const RankResult one = OneProcess(SmallJob(1, 16));
  std::vector<RankResult> ranks = Train(SmallJob(1, 4), 2, 2, ScheduleKind::kInterleaved1F1B,
                                        /*run=*/false, /*virtual_stages=*/2, /*shard=*/2);
  CheckMatches(ranks, one, 2);
}

TEST_CASE("DP=2 x PP=2 matches one process at the same global batch") {
  // Global batch dp x M x B = 2 x 4 x 2: one process reads it as 8 micro-
  // batches of 2, in the same order.
  const RankResult one = OneProcess(SmallJob(2, 8));
  std::vector<RankResult> ranks = Train(SmallJob(2, 4), 2, 2, ScheduleKind::k1F1B);
  CheckMatches(ranks, one, 2);
}

// The losses rank 0 wrote to train.metrics_file, by step.
std::map<int, float> MetricsLosses(const std::string& path) {
  std::map<int, float> losses;
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    int step = 0;
    float loss = 0;
    if (std::sscanf(line.c_str(), "{\"step\":%d,\"loss\":%g", &step, &loss) == 2) {
      losses[step] = loss;
    }
  }
  return losses;
}

TEST_CASE("a PP=2 checkpoint resumes bit-exact under PP=2 and into one process") {
  const std::string dir =
      absl::StrCat(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp", "/pp_ckpt");
  std::filesystem::remove_all(dir);
  TrainConfig config = SmallJob(2, 4);
  config.train.steps = 8;
  config.train.log_every = 1;
  config.checkpoint.dir = dir + "/full";
  config.checkpoint.every = 4;
  config.train.metrics_file = dir + "/full.jsonl";
  Train(config, 1, 2, ScheduleKind::k1F1B, /*run=*/true);
  const std::map<int, float> full = MetricsLosses(config.train.metrics_file);
  REQUIRE(full.size() == 8);

  // From step 4's checkpoint: the same layout again, and one process.
  TrainConfig resumed = config;
  resumed.checkpoint.resume = config.checkpoint.dir + "/step_00000004";
  resumed.checkpoint.dir = dir + "/again";
  resumed.train.metrics_file = dir + "/again.jsonl";
  Train(resumed, 1, 2, ScheduleKind::k1F1B, /*run=*/true);
  const std::map<int, float> again = MetricsLosses(resumed.train.metrics_file);
  REQUIRE(again.size() == 4);
  for (const auto& [step, loss] : again) CHECK(loss == full.at(step));

  TrainConfig alone = resumed;
  alone.checkpoint.dir = dir + "/alone";
  alone.train.metrics_file = dir + "/alone.jsonl";
  std::unique_ptr<FILE, int (*)(FILE*)> sink(std::fopen("/dev/null", "w"), &std::fclose);
  TrainerOptions options;
  options.log = sink.get();
  auto trainer = Trainer::Create(alone, options);
  REQUIRE(trainer.ok());
  REQUIRE((*trainer)->Run().ok());
  const std::map<int, float> one = MetricsLosses(alone.train.metrics_file);
  REQUIRE(one.size() == 4);
  for (const auto& [step, loss] : one) {
    INFO("step " << step);
    CHECK(std::abs(loss - full.at(step)) <= 1e-5 * full.at(step));
  }
}

TEST_CASE("an FSDP x PP checkpoint resumes bit-exact, and under DDP x PP and interleaved") {
  const std::string dir = absl::StrCat(
      std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp", "/fsdp_pp_ckpt");
  std::filesystem::remove_all(dir);
  // 2 shards (ZeRO-3) x PP=2, global batch 2 x 4 x 1.
  TrainConfig config = SmallJob(1, 4);
  config.train.steps = 8;
  config.train.log_every = 1;
  config.checkpoint.dir = dir + "/full";
  config.checkpoint.every = 4;
  config.train.metrics_file = dir + "/full.jsonl";
  Train(config, 1, 2, ScheduleKind::k1F1B, /*run=*/true, 1, /*shard=*/2, /*zero=*/3);
  const std::map<int, float> full = MetricsLosses(config.train.metrics_file);
  REQUIRE(full.size() == 8);

  auto resume = [&](const std::string& name) {
    TrainConfig resumed = config;
    resumed.checkpoint.resume = config.checkpoint.dir + "/step_00000004";
    resumed.checkpoint.dir = dir + "/" + name;
    resumed.train.metrics_file = dir + "/" + name + ".jsonl";
    return resumed;
  };
  // The same layout: bit for bit.
  TrainConfig again = resume("again");
  Train(again, 1, 2, ScheduleKind::k1F1B, /*run=*/true, 1, /*shard=*/2, /*zero=*/3);
  for (const auto& [step, loss] : MetricsLosses(again.train.metrics_file)) {
    CHECK(loss == full.at(step));
  }
  // DDP x PP (2 pipelines), and 2 shards (ZeRO-1) x PP=2 interleaved: the
  // same samples, other sums.
  TrainConfig ddp = resume("ddp");
  Train(ddp, 2, 2, ScheduleKind::k1F1B, /*run=*/true);
  TrainConfig interleaved = resume("interleaved");
  Train(interleaved, 1, 2, ScheduleKind::kInterleaved1F1B, /*run=*/true, /*virtual_stages=*/2,
        /*shard=*/2, /*zero=*/1);
  for (const TrainConfig* other : {&ddp, &interleaved}) {
    const std::map<int, float> losses = MetricsLosses(other->train.metrics_file);
    REQUIRE(losses.size() == 4);
    for (const auto& [step, loss] : losses) {
      INFO(other->checkpoint.dir << " step " << step);
      CHECK(std::abs(loss - full.at(step)) <= 1e-5 * full.at(step));
    }
  }
}

TEST_CASE("the pipeline split balances FLOPs, with the classifier on the last stage") {
  ModelConfig gpt2;
  gpt2.layers = 12;
  gpt2.dim = 768;
  gpt2.heads = 12;
  gpt2.vocab = 50257;
  gpt2.seq_len = 1024;
  // The classifier (2 C Vp per token) weighs about 5.5 blocks (24 C^2).
  auto four = PipelineSplit(gpt2, 4, {});
  REQUIRE(four.ok());
  CHECK(four->back() == 1);
  int sum = 0;
  for (int blocks : *four) sum += blocks;
  CHECK(sum == 12);
  ModelConfig small;  // a small vocabulary: the head is light, blocks even
  small.layers = 8;
  small.dim = 256;
  small.vocab = 128;
  CHECK(PipelineSplit(small, 4, {}).value() == std::vector<int>{2, 2, 2, 2});
  CHECK(PipelineSplit(small, 2, {5, 3}).value() == std::vector<int>{5, 3});
  CHECK_THAT(std::string(PipelineSplit(small, 2, {5, 2}).status().message()),
             Catch::StartsWith("parallel.pp_split: [5, 2] must be 2 positive block counts"));
  CHECK_THAT(std::string(PipelineSplit(small, 9, {}).status().message()),
             Catch::StartsWith("parallel.pp: 9 pipeline stages for 8 blocks"));
}

TEST_CASE("1F1B with fewer micro-batches than stages is refused naming the field") {
  rdzv::InMemoryStore store;
  auto groups = parallel::ConnectLocalGroups(&store, 2, "g/");
  REQUIRE(groups.ok());
  auto dims = parallel::ParallelDims::Create(2, 1, 1, 2);
  REQUIRE(dims.ok());
  // Build checks the schedule before it communicates, so rank 0's view
  // of the groups is enough.
  PipelineGroups mine;
  mine.pipeline = mine.tied = mine.activations_out = mine.gradients_in = (*groups)[0].get();
  Pipeline pipeline(mine, (*groups)[0].get(), *dims, PipelineOptions{}, "gloo");
  BuildSpec spec;
  spec.model = SmallJob(1, 1).model;
  spec.micro_steps = 1;
  auto built = pipeline.Build(spec);
  REQUIRE(absl::IsInvalidArgument(built.status()));
  CHECK_THAT(std::string(built.status().message()),
             Catch::StartsWith("parallel.microbatches: 1 is fewer than parallel.pp (2)"));
}

}  // namespace
}  // namespace muster::worker
