// The `worker` program as a library function, so that a binary can run
// it on a file system of its choice: worker/main.cc on Env::Default(),
// //tests/worker/checkpoint:fault_worker on a wrapper that stops a checkpoint save
// at a chosen call (worker/checkpoint/env.h).
#pragma once

#include "worker/checkpoint/env.h"

namespace muster::worker {

// Blocks the preemption signals (launcher::kPreemptionSignals): one that
// comes while the worker loads, re-execs or reads its config is held, and
// answered once training handles it (a save after the first step, exit
// 75), not fatal. The mask lasts through exec. WorkerMain unblocks them
// again for every command but training.
// Async-signal-safe, and needs nothing initialised: worker/main.cc calls it
// from the executable's .preinit_array, before any static initialiser; a
// binary without that hook calls it first in main().
void HoldPreemptionSignals();

// OpenMP's idle threads spin by default. Spinning threads of two processes
// (or of a worker and its OpenBLAS threads) on shared cores slowed a step
// 3x to 100x here, so the worker waits passively unless the user chose.
// libgomp reads OMP_WAIT_POLICY when it is loaded, before main(), hence
// one re-exec of /proc/self/exe with `argv` and the variable set. Call it
// first in main(), with main's own argv; returns only when no exec was
// needed (or it failed: then threads spin).
void WaitPassivelyUnlessChosen(char** argv);

// Parses `argv` and runs the worker, all checkpoint I/O through `env`;
// returns the process's exit code: 0 success; 2 a usage, config or data
// error (the message is one line on stderr); 75
// (launcher::kPreemptedExitCode) preempted; 1 any other failure.
// REQUIRES: `env` outlives the call.
int WorkerMain(int argc, char** argv, Env* env);

}  // namespace muster::worker
