#include "tools/pp/memory.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/pipeline_schedule.h"
#include "worker/model/model.h"
#include "worker/strategy/pipeline/pipeline.h"

namespace muster::tools {
namespace {

using parallel::ScheduleKind;

double Mb(double bytes) { return bytes / 1048576.0; }

// One model part's activation memory as a line: bytes = scratch + slots x per_slot.
struct PartBytes {
  size_t per_slot = 0, scratch = 0;
};

// `split_backward`: the part as zb_h1's Pipeline makes it, whose slots
// also keep what PartBackwardInput leaves for PartBackwardWeight.
absl::StatusOr<PartBytes> MeasurePart(const worker::ModelConfig& config, int micro_batch,
                                      int first_block, int end_block, bool split_backward = false) {
  size_t bytes[2] = {0, 0};
  for (int slots : {1, 2}) {
    auto part = worker::GptModel::CreatePart(config, micro_batch, worker::Device::kCpu,
                                             {first_block, end_block, slots, split_backward});
    if (!part.ok()) return part.status();
    bytes[slots - 1] = (*part)->ActivationBytes();
  }
  return PartBytes{bytes[1] - bytes[0], 2 * bytes[0] - bytes[1]};
}

// The first block of pipeline stage `stage` under `split`.
int FirstBlock(const std::vector<int>& split, int stage) {
  int first = 0;
  for (int s = 0; s < stage; ++s) first += split[s];
  return first;
}

// The slot bytes of rank `rank` of a one-chunk run (GPipe, 1F1B): its
// in-flight bound times its part's per-slot bytes.
absl::StatusOr<size_t> OneChunkSlotBytes(const worker::ModelConfig& model, int micro_batch,
                                         const PipelineRun& run, ScheduleKind kind, int M,
                                         int rank) {
  const int P = static_cast<int>(run.split.size());
  const int first = FirstBlock(run.split, rank);
  auto part = MeasurePart(model, micro_batch, first, first + run.split[rank]);
  if (!part.ok()) return part.status();
  return parallel::InFlightBound({kind, P, M, 1}, rank) * part->per_slot;
}

// {slot bytes, with the scratch} of one rank: the schedule measured, 1F1B,
// GPipe.
using Cells = std::array<std::array<double, 2>, 3>;

// A schedule's activation memory rank by rank next to 1F1B's and GPipe's
// at the same (P, M), and the most any rank holds of each.
struct AgainstOneChunk {
  int* below_one_f;  // ranks whose slots are at most 1F1B's
  int* compared;     // ranks compared
  double most_slots[3] = {0, 0, 0}, most_total[3] = {0, 0, 0};

  // Rank `rank`'s cells, the schedule's being `slot_bytes` and `counted`;
  // counts the rank.
  absl::StatusOr<Cells> Add(const worker::ModelConfig& model, int micro_batch,
                            const PipelineRun& gpipe, const PipelineRun& one_f, int M, int rank,
                            size_t slot_bytes, size_t counted) {
    auto one_f_slots = OneChunkSlotBytes(model, micro_batch, one_f, ScheduleKind::k1F1B, M, rank);
    if (!one_f_slots.ok()) return one_f_slots.status();
    auto gpipe_slots = OneChunkSlotBytes(model, micro_batch, gpipe, ScheduleKind::kGpipe, M, rank);
    if (!gpipe_slots.ok()) return gpipe_slots.status();
    const Cells cells = {{
        {static_cast<double>(slot_bytes), static_cast<double>(counted)},
        {static_cast<double>(*one_f_slots), static_cast<double>(one_f.activation_bytes[rank])},
        {static_cast<double>(*gpipe_slots), static_cast<double>(gpipe.activation_bytes[rank])},
    }};
    for (int i = 0; i < 3; ++i) {
      most_slots[i] = std::max(most_slots[i], cells[i][0]);
      most_total[i] = std::max(most_total[i], cells[i][1]);
    }
    ++*compared;
    *below_one_f += cells[0][0] <= cells[1][0];
    return cells;
  }

  void PrintMost(int P, int M) const {
    std::printf(
        "  %2d %3d  the rank that holds most: slots %.1f MB = %.3f of 1F1B's, %.3f of GPipe's; "
        "with the scratch %.1f MB = %.3f, %.3f\n",
        P, M, Mb(most_slots[0]), most_slots[0] / most_slots[1], most_slots[0] / most_slots[2],
        Mb(most_total[0]), most_total[0] / most_total[1], most_total[0] / most_total[2]);
  }
};

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

void PrintInterleavedMemoryHeader(int virtual_stages) {
  std::printf(
      "\ninterleaved_1f1b (V=%d) activation memory per rank: each chunk a part of its own, "
      "with its own scratch;\nslots per chunk as the Pipeline sizes them (the most micro-batches "
      "the chunk's list holds at once);\nbound = InFlightBound and peak = peak_in_flight(), in "
      "virtual micro-batches (one per chunk and\nmicro-batch); MB: slots / with the scratch; "
      "1F1B and GPipe: the same (P, M) of the table above\n",
      virtual_stages);
  const char* format = "  %2s %3s %4s %-8s %-8s %5s %4s %9s %10s %9s | %10s %9s | %11s %9s | %s\n";
  std::printf(format, "P", "M", "rank", "blocks", "slots", "bound", "peak", "slots MB",
              "scratch MB", "total MB", "1F1B slots", "total", "GPipe slots", "total",
              "slots: /1F1B /GPipe");
}

int PrintInterleavedMemoryRows(const worker::ModelConfig& model, int micro_batch, int microbatches,
                               int virtual_stages, const PipelineRun& gpipe,
                               const PipelineRun& one_f, const PipelineRun& interleaved,
                               int* below_one_f, int* compared) {
  const int P = static_cast<int>(gpipe.split.size()), M = microbatches, V = virtual_stages;
  const parallel::ScheduleSpec spec{ScheduleKind::kInterleaved1F1B, P, M, V};
  auto lists = parallel::BuildSchedule(spec);
  if (!lists.ok()) {
    std::printf("  P %d M %d interleaved: %s\n", P, M, lists.status().ToString().c_str());
    return 1;
  }
  int status = 0;
  AgainstOneChunk against{below_one_f, compared};
  for (int rank = 0; rank < P; ++rank) {
    const std::vector<int> slots = worker::PipelineSlots((*lists)[rank], P, V);
    std::string blocks_text, slots_text;
    size_t slot_bytes = 0, scratch = 0;
    int slots_sum = 0;
    for (int c = 0; c < V; ++c) {
      const int stage = c * P + rank;
      const int first = FirstBlock(interleaved.split, stage);
      auto part = MeasurePart(model, micro_batch, first, first + interleaved.split[stage]);
      if (!part.ok()) {
        std::printf("  part: %s\n", part.status().ToString().c_str());
        return 1;
      }
      slot_bytes += slots[c] * part->per_slot;
      scratch += part->scratch;
      slots_sum += slots[c];
      blocks_text += (c == 0 ? "" : "+") + std::to_string(interleaved.split[stage]);
      slots_text += (c == 0 ? "" : "+") + std::to_string(slots[c]);
    }
    const int bound = parallel::InFlightBound(spec, rank);
    const size_t counted = interleaved.activation_bytes[rank];
    if (counted != scratch + slot_bytes) {
      std::printf(
          "  P %d M %d rank %d interleaved: ActivationBytes %zu, not the chunks' scratch + slots "
          "= %zu\n",
          P, M, rank, counted, scratch + slot_bytes);
      status = 1;
    }
    if (interleaved.peak_in_flight[rank] > bound) {
      std::printf("  P %d M %d rank %d interleaved: peak in flight %d above the bound %d\n", P, M,
                  rank, interleaved.peak_in_flight[rank], bound);
      status = 1;
    }
    auto compared_cells =
        against.Add(model, micro_batch, gpipe, one_f, M, rank, slot_bytes, counted);
    if (!compared_cells.ok()) {
      std::printf("  part: %s\n", compared_cells.status().ToString().c_str());
      return 1;
    }
    const Cells& cells = *compared_cells;
    std::printf(
        "  %2d %3d %4d %-8s %-8s %5d %4d %9.1f %10.1f %9.1f | %10.1f %9.1f | %11.1f %9.1f | "
        "%5.3f %6.3f\n",
        P, M, rank, blocks_text.c_str(), (slots_text + "=" + std::to_string(slots_sum)).c_str(),
        bound, interleaved.peak_in_flight[rank], Mb(slot_bytes), Mb(scratch), Mb(counted),
        Mb(cells[1][0]), Mb(cells[1][1]), Mb(cells[2][0]), Mb(cells[2][1]),
        cells[0][0] / cells[1][0], cells[0][0] / cells[2][0]);
  }
  against.PrintMost(P, M);
  return status;
}

void PrintZeroBubbleMemoryHeader() {
  std::printf(
      "\nzb_h1 activation memory per rank: parts made with split_backward (the output "
      "gradients Bw reads kept in\nactivations Bi is done with: a slot is a 1F1B slot); slots "
      "as the Pipeline sizes them (worker::PipelineSlots:\nfrom a micro-batch's first action on "
      "the rank to its Bw); bound = InFlightBound, peak = peak_in_flight();\n1F1B and GPipe: "
      "the same (P, M) of the first table\n");
  const char* format =
      "  %2s %3s %4s %6s %8s %10s %5s %5s %4s %9s %9s | %10s %9s | %11s %9s | %s\n";
  std::printf(format, "P", "M", "rank", "blocks", "slot MB", "scratch MB", "slots", "bound", "peak",
              "slots MB", "total MB", "1F1B slots", "total", "GPipe slots", "total",
              "slots: /1F1B /GPipe; total: /1F1B");
}

int PrintZeroBubbleMemoryRows(const worker::ModelConfig& model, int micro_batch, int microbatches,
                              const PipelineRun& gpipe, const PipelineRun& one_f,
                              const PipelineRun& zero_bubble, int* below_one_f, int* compared) {
  const int P = static_cast<int>(zero_bubble.split.size()), M = microbatches;
  const parallel::ScheduleSpec spec{ScheduleKind::kZeroBubbleH1, P, M, 1};
  auto lists = parallel::BuildSchedule(spec);
  if (!lists.ok()) {
    std::printf("  P %d M %d zb_h1: %s\n", P, M, lists.status().ToString().c_str());
    return 1;
  }
  int status = 0;
  AgainstOneChunk against{below_one_f, compared};
  for (int rank = 0; rank < P; ++rank) {
    const int first = FirstBlock(zero_bubble.split, rank);
    const int blocks = zero_bubble.split[rank];
    auto split = MeasurePart(model, micro_batch, first, first + blocks, /*split_backward=*/true);
    auto whole = MeasurePart(model, micro_batch, first, first + blocks);
    if (!split.ok() || !whole.ok()) {
      std::printf("  part: %s\n",
                  (split.ok() ? whole.status() : split.status()).ToString().c_str());
      return 1;
    }
    // split_backward costs nothing per slot: the output gradients Bw reads
    // are kept in activations Bi is done with (worker/model/model.h).
    if (split->per_slot != whole->per_slot || split->scratch != whole->scratch) {
      std::printf(
          "  P %d M %d rank %d zb_h1: split part's slot %zu bytes, scratch %zu; the plain "
          "part's %zu and %zu\n",
          P, M, rank, split->per_slot, split->scratch, whole->per_slot, whole->scratch);
      status = 1;
    }
    const int slots = worker::PipelineSlots((*lists)[rank], P, 1)[0];
    const int bound = parallel::InFlightBound(spec, rank);
    const size_t slot_bytes = slots * split->per_slot;
    const size_t counted = zero_bubble.activation_bytes[rank];
    if (counted != split->scratch + slot_bytes) {
      std::printf("  P %d M %d rank %d zb_h1: ActivationBytes %zu, not scratch + %d slots = %zu\n",
                  P, M, rank, counted, slots, split->scratch + slot_bytes);
      status = 1;
    }
    if (zero_bubble.peak_in_flight[rank] > bound) {
      std::printf("  P %d M %d rank %d zb_h1: peak in flight %d above the bound %d\n", P, M, rank,
                  zero_bubble.peak_in_flight[rank], bound);
      status = 1;
    }
    auto compared_cells =
        against.Add(model, micro_batch, gpipe, one_f, M, rank, slot_bytes, counted);
    if (!compared_cells.ok()) {
      std::printf("  part: %s\n", compared_cells.status().ToString().c_str());
      return 1;
    }
    const Cells& cells = *compared_cells;
    std::printf(
        "  %2d %3d %4d %6d %8.2f %10.2f %5d %5d %4d %9.1f %9.1f | %10.1f %9.1f | %11.1f "
        "%9.1f | %5.3f %6.3f; %5.3f\n",
        P, M, rank, blocks, Mb(split->per_slot), Mb(split->scratch), slots, bound,
        zero_bubble.peak_in_flight[rank], Mb(slot_bytes), Mb(counted), Mb(cells[1][0]),
        Mb(cells[1][1]), Mb(cells[2][0]), Mb(cells[2][1]), cells[0][0] / cells[1][0],
        cells[0][0] / cells[2][0], cells[0][1] / cells[1][1]);
  }
  against.PrintMost(P, M);
  return status;
}

}  // namespace muster::tools
