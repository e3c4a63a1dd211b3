// The elastic agent: one per node. It joins the job's rendezvous, starts
// this node's workers for each round, and restarts them when the round
// ends, until the job succeeds or fails.
//
//   join ─► round R RUNNING ─► spawn workers ─► watch ─┬─► all exit 0 ─► report done
//     ▲                                                │     ─► job SUCCEEDED: exit 0
//     │                                                ├─► a worker fails ─► report,
//     │                                                │     stop workers
//     │                                                ├─► round R ended elsewhere ─►
//     │                                                │     stop workers
//     │                                                └─► nodes waiting, room left ─►
//     │                                                      stop workers
//     └──────────────────── rejoin ◄──────────────────────────────────┘
//   signal ─► forward it to the workers, stop them, leave, exit 128+signal
//   SIGTERM/SIGUSR1 (preemption) ─► forward, wait --preempt_grace; if every
//       worker exited kPreemptedExitCode (or 0): "preempted", leave, exit 75;
//       if every one exited 0 (they finished): report done, leave, exit 0
//   a worker exits kPreemptedExitCode on its own ─► the same, as for SIGTERM
//   job FAILED (restart budget spent, or a failure no restart can mend: the
//       worker's error file says "restartable": "false") ─► exit with the
//       failed worker's code
//
// A handled signal ends every wait, not only the one on the workers:
// gathering, the MASTER_PORT wait, the wait for the job to close,
// connecting. The agent then leaves the rendezvous (the server sees the
// node go at once, not at lease expiry) and exits (see signal_watch.h).
// No worker runs in those waits, so nothing is left unsaved: a preemption
// signal exits 75, so that the job is requeued as when workers saved their
// state, and another signal 128+signal. In the wait for the job to close
// this node's workers have succeeded: a preemption signal exits 0 then (or
// the job's own code if it closed), since a 75 would requeue a job that may
// have succeeded, and a scheduler that takes the highest exit code of the
// nodes (srun) still sees the 75 of a node whose workers were preempted.
//
// The agent's main thread spawns every worker (see process.h on
// PR_SET_PDEATHSIG) and waits on pidfds, the signal watch's eventfd and an
// eventfd the job watcher pokes, so nothing polls on a timer except as a
// backstop.
#pragma once

#include <map>
#include <string>

#include "launcher/options.h"

namespace muster::launcher {

// Runs the agent to the end and returns the process exit code:
//   0        the job succeeded
//   N        the failed worker's exit code (128+signal if killed), of the
//            newest failure: the one that spent the budget or that no
//            restart can mend
//   75       preempted: kPreemptedExitCode (worker_env.h); the workers saved
//            their state, or none ran when SIGTERM (SIGUSR1) came
//   128+S    the agent got signal S (one of options.signals_to_handle), and
//            for a preemption signal, not every worker saved its state
//   1        the job was closed by an administrator, failed without a
//            worker's code (a lost node, a join timeout), a server limit
//            refused the first join, or another agent error
//   2        bad options, or the rendezvous service could not be reached
//            or refused us (docs/launch.md, "Exit codes")
// `signal_fd` is a non-blocking signalfd for options.signals_to_handle,
// which the caller has blocked in every thread.
int RunAgent(const LaunchOptions& options, const std::map<std::string, std::string>& env,
             int signal_fd);

}  // namespace muster::launcher
