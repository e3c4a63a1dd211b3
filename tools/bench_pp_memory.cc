#include "tools/bench_pp_memory.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/pipeline_schedule.h"
#include "worker/model/model.h"

namespace muster::tools {
namespace {

using parallel::ScheduleKind;

double Mb(double bytes) { return bytes / 1048576.0; }

// One model part's activation memory as a line: bytes = scratch + slots x per_slot.
struct PartBytes {
  size_t per_slot = 0, scratch = 0;
};

absl::StatusOr<PartBytes> MeasurePart(const worker::ModelConfig& config, int micro_batch,
                                      int first_block, int end_block) {
  size_t bytes[2] = {0, 0};
  for (int slots : {1, 2}) {
    auto part = worker::GptModel::CreatePart(config, micro_batch, worker::Device::kCpu,
                                             {first_block, end_block, slots});
    if (!part.ok()) return part.status();
    bytes[slots - 1] = (*part)->ActivationBytes();
  }
  return PartBytes{bytes[1] - bytes[0], 2 * bytes[0] - bytes[1]};
}

}  // namespace

void PrintMemoryHeader() {
  std::printf(
      "\nactivation memory per rank: ActivationBytes() = scratch + slots x per-slot (per-slot "
      "and scratch from\nparts built with 1 and 2 slots); slots = the schedule's in-flight bound; "
      "peak = peak_in_flight()\n");
  const char* format =
      "  %2s %3s %4s %6s %9s %10s | %-5s %5s %4s %9s %9s | %-5s %5s %4s %9s %9s | %7s %6s\n";
  std::printf(format, "P", "M", "rank", "blocks", "slot MB", "scratch MB", "GPipe", "slots", "peak",
              "slots MB", "total MB", "1F1B", "slots", "peak", "slots MB", "total MB", "slots",
              "P/M");
  std::printf(format, "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "1F1B/GP",
              "");
}

int PrintMemoryRows(const worker::ModelConfig& model, int micro_batch, int microbatches,
                    const PipelineRun& gpipe, const PipelineRun& one_f, int* met, int* compared) {
  const int P = static_cast<int>(gpipe.split.size()), M = microbatches;
  const PipelineRun* runs[2] = {&gpipe, &one_f};
  const ScheduleKind kinds[2] = {ScheduleKind::kGpipe, ScheduleKind::k1F1B};
  int status = 0;
  int first_block = 0;
  double most_slots[2] = {0, 0}, most_total[2] = {0, 0};  // over ranks; GPipe, 1F1B
  for (int rank = 0; rank < P; ++rank) {
    const int blocks = gpipe.split[rank];
    auto part = MeasurePart(model, micro_batch, first_block, first_block + blocks);
    first_block += blocks;
    if (!part.ok()) {
      std::printf("  part: %s\n", part.status().ToString().c_str());
      return 1;
    }
    size_t slot_bytes[2];
    std::string cells[2];
    for (int i = 0; i < 2; ++i) {
      const int slots = parallel::InFlightBound({kinds[i], P, M, 1}, rank);
      slot_bytes[i] = slots * part->per_slot;
      const size_t counted = runs[i]->activation_bytes[rank];
      if (counted != part->scratch + slot_bytes[i]) {
        std::printf("  P %d M %d rank %d %s: ActivationBytes %zu, not scratch + %d slots = %zu\n",
                    P, M, rank, parallel::ScheduleName(kinds[i]), counted, slots,
                    part->scratch + slot_bytes[i]);
        status = 1;
      }
      char text[96];
      std::snprintf(text, sizeof(text), "%-5s %5d %4d %9.1f %9.1f", "", slots,
                    runs[i]->peak_in_flight[rank], Mb(slot_bytes[i]), Mb(counted));
      cells[i] = text;
      most_slots[i] = std::max(most_slots[i], static_cast<double>(slot_bytes[i]));
      most_total[i] = std::max(most_total[i], static_cast<double>(counted));
    }
    const double ratio = static_cast<double>(slot_bytes[1]) / slot_bytes[0];
    ++*compared;
    *met += ratio <= static_cast<double>(P) / M + 1e-12;
    std::printf("  %2d %3d %4d %6d %9.2f %10.2f | %s | %s | %7.3f %6.3f\n", P, M, rank, blocks,
                Mb(part->per_slot), Mb(part->scratch), cells[0].c_str(), cells[1].c_str(), ratio,
                static_cast<double>(P) / M);
  }
  std::printf(
      "  %2d %3d  the rank that holds most: slots %.1f / %.1f MB = %.3f, with the scratch "
      "%.1f / %.1f MB = %.3f (1F1B / GPipe)\n",
      P, M, Mb(most_slots[1]), Mb(most_slots[0]), most_slots[1] / most_slots[0], Mb(most_total[1]),
      Mb(most_total[0]), most_total[1] / most_total[0]);
  return status;
}

}  // namespace muster::tools
