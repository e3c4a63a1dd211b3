// Turns a handled signal into the end of whatever the agent is waiting for.
//
// `launch` blocks its handled signals (--signals_to_handle) in every thread
// and reads them from a signalfd (main.cc). A SignalWatch reads that fd on
// a thread of its own, so a signal is noticed in every wait of the agent:
// gathering for a round, the MASTER_PORT wait, the wait for the job to
// close, connecting to the service, and the loop that watches the workers.
// On the first signal it
//   - records its number (received()),
//   - cancels cancellation(): an RPC in flight that uses it ends with
//     CANCELLED, and later ones fail at once,
//   - stops the JobWatcher given to Watch(): a WaitFor ends with CANCELLED,
//   - makes fd() readable, for good: a poll() including it wakes.
// The waiter then sees received() != 0 and shuts down. Later signals are
// logged and otherwise ignored: the first one decides how the agent stops.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "rendezvous/client/client.h"

namespace muster::launcher {

class SignalWatch {
 public:
  // Starts reading `signal_fd` (a non-blocking signalfd; not owned, must
  // outlive the watch).
  explicit SignalWatch(int signal_fd);
  // Stops and joins the thread.
  ~SignalWatch();
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;

  // The first signal received, or 0.
  int received() const { return received_.load(); }

  // Readable (POLLIN) once a signal was received. Owned by the watch.
  int fd() const { return notify_fd_; }

  // For every RPC that may wait long: the first signal cancels it.
  rdzv::Cancellation* cancellation() { return &cancellation_; }

  // Stops `watcher` on the first signal, or at once if one was received
  // already. nullptr forgets the one given before. REQUIRES: the watcher
  // stays alive until it is forgotten (Watch(nullptr)) or the watch goes.
  void Watch(rdzv::JobWatcher* watcher);

 private:
  void Run();

  const int signal_fd_;
  const int notify_fd_;  // eventfd: readable once a signal came
  const int stop_fd_;    // eventfd: ends Run()
  std::atomic<int> received_{0};
  rdzv::Cancellation cancellation_;

  absl::Mutex mu_;
  rdzv::JobWatcher* watcher_ ABSL_GUARDED_BY(mu_) = nullptr;

  std::thread thread_;  // last: starts after every field is ready
};

}  // namespace muster::launcher
