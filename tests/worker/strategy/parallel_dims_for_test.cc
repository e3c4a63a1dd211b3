// ParallelDimsFor (worker/strategy/strategy.h): parallel.dp_replicate x dp_shard x pp
// resolved against a world size, the auto degrees (0) filled in.
#include <catch2/catch.hpp>
#include <string>

#include "absl/status/status.h"
#include "worker/config/config.h"
#include "worker/strategy/strategy.h"

namespace muster::worker {
namespace {

ParallelConfig Config(const std::string& strategy, int dp_replicate, int dp_shard, int pp = 1) {
  ParallelConfig config;
  config.strategy = strategy;
  config.dp_replicate = dp_replicate;
  config.dp_shard = dp_shard;
  config.pp = pp;
  return config;
}

// "replicate x shard x pp", or the error's message.
std::string Resolved(const ParallelConfig& config, int world_size) {
  absl::StatusOr<parallel::ParallelDims> dims = ParallelDimsFor(config, world_size);
  if (!dims.ok()) {
    CHECK(dims.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(dims.status().message());
  }
  CHECK(dims->world() == world_size);
  return std::to_string(dims->dp_replicate) + " x " + std::to_string(dims->dp_shard) + " x " +
         std::to_string(dims->pp);
}

// What the message adds to "... not a multiple of N": that launch would not
// have formed such a world, and what to choose instead.
std::string UnderLaunch(int known) {
  return "; launch, given this train.yaml as its target, forms only rounds whose world is a "
         "multiple of " +
         std::to_string(known) +
         " (--rdzv_conf world_size_multiple otherwise); started another way, choose the world "
         "size";
}

TEST_CASE("the defaults are what a file that sets nothing gets") {
  ParallelConfig defaults;
  CHECK(defaults.strategy == "ddp");
  CHECK(defaults.dp_replicate == 0);
  CHECK(defaults.dp_shard == 0);
  CHECK(Resolved(defaults, 4) == "4 x 1 x 1");
  CHECK(Resolved(defaults, 1) == "1 x 1 x 1");
}

TEST_CASE("ddp: every rank is a replica; the shard degree is always 1") {
  CHECK(Resolved(Config("ddp", 0, 0), 4) == "4 x 1 x 1");
  CHECK(Resolved(Config("ddp", 0, 1), 4) == "4 x 1 x 1");
  CHECK(Resolved(Config("ddp", 4, 0), 4) == "4 x 1 x 1");
  // LoadConfig refuses this; ParallelDimsFor does too, for configs built in code.
  CHECK(Resolved(Config("ddp", 0, 2), 4) ==
        "parallel.dp_shard: 2 shards each replica, which needs parallel.strategy: fsdp");
  // worker_cli_test checks the same message through the binary.
  CHECK(Resolved(Config("ddp", 2, 0), 4) ==
        "parallel.dp_replicate (2) x parallel.dp_shard (1) x parallel.pp (1) = 2, but the world "
        "has 4 ranks");
  CHECK(Resolved(Config("ddp", 2, 0), 1) ==
        "parallel.dp_replicate (2) x parallel.dp_shard (1) x parallel.pp (1) = 2, but the world "
        "has 1 rank");
}

TEST_CASE("fsdp: both auto is one replica sharded over the world") {
  CHECK(Resolved(Config("fsdp", 0, 0), 4) == "1 x 4 x 1");
  CHECK(Resolved(Config("fsdp", 0, 0), 1) == "1 x 1 x 1");
  CHECK(Resolved(Config("fsdp", 0, 0), 3) == "1 x 3 x 1");
}

TEST_CASE("fsdp: one auto degree is the rest of the world (HSDP)") {
  CHECK(Resolved(Config("fsdp", 2, 0), 4) == "2 x 2 x 1");
  CHECK(Resolved(Config("fsdp", 0, 2), 4) == "2 x 2 x 1");
  CHECK(Resolved(Config("fsdp", 0, 4), 8) == "2 x 4 x 1");
  CHECK(Resolved(Config("fsdp", 1, 0), 8) == "1 x 8 x 1");
  CHECK(Resolved(Config("fsdp", 0, 1), 8) == "8 x 1 x 1");  // fsdp that shards nothing
  CHECK(Resolved(Config("fsdp", 2, 4), 8) == "2 x 4 x 1");
}

TEST_CASE("fsdp: degrees that cannot cover the world name the three fields") {
  CHECK(Resolved(Config("fsdp", 0, 2), 3) ==
        "parallel.dp_replicate (auto) x parallel.dp_shard (2) x parallel.pp (1) cannot cover the "
        "world: 3 ranks are not a multiple of 2" +
            UnderLaunch(2));
  CHECK(Resolved(Config("fsdp", 2, 0), 1) ==
        "parallel.dp_replicate (2) x parallel.dp_shard (auto) x parallel.pp (1) cannot cover the "
        "world: 1 rank is not a multiple of 2" +
            UnderLaunch(2));
  CHECK(Resolved(Config("fsdp", 2, 2), 8) ==
        "parallel.dp_replicate (2) x parallel.dp_shard (2) x parallel.pp (1) = 4, but the world "
        "has 8 ranks");
}

TEST_CASE("pp (planned at load) divides the world before the auto degrees take the rest") {
  CHECK(Resolved(Config("ddp", 0, 0, 2), 8) == "4 x 1 x 2");
  CHECK(Resolved(Config("fsdp", 0, 0, 2), 8) == "1 x 4 x 2");
  CHECK(Resolved(Config("fsdp", 2, 0, 2), 8) == "2 x 2 x 2");
  CHECK(Resolved(Config("ddp", 0, 0, 2), 3) ==
        "parallel.dp_replicate (auto) x parallel.dp_shard (1) x parallel.pp (2) cannot cover the "
        "world: 3 ranks are not a multiple of 2" +
            UnderLaunch(2));
}

TEST_CASE("a degree below its range, only possible from code, is Create's error naming it") {
  CHECK(Resolved(Config("fsdp", -1, 0), 4) == "parallel.dp_replicate is -1; expected at least 1");
  CHECK(Resolved(Config("fsdp", 0, 0, 0), 4) == "parallel.pp is 0; expected at least 1");
}

// launch asks the rendezvous for worlds that are multiples of
// WorldSizeMultiple (worker/config), or exactly that world when
// WorldSizeFixed: every such world must resolve, and every other one must
// not.
TEST_CASE("WorldSizeMultiple and WorldSizeFixed are what ParallelDimsFor needs of the world") {
  const ParallelConfig layouts[] = {
      Config("ddp", 0, 0),     Config("ddp", 0, 0, 2),  Config("ddp", 0, 1, 3),
      Config("fsdp", 0, 0),    Config("fsdp", 0, 2),    Config("fsdp", 2, 0),
      Config("fsdp", 0, 2, 2), Config("fsdp", 3, 0, 2), Config("ddp", 1, 0, 2),
      Config("ddp", 2, 0),     Config("fsdp", 1, 2),    Config("fsdp", 2, 2, 2)};
  const int64_t expected[] = {1, 2, 3, 1, 2, 2, 4, 6, 2, 2, 2, 8};
  const bool fixed[] = {false, false, false, false, false, false,
                        false, false, true,  true,  true,  true};
  for (size_t i = 0; i < std::size(layouts); ++i) {
    const int64_t multiple = WorldSizeMultiple(layouts[i]);
    INFO(layouts[i].strategy << " " << layouts[i].dp_replicate << " x " << layouts[i].dp_shard
                             << " x " << layouts[i].pp);
    CHECK(multiple == expected[i]);
    CHECK(WorldSizeFixed(layouts[i]) == fixed[i]);
    for (int world = 1; world <= 12; ++world) {
      INFO("world " << world);
      CHECK(ParallelDimsFor(layouts[i], world).ok() ==
            (fixed[i] ? world == multiple : world % multiple == 0));
    }
  }
}

}  // namespace
}  // namespace muster::worker
