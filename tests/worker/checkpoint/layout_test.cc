// The flat state's split into files (worker/checkpoint/layout.h): the
// manifest's slices for files that hold one range each (DDP) and several
// ranges each, in any order (FSDP: a rank's slice of every stage).
#include <catch2/catch.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "worker/checkpoint/layout.h"
#include "worker/checkpoint/manifest.h"

namespace muster::worker {

// For comparing slices in CHECKs; in the type's namespace, where the
// comparison of vectors finds them.
bool operator==(const TensorSlice& a, const TensorSlice& b) {
  return a.file == b.file && a.start == b.start && a.count == b.count && a.offset == b.offset;
}

std::ostream& operator<<(std::ostream& out, const TensorSlice& s) {
  return out << "{file " << s.file << ", start " << s.start << ", count " << s.count << ", offset "
             << s.offset << "}";
}

namespace {

// Three tensors of 20, 10 and 30 floats: a [0, 20), b [20, 30), c [30, 60).
std::vector<StateTensor> ThreeTensors() {
  return {{"params/a", {4, 5}, 0, 20}, {"params/b", {10}, 20, 10}, {"params/c", {3, 10}, 30, 30}};
}

TEST_CASE("SliceTensors: one range per file is the even DDP split") {
  const std::vector<FlatRange> shards = EvenShards(60, 3);
  REQUIRE(shards.size() == 3);
  const std::vector<TensorRecord> records =
      SliceTensors(ThreeTensors(), {{shards[0]}, {shards[1]}, {shards[2]}});
  REQUIRE(records.size() == 3);
  // [0, 20) | [20, 40) | [40, 60): c is split 10 | 20 between files 1 and 2.
  CHECK(records[0].slices == std::vector<TensorSlice>{{0, 0, 20, 0}});
  CHECK(records[1].slices == std::vector<TensorSlice>{{1, 0, 10, 0}});
  CHECK(records[2].slices == std::vector<TensorSlice>{{1, 0, 10, 40}, {2, 10, 20, 0}});
}

TEST_CASE("SliceTensors: a file of several ranges holds them end to end, in its order") {
  // File 0 holds [0, 7), [25, 35), [50, 54); file 1 [7, 15), [35, 50);
  // file 2 [54, 60) before [15, 25) (out of flat order); file 3 nothing;
  // and an empty range in file 1.
  const std::vector<std::vector<FlatRange>> files = {
      {{0, 7}, {25, 10}, {50, 4}}, {{7, 8}, {40, 0}, {35, 15}}, {{54, 6}, {15, 10}}, {}};
  const std::vector<TensorRecord> records = SliceTensors(ThreeTensors(), files);
  REQUIRE(records.size() == 3);
  CHECK(records[0].name == "params/a");
  CHECK(records[0].shape == std::vector<int64_t>{4, 5});
  // Offsets are bytes: the floats of the file's earlier ranges, plus how
  // far into its range the slice starts, times 4. Slices sorted by start.
  const std::vector<TensorSlice> a = {
      {0, 0, 7, 0},      // [0, 7): file 0's first range
      {1, 7, 8, 0},      // [7, 15): file 1's first range
      {2, 15, 5, 6 * 4}  // [15, 20): after file 2's 6 floats of [54, 60)
  };
  const std::vector<TensorSlice> b = {
      {2, 0, 5, (6 + 5) * 4},  // [20, 25): 5 floats into file 2's [15, 25)
      {0, 5, 5, 7 * 4}         // [25, 30): after file 0's [0, 7)
  };
  const std::vector<TensorSlice> c = {
      {0, 0, 5, (7 + 5) * 4},    // [30, 35): 5 floats into file 0's [25, 35)
      {1, 5, 15, 8 * 4},         // [35, 50): after file 1's [7, 15) (and the empty range)
      {0, 20, 4, (7 + 10) * 4},  // [50, 54): file 0's third range
      {2, 24, 6, 0}              // [54, 60): file 2's first range
  };
  CHECK(records[0].slices == a);
  CHECK(records[1].slices == b);
  CHECK(records[2].slices == c);

  // The slices are what ParseManifest accepts: every tensor covered once,
  // every slice inside its file, each file its slices end to end.
  Manifest manifest;
  manifest.world_size = static_cast<int>(files.size());
  for (size_t file = 0; file < files.size(); ++file) {
    uint64_t floats = 0;
    for (const FlatRange& range : files[file]) floats += range.count;
    manifest.files.push_back({RankFileName(static_cast<int>(file)), floats * 4, 0});
  }
  manifest.tensors = records;
  auto parsed = ParseManifest(ManifestToJson(manifest), "several ranges");
  INFO(parsed.status().ToString());
  CHECK(parsed.ok());
}

}  // namespace
}  // namespace muster::worker
