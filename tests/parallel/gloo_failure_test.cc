// How the Gloo ProcessGroup fails: a peer that goes away is reported at once
// (UNAVAILABLE), a peer that never arrives after the timeout
// (DEADLINE_EXCEEDED), and the first error sticks. Elapsed times are
// measured, so this target runs alone (tag exclusive).
#include "absl/strings/match.h"
#include "absl/time/clock.h"
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
  // The message names the connection (by rank when the address is known).
  for (const absl::Status& status : {status0, status1}) {
    CHECK(absl::StrContains(status.message(), "by peer"));
    CHECK(absl::StrContains(status.message(), "[127.0.0.1]:"));
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
  // Rank 1's listening address appears when rank 0 dialled it; when rank 1
  // dialled, gloo knows it only by an ephemeral port.
  CHECK((absl::StrContains(status.message(), "connection to rank 1 at [127.0.0.1]:") ||
         absl::StrContains(status.message(), "by peer")));
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
  CHECK(absl::StrContains(group.status().message(), "connecting rank 0 of 2"));
  CHECK(elapsed < timeout + absl::Seconds(1));
}

}  // namespace
}  // namespace muster::parallel::testing
