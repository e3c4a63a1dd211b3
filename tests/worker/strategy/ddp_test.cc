// The parallel seam (worker/strategy/strategy.h) and DDP (worker/strategy/ddp/ddp.h,
// parallel/gradient_reducer.h): the bucket plan, the contract every
// strategy honours, and ranks as threads in one process on real Gloo
// groups over an in-memory store.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "parallel/gloo/group.h"
#include "parallel/gradient_reducer.h"
#include "rendezvous/client/store.h"
#include "tests/parallel/group_test_util.h"
#include "tests/worker/test_corpus.h"
#include "worker/data/data.h"
#include "worker/strategy/ddp/ddp.h"
#include "worker/strategy/strategy.h"
#include "worker/trainer/trainer.h"

namespace muster::worker {
namespace {

using parallel::Bucket;
using parallel::BucketOptions;
using parallel::PlanBuckets;

TEST_CASE("parallel.backend: auto is nccl on CUDA and gloo on the CPU; gloo on CUDA is staged") {
  using parallel::DataBackend;
  CHECK(*ChooseDataBackend("auto", Device::kCuda) == DataBackend::kNccl);
  CHECK(*ChooseDataBackend("auto", Device::kCpu) == DataBackend::kGloo);
  CHECK(*ChooseDataBackend("nccl", Device::kCuda) == DataBackend::kNccl);
  CHECK(*ChooseDataBackend("gloo", Device::kCuda) == DataBackend::kStagedGloo);
  CHECK(*ChooseDataBackend("gloo", Device::kCpu) == DataBackend::kGloo);
  // device: auto resolved to the CPU (no GPU here) with backend: nccl.
  absl::StatusOr<DataBackend> refused = ChooseDataBackend("nccl", Device::kCpu);
  REQUIRE(absl::IsInvalidArgument(refused.status()));
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("parallel.backend: nccl needs device cuda"));
  CHECK(absl::IsInvalidArgument(ChooseDataBackend("mpi", Device::kCpu).status()));
  CHECK(std::string(DataBackendName(DataBackend::kStagedGloo)) ==
        "gloo (staged through pinned host memory)");
}

TEST_CASE("parallel degrees: dp_replicate 0 fills the world; a product off the world names them") {
  ParallelConfig config;
  auto dims = ParallelDimsFor(config, 4);
  REQUIRE(dims.ok());
  CHECK(dims->dp_replicate == 4);
  CHECK(dims->dp() == 4);
  config.dp_replicate = 4;
  CHECK(ParallelDimsFor(config, 4).ok());
  config.dp_replicate = 2;
  auto wrong = ParallelDimsFor(config, 4);
  REQUIRE(absl::IsInvalidArgument(wrong.status()));
  CHECK_THAT(
      std::string(wrong.status().message()),
      Catch::Contains("parallel.dp_replicate (2) x parallel.dp_shard (1) x parallel.pp (1) = "
                      "2, but the world has 4 ranks"));
}

TEST_CASE("buckets run backwards over the segments, capped, with a small first bucket") {
  // One allocation, like GptModel's: embedding, 6 blocks, head.
  std::vector<float> memory(1000 + 6 * 300 + 10);
  std::vector<absl::Span<float>> segments;
  size_t offset = 0;
  for (size_t size : {1000, 300, 300, 300, 300, 300, 300, 10}) {
    segments.emplace_back(memory.data() + offset, size);
    offset += size;
  }
  BucketOptions options;
  options.first_bucket_bytes = 400 * sizeof(float);
  options.bucket_bytes = 700 * sizeof(float);
  std::vector<Bucket> buckets = PlanBuckets(segments, options);

  // head + block5 (310 floats; block4 would overflow 400), then pairs of
  // blocks (600; a third would overflow 700), then block0, then the
  // embedding alone (larger than any cap).
  REQUIRE(buckets.size() == 5);
  CHECK(buckets[0].first_segment == 6);
  CHECK(buckets[0].last_segment == 7);
  CHECK(buckets[1].first_segment == 4);
  CHECK(buckets[2].first_segment == 2);
  CHECK(buckets[3].first_segment == 1);
  CHECK(buckets[3].last_segment == 1);
  CHECK(buckets[4].first_segment == 0);
  CHECK(buckets[4].floats == 1000);
  int expected_last = 7;
  size_t total = 0;
  for (const Bucket& bucket : buckets) {
    CHECK(bucket.last_segment == expected_last);
    expected_last = bucket.first_segment - 1;
    // Adjacent segments make one span: one allreduce per bucket.
    REQUIRE(bucket.spans.size() == 1);
    CHECK(bucket.spans[0].data() == segments[bucket.first_segment].data());
    total += bucket.floats;
  }
  CHECK(expected_last == -1);
  CHECK(total == memory.size());

  SECTION("segments apart in memory become one span each") {
    std::vector<float> a(5), b(5);
    std::vector<Bucket> apart = PlanBuckets({absl::MakeSpan(a), absl::MakeSpan(b)}, {});
    REQUIRE(apart.size() == 1);
    CHECK(apart[0].spans.size() == 2);
    CHECK(apart[0].floats == 10);
  }
}

// A real ProcessGroup that counts what is asked of it.
class CountingGroup : public parallel::ProcessGroup {
 public:
  explicit CountingGroup(std::unique_ptr<parallel::ProcessGroup> group)
      : group_(std::move(group)) {}
  int allreduces = 0;

  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  absl::Duration timeout() const override { return group_->timeout(); }
  std::shared_ptr<parallel::Work> AllReduce(absl::Span<float> data,
                                            parallel::ReduceOp op) override {
    ++allreduces;
    return group_->AllReduce(data, op);
  }
  std::shared_ptr<parallel::Work> ReduceScatter(absl::Span<const float> input,
                                                absl::Span<float> output,
                                                std::vector<size_t> counts,
                                                parallel::ReduceOp op) override {
    return group_->ReduceScatter(input, output, std::move(counts), op);
  }
  std::shared_ptr<parallel::Work> AllGather(absl::Span<const float> input, absl::Span<float> output,
                                            std::vector<size_t> counts) override {
    return group_->AllGather(input, output, std::move(counts));
  }
  std::shared_ptr<parallel::Work> AllGatherBf16(absl::Span<const uint16_t> input,
                                                absl::Span<uint16_t> output,
                                                std::vector<size_t> counts) override {
    return group_->AllGatherBf16(input, output, std::move(counts));
  }
  std::shared_ptr<parallel::Work> Broadcast(absl::Span<float> data, int root) override {
    return group_->Broadcast(data, root);
  }
  std::shared_ptr<parallel::Work> AllReduceInt64(absl::Span<int64_t> data,
                                                 parallel::ReduceOp op) override {
    return group_->AllReduceInt64(data, op);
  }
  std::shared_ptr<parallel::Work> BroadcastBytes(absl::Span<uint8_t> data, int root) override {
    return group_->BroadcastBytes(data, root);
  }
  std::shared_ptr<parallel::Work> Send(absl::Span<const float> data, int destination,
                                       int tag) override {
    return group_->Send(data, destination, tag);
  }
  std::shared_ptr<parallel::Work> Recv(absl::Span<float> data, int source, int tag) override {
    return group_->Recv(data, source, tag);
  }
  std::shared_ptr<parallel::Work> Barrier() override { return group_->Barrier(); }
  parallel::GroupHealth Health() const override { return group_->Health(); }
  void Abort(const absl::Status& cause) override { group_->Abort(cause); }

 private:
  std::unique_ptr<parallel::ProcessGroup> group_;
};

TrainConfig SmallJob(const std::string& dir, int micro_batch, int accumulation) {
  TrainConfig config;
  config.model = {2, 2, 32, 128, 16};
  config.data.train = testing::TestCorpus("ddp_test");
  config.data.micro_batch = micro_batch;
  config.data.grad_accumulation = accumulation;
  config.optim.lr = 1e-2;
  config.train.steps = 6;
  config.train.seed = 11;
  config.device = "cpu";
  config.parallel.bucket_mb = 0.02;
  return config;
}

struct RankResult {
  std::string error;  // Catch2 assertions are not thread-safe: threads
                      // record their first failure here instead
  std::vector<float> losses;
  std::vector<float> params;
  int allreduces = 0;
};

void TrainRank(const TrainConfig& config, int rank, int world, rdzv::Store* store,
               RankResult* result) {
  parallel::GlooOptions options;
  options.timeout = absl::Seconds(30);
  auto group = parallel::CreateGlooGroup(store, rank, world, options);
  if (!group.ok()) {
    result->error = group.status().ToString();
    return;
  }
  CountingGroup counting(*std::move(group));
  Ddp ddp(&counting, &counting, BucketOptionsFor(config.parallel), "gloo");
  TrainConfig mine = config;
  std::unique_ptr<FILE, int (*)(FILE*)> sink(std::fopen("/dev/null", "w"), &std::fclose);
  TrainerOptions trainer_options;
  trainer_options.log = sink.get();
  trainer_options.strategy = &ddp;
  auto trainer = Trainer::Create(mine, trainer_options);
  if (!trainer.ok()) {
    result->error = trainer.status().ToString();
    return;
  }
  int before = counting.allreduces;
  for (int step = 0; step < config.train.steps; ++step) {
    auto metrics = (*trainer)->Step();
    if (!metrics.ok()) {
      result->error = metrics.status().ToString();
      return;
    }
    result->losses.push_back(metrics->loss);
  }
  result->allreduces = counting.allreduces - before;
  result->params = (*trainer)->model()->CopyParamsToHost();
}

// Trains `config` on `world` ranks as threads.
std::vector<RankResult> TrainThreads(const TrainConfig& config, int world) {
  rdzv::InMemoryStore store;
  std::vector<RankResult> results(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back(TrainRank, std::cref(config), rank, world, &store, &results[rank]);
  }
  for (auto& thread : threads) thread.join();
  for (const RankResult& result : results) REQUIRE(result.error == "");
  return results;
}

TEST_CASE("DDP ranks as threads match one process at the same global batch") {
  std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp",
                                 "/data_parallel_test");
  std::filesystem::create_directories(dir);
  // One process, batch 8.
  std::vector<RankResult> one = TrainThreads(SmallJob(dir, 8, 1), 1);
  // Two ranks x 2 sequences x 2 micro-steps.
  std::vector<RankResult> two = TrainThreads(SmallJob(dir, 2, 2), 2);

  for (size_t step = 0; step < one[0].losses.size(); ++step) {
    INFO("step " << step + 1);
    CHECK(two[0].losses[step] == two[1].losses[step]);
    CHECK(std::abs(two[0].losses[step] - one[0].losses[step]) <= 1e-5 * one[0].losses[step]);
  }
  // Identical weights on both ranks, and close to the single process's.
  CHECK(two[0].params == two[1].params);
  double worst = 0;
  for (size_t i = 0; i < one[0].params.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(two[0].params[i] - one[0].params[i])));
  }
  CHECK(worst < 1e-4);

  // Communication only on the last micro-step: per step one allreduce per
  // bucket span plus one for the loss, whatever the accumulation.
  TrainConfig config = SmallJob(dir, 2, 2);
  CHECK(two[0].allreduces % config.train.steps == 0);
  int per_step = two[0].allreduces / config.train.steps;
  CHECK(per_step >= 2);
  std::vector<RankResult> no_accumulation = TrainThreads(SmallJob(dir, 4, 1), 2);
  CHECK(no_accumulation[0].allreduces / config.train.steps == per_step);
}

TEST_CASE("Ddp::Build gives every rank rank 0's weights") {
  rdzv::InMemoryStore store;
  BuildSpec spec;
  spec.model = ModelConfig{2, 2, 32, 128, 16};
  std::vector<std::vector<float>> params(3);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 3; ++rank) {
    threads.emplace_back([&, rank] {
      auto group = parallel::CreateGlooGroup(&store, rank, 3);
      if (!group.ok()) {
        errors[rank] = group.status().ToString();
        return;
      }
      Ddp ddp(group->get(), group->get(), {}, "gloo");
      BuildSpec mine = spec;
      mine.seed = 100 + rank;  // three different initial models
      auto built = ddp.Build(mine);
      if (!built.ok()) {
        errors[rank] = built.status().ToString();
        return;
      }
      params[rank] = built->model->CopyParamsToHost();
      if (ddp.Build(mine).status().code() != absl::StatusCode::kFailedPrecondition) {
        errors[rank] = "a second Build was not refused";
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const std::string& error : errors) REQUIRE(error == "");
  auto reference = GptModel::Create(spec.model, 1, Device::kCpu);
  REQUIRE(reference.ok());
  (*reference)->InitWeights(100);
  CHECK(params[0] == (*reference)->CopyParamsToHost());
  CHECK(params[1] == params[0]);
  CHECK(params[2] == params[0]);
}

// One step through a strategy, as the trainer drives it; what a caller
// can observe of the contract.
struct ContractRun {
  std::vector<std::string> hook_stages;  // post_backward stages seen, on the last micro-step
  std::vector<float> params_before, grads, params_after;
  double sum_of_squares = 0;
  std::vector<std::vector<FlatRange>> files;
  std::vector<FlatRange> load;
  float loss_mean = 0;
};

ContractRun RunContract(ParallelStrategy* strategy, const BuildSpec& spec) {
  ContractRun run;
  auto built = strategy->Build(spec);
  REQUIRE(built.ok());
  GptModel* model = built->model.get();
  run.params_before = model->CopyParamsToHost();
  std::vector<int> inputs(2 * 16), targets(2 * 16);
  for (size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = static_cast<int>((i * 5) % 128);
    targets[i] = static_cast<int>((i * 5 + 1) % 128);
  }
  for (int micro = 0; micro < 2; ++micro) {
    model->Forward(inputs.data(), targets.data(), 2, 16);
    strategy->BeginBackward(model, micro == 1);
    model->Backward(0.5f);
  }
  REQUIRE(strategy->ReduceGradients(model).ok());
  run.grads = model->CopyGradsToHost();
  auto sum = strategy->GradSumOfSquares(model);
  REQUIRE(sum.ok());
  run.sum_of_squares = *sum;
  REQUIRE(strategy->OptimizerStep(model, built->optimizer.get(), 1e-3f, 1, 1.0f).ok());
  run.params_after = model->CopyParamsToHost();
  const uint64_t total = 3 * run.params_before.size();
  run.files = strategy->CheckpointFiles(total);
  run.load = strategy->CheckpointLoad(total);
  auto mean = strategy->control().AllReduce(2.5f, parallel::ReduceOp::kAvg);
  REQUIRE(mean.ok());
  run.loss_mean = *mean;
  return run;
}

TEST_CASE("SingleProcess and a world-of-one Ddp honour the same strategy contract") {
  BuildSpec spec;
  spec.model = ModelConfig{2, 2, 32, 128, 16};
  spec.micro_batch = 2;
  spec.seed = 7;
  SingleProcess single;
  ContractRun alone = RunContract(&single, spec);

  rdzv::InMemoryStore store;
  auto group = parallel::CreateGlooGroup(&store, 0, 1);
  REQUIRE(group.ok());
  CountingGroup counting(*std::move(group));
  Ddp ddp(&counting, &counting, {}, "gloo");
  ContractRun replicated = RunContract(&ddp, spec);

  for (ParallelStrategy* strategy :
       {static_cast<ParallelStrategy*>(&single), static_cast<ParallelStrategy*>(&ddp)}) {
    INFO(strategy->Describe());
    CHECK(strategy->rank() == 0);
    CHECK(strategy->dp_rank() == 0);
    CHECK(strategy->dims().world() == 1);
    CHECK(strategy->dims().dp() == 1);
    CHECK(strategy->control().size() == 1);
  }
  CHECK(ddp.Describe() == "ddp over gloo, 1 ranks");
  // The same model, gradients, norm and step, bit for bit.
  CHECK(replicated.params_before == alone.params_before);
  CHECK(replicated.grads == alone.grads);
  CHECK(replicated.sum_of_squares == alone.sum_of_squares);
  CHECK(replicated.params_after == alone.params_after);
  CHECK(replicated.params_after != replicated.params_before);
  CHECK(counting.allreduces > 0);  // Ddp reduced over its group all the same
  // Every checkpoint float written by exactly one file; all loaded.
  for (const ContractRun* run : {&alone, &replicated}) {
    const uint64_t total = 3 * run->params_before.size();
    uint64_t next = 0;
    for (const std::vector<FlatRange>& file : run->files) {
      for (const FlatRange& range : file) {
        CHECK(range.begin == next);
        next = range.begin + range.count;
      }
    }
    CHECK(next == total);
    REQUIRE(run->load.size() == 1);
    CHECK(run->load[0].begin == 0);
    CHECK(run->load[0].count == total);
    CHECK(run->loss_mean == 2.5f);
  }
}

TEST_CASE("Ddp's checkpoint files split the state evenly over ranks") {
  rdzv::InMemoryStore store;
  parallel::testing::Groups groups = parallel::testing::ConnectGroups(store, 3);
  for (int rank = 0; rank < 3; ++rank) {
    Ddp ddp(groups[rank].get(), groups[rank].get(), {}, "gloo");
    CHECK(ddp.rank() == rank);
    CHECK(ddp.dp_rank() == rank);
    CHECK(ddp.dims().dp_replicate == 3);
    const std::vector<std::vector<FlatRange>> files = ddp.CheckpointFiles(10);
    REQUIRE(files.size() == 3);
    for (const std::vector<FlatRange>& file : files) REQUIRE(file.size() == 1);  // one range each
    CHECK(files[0][0].count == 4);
    CHECK(files[1][0].begin == 4);
    CHECK(files[2][0].begin + files[2][0].count == 10);
    const std::vector<FlatRange> load = ddp.CheckpointLoad(10);
    REQUIRE(load.size() == 1);
    CHECK(load[0].begin == 0);
    CHECK(load[0].count == 10);
  }
}

}  // namespace
}  // namespace muster::worker
