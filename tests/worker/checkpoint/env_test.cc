// The file system under checkpoints (worker/checkpoint/env.h): the POSIX Env's
// operations and its errors, which name the path and the reason; and
// saves on an Env that fails a write, which fail with the file's name and
// leave the previous checkpoint to resume from.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/worker/checkpoint/tiny_job.h"
#include "tests/worker/thread_ranks.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/reader.h"
#include "worker/data/data.h"
#include "worker/trainer/trainer.h"

namespace muster::worker {
namespace {

namespace fs = std::filesystem;

std::string FreshDir(const std::string& name) { return testing::FreshDir("env_test", name); }

std::string Contents(Env* env, const std::string& path) {
  auto file = env->NewRandomAccessFile(path);
  REQUIRE(file.ok());
  auto size = (*file)->Size();
  REQUIRE(size.ok());
  std::string text(*size, '\0');
  auto read = (*file)->Read(0, text.size(), text.data());
  REQUIRE(read.ok());
  CHECK(*read == text.size());
  return text;
}

TEST_CASE("the POSIX Env writes, reads, lists, renames and deletes") {
  Env* env = Env::Default();
  const std::string dir = FreshDir("posix");
  const std::string sub = dir + "/a/b";
  REQUIRE(env->CreateDir(sub).ok());
  REQUIRE(env->CreateDir(sub).ok());  // already there: fine
  CHECK(env->IsDirectory(sub));

  // One Append larger than the 8 MiB chunks the POSIX file writes in,
  // then a small one.
  std::string big(20 * 1024 * 1024 + 3, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + i / 4096);
  const std::string file = sub + "/data.bin";
  {
    auto writable = env->NewWritableFile(file);
    REQUIRE(writable.ok());
    REQUIRE((*writable)->Append(big.data(), big.size()).ok());
    REQUIRE((*writable)->Append("tail", 4).ok());
    REQUIRE((*writable)->Sync().ok());
    REQUIRE((*writable)->Close().ok());
  }
  CHECK(env->FileExists(file));
  CHECK_FALSE(env->IsDirectory(file));
  CHECK(Contents(env, file) == big + "tail");

  auto readable = env->NewRandomAccessFile(file);
  REQUIRE(readable.ok());
  auto size = (*readable)->Size();
  REQUIRE(size.ok());
  CHECK(*size == big.size() + 4);
  char piece[16];
  auto read = (*readable)->Read(*size - 6, sizeof(piece), piece);  // runs past the end
  REQUIRE(read.ok());
  CHECK(*read == 6);
  CHECK(std::string(piece, 6) == big.substr(big.size() - 2) + "tail");
  read = (*readable)->Read(*size, sizeof(piece), piece);
  REQUIRE(read.ok());
  CHECK(*read == 0);

  // Creating truncates.
  {
    auto again = env->NewWritableFile(file);
    REQUIRE(again.ok());
    REQUIRE((*again)->Append("short", 5).ok());
    REQUIRE((*again)->Close().ok());
  }
  CHECK(Contents(env, file) == "short");

  std::ofstream(sub + "/other") << "x";
  REQUIRE(env->CreateDir(sub + "/child").ok());
  auto children = env->GetChildren(sub);
  REQUIRE(children.ok());
  std::sort(children->begin(), children->end());
  CHECK(*children == std::vector<std::string>{"child", "data.bin", "other"});

  CHECK(env->SyncFile(file).ok());
  CHECK(env->SyncDir(sub).ok());

  REQUIRE(env->RenameFile(file, sub + "/renamed.bin").ok());
  CHECK_FALSE(env->FileExists(file));
  CHECK(Contents(env, sub + "/renamed.bin") == "short");
  // A directory renamed over an empty one, as a commit renames .tmp_step_N.
  REQUIRE(env->CreateDir(dir + "/empty").ok());
  REQUIRE(env->RenameFile(sub, dir + "/empty").ok());
  CHECK(env->FileExists(dir + "/empty/renamed.bin"));

  REQUIRE(env->RemoveFile(dir + "/empty/other").ok());
  CHECK_FALSE(env->FileExists(dir + "/empty/other"));
  REQUIRE(env->RemoveAll(dir + "/empty").ok());
  CHECK_FALSE(env->FileExists(dir + "/empty"));
  CHECK(env->RemoveAll(dir + "/never_there").ok());
}

TEST_CASE("the POSIX Env's errors name the path and the reason") {
  Env* env = Env::Default();
  const std::string dir = FreshDir("errors");
  const std::string missing = dir + "/missing/file";
  auto check = [](const absl::Status& status, absl::StatusCode code,
                  const std::vector<std::string>& parts) {
    INFO(status.ToString());
    CHECK(status.code() == code);
    for (const std::string& part : parts) CHECK(absl::StrContains(status.message(), part));
  };
  const auto kNotFound = absl::StatusCode::kNotFound;
  const auto kUnavailable = absl::StatusCode::kUnavailable;
  const std::string enoent = "No such file or directory";

  check(env->NewWritableFile(missing).status(), kNotFound, {missing, "cannot create", enoent});
  check(env->NewRandomAccessFile(missing).status(), kNotFound, {missing, "cannot open", enoent});
  check(env->SyncFile(missing), kNotFound, {missing, enoent});
  check(env->SyncDir(dir + "/missing"), kNotFound, {dir + "/missing", enoent});
  check(env->GetChildren(dir + "/missing").status(), kNotFound, {dir + "/missing", enoent});
  check(env->RenameFile(missing, dir + "/to"), kNotFound,
        {"cannot rename " + missing + " to " + dir + "/to", enoent});
  check(env->RemoveFile(missing), kNotFound, {missing, "cannot delete", enoent});
  CHECK_FALSE(env->FileExists(missing));
  CHECK_FALSE(env->IsDirectory(dir + "/missing"));

  // AvailableBytes: statvfs of the file system that holds the path.
  auto free = env->AvailableBytes(dir);
  REQUIRE(free.ok());
  CHECK(*free > 0);
  check(env->AvailableBytes(dir + "/missing").status(), kNotFound,
        {dir + "/missing", "cannot statvfs", enoent});

  // A full disk or quota is RESOURCE_EXHAUSTED, marked so that it is told
  // apart from running out of memory; /dev/full is one for real.
  auto full = env->NewWritableFile("/dev/full");
  REQUIRE(full.ok());
  const absl::Status append = (*full)->Append("x", 1);
  check(append, absl::StatusCode::kResourceExhausted,
        {"/dev/full: write failed: No space left on device"});
  CHECK(IsNoSpace(append));
  for (int error : {ENOSPC, EDQUOT}) {
    CHECK(FileSystemError(error, "m").code() == absl::StatusCode::kResourceExhausted);
    CHECK(IsNoSpace(FileSystemError(error, "m")));
  }
  CHECK_FALSE(IsNoSpace(FileSystemError(EIO, "m")));
  CHECK_FALSE(IsNoSpace(absl::ResourceExhaustedError("out of memory")));
  CHECK(IsNoSpace(MarkNoSpace(absl::AbortedError("another rank's disk is full"))));

  // A path that is wrong (a file on the way, a directory where a file
  // goes) is INVALID_ARGUMENT: no restart mends it.
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  std::ofstream(dir + "/plain") << "x";
  check(env->CreateDir(dir + "/plain/sub"), kInvalid,
        {dir + "/plain/sub", "cannot create directory", "Not a directory"});
  check(env->NewWritableFile(dir).status(), kInvalid, {dir, "Is a directory"});
  check(env->SyncDir(dir + "/plain"), kInvalid, {dir + "/plain", "Not a directory"});
  check(env->GetChildren(dir + "/plain").status(), kInvalid, {dir + "/plain"});
  check(env->NewWritableFile(dir + "/" + std::string(300, 'n')).status(), kInvalid,
        {"File name too long"});
  // Not ours to write, or a read-only mount: PERMISSION_DENIED (as root,
  // errno's meaning alone: root writes where chmod forbids it).
  for (int error : {EACCES, EPERM, EROFS}) {
    CHECK(FileSystemError(error, "m").code() == absl::StatusCode::kPermissionDenied);
  }
  // Anything else (I/O) is UNAVAILABLE.
  CHECK(FileSystemError(EIO, "m").code() == kUnavailable);
  CHECK(FileSystemError(ESTALE, "m").code() == kUnavailable);
}

TEST_CASE("an EnvWrapper forwards what it does not override") {
  const std::string dir = FreshDir("wrapper");
  EnvWrapper wrapper(Env::Default());
  CHECK(wrapper.target() == Env::Default());
  REQUIRE(wrapper.CreateDir(dir + "/d").ok());
  auto file = wrapper.NewWritableFile(dir + "/d/f");
  REQUIRE(file.ok());
  REQUIRE((*file)->Append("abc", 3).ok());
  REQUIRE((*file)->Close().ok());
  CHECK(Contents(&wrapper, dir + "/d/f") == "abc");
  CHECK(wrapper.GetChildren(dir + "/d").value() == std::vector<std::string>{"f"});
  CHECK(wrapper.NewRandomAccessFile(dir + "/nope").status().code() == absl::StatusCode::kNotFound);
  REQUIRE(wrapper.RemoveAll(dir + "/d").ok());
  CHECK_FALSE(wrapper.FileExists(dir + "/d"));
}

// ---- Saves on a failing file system.

// A full disk for the save of one step: a rank's data file takes half of
// its bytes, then ENOSPC. Or its commit's rename fails with EIO.
class FailingEnv : public EnvWrapper {
 public:
  // kRankFileDenied: the rank file cannot be created (EACCES), as on a
  // node that mounts the shared directory read-only or as another user.
  enum class Fault { kRankFileFull, kRenameFails, kRankFileDenied };
  FailingEnv(Env* target, Fault fault, int step)
      : EnvWrapper(target), fault_(fault), tmp_dir_(TempStepDirName(step)) {}

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    if (fault_ == Fault::kRankFileDenied && InSave(path) && absl::EndsWith(path, ".bin")) {
      ++faults_;
      return FileSystemError(EACCES, path + ": cannot create: " + std::strerror(EACCES));
    }
    auto file = target()->NewWritableFile(path);
    if (!file.ok() || fault_ != Fault::kRankFileFull || !InSave(path) ||
        !absl::EndsWith(path, ".bin")) {
      return file;
    }
    return std::unique_ptr<WritableFile>(new FullDisk(this, *std::move(file), path));
  }

  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    if (fault_ == Fault::kRenameFails && absl::EndsWith(from, "/" + tmp_dir_)) {
      ++faults_;
      return absl::UnavailableError(
          absl::StrCat("cannot rename ", from, " to ", to, ": Input/output error"));
    }
    return target()->RenameFile(from, to);
  }

  int faults() const { return faults_.load(); }

 private:
  class FullDisk : public WritableFile {
   public:
    FullDisk(FailingEnv* env, std::unique_ptr<WritableFile> file, std::string path)
        : env_(env), file_(std::move(file)), path_(std::move(path)) {}
    absl::Status Append(const void* data, size_t bytes) override {
      if (absl::Status status = file_->Append(data, bytes / 2); !status.ok()) return status;
      ++env_->faults_;
      return FileSystemError(ENOSPC,
                             absl::StrCat(path_, ": write failed: ", std::strerror(ENOSPC)));
    }
    absl::Status Sync() override { return file_->Sync(); }
    absl::Status Close() override { return file_->Close(); }

   private:
    FailingEnv* env_;
    std::unique_ptr<WritableFile> file_;
    const std::string path_;
  };

  bool InSave(const std::string& path) const {
    return absl::StrContains(path, "/" + tmp_dir_ + "/");
  }

  const Fault fault_;
  const std::string tmp_dir_;
  std::atomic<int> faults_{0};
};

// L=2, C=32, NH=2, T=16, B=4; checkpoints every 4 of 12 steps.
// The shared tiny job, its shard written into `dir`.
TrainConfig TinyConfig(const std::string& dir) {
  testing::WriteShard(dir);
  return testing::TinyConfig(dir);
}

struct Outcome {
  absl::Status status;
  int resumed_at = -1;  // the step Create resumed at
  int steps = 0;        // steps this run took
};

// Never REQUIREs: it may run on a rank thread.
Outcome Train(const TrainConfig& config, Env* env, ParallelStrategy* strategy = nullptr) {
  Outcome outcome;
  TrainerOptions options;
  options.log = std::tmpfile();
  options.env = env;
  options.strategy = strategy;
  options.on_step = [&outcome](const StepMetrics&) { ++outcome.steps; };
  auto trainer = Trainer::Create(config, options);
  if (trainer.ok()) {
    outcome.resumed_at = (*trainer)->state().step;
    outcome.status = (*trainer)->Run();
  } else {
    outcome.status = trainer.status();
  }
  std::fclose(options.log);
  return outcome;
}

TEST_CASE("a failed write fails the save naming the file; the previous checkpoint resumes") {
  for (auto fault : {FailingEnv::Fault::kRankFileFull, FailingEnv::Fault::kRenameFails}) {
    const bool full = fault == FailingEnv::Fault::kRankFileFull;
    DYNAMIC_SECTION((full ? "ENOSPC writing the rank file" : "EIO renaming the directory")) {
      const std::string dir = FreshDir(full ? "enospc" : "eio");
      const TrainConfig config = TinyConfig(dir);
      const std::string tmp = config.checkpoint.dir + "/.tmp_step_00000008";
      FailingEnv failing(Env::Default(), fault, 8);

      Outcome failed = Train(config, &failing);
      INFO(failed.status.ToString());
      CHECK(failing.faults() == 1);
      CHECK(failed.status.code() ==
            (full ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kUnavailable));
      // A full disk is marked (no restart mends it: worker_main reports it
      // so), and says what a checkpoint takes and where a rerun resumes.
      CHECK(IsNoSpace(failed.status) == full);
      // The abandoned save's files are gone, so a full disk has its space back.
      CHECK_FALSE(fs::exists(tmp));
      if (full) {
        CHECK(absl::StrContains(failed.status.message(), "saving checkpoint step 8: " + tmp +
                                                             "/rank_00000.bin: write failed: "
                                                             "No space left on device; the file "
                                                             "system of " +
                                                             config.checkpoint.dir + " has "));
        CHECK(absl::StrContains(failed.status.message(),
                                " free with this save's files deleted. A checkpoint of this run "
                                "takes "));
        CHECK(absl::StrContains(failed.status.message(),
                                "checkpoint.keep_last 10 keeps up to 11 of them while a save is "
                                "written: free space there (or lower checkpoint.keep_last) and "
                                "start the run again, which resumes from step 4"));
      } else {
        CHECK(absl::StrContains(failed.status.message(), "cannot rename " + tmp + " to " +
                                                             config.checkpoint.dir +
                                                             "/step_00000008: Input/output "
                                                             "error"));
      }
      // The failure stops the run by the next save at the latest: when it
      // surfaces depends on how fast the background writer gets to it (a
      // busy machine: the final save), never on whether.
      CHECK(failed.steps <= 12);
      CHECK_FALSE(fs::exists(config.checkpoint.dir + "/step_00000012"));
      CHECK(VerifyCheckpoint(Env::Default(), config.checkpoint.dir + "/step_00000004").ok());
      CHECK_FALSE(fs::exists(config.checkpoint.dir + "/step_00000008"));

      // The disk is back: the next run resumes from step 4 and finishes.
      Outcome resumed = Train(config, Env::Default());
      INFO(resumed.status.ToString());
      REQUIRE(resumed.status.ok());
      CHECK(resumed.resumed_at == 4);
      CHECK(resumed.steps == 8);
      CHECK(VerifyCheckpoint(Env::Default(), config.checkpoint.dir + "/step_00000012").ok());
    }
  }
}

// Two thread-ranks train `config`, rank 1 on `env` and rank 0 on the
// default one.
std::vector<Outcome> TrainWithRank1On(const TrainConfig& config, Env* env) {
  std::vector<Outcome> outcomes(2);
  testing::RunRanks(2, [&](int rank, ParallelStrategy* strategy) {
    outcomes[rank] = Train(config, rank == 1 ? env : Env::Default(), strategy);
  });
  return outcomes;
}

// A directory one rank may not write: not restartable on that rank, and
// so on every rank, each naming the cause (CheckpointManager::Agree).
TEST_CASE("one rank's refused rank file fails every rank as not restartable, naming it") {
  const std::string dir = FreshDir("eacces_rank1");
  const TrainConfig config = TinyConfig(dir);
  const std::string tmp = config.checkpoint.dir + "/.tmp_step_00000008";
  FailingEnv failing(Env::Default(), FailingEnv::Fault::kRankFileDenied, 8);
  const std::vector<Outcome> outcomes = TrainWithRank1On(config, &failing);
  const std::string cause = tmp + "/rank_00001.bin: cannot create: Permission denied";
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank " << rank << ": " << outcomes[rank].status.ToString());
    CHECK(absl::IsPermissionDenied(outcomes[rank].status));
    CHECK_FALSE(IsNoSpace(outcomes[rank].status));
  }
  CHECK(failing.faults() == 1);
  CHECK(outcomes[1].status.message() == "saving checkpoint step 8: " + cause);
  CHECK(outcomes[0].status.message() == "saving checkpoint step 8 failed on rank 1: " + cause);
  CHECK_FALSE(fs::exists(tmp));
  CHECK(VerifyCheckpoint(Env::Default(), config.checkpoint.dir + "/step_00000004").ok());
}

TEST_CASE("one rank's full disk fails every rank as a full disk, and the save leaves nothing") {
  const std::string dir = FreshDir("enospc_rank1");
  const TrainConfig config = TinyConfig(dir);
  const std::string tmp = config.checkpoint.dir + "/.tmp_step_00000008";
  // Rank 1's file system is full during step 8's save; rank 0's is not.
  FailingEnv failing(Env::Default(), FailingEnv::Fault::kRankFileFull, 8);
  const std::vector<Outcome> outcomes = TrainWithRank1On(config, &failing);
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank " << rank << ": " << outcomes[rank].status.ToString());
    // Both are not restartable: a restart would fail the same way, so no
    // agent may report this one as a failure to restart from.
    CHECK(IsNoSpace(outcomes[rank].status));
  }
  CHECK(failing.faults() == 1);
  CHECK(absl::StrContains(outcomes[1].status.message(),
                          "saving checkpoint step 8: " + tmp + "/rank_00001.bin: write failed"));
  // Rank 0 says what rank 1 met, advice included, with its code.
  CHECK(outcomes[0].status.code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(
      outcomes[0].status.message(),
      "saving checkpoint step 8 failed on rank 1: " + tmp + "/rank_00001.bin: write failed"));
  CHECK(absl::StrContains(outcomes[0].status.message(),
                          "start the run again, which resumes from "
                          "step 4"));
  CHECK_FALSE(fs::exists(tmp));
  CHECK(VerifyCheckpoint(Env::Default(), config.checkpoint.dir + "/step_00000004").ok());
}

}  // namespace
}  // namespace muster::worker
