#include "worker/checkpoint/dir_lock.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "worker/checkpoint/files.h"

namespace muster::worker {
namespace {

constexpr absl::Duration kFirstPause = absl::Milliseconds(50);
constexpr absl::Duration kLongestPause = absl::Seconds(1);

// "pid 12 on host h (job j, since t)", with what is known of it.
std::string Describe(const LockHolder& holder) {
  if (holder.pid == 0 && holder.host.empty()) return "another process (it has not said which)";
  std::string text =
      absl::StrCat("pid ", holder.pid, " on host ", holder.host.empty() ? "?" : holder.host);
  std::vector<std::string> more;
  if (!holder.job.empty()) more.push_back("job " + holder.job);
  if (!holder.since.empty()) more.push_back("since " + holder.since);
  if (!more.empty()) absl::StrAppend(&text, " (", absl::StrJoin(more, ", "), ")");
  return text;
}

// Whether `holder` is a process of this host that is alive: one that will
// not let go by waiting. kill(pid, 0) tests that the pid exists (EPERM:
// it exists, owned by another user).
bool LiveHereAndNow(const LockHolder& holder, const std::string& host) {
  if (holder.pid <= 0 || holder.host.empty() || holder.host != host) return false;
  if (holder.pid == ::getpid()) return true;
  return ::kill(holder.pid, 0) == 0 || errno == EPERM;
}

absl::Status InUse(const std::string& dir, const LockHolder& holder, const std::string& waited) {
  return absl::FailedPreconditionError(
      absl::StrCat("checkpoint.dir ", dir, " is in use by another run: ", Describe(holder), waited,
                   ". Two runs saving into one directory would overwrite and delete each other's "
                   "checkpoints: stop that run, or give this one another checkpoint.dir"));
}

}  // namespace

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

std::string FormatLockHolder(const LockHolder& holder) {
  return absl::StrCat("pid: ", holder.pid, "\nhost: ", holder.host, "\njob: ", holder.job,
                      "\nsince: ", holder.since, "\ntoken: ", holder.token, "\n");
}

LockHolder ParseLockHolder(const std::string& text) {
  LockHolder holder;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::pair<absl::string_view, absl::string_view> field = absl::StrSplit(line, ": ");
    const std::string value(absl::StripAsciiWhitespace(field.second));
    if (field.first == "pid") {
      if (!absl::SimpleAtoi(value, &holder.pid) || holder.pid < 0) holder.pid = 0;
    } else if (field.first == "host") {
      holder.host = value;
    } else if (field.first == "job") {
      holder.job = value;
    } else if (field.first == "since") {
      holder.since = value;
    } else if (field.first == "token") {
      if (!absl::SimpleAtoi(value, &holder.token)) holder.token = 0;
    }
  }
  return holder;
}

uint64_t NewLockToken() {
  std::random_device device;
  uint64_t token = 0;
  while (token == 0) token = (uint64_t{device()} << 32) | device();
  return token;
}

LockHolder ThisProcess(absl::Time now, uint64_t token) {
  LockHolder me;
  me.token = token;
  me.pid = static_cast<int>(::getpid());
  me.host = HostName();
  if (const char* job = std::getenv("TORCHELASTIC_RUN_ID")) me.job = job;
  me.since = absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", now, absl::UTCTimeZone());
  return me;
}

absl::StatusOr<std::unique_ptr<FileLock>> LockCheckpointDir(
    Env* env, const std::string& dir, absl::Duration wait, const std::string& wait_name,
    uint64_t token, const std::function<void(const std::string&)>& log, const LockClock& clock) {
  const std::string path = dir + "/LOCK";
  const std::string host = HostName();
  const absl::Time start = clock.now();
  absl::Duration pause = kFirstPause;
  bool told = false;
  while (true) {
    auto lock = env->LockFile(path);
    if (lock.ok()) {
      const std::string text = FormatLockHolder(ThisProcess(clock.now(), token));
      if (absl::Status wrote = (*lock)->SetContents(text); !wrote.ok()) {
        return wrote;
      }
      if (told) {
        log(absl::StrCat(
            "took ", path, " after ",
            absl::FormatDuration(absl::Trunc(clock.now() - start, absl::Milliseconds(1)))));
      }
      return lock;
    }
    if (!absl::IsFailedPrecondition(lock.status())) return lock.status();
    // Held. Its text may be missing (a holder between its lock and its
    // write): then it is waited for like a holder elsewhere.
    auto text = ReadSmallFile(env, path);
    const LockHolder holder = ParseLockHolder(text.ok() ? *text : "");
    if (LiveHereAndNow(holder, host)) return InUse(dir, holder, "");
    const absl::Duration waited = clock.now() - start;
    if (waited >= wait) {
      return InUse(
          dir, holder,
          wait > absl::ZeroDuration()
              ? absl::StrCat("; waited ", absl::ToInt64Seconds(wait), " s for it (", wait_name, ")")
              : "");
    }
    if (!told) {
      log(absl::StrCat(path, " is held by ", Describe(holder), "; waiting up to ",
                       absl::ToInt64Seconds(wait), " s for it (", wait_name, ")"));
      told = true;
    }
    clock.sleep(std::min(pause, wait - waited));
    pause = std::min(pause * 2, kLongestPause);
  }
}

absl::Status SeesLock(Env* env, const std::string& dir, uint64_t token, int rank) {
  const std::string path = dir + "/LOCK";
  auto text = ReadSmallFile(env, path);
  const LockHolder holder = ParseLockHolder(text.ok() ? *text : "");
  if (text.ok() && holder.token == token) return absl::OkStatus();
  const std::string found =
      text.ok() ? absl::StrCat("finds another run's there, that of ", Describe(holder))
                : absl::StrCat("cannot read it (", text.status().message(), ")");
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint.dir ", dir, " is not one directory for every rank: rank 0 holds ", path,
      ", and rank ", rank, " on host ", HostName(), " ", found,
      ". Every rank writes its own file of each checkpoint there, so checkpoint.dir must be on a "
      "file system that every node mounts (NFS, Lustre, ...)"));
}

}  // namespace muster::worker
