#include "launcher/log_pump.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "spdlog/spdlog.h"

namespace muster::launcher {
namespace {

// False, with errno set, when a write fails: a closed console or a full
// disk must not stop the pump, so the caller decides what follows.
bool WriteFully(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t wrote = write(fd, data, size);
    if (wrote < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += wrote;
    size -= static_cast<size_t>(wrote);
  }
  return true;
}

struct Stream {
  int read_fd;
  LogSink sink;
  // Console text after the last line end; never holds one, and never more
  // than kMaxConsoleLine bytes, so each read is scanned once.
  std::string partial_line;
  // The last line shown ended with '\r': a '\n' right after it completes
  // that "\r\n" rather than showing an empty line.
  bool after_carriage_return = false;

  // Shows whole lines, each with the prefix, in one write() per read. A
  // line ends with '\n' or '\r' (progress bars redraw with '\r'; each
  // redraw keeps its prefix, and the terminal still draws them in place).
  // The log file failed with `error` (its open, or a write): it is closed
  // and given up, with one warning; the console takes over where the
  // stream was kept off it only for the file's sake.
  void FileFailed(int error) {
    if (sink.file_fd >= 0) close(sink.file_fd);
    sink.file_fd = -1;
    const char* then = "the console still shows its output";
    if (sink.console_fd < 0 && sink.fallback_console_fd >= 0) {
      sink.console_fd = sink.fallback_console_fd;
      then = "its output goes to the console instead";
    } else if (sink.console_fd < 0) {
      then = "its output from here on is lost (--local_ranks_filter keeps it off the console)";
    }
    spdlog::warn("cannot write the log file {}: {}; {}", sink.file_path, std::strerror(error),
                 then);
  }

  // A console write failed (a reader that closed the pipe: `launch ... |
  // head`): the job goes on and its console output is dropped, which the
  // agent says once per console stream.
  void ConsoleFailed(int error) {
    static absl::Mutex mu;
    static std::set<int>* said = new std::set<int>;  // console fds warned of; never freed
    const int fd = sink.console_fd;
    {
      absl::MutexLock lock(&mu);
      if (!said->insert(fd).second) return;
    }
    spdlog::warn(
        "cannot write the workers' output to {}: {}; it is dropped from here on, and the job "
        "goes on (--log_dir with --redirects or --tee keeps it in files)",
        fd == 1   ? "stdout"
        : fd == 2 ? "stderr"
                  : "the console",
        std::strerror(error));
  }

  void Consume(const char* data, size_t size) {
    if (sink.file_fd >= 0 && !WriteFully(sink.file_fd, data, size)) FileFailed(errno);
    if (sink.console_fd < 0) return;
    std::string out;
    const char* end = data + size;
    while (data < end) {
      const char* line_end = data;
      while (line_end < end && *line_end != '\n' && *line_end != '\r' &&
             partial_line.size() + static_cast<size_t>(line_end - data) < kMaxConsoleLine) {
        ++line_end;
      }
      if (line_end == end) break;  // no line end yet: keep the rest
      if (*line_end == '\n' && after_carriage_return && partial_line.empty() && line_end == data) {
        out.push_back('\n');
      } else {
        out.append(sink.prefix).append(partial_line).append(data, line_end);
        partial_line.clear();
        // A line cut at kMaxConsoleLine ends with a newline of ours.
        out.push_back(*line_end == '\r' ? '\r' : '\n');
      }
      bool ended_by_data = *line_end == '\n' || *line_end == '\r';
      after_carriage_return = ended_by_data && *line_end == '\r';
      data = ended_by_data ? line_end + 1 : line_end;
    }
    partial_line.append(data, end);
    if (!out.empty() && !WriteFully(sink.console_fd, out.data(), out.size())) {
      ConsoleFailed(errno);
    }
  }

  void Finish() {
    if (sink.console_fd >= 0 && !partial_line.empty()) {
      std::string out = sink.prefix + partial_line + "\n";
      if (!WriteFully(sink.console_fd, out.data(), out.size())) ConsoleFailed(errno);
    }
    close(read_fd);
    if (sink.file_fd >= 0) {
      fsync(sink.file_fd);
      close(sink.file_fd);
    }
  }
};

}  // namespace

struct LogPump::Impl {
  absl::Mutex mu;
  std::vector<Stream> incoming ABSL_GUARDED_BY(mu);
  int open_streams ABSL_GUARDED_BY(mu) = 0;  // added and not yet at EOF
  bool stopping ABSL_GUARDED_BY(mu) = false;
  int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  std::thread thread;

  void Wake() {
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd, &one, sizeof(one));
    (void)ignored;
  }

  void Run() {
    std::vector<Stream> streams;
    std::vector<pollfd> fds;
    char buffer[1 << 16];
    for (;;) {
      {
        absl::MutexLock lock(&mu);
        for (Stream& stream : incoming) streams.push_back(std::move(stream));
        incoming.clear();
        if (stopping && streams.empty()) return;
      }
      fds.assign(1, pollfd{wake_fd, POLLIN, 0});
      for (const Stream& stream : streams) fds.push_back(pollfd{stream.read_fd, POLLIN, 0});
      if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) return;
      if (fds[0].revents & POLLIN) {
        uint64_t count;
        ssize_t ignored = read(wake_fd, &count, sizeof(count));
        (void)ignored;
      }
      int finished = 0;
      for (size_t i = streams.size(); i-- > 0;) {
        if (fds[i + 1].revents == 0) continue;
        ssize_t got = read(streams[i].read_fd, buffer, sizeof(buffer));
        if (got > 0) {
          streams[i].Consume(buffer, static_cast<size_t>(got));
        } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
          streams[i].Finish();
          streams.erase(streams.begin() + static_cast<long>(i));
          ++finished;
        }
      }
      if (finished > 0) {
        absl::MutexLock lock(&mu);
        open_streams -= finished;
      }
      // On stop, streams still open belong to children that outlived their
      // agent's interest; they are closed below.
      absl::MutexLock lock(&mu);
      if (stopping) {
        for (Stream& stream : streams) stream.Finish();
        open_streams = 0;
        return;
      }
    }
  }
};

LogPump::LogPump() : impl_(std::make_unique<Impl>()) {
  impl_->thread = std::thread([this] { impl_->Run(); });
}

LogPump::~LogPump() {
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stopping = true;
  }
  impl_->Wake();
  impl_->thread.join();
  for (Stream& stream : impl_->incoming) stream.Finish();
  close(impl_->wake_fd);
}

void LogPump::Add(int read_fd, LogSink sink) {
  Stream stream{read_fd, std::move(sink), {}};
  if (stream.sink.file_fd < 0 && !stream.sink.file_path.empty()) {
    stream.FileFailed(stream.sink.file_error);
  }
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->incoming.push_back(std::move(stream));
    ++impl_->open_streams;
  }
  impl_->Wake();
}

bool LogPump::WaitDrained(absl::Duration timeout) {
  absl::MutexLock lock(&impl_->mu);
  auto drained = [this]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->mu) { return impl_->open_streams == 0; };
  return impl_->mu.AwaitWithTimeout(absl::Condition(&drained), timeout);
}

}  // namespace muster::launcher
