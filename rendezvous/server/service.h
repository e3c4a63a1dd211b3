// The gRPC face of the rendezvous state machine (callback API: open Watch
// streams and blocked Gets cost no threads).
//
// One absl::Mutex (mu_) guards the StateMachine and the registries of
// waiters and watchers. Handlers translate a request into one StateMachine
// call under mu_, then reply after releasing it; nothing does I/O, Finish or
// StartWrite while holding mu_.
//
// After every mutation the service takes the jobs that changed and, once the
// mutation is durable (group commit, see group_commit.h), re-checks their
// blocked Get/Wait calls and offers their Watch streams the new state. A
// mutation's reply is sent only after a snapshot containing it is on disk.
//
// Two background threads: the timer (StateMachine::Tick and waiter
// deadlines) and, with a state dir, the group-commit writer.
//
// Lifecycle: construct, RestoreFromDisk, Start, register with a
// grpc::ServerBuilder; on shutdown BeginShutdown, shut the grpc::Server
// down, then Stop. The service must outlive the grpc::Server.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/rendezvous.grpc.pb.h"
#include "rendezvous/server/auth.h"
#include "rendezvous/server/clock.h"
#include "rendezvous/server/group_commit.h"
#include "rendezvous/server/job_events.h"
#include "rendezvous/server/metrics.h"
#include "rendezvous/server/persistence.h"
#include "rendezvous/state/state_machine.h"

namespace muster::rdzv {

struct ServiceOptions {
  Limits limits;
  Clock* clock = nullptr;                 // not owned; required
  TokenChecker tokens;                    // default: no token
  Metrics* metrics = nullptr;             // not owned; required
  const StateFile* state_file = nullptr;  // not owned; null: memory only
  // Open Watch streams on the server and on one job (so one tenant cannot
  // take them all); beyond either: RESOURCE_EXHAUSTED naming it.
  size_t max_watch_streams = 100000;
  size_t max_watch_streams_per_job = 10000;
  // Blocked Get (wait_ms > 0) and Wait calls on one job; one more gets
  // RESOURCE_EXHAUSTED naming the limit.
  size_t max_waiters_per_job = 10000;
  // Jobs that exist at once per caller identity (CallerIdentity, auth.h):
  // a Join that would create one more gets RESOURCE_EXHAUSTED naming the
  // quota. Joins of existing jobs are never refused by it.
  size_t max_jobs_per_identity = 1000;
  // The timer re-checks at least this often, so a FakeClock moved by a test
  // takes effect without an RPC.
  absl::Duration max_timer_sleep = absl::Seconds(1);
};

class RendezvousService final : public pb::Rendezvous::CallbackService {
 public:
  explicit RendezvousService(ServiceOptions options);
  ~RendezvousService() override;  // Stops (see Stop).

  RendezvousService(const RendezvousService&) = delete;
  RendezvousService& operator=(const RendezvousService&) = delete;

  // Before Start: loads the state file if there is one. DATA_LOSS naming
  // the file if it cannot be parsed; the StateMachine's error if it rejects
  // the contents.
  absl::Status RestoreFromDisk();
  // Starts the timer thread and the group-commit writer.
  void Start();
  // New Watch and blocking Get/Wait calls get UNAVAILABLE; open ones are
  // finished with UNAVAILABLE so clients reconnect elsewhere or later.
  void BeginShutdown();
  // After the grpc::Server has shut down: stops the threads and writes the
  // state one last time. Returns that write's status. Idempotent.
  absl::Status Stop();

  // Jobs and members, for the metrics gauges.
  Metrics::Gauges ReadGauges();

  // ---- pb::Rendezvous (service.cc, service_store.cc, service_watch.cc)
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const pb::JoinRequest* request,
                                 pb::JoinResponse* response) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* context,
                                      const pb::KeepAliveRequest* request,
                                      pb::KeepAliveResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const pb::LeaveRequest* request,
                                  pb::LeaveResponse* response) override;
  grpc::ServerUnaryReactor* ReportFailure(grpc::CallbackServerContext* context,
                                          const pb::ReportFailureRequest* request,
                                          pb::ReportFailureResponse* response) override;
  grpc::ServerUnaryReactor* ReportDone(grpc::CallbackServerContext* context,
                                       const pb::ReportDoneRequest* request,
                                       pb::ReportDoneResponse* response) override;
  grpc::ServerWriteReactor<pb::JobState>* Watch(grpc::CallbackServerContext* context,
                                                const pb::WatchRequest* request) override;
  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context, const pb::SetRequest* request,
                                pb::SetResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context, const pb::GetRequest* request,
                                pb::GetResponse* response) override;
  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* context, const pb::AddRequest* request,
                                pb::AddResponse* response) override;
  grpc::ServerUnaryReactor* CompareAndSet(grpc::CallbackServerContext* context,
                                          const pb::CompareAndSetRequest* request,
                                          pb::CompareAndSetResponse* response) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* context,
                                   const pb::DeleteRequest* request,
                                   pb::DeleteResponse* response) override;
  grpc::ServerUnaryReactor* MultiGet(grpc::CallbackServerContext* context,
                                     const pb::MultiGetRequest* request,
                                     pb::MultiGetResponse* response) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* context,
                                 const pb::WaitRequest* request,
                                 pb::WaitResponse* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const pb::ListJobsRequest* request,
                                     pb::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* DescribeJob(grpc::CallbackServerContext* context,
                                        const pb::DescribeJobRequest* request,
                                        pb::DescribeJobResponse* response) override;
  grpc::ServerUnaryReactor* CloseJob(grpc::CallbackServerContext* context,
                                     const pb::CloseJobRequest* request,
                                     pb::CloseJobResponse* response) override;

 private:
  class StoreWaiter;   // a blocked Get or Wait (service_store.cc)
  class WatchReactor;  // one Watch stream (service_watch.cc)

  // What a call under mu_ changed, to act on after releasing it.
  struct Effects {
    std::vector<std::string> changed_jobs;
    bool durable = false;   // a snapshot must be written before replying
    uint64_t sequence = 0;  // mutation number, when durable
  };
  using Reply = std::function<void(absl::Status durable)>;

  // Runs `call` (which uses sm_) under mu_, catching exceptions, then
  // replies through `reactor` once its effects are durable.
  template <typename Call>
  grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* context, Rpc rpc,
                                     bool may_move_deadlines, Call call);

  // Collects changed jobs and the dirty bit; wakes the timer if the next
  // deadline moved earlier (skipped for KeepAlive, which only defers).
  Effects TakeEffects(bool may_move_deadlines) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After releasing mu_: once durable, notifies changed jobs, then `reply`.
  void AfterCommit(Effects effects, Reply reply) ABSL_LOCKS_EXCLUDED(mu_);
  // Re-checks waiters and offers watchers the state of each job.
  void NotifyJobs(const std::vector<std::string>& job_ids) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- waiters (service_store.cc)
  // Whether `waiter` is satisfied now: OK (response filled), an error, or
  // nullopt to keep waiting.
  std::optional<absl::Status> CheckWaiter(StoreWaiter* waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RegisterWaiter(StoreWaiter* waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // False if it was not registered (someone else finishes it).
  bool UnregisterWaiter(StoreWaiter* waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CancelWaiter(StoreWaiter* waiter) ABSL_LOCKS_EXCLUDED(mu_);
  grpc::ServerUnaryReactor* StartWaiter(StoreWaiter* waiter, grpc::CallbackServerContext* context)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- jobs per identity (service.cc)
  // OK if `identity` may create one more job; RESOURCE_EXHAUSTED otherwise.
  absl::Status CheckJobQuota(const std::string& identity) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts `job_id` for `identity`: always when `created`, else only if the
  // job is counted for no one yet (restored from the state file).
  void CountJob(const std::string& job_id, const std::string& identity, bool created)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets counted jobs that the state machine has dropped.
  void ForgetDroppedJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- watchers (service_watch.cc)
  void UnregisterWatcher(WatchReactor* watcher) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- timer (service_core.cc)
  void TimerLoop();

  std::pair<state::ServerState, uint64_t> SnapshotForCommit() ABSL_LOCKS_EXCLUDED(mu_);
  // After a failed state write: the machine goes back to `durable`, the last
  // state written, and watchers of the jobs that change back are told.
  // Returns the mutation number of that restoring (GroupCommitter).
  uint64_t RollBack(const state::ServerState& durable) ABSL_LOCKS_EXCLUDED(mu_);

  const ServiceOptions options_;
  Clock* const clock_;
  Metrics* const metrics_;
  std::unique_ptr<GroupCommitter> committer_;  // null without a state dir

  absl::Mutex mu_;
  StateMachine machine_ ABSL_GUARDED_BY(mu_);
  JobEventTracker events_ ABSL_GUARDED_BY(mu_);
  uint64_t mutation_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;

  // Blocked Get/Wait calls by job, and by real-time deadline for the timer.
  absl::flat_hash_map<std::string, std::set<StoreWaiter*>> waiters_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<absl::Time, StoreWaiter*>> waiter_deadlines_ ABSL_GUARDED_BY(mu_);
  // Open Watch streams by job; shared so a notifier holding one after
  // releasing mu_ never sees it deleted under it.
  absl::flat_hash_map<std::string, std::map<WatchReactor*, std::shared_ptr<WatchReactor>>> watchers_
      ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> open_watches_{0};
  // Who created each job, and the jobs of each identity, for
  // max_jobs_per_identity. A dropped job lingers here until the identity
  // creates again or ForgetDroppedJobs sweeps (when the map outgrows the
  // state machine's jobs), so the bookkeeping stays O(jobs).
  absl::flat_hash_map<std::string, std::string> identity_of_job_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::flat_hash_set<std::string>> jobs_of_identity_
      ABSL_GUARDED_BY(mu_);
  // The watch view last built per job, so a store write (which leaves the
  // view as it was) does not rebuild a 1000-member state.
  absl::flat_hash_map<std::string, std::shared_ptr<const absl::StatusOr<pb::JobState>>> last_views_
      ABSL_GUARDED_BY(mu_);

  // When the timer sleeps: the clock instant and real instant it wakes at
  // (InfinitePast while it is awake), so a change only signals it when it
  // brings a deadline forward.
  absl::CondVar timer_wake_;
  absl::Time timer_wakes_at_clock_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time timer_wakes_at_real_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::thread timer_;
};

// The most bytes of a status message a reply carries; the middle of a
// longer one is cut.
inline constexpr size_t kMaxStatusMessageBytes = 1024;

// absl::Status -> grpc::Status, same code, and the message cut to
// kMaxStatusMessageBytes.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace muster::rdzv
