// The activation memory part of tools/bench_pp: per pipeline rank, what
// its model part holds under GPipe and under 1F1B.
//
// GptModel::ActivationBytes() counts every slot's activations (the
// schedule's in-flight bound of them: M under GPipe, P - rank under 1F1B)
// and the backward scratch, which the slots share. To compare the slots
// alone, each rank's part is also built directly (GptModel::CreatePart)
// with 1 and with 2 slots: per slot = the difference, scratch = the rest;
// the tool checks that the trained part's ActivationBytes() is scratch +
// slots x per slot. Pipeline::peak_in_flight() is shown next to the bound.
// Not counted: the Pipeline's own message buffers (worker/pipeline.cc,
// 4 x B x T x C floats per slot), sized by the same bound.
#pragma once

#include "tools/bench_pp_threads.h"
#include "worker/config.h"

namespace muster::tools {

void PrintMemoryHeader();

// The rows of one (P, M): a row per rank, then the rank that holds most.
// Adds to *met the ranks where 1F1B's slots are at most P/M of GPipe's,
// to *compared every rank. Returns 1 when a part cannot be built or
// ActivationBytes() is not scratch + slots x per slot, else 0.
int PrintMemoryRows(const worker::ModelConfig& model, int micro_batch, int microbatches,
                    const PipelineRun& gpipe, const PipelineRun& one_f, int* met, int* compared);

}  // namespace muster::tools
