// Communicator::NewGroup with the real thing: an in-process rendezvous
// server, one RUNNING round of 4 ranks, and 4 Communicators (one per rank,
// each on a thread of its own while it blocks) that make sub-groups
// through the round's store and reduce within them.
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "parallel/bootstrap.h"
#include "parallel/collectives.h"
#include "parallel/parallel_dims.h"
#include "rendezvous/client/client.h"
#include "rendezvous/server/server.h"
#include "tests/parallel/group_test_util.h"

namespace muster::parallel::testing {
namespace {

using Dim = ParallelDims::Dim;

constexpr int64_t kBig = (int64_t{1} << 58) + 1;

// A server, a job of one node running `size` ranks, its lease kept, and
// one connected Communicator per rank.
struct World {
  explicit World(int size, std::vector<CommunicatorOptions> options = {}) {
    rdzv::ServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<rdzv::Server>> started = rdzv::Server::Start(server_options);
    INFO(started.status().ToString());
    REQUIRE(started.ok());
    server = *std::move(started);
    endpoint = absl::StrCat("127.0.0.1:", server->port());

    rdzv::ClientOptions client_options;
    client_options.endpoint = endpoint;
    client_options.rpc_timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<rdzv::Client>> connected = rdzv::Client::Connect(client_options);
    REQUIRE(connected.ok());
    client = *std::move(connected);
    rdzv::pb::JoinRequest join;
    join.set_job_id(job);
    rdzv::pb::JobConfig* config = join.mutable_config();
    config->set_min_nodes(1);
    config->set_max_nodes(1);
    config->set_join_timeout_ms(30000);
    config->set_last_call_timeout_ms(100);
    config->set_lease_ttl_ms(30000);
    config->set_max_restarts(0);
    join.set_address("127.0.0.1");
    join.set_hostname("node0");
    join.set_nproc(size);
    join.set_requested_rank(-1);
    absl::StatusOr<rdzv::RoundAssignment> joined =
        rdzv::JoinAndWaitForRound(*client, join, nullptr, absl::Now() + absl::Seconds(30));
    INFO(joined.status().ToString());
    REQUIRE(joined.ok());
    keeper = std::make_unique<rdzv::LeaseKeeper>(client.get(), job, joined->member_id,
                                                 absl::Milliseconds(30000));

    options.resize(size);
    std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> made =
        OnEveryRank(size, [&](int rank) {
          WorldInfo world;
          world.rank = rank;
          world.world_size = size;
          world.local_rank = rank;
          world.master_addr = "127.0.0.1";
          world.local_addr = "127.0.0.1";
          world.rdzv_endpoint = endpoint;
          world.job_id = job;
          world.round = joined->state.round();
          options[rank].timeout = absl::Seconds(20);  // bounds every wait below
          return Communicator::Connect(world, options[rank]);
        });
    for (int rank = 0; rank < size; ++rank) {
      INFO("rank " << rank << ": " << made[rank].status().ToString());
      REQUIRE(made[rank].ok());
      comms.push_back(*std::move(made[rank]));
    }
  }

  ~World() {
    comms.clear();  // the groups go before the server
    keeper.reset();
  }

  const std::string job = "subgroups";
  std::unique_ptr<rdzv::Server> server;
  std::string endpoint;
  std::unique_ptr<rdzv::Client> client;
  std::unique_ptr<rdzv::LeaseKeeper> keeper;
  std::vector<std::unique_ptr<Communicator>> comms;
};

// Every rank's sub-group along `dim`.
std::vector<ProcessGroup*> MakeGroups(World& world, const ParallelDims& dims, Dim dim) {
  std::vector<absl::StatusOr<ProcessGroup*>> made = OnEveryRank(dims.world(), [&](int rank) {
    return world.comms[rank]->NewGroup(dims.GroupName(dim, rank), dims.GroupRanks(dim, rank));
  });
  std::vector<ProcessGroup*> groups;
  for (int rank = 0; rank < dims.world(); ++rank) {
    INFO("rank " << rank << ": " << made[rank].status().ToString());
    REQUIRE(made[rank].ok());
    groups.push_back(*made[rank]);
  }
  return groups;
}

TEST_CASE("sub-groups of a 4-rank world reduce within themselves") {
  World world(4);
  absl::StatusOr<ParallelDims> dims = ParallelDims::Create(4, 2, 2, 1);
  REQUIRE(dims.ok());
  // Shard groups {0,1} {2,3}, replicate groups {0,2} {1,3}.
  std::vector<ProcessGroup*> shard = MakeGroups(world, *dims, Dim::kDpShard);
  std::vector<ProcessGroup*> replicate = MakeGroups(world, *dims, Dim::kDpReplicate);
  for (int rank = 0; rank < 4; ++rank) {
    CHECK(shard[rank]->size() == 2);
    CHECK(shard[rank]->rank() == rank % 2);
    CHECK(replicate[rank]->size() == 2);
    CHECK(replicate[rank]->rank() == rank / 2);
    CHECK(shard[rank]->timeout() == absl::Seconds(20));
  }

  struct Result {
    absl::StatusOr<int64_t> shard_sum, replicate_max, world_sum;
    absl::Status broadcast;
    std::string message;
  };
  std::vector<Result> got = OnEveryRank(4, [&](int rank) {
    Result result;
    Collectives in_shard(shard[rank]), in_replicate(replicate[rank]);
    Collectives in_world(&world.comms[rank]->control_group());
    result.shard_sum = in_shard.AllReduce(kBig + rank, ReduceOp::kSum);
    result.replicate_max = in_replicate.AllReduce(int64_t{rank}, ReduceOp::kMax);
    result.world_sum = in_world.AllReduce(int64_t{rank}, ReduceOp::kSum);
    // Group rank 1 of each shard group (global ranks 1 and 3) sends.
    result.message = absl::StrCat("from rank ", rank);
    result.broadcast = in_shard.Broadcast(&result.message, 1);
    return result;
  });
  for (int rank = 0; rank < 4; ++rank) {
    INFO("rank " << rank);
    const Result& r = got[rank];
    REQUIRE(r.shard_sum.ok());
    CHECK(*r.shard_sum == 2 * kBig + (rank < 2 ? 0 + 1 : 2 + 3));
    REQUIRE(r.replicate_max.ok());
    CHECK(*r.replicate_max == (rank % 2 == 0 ? 2 : 3));
    REQUIRE(r.world_sum.ok());
    CHECK(*r.world_sum == 6);
    CHECK(r.broadcast.ok());
    CHECK(r.message == (rank < 2 ? "from rank 1" : "from rank 3"));
  }
}

TEST_CASE("NewGroup refuses a rank not in the list, bad lists, a name used twice") {
  World world(4);
  Communicator& rank0 = *world.comms[0];
  auto code = [](const absl::StatusOr<ProcessGroup*>& made) { return made.status().code(); };

  absl::StatusOr<ProcessGroup*> refused = rank0.NewGroup("others", {1, 2});
  INFO(refused.status().ToString());
  CHECK(code(refused) == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("'others'") &&
                                                          Catch::Contains("[1,2]") &&
                                                          Catch::Contains("not a member"));
  CHECK(code(rank0.NewGroup("", {0, 1})) == absl::StatusCode::kInvalidArgument);
  CHECK(code(rank0.NewGroup("outside", {0, 4})) == absl::StatusCode::kInvalidArgument);
  CHECK(code(rank0.NewGroup("negative", {-1, 0})) == absl::StatusCode::kInvalidArgument);
  CHECK(code(rank0.NewGroup("twice", {0, 1, 0})) == absl::StatusCode::kInvalidArgument);
  CHECK(code(rank0.NewGroup("none", {})) == absl::StatusCode::kInvalidArgument);
  // A refused name was never taken.
  CHECK(code(rank0.NewGroup("others", {1, 2})) == absl::StatusCode::kInvalidArgument);

  // A group of one rank needs no peer: a self group, at once.
  absl::StatusOr<ProcessGroup*> alone = world.comms[3]->NewGroup("alone", {3});
  REQUIRE(alone.ok());
  CHECK((*alone)->size() == 1);
  CHECK(*Collectives(*alone).AllReduce(int64_t{5}, ReduceOp::kSum) == 5);

  std::vector<absl::StatusOr<ProcessGroup*>> pair = OnEveryRank(2, [&](int rank) {
    return world.comms[rank]->NewGroup("pair", {0, 1});
  });
  REQUIRE(pair[0].ok());
  REQUIRE(pair[1].ok());
  absl::StatusOr<ProcessGroup*> again = rank0.NewGroup("pair", {0, 1});
  INFO(again.status().ToString());
  CHECK(code(again) == absl::StatusCode::kAlreadyExists);
  // Another member naming the same group with other ranks learns at once
  // what the first members agreed on, instead of waiting for the timeout.
  const absl::Time start = absl::Now();
  absl::StatusOr<ProcessGroup*> mismatch = world.comms[2]->NewGroup("pair", {0, 2});
  INFO(mismatch.status().ToString());
  CHECK(code(mismatch) == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(mismatch.status().message()), Catch::Contains("[0,1]"));
  CHECK(absl::Now() - start < absl::Seconds(10));
}

TEST_CASE("NewDataGroup on a Gloo world is a Gloo group; it shares NewGroup's names") {
  World world(4);
  std::vector<absl::StatusOr<ProcessGroup*>> data = OnEveryRank(2, [&](int rank) {
    return world.comms[rank]->NewDataGroup("data pair", {0, 1});
  });
  REQUIRE(data[0].ok());
  REQUIRE(data[1].ok());
  std::vector<absl::StatusOr<int64_t>> sums = OnEveryRank(2, [&](int rank) {
    return Collectives(*data[rank]).AllReduce(int64_t{rank + 1}, ReduceOp::kSum);
  });
  CHECK(*sums[0] == 3);
  CHECK(*sums[1] == 3);
  CHECK(world.comms[0]->NewGroup("data pair", {0, 1}).status().code() ==
        absl::StatusCode::kAlreadyExists);
  CHECK(world.comms[2]->NewDataGroup("data pair", {0, 2}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ProcessGroup*> alone = world.comms[3]->NewDataGroup("data alone", {3});
  REQUIRE(alone.ok());
  CHECK((*alone)->size() == 1);
}

TEST_CASE("the watchdog aborts the sub-groups when a group of the rank fails") {
  // Only rank 0's watchdog looks (every 100 ms); the others' would look
  // only when woken by the round watch, and the round stays RUNNING. So
  // nothing but rank 0's watchdog can end rank 0's blocked barrier.
  std::vector<CommunicatorOptions> options(4);
  for (int rank = 1; rank < 4; ++rank) options[rank].watchdog.interval = absl::Hours(1);
  World world(4, options);
  absl::StatusOr<ParallelDims> dims = ParallelDims::Create(4, 2, 2, 1);
  REQUIRE(dims.ok());
  std::vector<ProcessGroup*> shard = MakeGroups(world, *dims, Dim::kDpShard);
  std::vector<ProcessGroup*> replicate = MakeGroups(world, *dims, Dim::kDpReplicate);
  REQUIRE(world.comms[0]->watchdog() != nullptr);

  // Rank 0 alone enters barriers its peers never join.
  std::shared_ptr<Work> blocked_shard = shard[0]->Barrier();
  std::shared_ptr<Work> blocked_replicate = replicate[0]->Barrier();
  const absl::Status cause = absl::UnavailableError("test: rank 0's world group failed");
  const absl::Time start = absl::Now();
  world.comms[0]->group().Abort(cause);
  absl::Status shard_status = blocked_shard->Wait();
  absl::Status replicate_status = blocked_replicate->Wait();
  const absl::Duration took = absl::Now() - start;
  INFO(shard_status.ToString() << "; " << replicate_status.ToString());
  CHECK(absl::IsUnavailable(shard_status));
  // Each names its own group, then whose error it was.
  CHECK(shard_status.message() ==
        "barrier (group dp_shard.0 of 2 ranks; op #0 on global rank 0): aborted after an error "
        "in group world: test: rank 0's world group failed");
  CHECK(absl::IsUnavailable(replicate_status));
  CHECK(replicate_status.message() ==
        "barrier (group dp_replicate.0 of 2 ranks; op #0 on global rank 0): aborted after an "
        "error in group world: test: rank 0's world group failed");
  CHECK(took < absl::Seconds(10));  // the groups' timeout is 20 s
  CHECK(world.comms[0]->watchdog()->cause() == cause);
}

TEST_CASE("a dead peer is named by its global rank and the sub-group's name") {
  // The user's layout: pp 2 and FSDP shards of 2. Stage 0 is global ranks
  // 0 and 1, stage 1 ranks 2 and 3; dp_shard.1 is {2, 3}; the activation
  // channels from stage 0 to 1 are act.pp.0.0 {0, 2} and act.pp.1.0
  // {1, 3}. No watchdog looks (interval 1 h, and the round stays RUNNING),
  // so each failure below is the sub-group's own.
  std::vector<CommunicatorOptions> options(4);
  for (CommunicatorOptions& option : options) option.watchdog.interval = absl::Hours(1);
  World world(4, options);
  absl::StatusOr<ParallelDims> dims = ParallelDims::Create(4, 1, 2, 2);
  REQUIRE(dims.ok());
  std::vector<ProcessGroup*> shard = MakeGroups(world, *dims, Dim::kDpShard);
  std::vector<absl::StatusOr<ProcessGroup*>> channel = OnEveryRank(4, [&](int rank) {
    return world.comms[rank]->NewGroup(absl::StrCat("act.", dims->GroupName(Dim::kPp, rank), ".0"),
                                       dims->GroupRanks(Dim::kPp, rank));
  });
  for (int rank = 0; rank < 4; ++rank) {
    INFO("rank " << rank << ": " << channel[rank].status().ToString());
    REQUIRE(channel[rank].ok());
  }
  CHECK((*channel[0])->members().name == "act.pp.0.0");
  CHECK((*channel[0])->members().global_ranks == std::vector<int>{0, 2});
  CHECK(world.comms[0]->group().members().name == "world");

  // Global rank 0 waits on its channel's rank 1 (global rank 2), global
  // rank 3 on its shard group's rank 0 (global rank 2 too).
  std::vector<float> data(8);
  std::shared_ptr<Work> recv = (*channel[0])->Recv(absl::MakeSpan(data), 1, 0);
  std::shared_ptr<Work> barrier = shard[3]->Barrier();
  world.comms[2].reset();  // global rank 2 dies
  const absl::Status recv_status = recv->Wait();
  const absl::Status barrier_status = barrier->Wait();
  INFO(recv_status.ToString() << "\n" << barrier_status.ToString());

  CHECK(absl::IsUnavailable(recv_status));
  CHECK(absl::StartsWith(recv_status.message(),
                         "recv of 8 floats with tag 0 from global rank 2 (rank 1 of group "
                         "act.pp.0.0; op #0 on global rank 0): connection to global rank 2 (rank 1 "
                         "of group act.pp.0.0) "));
  CHECK(absl::IsUnavailable(barrier_status));
  CHECK(absl::StartsWith(barrier_status.message(),
                         "barrier (group dp_shard.1 of 2 ranks; op #0 on global rank 3): "
                         "connection to global rank 2 (rank 0 of group dp_shard.1) "));
  // Global ranks 0 and 1 are alive: no message blames them.
  for (const absl::Status& status : {recv_status, barrier_status}) {
    CHECK_FALSE(absl::StrContains(status.message(), "connection to global rank 0"));
    CHECK_FALSE(absl::StrContains(status.message(), "connection to global rank 1"));
    CHECK(std::string(status.message()).find('\n') == std::string::npos);
  }
}

}  // namespace
}  // namespace muster::parallel::testing
