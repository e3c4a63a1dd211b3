// How the Gloo ProcessGroup fails: a peer that goes away is reported at once
// (UNAVAILABLE), a peer that never arrives after the timeout
// (DEADLINE_EXCEEDED), and the first error sticks. Elapsed times are
// measured, so this target runs alone (tag exclusive).
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "parallel/watchdog.h"
#include "tests/parallel/group_test_util.h"

namespace muster::parallel::testing {
namespace {

GlooOptions Timeout(absl::Duration timeout) {
  GlooOptions options;
  options.timeout = timeout;
  return options;
}

TEST_CASE("a destroyed peer makes the others fail with UNAVAILABLE at once, naming it") {
  rdzv::InMemoryStore store;
  // A long timeout: the failure must come from the closed connection.
  Groups groups = ConnectGroups(store, 3, Timeout(absl::Seconds(30)));
  std::vector<std::vector<float>> data(3, std::vector<float>(1000, 1.0f));
  std::vector<std::shared_ptr<Work>> first;
  for (int r = 0; r < 3; ++r) {
    first.push_back(groups[r]->AllReduce(absl::MakeSpan(data[r]), ReduceOp::kSum));
  }
  WaitAll(first);

  groups[2].reset();  // rank 2 leaves mid-sequence
  const absl::Time start = absl::Now();
  auto survivor0 = groups[0]->AllReduce(absl::MakeSpan(data[0]), ReduceOp::kSum);
  auto survivor1 = groups[1]->AllReduce(absl::MakeSpan(data[1]), ReduceOp::kSum);
  auto queued0 = groups[0]->Barrier();
  absl::Status status0 = survivor0->Wait();
  absl::Status status1 = survivor1->Wait();
  const absl::Duration elapsed = absl::Now() - start;
  INFO(status0.ToString() << "\n" << status1.ToString());
  CHECK(status0.code() == absl::StatusCode::kUnavailable);
  CHECK(status1.code() == absl::StatusCode::kUnavailable);
  CHECK(elapsed < absl::Seconds(5));
  // The message names the connection (by rank when the address is known)
  // and the operation, by group and global rank; or, when the group's
  // connection monitor saw the closed pair before the operation did (under
  // load), the connection alone, by rank and group.
  for (const absl::Status& status : {status0, status1}) {
    INFO(status.message());
    CHECK(absl::StrContains(status.message(), "by peer"));
    CHECK(absl::StrContains(status.message(), "[127.0.0.1]:"));
    CHECK((absl::StartsWith(status.message(),
                            "allreduce (sum) of 1000 floats (group world of 3 "
                            "ranks; op #1 on global rank ") ||
           absl::StartsWith(status.message(),
                            "connection to global rank 2 (rank 2 of group world) failed")));
  }

  // Sticky: the op queued behind and every later op fail with the first error.
  CHECK(queued0->Wait() == status0);
  CHECK(groups[0]->Barrier()->Wait() == status0);
  CHECK(groups[1]->Broadcast(absl::MakeSpan(data[1]), 0)->Wait() == status1);
}

TEST_CASE("two ranks: the survivor names the connection that closed") {
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, 2, Timeout(absl::Seconds(30)));
  groups[1].reset();
  std::vector<float> data(10, 1.0f);
  absl::Status status = groups[0]->AllReduce(absl::MakeSpan(data), ReduceOp::kSum)->Wait();
  INFO(status.ToString());
  CHECK(status.code() == absl::StatusCode::kUnavailable);
  // Of two ranks the connection that failed is the other's, whether or not
  // gloo's message has its listening address (only when rank 0 dialled it).
  CHECK(
      absl::StrContains(status.message(), "connection to global rank 1 (rank 1 of group world) "));
  CHECK(absl::StrContains(status.message(), "by peer"));
}

// A sub-group of the given global ranks, its ranks on threads (the rest
// of the world is not needed).
GlooOptions SubGroup(std::string name, std::vector<int> global_ranks) {
  GlooOptions options = Timeout(absl::Seconds(30));
  options.members = {std::move(name), std::move(global_ranks)};
  return options;
}

TEST_CASE("a sub-group's survivor names the group and the dead peer's global rank") {
  rdzv::InMemoryStore store;
  // Group rank 0 is global rank 1, group rank 1 is global rank 3.
  Groups groups = ConnectGroups(store, 2, SubGroup("act.pp.1.0", {1, 3}));
  std::vector<float> data(16, 1.0f);
  WaitAll({groups[0]->Send(data, 1, 0), groups[1]->Recv(absl::MakeSpan(data), 0, 0)});

  groups[1].reset();  // global rank 3 goes
  absl::Status status = groups[0]->Recv(absl::MakeSpan(data), 1, 1)->Wait();
  INFO(status.ToString());
  CHECK(status.code() == absl::StatusCode::kUnavailable);
  const std::string message(status.message());
  CHECK(absl::StartsWith(message,
                         "recv of 16 floats with tag 1 from global rank 3 (rank 1 of group "
                         "act.pp.1.0; op #1 on global rank 1): connection to global rank 3 (rank 1 "
                         "of group act.pp.1.0) "));
  CHECK(absl::StrContains(message, "failed (that process died or closed the group)"));
  // Group rank 1's global rank is named, never as a bare "rank 1".
  CHECK_FALSE(absl::StrContains(message, "connection to rank"));
  CHECK(message.find('\n') == std::string::npos);  // one line
  CHECK(groups[0]->Barrier()->Wait() == status);   // sticky, the same words
}

TEST_CASE("an idle sub-group's monitor names the group, so its error can be passed on") {
  rdzv::InMemoryStore store;
  // Listed out of order: group rank 0 is global rank 6.
  Groups groups = ConnectGroups(store, 2, SubGroup("dp_shard.2", {6, 4}));
  groups[0].reset();  // global rank 6 goes while nothing runs
  // The monitor (every 50 ms) fails the idle group by itself, naming the
  // pair it probed: nothing else would name the group in the error.
  absl::Status status;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (status.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    status = groups[1]->Health().error;
  }
  INFO(status.ToString());
  REQUIRE(status.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StartsWith(status.message(),
                         "connection to global rank 6 (rank 0 of group dp_shard.2) failed"));
}

TEST_CASE("another group's error reaches a sub-group under that group's names") {
  // Global ranks 0..2 in the world group; global ranks 0 and 2 also in a
  // pipeline channel. Global rank 1, in the world only, goes; rank 0's
  // watchdog passes the world's error on to the channel, where rank 0
  // waits on global rank 2 (alive: it was never sent to). The channel's
  // rank 1 is global rank 2, the world's is global rank 1: the message must
  // not mix the two up.
  rdzv::InMemoryStore store;
  Groups world = ConnectGroups(store, 3, Timeout(absl::Seconds(30)));
  auto channel = ConnectLocalGroups(&store, 2, "act", SubGroup("act.pp.0.0", {0, 2}));
  REQUIRE(channel.ok());
  Watchdog dog({world[0].get(), (*channel)[0].get()}, nullptr, nullptr);
  dog.Start();
  std::vector<float> data(8);
  std::shared_ptr<Work> waiting = (*channel)[0]->Recv(absl::MakeSpan(data), 1, 0);

  world[1].reset();
  absl::Status status = waiting->Wait();
  INFO(status.ToString() << "\ncause: " << dog.cause().ToString());
  CHECK(status.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StartsWith(status.message(),
                         "recv of 8 floats with tag 0 from global rank 2 (rank 1 of group "
                         "act.pp.0.0; op #0 on global rank 0): aborted after an error in group "
                         "world: connection to global rank 1 (rank 1 of group world) failed"));
  CHECK_FALSE(absl::StrContains(status.message(), "connection to global rank 2"));
  // The watchdog's cause is the world's own error, as the world has it.
  CHECK(absl::StartsWith(dog.cause().message(),
                         "connection to global rank 1 (rank 1 of group world) failed"));
  CHECK(world[0]->Health().error == dog.cause());
}

TEST_CASE("a rank that never joins a collective: DEADLINE_EXCEEDED within the timeout") {
  const absl::Duration timeout = absl::Milliseconds(1500);
  rdzv::InMemoryStore store;
  Groups groups = ConnectGroups(store, 2, Timeout(timeout));
  std::vector<float> data(100, 1.0f);
  const absl::Time start = absl::Now();
  auto lonely = groups[0]->AllReduce(absl::MakeSpan(data), ReduceOp::kSum);
  auto behind = groups[0]->Barrier();
  absl::Status status = lonely->Wait();
  const absl::Duration elapsed = absl::Now() - start;
  INFO(status.ToString() << " after " << absl::FormatDuration(elapsed));
  CHECK(status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(elapsed >= timeout - absl::Milliseconds(50));
  CHECK(elapsed < timeout + absl::Seconds(1));
  CHECK(behind->Wait() == status);  // failed with it, not after another timeout
  CHECK(absl::Now() - start < timeout + absl::Seconds(1));
}

TEST_CASE("a rank that never connects: CreateGlooGroup gives DEADLINE_EXCEEDED in time") {
  const absl::Duration timeout = absl::Seconds(1);
  rdzv::InMemoryStore store;
  const absl::Time start = absl::Now();
  auto group = CreateGlooGroup(&store, 0, 2, Timeout(timeout));
  const absl::Duration elapsed = absl::Now() - start;
  INFO(group.status().ToString());
  CHECK(group.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(group.status().message(),
                          "connecting global rank 0 to group world as its rank 0 of 2: "));
  CHECK(elapsed < timeout + absl::Seconds(1));
}

}  // namespace
}  // namespace muster::parallel::testing
