// The rendezvous client: one gRPC channel to the server and one method per
// RPC. Include "rendezvous/client/client.h" to get it together with
// LeaseKeeper, JobWatcher and JoinAndWaitForRound.
//
// Thread-safety: a Client is thread-safe; share one per process. Every
// method may be called from any thread at once.
//
// Errors: each method returns the server's gRPC status as an absl::Status
// with the same code and message (codes: rendezvous/state/state_machine.h), or
// DEADLINE_EXCEEDED when the call's deadline passed, or CANCELLED when its
// Cancellation fired.
//
// Connection. Every call is sent with gRPC's wait_for_ready: while the
// server is down (restarting) the call is queued in the client and sent as
// soon as the channel reconnects, within the call's deadline. (Fail-fast
// calls are worse here: gRPC 1.51 keeps failing them for seconds after the
// server is back.) A call that never got a connection before its deadline
// returns UNAVAILABLE rather than DEADLINE_EXCEEDED: "no connection to the
// rendezvous server at ...", or, when the connection was made but its setup
// failed, what failed and why, e.g. "TLS handshake with ... failed: ...
// certificate verify failed ..." (see NoConnectionMessage).
//
// Keepalive. Every channel pings the server after keepalive.time without
// activity and closes the connection when a ping is not answered within
// keepalive.timeout, even with no call in flight. A connection that died
// silently (a NAT or firewall dropped it, the peer vanished) is so noticed
// within about time + timeout instead of when TCP gives up (~15 min): open
// Watch streams fail with UNAVAILABLE and reconnect, calls get a fresh
// connection. The channel arguments are built in one place,
// ChannelArgumentsFor.
//
// Retries. Calls that are safe to repeat (KeepAlive, Get, MultiGet, Wait,
// Set, DescribeJob, ListJobs, and Join with a member_id) are also retried
// when an attempt ends with UNAVAILABLE (the connection broke mid-call, the
// server was shutting down), with jittered exponential backoff, until their
// deadline. Calls that are not safe to repeat (a first Join, Leave,
// ReportFailure, ReportDone, Add, CompareAndSet, Delete, CloseJob) are not:
// thanks to wait_for_ready a request that was never sent does not fail, so
// an UNAVAILABLE that does come back means the request may have reached the
// server, and retrying a first Join could create a second member. The caller
// decides (e.g. Leave again and accept NOT_FOUND).
//
// RESOURCE_EXHAUSTED (a server quota or cap, named in the message) is tried
// at most resource_exhausted_attempts times in all, with backoff, by the
// calls that are safe to repeat, by JobWatcher and by LeaseKeeper; after
// that it is final and returned to the caller (a quota that frees up soon,
// such as blocked calls per job, gets a few chances; a cap that holds does
// not spin forever). Calls that are not safe to repeat return it at once.
//
// Credential rotation. A token given as token_file is read again when the
// file changes (WatchedFile: looked at, with stat(2), at most every
// credentials_refresh), so an operator rotates it in place without
// restarting the agents or workers that hold it. A call refused
// UNAUTHENTICATED reads the file at once, and is sent again, whatever the
// call, when the token in it is another: the server refuses an
// unauthenticated request before acting on it, so repeating one is always
// safe. A file that becomes empty or unreadable keeps the token read
// before. The TLS files (tls_ca_file, tls_cert_file, tls_key_file) are
// watched by gRPC's FileWatcherCertificateProvider on the same period: the
// next handshake (a new connection) uses what they hold then, so a
// short-lived client certificate is renewed under a running agent.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/rendezvous.grpc.pb.h"
#include "proto/rendezvous.pb.h"
#include "rendezvous/common/watched_file.h"

namespace grpc {
class Channel;
class ChannelArguments;
class ClientContext;
}  // namespace grpc

namespace muster::rdzv {

namespace pb = ::muster::rendezvous::v1;

inline constexpr int kDefaultRendezvousPort = 29400;

// Full-jitter exponential backoff: attempt n (from 0) sleeps a uniform
// random time in [0, min(max, initial * 2^n)].
struct BackoffOptions {
  absl::Duration initial = absl::Milliseconds(50);
  absl::Duration max = absl::Seconds(2);
};
absl::Duration JitteredBackoff(const BackoffOptions& backoff, int attempt);

// gRPC keepalive of a client channel (see the top of this file). Both
// durations are rounded to whole milliseconds, at least 1 ms.
struct KeepaliveOptions {
  absl::Duration time = absl::Seconds(10);    // idle time before a ping
  absl::Duration timeout = absl::Seconds(5);  // unanswered ping: dead link
};

struct ClientOptions {
  // host[:port], "[v6addr]:port", or "unix:/path". Port defaults to 29400.
  std::string endpoint = "127.0.0.1:29400";

  // Bearer token: give it directly or as a file (whitespace trimmed), not
  // both. Empty: no authorization header is sent.
  std::string token;
  std::string token_file;

  // TLS is used when `use_tls` is set or any tls_* file is given.
  // tls_ca_file verifies the server (empty: system roots); tls_cert_file and
  // tls_key_file (both or neither) are this client's certificate for mTLS;
  // tls_server_name overrides the name checked against the server cert.
  bool use_tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;

  // How often token_file and the tls_* files are looked at for a change,
  // which is then used (see the top): the next call's token, the next TLS
  // handshake's certificates (gRPC's watcher: whole seconds, at least 1).
  absl::Duration credentials_refresh = absl::Seconds(5);

  // Sent as x-muster-job-secret on every call when non-empty: give it
  // directly or as a file (whitespace trimmed), not both.
  std::string job_secret;
  std::string job_secret_file;

  // Default deadline of one call, retries included. Blocking store calls
  // get their wait time on top.
  absl::Duration rpc_timeout = absl::Seconds(10);
  BackoffOptions backoff;

  KeepaliveOptions keepalive;

  // A Watch stream is given this deadline; when it passes, JobWatcher opens
  // a new stream resuming after the last version it saw (no state is seen
  // twice or lost: the server sends the current state when it is newer).
  // A stream that stalls in a way keepalive cannot see ends by then.
  absl::Duration watch_stream_deadline = absl::Minutes(5);

  // Attempts (the first included) for a RESOURCE_EXHAUSTED answer before it
  // is final; see the top of this file. At least 1.
  int resource_exhausted_attempts = 4;
};

// The arguments every client channel is created with: reconnect backoff
// from `options.backoff`, keepalive from `options.keepalive`, a local
// subchannel pool, the TLS server name override.
grpc::ChannelArguments ChannelArgumentsFor(const ClientOptions& options);

// Cancels calls from another thread: the call in flight ends with CANCELLED
// and retry sleeps end at once. Once cancelled, every later call that uses
// it fails with CANCELLED immediately. Thread-safe; must outlive the calls.
class Cancellation {
 public:
  void Cancel();
  bool cancelled() const;

  // Sleeps until `deadline` or Cancel(); returns false if cancelled.
  bool SleepUntil(absl::Time deadline) const;

 private:
  friend class Client;
  // False (and nothing registered) if already cancelled.
  bool Register(grpc::ClientContext* context);
  void Unregister(grpc::ClientContext* context);

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* active_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// grpc.health.v1.HealthCheckResponse.ServingStatus: what a server reports
// for itself or one of its services. A value this list lacks is kept as is.
enum class ServingStatus : int {
  kUnknown = 0,
  kServing = 1,
  kNotServing = 2,
  kServiceUnknown = 3,
};
// "SERVING", "NOT_SERVING", ...; "UNRECOGNIZED(7)" for another value.
std::string ServingStatusName(ServingStatus status);

// Per-call settings; the defaults use the client's options.
struct CallOptions {
  absl::Duration timeout = absl::ZeroDuration();  // zero: rpc_timeout
  Cancellation* cancellation = nullptr;           // not owned
};

class Client {
 public:
  // Validates the options, reads the token and TLS files and creates the
  // channel (it connects lazily). INVALID_ARGUMENT names a malformed
  // endpoint, an unreadable or empty file, or conflicting options.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // ---- membership
  absl::StatusOr<pb::JoinResponse> Join(const pb::JoinRequest& request, CallOptions call = {});
  absl::StatusOr<pb::KeepAliveResponse> KeepAlive(const pb::KeepAliveRequest& request,
                                                  CallOptions call = {});
  absl::StatusOr<pb::LeaveResponse> Leave(const pb::LeaveRequest& request, CallOptions call = {});
  absl::StatusOr<pb::ReportFailureResponse> ReportFailure(const pb::ReportFailureRequest& request,
                                                          CallOptions call = {});
  absl::StatusOr<pb::ReportDoneResponse> ReportDone(const pb::ReportDoneRequest& request,
                                                    CallOptions call = {});

  // ---- store (Get and Wait get request.wait_ms on top of the timeout)
  absl::StatusOr<pb::SetResponse> Set(const pb::SetRequest& request, CallOptions call = {});
  absl::StatusOr<pb::GetResponse> Get(const pb::GetRequest& request, CallOptions call = {});
  absl::StatusOr<pb::AddResponse> Add(const pb::AddRequest& request, CallOptions call = {});
  absl::StatusOr<pb::CompareAndSetResponse> CompareAndSet(const pb::CompareAndSetRequest& request,
                                                          CallOptions call = {});
  absl::StatusOr<pb::DeleteResponse> Delete(const pb::DeleteRequest& request,
                                            CallOptions call = {});
  absl::StatusOr<pb::MultiGetResponse> MultiGet(const pb::MultiGetRequest& request,
                                                CallOptions call = {});
  absl::StatusOr<pb::WaitResponse> Wait(const pb::WaitRequest& request, CallOptions call = {});

  // ---- admin
  absl::StatusOr<pb::ListJobsResponse> ListJobs(const pb::ListJobsRequest& request = {},
                                                CallOptions call = {});
  absl::StatusOr<pb::DescribeJobResponse> DescribeJob(const pb::DescribeJobRequest& request,
                                                      CallOptions call = {});
  absl::StatusOr<pb::CloseJobResponse> CloseJob(const pb::CloseJobRequest& request,
                                                CallOptions call = {});

  // ---- health
  // grpc.health.v1.Health/Check for `service` ("": the server as a whole),
  // the standard service every rendezvous server registers: the status the
  // server reports. The server does not check the bearer token or the job
  // secret on it (they are sent anyway), so it answers load-balancer
  // probes. Safe to repeat: retried as ListJobs is. A named service the
  // server does not know is NOT_FOUND. Stubs from proto/health.proto.
  absl::StatusOr<ServingStatus> CheckHealth(const std::string& service = "", CallOptions call = {});

  // ---- for streams and async callers (JobWatcher, the benchmark)

  // Adds the auth metadata and `deadline` (InfiniteFuture: none) to a
  // fresh context. Returns the bearer token it added ("" for none).
  std::string PrepareContext(grpc::ClientContext* context, absl::Time deadline) const;
  // Whether the token file holds another token than `token` now (read at
  // once): a call or stream refused UNAUTHENTICATED with `token` may go
  // again. False without a token file.
  bool TokenRotatedFrom(const std::string& token) const { return Token(/*now=*/true) != token; }
  pb::Rendezvous::Stub* stub() const { return stub_.get(); }
  const ClientOptions& options() const { return options_; }

 private:
  Client(ClientOptions options, std::string token, std::optional<WatchedFile> token_file,
         std::shared_ptr<grpc::Channel> channel);

  // The bearer token to send: token_file's when it changed (at once with
  // `now`), else the one read before.
  std::string Token(bool now = false) const;

  // Runs `attempt` (one RPC on a prepared context) with deadline, retries
  // and cancellation as described at the top of this file.
  template <typename Response, typename Attempt>
  absl::StatusOr<Response> Call(const char* method, bool retry_unavailable,
                                absl::Duration extra_wait, CallOptions call, Attempt attempt);

  const ClientOptions options_;
  mutable absl::Mutex token_mu_;
  mutable std::string token_ ABSL_GUARDED_BY(token_mu_);
  // Set when the token came from a file.
  mutable std::optional<WatchedFile> token_file_ ABSL_GUARDED_BY(token_mu_);
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Rendezvous::Stub> stub_;
};

// Whether `options` ask for TLS: use_tls or any tls_* file.
bool UsesTls(const ClientOptions& options);

// What a call that got no connection to the server within `waited` says
// (after its method's name), from `last_error`: gRPC's message for a call
// failed at once on the channel ("failed to connect to all addresses; last
// error: ..."; "" when there is none). A failed TLS handshake, or a server
// that closed the connection as one does to a client without TLS, is named
// with its likely cause and the option that mends it; else "no connection
// to the rendezvous server at ENDPOINT within ...", with gRPC's reason.
std::string NoConnectionMessage(const std::string& last_error, const ClientOptions& options,
                                absl::Duration waited);

// "host:port" for gRPC from "host[:port]"; INVALID_ARGUMENT if malformed.
absl::StatusOr<std::string> NormalizeEndpoint(const std::string& endpoint);

}  // namespace muster::rdzv
