#include "tools/bench_calls.h"

#include <algorithm>
#include <atomic>
#include <functional>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"

namespace muster::tools {

namespace pb = rdzv::pb;
using rdzv::Client;

void LatencySamples::Add(double millis) {
  absl::MutexLock lock(&mu_);
  samples_.push_back(millis);
}

double LatencySamples::Percentile(double p) const {
  absl::MutexLock lock(&mu_);
  if (samples_.empty()) return 0;
  std::vector<double> sorted = samples_;
  std::sort(sorted.begin(), sorted.end());
  size_t index = static_cast<size_t>(p / 100.0 * (sorted.size() - 1) + 0.5);
  return sorted[std::min(index, sorted.size() - 1)];
}

namespace {

// Progress of the rendezvous phase, shared by every node's callbacks.
struct Progress {
  absl::Mutex mu;
  int joined ABSL_GUARDED_BY(mu) = 0;
  int running ABSL_GUARDED_BY(mu) = 0;
  int finished ABSL_GUARDED_BY(mu) = 0;  // watches whose OnDone ran
  absl::Status error ABSL_GUARDED_BY(mu);
  std::atomic<int64_t> watch_messages{0};

  void Fail(const absl::Status& status) {
    absl::MutexLock lock(&mu);
    if (error.ok()) error = status;
  }
};

// One simulated node: Join, then Watch until its RUNNING round shows up.
class Node : public grpc::ClientReadReactor<pb::JobState> {
 public:
  Node(Client* client, int index, const std::string& job_id, int nodes, absl::Time start,
       Progress* progress, RendezvousResult* result)
      : client_(client),
        index_(index),
        nodes_(nodes),
        start_(start),
        progress_(progress),
        result_(result) {
    join_request_.set_job_id(job_id);
    pb::JobConfig* config = join_request_.mutable_config();
    config->set_min_nodes(nodes);
    config->set_max_nodes(nodes);
    config->set_join_timeout_ms(120000);
    config->set_last_call_timeout_ms(1000);
    config->set_lease_ttl_ms(60000);  // nobody expires during the benchmark
    config->set_max_restarts(0);
    join_request_.set_address(absl::StrCat("10.0.", index / 256, ".", index % 256));
    join_request_.set_hostname(absl::StrCat("node-", index));
    join_request_.set_nproc(8);
    join_request_.set_requested_rank(-1);
    watch_request_.set_job_id(job_id);
  }

  void StartJoin() {
    client_->PrepareContext(&join_context_, absl::Now() + absl::Seconds(30));
    join_sent_ = absl::Now();
    client_->stub()->async()->Join(&join_context_, &join_request_, &join_response_,
                                   [this](grpc::Status status) { OnJoined(status); });
  }

  void Cancel() { watch_context_.TryCancel(); }

 private:
  void OnJoined(const grpc::Status& status) {
    if (!status.ok()) {
      progress_->Fail(
          absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                       absl::StrCat("join of node ", index_, ": ", status.error_message())));
      absl::MutexLock lock(&progress_->mu);
      ++progress_->finished;  // its watch never starts
      return;
    }
    const absl::Time now = absl::Now();
    result_->join_latency_ms.Add(absl::ToDoubleMilliseconds(now - join_sent_));
    {
      absl::MutexLock lock(&progress_->mu);
      result_->member_ids[index_] = join_response_.member_id();
      if (++progress_->joined == nodes_) result_->all_joined = now - start_;
    }
    client_->PrepareContext(&watch_context_, absl::InfiniteFuture());
    client_->stub()->async()->Watch(&watch_context_, &watch_request_, this);
    StartRead(&state_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    progress_->watch_messages.fetch_add(1, std::memory_order_relaxed);
    if (state_.phase() == pb::RUNNING && state_.members_size() == nodes_) {
      bool found = false;
      for (const pb::Member& member : state_.members()) {
        if (member.member_id() == join_response_.member_id()) found = true;
      }
      if (found) {
        absl::MutexLock lock(&progress_->mu);
        seen_running_ = true;
        result_->round = state_.round();
        if (++progress_->running == nodes_) {
          result_->all_running = absl::Now() - start_;
        }
        watch_context_.TryCancel();  // done: free the stream
        return;
      }
    }
    StartRead(&state_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&progress_->mu);
    if (!seen_running_ && progress_->error.ok()) {
      progress_->error =
          absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                       absl::StrCat("watch of node ", index_,
                                    " ended before RUNNING: ", status.error_message()));
    }
    ++progress_->finished;
  }

  Client* const client_;
  const int index_;
  const int nodes_;
  const absl::Time start_;
  Progress* const progress_;
  RendezvousResult* const result_;
  grpc::ClientContext join_context_;
  pb::JoinRequest join_request_;
  pb::JoinResponse join_response_;
  absl::Time join_sent_;
  grpc::ClientContext watch_context_;
  pb::WatchRequest watch_request_;
  pb::JobState state_;
  bool seen_running_ = false;  // guarded by progress_->mu
};

// Runs `issue` with `in_flight` calls outstanding until `length` is over.
class ClosedLoop {
 public:
  using Issue =
      std::function<void(int64_t sequence, std::function<void(const grpc::Status&)> done)>;

  ClosedLoop(int in_flight, absl::Duration length, Issue issue)
      : in_flight_(in_flight), issue_(std::move(issue)) {
    start_ = absl::Now();
    end_ = start_ + length;
  }

  Throughput Run() {
    {
      absl::MutexLock lock(&mu_);
      active_ = in_flight_;
    }
    for (int i = 0; i < in_flight_; ++i) Next();
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == 0; };
    mu_.Await(absl::Condition(&idle));
    result_.elapsed = absl::Now() - start_;
    return result_;
  }

 private:
  void Next() {
    issue_(sequence_++, [this](const grpc::Status& status) { OnDone(status); });
  }

  void OnDone(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (status.ok()) {
        ++result_.ok;
      } else if (result_.failed++ == 0) {
        result_.first_error = status.error_message();
      }
      if (absl::Now() >= end_) {
        --active_;
        return;
      }
    }
    Next();
  }

  const int in_flight_;
  const Issue issue_;
  absl::Time start_, end_;
  std::atomic<int64_t> sequence_{0};
  absl::Mutex mu_;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  Throughput result_ ABSL_GUARDED_BY(mu_);
};

// One unary call's buffers, alive until its callback ran.
template <typename Request, typename Response>
struct UnaryCall {
  grpc::ClientContext context;
  Request request;
  Response response;
};

// `method(async_stub, context, request, response, callback)` starts the call.
template <typename Request, typename Response, typename Method>
void StartUnary(Client* client, Request request, Method method,
                std::function<void(const grpc::Status&)> done) {
  auto* call = new UnaryCall<Request, Response>;
  call->request = std::move(request);
  client->PrepareContext(&call->context, absl::Now() + absl::Seconds(10));
  method(client->stub()->async(), &call->context, &call->request, &call->response,
         [call, done = std::move(done)](grpc::Status status) {
           done(status);
           delete call;
         });
}

#define MUSTER_ASYNC(Method)                                              \
  [](auto* stub, auto* context, auto* request, auto* response, auto cb) { \
    stub->Method(context, request, response, std::move(cb));              \
  }

}  // namespace

void RunRendezvous(const std::vector<std::unique_ptr<Client>>& clients, const std::string& job_id,
                   int nodes, absl::Duration timeout, RendezvousResult* result) {
  result->member_ids.resize(nodes);
  Progress progress;
  const absl::Time start = absl::Now();
  std::vector<std::unique_ptr<Node>> all;
  for (int i = 0; i < nodes; ++i) {
    all.push_back(std::make_unique<Node>(clients[i % clients.size()].get(), i, job_id, nodes, start,
                                         &progress, result));
  }
  for (auto& node : all) node->StartJoin();

  absl::MutexLock lock(&progress.mu);
  auto all_running = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(progress.mu) {
    return progress.running == nodes || progress.finished == nodes || !progress.error.ok();
  };
  if (!progress.mu.AwaitWithTimeout(absl::Condition(&all_running), timeout)) {
    progress.error = absl::DeadlineExceededError(
        absl::StrCat(progress.running, " of ", nodes, " nodes saw the round RUNNING within ",
                     absl::FormatDuration(timeout), " (", progress.joined, " joined)"));
  }
  progress.mu.Unlock();
  for (auto& node : all) node->Cancel();
  progress.mu.Lock();
  // Every reactor must be done before it is destroyed.
  auto all_finished = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(progress.mu) {
    return progress.finished == nodes;
  };
  progress.mu.Await(absl::Condition(&all_finished));
  result->error = progress.error;
  result->watch_messages = progress.watch_messages.load();
}

Throughput RunKeepAlives(const std::vector<std::unique_ptr<Client>>& clients,
                         const std::string& job_id, const std::vector<std::string>& member_ids,
                         int in_flight, absl::Duration length) {
  ClosedLoop loop(in_flight, length, [&](int64_t n, auto done) {
    pb::KeepAliveRequest request;
    request.set_job_id(job_id);
    request.set_member_id(member_ids[n % member_ids.size()]);
    StartUnary<pb::KeepAliveRequest, pb::KeepAliveResponse>(
        clients[n % clients.size()].get(), std::move(request), MUSTER_ASYNC(KeepAlive),
        std::move(done));
  });
  return loop.Run();
}

Throughput RunStoreSets(const std::vector<std::unique_ptr<Client>>& clients,
                        const std::string& job_id, uint64_t round, int in_flight,
                        absl::Duration length) {
  const std::string value(64, 'v');
  ClosedLoop loop(in_flight, length, [&](int64_t n, auto done) {
    pb::SetRequest request;
    request.set_job_id(job_id);
    request.set_round(round);
    request.set_key(absl::StrCat("bench/", n % 10000));
    request.set_value(value);
    StartUnary<pb::SetRequest, pb::SetResponse>(
        clients[n % clients.size()].get(), std::move(request), MUSTER_ASYNC(Set), std::move(done));
  });
  return loop.Run();
}

Throughput RunStoreGets(const std::vector<std::unique_ptr<Client>>& clients,
                        const std::string& job_id, uint64_t round, int in_flight,
                        absl::Duration length, int64_t keys_written) {
  const int64_t keys = std::min<int64_t>(keys_written, 10000);
  if (keys <= 0) return Throughput{};
  ClosedLoop loop(in_flight, length, [&](int64_t n, auto done) {
    pb::GetRequest request;
    request.set_job_id(job_id);
    request.set_round(round);
    request.set_key(absl::StrCat("bench/", n % keys));
    request.set_wait_ms(0);
    StartUnary<pb::GetRequest, pb::GetResponse>(
        clients[n % clients.size()].get(), std::move(request), MUSTER_ASYNC(Get), std::move(done));
  });
  return loop.Run();
}

}  // namespace muster::tools
