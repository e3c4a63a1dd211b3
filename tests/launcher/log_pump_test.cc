#include "launcher/log_pump.h"

#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_split.h"

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

}  // namespace
}  // namespace muster::launcher
