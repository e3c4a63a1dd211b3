#include "launcher/failures.h"

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>

#include "absl/strings/match.h"

namespace muster::launcher {
namespace {

std::string WriteTemp(const std::string& text) {
  char path[] = "/tmp/error_fileXXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  close(fd);
  return path;
}

TEST_CASE("torch's error file shapes") {
  std::string nested = WriteTemp(
      R"({"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "x", "timestamp": "1"}}})");
  std::string flat = WriteTemp(R"({"message": "ValueError: bad"})");
  std::string broken = WriteTemp("{not json");
  std::string empty = WriteTemp("");
  CHECK(ReadErrorFile(nested).message == "RuntimeError: boom");
  CHECK(ReadErrorFile(flat).message == "ValueError: bad");
  CHECK(ReadErrorFile(broken).message.find("unreadable error file") != std::string::npos);
  CHECK(ReadErrorFile(empty).message.empty());
  CHECK(ReadErrorFile("/nonexistent/error.json").message.empty());
  // None of them says a restart cannot help.
  for (const auto& path : {nested, flat, broken, empty}) {
    CHECK(ReadErrorFile(path).restartable);
    std::remove(path.c_str());
  }
  CHECK(ReadErrorFile("/nonexistent/error.json").restartable);
}

TEST_CASE("launch's own error report: the worker's file as it is, else torch's shape") {
  const std::string worker = WriteTemp(R"({"message": {"message": "ValueError: boom"}})");
  CHECK(ParentErrorReport(worker, "unused", absl::FromUnixSeconds(5)) ==
        R"({"message": {"message": "ValueError: boom"}})");
  std::remove(worker.c_str());
  // No file (or an empty one): the line, escaped for JSON, which our reader takes back.
  const std::string line = "rank 1 on vm failed (exit code 3): \"quoted\"\\ \n\x01";
  const std::string report = ParentErrorReport("", line, absl::FromUnixSeconds(5));
  CHECK(report ==
        "{\"message\": {\"message\": \"rank 1 on vm failed (exit code 3): \\\"quoted\\\"\\\\ "
        "\\n\\u0001\", \"extraInfo\": {\"timestamp\": \"5\"}}}\n");
  const std::string written = WriteTemp(report);
  CHECK(ReadErrorFile(written).message == line);
  std::remove(written.c_str());
}

TEST_CASE("an error file may say that no restart can mend the failure") {
  std::string permanent = WriteTemp(
      R"({"message": {"message": "t.yaml:3: model.layer: unknown key", "extraInfo": {"restartable": "false"}}})");
  std::string other =
      WriteTemp(R"({"message": {"message": "boom", "extraInfo": {"restartable": "true"}}})");
  std::string odd =
      WriteTemp(R"({"message": {"message": "boom", "extraInfo": {"restartable": ["false"]}}})");
  ErrorReport report = ReadErrorFile(permanent);
  CHECK(report.message == "t.yaml:3: model.layer: unknown key");
  CHECK_FALSE(report.restartable);
  CHECK(ReadErrorFile(other).restartable);
  CHECK(ReadErrorFile(odd).restartable);  // only the string "false" says so
  for (const auto& path : {permanent, other, odd}) std::remove(path.c_str());
}

TEST_CASE("the failure table names rank, host, exit and message") {
  WorkerFailure signalled{absl::Now(), "node-a", 3, 1, 4242, ExitInfo{0, 9}, ""};
  WorkerFailure failed{absl::Now(), "node-b", 0, 0, 17, ExitInfo{2, 0}, "Boom\ntraceback"};
  std::string table = FormatFailureTable({signalled, failed});
  CHECK(table.find("node-a") != std::string::npos);
  CHECK(table.find("signal 9 (SIGKILL)") != std::string::npos);
  CHECK(table.find("4242") != std::string::npos);
  CHECK(table.find("exit code 2") != std::string::npos);
  CHECK(table.find("Boom") != std::string::npos);
  CHECK(table.find("traceback") == std::string::npos);
  CHECK(table.find("(no error file; see the worker's stderr)") != std::string::npos);

  // With its stderr in a log file (--redirects, --tee), the table says where.
  signalled.stderr_log = "/logs/job/attempt_0/3/stderr.log";
  CHECK(absl::StrContains(FormatFailureTable({signalled}),
                          "(no error file; see its stderr in /logs/job/attempt_0/3/stderr.log)"));

  // Kept off the console by --local_ranks_filter and not in a file: the
  // table does not send the reader to a stderr nobody saw.
  WorkerFailure hidden = signalled;
  hidden.stderr_log.clear();
  hidden.on_console = false;
  CHECK(absl::StrContains(FormatFailureTable({hidden}),
                          "(no error file; its stderr was neither shown, for --local_ranks_filter, "
                          "nor redirected to a file)"));

  // A report's path under its row, as torchrun's summary gives it.
  failed.error_file = "/logs/job/attempt_0/0/error.json";
  const std::string with_file = FormatFailureTable({failed});
  CHECK(absl::StrContains(with_file, "Boom\n"));
  CHECK(absl::StrContains(with_file, "error file: /logs/job/attempt_0/0/error.json\n"));
}

}  // namespace
}  // namespace muster::launcher
