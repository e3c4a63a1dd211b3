#include "launcher/process.h"

#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace muster::launcher {
namespace {

SpawnSpec Shell(const std::string& script, bool pipe_stdout = false) {
  SpawnSpec spec;
  spec.argv = {"/bin/sh", "-c", script};
  spec.env = {"PATH=/usr/bin:/bin", "MUSTER_TEST_VAR=hello"};
  spec.pipe_stdout = pipe_stdout;
  return spec;
}

std::string ReadAll(int fd) {
  std::string out;
  char buffer[256];
  ssize_t got;
  while ((got = read(fd, buffer, sizeof(buffer))) > 0) out.append(buffer, got);
  close(fd);
  return out;
}

// True once /proc shows no live process `pid` (gone, or a zombie that its
// new parent has yet to reap).
bool Gone(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  size_t close_paren = line.rfind(')');
  return close_paren != std::string::npos && line.size() > close_paren + 2 &&
         line[close_paren + 2] == 'Z';
}

bool GoneWithin(pid_t pid, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (!Gone(pid)) {
    if (absl::Now() > deadline) return false;
    usleep(10000);  // polling /proc: there is no event for another's child
  }
  return true;
}

TEST_CASE("exit codes and the environment reach the caller") {
  auto child = Child::Spawn(Shell("echo $MUSTER_TEST_VAR; exit 3", true));
  REQUIRE(child.ok());
  CHECK(ReadAll(child->TakeStdout()) == "hello\n");
  auto exit = child->WaitFor(absl::Seconds(10));
  REQUIRE(exit.has_value());
  CHECK(exit->exit_code == 3);
  CHECK(exit->ShellCode() == 3);
  CHECK_FALSE(exit->Succeeded());
  CHECK(exit->Describe() == "exit code 3");
}

TEST_CASE("a program that cannot run is NOT_FOUND before Spawn returns") {
  SpawnSpec spec;
  spec.argv = {"/nonexistent/program"};
  auto child = Child::Spawn(spec);
  REQUIRE(child.status().code() == absl::StatusCode::kNotFound);
  CHECK(std::string(child.status().message()).find("/nonexistent/program") != std::string::npos);
}

TEST_CASE("a signal death reports 128 + signal") {
  auto child = Child::Spawn(Shell("kill -KILL $$"));
  REQUIRE(child.ok());
  auto exit = child->WaitFor(absl::Seconds(10));
  REQUIRE(exit.has_value());
  CHECK(exit->signal == SIGKILL);
  CHECK(exit->ShellCode() == 128 + SIGKILL);
  CHECK(exit->Describe() == "signal 9 (SIGKILL)");
}

TEST_CASE("StopAll escalates to SIGKILL and takes the worker's children along") {
  // The first worker ignores SIGTERM; the second runs a grandchild.
  std::vector<Child> children;
  auto stubborn = Child::Spawn(Shell("trap '' TERM; echo ready; exec sleep 100", true));
  REQUIRE(stubborn.ok());
  auto parent = Child::Spawn(Shell("sleep 100 & echo $!; wait", true));
  REQUIRE(parent.ok());
  int stubborn_out = stubborn->TakeStdout();
  int parent_out = parent->TakeStdout();
  char line[64] = {};
  REQUIRE(read(stubborn_out, line, sizeof(line) - 1) > 0);  // trap is installed
  std::string grandchild_text;
  char c;
  while (read(parent_out, &c, 1) == 1 && c != '\n') grandchild_text += c;
  int grandchild = 0;
  REQUIRE(absl::SimpleAtoi(grandchild_text, &grandchild));
  children.push_back(std::move(*stubborn));
  children.push_back(std::move(*parent));

  absl::Time start = absl::Now();
  StopAll({&children[0], &children[1]}, absl::Milliseconds(300), SIGTERM);
  absl::Duration took = absl::Now() - start;
  CHECK(took >= absl::Milliseconds(300));
  CHECK(took < absl::Seconds(5));
  REQUIRE(children[0].exit_info().has_value());
  CHECK(children[0].exit_info()->signal == SIGKILL);
  REQUIRE(children[1].exit_info().has_value());
  CHECK(children[1].exit_info()->signal == SIGTERM);
  CHECK(GoneWithin(grandchild, absl::Seconds(5)));
  close(stubborn_out);
  close(parent_out);
}

TEST_CASE("destroying a running Child kills and reaps it") {
  pid_t pid;
  {
    auto child = Child::Spawn(Shell("exec sleep 100"));
    REQUIRE(child.ok());
    pid = child->pid();
  }
  CHECK(Gone(pid));
}

// Spawns `spec` until the child gets `pid` (steering the kernel through
// ns_last_pid, which needs root), or gives up: nullopt.
std::optional<Child> SpawnWithPid(const SpawnSpec& spec, pid_t pid) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    {
      std::ofstream last_pid("/proc/sys/kernel/ns_last_pid");
      if (!last_pid) return std::nullopt;
      last_pid << pid - 1;
      if (!last_pid.flush()) return std::nullopt;
    }
    auto child = Child::Spawn(spec);
    REQUIRE(child.ok());
    if (child->pid() == pid) return std::move(*child);
    // Taken, or another process forked first: try again.
  }
  return std::nullopt;
}

TEST_CASE("StopAll never signals a process group whose leader was reaped") {
  // A worker that exited is seen by the agent's loop (WaitFor/TryReap)
  // long before the group is stopped. Were it reaped then, its pid, and so
  // its process group id, could go to an unrelated process, which the
  // final SIGKILL to the group would hit.
  auto exited = Child::Spawn(Shell("exit 0"));
  REQUIRE(exited.ok());
  REQUIRE(exited->WaitFor(absl::Seconds(10)).has_value());
  pid_t pid = exited->pid();
  // A process given that pid, leading a group of that id as workers do.
  std::optional<Child> bystander = SpawnWithPid(Shell("exec sleep 100"), pid);
  if (bystander.has_value()) {
    WARN("pid " << pid << " was reused by a bystander");
  } else {
    WARN("pid " << pid << " could not be reused (still held, or ns_last_pid not writable)");
  }
  StopAll({&*exited}, absl::Milliseconds(100), SIGTERM);
  CHECK(Gone(pid) != bystander.has_value());  // reaped now, unless the bystander holds it
  if (bystander.has_value()) {
    CHECK_FALSE(bystander->WaitFor(absl::Milliseconds(200)).has_value());  // alive
  }
}

}  // namespace
}  // namespace muster::launcher
