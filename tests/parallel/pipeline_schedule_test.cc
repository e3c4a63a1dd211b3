// Pipeline schedules as data (parallel/pipeline_schedule.h): every schedule
// over the whole grid P <= 8, M <= 32, V <= 4 runs to the end in the
// simulator (no deadlock, each forward before its backward, every
// micro-batch and stage exactly once), holds no more than its in-flight
// bound, and has the bubble the theory gives; the config errors name
// their fields; a broken list is caught.
#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "parallel/pipeline_schedule.h"

namespace muster::parallel {
namespace {

using Type = PipelineAction::Type;

// Whether BuildSchedule must refuse the spec, by the rules in the header.
bool Refused(const ScheduleSpec& spec) {
  const int P = spec.pp, M = spec.microbatches, V = spec.virtual_stages;
  if (spec.kind == ScheduleKind::kInterleaved1F1B) return V < 2 || P < 2 || M % P != 0 || M < P;
  if (V != 1) return true;
  return spec.kind == ScheduleKind::k1F1B && M < P;
}

TEST_CASE("every schedule on the grid P <= 8, M <= 32, V <= 4 runs to the end within its bounds") {
  int simulated = 0, valid = 0;
  for (ScheduleKind kind :
       {ScheduleKind::kGpipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    for (int P = 1; P <= 8; ++P) {
      for (int M = 1; M <= 32; ++M) {
        for (int V = 1; V <= 4; ++V) {
          const ScheduleSpec spec{kind, P, M, V};
          auto built = BuildSchedule(spec);
          valid += Refused(spec) ? 0 : 1;
          if (Refused(spec)) {
            if (built.ok()) FAIL(ScheduleName(kind) << " P=" << P << " M=" << M << " V=" << V);
            continue;
          }
          if (!built.ok()) {
            FAIL(ScheduleName(kind)
                 << " P=" << P << " M=" << M << " V=" << V << ": " << built.status().message());
          }
          auto run = SimulateSchedule(spec, *built);
          if (!run.ok()) {
            FAIL(ScheduleName(kind)
                 << " P=" << P << " M=" << M << " V=" << V << ": " << run.status().message());
          }
          ++simulated;
          // The theory's bubble with forward 1 and backward 2 units:
          // (P - 1) / (M + P - 1), V times smaller in the pipeline's
          // length for interleaving.
          const double theory = kind == ScheduleKind::kInterleaved1F1B
                                    ? (P - 1.0) / (V * M + P - 1.0)
                                    : (P - 1.0) / (M + P - 1.0);
          for (int rank = 0; rank < P; ++rank) {
            if (run->peak_in_flight[rank] > InFlightBound(spec, rank)) {
              FAIL(ScheduleName(kind) << " P=" << P << " M=" << M << " V=" << V << " rank " << rank
                                      << ": " << run->peak_in_flight[rank] << " in flight, bound "
                                      << InFlightBound(spec, rank));
            }
            const double bubble = run->BubbleFraction(rank);
            if (std::abs(bubble - theory) > 1e-9) {
              FAIL(ScheduleName(kind) << " P=" << P << " M=" << M << " V=" << V << " rank " << rank
                                      << ": bubble " << bubble << ", theory " << theory);
            }
          }
          // 1F1B's point: at most P micro-batches held, where GPipe holds M.
          if (kind == ScheduleKind::k1F1B) CHECK(run->peak_in_flight[0] == std::min(M, P));
          if (kind == ScheduleKind::kGpipe) CHECK(run->peak_in_flight[0] == M);
        }
      }
    }
  }
  CHECK(simulated == valid);
  CHECK(simulated > 600);
}

TEST_CASE("1F1B on 4 ranks, 8 micro-batches: warm-up, steady 1F1B, cool-down") {
  auto built = BuildSchedule({ScheduleKind::k1F1B, 4, 8, 1});
  REQUIRE(built.ok());
  std::vector<std::string> computes;
  for (const PipelineAction& a : (*built)[1]) {
    if (a.type == Type::kForward || a.type == Type::kBackward) computes.push_back(ActionName(a));
  }
  // Rank 1 warms up with P - 1 - 1 = 2 forwards.
  CHECK(computes == std::vector<std::string>{"F0@s1", "F1@s1", "F2@s1", "B0@s1", "F3@s1", "B1@s1",
                                             "F4@s1", "B2@s1", "F5@s1", "B3@s1", "F6@s1", "B4@s1",
                                             "F7@s1", "B5@s1", "B6@s1", "B7@s1"});
  // The first stage receives nothing before a forward; a middle one
  // receives from its left neighbour and sends to its right.
  CHECK(ActionName((*built)[0][0]) == "F0@s0");
  CHECK(ActionName((*built)[0][1]) == "sendA0@s0->1");
  CHECK(ActionName((*built)[1][0]) == "recvA0@s1<-0");
  // The last stage turns each forward straight into its backward.
  CHECK(ActionName((*built)[3][1]) == "F0@s3");
  CHECK(ActionName((*built)[3][2]) == "B0@s3");
}

TEST_CASE("interleaved 1F1B places stage s on rank s % P") {
  auto built = BuildSchedule({ScheduleKind::kInterleaved1F1B, 2, 4, 2});
  REQUIRE(built.ok());
  for (int rank = 0; rank < 2; ++rank) {
    for (const PipelineAction& a : (*built)[rank]) CHECK(a.stage % 2 == rank);
  }
  // Stage 1 (rank 1) sends to stage 2, which is rank 0's second chunk.
  bool found = false;
  for (const PipelineAction& a : (*built)[1]) {
    if (a.type == Type::kSendActivation && a.stage == 1) found = found || a.peer == 0;
  }
  CHECK(found);
}

TEST_CASE("schedule config errors name the field") {
  auto message = [](const ScheduleSpec& spec) {
    return std::string(BuildSchedule(spec).status().message());
  };
  CHECK_THAT(message({ScheduleKind::k1F1B, 4, 2, 1}),
             Catch::StartsWith("parallel.microbatches: 2 is fewer than parallel.pp (4)"));
  CHECK_THAT(message({ScheduleKind::kInterleaved1F1B, 4, 6, 2}),
             Catch::StartsWith("parallel.microbatches: 6 is not a multiple of parallel.pp (4)"));
  CHECK_THAT(message({ScheduleKind::kInterleaved1F1B, 4, 8, 1}),
             Catch::StartsWith("parallel.virtual_stages: 1 with interleaved_1f1b"));
  CHECK_THAT(message({ScheduleKind::kGpipe, 4, 8, 2}),
             Catch::StartsWith("parallel.virtual_stages: 2 with gpipe"));
  CHECK_THAT(message({ScheduleKind::kGpipe, 0, 8, 1}), Catch::StartsWith("parallel.pp"));
  CHECK(ParseSchedule("1f1b").value() == ScheduleKind::k1F1B);
  CHECK_THAT(std::string(ParseSchedule("zb").status().message()),
             Catch::StartsWith("parallel.schedule: expected gpipe, 1f1b or interleaved_1f1b"));
  // GPipe may run fewer micro-batches than ranks.
  CHECK(BuildSchedule({ScheduleKind::kGpipe, 4, 2, 1}).ok());
}

TEST_CASE("the simulator catches a deadlock, a backward before its forward and a lost action") {
  const ScheduleSpec spec{ScheduleKind::k1F1B, 2, 2, 1};
  auto built = BuildSchedule(spec);
  REQUIRE(built.ok());
  // Rank 0 waits for a gradient before sending the activation that
  // produces it: a cycle.
  auto cycle = *built;
  std::vector<PipelineAction>& rank0 = cycle[0];
  std::swap(rank0[1], rank0[rank0.size() - 2]);  // sendA0 <-> recvG1 (moved early)
  auto deadlocked = SimulateSchedule(spec, cycle);
  CHECK(absl::IsFailedPrecondition(deadlocked.status()));
  CHECK_THAT(std::string(deadlocked.status().message()), Catch::StartsWith("deadlock: rank 0"));

  auto early = *built;
  std::vector<PipelineAction>& rank1 = early[1];
  // Rank 1's first forward and first backward swapped.
  auto f = std::find_if(rank1.begin(), rank1.end(),
                        [](const PipelineAction& a) { return a.type == Type::kForward; });
  auto b = std::find_if(rank1.begin(), rank1.end(),
                        [](const PipelineAction& a) { return a.type == Type::kBackward; });
  std::iter_swap(f, b);
  CHECK_THAT(std::string(SimulateSchedule(spec, early).status().message()),
             Catch::Contains("comes before its forward"));

  auto lost = *built;
  lost[0].pop_back();  // rank 0's last backward gone (stage 0 sends nothing after it)
  CHECK(absl::IsInvalidArgument(SimulateSchedule(spec, lost).status()));
}

}  // namespace
}  // namespace muster::parallel
