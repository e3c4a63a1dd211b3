// The activation memory part of tools/bench_pp: per pipeline rank, what
// its model parts hold under GPipe, 1F1B, interleaved 1F1B and zb_h1.
//
// GptModel::ActivationBytes() counts every slot's activations (the
// schedule's in-flight bound of them: M under GPipe, P - rank under 1F1B)
// and the backward scratch, which the slots share. To compare the slots
// alone, each rank's part is also built directly (GptModel::CreatePart)
// with 1 and with 2 slots: per slot = the difference, scratch = the rest;
// the tool checks that the trained part's ActivationBytes() is scratch +
// slots x per slot. Pipeline::peak_in_flight() is shown next to the bound.
// Not counted: the Pipeline's own message buffers (worker/strategy/pipeline/pipeline.cc,
// 4 x B x T x C floats per slot), sized by the same bound.
//
// Interleaved 1F1B runs V chunks per rank, each a model part of its own
// with its own slots and its own backward scratch, and Pipeline sizes each
// chunk's slots by the most micro-batches its list holds on that chunk at
// once (from the first receive to the gradient sent), not by the bound
// (worker::PipelineSlots, which the tool calls too).
// Pipeline::ActivationBytes() sums the chunks; the tool rebuilds each
// chunk's part as above and checks the sum against it. The rank's bound,
// parallel::InFlightBound, and Pipeline::peak_in_flight() count virtual
// micro-batches (one per chunk and micro-batch), each holding 1/V of a
// rank's blocks.
//
// zb_h1 runs one part per rank made with ModelPart::split_backward, whose
// slot is a plain part's (the output gradients Bw reads are kept in
// activations Bi is done with), and a micro-batch keeps its slot from its
// first action on the rank to its Bw. The tool builds the part both ways,
// checks that their slots and scratch are the same size, and checks
// ActivationBytes() against scratch + slots x per slot, slots as
// worker::PipelineSlots gives them for the rank's list.
#pragma once

#include "tools/pp/threads.h"
#include "worker/config/config.h"

namespace muster::tools {

void PrintMemoryHeader();

// The rows of one (P, M): a row per rank, then the rank that holds most.
// Adds to *met the ranks where 1F1B's slots are at most P/M of GPipe's,
// to *compared every rank. Returns 1 when a part cannot be built or
// ActivationBytes() is not scratch + slots x per slot, else 0.
int PrintMemoryRows(const worker::ModelConfig& model, int micro_batch, int microbatches,
                    const PipelineRun& gpipe, const PipelineRun& one_f, int* met, int* compared);

void PrintInterleavedMemoryHeader(int virtual_stages);

// The rows of one (P, M) for interleaved 1F1B with `virtual_stages`
// chunks per rank, next to GPipe's and 1F1B's runs of the same (P, M). Adds
// to *below_one_f the ranks whose interleaved slots take no more bytes
// than 1F1B's, to *compared every rank. Returns 1 when a part cannot be
// built, ActivationBytes() is not the chunks' scratch + slots x per slot,
// or peak_in_flight() exceeds the bound, else 0.
int PrintInterleavedMemoryRows(const worker::ModelConfig& model, int micro_batch, int microbatches,
                               int virtual_stages, const PipelineRun& gpipe,
                               const PipelineRun& one_f, const PipelineRun& interleaved,
                               int* below_one_f, int* compared);

void PrintZeroBubbleMemoryHeader();

// The rows of one (P, M) for zb_h1, next to GPipe's and 1F1B's runs of
// the same (P, M). Adds to *below_one_f the ranks whose zb_h1 slots take
// no more bytes than 1F1B's, to *compared every rank. Returns 1 when a part
// cannot be built, the split part's slot or scratch differs from the
// plain one's,
// ActivationBytes() is not scratch + slots x per slot, or peak_in_flight()
// exceeds the bound, else 0.
int PrintZeroBubbleMemoryRows(const worker::ModelConfig& model, int micro_batch, int microbatches,
                              const PipelineRun& gpipe, const PipelineRun& one_f,
                              const PipelineRun& zero_bubble, int* below_one_f, int* compared);

}  // namespace muster::tools
