// `worker`: the program (worker/worker_main.h) on the POSIX file system.
#include "worker/checkpoint/env.h"
#include "worker/worker_main.h"

namespace {

// The preemption signals are held from before any initialiser runs: the
// dynamic loader calls the executable's .preinit_array once it has mapped
// and relocated the shared libraries, before the libraries' static
// initialisers and the program's own (over 100 ms here, in which a SIGTERM
// was fatal when main() blocked them). Only the loader's own work comes
// first. The hook lives in the binary's own source, so it is always linked.
void HoldPreemptionSignalsAtLoad(int, char**, char**) { muster::worker::HoldPreemptionSignals(); }

__attribute__((section(".preinit_array"), used)) void (*const kHoldPreemptionSignalsAtLoad)(
    int, char**, char**) = HoldPreemptionSignalsAtLoad;

}  // namespace

int main(int argc, char** argv) {
  muster::worker::WaitPassivelyUnlessChosen(argv);
  return muster::worker::WorkerMain(argc, argv, muster::worker::Env::Default());
}
