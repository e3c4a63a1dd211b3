// `worker`: the program (worker/worker_main.h) on the POSIX file system.
#include "worker/checkpoint/env.h"
#include "worker/worker_main.h"

int main(int argc, char** argv) {
  muster::worker::HoldPreemptionSignals();
  muster::worker::WaitPassivelyUnlessChosen(argv);
  return muster::worker::WorkerMain(argc, argv, muster::worker::Env::Default());
}
