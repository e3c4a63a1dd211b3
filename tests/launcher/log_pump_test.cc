#include "launcher/log_pump.h"

#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

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
