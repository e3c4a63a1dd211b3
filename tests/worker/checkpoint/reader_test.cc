// Loading ranges of the flat state (worker/checkpoint/reader.h) from a
// checkpoint whose files hold several ranges each, as FSDP writes them:
// the floats exactly, each touched file read once and checked in full,
// and wanted ranges that are not sorted and disjoint refused.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "tests/worker/checkpoint/tiny_job.h"
#include "worker/checkpoint/env.h"
#include "worker/checkpoint/files.h"
#include "worker/checkpoint/layout.h"
#include "worker/checkpoint/manifest.h"
#include "worker/checkpoint/reader.h"
#include "worker/checkpoint/retention.h"

namespace muster::worker {
namespace {

// Counts the opens for reading of each path.
class CountingEnv : public EnvWrapper {
 public:
  CountingEnv() : EnvWrapper(Env::Default()) {}
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override {
    {
      absl::MutexLock lock(&mu_);
      ++opens_[path];
    }
    return EnvWrapper::NewRandomAccessFile(path);
  }
  std::map<std::string, int> opens() {
    absl::MutexLock lock(&mu_);
    return opens_;
  }
  void Reset() {
    absl::MutexLock lock(&mu_);
    opens_.clear();
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, int> opens_ ABSL_GUARDED_BY(mu_);
};

// A flat state of three tensors, a [0, 20), b [20, 30), c [30, 60), with
// float i equal to a value no other index has (exact in f32).
std::vector<StateTensor> ThreeTensors() {
  return {{"params/a", {4, 5}, 0, 20}, {"params/b", {10}, 20, 10}, {"params/c", {3, 10}, 30, 30}};
}
float Value(uint64_t i) { return 1000.0f + 0.25f * static_cast<float>(i); }

// Files of several ranges each, one out of flat order, one empty.
const std::vector<std::vector<FlatRange>> kFiles = {
    {{0, 7}, {25, 10}, {50, 4}}, {{7, 8}, {35, 15}}, {{54, 6}, {15, 10}}, {}};

// Writes a checkpoint of ThreeTensors() split as kFiles into `path` (the
// files, then manifest.json) and returns its manifest as ParseManifest
// reads it (ReadManifest would refuse it: its tensors are no model's).
Manifest WriteCheckpoint(const std::string& path) {
  Manifest manifest;
  for (size_t file = 0; file < kFiles.size(); ++file) {
    std::vector<float> data;
    for (const FlatRange& range : kFiles[file]) {
      for (uint64_t i = range.begin; i < range.begin + range.count; ++i) data.push_back(Value(i));
    }
    FileRecord record{RankFileName(static_cast<int>(file)), data.size() * sizeof(float), 0};
    REQUIRE(WriteFileDurably(Env::Default(), path + "/" + record.name, data.data(), record.bytes,
                             &record.crc32)
                .ok());
    manifest.files.push_back(record);
  }
  manifest.world_size = static_cast<int>(kFiles.size());
  manifest.tensors = SliceTensors(ThreeTensors(), kFiles);
  std::ofstream(path + "/" + kManifestName) << ManifestToJson(manifest);
  auto text = ReadSmallFile(Env::Default(), path + "/" + kManifestName);
  REQUIRE(text.ok());
  auto read = ParseManifest(*text, path);
  INFO(read.status().ToString());
  REQUIRE(read.ok());
  return *read;
}

TEST_CASE("LoadFlatRanges loads several ranges exactly, reading each touched file once") {
  const std::string path = testing::FreshDir("reader_test", "several");
  const Manifest manifest = WriteCheckpoint(path);
  CountingEnv env;

  // Each range into memory of its own: a spans files 0 and 1; b and c
  // files 2 and 0; [40, 42) file 1 alone; [52, 57) files 0 and 2; the
  // empty range reads nothing.
  const std::vector<FlatRange> ranges = {{3, 10}, {22, 10}, {40, 2}, {52, 5}, {58, 0}};
  std::vector<std::vector<float>> loaded;
  for (const FlatRange& range : ranges) loaded.emplace_back(range.count, -1.0f);
  absl::Status status =
      LoadFlatRanges(&env, path, manifest, ThreeTensors(), ranges, [&](uint64_t i) -> float* {
        for (size_t k = 0; k < ranges.size(); ++k) {
          if (i >= ranges[k].begin && i < ranges[k].begin + ranges[k].count) {
            return loaded[k].data() + (i - ranges[k].begin);
          }
        }
        return nullptr;  // never asked for: fails the test below
      });
  INFO(status.ToString());
  REQUIRE(status.ok());
  for (size_t k = 0; k < ranges.size(); ++k) {
    std::vector<float> expected;
    for (uint64_t i = ranges[k].begin; i < ranges[k].begin + ranges[k].count; ++i) {
      expected.push_back(Value(i));
    }
    INFO("range " << k);
    CHECK(loaded[k] == expected);
  }
  // Files 0, 1 and 2 each serve two or more ranges: one open each. File 3
  // (empty) holds nothing wanted and is not opened.
  const std::map<std::string, int> once = {
      {path + "/rank_00000.bin", 1}, {path + "/rank_00001.bin", 1}, {path + "/rank_00002.bin", 1}};
  CHECK(env.opens() == once);

  // The one-range forms are the same load: [40, 42) opens file 1 only.
  env.Reset();
  std::vector<float> two(2);
  REQUIRE(LoadFlatRange(&env, path, manifest, ThreeTensors(), 40, 2, two.data()).ok());
  CHECK(two == std::vector<float>{Value(40), Value(41)});
  CHECK(env.opens() == std::map<std::string, int>{{path + "/rank_00001.bin", 1}});
}

TEST_CASE("LoadFlatRanges checks the CRC of a touched file's bytes it does not want") {
  const std::string path = testing::FreshDir("reader_test", "crc");
  const Manifest manifest = WriteCheckpoint(path);
  // Flip a byte of file 2's first range, [54, 60), then load only from
  // its second: the file is read in full, so the flip is found.
  {
    std::fstream file(path + "/rank_00002.bin", std::ios::in | std::ios::out | std::ios::binary);
    char byte = 0;
    file.seekg(5);
    file.read(&byte, 1);
    byte ^= 0x10;
    file.seekp(5);
    file.write(&byte, 1);
  }
  std::vector<float> wanted(4);
  absl::Status status = LoadFlatRanges(Env::Default(), path, manifest, ThreeTensors(), {{16, 4}},
                                       [&](uint64_t i) { return wanted.data() + (i - 16); });
  CHECK(status.code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StrContains(status.message(), path + "/rank_00002.bin"));
}

TEST_CASE("LoadFlatRanges refuses ranges that are not sorted and disjoint, opening nothing") {
  const std::string path = testing::FreshDir("reader_test", "refused");
  const Manifest manifest = WriteCheckpoint(path);
  CountingEnv env;
  std::vector<float> sink(60);
  auto where = [&](uint64_t i) { return sink.data() + i; };
  struct Case {
    const char* what;
    std::vector<FlatRange> ranges;
    const char* says;
  };
  for (const Case& bad : std::vector<Case>{
           {"unsorted", {{22, 10}, {3, 10}}, "out of order or overlap"},
           {"overlapping", {{3, 10}, {12, 5}}, "out of order or overlap"},
           {"an empty range inside the one before", {{3, 10}, {5, 0}}, "out of order or overlap"},
           {"past the state's end", {{55, 10}}, "past the end"},
       }) {
    INFO(bad.what);
    absl::Status status = LoadFlatRanges(&env, path, manifest, ThreeTensors(), bad.ranges, where);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(status.message(), bad.says));
  }
  CHECK(env.opens().empty());
}

// A directory we may not read (mode 000, another user's), as POSIX shows
// it: stat of the directory works, stat or open of anything in it fails
// with EACCES.
class UnreadableDirEnv : public EnvWrapper {
 public:
  explicit UnreadableDirEnv(std::string dir) : EnvWrapper(Env::Default()), dir_(std::move(dir)) {}
  bool FileExists(const std::string& path) override {
    return !Inside(path) && EnvWrapper::FileExists(path);
  }
  bool IsDirectory(const std::string& path) override {
    return !Inside(path) && EnvWrapper::IsDirectory(path);
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path) override {
    if (Inside(path)) return absl::PermissionDeniedError(path + ": cannot open: Permission denied");
    return EnvWrapper::NewRandomAccessFile(path);
  }
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    if (dir == dir_) return absl::PermissionDeniedError(dir + ": cannot list: Permission denied");
    return EnvWrapper::GetChildren(dir);
  }

 private:
  bool Inside(const std::string& path) const { return absl::StartsWith(path, dir_ + "/"); }
  const std::string dir_;
};

TEST_CASE("a step directory that cannot be read is reported as such, not as torn") {
  const std::string dir = testing::FreshDir("reader_test", "unreadable");
  const std::string step = dir + "/" + StepDirName(4);
  std::filesystem::create_directories(step);
  WriteCheckpoint(step);
  UnreadableDirEnv env(step);
  auto manifest = ReadManifest(&env, step);
  CHECK(manifest.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(absl::StrContains(manifest.status().message(), "Permission denied"));
  CHECK_FALSE(absl::StrContains(manifest.status().message(), "torn"));
  // Retention leaves it alone: torn ones may be deleted.
  auto found = LineageSteps(&env, dir, "any");
  REQUIRE(found.ok());
  CHECK(found->torn.empty());
  CHECK(found->committed.empty());
}

}  // namespace
}  // namespace muster::worker
