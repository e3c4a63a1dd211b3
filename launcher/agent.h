// The elastic agent: one per node. It joins the job's rendezvous, starts
// this node's workers for each round, and restarts them when the round
// ends, until the job succeeds or fails.
//
//   join ─► round R RUNNING ─► spawn workers ─► watch ─┬─► all exit 0 ─► report done ─► job SUCCEEDED: exit 0
//     ▲                                                ├─► a worker fails ─► report, stop workers ─┐
//     │                                                ├─► round R ended elsewhere ─► stop workers ─┤
//     │                                                ├─► nodes waiting, room left ─► stop workers ┤
//     └────────────────────────────────────────────────┴────────────────────────────────────────────┘
//   signal ─► forward it to the workers, stop them, leave, exit 128+signal
//   job FAILED (restart budget spent) ─► exit with the failed worker's code
//
// The agent's main thread spawns every worker (see process.h on
// PR_SET_PDEATHSIG) and waits on pidfds, a signalfd and an eventfd the job
// watcher pokes, so nothing polls on a timer except as a backstop.
#pragma once

#include <map>
#include <string>

#include "launcher/options.h"

namespace muster::launcher {

// Runs the agent to the end and returns the process exit code:
//   0        the job succeeded
//   N        the first failed worker's exit code (128+signal if killed)
//   128+S    the agent got signal S (one of options.signals_to_handle)
//   1        the job was closed by an administrator, or an agent error
//   2        the rendezvous service could not be reached or refused us
// `signal_fd` is a signalfd for options.signals_to_handle, which the caller
// has blocked in every thread.
int RunAgent(const LaunchOptions& options, const std::map<std::string, std::string>& env,
             int signal_fd);

}  // namespace muster::launcher
