#include "worker/trainer/metrics.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "kernels/matmul.h"
#include "worker/checkpoint/env.h"
#include "worker/model/ops.h"

namespace muster::worker {

std::string FormatStepLine(const StepMetrics& m) {
  std::string mfu = m.mfu > 0 ? absl::StrFormat("%.1f%%", 100.0 * m.mfu) : "n/a";
  std::string line = absl::StrFormat(
      "step %d/%d | loss %.4f | lr %.1e | norm %.2f | %.0f ms | %.0f tok/s | MFU %s", m.step,
      m.total_steps, m.loss, m.lr, m.grad_norm, m.ms, m.tokens_per_s, mfu);
  if (m.world > 1 && m.comm_wait_ms >= 0) {
    absl::StrAppendFormat(&line, " | comm wait %.0f ms", m.comm_wait_ms);
  }
  return line;
}

std::string FormatEvalLine(const EvalMetrics& m) {
  return absl::StrFormat("step %d | val loss %.4f", m.step, m.val_loss);
}

std::string StepJson(const StepMetrics& m) {
  std::string json = absl::StrFormat(
      "{\"step\":%d,\"loss\":%.9g,\"lr\":%.9g,\"grad_norm\":%.9g,\"ms\":%.9g,"
      "\"tokens_per_s\":%.9g,\"mfu\":%.9g",
      m.step, m.loss, m.lr, m.grad_norm, m.ms, m.tokens_per_s, m.mfu);
  if (m.comm_wait_ms >= 0) absl::StrAppendFormat(&json, ",\"comm_wait_ms\":%.9g", m.comm_wait_ms);
  return json + "}";
}

std::string EvalJson(const EvalMetrics& m) {
  return absl::StrFormat("{\"step\":%d,\"val_loss\":%.9g}", m.step, m.val_loss);
}

namespace {

// The N of a line's "step":N, if it has one.
std::optional<int> StepOfLine(absl::string_view line) {
  constexpr absl::string_view kKey = "\"step\":";
  size_t at = line.find(kKey);
  if (at == absl::string_view::npos) return std::nullopt;
  absl::string_view rest = line.substr(at + kKey.size());
  size_t end = rest.find_first_not_of("0123456789");
  int step = 0;
  if (!absl::SimpleAtoi(rest.substr(0, end), &step)) return std::nullopt;
  return step;
}

// Cuts `path` after its last line of a step <= `resumed_step` (see Open).
// A missing file has nothing to cut.
absl::Status TrimAfter(const std::string& path, int resumed_step, MetricsTrim* trimmed) {
  // Only a regular file has lines to keep (/dev/full reads zeros for ever).
  std::error_code regular_error;
  if (!std::filesystem::is_regular_file(path, regular_error)) return absl::OkStatus();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::OkStatus();
  // Lines are read one at a time: a long run's file need not fit in memory.
  std::string line;
  uint64_t offset = 0;
  std::optional<uint64_t> cut;
  MetricsTrim trim;
  while (std::getline(in, line)) {
    const bool torn = in.eof();  // no newline after it
    std::optional<int> step = StepOfLine(line);
    if (!cut.has_value() && (torn || (step.has_value() && *step > resumed_step))) cut = offset;
    if (cut.has_value()) {
      ++trim.lines;
      if (step.has_value()) {
        if (trim.first_step == 0) trim.first_step = *step;
        trim.last_step = *step;
      }
    }
    offset += line.size() + (torn ? 0 : 1);
  }
  in.close();
  if (!cut.has_value()) return absl::OkStatus();
  std::error_code error;
  std::filesystem::resize_file(path, *cut, error);
  if (error) {
    return absl::InvalidArgumentError(absl::StrCat("train.metrics_file: cannot cut ", path,
                                                   " back to step ", resumed_step, ": ",
                                                   error.message()));
  }
  if (trimmed != nullptr) *trimmed = trim;
  return absl::OkStatus();
}

// A file that is there and not empty must look like a metrics file (each
// line a JSON object) before it is truncated or appended to: a path that
// names another file by mistake (a shard, a config, a LOCK) loses it
// otherwise.
absl::Status CheckLooksLikeMetrics(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) return absl::OkStatus();
  std::ifstream in(path, std::ios::binary);
  char first = 0;
  if (!in.get(first)) return absl::OkStatus();  // empty (or unreadable: fopen says why)
  if (first == '{') return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("train.metrics_file: '", path,
                   "' is not a metrics file (it does not start with '{'); refusing to overwrite "
                   "it: name another file, or remove this one"));
}

absl::Status MetricsFileError(const std::string& what, const std::error_code& error) {
  const std::string message = absl::StrCat("train.metrics_file: ", what, ": ", error.message());
  if (error.value() == ENOSPC || error.value() == EDQUOT) {
    return FileSystemError(error.value(), message);
  }
  return absl::InvalidArgumentError(message);
}

// The lineage recorded beside `path` ("" if none is).
std::string RecordedLineage(const std::string& path) {
  std::ifstream in(path + ".lineage");
  std::string lineage;
  std::getline(in, lineage);
  return lineage;
}

// Records `lineage` beside `path`, replacing the record whole.
absl::Status RecordLineage(const std::string& path, const std::string& lineage) {
  const std::string record = path + ".lineage", temporary = record + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << lineage << "\n";
    out.flush();
    if (!out) {
      return MetricsFileError(absl::StrCat("cannot write ", temporary),
                              std::error_code(errno != 0 ? errno : EIO, std::generic_category()));
    }
  }
  std::error_code error;
  std::filesystem::rename(temporary, record, error);
  if (error) return MetricsFileError(absl::StrCat("cannot rename ", temporary), error);
  return absl::OkStatus();
}

// Open's handling of a file that another lineage recorded (see Open).
absl::Status SetAsideOtherRuns(const std::string& path, const std::string& lineage,
                               std::optional<int> resumed_step, MetricsTrim* trimmed) {
  const std::string owner = RecordedLineage(path);
  std::error_code error;
  if (owner.empty() || owner == lineage || !std::filesystem::is_regular_file(path, error)) {
    return absl::OkStatus();
  }
  const std::string aside = MetricsAsidePath(path, owner);
  std::filesystem::rename(path, aside, error);
  if (error) return MetricsFileError(absl::StrCat("cannot move ", path, " to ", aside), error);
  trimmed->set_aside = aside;
  trimmed->set_aside_lineage = owner;
  const std::string own = MetricsAsidePath(path, lineage);
  if (std::filesystem::exists(own, error)) {
    std::filesystem::rename(own, path, error);
    if (error) return MetricsFileError(absl::StrCat("cannot move ", own, " to ", path), error);
    trimmed->restored = own;
  } else if (resumed_step.has_value()) {
    // A fork: its history up to the step it resumed is the other run's.
    std::filesystem::copy_file(aside, path, error);
    if (error) return MetricsFileError(absl::StrCat("cannot copy ", aside, " to ", path), error);
  }
  return absl::OkStatus();
}

}  // namespace

std::string MetricsAsidePath(const std::string& path, const std::string& lineage) {
  const std::filesystem::path file(path);
  return (file.parent_path() /
          absl::StrCat(file.stem().string(), ".lineage_", lineage, file.extension().string()))
      .string();
}

absl::StatusOr<std::unique_ptr<MetricsWriter>> MetricsWriter::Open(const std::string& path,
                                                                   std::optional<int> resumed_step,
                                                                   MetricsTrim* trimmed,
                                                                   const std::string& lineage) {
  // The yaml may name a directory no one made yet (out/tiny/...).
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code made;
  if (!parent.empty()) std::filesystem::create_directories(parent, made);
  if (absl::Status checked = CheckLooksLikeMetrics(path); !checked.ok()) return checked;
  MetricsTrim unused;
  if (trimmed == nullptr) trimmed = &unused;
  if (!lineage.empty()) {  // a file's: not /dev/null's, say
    absl::Status moved = SetAsideOtherRuns(path, lineage, resumed_step, trimmed);
    if (!moved.ok()) return moved;
  }
  if (resumed_step.has_value()) {
    MetricsTrim cut;
    if (absl::Status status = TrimAfter(path, *resumed_step, &cut); !status.ok()) return status;
    trimmed->lines = cut.lines;
    trimmed->first_step = cut.first_step;
    trimmed->last_step = cut.last_step;
  }
  std::error_code regular_error;
  if (!resumed_step.has_value() && std::filesystem::is_regular_file(path, regular_error)) {
    // What a fresh start drops: said, since nothing keeps it. (Only a
    // regular file: /dev/full reads zeros for ever.)
    std::ifstream in(path, std::ios::binary);
    trimmed->dropped_lines =
        in ? static_cast<int>(std::count(std::istreambuf_iterator<char>(in),
                                         std::istreambuf_iterator<char>(), '\n'))
           : 0;
  }
  FILE* file = std::fopen(path.c_str(), resumed_step.has_value() ? "a" : "w");
  if (file == nullptr) {
    int error = errno;
    std::string message = absl::StrCat("train.metrics_file: cannot open ", path,
                                       " for writing: ", std::strerror(error));
    // The directory that could not be made (EACCES) is why: fopen would
    // only say that it is not there.
    if (error == ENOENT && made) {
      error = made.value();
      message = absl::StrCat("train.metrics_file: cannot create the directory ", parent.string(),
                             " for ", path, ": ", made.message());
    }
    // A full disk is not the config's fault; anything else (a directory
    // not writable, a path through a file) is the path's.
    if (error == ENOSPC || error == EDQUOT) return FileSystemError(error, message);
    return absl::InvalidArgumentError(message);
  }
  std::error_code kind_error;
  if (!lineage.empty() && std::filesystem::is_regular_file(path, kind_error) &&
      RecordedLineage(path) != lineage) {
    if (absl::Status recorded = RecordLineage(path, lineage); !recorded.ok()) {
      std::fclose(file);
      return recorded;
    }
  }
  return std::unique_ptr<MetricsWriter>(new MetricsWriter(file, path));
}

MetricsWriter::~MetricsWriter() { std::fclose(file_); }

absl::Status MetricsWriter::Write(const std::string& json_line) {
  errno = 0;
  if (std::fprintf(file_, "%s\n", json_line.c_str()) < 0 || std::fflush(file_) != 0) {
    // The errno of the write that failed: a full disk (RESOURCE_EXHAUSTED,
    // not restartable, IsNoSpace) or another refusal (UNAVAILABLE). What
    // reached the file of this line is torn, and a resume cuts it.
    const int error = errno;
    return FileSystemError(error, absl::StrCat("train.metrics_file: writing ", path_, " failed: ",
                                               std::strerror(error != 0 ? error : EIO)));
  }
  return absl::OkStatus();
}

void ProgressBar::Draw(int done, int first, int total, double elapsed_s) {
  if (!enabled_ || total <= 0) return;
  constexpr int kWidth = 30;
  int filled = static_cast<int>(static_cast<int64_t>(kWidth) * done / total);
  std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
  std::string eta = "?";
  if (done > first && elapsed_s > 0) {
    double remaining = elapsed_s / (done - first) * (total - done);
    int seconds = static_cast<int>(remaining + 0.5);
    eta = absl::StrFormat("%dm%02ds", seconds / 60, seconds % 60);
  }
  std::fprintf(out_, "\r\033[K[%s] %d/%d %3d%% ETA %s", bar.c_str(), done, total,
               100 * done / total, eta.c_str());
  std::fflush(out_);
  shown_ = true;
}

void ProgressBar::Clear() {
  if (!enabled_ || !shown_) return;
  std::fprintf(out_, "\r\033[K");
  std::fflush(out_);
  shown_ = false;
}

namespace {

int CpuThreads() {
  int threads = 0;
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) {
    if (!absl::SimpleAtoi(omp, &threads)) threads = 0;
  }
  cpu_set_t set;
  int cores = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = 1;
  return threads > 0 ? std::min(threads, cores) : cores;
}

// The clock this core runs at, measured: the time of a chain of dependent
// integer adds, one per cycle on every x86-64 core; the best of three
// runs of ~2 ms (a run the scheduler interrupts reads low). Why our own:
// /proc/cpuinfo's "cpu MHz" on a VM is the nominal clock while the cores
// run at their boost clock (2.10 against 3.5 GHz on the development
// machine, where MFU read 117%), and the perf counters that would say are
// often not there in a VM. 0 where it cannot be measured.
double MeasureCoreHz() {
#if defined(__x86_64__)
  constexpr uint64_t kAdds = 8'000'000;
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    uint64_t chain = 0;
    const auto start = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < kAdds; i += 8) {
      asm volatile(
          "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
          "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
          : "+r"(chain));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > 0 && chain == kAdds) best = std::max(best, kAdds / seconds);
  }
  return best;
#else
  return 0;
#endif
}

// Clock (Hz) and FLOPs per cycle per core from /proc/cpuinfo's first CPU.
void CpuCoreFigures(double* hz, int* flops_per_cycle, std::string* vector_unit) {
  *hz = 0;
  *flops_per_cycle = 8;
  *vector_unit = "SSE";
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  bool have_flags = false;
  while (std::getline(in, line)) {
    if (*hz == 0 && absl::StartsWith(line, "cpu MHz")) {
      double mhz = 0;
      auto colon = line.find(':');
      if (colon != std::string::npos && absl::SimpleAtod(line.substr(colon + 1), &mhz)) {
        *hz = mhz * 1e6;
      }
    }
    if (!have_flags && absl::StartsWith(line, "flags")) {
      have_flags = true;
      std::string flags = line + " ";
      if (absl::StrContains(flags, " avx512f ")) {
        *flops_per_cycle = 64;  // 2 FMA units x 16 fp32 lanes x 2 FLOPs
        *vector_unit = "AVX-512";
      } else if (absl::StrContains(flags, " avx2 ") && absl::StrContains(flags, " fma ")) {
        *flops_per_cycle = 32;  // 2 FMA units x 8 lanes x 2
        *vector_unit = "AVX2+FMA";
      }
    }
    if (*hz > 0 && have_flags) break;
  }
  if (*hz == 0) *hz = 2e9;  // no clock reported (some VMs): assume 2 GHz
}

}  // namespace

double PeakFlops(Device device, Precision precision, std::string* description) {
  double peak = 0;
  if (const char* env = std::getenv("MUSTER_PEAK_FLOPS")) {
    if (absl::SimpleAtod(env, &peak) && peak > 0) {
      if (description) *description = absl::StrFormat("MUSTER_PEAK_FLOPS=%.3g", peak);
      return peak;
    }
  }
  if (device == Device::kCuda) {
    absl::StatusOr<CudaDeviceInfo> info = GetCudaDeviceInfo(precision);
    if (info.ok() && info->peak_flops > 0) {
      if (description) {
        // 989 TFLOP/s, but 19.5 for an A100's fp32: three digits either way.
        const double tflops = info->peak_flops / 1e12;
        *description = absl::StrFormat("%s, %s dense peak %.*f TFLOP/s", info->name,
                                       PrecisionName(precision), tflops >= 100 ? 0 : 1, tflops);
      }
      return info->peak_flops;
    }
    if (description) {
      *description = info.ok() && !info->name.empty()
                         ? absl::StrCat("unknown for ", info->name,
                                        " (not in the table of known GPUs; set "
                                        "MUSTER_PEAK_FLOPS)")
                         : "unknown for CUDA (set MUSTER_PEAK_FLOPS)";
    }
    return 0;
  }
  double nominal_hz = 0;
  int flops_per_cycle = 0;
  std::string unit;
  CpuCoreFigures(&nominal_hz, &flops_per_cycle, &unit);
  // The higher of the two clocks: the peak is the hardware's, so MFU is
  // never flattered by a clock read low.
  const double measured_hz = MeasureCoreHz();
  const double hz = std::max(nominal_hz, measured_hz);
  int threads = CpuThreads();
  peak = threads * hz * flops_per_cycle;
  if (description) {
    const std::string clock = measured_hz > nominal_hz
                                  ? absl::StrFormat("%.2f GHz (measured; /proc/cpuinfo says %.2f)",
                                                    hz / 1e9, nominal_hz / 1e9)
                                  : absl::StrFormat("%.2f GHz", hz / 1e9);
    *description =
        absl::StrFormat("%d cores x %s x %d FLOP/cycle (%s) = %.1f GFLOP/s; GEMMs: %s", threads,
                        clock, flops_per_cycle, unit, peak / 1e9, kernels::CpuGemmDescription());
  }
  return peak;
}

}  // namespace muster::worker
