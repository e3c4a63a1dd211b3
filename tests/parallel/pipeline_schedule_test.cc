// Pipeline schedules as data (parallel/pipeline_schedule.h): every schedule
// over the whole grid P <= 8, M <= 32, V <= 4 runs to the end in the
// simulator (channel order, no deadlock, each forward before its backward,
// every micro-batch and stage exactly once), holds no more than its
// in-flight bound, and has the bubble the theory gives; ZB-H1 follows the
// paper's figure and has a third of 1F1B's bubble; the config errors name
// their fields; a broken list is caught.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <set>
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
  return spec.kind != ScheduleKind::kGpipe && M < P;
}

// The compute actions (F, B, Bi, Bw) of a list, by name.
std::vector<std::string> Computes(const std::vector<PipelineAction>& actions) {
  std::vector<std::string> names;
  for (const PipelineAction& a : actions) {
    if (a.peer < 0) names.push_back(ActionName(a));
  }
  return names;
}

TEST_CASE("every schedule on the grid P <= 8, M <= 32, V <= 4 runs to the end within its bounds") {
  int simulated = 0, valid = 0;
  for (ScheduleKind kind : {ScheduleKind::kGpipe, ScheduleKind::k1F1B,
                            ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubbleH1}) {
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
          // length for interleaving. ZB-H1's backward runs as Bi and Bw of
          // 1 each, and its bubble is (P - 1)(F + Bi - Bw) = P - 1 units
          // beside 3 M of work.
          const double theory =
              kind == ScheduleKind::kInterleaved1F1B ? (P - 1.0) / (V * M + P - 1.0)
              : kind == ScheduleKind::kZeroBubbleH1  ? (P - 1.0) / (3 * M + P - 1.0)
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
          if (kind == ScheduleKind::kZeroBubbleH1) {
            for (int rank = 0; rank < P; ++rank) {
              // The paper: every rank holds P micro-batches from F to Bw,
              // but rank r only 1F1B's P - r of them from F to Bi (whole
              // activations), so rank 0's peak memory is 1F1B's.
              CHECK(run->peak_in_flight[rank] == P);
              CHECK(run->peak_before_input_gradient[rank] == P - rank);
            }
          } else {
            CHECK(run->peak_before_input_gradient == run->peak_in_flight);
          }
        }
      }
    }
  }
  CHECK(simulated == valid);
  CHECK(simulated > 800);
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

TEST_CASE("ZB-H1 on 4 ranks, 8 micro-batches: the paper's Figure 3 (top)") {
  auto built = BuildSchedule({ScheduleKind::kZeroBubbleH1, 4, 8, 1});
  REQUIRE(built.ok());
  // The figure's rows, numbered from 0: 1F1B's forwards and backwards with
  // each B split, and rank r's Bw of micro-batch j after its Bi of j + r.
  CHECK(Computes((*built)[0]) ==
        std::vector<std::string>{"F0@s0",  "F1@s0",  "F2@s0",  "F3@s0",  "Bi0@s0", "Bw0@s0",
                                 "F4@s0",  "Bi1@s0", "Bw1@s0", "F5@s0",  "Bi2@s0", "Bw2@s0",
                                 "F6@s0",  "Bi3@s0", "Bw3@s0", "F7@s0",  "Bi4@s0", "Bw4@s0",
                                 "Bi5@s0", "Bw5@s0", "Bi6@s0", "Bw6@s0", "Bi7@s0", "Bw7@s0"});
  CHECK(Computes((*built)[1]) ==
        std::vector<std::string>{"F0@s1",  "F1@s1",  "F2@s1",  "Bi0@s1", "F3@s1",  "Bi1@s1",
                                 "Bw0@s1", "F4@s1",  "Bi2@s1", "Bw1@s1", "F5@s1",  "Bi3@s1",
                                 "Bw2@s1", "F6@s1",  "Bi4@s1", "Bw3@s1", "F7@s1",  "Bi5@s1",
                                 "Bw4@s1", "Bi6@s1", "Bw5@s1", "Bi7@s1", "Bw6@s1", "Bw7@s1"});
  CHECK(Computes((*built)[2]) ==
        std::vector<std::string>{"F0@s2",  "F1@s2",  "Bi0@s2", "F2@s2",  "Bi1@s2", "F3@s2",
                                 "Bi2@s2", "Bw0@s2", "F4@s2",  "Bi3@s2", "Bw1@s2", "F5@s2",
                                 "Bi4@s2", "Bw2@s2", "F6@s2",  "Bi5@s2", "Bw3@s2", "F7@s2",
                                 "Bi6@s2", "Bw4@s2", "Bi7@s2", "Bw5@s2", "Bw6@s2", "Bw7@s2"});
  CHECK(Computes((*built)[3]) ==
        std::vector<std::string>{"F0@s3", "Bi0@s3", "F1@s3",  "Bi1@s3", "F2@s3",  "Bi2@s3",
                                 "F3@s3", "Bi3@s3", "Bw0@s3", "F4@s3",  "Bi4@s3", "Bw1@s3",
                                 "F5@s3", "Bi5@s3", "Bw2@s3", "F6@s3",  "Bi6@s3", "Bw3@s3",
                                 "F7@s3", "Bi7@s3", "Bw4@s3", "Bw5@s3", "Bw6@s3", "Bw7@s3"});
  // The gradient goes on right after Bi: a middle rank receives it, runs
  // Bi, sends the input's gradient; Bw touches no network.
  const std::vector<PipelineAction>& rank1 = (*built)[1];
  auto bi = std::find_if(rank1.begin(), rank1.end(),
                         [](const PipelineAction& a) { return a.type == Type::kBackwardInput; });
  REQUIRE(bi != rank1.begin());
  REQUIRE(bi + 1 != rank1.end());
  CHECK(ActionName(*(bi - 1)) == "recvG0@s1<-2");
  CHECK(ActionName(*(bi + 1)) == "sendG0@s1->0");
  for (const PipelineAction& a : rank1) {
    if (a.type == Type::kBackwardWeight) CHECK(a.peer == -1);
  }
}

TEST_CASE("ZB-H1 with F = Bi = Bw: a third of 1F1B's bubble, as the paper's Table 2 gives") {
  const ActionCosts unit{1.0, 1.0, 1.0};
  for (int P = 2; P <= 8; ++P) {
    for (int M = P; M <= 32; ++M) {
      INFO("P=" << P << " M=" << M);
      const ScheduleSpec zb{ScheduleKind::kZeroBubbleH1, P, M, 1},
          one{ScheduleKind::k1F1B, P, M, 1};
      auto zb_run = SimulateSchedule(zb, BuildSchedule(zb).value(), unit);
      auto one_run = SimulateSchedule(one, BuildSchedule(one).value(), unit);
      REQUIRE(zb_run.ok());
      REQUIRE(one_run.ok());
      for (int rank = 0; rank < P; ++rank) {
        // Every rank computes 3 M units; the paper's bubbles are
        // (P - 1)(F + Bi - Bw) for ZB-H1 and (P - 1)(F + Bi + Bw) for 1F1B.
        CHECK(zb_run->busy[rank] == 3.0 * M);
        CHECK(zb_run->makespan - zb_run->busy[rank] == P - 1.0);
        CHECK(one_run->makespan - one_run->busy[rank] == 3.0 * (P - 1));
      }
      CHECK(zb_run->makespan < one_run->makespan);
    }
  }
}

TEST_CASE("ZB-H1 keeps to the paper's bubble when Bw is the shortest pass") {
  // TW < TF < TB with TB + TW = 2 TF, as the paper's Table 1 counts a
  // transformer layer; Table 2's bubble (P - 1)(TF + TB - TW) is then an
  // upper bound on every rank.
  for (const ActionCosts& costs : {ActionCosts{1.0, 1.25, 0.75}, ActionCosts{1.0, 1.5, 0.5}}) {
    for (int P = 2; P <= 8; ++P) {
      for (int M = P; M <= 32; ++M) {
        INFO("P=" << P << " M=" << M << " Bi=" << costs.backward_input);
        const ScheduleSpec zb{ScheduleKind::kZeroBubbleH1, P, M, 1};
        auto run = SimulateSchedule(zb, BuildSchedule(zb).value(), costs);
        REQUIRE(run.ok());
        const double paper =
            (P - 1) * (costs.forward + costs.backward_input - costs.backward_weight);
        for (int rank = 0; rank < P; ++rank) {
          CHECK(run->makespan - run->busy[rank] <= paper + 1e-9);
        }
        const ScheduleSpec one{ScheduleKind::k1F1B, P, M, 1};
        CHECK(run->makespan < SimulateSchedule(one, BuildSchedule(one).value(), costs)->makespan);
      }
    }
  }
}

TEST_CASE("the simulator checks each channel's order on the lists") {
  // GPipe, 2 ranks, 2 micro-batches, by hand. Rank 0 sends activation 0,
  // then 1, on the channel to rank 1.
  const ScheduleSpec spec{ScheduleKind::kGpipe, 2, 2, 1};
  const std::vector<PipelineAction> rank0 = {
      {Type::kForward, 0, 0, -1},     {Type::kSendActivation, 0, 0, 1},
      {Type::kForward, 1, 0, -1},     {Type::kSendActivation, 1, 0, 1},
      {Type::kRecvGradient, 0, 0, 1}, {Type::kBackward, 0, 0, -1},
      {Type::kRecvGradient, 1, 0, 1}, {Type::kBackward, 1, 0, -1}};
  const std::vector<PipelineAction> rank1 = {
      {Type::kRecvActivation, 0, 1, 0}, {Type::kRecvActivation, 1, 1, 0},
      {Type::kForward, 0, 1, -1},       {Type::kForward, 1, 1, -1},
      {Type::kBackward, 0, 1, -1},      {Type::kSendGradient, 0, 1, 0},
      {Type::kBackward, 1, 1, -1},      {Type::kSendGradient, 1, 1, 0}};
  REQUIRE(SimulateSchedule(spec, {rank0, rank1}).ok());

  // Rank 1 receives activation 1 first. Both sends are issued before
  // either receive runs, so timing alone would let it pass; on the
  // runtime's channel it waits behind activation 0 forever.
  std::vector<PipelineAction> swapped = rank1;
  std::swap(swapped[0], swapped[1]);
  auto run = SimulateSchedule(spec, {rank0, swapped});
  CHECK(absl::IsInvalidArgument(run.status()));
  CHECK(std::string(run.status().message()) ==
        "rank 1: recvA1@s1<-0 out of channel order: the channel's next message is rank 0's "
        "sendA0@s0->1");

  // The order is the sender's: rank 0 sending activation 1 first breaks it too.
  std::vector<PipelineAction> sends_swapped = rank0;
  std::swap(sends_swapped[1], sends_swapped[3]);
  std::swap(sends_swapped[0], sends_swapped[2]);  // both forwards before their sends
  CHECK(std::string(SimulateSchedule(spec, {sends_swapped, rank1}).status().message()) ==
        "rank 1: recvA0@s1<-0 out of channel order: the channel's next message is rank 0's "
        "sendA1@s0->1");

  // A send nobody receives, and a receive nobody sends.
  std::vector<PipelineAction> unreceived = rank1;
  unreceived.erase(unreceived.begin() + 1);
  CHECK_THAT(std::string(SimulateSchedule(spec, {rank0, unreceived}).status().message()),
             Catch::StartsWith("rank 0: sendA1@s0->1 is never received"));
  std::vector<PipelineAction> unsent = rank0;
  unsent.erase(unsent.begin() + 3);
  CHECK_THAT(std::string(SimulateSchedule(spec, {unsent, rank1}).status().message()),
             Catch::StartsWith("rank 1: recvA1@s1<-0 is never sent"));
}

TEST_CASE("interleaved 1F1B's wrap-around channels carry several stages, in order") {
  // The activation channel from rank P - 1 to rank 0 carries every chunk
  // boundary's messages (stage P - 1 to P, 2P - 1 to 2P, ...), and so does
  // the gradient channel back: the order check has more than one stage's
  // micro-batches to interleave there.
  for (int P : {2, 3, 4}) {
    INFO("P=" << P);
    const ScheduleSpec spec{ScheduleKind::kInterleaved1F1B, P, 2 * P, 3};
    auto built = BuildSchedule(spec);
    REQUIRE(built.ok());
    std::vector<int> activation_stages, gradient_stages;
    for (const PipelineAction& a : (*built)[P - 1]) {
      if (a.type == Type::kSendActivation && a.peer == 0) activation_stages.push_back(a.stage);
    }
    for (const PipelineAction& a : (*built)[0]) {
      if (a.type == Type::kSendGradient && a.peer == P - 1) gradient_stages.push_back(a.stage);
    }
    CHECK(std::set<int>(activation_stages.begin(), activation_stages.end()) ==
          std::set<int>{P - 1, 2 * P - 1});
    CHECK(std::set<int>(gradient_stages.begin(), gradient_stages.end()) == std::set<int>{P, 2 * P});
    CHECK(SimulateSchedule(spec, *built).ok());
  }
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
  CHECK_THAT(message({ScheduleKind::kZeroBubbleH1, 4, 3, 1}),
             Catch::StartsWith("parallel.microbatches: 3 is fewer than parallel.pp (4): zb_h1"));
  CHECK_THAT(message({ScheduleKind::kZeroBubbleH1, 4, 8, 2}),
             Catch::StartsWith("parallel.virtual_stages: 2 with zb_h1"));
  CHECK(ParseSchedule("1f1b").value() == ScheduleKind::k1F1B);
  CHECK(ParseSchedule("zb_h1").value() == ScheduleKind::kZeroBubbleH1);
  CHECK(std::string(ScheduleName(ScheduleKind::kZeroBubbleH1)) == "zb_h1");
  CHECK_THAT(
      std::string(ParseSchedule("zb").status().message()),
      Catch::StartsWith("parallel.schedule: expected gpipe, 1f1b, interleaved_1f1b or zb_h1"));
  // GPipe may run fewer micro-batches than ranks.
  CHECK(BuildSchedule({ScheduleKind::kGpipe, 4, 2, 1}).ok());
}

TEST_CASE("the simulator catches a deadlock, a backward before its forward and a lost action") {
  const ScheduleSpec spec{ScheduleKind::k1F1B, 2, 2, 1};
  auto built = BuildSchedule(spec);
  REQUIRE(built.ok());
  // Rank 0 waits for a gradient before sending the activation that
  // produces it: a cycle, though every channel keeps its order.
  auto cycle = *built;
  std::vector<PipelineAction>& rank0 = cycle[0];
  REQUIRE(ActionName(rank0[4]) == "recvG0@s0<-1");
  std::rotate(rank0.begin() + 1, rank0.begin() + 4, rank0.begin() + 5);  // F0 recvG0 sendA0 ...
  auto deadlocked = SimulateSchedule(spec, cycle);
  CHECK(absl::IsFailedPrecondition(deadlocked.status()));
  CHECK(std::string(deadlocked.status().message()) ==
        "deadlock: rank 0: recvG0@s0<-1; rank 1: recvA0@s1<-0 wait forever");

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

  // A gradient sent before the backward that computes it.
  auto unready = *built;
  std::vector<PipelineAction>& last = unready[1];
  REQUIRE(ActionName(last[3]) == "sendG0@s1->0");
  std::swap(last[2], last[3]);
  CHECK_THAT(std::string(SimulateSchedule(spec, unready).status().message()),
             Catch::Contains("sendG0@s1->0 comes before the backward (B or Bi) that computes it"));
}

TEST_CASE("the simulator holds split backwards to their rules") {
  const ScheduleSpec spec{ScheduleKind::kZeroBubbleH1, 2, 2, 1};
  auto built = BuildSchedule(spec);
  REQUIRE(built.ok());
  REQUIRE(SimulateSchedule(spec, *built).ok());
  auto find = [](std::vector<PipelineAction>& list, const std::string& name) {
    return std::find_if(list.begin(), list.end(),
                        [&](const PipelineAction& a) { return ActionName(a) == name; });
  };
  auto message = [&](const std::vector<std::vector<PipelineAction>>& ranks) {
    return std::string(SimulateSchedule(spec, ranks).status().message());
  };

  // Bw before its Bi.
  auto early = *built;
  std::iter_swap(find(early[1], "Bi0@s1"), find(early[1], "Bw0@s1"));
  CHECK_THAT(message(early), Catch::Contains("rank 1: Bw0@s1 comes before its Bi"));

  // A whole backward where Bi and Bw ran.
  auto mixed = *built;
  mixed[0].push_back({Type::kBackward, 1, 0, -1});
  CHECK_THAT(message(mixed),
             Catch::Contains("rank 0: B1@s0 mixes a whole backward with Bi and Bw"));

  // Bi without its Bw: the weights never get their gradient.
  auto missing = *built;
  missing[0].erase(find(missing[0], "Bw1@s0"));
  CHECK_THAT(message(missing), Catch::StartsWith("4 forwards and 3 backwards (B, or Bi and Bw)"));

  // A repeated Bw.
  auto twice = *built;
  twice[1].push_back({Type::kBackwardWeight, 0, 1, -1});
  CHECK_THAT(message(twice), Catch::Contains("rank 1: Bw0@s1 is repeated"));

  // Costs per type: a whole backward costs Bi + Bw; the two-number form
  // splits its backward in halves.
  const ActionCosts costs{1.0, 2.0, 0.5};
  auto split = SimulateSchedule(spec, *built, costs);
  REQUIRE(split.ok());
  CHECK(split->busy[0] == 2 * (1.0 + 2.0 + 0.5));
  const ScheduleSpec one{ScheduleKind::k1F1B, 2, 2, 1};
  auto whole = SimulateSchedule(one, BuildSchedule(one).value(), costs);
  REQUIRE(whole.ok());
  CHECK(whole->busy[1] == 2 * (1.0 + 2.0 + 0.5));
  CHECK(SimulateSchedule(spec, *built, 1.0, 3.0)->busy[0] == 2 * (1.0 + 1.5 + 1.5));
}

TEST_CASE("split backwards have names") {
  CHECK(ActionName({Type::kBackwardInput, 3, 1, -1}) == "Bi3@s1");
  CHECK(ActionName({Type::kBackwardWeight, 0, 2, -1}) == "Bw0@s2");
}

}  // namespace
}  // namespace muster::parallel
