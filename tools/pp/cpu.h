// The CPU time of a few threads, sampled from outside them, for
// tools/bench_pp: Pipeline::last_step_times() gives each action's wall
// start and end, and the CPU time the rank's thread used between the two
// is read back afterwards by interpolating between samples. On a machine
// with fewer cores than ranks, or shared with other work, that is the
// action's own cost, which its wall time is not.
//
// A background thread reads every registered thread's CPU clock
// (pthread_getcpuclockid) and the wall clock every `period`; the error of
// CpuAt is at most what the thread used in one period.
//
// Thread-safety: Register and Unregister from any thread (each thread
// registers itself); CpuAt only after Stop.
#pragma once

#include <pthread.h>
#include <time.h>

#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace muster::tools {

class ThreadCpuSampler {
 public:
  // Times are seconds since `epoch`. Starts sampling.
  ThreadCpuSampler(int threads, absl::Time epoch, absl::Duration period);
  ~ThreadCpuSampler();  // Stop()s

  // Samples the calling thread as `index` (0 <= index < threads) until it
  // calls Unregister(index), which it must before it exits.
  void Register(int index);
  void Unregister(int index);
  // Ends sampling. Idempotent.
  void Stop();

  // The CPU seconds thread `index` had used at `wall_s`, interpolated
  // between the samples around it (clamped to the first and last).
  // REQUIRES: Stop() was called.
  double CpuAt(int index, double wall_s) const;

 private:
  void Loop();

  const absl::Time epoch_;
  const absl::Duration period_;
  absl::Mutex mutex_;
  std::vector<bool> live_ ABSL_GUARDED_BY(mutex_);
  std::vector<clockid_t> clocks_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  // Per thread: (wall, cpu) seconds. Written by the sampling thread only,
  // read after it has been joined.
  std::vector<std::vector<std::pair<double, double>>> samples_;
  std::thread sampler_;
};

}  // namespace muster::tools
