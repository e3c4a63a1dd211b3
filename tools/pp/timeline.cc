#include "tools/pp/timeline.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

namespace muster::tools {
namespace {

using Type = parallel::PipelineAction::Type;

// The compute kinds, in the order of Kind() (the rest are messages).
constexpr int kKinds = 4;

// 0 F, 1 B, 2 Bi, 3 Bw; -1 for a send or receive, which is not work.
int Kind(const parallel::PipelineAction& action) {
  switch (action.type) {
    case Type::kForward:
      return 0;
    case Type::kBackward:
      return 1;
    case Type::kBackwardInput:
      return 2;
    case Type::kBackwardWeight:
      return 3;
    default:
      return -1;
  }
}

bool IsCompute(const parallel::PipelineAction& action) { return Kind(action) >= 0; }

struct Interval {
  int rank = 0;
  size_t action = 0;          // its index in the rank's times
  double start = 0, end = 0;  // the job's clock, wall seconds
};

// The normalized clock (see the header) from the compute intervals.
class NormalizedClock {
 public:
  NormalizedClock(const std::vector<Interval>& computes, int cores) {
    for (const Interval& interval : computes) {
      points_.push_back(interval.start);
      points_.push_back(interval.end);
    }
    std::sort(points_.begin(), points_.end());
    points_.erase(std::unique(points_.begin(), points_.end()), points_.end());
    at_.assign(points_.size(), 0.0);
    for (size_t i = 1; i < points_.size(); ++i) {
      const double middle = (points_[i - 1] + points_[i]) / 2;
      int running = 0;
      for (const Interval& interval : computes) {
        running += interval.start < middle && middle < interval.end;
      }
      const double rate = running > cores ? static_cast<double>(cores) / running : 1.0;
      at_[i] = at_[i - 1] + rate * (points_[i] - points_[i - 1]);
    }
  }

  // REQUIRES: `wall` is an interval's start or end.
  double At(double wall) const {
    const size_t i = std::lower_bound(points_.begin(), points_.end(), wall) - points_.begin();
    return at_[i];
  }

 private:
  std::vector<double> points_;  // every start and end, sorted, unique
  std::vector<double> at_;      // the normalized clock there
};

// The ranks' lists run against each other, action i of rank r taking
// took[r][i]; per rank, 1 - busy / makespan.
std::vector<double> Replay(const std::vector<RankStep>& ranks,
                           const std::vector<std::vector<double>>& took) {
  const int pp = static_cast<int>(ranks.size());
  std::vector<double> clock(pp, 0.0), busy(pp, 0.0);
  std::vector<size_t> next(pp, 0);
  // (gradient, micro-batch, the sender's stage) -> when it was sent.
  std::map<std::tuple<bool, int, int>, double> sent;
  for (bool progress = true; progress;) {
    progress = false;
    for (int rank = 0; rank < pp; ++rank) {
      for (; next[rank] < ranks[rank].times.size(); ++next[rank], progress = true) {
        const parallel::PipelineAction& action = ranks[rank].times[next[rank]].action;
        const int m = action.microbatch, stage = action.stage;
        if (action.type == Type::kRecvActivation || action.type == Type::kRecvGradient) {
          const bool gradient = action.type == Type::kRecvGradient;
          auto found = sent.find({gradient, m, gradient ? stage + 1 : stage - 1});
          if (found == sent.end()) break;  // not sent yet: the other ranks first
          clock[rank] = std::max(clock[rank], found->second);
        } else if (action.type == Type::kSendActivation || action.type == Type::kSendGradient) {
          sent[{action.type == Type::kSendGradient, m, stage}] = clock[rank];
        } else {
          clock[rank] += took[rank][next[rank]];
          busy[rank] += took[rank][next[rank]];
        }
      }
    }
  }
  const double makespan = *std::max_element(clock.begin(), clock.end());
  std::vector<double> idle;
  for (int rank = 0; rank < pp; ++rank) idle.push_back(1 - busy[rank] / makespan);
  return idle;
}

}  // namespace

StepIdle MeasureStep(const std::vector<RankStep>& ranks, int cores) {
  const int pp = static_cast<int>(ranks.size());
  std::vector<Interval> computes;
  for (int rank = 0; rank < pp; ++rank) {
    const RankStep& step = ranks[rank];
    for (size_t i = 0; i < step.times.size(); ++i) {
      if (!IsCompute(step.times[i].action)) continue;
      computes.push_back(
          {rank, i, step.began_s + step.times[i].start, step.began_s + step.times[i].end});
    }
  }
  const NormalizedClock clock(computes, cores);
  StepIdle step;
  std::vector<double> busy_wall(pp, 0.0);
  step.busy_normalized_s.assign(pp, 0.0);
  step.busy_cpu_s.assign(pp, 0.0);
  // Per kind (Kind()) and rank: the CPU time and count, for the means.
  std::vector<double> cpu[kKinds];
  std::vector<int> count[kKinds];
  for (int kind = 0; kind < kKinds; ++kind) {
    cpu[kind].assign(pp, 0.0);
    count[kind].assign(pp, 0);
  }
  double first = std::numeric_limits<double>::max(), last = 0;
  for (const Interval& interval : computes) {
    const int rank = interval.rank;
    first = std::min(first, interval.start);
    last = std::max(last, interval.end);
    busy_wall[rank] += interval.end - interval.start;
    step.busy_normalized_s[rank] += clock.At(interval.end) - clock.At(interval.start);
    const double took = ranks[rank].action_cpu_s[interval.action];
    step.busy_cpu_s[rank] += took;
    const int kind = Kind(ranks[rank].times[interval.action].action);
    cpu[kind][rank] += took;
    ++count[kind][rank];
  }
  step.span_wall_s = last - first;
  const double span_normalized = clock.At(last) - clock.At(first);
  // Per kind: the mean per rank, and over every rank.
  std::vector<double> mean[kKinds];
  double all_mean[kKinds];
  for (int kind = 0; kind < kKinds; ++kind) {
    double total = 0;
    int n = 0;
    for (int rank = 0; rank < pp; ++rank) {
      mean[kind].push_back(cpu[kind][rank] / std::max(count[kind][rank], 1));
      total += cpu[kind][rank];
      n += count[kind][rank];
    }
    all_mean[kind] = total / std::max(n, 1);
  }
  step.forward_cpu_s = mean[0];
  step.backward_cpu_s = mean[1];
  step.backward_input_cpu_s = mean[2];
  step.backward_weight_cpu_s = mean[3];
  step.forward_s = all_mean[0];
  step.backward_s = all_mean[1];
  step.backward_input_s = all_mean[2];
  step.backward_weight_s = all_mean[3];
  std::vector<std::vector<double>> cpu_took(pp), mean_took(pp);
  for (int rank = 0; rank < pp; ++rank) {
    step.idle_wall.push_back(1 - busy_wall[rank] / step.span_wall_s);
    step.idle_normalized.push_back(1 - step.busy_normalized_s[rank] / span_normalized);
    for (size_t i = 0; i < ranks[rank].times.size(); ++i) {
      const int kind = Kind(ranks[rank].times[i].action);
      // Every compute its own measured CPU time (Bi and Bw included), or
      // the rank's mean of its kind.
      cpu_took[rank].push_back(kind >= 0 ? ranks[rank].action_cpu_s[i] : 0.0);
      mean_took[rank].push_back(kind >= 0 ? mean[kind][rank] : 0.0);
    }
  }
  step.idle_replay = Replay(ranks, cpu_took);
  step.idle_mean_replay = Replay(ranks, mean_took);
  return step;
}

}  // namespace muster::tools
