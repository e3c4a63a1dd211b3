#include "rendezvous/server/tls_mirror.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace muster::rdzv {
namespace {

absl::Status Failed(const std::string& what, int error) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(error)));
}

// Writes `contents` to a new file `path` with `mode`, its times set to
// `mtime_s` seconds.
absl::Status WriteFile(const std::string& path, const std::string& contents, mode_t mode,
                       int64_t mtime_s) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) return Failed(absl::StrCat("cannot create ", path), errno);
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t wrote = ::write(fd, contents.data() + done, contents.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) {
      const int error = errno;
      ::close(fd);
      return Failed(absl::StrCat("cannot write ", path), error);
    }
    done += static_cast<size_t>(wrote);
  }
  const struct timespec times[2] = {{mtime_s, 0}, {mtime_s, 0}};
  const int timed = ::futimens(fd, times);
  const int error = errno;
  ::close(fd);
  if (timed != 0) return Failed(absl::StrCat("cannot set the times of ", path), error);
  return absl::OkStatus();
}

}  // namespace

TlsMirror::TlsMirror(std::shared_ptr<HttpsCredentials> source, std::string dir, bool with_client_ca)
    : source_(std::move(source)), dir_(std::move(dir)), with_client_ca_(with_client_ca) {}

absl::StatusOr<std::unique_ptr<TlsMirror>> TlsMirror::Start(
    std::shared_ptr<HttpsCredentials> source, absl::Duration refresh, bool with_client_ca) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/rendezvous-tls.XXXXXX");
  std::vector<char> name(pattern.begin(), pattern.end());
  name.push_back('\0');
  if (::mkdtemp(name.data()) == nullptr) {  // mode 0700
    return Failed(
        absl::StrCat("cannot make a directory for the TLS files gRPC reads (", pattern, ")"),
        errno);
  }
  std::unique_ptr<TlsMirror> mirror(
      new TlsMirror(std::move(source), std::string(name.data()), with_client_ca));
  absl::Status written = mirror->Write(mirror->source_->Now());
  if (!written.ok()) return written;
  mirror->thread_ = std::thread([mirror = mirror.get(), refresh] { mirror->Run(refresh); });
  return mirror;
}

TlsMirror::~TlsMirror() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  std::error_code error;
  std::filesystem::remove_all(dir_, error);
}

TlsFiles TlsMirror::files() const {
  const std::string current = dir_ + "/current/";
  return {current + "cert.pem", current + "key.pem",
          with_client_ca_ ? current + "client_ca.pem" : std::string()};
}

absl::Status TlsMirror::Write(const HttpsCredentials::Accepted& set) {
  const std::string generation = absl::StrCat("set.", set.generation);
  const std::string dir = absl::StrCat(dir_, "/", generation);
  std::error_code error;
  std::filesystem::remove_all(dir, error);  // a leftover of a failed try
  if (::mkdir(dir.c_str(), 0700) != 0) return Failed(absl::StrCat("cannot make ", dir), errno);
  // A second after the set before, at least: gRPC compares whole seconds.
  last_mtime_s_ = std::max<int64_t>(absl::ToUnixSeconds(absl::Now()), last_mtime_s_ + 1);
  absl::Status status = WriteFile(dir + "/key.pem", set.key_pem, 0600, last_mtime_s_);
  if (status.ok()) status = WriteFile(dir + "/cert.pem", set.cert_pem, 0644, last_mtime_s_);
  if (status.ok() && with_client_ca_) {
    status = WriteFile(dir + "/client_ca.pem", set.client_ca_pem, 0644, last_mtime_s_);
  }
  if (!status.ok()) return status;
  const std::string link = dir_ + "/current", staged = dir_ + "/current.new";
  ::unlink(staged.c_str());
  if (::symlink(generation.c_str(), staged.c_str()) != 0) {
    return Failed(absl::StrCat("cannot link ", staged), errno);
  }
  if (::rename(staged.c_str(), link.c_str()) != 0) {
    return Failed(absl::StrCat("cannot rename ", staged, " to ", link), errno);
  }
  // The set before stays for a reader that resolved "current" just before
  // the switch; the one before it goes.
  if (set.generation >= 2) {
    std::filesystem::remove_all(absl::StrCat(dir_, "/set.", set.generation - 2), error);
  }
  written_ = set.generation;
  return absl::OkStatus();
}

void TlsMirror::Run(absl::Duration refresh) {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), refresh)) {
    mu_.Unlock();
    const HttpsCredentials::Accepted set = source_->Now();  // may read the files
    if (set.generation != written_) {
      absl::Status written = Write(set);
      if (!written.ok()) {
        spdlog::error("rendezvous: the gRPC port keeps the TLS credentials it had: {}",
                      std::string(written.message()));
      }
    }
    mu_.Lock();
  }
}

}  // namespace muster::rdzv
