// The `worker` binary as users run it: exit codes and messages for bad
// configs, data and environments, --print-config, a short training run and
// `worker generate`.
#include <elf.h>
#include <sys/stat.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "launcher/process.h"
#include "worker/checkpoint/env.h"
#include "worker/config/config.h"
#include "worker/data/data.h"

extern char** environ;

namespace muster::worker {
namespace {

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  REQUIRE(out.good());
}

std::string FreshDir(const std::string& name) {
  static int counter = 0;
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base ? base : "/tmp", "/worker_cli_", name, "_", ++counter);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string WorkerBinary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  std::string path = absl::StrCat(srcdir ? srcdir : ".", "/muster/worker/worker");
  REQUIRE(std::filesystem::exists(path));
  return path;
}

// Runs `worker args...` with this test's environment plus `extra_env`
// (minus the launcher's variables), stdout and stderr captured in files
// under `dir`. Bounded: a worker that hangs fails the test after 60 s.
// `shell` runs in the shell before the worker starts (a ulimit).
RunResult RunWorker(const std::string& dir, const std::vector<std::string>& args,
                    const std::vector<std::string>& extra_env = {}, const std::string& shell = "") {
  launcher::SpawnSpec spec;
  // The shell only redirects; "$0" "$@" pass the arguments unquoted-safe.
  spec.argv = {
      "/bin/sh", "-c",
      shell + (shell.empty() ? "" : "; ") + "exec \"$0\" \"$@\" >\"$CLI_OUT\" 2>\"$CLI_ERR\"",
      WorkerBinary()};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  for (char** var = environ; *var != nullptr; ++var) {
    std::string entry = *var;
    if (entry.rfind("WORLD_SIZE=", 0) == 0 || entry.rfind("RANK=", 0) == 0) continue;
    spec.env.push_back(entry);
  }
  spec.env.push_back("CLI_OUT=" + dir + "/stdout");
  spec.env.push_back("CLI_ERR=" + dir + "/stderr");
  spec.env.insert(spec.env.end(), extra_env.begin(), extra_env.end());
  auto child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  auto exit = child->WaitFor(absl::Seconds(60));
  REQUIRE(exit.has_value());
  RunResult result;
  result.exit_code = exit->ShellCode();
  result.out = ReadAll(dir + "/stdout");
  result.err = ReadAll(dir + "/stderr");
  return result;
}

// A byte-level model small enough to train 5 steps in well under a second.
std::string WriteTinyJob(const std::string& dir, int steps) {
  std::vector<uint16_t> tokens;
  const std::string text = "the quick brown fox jumps over the lazy dog. ";
  for (int i = 0; i < 6000; ++i)
    tokens.push_back(static_cast<unsigned char>(text[i % text.size()]));
  REQUIRE(WriteTokenShard(dir + "/train_000.bin", tokens).ok());
  REQUIRE(WriteTokenShard(dir + "/val_000.bin", tokens).ok());
  std::string yaml = absl::StrCat(R"(model:
  layers: 2
  heads: 2
  dim: 32
  vocab: 256
  seq_len: 16
data:
  train: train_*.bin
  val: val_*.bin
  micro_batch: 4
optim:
  lr: 1.0e-2
train:
  steps: )",
                                  steps, R"(
  log_every: 1
  eval_every: 5
  eval_batches: 2
  metrics_file: out/metrics.jsonl
device: cpu
)");
  std::string path = dir + "/tiny.yaml";
  WriteAll(path, yaml);
  return path;
}

// Replaces the first `from` in the file at `path` with `to`.
void EditFile(const std::string& path, const std::string& from, const std::string& to) {
  std::string text = ReadAll(path);
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), to);
  WriteAll(path, text);
}

std::string WithoutComments(const std::string& yaml) {
  std::stringstream in(yaml);
  std::string kept;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("#", 0) != 0) kept += line + "\n";
  }
  return kept;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_CASE("a bad config exits 2 with a one-line message naming the key") {
  std::string dir = FreshDir("bad");
  WriteAll(dir + "/bad.yaml", "model:\n  layerz: 4\n");
  RunResult run = RunWorker(dir, {dir + "/bad.yaml"});
  CHECK(run.exit_code == 2);
  INFO(run.err);
  CHECK(Contains(run.err, "layerz"));
  CHECK(run.err.rfind("worker: ", 0) == 0);
  CHECK(std::count(run.err.begin(), run.err.end(), '\n') == 1);

  RunResult missing = RunWorker(dir, {dir + "/missing.yaml"});
  CHECK(missing.exit_code == 2);
}

// `mkfifo f.yaml; worker f.yaml` waited forever in open(2) for a writer.
// Bounded by RunWorker's 60 s, after which the worker is killed.
TEST_CASE("a config that is a FIFO nothing writes to, or missing, exits 2 at once saying why") {
  std::string dir = FreshDir("fifo");
  const std::string fifo = dir + "/fifo.yaml";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--print-config", fifo}, std::vector<std::string>{fifo}}) {
    RunResult run = RunWorker(dir, args);
    INFO(run.err);
    CHECK(run.exit_code == 2);
    CHECK(run.err == "worker: " + fifo + ": a FIFO that nothing writes to, not a config file\n");
  }
  RunResult missing = RunWorker(dir, {dir + "/missing.yaml"});
  CHECK(missing.exit_code == 2);
  CHECK(missing.err == "worker: " + dir +
                           "/missing.yaml: cannot read the config file: No such file or "
                           "directory\n");
}

// The names of the functions an ELF executable's .preinit_array calls,
// from its section headers and symbol table; in a position-independent
// executable the array is filled by relative relocations, whose addends
// are the functions' addresses.
std::vector<std::string> PreinitFunctions(const std::string& path) {
  const std::string file = ReadAll(path);
  REQUIRE(file.size() >= sizeof(Elf64_Ehdr));
  Elf64_Ehdr header;
  std::memcpy(&header, file.data(), sizeof(header));
  REQUIRE(std::memcmp(header.e_ident, ELFMAG, SELFMAG) == 0);
  REQUIRE(header.e_ident[EI_CLASS] == ELFCLASS64);
  REQUIRE(header.e_shoff + uint64_t{header.e_shnum} * sizeof(Elf64_Shdr) <= file.size());
  std::vector<Elf64_Shdr> sections(header.e_shnum);
  std::memcpy(sections.data(), file.data() + header.e_shoff, sections.size() * sizeof(Elf64_Shdr));
  auto at = [&](uint64_t offset, uint64_t size) {
    if (offset > file.size() || size > file.size() - offset) {
      throw std::out_of_range(absl::StrCat(path, ": offset ", offset, " past the end"));
    }
    return file.data() + offset;
  };
  auto read_u64 = [&](uint64_t offset) {
    uint64_t value;
    std::memcpy(&value, at(offset, sizeof(value)), sizeof(value));
    return value;
  };
  std::vector<uint64_t> addresses;  // of the functions the array calls
  const Elf64_Shdr* symbols = nullptr;
  for (const Elf64_Shdr& section : sections) {
    if (section.sh_type == SHT_SYMTAB) symbols = &section;
    if (section.sh_type != SHT_PREINIT_ARRAY) continue;
    for (uint64_t slot = 0; slot < section.sh_size; slot += sizeof(uint64_t)) {
      uint64_t address = read_u64(section.sh_offset + slot);
      for (const Elf64_Shdr& relocations : sections) {
        if (relocations.sh_type != SHT_RELA) continue;
        for (uint64_t entry = 0; entry < relocations.sh_size; entry += sizeof(Elf64_Rela)) {
          Elf64_Rela rela;
          std::memcpy(&rela, at(relocations.sh_offset + entry, sizeof(rela)), sizeof(rela));
          if (rela.r_offset == section.sh_addr + slot) address = rela.r_addend;
        }
      }
      addresses.push_back(address);
    }
  }
  INFO("no symbol table in " << path << " (stripped?)");
  REQUIRE(symbols != nullptr);
  const Elf64_Shdr& names = sections.at(symbols->sh_link);
  std::vector<std::string> functions;
  for (uint64_t entry = 0; entry < symbols->sh_size; entry += sizeof(Elf64_Sym)) {
    Elf64_Sym symbol;
    std::memcpy(&symbol, at(symbols->sh_offset + entry, sizeof(symbol)), sizeof(symbol));
    if (ELF64_ST_TYPE(symbol.st_info) != STT_FUNC) continue;
    if (std::find(addresses.begin(), addresses.end(), symbol.st_value) == addresses.end()) continue;
    functions.emplace_back(at(names.sh_offset + symbol.st_name, 1));
  }
  return functions;
}

// SIGTERM in the first ~140 ms of a worker started by hand killed it (143)
// instead of stopping it after a step (75): main() blocked the signals
// only after the shared libraries' static initialisers. The executable's
// .preinit_array runs before them; a hook there in a library's object
// would be dropped by the linker, unreferenced, so this checks the binary
// itself. (When exactly a signal arrives cannot be made deterministic.)
TEST_CASE("the worker binary blocks the preemption signals from its .preinit_array") {
  const std::vector<std::string> functions = PreinitFunctions(WorkerBinary());
  INFO(absl::StrJoin(functions, ", "));
  CHECK(std::any_of(functions.begin(), functions.end(), [](const std::string& name) {
    return Contains(name, "HoldPreemptionSignalsAtLoad");
  }));
}

// The error file says "restartable": "false" for a bad config, so launch
// fails the job at once. Where that file cannot be written (a full disk:
// /dev/full, whose every write fails with ENOSPC), the exit code says it:
// 78 (launcher::kNotRestartableExitCode), which launch reads the same way
// (launch_test). A restartable failure keeps its code.
TEST_CASE("a failure no restart can mend exits 78 when its error file cannot be written") {
  std::string dir = FreshDir("errfile");
  WriteAll(dir + "/bad.yaml", "model:\n  layerz: 4\n");

  // Written: the file says it, and the code is the config error's.
  RunResult written =
      RunWorker(dir, {dir + "/bad.yaml"}, {"TORCHELASTIC_ERROR_FILE=" + dir + "/error.json"});
  CHECK(written.exit_code == 2);
  CHECK(Contains(ReadAll(dir + "/error.json"), "\"restartable\": \"false\""));

  SECTION("a full disk") {
    const std::string full = dir + "/full.json";
    REQUIRE(std::filesystem::exists("/dev/full"));
    std::filesystem::create_symlink("/dev/full", full);
    RunResult run = RunWorker(dir, {dir + "/bad.yaml"}, {"TORCHELASTIC_ERROR_FILE=" + full});
    INFO(run.err);
    CHECK(run.exit_code == 78);
    CHECK(Contains(run.err, "layerz"));
    CHECK(Contains(run.err, "worker: cannot write the error file " + full +
                                ": No space left on device; exiting 78, which tells launch "
                                "that no restart can mend this\n"));
    // What was written of it is gone (the link, not the device).
    CHECK_FALSE(std::filesystem::is_symlink(full));
    CHECK(std::filesystem::exists("/dev/full"));
  }
  SECTION("a directory that is not there") {
    const std::string nowhere = dir + "/no/such/dir/error.json";
    RunResult run = RunWorker(dir, {dir + "/bad.yaml"}, {"TORCHELASTIC_ERROR_FILE=" + nowhere});
    INFO(run.err);
    CHECK(run.exit_code == 78);
    CHECK(Contains(run.err, "cannot write the error file " + nowhere +
                                ": No such file or directory; exiting 78"));
  }
  SECTION("a restartable failure keeps its code, with a warning") {
    // Data not there (NOT_FOUND) may come with a late mount: restartable.
    std::string config = WriteTinyJob(dir, 5);
    std::filesystem::remove(dir + "/train_000.bin");
    const std::string nowhere = dir + "/no/such/dir/error.json";
    RunResult run = RunWorker(dir, {config}, {"TORCHELASTIC_ERROR_FILE=" + nowhere});
    INFO(run.err);
    CHECK(run.exit_code == 2);
    CHECK(Contains(run.err, "worker: cannot write the error file " + nowhere +
                                ": No such file or directory\n"));
    CHECK_FALSE(Contains(run.err, "exiting 78"));
  }
}

TEST_CASE("a batch that cannot fit in memory exits 1 naming the bytes asked for and available") {
  std::string dir = FreshDir("huge");
  std::string config = WriteTinyJob(dir, 5);
  std::string yaml = ReadAll(config);
  // 10^9 sequences a micro-batch over a vocab of 65536: logits alone of
  // petabytes, beyond a 47-bit address space, so no overcommit setting
  // lets the mapping succeed (and nothing is touched).
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"micro_batch: 4", "micro_batch: 1000000000"}, {"vocab: 256", "vocab: 65536"}}) {
    const size_t at = yaml.find(from);
    REQUIRE(at != std::string::npos);
    yaml.replace(at, from.size(), to);
  }
  WriteAll(config, yaml);
  RunResult run = RunWorker(dir, {config});
  INFO(run.err);
  CHECK(run.exit_code == 1);
  CHECK(Contains(run.err, "worker: out of host memory: asked for "));
  CHECK(Contains(run.err, " GB) available; lower data.micro_batch or model.seq_len") ==
        std::ifstream("/proc/meminfo").good());
}

// Allocations outside Ops::Alloc (the model's tables of 100000 layers)
// throw std::bad_alloc under a small address space: the worker aborted
// with the C++ runtime's message (exit 134) and wrote no error file.
TEST_CASE("an allocation that fails anywhere exits 1 with one line and the error file") {
  std::string dir = FreshDir("bad_alloc");
  std::string config = WriteTinyJob(dir, 1);
  EditFile(config, "layers: 2", "layers: 100000");
  RunResult run = RunWorker(dir, {config}, {"TORCHELASTIC_ERROR_FILE=" + dir + "/error.json"},
                            "ulimit -v 300000");
  INFO(run.err);
  CHECK(run.exit_code == 1);
  CHECK(run.err.rfind("worker: out of host memory: ", 0) == 0);
  CHECK(std::count(run.err.begin(), run.err.end(), '\n') == 1);
  CHECK(Contains(ReadAll(dir + "/error.json"), "out of host memory"));
}

// The message names the field whose glob failed: data.train and data.val
// fail alike.
TEST_CASE("data that is not there exits 2, naming the field") {
  for (const char* field : {"train", "val"}) {
    std::string dir = FreshDir(absl::StrCat("nodata_", field));
    std::string config = WriteTinyJob(dir, 5);
    std::filesystem::remove(absl::StrCat(dir, "/", field, "_000.bin"));
    RunResult run = RunWorker(dir, {config});
    INFO(run.err);
    CHECK(run.exit_code == 2);
    CHECK(Contains(run.err, absl::StrCat("data.", field, ": no token shards match '")));
    CHECK(Contains(run.err, absl::StrCat(field, "_*.bin")));
  }
}

TEST_CASE("parallel degrees that do not cover the world exit 2 naming the fields") {
  std::string dir = FreshDir("degrees");
  std::string config = WriteTinyJob(dir, 5);
  std::ofstream(config, std::ios::app) << "parallel:\n  dp_replicate: 2\n";
  RunResult run = RunWorker(dir, {config});
  INFO(run.err);
  CHECK(run.exit_code == 2);
  CHECK(Contains(run.err,
                 "parallel.dp_replicate (2) x parallel.dp_shard (1) x parallel.pp (1) = 2, "
                 "but the world has 1 rank"));
}

TEST_CASE("--print-config prints yaml that loads back to the same config") {
  std::string dir = FreshDir("print");
  std::string config = WriteTinyJob(dir, 5);
  RunResult run = RunWorker(dir, {"--print-config", config});
  INFO(run.err);
  REQUIRE(run.exit_code == 0);
  WriteAll(dir + "/printed.yaml", run.out);
  auto printed = LoadConfig(dir + "/printed.yaml");
  INFO(printed.status().ToString());
  REQUIRE(printed.ok());
  auto original = LoadConfig(config);
  REQUIRE(original.ok());
  CHECK(printed->model.dim == 32);
  CHECK(printed->train.steps == 5);
  CHECK(printed->data.train == original->data.train);
  // Printing it again gives the same yaml, apart from the comment naming
  // the file it was resolved from.
  CHECK(WithoutComments(ConfigToYaml(*printed)) == WithoutComments(run.out));
}

TEST_CASE("the config may come as a positional argument or as --config, in both commands") {
  std::string dir = FreshDir("config_flag");
  std::string config = WriteTinyJob(dir, 5);
  RunResult positional = RunWorker(dir, {"--print-config", config});
  RunResult flag = RunWorker(dir, {"--print-config", "--config", config});
  INFO(positional.err << flag.err);
  REQUIRE(positional.exit_code == 0);
  REQUIRE(flag.exit_code == 0);
  CHECK(flag.out == positional.out);

  const std::vector<std::string> sample = {"--prompt",       "ab", "--tokens", "4",
                                           "--steps-before", "1"};
  std::vector<std::string> with_flag = {"generate", "--config", config};
  std::vector<std::string> bare = {"generate", config};
  with_flag.insert(with_flag.end(), sample.begin(), sample.end());
  bare.insert(bare.end(), sample.begin(), sample.end());
  RunResult generated = RunWorker(dir, with_flag), again = RunWorker(dir, bare);
  INFO(generated.err << again.err);
  REQUIRE(generated.exit_code == 0);
  REQUIRE(again.exit_code == 0);
  CHECK(again.out == generated.out);

  // Both forms at once is a usage error, not a silent pick.
  RunResult both = RunWorker(dir, {"--print-config", "--config", config, config});
  CHECK(both.exit_code == 2);
}

TEST_CASE("a 5-step run exits 0 and writes its metrics") {
  std::string dir = FreshDir("train");
  std::string config = WriteTinyJob(dir, 5);
  RunResult run = RunWorker(dir, {config});
  INFO(run.out << run.err);
  REQUIRE(run.exit_code == 0);
  CHECK(Contains(run.out, "step 5/5 | loss "));
  CHECK(Contains(run.out, "val loss"));
  CHECK_FALSE(Contains(run.err, "\r"));  // no progress bar into a file
  std::string metrics = ReadAll(dir + "/out/metrics.jsonl");
  CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 5 + 1);
  CHECK(Contains(metrics, "{\"step\":5,\"val_loss\":"));
}

// A run from step 0 starts its metrics file afresh: a path naming another
// file by mistake lost that file (a shard: the worker then died of SIGBUS).
TEST_CASE("train.metrics_file naming a shard or a file that is not metrics exits 2, keeping it") {
  std::string dir = FreshDir("metrics_clash");
  std::string config = WriteTinyJob(dir, 2);
  const std::string shard = ReadAll(dir + "/train_000.bin");
  EditFile(config, "out/metrics.jsonl", "train_000.bin");
  RunResult run = RunWorker(dir, {config});
  INFO(run.err);
  CHECK(run.exit_code == 2);
  CHECK(run.err == "worker: " + config + ":18: train.metrics_file: '" + dir +
                       "/train_000.bin' is a shard of data.train ('" + dir +
                       "/train_*.bin'); the metrics file would overwrite it\n");
  CHECK(ReadAll(dir + "/train_000.bin") == shard);

  WriteAll(dir + "/notes.txt", "my notes\n");
  EditFile(config, "train_000.bin\n", "notes.txt\n");
  RunResult notes = RunWorker(dir, {config});
  INFO(notes.err);
  CHECK(notes.exit_code == 2);
  CHECK(notes.err == "worker: train.metrics_file: '" + dir +
                         "/notes.txt' is not a metrics file (it does not start with '{'); "
                         "refusing to overwrite it: name another file, or remove this one\n");
  CHECK(ReadAll(dir + "/notes.txt") == "my notes\n");

  // A metrics file of an earlier run is started afresh, as before.
  WriteAll(dir + "/notes.txt", "{\"step\":1}\n");
  RunResult again = RunWorker(dir, {config});
  INFO(again.err);
  CHECK(again.exit_code == 0);
  CHECK(Contains(ReadAll(dir + "/notes.txt"), "{\"step\":2,"));
}

// A directory that cannot be made (EACCES, or here a dangling symbolic
// link on the way) said "cannot open ... for writing: No such file or
// directory", hiding why.
TEST_CASE("a metrics directory that cannot be made is named with the reason") {
  std::string dir = FreshDir("metrics_dir");
  std::string config = WriteTinyJob(dir, 1);
  std::filesystem::create_symlink(dir + "/gone", dir + "/out");
  RunResult run = RunWorker(dir, {config});
  INFO(run.err);
  CHECK(run.exit_code == 2);
  CHECK(Contains(run.err, "worker: train.metrics_file: cannot create the directory " + dir +
                              "/out for " + dir + "/out/metrics.jsonl: "));
  CHECK(std::count(run.err.begin(), run.err.end(), '\n') == 1);
}

// Valid, but the run never reaches optim.lr: a warning, then training.
TEST_CASE("a warmup as long as the run is a warning at start") {
  std::string dir = FreshDir("warmup");
  std::string config = WriteTinyJob(dir, 2);
  EditFile(config, "optim:\n", "optim:\n  warmup_steps: 10\n");
  RunResult run = RunWorker(dir, {config});
  INFO(run.err);
  CHECK(run.exit_code == 0);
  CHECK(run.err.rfind("worker: warning: optim.warmup_steps 10 is not below train.steps 2: the run "
                      "ends within its warmup and never reaches optim.lr\n",
                      0) == 0);
}

TEST_CASE("generate trains, then prints the prompt and sampled bytes") {
  std::string dir = FreshDir("generate");
  std::string config = WriteTinyJob(dir, 5);
  RunResult run = RunWorker(dir, {"generate", "--config", config, "--prompt", "the quick",
                                  "--tokens", "30", "--steps-before", "3", "--seed", "5"});
  INFO(run.err);
  REQUIRE(run.exit_code == 0);
  CHECK(run.out.rfind("the quick", 0) == 0);
  CHECK(run.out.size() == 9 + 30 + 1);
  CHECK(Contains(run.err, "step 3/3"));  // training logs go to stderr
  CHECK_FALSE(std::filesystem::exists(dir + "/out/metrics.jsonl"));

  RunResult again = RunWorker(dir, {"generate", "--config", config, "--prompt", "the quick",
                                    "--tokens", "30", "--steps-before", "3", "--seed", "5"});
  CHECK(again.out == run.out);
}

// Without --checkpoint, generate reads the run's checkpoint.dir and writes
// nothing there: no save, no retention, no LOCK (the run may be training
// beside it). A checkpoint of the same settings at or before the step to
// sample at is where it starts; one of other settings (train.steps is the
// schedule's end) is not a step of the model asked for.
TEST_CASE("generate samples the run's model from its checkpoints and writes nothing there") {
  std::string dir = FreshDir("generate_run");
  std::string plain = WriteTinyJob(dir, 6);
  const std::string yaml = ReadAll(plain);
  const std::string config = dir + "/with_ck.yaml";
  WriteAll(config, yaml + "checkpoint:\n  dir: ck\n  every: 3\n  keep_last: 2\n");
  RunResult trained = RunWorker(dir, {config});
  INFO(trained.err);
  REQUIRE(trained.exit_code == 0);
  auto listing = [&dir] {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir + "/ck")) {
      names.push_back(entry.path().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::vector<std::string> before = listing();
  REQUIRE(std::find(before.begin(), before.end(), dir + "/ck/step_00000006") != before.end());
  // The run's LOCK is held, as by a run training there.
  auto lock = Env::Default()->LockFile(dir + "/ck/LOCK");
  REQUIRE(lock.ok());

  const std::vector<std::string> sample = {"--prompt", "the", "--tokens", "12"};
  auto generate = [&](const std::string& yaml_path, std::vector<std::string> extra) {
    std::vector<std::string> args = {"generate", yaml_path};
    args.insert(args.end(), sample.begin(), sample.end());
    args.insert(args.end(), extra.begin(), extra.end());
    return RunWorker(dir, args);
  };
  RunResult from_run = generate(config, {});
  RunResult from_scratch = generate(plain, {});  // 6 steps trained again
  INFO(from_run.err << from_scratch.err);
  REQUIRE(from_run.exit_code == 0);
  REQUIRE(from_scratch.exit_code == 0);
  CHECK(Contains(from_run.err, "resumed from " + dir + "/ck/step_00000006"));
  CHECK(Contains(from_run.err, "nothing to train"));
  CHECK(from_run.out == from_scratch.out);

  // Four steps are not the run's step 3 (trained towards 6) plus one.
  RunResult shorter = generate(config, {"--steps-before", "4"});
  RunResult shorter_scratch = generate(plain, {"--steps-before", "4"});
  INFO(shorter.err);
  REQUIRE(shorter.exit_code == 0);
  CHECK_FALSE(Contains(shorter.err, "resumed from"));
  CHECK(Contains(shorter.err, "generate: passing over " + dir +
                                  "/ck/step_00000003: saved by a run with other training "
                                  "settings (train.steps 6 -> 4"));
  CHECK(shorter.out == shorter_scratch.out);
  CHECK(listing() == before);
}

// A resumed run shows its first step at once, whatever train.log_every
// says; the metrics file keeps only the lines a run never stopped writes.
TEST_CASE("a resumed run logs its first step on the console, not in the metrics file") {
  std::string dir = FreshDir("resume_log");
  std::string yaml = ReadAll(WriteTinyJob(dir, 3));
  yaml.replace(yaml.find("log_every: 1"), 12, "log_every: 5");
  yaml += "checkpoint:\n  dir: ck\n  every: 3\n";
  WriteAll(dir + "/three.yaml", yaml);
  yaml.replace(yaml.find("steps: 3"), 8, "steps: 6");
  WriteAll(dir + "/six.yaml", yaml);
  REQUIRE(RunWorker(dir, {dir + "/three.yaml"}).exit_code == 0);
  RunResult resumed = RunWorker(dir, {dir + "/six.yaml"});
  INFO(resumed.out << resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(Contains(resumed.out, "step 4/6 | loss "));
  CHECK(Contains(resumed.out, "step 5/6 | loss "));
  std::string metrics = ReadAll(dir + "/out/metrics.jsonl");
  INFO(metrics);
  CHECK(Contains(metrics, "{\"step\":3,"));
  CHECK_FALSE(Contains(metrics, "{\"step\":4,"));
  CHECK(Contains(metrics, "{\"step\":5,"));
}

TEST_CASE("generate refuses bad options before reading any data, naming them") {
  std::string dir = FreshDir("generate_bad");
  std::string config = WriteTinyJob(dir, 5);
  std::filesystem::remove(dir + "/train_000.bin");  // no data: the check comes first
  RunResult nan = RunWorker(dir, {"generate", config, "--temperature", "nan"});
  CHECK(nan.exit_code == 2);
  CHECK(Contains(nan.err, "--temperature nan: expected a finite number >= 0 (0: greedy)"));
  RunResult inf = RunWorker(dir, {"generate", config, "--temperature", "inf"});
  CHECK(inf.exit_code == 2);
  RunResult negative = RunWorker(dir, {"generate", config, "--steps-before", "-7"});
  CHECK(negative.exit_code == 2);
  CHECK(Contains(negative.err, "--steps-before: Value -7 not in range"));
  // --seed was saturated: -1 and 99999999999999999999 were both 2^64 - 1.
  for (const std::string seed : {"-1", "99999999999999999999", "12x", ""}) {
    RunResult bad_seed = RunWorker(dir, {"generate", config, "--seed", seed});
    INFO(bad_seed.err);
    CHECK(bad_seed.exit_code == 2);
    CHECK(bad_seed.err ==
          "worker: --seed '" + seed + "': expected an integer from 0 to 18446744073709551615\n");
  }
  // What comes before the word generate would not be used; nor would an
  // empty --checkpoint (it used to mean: train the config first).
  RunResult before = RunWorker(dir, {config, "generate", config});
  CHECK(before.exit_code == 2);
  CHECK(Contains(before.err, " before `generate` is not used"));
  RunResult printed = RunWorker(dir, {"--print-config", "generate", config});
  CHECK(printed.exit_code == 2);
  CHECK(Contains(printed.err, "--print-config before `generate` is not used"));
  RunResult empty = RunWorker(dir, {"generate", config, "--checkpoint", ""});
  CHECK(empty.exit_code == 2);
  CHECK(Contains(empty.err, "--checkpoint '': expected a step_XXXXXXXX checkpoint directory"));
  RunResult both =
      RunWorker(dir, {"generate", config, "--steps-before", "3", "--checkpoint", dir + "/x"});
  CHECK(both.exit_code == 2);
  CHECK(Contains(both.err, "--steps-before excludes --checkpoint"));
}

// The directory of checkpoints given where one of them is meant: the
// message names the newest, not "no manifest.json (a torn or unfinished
// checkpoint)".
TEST_CASE("generate --checkpoint with checkpoint.dir itself names a checkpoint to pass") {
  std::string dir = FreshDir("generate_dir");
  std::string config = WriteTinyJob(dir, 5);
  std::ofstream(config, std::ios::app) << "checkpoint:\n  dir: ck\n  every: 5\n";
  REQUIRE(RunWorker(dir, {config}).exit_code == 0);
  RunResult wrong =
      RunWorker(dir, {"generate", config, "--checkpoint", dir + "/ck", "--tokens", "4"});
  INFO(wrong.err);
  CHECK(wrong.exit_code == 2);
  CHECK(Contains(wrong.err, "worker: " + dir +
                                "/ck: a directory of checkpoints, not one (no manifest.json); name "
                                "one of them, e.g. the newest: " +
                                dir + "/ck/step_00000005\n"));
  RunResult right = RunWorker(
      dir, {"generate", config, "--checkpoint", dir + "/ck/step_00000005", "--tokens", "4"});
  INFO(right.err);
  CHECK(right.exit_code == 0);
  // Sampling reads no data (a checkpoint copied to a machine without the
  // training set), and says nothing of training settings it does not use.
  CHECK_FALSE(Contains(right.err, "train.steps"));
  std::filesystem::remove(dir + "/train_000.bin");
  std::filesystem::remove(dir + "/val_000.bin");
  std::string yaml = ReadAll(config);
  yaml.replace(yaml.find("train:\n"), 7, "train:\n  seed: 99\n");  // the data's order: unused
  WriteAll(config, yaml);
  RunResult without_data = RunWorker(
      dir, {"generate", config, "--checkpoint", dir + "/ck/step_00000005", "--tokens", "4"});
  INFO(without_data.err);
  CHECK(without_data.exit_code == 0);
  CHECK(without_data.out == right.out);
}

// A requeue whose job the service no longer has (an agent's embedded one, or
// one that dropped it) starts it again at round 0 with the same id: with
// checkpoint.resume never that is still the run's restart, not a fresh run.
TEST_CASE("resume never under a job id: the job's round 0 again continues the run's own") {
  std::string dir = FreshDir("never_requeue");
  std::string yaml = ReadAll(WriteTinyJob(dir, 6));
  yaml += "checkpoint:\n  dir: ck\n  every: 3\n  resume: never\n";
  WriteAll(dir + "/six.yaml", yaml);
  yaml.replace(yaml.find("steps: 6"), 8, "steps: 9");
  WriteAll(dir + "/nine.yaml", yaml);
  const std::vector<std::string> job = {"MUSTER_JOB=requeued", "MUSTER_ROUND=0"};
  RunResult first = RunWorker(dir, {dir + "/six.yaml"}, job);
  INFO(first.out << first.err);
  REQUIRE(first.exit_code == 0);
  RunResult requeued = RunWorker(dir, {dir + "/nine.yaml"}, job);
  INFO(requeued.out << requeued.err);
  REQUIRE(requeued.exit_code == 0);
  CHECK(Contains(requeued.out,
                 "checkpoint.resume never started job requeued at step 0; in its "
                 "round 0 it continues from the run's own " +
                     dir + "/ck/step_00000006"));
  CHECK_FALSE(Contains(requeued.out, "step 1/9"));
  // Without checkpoint.dir a restart under launch starts again at 0: said.
  CHECK_FALSE(Contains(requeued.out, "no checkpoint.dir"));
  RunResult bare = RunWorker(dir, {dir + "/tiny.yaml"}, job);
  INFO(bare.out << bare.err);
  REQUIRE(bare.exit_code == 0);
  CHECK(Contains(bare.out,
                 "worker: warning: no checkpoint.dir, so a restart of job requeued (a "
                 "failure, a node joining or leaving, a preemption) starts again at "
                 "step 0\n"));
  // Another job id is another run: a fresh start.
  RunResult other = RunWorker(dir, {dir + "/nine.yaml"}, {"MUSTER_JOB=other", "MUSTER_ROUND=0"});
  INFO(other.out << other.err);
  REQUIRE(other.exit_code == 0);
  CHECK(Contains(other.out, "step 1/9"));
}

TEST_CASE("a resume that names a file, or a miswritten word of the field, says so") {
  std::string dir = FreshDir("resume_words");
  std::string yaml = ReadAll(WriteTinyJob(dir, 2));
  WriteAll(dir + "/auto.yaml", yaml + "checkpoint:\n  dir: ck\n  resume: Auto\n");
  RunResult word = RunWorker(dir, {dir + "/auto.yaml"});
  INFO(word.err);
  CHECK(word.exit_code != 0);
  CHECK(Contains(word.err, "/Auto: no such checkpoint directory (did you mean `auto`?"));
  RunResult file =
      RunWorker(dir, {"generate", dir + "/tiny.yaml", "--checkpoint", dir + "/tiny.yaml"});
  INFO(file.err);
  CHECK(file.exit_code != 0);
  CHECK(Contains(file.err, "tiny.yaml: a file, not a checkpoint (a step_XXXXXXXX directory)"));
}

TEST_CASE("a world of more than one without the launcher's rendezvous exits 2") {
  std::string dir = FreshDir("world");
  std::string config = WriteTinyJob(dir, 5);
  std::string error_file = dir + "/error.json";
  RunResult run =
      RunWorker(dir, {config}, {"WORLD_SIZE=2", "RANK=0", "TORCHELASTIC_ERROR_FILE=" + error_file});
  INFO(run.err);
  CHECK(run.exit_code == 2);
  CHECK(Contains(run.err, "MUSTER_RDZV_ENDPOINT"));
  CHECK(Contains(ReadAll(error_file), "MUSTER_RDZV_ENDPOINT"));

  RunResult bad = RunWorker(dir, {config}, {"WORLD_SIZE=two", "RANK=0"});
  CHECK(bad.exit_code == 2);
  CHECK(Contains(bad.err, "WORLD_SIZE"));

  RunResult one = RunWorker(dir, {config}, {"WORLD_SIZE=1", "RANK=0"});
  CHECK(one.exit_code == 0);
}

}  // namespace
}  // namespace muster::worker
