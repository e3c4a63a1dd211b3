// The rendezvous client library, as used by the launcher agent, the worker
// and the tools:
//   Client               one channel, one method per RPC, retries (rpc.h)
//   LeaseKeeper          renews a member's lease in the background
//   JobWatcher           follows a job's state over a Watch stream
//   JoinAndWaitForRound  join, then wait for a RUNNING round with this member
// The key-value store interface and its implementations are in store.h.
#pragma once

#include "rendezvous/client/lease_keeper.h"
#include "rendezvous/client/rpc.h"
#include "rendezvous/client/watcher.h"
