// What the trainer reports: the human log line, the progress bar and the
// JSONL metrics file, plus the peak-FLOP/s estimate behind MFU.
//
// Thread-safety: none; the training thread owns these objects.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/model/model.h"

namespace muster::worker {

// One logged optimizer step. `step` counts completed steps (1-based).
struct StepMetrics {
  int step = 0;
  int total_steps = 0;
  float loss = 0;  // mean over the step's micro-batches
  float lr = 0;
  float grad_norm = 0;      // before clipping
  double ms = 0;            // wall time of the step
  double tokens_per_s = 0;  // every rank's tokens
  double mfu = 0;           // fraction of peak, 0 when the peak is unknown
  // Mean over ranks of the time blocked on the parallel strategy's
  // collectives in this step (ParallelStrategy::CommWaitSeconds); < 0
  // where the strategy does not measure it.
  double comm_wait_ms = -1;
  int world = 1;  // ranks: the step line shows the wait only for more than one
};

// One evaluation, after `step` completed steps.
struct EvalMetrics {
  int step = 0;
  float val_loss = 0;
};

// `step 40/300 | loss 2.4312 | lr 2.9e-04 | norm 0.83 | 212 ms |
//  4830 tok/s | MFU 3.1%` (one line, no newline).
std::string FormatStepLine(const StepMetrics& metrics);
std::string FormatEvalLine(const EvalMetrics& metrics);

// JSONL objects. Floats use %.9g, enough digits to round-trip an fp32, so
// two runs' files compare bitwise.
std::string StepJson(const StepMetrics& metrics);
std::string EvalJson(const EvalMetrics& metrics);

// What opening a run's metrics file did to what was there.
struct MetricsTrim {
  int lines = 0;       // lines dropped, a torn last line included
  int first_step = 0;  // the first and last step those lines name; 0 when
  int last_step = 0;   // none names one (a torn line)
  // Another run's file, moved here whole ("" when the file was this run's),
  // and that run's lineage.
  std::string set_aside;
  std::string set_aside_lineage;
  // This run's own file, set aside by another run earlier and moved back
  // from here ("" when there was none).
  std::string restored;
  // A run from step 0: the lines of the file it started afresh (not set
  // aside: the same run's, or one without a lineage).
  int dropped_lines = 0;
};

// Where a metrics file `path` of another run (its lineage) is kept:
// "out/metrics.jsonl" -> "out/metrics.lineage_<lineage>.jsonl".
std::string MetricsAsidePath(const std::string& path, const std::string& lineage);

// Appends one JSON object per line to a file, flushed after every line so
// a killed run keeps what it logged. An empty path writes nothing.
class MetricsWriter {
 public:
  // Without `resumed_step`, truncates the file: a run from step 0.
  //
  // With it (a run that resumed from the checkpoint of that step), keeps
  // the file's lines up to that step and cuts the rest: the lines of later
  // steps were logged by a run killed before its next checkpoint, and this
  // run logs those steps again, so each step would appear twice, the
  // second time with other timings. A last line without its newline (torn
  // by a kill) is cut too. The cut starts at the first line naming a later
  // step; lines that name none before it are kept. `trimmed` (may be null)
  // says what was cut.
  //
  // `lineage` (the run's checkpoint lineage; "" when unknown, as without
  // checkpoint.dir) is recorded in `path`.lineage. A file recorded as
  // another lineage's is another run's history (the run this one forked
  // from, or an earlier fresh start): it is moved whole to
  // MetricsAsidePath rather than cut or truncated, and this run takes back
  // its own file if one was set aside so, or else, resuming, starts from
  // a copy of the other's lines up to `resumed_step` (the history it
  // forked from). A file with no record is taken as this run's.
  //
  // Either way, an existing file that is not empty must start with '{' as a
  // metrics file does: anything else is INVALID_ARGUMENT, and left alone.
  //
  // INVALID_ARGUMENT naming the path and the OS's reason if it cannot be
  // opened or cut; RESOURCE_EXHAUSTED (IsNoSpace) if the disk is full.
  static absl::StatusOr<std::unique_ptr<MetricsWriter>> Open(
      const std::string& path, std::optional<int> resumed_step = std::nullopt,
      MetricsTrim* trimmed = nullptr, const std::string& lineage = "");
  ~MetricsWriter();
  // Appends the line and flushes it. A failure names the path and the
  // OS's reason, as worker/checkpoint/env.h's errors do: on a full disk
  // RESOURCE_EXHAUSTED with IsNoSpace() true.
  absl::Status Write(const std::string& json_line);

 private:
  explicit MetricsWriter(FILE* file, std::string path) : file_(file), path_(std::move(path)) {}
  FILE* file_;
  std::string path_;
};

// A one-line bar with ETA, redrawn in place with \r on a terminal. Draw and
// Clear do nothing when disabled (stderr piped to a file).
class ProgressBar {
 public:
  ProgressBar(FILE* out, bool enabled) : out_(out), enabled_(enabled) {}
  // `done` of `total` steps after `elapsed_s` seconds of this run's
  // `done - first` steps.
  void Draw(int done, int first, int total, double elapsed_s);
  // Erases the bar so a log line can take its place.
  void Clear();
  bool enabled() const { return enabled_; }

 private:
  FILE* out_;
  bool enabled_;
  bool shown_ = false;
};

// Peak FLOP/s of the hardware this process trains on at `precision`, the
// denominator of MFU (docs/worker.md says where the figures come from):
//   MUSTER_PEAK_FLOPS (environment, FLOP/s) overrides everything;
//   CPU: the fp32 peak (the only precision there): threads x per-core peak,
//     where threads is OMP_NUM_THREADS or the cores this process may run
//     on, and the per-core peak is clock x FLOPs per cycle from the vector
//     units /proc/cpuinfo reports (AVX-512: 2 FMA x 16 lanes x 2 = 64;
//     AVX2+FMA: 32; otherwise SSE: 8); the clock is the higher of
//     /proc/cpuinfo's and the one measured (x86-64);
//   CUDA: the dense peak for `precision` of the current GPU from the table
//     of known GPUs (GetCudaDeviceInfo, worker/model/ops.h); 0 (unknown) for a
//     GPU not in it, unless overridden.
// `description` (may be nullptr) receives how the figure was obtained.
double PeakFlops(Device device, Precision precision, std::string* description);

}  // namespace muster::worker
