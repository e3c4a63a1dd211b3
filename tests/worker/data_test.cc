// Token shards (format, validation) and the global sample stream (order,
// determinism, splitting across ranks).
#include "worker/data/data.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "launcher/process.h"

namespace muster::worker {
namespace {

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// An empty directory under TEST_TMPDIR, unique to this test case.
std::string FreshDir(const std::string& name) {
  static int counter = 0;
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base ? base : "/tmp", "/data_test_", name, "_", ++counter);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  REQUIRE(out.good());
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A shard written byte by byte, independently of WriteTokenShard, with
// whatever header values a test wants.
std::string ShardBytes(int32_t magic, int32_t version, int32_t count,
                       const std::vector<uint16_t>& tokens) {
  std::string bytes(kShardHeaderBytes, '\0');
  int32_t words[3] = {magic, version, count};
  for (int w = 0; w < 3; ++w) {
    for (int b = 0; b < 4; ++b) bytes[4 * w + b] = char(uint32_t(words[w]) >> (8 * b));
  }
  for (uint16_t token : tokens) {
    bytes.push_back(char(token & 0xff));
    bytes.push_back(char(token >> 8));
  }
  return bytes;
}

// Tokens base, base+1, ...: a window's first input names the window.
std::vector<uint16_t> Counting(int count, int base) {
  std::vector<uint16_t> tokens(count);
  for (int i = 0; i < count; ++i) tokens[i] = static_cast<uint16_t>(base + i);
  return tokens;
}

TEST_CASE("a written shard opens with the same tokens") {
  std::string dir = FreshDir("roundtrip");
  std::vector<uint16_t> tokens = {0, 1, 255, 256, 50256, 65535, 7};
  REQUIRE(WriteTokenShard(dir + "/a.bin", tokens).ok());
  auto shard = TokenShard::Open(dir + "/a.bin", 65536);
  REQUIRE(shard.ok());
  CHECK((*shard)->path() == dir + "/a.bin");
  REQUIRE((*shard)->size() == tokens.size());
  CHECK(std::vector<uint16_t>((*shard)->tokens(), (*shard)->tokens() + tokens.size()) == tokens);
  // Byte layout as llm.c writes it: little-endian header, then uint16 LE.
  std::string bytes = ReadBytes(dir + "/a.bin");
  CHECK(bytes == ShardBytes(kShardMagic, kShardVersion, 7, tokens));

  REQUIRE(WriteTokenShard(dir + "/empty.bin", {}).ok());
  auto empty = TokenShard::Open(dir + "/empty.bin", 256);
  REQUIRE(empty.ok());
  CHECK((*empty)->size() == 0);
}

TEST_CASE("each malformed shard is rejected with the file and the problem named") {
  std::string dir = FreshDir("invalid");
  auto open_error = [&](const std::string& name, const std::string& bytes, int vocab = 256) {
    std::string path = dir + "/" + name;
    WriteBytes(path, bytes);
    auto shard = TokenShard::Open(path, vocab);
    REQUIRE_FALSE(shard.ok());
    CHECK(shard.status().code() == absl::StatusCode::kInvalidArgument);
    std::string message(shard.status().message());
    CHECK(Contains(message, path));
    return message;
  };

  auto missing = TokenShard::Open(dir + "/missing.bin", 256);
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK(Contains(std::string(missing.status().message()), dir + "/missing.bin"));

  CHECK(Contains(open_error("short.bin", std::string(1000, '\0')), "1000 bytes"));
  CHECK(Contains(open_error("magic.bin", ShardBytes(123, 1, 2, {1, 2})),
                 "wrong magic 123, expected 20240520 (not an llm.c token shard?)"));
  CHECK(Contains(open_error("version.bin", ShardBytes(kShardMagic, 2, 2, {1, 2})), "version 2"));
  std::string size = open_error("size.bin", ShardBytes(kShardMagic, 1, 5, {1, 2}));
  CHECK(Contains(size, "1028"));  // the file's size
  CHECK(Contains(size, "1034"));  // what 5 tokens need
  std::string token = open_error("token.bin", ShardBytes(kShardMagic, 1, 4, {1, 2, 300, 999}));
  CHECK(Contains(token, "token 2 is 300"));
  // The same file is fine with a larger vocabulary.
  CHECK(TokenShard::Open(dir + "/token.bin", 1000).ok());
}

TEST_CASE("a glob that matches nothing is NOT_FOUND; too-short shards are INVALID_ARGUMENT") {
  std::string dir = FreshDir("glob");
  auto none = TokenStream::Open(dir + "/train_*.bin", 4, 256, 1);
  CHECK(none.status().code() == absl::StatusCode::kNotFound);
  CHECK(Contains(std::string(none.status().message()), dir + "/train_*.bin"));

  REQUIRE(WriteTokenShard(dir + "/train_000000.bin", Counting(4, 0)).ok());
  auto short_stream = TokenStream::Open(dir + "/train_*.bin", 4, 256, 1);
  CHECK(short_stream.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Contains(std::string(short_stream.status().message()), "5 tokens"));
  // seq_len + 1 in 64 bits: the largest seq_len said -2147483648 tokens.
  auto longest = TokenStream::Open(dir + "/train_*.bin", 2147483647, 256, 1);
  CHECK(Contains(std::string(longest.status().message()), "seq_len + 1 = 2147483648 tokens"));

  // A bad shard among the matches fails the whole stream, naming that shard.
  WriteBytes(dir + "/train_000001.bin", ShardBytes(123, 1, 0, {}));
  auto bad = TokenStream::Open(dir + "/train_*.bin", 4, 256, 1);
  CHECK(Contains(std::string(bad.status().message()), "train_000001.bin"));
}

// Two shards: 43 tokens (10 windows of T=4, 2 tokens left over), 21 tokens
// (5 windows). Window ids are recovered from the first input token.
struct SmallStream {
  static constexpr int kT = 4;
  std::string dir = FreshDir("stream");
  SmallStream() {
    REQUIRE(WriteTokenShard(dir + "/s_b.bin", Counting(21, 1000)).ok());
    REQUIRE(WriteTokenShard(dir + "/s_a.bin", Counting(43, 0)).ok());
  }
  std::unique_ptr<TokenStream> Open(uint64_t seed) const {
    auto stream = TokenStream::Open(dir + "/s_*.bin", kT, 2000, seed);
    REQUIRE(stream.ok());
    return *std::move(stream);
  }
  static int WindowOf(int first_input) {
    return first_input >= 1000 ? 10 + (first_input - 1000) / kT : first_input / kT;
  }
};

TEST_CASE("every epoch visits every window exactly once, in a new order") {
  SmallStream data;
  auto stream = data.Open(42);
  REQUIRE(stream->samples_per_epoch() == 15);
  CHECK(stream->files() == std::vector<std::string>{data.dir + "/s_a.bin", data.dir + "/s_b.bin"});
  std::set<std::vector<int>> orders;
  for (uint64_t epoch = 0; epoch < 5; ++epoch) {
    std::vector<int> order;
    std::set<int> seen;
    for (uint64_t i = 0; i < 15; ++i) {
      int inputs[SmallStream::kT], targets[SmallStream::kT];
      stream->Sample(epoch * 15 + i, inputs, targets);
      int window = SmallStream::WindowOf(inputs[0]);
      order.push_back(window);
      seen.insert(window);
    }
    CHECK(seen.size() == 15);
    CHECK(*seen.begin() == 0);
    CHECK(*seen.rbegin() == 14);
    orders.insert(order);
  }
  CHECK(orders.size() == 5);
}

TEST_CASE("targets are the inputs shifted by one, within one shard") {
  SmallStream data;
  auto stream = data.Open(7);
  for (uint64_t i = 0; i < 45; ++i) {
    int inputs[SmallStream::kT], targets[SmallStream::kT];
    stream->Sample(i, inputs, targets);
    int base = inputs[0];
    CHECK((base < 1000 ? base % 4 : (base - 1000) % 4) == 0);  // stride T
    for (int t = 0; t < SmallStream::kT; ++t) {
      CHECK(inputs[t] == base + t);
      CHECK(targets[t] == base + t + 1);
    }
  }
}

TEST_CASE("the stream is a pure function of (files, seed, index)") {
  SmallStream data;
  auto first = data.Open(1234);
  auto second = data.Open(1234);
  auto other_seed = data.Open(1235);
  bool seed_matters = false;
  // Includes indexes far beyond one epoch: no state accumulates.
  for (uint64_t i : {uint64_t{0}, uint64_t{1}, uint64_t{14}, uint64_t{15}, uint64_t{1000003},
                     uint64_t{1} << 62, ~uint64_t{0}}) {
    int a_in[4], a_tg[4], b_in[4], b_tg[4], c_in[4], c_tg[4];
    first->Sample(i, a_in, a_tg);
    second->Sample(i, b_in, b_tg);
    other_seed->Sample(i, c_in, c_tg);
    CHECK(std::memcmp(a_in, b_in, sizeof(a_in)) == 0);
    CHECK(std::memcmp(a_tg, b_tg, sizeof(a_tg)) == 0);
    seed_matters |= a_in[0] != c_in[0];
  }
  CHECK(seed_matters);

  // Pinned order: changing the permutation would silently change what a
  // resumed run (or another platform) trains on.
  std::vector<int> order;
  for (uint64_t i = 0; i < 15; ++i) {
    int inputs[4], targets[4];
    first->Sample(i, inputs, targets);
    order.push_back(SmallStream::WindowOf(inputs[0]));
  }
  CHECK(order == std::vector<int>{1, 3, 10, 13, 8, 12, 0, 14, 2, 7, 6, 4, 11, 5, 9});
}

TEST_CASE("1, 2 or 3 ranks splitting each global batch see exactly the 1-rank samples") {
  SmallStream data;
  auto reference = data.Open(99);
  constexpr int kGlobalBatch = 6, kSteps = 7, kT = SmallStream::kT;  // crosses epochs
  std::vector<int> expected_inputs(kSteps * kGlobalBatch * kT);
  std::vector<int> expected_targets(expected_inputs.size());
  reference->Batch(0, kSteps * kGlobalBatch, expected_inputs.data(), expected_targets.data());

  for (int world : {1, 2, 3}) {
    // Each rank owns its own stream, as separate processes would, and runs
    // on its own thread; step s, rank r reads samples
    // s*G + r*G/world ... s*G + (r+1)*G/world - 1.
    std::vector<int> inputs(expected_inputs.size(), -1), targets(inputs.size(), -1);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < world; ++rank) {
      ranks.emplace_back([&, rank] {
        auto stream = TokenStream::Open(data.dir + "/s_*.bin", kT, 2000, 99);
        if (!stream.ok()) return;
        int per_rank = kGlobalBatch / world;
        for (int step = 0; step < kSteps; ++step) {
          uint64_t first = uint64_t(step) * kGlobalBatch + uint64_t(rank) * per_rank;
          (*stream)->Batch(first, per_rank, &inputs[first * kT], &targets[first * kT]);
        }
      });
    }
    for (std::thread& rank : ranks) rank.join();
    INFO("world size " << world);
    CHECK(inputs == expected_inputs);
    CHECK(targets == expected_targets);
  }

  // A resume at another world size continues from the saved global index.
  std::vector<int> resumed(expected_inputs.size()), ignored(expected_inputs.size());
  reference->Batch(0, 3 * kGlobalBatch, resumed.data(), ignored.data());
  auto after_resume = data.Open(99);
  for (int rank = 0; rank < 3; ++rank) {
    for (int step = 3; step < kSteps; ++step) {
      uint64_t first = uint64_t(step) * kGlobalBatch + uint64_t(rank) * 2;
      after_resume->Batch(first, 2, &resumed[first * kT], &ignored[first * kT]);
    }
  }
  CHECK(resumed == expected_inputs);
}

TEST_CASE("one stream may be sampled from many threads at once") {
  SmallStream data;
  auto stream = data.Open(5);
  constexpr int kSamples = 300;
  std::vector<int> expected(kSamples * 4), scratch(kSamples * 4);
  stream->Batch(0, kSamples, expected.data(), scratch.data());
  std::vector<std::vector<int>> got(4, std::vector<int>(kSamples * 4));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<int> targets(kSamples * 4);
      stream->Batch(0, kSamples, got[t].data(), targets.data());
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::vector<int>& inputs : got) CHECK(inputs == expected);
}

// ---- tools/mkdata, run as a process from the test's runfiles.

struct Run {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

Run Mkdata(const std::vector<std::string>& args, const std::string& dir) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  std::string binary =
      absl::StrCat(srcdir ? srcdir : ".", "/", workspace ? workspace : "muster", "/tools/mkdata");
  launcher::SpawnSpec spec;
  // The shell sends both streams to one file, so the test reads them after
  // the exit without pipes to drain.
  spec.argv = {"/bin/sh", "-c", "exec \"$0\" \"$@\" > " + dir + "/mkdata.out 2>&1"};
  spec.argv.push_back(binary);
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  absl::StatusOr<launcher::Child> child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  auto exit = child->WaitFor(absl::Seconds(20));
  REQUIRE(exit.has_value());
  return Run{exit->ShellCode(), ReadBytes(dir + "/mkdata.out")};
}

// What the byte-level tokenizer should produce: one token per (unsigned) byte.
std::vector<uint16_t> ByteTokens(const std::string& text) {
  std::vector<uint16_t> tokens;
  for (char byte : text) tokens.push_back(static_cast<unsigned char>(byte));
  return tokens;
}

TEST_CASE("mkdata turns text into byte-token shards: train first, validation from the end") {
  std::string dir = FreshDir("mkdata");
  std::string text_a = "Hello, shards!\n", text_b = "caf\xc3\xa9 \x01\xff end";
  WriteBytes(dir + "/a.txt", text_a);
  WriteBytes(dir + "/b.txt", text_b);
  std::string all = text_a + text_b;  // 27 bytes -> 27 tokens
  REQUIRE(all.size() == 27);

  // 25% validation: 6 tokens; train 21 in shards of at most 10.
  Run run = Mkdata({"--out", dir + "/out", "--val-fraction", "0.25", "--shard-tokens", "10",
                    dir + "/a.txt", dir + "/b.txt"},
                   dir);
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK(Contains(run.output, "train: 21 tokens in 3 shard(s)"));
  CHECK(Contains(run.output, "val: 6 tokens in 1 shard(s)"));
  std::string decoded;
  for (const char* name : {"train_000000", "train_000001", "train_000002", "val_000000"}) {
    auto shard = TokenShard::Open(absl::StrCat(dir, "/out/", name, ".bin"), 256);
    REQUIRE(shard.ok());
    for (size_t i = 0; i < (*shard)->size(); ++i) decoded.push_back(char((*shard)->tokens()[i]));
  }
  CHECK(decoded == all);
  CHECK(ReadBytes(dir + "/out/val_000000.bin") ==
        ShardBytes(kShardMagic, 1, 6, ByteTokens(all.substr(21))));
  // The trainer's globs see exactly these shards.
  auto train = TokenStream::Open(dir + "/out/train_*.bin", 4, 256, 0);
  REQUIRE(train.ok());
  CHECK((*train)->files().size() == 3);

  // A smaller rerun replaces the old shards and removes the stale ones.
  run = Mkdata({"--out", dir + "/out", "--val-fraction", "0", dir + "/a.txt"}, dir);
  REQUIRE(run.exit_code == 0);
  CHECK(ReadBytes(dir + "/out/train_000000.bin") ==
        ShardBytes(kShardMagic, 1, 15, ByteTokens(text_a)));
  CHECK_FALSE(std::filesystem::exists(dir + "/out/train_000001.bin"));
  CHECK_FALSE(std::filesystem::exists(dir + "/out/val_000000.bin"));

  run = Mkdata({"--out", dir + "/named", "--name", "tiny", dir + "/a.txt"}, dir);
  REQUIRE(run.exit_code == 0);
  CHECK(std::filesystem::exists(dir + "/named/tiny_train_000000.bin"));
  CHECK(std::filesystem::exists(dir + "/named/tiny_val_000000.bin"));
}

// Names are matched as they are: glob characters in the directory or the
// prefix neither hide a stale shard nor make another data set's look stale.
TEST_CASE("mkdata's stale-shard cleanup takes names literally") {
  std::string dir = FreshDir("mkdata_literal");
  WriteBytes(dir + "/a.txt", "Hello, shards! Hello, shards!\n");
  const std::string out = dir + "/d[1]";
  Run run = Mkdata({"--out", out, "--shard-tokens", "10", dir + "/a.txt"}, dir);
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  REQUIRE(std::filesystem::exists(out + "/train_000002.bin"));
  run = Mkdata({"--out", out, dir + "/a.txt"}, dir);
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK(Contains(run.output, "removed stale shard " + out + "/train_000002.bin"));
  CHECK_FALSE(std::filesystem::exists(out + "/train_000001.bin"));
  CHECK_FALSE(std::filesystem::exists(out + "/train_000002.bin"));

  // A prefix of '*' leaves the shards of the prefix 'a_' alone.
  run = Mkdata({"--out", dir + "/sx", "--name", "a", dir + "/a.txt"}, dir);
  REQUIRE(run.exit_code == 0);
  run = Mkdata({"--out", dir + "/sx", "--name", "*", dir + "/a.txt"}, dir);
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_FALSE(Contains(run.output, "removed stale shard"));
  CHECK(std::filesystem::exists(dir + "/sx/a_train_000000.bin"));
}

TEST_CASE("mkdata fails with one line and exit code 2") {
  std::string dir = FreshDir("mkdata_errors");
  WriteBytes(dir + "/empty.txt", "");
  WriteBytes(dir + "/a.txt", "text");
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  std::vector<Case> cases = {
      {{"--out", dir + "/out", dir + "/missing.txt"}, dir + "/missing.txt"},
      {{"--out", dir + "/out", dir + "/empty.txt"}, "empty"},
      // A path below a regular file can never be created (even by root).
      {{"--out", dir + "/a.txt/out", dir + "/a.txt"}, dir + "/a.txt/out"},
  };
  for (const Case& c : cases) {
    Run run = Mkdata(c.args, dir);
    INFO(run.output);
    CHECK(run.exit_code == 2);
    CHECK(Contains(run.output, c.expected));
    CHECK(std::count(run.output.begin(), run.output.end(), '\n') == 1);
  }
}

TEST_CASE("mkdata refuses a --name or --out that would write elsewhere, naming why") {
  std::string dir = FreshDir("mkdata_names");
  WriteBytes(dir + "/a.txt", "Hello, shards!\n");
  std::filesystem::create_directories(dir + "/out");
  for (const std::string name : {"../escape", "a/b", "x..y"}) {
    INFO(name);
    Run run = Mkdata({"--out", dir + "/out", "--name", name, dir + "/a.txt"}, dir);
    CHECK(run.exit_code == 2);
    CHECK(run.output ==
          "mkdata: --name \"" + name + "\" is a file name prefix: it may not hold '/' or '..'\n");
  }
  CHECK_FALSE(std::filesystem::exists(dir + "/escape_train_000000.bin"));
  Run empty = Mkdata({"--out", "", dir + "/a.txt"}, dir);
  CHECK(empty.exit_code == 2);
  CHECK(empty.output == "mkdata: --out is empty: name the directory to write the shards to\n");

  // A file we may not open says so. A write-only sysctl refuses reading
  // even to root (whom a mode of 000 would not stop).
  std::string unreadable = "/proc/sys/vm/compact_memory";
  if (!std::filesystem::exists(unreadable)) {
    unreadable = dir + "/secret.txt";
    WriteBytes(unreadable, "x");
    std::filesystem::permissions(unreadable, std::filesystem::perms::none);
  }
  Run denied = Mkdata({"--out", dir + "/out", unreadable}, dir);
  CHECK(denied.exit_code == 2);
  CHECK(denied.output == "mkdata: cannot open " + unreadable + ": Permission denied\n");
}

TEST_CASE("mkdata counts one token in the singular and warns when no shard can train") {
  std::string dir = FreshDir("mkdata_one");
  WriteBytes(dir + "/one.txt", "x");
  Run run = Mkdata({"--out", dir + "/out", "--val-fraction", "0", dir + "/one.txt"}, dir);
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK(Contains(run.output, "1 token (vocab 256, one per byte) from 1 file(s)\n"));
  CHECK(Contains(run.output, "train: 1 token in 1 shard(s)"));
  CHECK(Contains(run.output,
                 "mkdata: warning: no train shard holds more than 1 token: training needs "
                 "shards of at least seq_len + 1 tokens\n"));
  run = Mkdata({"--out", dir + "/out", "--val-fraction", "0", "--shard-tokens", "2",
                dir + "/one.txt", dir + "/one.txt"},
               dir);
  CHECK(run.exit_code == 0);
  CHECK_FALSE(Contains(run.output, "warning"));
}

}  // namespace
}  // namespace muster::worker
