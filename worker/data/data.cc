#include "worker/data/data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

// The shard format is little-endian; tokens are served straight from the
// mapping, so only little-endian hosts are supported.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token shards are little-endian");

namespace muster::worker {
namespace {

absl::Status OpenError(const std::string& path, const char* what, int error) {
  std::string message = absl::StrCat(path, ": cannot ", what, ": ", std::strerror(error));
  if (error == ENOENT) return absl::NotFoundError(message);
  if (error == EACCES) return absl::PermissionDeniedError(message);
  // EIO, ESTALE (NFS), ENOMEM, ...: the file system's trouble, which may
  // pass, not a wrong input (INVALID_ARGUMENT fails a job for good).
  return absl::UnavailableError(message);
}

int32_t HeaderWord(const unsigned char* header, int index) {
  const unsigned char* p = header + 4 * index;
  uint32_t value =
      uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
  return static_cast<int32_t>(value);
}

void PutLittleEndian32(int32_t value, unsigned char* out) {
  uint32_t bits = static_cast<uint32_t>(value);
  for (int i = 0; i < 4; ++i) out[i] = static_cast<unsigned char>(bits >> (8 * i));
}

// Writes all of `bytes`, retrying short writes and EINTR.
bool WriteAll(int fd, const void* bytes, size_t count) {
  const char* p = static_cast<const char*>(bytes);
  while (count > 0) {
    ssize_t wrote = ::write(fd, p, count);
    if (wrote < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += wrote;
    count -= static_cast<size_t>(wrote);
  }
  return true;
}

// A pseudo-random permutation of [0, size) per epoch, computed per element
// without storing it: a balanced Feistel network over the smallest even
// power of two >= size, with cycle walking (re-encrypt until the value lands
// in range; a bijection restricted this way stays a bijection). Round keys
// come from splitmix64 of (seed, epoch), written out here rather than taken
// from <random>, whose distributions differ between standard libraries.
class WindowPermutation {
 public:
  WindowPermutation() = default;
  WindowPermutation(uint64_t size, uint64_t seed) : size_(size), seed_(seed) {
    half_bits_ = 1;
    while (half_bits_ < 32 && (uint64_t{1} << (2 * half_bits_)) < size) ++half_bits_;
    half_mask_ = half_bits_ == 32 ? 0xffffffffu : (uint64_t{1} << half_bits_) - 1;
  }

  // REQUIRES: position < size.
  uint64_t Apply(uint64_t position, uint64_t epoch) const {
    uint64_t keys[kRounds];
    uint64_t epoch_key = Mix(seed_ ^ Mix(epoch ^ 0x6a09e667f3bcc909ull));
    for (int round = 0; round < kRounds; ++round) {
      keys[round] = Mix(epoch_key + static_cast<uint64_t>(round) * 0x9e3779b97f4a7c15ull);
    }
    // The domain is < 4 * size, so this loops under 4 times on average.
    uint64_t value = position;
    do {
      value = Encrypt(value, keys);
    } while (value >= size_);
    return value;
  }

  // splitmix64's output function: a well-mixed 64-bit bijection.
  static uint64_t Mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  static constexpr int kRounds = 6;

  uint64_t Encrypt(uint64_t value, const uint64_t* keys) const {
    uint64_t left = value >> half_bits_;
    uint64_t right = value & half_mask_;
    for (int round = 0; round < kRounds; ++round) {
      uint64_t next_right = left ^ (Mix(right ^ keys[round]) & half_mask_);
      left = right;
      right = next_right;
    }
    return (left << half_bits_) | right;
  }

  uint64_t size_ = 1;
  uint64_t seed_ = 0;
  int half_bits_ = 1;
  uint64_t half_mask_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TokenShard>> TokenShard::Open(const std::string& path, int vocab) {
  if (vocab <= 0 || vocab > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": vocab ", vocab, " is outside [1, 65536]"));
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return OpenError(path, "open", errno);
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    int error = errno;
    ::close(fd);
    return OpenError(path, "stat", error);
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  size_t file_bytes = static_cast<size_t>(info.st_size);
  if (file_bytes < kShardHeaderBytes) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", file_bytes, " bytes is too small for the ", kShardHeaderBytes,
                     "-byte header (not an llm.c token shard?)"));
  }
  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  int map_error = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (mapping == MAP_FAILED) return OpenError(path, "mmap", map_error);

  // From here on the shard owns the mapping, so early returns unmap it.
  std::unique_ptr<TokenShard> shard(new TokenShard());
  shard->path_ = path;
  shard->mapping_ = mapping;
  shard->mapping_bytes_ = file_bytes;

  const auto* header = static_cast<const unsigned char*>(mapping);
  int32_t magic = HeaderWord(header, 0);
  if (magic != kShardMagic) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": wrong magic ", magic, ", expected ",
                                                   kShardMagic, " (not an llm.c token shard?)"));
  }
  int32_t version = HeaderWord(header, 1);
  if (version != kShardVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unsupported version ", version, ", expected ", kShardVersion));
  }
  int32_t token_count = HeaderWord(header, 2);
  if (token_count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": negative token count ", token_count, " in the header"));
  }
  uint64_t expected_bytes = kShardHeaderBytes + 2 * static_cast<uint64_t>(token_count);
  if (file_bytes != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file is ", file_bytes, " bytes but the header's ", token_count,
                     " tokens need ", expected_bytes, " (truncated or corrupt?)"));
  }
  const auto* tokens = reinterpret_cast<const uint16_t*>(header + kShardHeaderBytes);
  // One pass now, so a bad token is reported at open time, not as an
  // out-of-range embedding lookup hours into training.
  for (size_t i = 0; i < static_cast<size_t>(token_count); ++i) {
    if (tokens[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": token ", i, " is ", tokens[i],
                                                     ", not below the vocab size ", vocab));
    }
  }
  shard->tokens_ = tokens;
  shard->size_ = static_cast<size_t>(token_count);
  return shard;
}

TokenShard::~TokenShard() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

absl::Status WriteTokenShard(const std::string& path, const std::vector<uint16_t>& tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", tokens.size(), " tokens do not fit the header's int32 count"));
  }
  unsigned char header[kShardHeaderBytes] = {};
  PutLittleEndian32(kShardMagic, header);
  PutLittleEndian32(kShardVersion, header + 4);
  PutLittleEndian32(static_cast<int32_t>(tokens.size()), header + 8);

  // Temp file in the same directory, then rename: readers never see a
  // half-written shard, and a crash leaves the old one (if any) intact.
  std::string temp_path = path + ".tmp.XXXXXX";
  int fd = ::mkstemp(temp_path.data());
  if (fd < 0) return OpenError(temp_path, "create", errno);
  auto fail = [&](const char* what) {
    int error = errno;
    ::close(fd);
    ::unlink(temp_path.c_str());
    return OpenError(temp_path, what, error);
  };
  if (::fchmod(fd, 0644) != 0) return fail("chmod");
  if (!WriteAll(fd, header, sizeof(header))) return fail("write");
  // uint16 in host order is little-endian (static_assert above).
  if (!WriteAll(fd, tokens.data(), tokens.size() * sizeof(uint16_t))) return fail("write");
  if (::fsync(fd) != 0) return fail("fsync");
  if (::close(fd) != 0) {
    int error = errno;
    ::unlink(temp_path.c_str());
    return OpenError(temp_path, "close", error);
  }
  if (::rename(temp_path.c_str(), path.c_str()) != 0) {
    int error = errno;
    ::unlink(temp_path.c_str());
    return OpenError(path, "rename into place", error);
  }
  return absl::OkStatus();
}

struct TokenStream::Impl {
  std::vector<std::string> files;
  std::vector<std::unique_ptr<TokenShard>> shards;  // only shards with >= 1 window
  std::vector<uint64_t> first_window;               // per shard, cumulative
  WindowPermutation permutation;
};

absl::StatusOr<std::unique_ptr<TokenStream>> TokenStream::Open(const std::string& pattern,
                                                               int seq_len, int vocab,
                                                               uint64_t seed) {
  if (seq_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len ", seq_len, " must be positive"));
  }
  glob_t matches;
  int glob_result = ::glob(pattern.c_str(), 0, nullptr, &matches);
  if (glob_result == GLOB_NOMATCH) {
    ::globfree(&matches);
    return absl::NotFoundError(absl::StrCat("no token shards match '", pattern, "'"));
  }
  if (glob_result != 0) {
    ::globfree(&matches);
    return absl::InvalidArgumentError(
        absl::StrCat("cannot expand '", pattern, "' (glob error ", glob_result, ")"));
  }
  std::vector<std::string> files(matches.gl_pathv, matches.gl_pathv + matches.gl_pathc);
  ::globfree(&matches);
  // glob(3) sorts by the locale's collation; byte order is the same everywhere.
  std::sort(files.begin(), files.end());

  auto impl = std::make_shared<Impl>();
  impl->files = files;
  uint64_t windows = 0;
  size_t largest = 0;
  for (const std::string& file : files) {
    absl::StatusOr<std::unique_ptr<TokenShard>> shard = TokenShard::Open(file, vocab);
    if (!shard.ok()) return shard.status();
    size_t tokens = (*shard)->size();
    largest = std::max(largest, tokens);
    // Windows of T+1 tokens at stride T: the last target of one window is
    // the first input of the next, so every token but the first is a target once.
    uint64_t shard_windows = tokens == 0 ? 0 : (tokens - 1) / static_cast<uint64_t>(seq_len);
    if (shard_windows == 0) continue;
    impl->first_window.push_back(windows);
    impl->shards.push_back(*std::move(shard));
    windows += shard_windows;
  }
  if (windows == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", pattern,
        "': no shard holds a window of seq_len + 1 = ", static_cast<int64_t>(seq_len) + 1,
        " tokens (largest of ", files.size(), " holds ", largest, ")"));
  }
  impl->permutation = WindowPermutation(windows, seed);

  std::unique_ptr<TokenStream> stream(new TokenStream());
  stream->impl_ = std::move(impl);
  stream->seq_len_ = seq_len;
  stream->windows_ = windows;
  return stream;
}

const std::vector<std::string>& TokenStream::files() const { return impl_->files; }

void TokenStream::Sample(uint64_t index, int* inputs, int* targets) const {
  uint64_t epoch = index / windows_;
  uint64_t window = impl_->permutation.Apply(index % windows_, epoch);
  // The shard whose first window is the last one <= window.
  auto next = std::upper_bound(impl_->first_window.begin(), impl_->first_window.end(), window);
  size_t shard_index = static_cast<size_t>(next - impl_->first_window.begin()) - 1;
  const TokenShard& shard = *impl_->shards[shard_index];
  uint64_t offset = (window - impl_->first_window[shard_index]) * static_cast<uint64_t>(seq_len_);
  const uint16_t* tokens = shard.tokens() + offset;  // (T+1,)
  for (int t = 0; t < seq_len_; ++t) {
    inputs[t] = tokens[t];
    targets[t] = tokens[t + 1];
  }
}

void TokenStream::Batch(uint64_t first, int count, int* inputs, int* targets) const {
  for (int b = 0; b < count; ++b) {
    size_t row = static_cast<size_t>(b) * static_cast<size_t>(seq_len_);
    Sample(first + static_cast<uint64_t>(b), inputs + row, targets + row);
  }
}

}  // namespace muster::worker
