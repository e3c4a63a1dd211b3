#include "launcher/signal_watch.h"

#include <poll.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>

#include "spdlog/spdlog.h"

namespace muster::launcher {
namespace {

void Poke(int event_fd) {
  uint64_t one = 1;
  ssize_t ignored = write(event_fd, &one, sizeof(one));
  (void)ignored;
}

}  // namespace

SignalWatch::SignalWatch(int signal_fd)
    : signal_fd_(signal_fd),
      notify_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      stop_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      thread_([this] { Run(); }) {}

SignalWatch::~SignalWatch() {
  Poke(stop_fd_);
  thread_.join();
  close(notify_fd_);
  close(stop_fd_);
}

void SignalWatch::Watch(rdzv::JobWatcher* watcher) {
  absl::MutexLock lock(&mu_);
  watcher_ = watcher;
  // A signal that came before the watcher existed ends its waits too.
  if (watcher_ != nullptr && received() != 0) watcher_->Stop();
}

void SignalWatch::Run() {
  for (;;) {
    pollfd fds[2] = {{signal_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("signal watch: poll: {}", strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    signalfd_siginfo info;
    if (read(signal_fd_, &info, sizeof(info)) != sizeof(info)) continue;
    int signal_number = static_cast<int>(info.ssi_signo);
    int first = 0;
    if (!received_.compare_exchange_strong(first, signal_number)) {
      spdlog::warn("got SIG{} as well; still stopping for SIG{}", sigabbrev_np(signal_number),
                   sigabbrev_np(first));
      continue;
    }
    cancellation_.Cancel();
    {
      // Under the lock, so the watcher cannot be forgotten and destroyed
      // while it is being stopped. Stop() only joins the watcher's thread.
      absl::MutexLock lock(&mu_);
      if (watcher_ != nullptr) watcher_->Stop();
    }
    Poke(notify_fd_);
  }
}

}  // namespace muster::launcher
