// How launch turns its target into the workers' command line.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "launcher/options.h"
#include "launcher/workers.h"

namespace muster::launcher {
namespace {

TEST_CASE("an executable target in the working directory runs as itself, not a namesake on PATH") {
  // `launch --standalone test` ran /usr/bin/test; `launch myscript` failed
  // with "No such file or directory": the exec searched PATH.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("worker_command_test." + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::filesystem::path before = std::filesystem::current_path();
  std::filesystem::current_path(dir);
  std::ofstream("test") << "#!/bin/sh\necho mine\n";
  chmod("test", 0755);
  auto options = ParseLaunchOptions({"launch", "--standalone", "test", "a"}, {});
  REQUIRE(options.ok());
  CHECK(options->target_kind == TargetKind::kExecutable);
  auto command = WorkerCommand(*options, {});
  REQUIRE(command.ok());
  CHECK(*command == std::vector<std::string>{"./test", "a"});
  // --no_python names a program, found on PATH as torchrun finds it.
  auto program = ParseLaunchOptions({"launch", "--standalone", "--no_python", "test", "a"}, {});
  REQUIRE(program.ok());
  auto named = WorkerCommand(*program, {});
  REQUIRE(named.ok());
  CHECK(named->front() == "test");
  std::filesystem::current_path(before);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace muster::launcher
