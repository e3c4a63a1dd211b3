#include "tools/pp/cpu.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace muster::tools {

ThreadCpuSampler::ThreadCpuSampler(int threads, absl::Time epoch, absl::Duration period)
    : epoch_(epoch),
      period_(period),
      live_(threads, false),
      clocks_(threads),
      samples_(threads),
      sampler_([this] { Loop(); }) {}

ThreadCpuSampler::~ThreadCpuSampler() { Stop(); }

void ThreadCpuSampler::Register(int index) {
  clockid_t clock;
  pthread_getcpuclockid(pthread_self(), &clock);
  absl::MutexLock lock(&mutex_);
  clocks_[index] = clock;
  live_[index] = true;
}

void ThreadCpuSampler::Unregister(int index) {
  // Under the lock: the sampler never reads the clock of a thread that
  // has gone.
  absl::MutexLock lock(&mutex_);
  live_[index] = false;
}

void ThreadCpuSampler::Stop() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  if (sampler_.joinable()) sampler_.join();
}

void ThreadCpuSampler::Loop() {
  absl::MutexLock lock(&mutex_);
  while (!stopping_) {
    for (size_t i = 0; i < clocks_.size(); ++i) {
      if (!live_[i]) continue;
      timespec cpu{};
      if (clock_gettime(clocks_[i], &cpu) != 0) continue;
      const double wall = absl::ToDoubleSeconds(absl::Now() - epoch_);
      samples_[i].emplace_back(wall, cpu.tv_sec + cpu.tv_nsec * 1e-9);
    }
    // Sleeps without the lock; wakes early to stop.
    mutex_.AwaitWithTimeout(absl::Condition(&stopping_), period_);
  }
}

double ThreadCpuSampler::CpuAt(int index, double wall_s) const {
  const std::vector<std::pair<double, double>>& samples = samples_[index];
  if (samples.empty()) return 0;
  auto after = std::lower_bound(samples.begin(), samples.end(), std::make_pair(wall_s, 0.0));
  if (after == samples.begin()) return samples.front().second;
  if (after == samples.end()) return samples.back().second;
  const auto& [wall1, cpu1] = *after;
  const auto& [wall0, cpu0] = *(after - 1);
  return wall1 == wall0 ? cpu1 : cpu0 + (cpu1 - cpu0) * (wall_s - wall0) / (wall1 - wall0);
}

}  // namespace muster::tools
