#include "launcher/log_pump.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace muster::launcher {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void Write(int fd, const std::string& text) {
  REQUIRE(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
}

TEST_CASE("lines reach files as written and the console prefixed, whole") {
  char dir_template[] = "/tmp/log_pump_testXXXXXX";
  std::string dir = mkdtemp(dir_template);
  int console[2], worker0[2], worker1[2];
  REQUIRE(pipe(console) == 0);
  REQUIRE(pipe(worker0) == 0);
  REQUIRE(pipe(worker1) == 0);
  std::string file0 = dir + "/rank0.log";
  {
    LogPump pump;
    pump.Add(worker0[0], LogSink{open(file0.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644),
                                 console[1], "[node0 rank0]: "});
    pump.Add(worker1[0], LogSink{-1, console[1], "[node0 rank1]: "});
    Write(worker0[1], "first ha");
    Write(worker1[1], "other line\n");
    Write(worker0[1], "lf\nsecond\nunterminated");
    close(worker0[1]);
    close(worker1[1]);
    REQUIRE(pump.WaitDrained(absl::Seconds(10)));
  }
  close(console[1]);
  std::string console_text;
  char buffer[4096];
  ssize_t got;
  while ((got = read(console[0], buffer, sizeof(buffer))) > 0) console_text.append(buffer, got);
  close(console[0]);

  CHECK(Slurp(file0) == "first half\nsecond\nunterminated");
  std::vector<std::string> lines = absl::StrSplit(console_text, '\n', absl::SkipEmpty());
  std::multiset<std::string> got_lines(lines.begin(), lines.end());
  std::multiset<std::string> want = {"[node0 rank0]: first half", "[node0 rank0]: second",
                                     "[node0 rank0]: unterminated", "[node0 rank1]: other line"};
  CHECK(got_lines == want);
  std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("WaitDrained times out while a writer is still open") {
  int worker[2];
  REQUIRE(pipe(worker) == 0);
  LogPump pump;
  pump.Add(worker[0], LogSink{});
  CHECK_FALSE(pump.WaitDrained(absl::Milliseconds(50)));
  close(worker[1]);
  CHECK(pump.WaitDrained(absl::Seconds(10)));
}

// A temporary file to stand for the console (a pipe nobody reads would
// fill up and stall the pump).
struct ConsoleFile {
  ConsoleFile() {
    char path_template[] = "/tmp/log_pump_consoleXXXXXX";
    fd = mkstemp(path_template);
    REQUIRE(fd >= 0);
    path = path_template;
  }
  ~ConsoleFile() {
    close(fd);
    unlink(path.c_str());
  }
  std::string Text() const { return Slurp(path); }
  int fd;
  std::string path;
};

// The process's peak resident set, in KiB.
int64_t PeakRssKib() {
  for (absl::string_view line : absl::StrSplit(Slurp("/proc/self/status"), '\n')) {
    if (absl::ConsumePrefix(&line, "VmHWM:")) {
      int64_t kib = 0;
      REQUIRE(absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(line), " kB"), &kib));
      return kib;
    }
  }
  FAIL("no VmHWM in /proc/self/status");
  return 0;
}

// The agent's log while it lives: spdlog's default logger writes to `text`.
struct CapturedLog {
  CapturedLog() : previous(spdlog::default_logger()) {
    spdlog::set_default_logger(std::make_shared<spdlog::logger>(
        "captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(text)));
  }
  ~CapturedLog() { spdlog::set_default_logger(previous); }
  std::ostringstream text;
  std::shared_ptr<spdlog::logger> previous;
};

TEST_CASE("a log file that fails is given up with one warning, and the console shows the rest") {
  CapturedLog log;
  ConsoleFile console;
  int redirected[2], teed[2], filtered[2], unopened[2];
  for (int* fds : {redirected, teed, filtered, unopened}) REQUIRE(pipe(fds) == 0);
  // /dev/full: every write fails with ENOSPC, as on a full disk.
  auto full = [] { return open("/dev/full", O_WRONLY | O_CLOEXEC); };
  {
    LogPump pump;
    // --redirects: the file only, the console if the file fails.
    LogSink file_only{full(), -1, "[n rank0]: ", "/logs/0/stdout.log"};
    file_only.fallback_console_fd = console.fd;
    pump.Add(redirected[0], file_only);
    // --tee: the file and the console.
    pump.Add(teed[0], LogSink{full(), console.fd, "[n rank1]: ", "/logs/1/stdout.log"});
    // Kept off the console by --local_ranks_filter: nowhere else to go.
    pump.Add(filtered[0], LogSink{full(), -1, "[n rank2]: ", "/logs/2/stdout.log"});
    // A file that could not even be opened.
    LogSink not_opened{-1, -1, "[n rank3]: ", "/logs/3/stdout.log", ENOTDIR};
    not_opened.fallback_console_fd = console.fd;
    pump.Add(unopened[0], not_opened);
    for (int* fds : {redirected, teed, filtered, unopened}) {
      Write(fds[1], "one\n");
      Write(fds[1], "two\n");  // after the failure: one warning per file, not per write
      close(fds[1]);
    }
    REQUIRE(pump.WaitDrained(absl::Seconds(10)));
  }
  std::vector<std::string> lines = absl::StrSplit(console.Text(), '\n', absl::SkipEmpty());
  std::multiset<std::string> shown(lines.begin(), lines.end());
  CHECK(shown == std::multiset<std::string>{"[n rank0]: one", "[n rank0]: two", "[n rank1]: one",
                                            "[n rank1]: two", "[n rank3]: one", "[n rank3]: two"});
  const std::string warnings = log.text.str();
  INFO(warnings);
  std::vector<std::string> warned = absl::StrSplit(warnings, '\n', absl::SkipEmpty());
  CHECK(warned.size() == 4);
  for (const std::string& want :
       {"cannot write the log file /logs/0/stdout.log: No space left on device; its output goes "
        "to the console instead",
        "cannot write the log file /logs/1/stdout.log: No space left on device; the console "
        "still shows its output",
        "cannot write the log file /logs/2/stdout.log: No space left on device; its output from "
        "here on is lost (--local_ranks_filter keeps it off the console)",
        "cannot write the log file /logs/3/stdout.log: Not a directory; its output goes to the "
        "console instead"}) {
    CHECK(absl::StrContains(warnings, want));
  }
}

TEST_CASE("a console whose reader is gone: the output is dropped, with one warning") {
  // `launch ... | head`: the pump goes on, the job too, and says so once.
  signal(SIGPIPE, SIG_IGN);  // as launch's main does
  CapturedLog log;
  int console[2], worker[2];
  REQUIRE(pipe(console) == 0);
  REQUIRE(pipe(worker) == 0);
  close(console[0]);
  {
    LogPump pump;
    pump.Add(worker[0], LogSink{-1, console[1], "[n rank0]: ", ""});
    Write(worker[1], "one\n");
    Write(worker[1], "two\n");
    close(worker[1]);
    REQUIRE(pump.WaitDrained(absl::Seconds(10)));
  }
  close(console[1]);
  std::vector<std::string> warned = absl::StrSplit(log.text.str(), '\n', absl::SkipEmpty());
  REQUIRE(warned.size() == 1);
  CHECK(absl::StrContains(warned[0],
                          "cannot write the workers' output to the console: Broken "
                          "pipe; it is dropped from here on, and the job goes on"));
}

TEST_CASE("a carriage return ends a console line: progress bars keep their prefix") {
  ConsoleFile console;
  int worker[2];
  REQUIRE(pipe(worker) == 0);
  {
    LogPump pump;
    pump.Add(worker[0], LogSink{-1, console.fd, "[n rank0]: "});
    Write(worker[1], " 10%|#\r 20%|##\r 30%");
    Write(worker[1], "|###\ndone\r\nnext\r");
    Write(worker[1], "\nlast\n");
    close(worker[1]);
    REQUIRE(pump.WaitDrained(absl::Seconds(10)));
  }
  CHECK(console.Text() ==
        "[n rank0]:  10%|#\r[n rank0]:  20%|##\r[n rank0]:  30%|###\n"
        "[n rank0]: done\r\n[n rank0]: next\r\n[n rank0]: last\n");
}

TEST_CASE("a line with no end reaches the console in pieces of kMaxConsoleLine") {
  ConsoleFile console;
  int worker[2];
  REQUIRE(pipe(worker) == 0);
  LogPump pump;
  pump.Add(worker[0], LogSink{-1, console.fd, "[p]: "});
  const size_t total = 4 * kMaxConsoleLine + 100;
  std::string chunk(4096, 'x');
  for (size_t sent = 0; sent < total; sent += chunk.size()) {
    Write(worker[1], chunk.substr(0, std::min(chunk.size(), total - sent)));
  }
  // Still open: what is shown so far is every whole piece.
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  const size_t piece = 5 + kMaxConsoleLine + 1;  // prefix, text, newline
  while (console.Text().size() < 4 * piece && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  std::string shown = console.Text();
  REQUIRE(shown.size() == 4 * piece);
  CHECK(shown.substr(0, 5) == "[p]: ");
  CHECK(shown.substr(piece - 3, 9) == "xx\n[p]: x");
  close(worker[1]);
  REQUIRE(pump.WaitDrained(absl::Seconds(10)));
  CHECK(console.Text().size() == 4 * piece + 5 + 100 + 1);
}

TEST_CASE("64 MiB without a line end: bounded memory, linear time") {
  ConsoleFile console;
  int worker[2];
  REQUIRE(pipe(worker) == 0);
  int64_t peak_before = PeakRssKib();
  absl::Time start = absl::Now();
  {
    LogPump pump;
    pump.Add(worker[0], LogSink{-1, console.fd, "[p]: "});
    std::string chunk(64 * 1024, 'y');
    for (int i = 0; i < 1024; ++i) Write(worker[1], chunk);
    close(worker[1]);
    REQUIRE(pump.WaitDrained(absl::Seconds(60)));
  }
  absl::Duration took = absl::Now() - start;
  int64_t grew_kib = PeakRssKib() - peak_before;
  WARN("64 MiB in " << absl::FormatDuration(took) << ", peak RSS grew " << grew_kib << " KiB");
  CHECK(grew_kib < 8 * 1024);
  CHECK(took < absl::Seconds(3));
}

}  // namespace
}  // namespace muster::launcher
