// mkdata: turns text files into llm.c token shards with a byte-level
// tokenizer (vocab 256, token = byte), for demos and tests that need real
// data without a GPT-2 tokenizer.
//
//   mkdata --out DIR [--val-fraction 0.1] [--shard-tokens N] [--name NAME] FILE...
//
// Writes DIR/[NAME_]train_000000.bin ... and DIR/[NAME_]val_000000.bin ...
// (llm.c's naming); validation takes the last val-fraction of the
// concatenated text. Exit 0 on success, 2 on any error (one line on stderr).

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/data/data.h"

namespace {

constexpr int kExitError = 2;

int Fail(const std::string& message) {
  std::fprintf(stderr, "mkdata: %s\n", message.c_str());
  return kExitError;
}

absl::Status AppendFile(const std::string& path, std::vector<uint16_t>* tokens) {
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(path, error);
  if (error) {  // the reason itself: missing, or a directory on the way we may not search
    return absl::NotFoundError(absl::StrCat("cannot read ", path, ": ", error.message()));
  }
  if (!std::filesystem::is_regular_file(status)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", path, ": not a regular file"));
  }
  std::FILE* in = std::fopen(path.c_str(), "rb");
  if (in == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  // Byte-level tokenizer: each byte is its own token.
  char buffer[1 << 16];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof(buffer), in)) > 0) {
    for (size_t i = 0; i < got; ++i) tokens->push_back(static_cast<unsigned char>(buffer[i]));
  }
  const bool failed = std::ferror(in) != 0;
  const int reason = errno;
  std::fclose(in);
  if (failed) {
    return absl::DataLossError(absl::StrCat("error reading ", path, ": ", std::strerror(reason)));
  }
  return absl::OkStatus();
}

// "1 token", "2 tokens".
std::string Count(size_t n, const char* noun) {
  return absl::StrCat(n, " ", noun, n == 1 ? "" : "s");
}

std::string ShardPath(const std::string& dir, const std::string& prefix, const std::string& split,
                      size_t index) {
  return absl::StrFormat("%s/%s%s_%06d.bin", dir, prefix, split, index);
}

// Writes tokens[begin, end) as shards of at most shard_tokens; returns the paths.
absl::StatusOr<std::vector<std::string>> WriteSplit(const std::vector<uint16_t>& tokens,
                                                    size_t begin, size_t end, size_t shard_tokens,
                                                    const std::string& dir,
                                                    const std::string& prefix,
                                                    const std::string& split) {
  std::vector<std::string> paths;
  for (size_t start = begin; start < end; start += shard_tokens) {
    size_t stop = std::min(end, start + shard_tokens);
    std::string path = ShardPath(dir, prefix, split, paths.size());
    std::vector<uint16_t> shard(tokens.begin() + start, tokens.begin() + stop);
    absl::Status written = muster::worker::WriteTokenShard(path, shard);
    if (!written.ok()) return written;
    paths.push_back(path);
  }
  return paths;
}

// Shards of an earlier, larger run would still match the trainer's glob and
// silently join this data set, so remove any this run did not write.
std::vector<std::string> RemoveStaleShards(const std::string& dir, const std::string& prefix,
                                           const std::set<std::string>& written) {
  // Names are compared as they are, not through glob(3): a directory or
  // prefix holding '[', '*' or '?' would otherwise match other files, or
  // none of its own.
  std::set<std::string> kept;
  for (const std::string& path : written) kept.insert(path.substr(path.rfind('/') + 1));
  auto stale = [&](const std::string& name) {
    for (const std::string split : {"train", "val"}) {
      const std::string head = prefix + split + "_";
      if (name.size() != head.size() + 6 + 4 || name.compare(0, head.size(), head) != 0 ||
          name.compare(name.size() - 4, 4, ".bin") != 0) {
        continue;
      }
      const std::string digits = name.substr(head.size(), 6);
      if (std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit)) {
        return kept.count(name) == 0;
      }
    }
    return false;
  };
  std::vector<std::string> removed;
  std::error_code error;
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    if (stale(name) && std::remove(path.c_str()) == 0) removed.push_back(path);
  }
  return removed;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Byte-level tokenizer: text files -> llm.c token shards (vocab 256)"};
  std::string out_dir;
  double val_fraction = 0.1;
  int64_t shard_tokens = 100'000'000;  // llm.c's fineweb shards hold 1e8 tokens
  std::string name;
  std::vector<std::string> inputs;
  app.add_option("--out", out_dir, "output directory (created if missing)")->required();
  app.add_option("--val-fraction", val_fraction,
                 "fraction of the tokens, from the end, that go to validation")
      ->check(CLI::Range(0.0, 0.999999));
  app.add_option("--shard-tokens", shard_tokens, "at most this many tokens per shard")
      ->check(CLI::Range(int64_t{1}, int64_t{INT32_MAX}));
  app.add_option("--name", name,
                 "file name prefix: NAME_train_000000.bin (empty: train_000000.bin)");
  app.add_option("FILE", inputs, "text files, concatenated in order")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    int code = app.exit(error);
    return code == 0 ? 0 : kExitError;
  }

  if (out_dir.empty()) return Fail("--out is empty: name the directory to write the shards to");
  // The prefix is part of a file name: a '/' or '..' would write (and sweep
  // stale shards) outside --out.
  if (name.find('/') != std::string::npos || name.find("..") != std::string::npos) {
    return Fail(
        absl::StrCat("--name \"", name, "\" is a file name prefix: it may not hold '/' or '..'"));
  }

  std::vector<uint16_t> tokens;
  for (const std::string& input : inputs) {
    absl::Status read = AppendFile(input, &tokens);
    if (!read.ok()) return Fail(std::string(read.message()));
  }
  if (tokens.empty()) return Fail("the input files are empty: nothing to tokenize");

  std::error_code error;
  std::filesystem::create_directories(out_dir, error);
  if (error) return Fail(absl::StrCat("cannot create ", out_dir, ": ", error.message()));

  size_t total = tokens.size();
  size_t val_tokens = static_cast<size_t>(static_cast<double>(total) * val_fraction);
  size_t train_tokens = total - val_tokens;
  if (train_tokens == 0) {
    return Fail(
        absl::StrCat("--val-fraction ", val_fraction, " leaves no training tokens of ", total));
  }
  std::string prefix = name.empty() ? "" : name + "_";
  auto train = WriteSplit(tokens, 0, train_tokens, static_cast<size_t>(shard_tokens), out_dir,
                          prefix, "train");
  if (!train.ok()) return Fail(std::string(train.status().message()));
  auto val = WriteSplit(tokens, train_tokens, total, static_cast<size_t>(shard_tokens), out_dir,
                        prefix, "val");
  if (!val.ok()) return Fail(std::string(val.status().message()));

  std::set<std::string> written(train->begin(), train->end());
  written.insert(val->begin(), val->end());
  for (const std::string& path : RemoveStaleShards(out_dir, prefix, written)) {
    std::printf("removed stale shard %s\n", path.c_str());
  }
  std::printf("%s (vocab 256, one per byte) from %zu file(s)\n", Count(total, "token").c_str(),
              inputs.size());
  std::printf("train: %s in %zu shard(s): %s%s\n", Count(train_tokens, "token").c_str(),
              train->size(), train->front().c_str(), train->size() > 1 ? " ..." : "");
  if (val->empty()) {
    std::printf("val: 0 tokens (no shard written)\n");
  } else {
    std::printf("val: %s in %zu shard(s): %s%s\n", Count(val_tokens, "token").c_str(), val->size(),
                val->front().c_str(), val->size() > 1 ? " ..." : "");
  }
  // A window is seq_len + 1 tokens of one shard, and seq_len is at least 1.
  const size_t largest = std::min(train_tokens, static_cast<size_t>(shard_tokens));
  if (largest < 2) {
    std::fprintf(stderr,
                 "mkdata: warning: no train shard holds more than %s: training needs shards of "
                 "at least seq_len + 1 tokens\n",
                 Count(largest, "token").c_str());
  }
  return 0;
}
