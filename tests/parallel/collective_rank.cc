// A worker for the multi-process tests: joins its peers from the
// environment `launch` gives it (parallel/bootstrap.h) and runs a fixed
// sequence of collectives, checking every result exactly.
//
//   collective_rank --dir=DIR [--iterations=N] [--first_attempt_loops]
//
// It writes, in DIR, pid.<attempt>.<rank> once connected, looping.<attempt>.<rank>
// after the first iteration, then done.<attempt>.<rank> or
// error.<attempt>.<rank> (the failure's status). --first_attempt_loops:
// in attempt 0 (TORCHELASTIC_RESTART_COUNT) loop until an operation fails
// (at most 120 s) and ignore SIGTERM, so the test sees how the survivors of
// a killed peer fail on their own rather than being stopped by the agent.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "parallel/bootstrap.h"

namespace muster::parallel {
namespace {

void WriteFileAtomically(const std::string& path, const std::string& text) {
  std::string temp = path + ".tmp";
  std::ofstream(temp) << text;
  std::rename(temp.c_str(), path.c_str());
}

// Integer-valued floats, so sums over ranks are exact.
std::vector<float> Data(int rank, int iteration, size_t n) {
  std::vector<float> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<float>(i % 1013 + 7 * rank + iteration);
  return data;
}

// Rank k's chunk k of its Data, concatenated in rank order.
std::vector<float> ExpectedGather(int size, int iteration, const std::vector<size_t>& counts) {
  std::vector<float> gathered;
  size_t offset = 0;
  for (int rank = 0; rank < size; ++rank) {
    std::vector<float> data = Data(rank, iteration, offset + counts[rank]);
    gathered.insert(gathered.end(), data.begin() + offset, data.end());
    offset += counts[rank];
  }
  return gathered;
}

absl::Status Expect(bool ok, const std::string& what, int iteration) {
  if (ok) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("wrong result of ", what, " in iteration ", iteration));
}

// One iteration: every op issued before any wait, then every result checked.
absl::Status RunIteration(ProcessGroup& group, int iteration) {
  const int P = group.size(), r = group.rank();
  const size_t n = 1000 + iteration % 5;
  std::vector<float> sum(n, 0.0f);
  for (int rank = 0; rank < P; ++rank) {
    std::vector<float> data = Data(rank, iteration, n);
    for (size_t i = 0; i < n; ++i) sum[i] += data[i];
  }
  std::vector<float> mean = sum;
  for (float& value : mean) value /= static_cast<float>(P);
  const std::vector<size_t> counts = EvenCounts(n, P);
  size_t offset = 0;
  for (int rank = 0; rank < r; ++rank) offset += counts[rank];

  std::vector<float> summed = Data(r, iteration, n), averaged = summed;
  std::vector<float> input = summed, scattered(counts[r]);
  std::vector<float> piece(summed.begin() + offset, summed.begin() + offset + counts[r]);
  std::vector<float> gathered(n);
  const int root = iteration % P;
  std::vector<float> broadcast = Data(r, iteration, n);
  std::vector<float> to_next = Data(r, iteration, 17), from_prev(17);
  const int next = (r + 1) % P, prev = (r + P - 1) % P;

  std::vector<std::shared_ptr<Work>> works = {
      group.AllReduce(absl::MakeSpan(summed), ReduceOp::kSum),
      group.AllReduce(absl::MakeSpan(averaged), ReduceOp::kAvg),
      group.ReduceScatter(input, absl::MakeSpan(scattered), counts, ReduceOp::kSum),
      group.AllGather(piece, absl::MakeSpan(gathered), counts),
      group.Broadcast(absl::MakeSpan(broadcast), root),
  };
  // A pipelined ring: rank 0 sends first, everyone else receives first.
  if (r == 0) {
    works.push_back(group.Send(to_next, next, iteration));
    works.push_back(group.Recv(absl::MakeSpan(from_prev), prev, iteration));
  } else {
    works.push_back(group.Recv(absl::MakeSpan(from_prev), prev, iteration));
    works.push_back(group.Send(to_next, next, iteration));
  }
  works.push_back(group.Barrier());
  for (auto& work : works) {
    if (absl::Status status = work->Wait(); !status.ok()) return status;
  }

  std::vector<absl::Status> checks = {
      Expect(summed == sum, "allreduce sum", iteration),
      Expect(averaged == mean, "allreduce avg", iteration),
      Expect(
          scattered == std::vector<float>(sum.begin() + offset, sum.begin() + offset + counts[r]),
          "reduce_scatter", iteration),
      Expect(gathered == ExpectedGather(P, iteration, counts), "allgather", iteration),
      Expect(broadcast == Data(root, iteration, n), "broadcast", iteration),
      Expect(from_prev == Data(prev, iteration, 17), "send/recv", iteration),
  };
  for (const absl::Status& check : checks) {
    if (!check.ok()) return check;
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  std::string dir;
  int iterations = 20;
  bool first_attempt_loops = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (absl::StartsWith(arg, "--dir=")) {
      dir = arg.substr(6);
    } else if (absl::StartsWith(arg, "--iterations=")) {
      if (!absl::SimpleAtoi(arg.substr(13), &iterations)) return 2;
    } else if (arg == "--first_attempt_loops") {
      first_attempt_loops = true;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const std::string attempt = restart != nullptr ? restart : "0";
  const bool loop = first_attempt_loops && attempt == "0";
  if (loop) signal(SIGTERM, SIG_IGN);

  absl::StatusOr<WorldInfo> world = WorldFromEnvironment();
  std::string name;
  auto fail = [&](const absl::Status& status) {
    std::fprintf(stderr, "collective_rank %s: %s\n", name.c_str(), status.ToString().c_str());
    if (!dir.empty()) WriteFileAtomically(dir + "/error." + name, status.ToString());
    return 1;
  };
  if (!world.ok()) return fail(world.status());
  name = absl::StrCat(attempt, ".", world->rank);
  CommunicatorOptions options;
  options.timeout = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<Communicator>> comm = Communicator::Connect(*world, options);
  if (!comm.ok()) return fail(comm.status());
  WriteFileAtomically(dir + "/pid." + name, absl::StrCat(getpid()));

  const absl::Time give_up = absl::Now() + absl::Seconds(120);
  for (int i = 0; loop ? absl::Now() < give_up : i < iterations; ++i) {
    if (absl::Status status = RunIteration((*comm)->group(), i); !status.ok()) {
      return fail(status);
    }
    if (i == 0) WriteFileAtomically(dir + "/looping." + name, "");
  }
  WriteFileAtomically(dir + "/done." + name, "");
  return 0;
}

}  // namespace
}  // namespace muster::parallel

int main(int argc, char** argv) { return muster::parallel::Main(argc, argv); }
