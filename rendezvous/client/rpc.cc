#include "rendezvous/client/rpc.h"

#include <algorithm>
#include <limits>
#include <utility>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "proto/health.grpc.pb.h"
#include "rendezvous/common/credentials.h"
#include "rendezvous/common/watched_file.h"
#include "spdlog/spdlog.h"

namespace muster::rdzv {
namespace {

absl::Status ToAbsl(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// RESOURCE_EXHAUSTED made final: the server's message names the quota.
absl::Status ResourceExhaustedAfter(const char* method, int attempts, const grpc::Status& status) {
  return absl::ResourceExhaustedError(
      absl::StrCat(method, " refused ", attempts,
                   " time(s) for lack of a server resource: ", status.error_message()));
}

// A secret given directly (`value`) or as a file (`file`, whitespace
// trimmed), not both; an empty file is an error.
absl::StatusOr<std::string> SecretFromFile(const std::string& value, const std::string& file,
                                           const char* what, const char* file_what) {
  if (file.empty()) {
    absl::Status sendable = CheckHeaderValue(value, absl::StrCat("the ", what));
    if (!sendable.ok()) return sendable;
    return value;
  }
  if (!value.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("give the ", what, " or a ", file_what, ", not both"));
  }
  absl::StatusOr<std::string> contents = ReadWholeFile(file, file_what);
  if (!contents.ok()) return contents.status();
  std::string secret(absl::StripAsciiWhitespace(*contents));
  if (secret.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file_what, " \"", file, "\" is empty; expected a ", what));
  }
  absl::Status sendable = CheckHeaderValue(secret, absl::StrCat(file_what, " \"", file, "\""));
  if (!sendable.ok()) return sendable;
  return secret;
}

// The token a client sends from its token file: the first one the file
// holds, read by the server's rules (ParseTokenFile), so that comments, a
// second token for a rotation, or the server's own file all work.
absl::StatusOr<std::string> TokenFromFile(const std::string& contents, const std::string& path) {
  absl::StatusOr<std::vector<std::string>> tokens = ParseTokenFile(contents, path);
  if (!tokens.ok()) return tokens.status();
  return tokens->front();
}

// Whole milliseconds for a channel argument, at least 1.
int PositiveMs(absl::Duration duration) {
  return static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(duration), 1, std::numeric_limits<int>::max()));
}

// gRPC's last connection error on `channel` ("" when it names none). A
// wait_for_ready call that times out says only "Deadline Exceeded"; a
// fail-fast call on a channel in TRANSIENT_FAILURE fails at once with the
// reason (a refused connect, a failed TLS handshake). Still CONNECTING: no
// attempt has failed yet, and the call would wait for one.
std::string LastConnectionError(const std::shared_ptr<grpc::Channel>& channel) {
  if (channel->GetState(false) != GRPC_CHANNEL_TRANSIENT_FAILURE) return "";
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status =
      grpc::health::v1::Health::NewStub(channel)->Check(&context, request, &response);
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ? status.error_message() : "";
}

}  // namespace

// ---------------------------------------------------------------- Client

grpc::ChannelArguments ChannelArgumentsFor(const ClientOptions& options) {
  grpc::ChannelArguments args;
  // Reconnect as eagerly as our own retries do, so a restarted server is
  // found within about backoff.max rather than gRPC's default of minutes.
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is left alone: it is also the least
  // time one connection attempt gets, and 50 ms handshakes time out on a
  // busy machine ("tcp handshaker shutdown"), leaving the channel down.
  const int initial_ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(options.backoff.initial));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, initial_ms);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              std::max<int64_t>(initial_ms, absl::ToInt64Milliseconds(options.backoff.max)));
  // Each Client is its own connection, as each node would be.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Keepalive (see header). Pings continue while no call is open and
  // without data in between (gRPC stops after 2 such pings by default), so
  // an idle Watch stream or a lease between renewals is covered too. The
  // server never GOAWAYs for pings (server.cc), however often they come.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, PositiveMs(options.keepalive.time));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, PositiveMs(options.keepalive.timeout));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  return args;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  absl::StatusOr<std::string> target = NormalizeEndpoint(options.endpoint);
  if (!target.ok()) return target.status();
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rpc_timeout must be positive");
  }
  if (options.keepalive.time <= absl::ZeroDuration() ||
      options.keepalive.timeout <= absl::ZeroDuration() ||
      options.watch_stream_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "keepalive.time, keepalive.timeout and watch_stream_deadline must be "
        "positive");
  }
  if (options.resource_exhausted_attempts < 1) {
    return absl::InvalidArgumentError("resource_exhausted_attempts must be at least 1");
  }

  if (options.credentials_refresh <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("credentials_refresh must be positive");
  }
  std::optional<WatchedFile> token_file;
  if (!options.token_file.empty()) {
    // Only to remember the version, before the read below: a change in
    // between is then read again at the first look, never missed.
    token_file.emplace(options.token_file, options.credentials_refresh);
    (void)token_file->Read("token file");
  }
  absl::StatusOr<std::string> token = options.token;
  if (!options.token_file.empty()) {
    if (!options.token.empty()) {
      return absl::InvalidArgumentError("give the bearer token or a token file, not both");
    }
    absl::StatusOr<std::string> contents = ReadWholeFile(options.token_file, "token file");
    if (!contents.ok()) return contents.status();
    token = TokenFromFile(*contents, options.token_file);
  } else if (absl::Status sendable = CheckHeaderValue(options.token, "the bearer token");
             !sendable.ok()) {
    return sendable;
  }
  if (!token.ok()) return token.status();
  absl::StatusOr<std::string> job_secret =
      SecretFromFile(options.job_secret, options.job_secret_file, "job secret", "job secret file");
  if (!job_secret.ok()) return job_secret.status();

  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (UsesTls(options)) {
    if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("tls_cert_file and tls_key_file must be given together");
    }
    grpc::SslCredentialsOptions ssl;
    struct {
      const std::string& path;
      std::string* out;
      const char* what;
    } files[] = {{options.tls_ca_file, &ssl.pem_root_certs, "TLS CA file"},
                 {options.tls_cert_file, &ssl.pem_cert_chain, "TLS certificate"},
                 {options.tls_key_file, &ssl.pem_private_key, "TLS key"}};
    for (auto& file : files) {
      if (file.path.empty()) continue;
      absl::StatusOr<std::string> pem = ReadWholeFile(file.path, file.what);
      if (!pem.ok()) return pem.status();
      *file.out = *std::move(pem);
    }
    if (options.tls_ca_file.empty() && options.tls_cert_file.empty()) {
      credentials = grpc::SslCredentials(ssl);  // the system's roots: no file to watch
    } else {
      // Read above only to name a bad file now; gRPC's watcher reads them
      // again whenever they change (see the top of rpc.h).
      auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          options.tls_key_file, options.tls_cert_file, options.tls_ca_file,
          WatcherSeconds(options.credentials_refresh));
      grpc::experimental::TlsChannelCredentialsOptions tls_options;
      tls_options.set_certificate_provider(provider);
      // Without a CA file, the system's roots verify the server.
      if (!options.tls_ca_file.empty()) tls_options.watch_root_certs();
      if (!options.tls_cert_file.empty()) tls_options.watch_identity_key_cert_pairs();
      credentials = grpc::experimental::TlsCredentials(tls_options);
    }
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }

  auto channel = grpc::CreateCustomChannel(*target, credentials, ChannelArgumentsFor(options));
  ClientOptions kept = options;
  kept.job_secret = *std::move(job_secret);
  return std::unique_ptr<Client>(
      new Client(std::move(kept), *std::move(token), std::move(token_file), std::move(channel)));
}

Client::Client(ClientOptions options, std::string token, std::optional<WatchedFile> token_file,
               std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      token_(std::move(token)),
      token_file_(std::move(token_file)),
      channel_(std::move(channel)),
      stub_(pb::Rendezvous::NewStub(channel_)) {}

Client::~Client() = default;

std::string Client::Token(bool now) const {
  absl::MutexLock lock(&token_mu_);
  if (!token_file_.has_value()) return token_;
  std::optional<absl::StatusOr<std::string>> changed = token_file_->Changed("token file", now);
  if (changed.has_value() && changed->ok()) {
    // A file emptied, or holding what cannot be sent, keeps the token
    // before, as the server keeps its tokens on a bad change.
    absl::StatusOr<std::string> token = TokenFromFile(**changed, token_file_->path());
    if (token.ok()) {
      token_ = *std::move(token);
    } else {
      spdlog::warn("{} (changed); still sending the token read before",
                   std::string(token.status().message()));
    }
  }
  return token_;
}

std::string Client::PrepareContext(grpc::ClientContext* context, absl::Time deadline) const {
  std::string token = Token();
  if (!token.empty()) {
    context->AddMetadata("authorization", "Bearer " + token);
  }
  if (!options_.job_secret.empty()) {
    context->AddMetadata("x-muster-job-secret", options_.job_secret);
  }
  if (deadline != absl::InfiniteFuture()) {
    context->set_deadline(absl::ToChronoTime(deadline));
  }
  return token;
}

template <typename Response, typename Attempt>
absl::StatusOr<Response> Client::Call(const char* method, bool retry_unavailable,
                                      absl::Duration extra_wait, CallOptions call,
                                      Attempt attempt) {
  const absl::Duration timeout =
      call.timeout > absl::ZeroDuration() ? call.timeout : options_.rpc_timeout;
  const absl::Time deadline = absl::Now() + timeout + extra_wait;
  int exhausted_attempts = 0;
  for (int attempt_number = 0;; ++attempt_number) {
    grpc::ClientContext context;
    const std::string token = PrepareContext(&context, deadline);
    // Queued by gRPC while the channel is down, sent once it is up (see
    // header). Fail-fast calls would be no better: gRPC 1.51 keeps failing
    // them for seconds after a restarted server is back.
    context.set_wait_for_ready(true);
    if (call.cancellation != nullptr && !call.cancellation->Register(&context)) {
      return absl::CancelledError(absl::StrCat(method, " cancelled"));
    }
    Response response{};
    grpc::Status status = attempt(&context, &response, deadline, timeout);
    if (call.cancellation != nullptr) call.cancellation->Unregister(&context);
    if (status.ok()) return response;
    // A call this client did not cancel was cancelled by the server: it is
    // shutting down (a graceful stop cancels what is in flight) and a
    // restart may follow. That is UNAVAILABLE, to retry as such, not a
    // final CANCELLED: a lease keeper took it as a lost lease, and its
    // agent exited 1 on every rolling restart of the service.
    if (status.error_code() == grpc::StatusCode::CANCELLED &&
        (call.cancellation == nullptr || !call.cancellation->cancelled())) {
      status =
          grpc::Status(grpc::StatusCode::UNAVAILABLE,
                       "the server cancelled the call (shutting down?): " + status.error_message());
    }
    // A token rotated since it was read: the file holds another one now.
    // Refused before the server acted, so any call may go again, at once.
    if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED && TokenRotatedFrom(token)) {
      continue;
    }
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
        channel_->GetState(false) != GRPC_CHANNEL_READY) {
      // The call never got a connection: say "unreachable" or why the
      // connection failed (a TLS handshake), not "slow".
      return absl::UnavailableError(absl::StrCat(
          method, ": ",
          NoConnectionMessage(LastConnectionError(channel_), options_, timeout + extra_wait)));
    }
    const bool exhausted = status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    if (!retry_unavailable ||
        (status.error_code() != grpc::StatusCode::UNAVAILABLE && !exhausted)) {
      return ToAbsl(status);
    }
    if (exhausted && ++exhausted_attempts >= options_.resource_exhausted_attempts) {
      return ResourceExhaustedAfter(method, exhausted_attempts, status);
    }
    const absl::Time wake = absl::Now() + JitteredBackoff(options_.backoff, attempt_number);
    if (wake >= deadline) {
      return exhausted ? ResourceExhaustedAfter(method, exhausted_attempts, status)
                       : ToAbsl(status);
    }
    if (call.cancellation != nullptr) {
      if (!call.cancellation->SleepUntil(wake)) {
        return absl::CancelledError(absl::StrCat(method, " cancelled"));
      }
    } else {
      absl::SleepFor(wake - absl::Now());
    }
  }
}

namespace {
// The server-side wait that still fits in the call's remaining time, leaving
// `timeout` for the reply; at least 1 ms so the request keeps blocking
// semantics (0 would mean "do not wait").
int64_t RemainingWaitMs(int64_t requested_ms, absl::Time deadline, absl::Duration timeout) {
  if (requested_ms <= 0) return requested_ms;
  int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now() - timeout);
  return std::max<int64_t>(1, std::min(requested_ms, left));
}
}  // namespace

#define MUSTER_RPC(Name, Request, Response, retry)                                    \
  Call<pb::Response>(#Name, retry, absl::ZeroDuration(), call,                        \
                     [&](grpc::ClientContext* context, pb::Response* out, absl::Time, \
                         absl::Duration) { return stub_->Name(context, request, out); })

absl::StatusOr<pb::JoinResponse> Client::Join(const pb::JoinRequest& request, CallOptions call) {
  // A join naming its member_id only renews that member: safe to repeat.
  return MUSTER_RPC(Join, JoinRequest, JoinResponse, !request.member_id().empty());
}
absl::StatusOr<pb::KeepAliveResponse> Client::KeepAlive(const pb::KeepAliveRequest& request,
                                                        CallOptions call) {
  return MUSTER_RPC(KeepAlive, KeepAliveRequest, KeepAliveResponse, true);
}
absl::StatusOr<pb::LeaveResponse> Client::Leave(const pb::LeaveRequest& request, CallOptions call) {
  return MUSTER_RPC(Leave, LeaveRequest, LeaveResponse, false);
}
absl::StatusOr<pb::ReportFailureResponse> Client::ReportFailure(
    const pb::ReportFailureRequest& request, CallOptions call) {
  return MUSTER_RPC(ReportFailure, ReportFailureRequest, ReportFailureResponse, false);
}
absl::StatusOr<pb::ReportDoneResponse> Client::ReportDone(const pb::ReportDoneRequest& request,
                                                          CallOptions call) {
  return MUSTER_RPC(ReportDone, ReportDoneRequest, ReportDoneResponse, false);
}
absl::StatusOr<pb::SetResponse> Client::Set(const pb::SetRequest& request, CallOptions call) {
  return MUSTER_RPC(Set, SetRequest, SetResponse, true);
}
absl::StatusOr<pb::GetResponse> Client::Get(const pb::GetRequest& request, CallOptions call) {
  return Call<pb::GetResponse>(
      "Get", true, absl::Milliseconds(std::max<int64_t>(0, request.wait_ms())), call,
      [&](grpc::ClientContext* context, pb::GetResponse* out, absl::Time deadline,
          absl::Duration timeout) {
        pb::GetRequest attempt = request;
        attempt.set_wait_ms(RemainingWaitMs(request.wait_ms(), deadline, timeout));
        return stub_->Get(context, attempt, out);
      });
}
absl::StatusOr<pb::AddResponse> Client::Add(const pb::AddRequest& request, CallOptions call) {
  return MUSTER_RPC(Add, AddRequest, AddResponse, false);
}
absl::StatusOr<pb::CompareAndSetResponse> Client::CompareAndSet(
    const pb::CompareAndSetRequest& request, CallOptions call) {
  return MUSTER_RPC(CompareAndSet, CompareAndSetRequest, CompareAndSetResponse, false);
}
absl::StatusOr<pb::DeleteResponse> Client::Delete(const pb::DeleteRequest& request,
                                                  CallOptions call) {
  return MUSTER_RPC(Delete, DeleteRequest, DeleteResponse, false);
}
absl::StatusOr<pb::MultiGetResponse> Client::MultiGet(const pb::MultiGetRequest& request,
                                                      CallOptions call) {
  return MUSTER_RPC(MultiGet, MultiGetRequest, MultiGetResponse, true);
}
absl::StatusOr<pb::WaitResponse> Client::Wait(const pb::WaitRequest& request, CallOptions call) {
  return Call<pb::WaitResponse>(
      "Wait", true, absl::Milliseconds(std::max<int64_t>(0, request.wait_ms())), call,
      [&](grpc::ClientContext* context, pb::WaitResponse* out, absl::Time deadline,
          absl::Duration timeout) {
        pb::WaitRequest attempt = request;
        attempt.set_wait_ms(RemainingWaitMs(request.wait_ms(), deadline, timeout));
        return stub_->Wait(context, attempt, out);
      });
}
absl::StatusOr<pb::ListJobsResponse> Client::ListJobs(const pb::ListJobsRequest& request,
                                                      CallOptions call) {
  return MUSTER_RPC(ListJobs, ListJobsRequest, ListJobsResponse, true);
}
absl::StatusOr<pb::DescribeJobResponse> Client::DescribeJob(const pb::DescribeJobRequest& request,
                                                            CallOptions call) {
  return MUSTER_RPC(DescribeJob, DescribeJobRequest, DescribeJobResponse, true);
}
absl::StatusOr<pb::CloseJobResponse> Client::CloseJob(const pb::CloseJobRequest& request,
                                                      CallOptions call) {
  return MUSTER_RPC(CloseJob, CloseJobRequest, CloseJobResponse, false);
}

#undef MUSTER_RPC

// ---------------------------------------------------------------- health

std::string ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kUnknown:
      return "UNKNOWN";
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
  }
  return absl::StrCat("UNRECOGNIZED(", static_cast<int>(status), ")");
}

absl::StatusOr<ServingStatus> Client::CheckHealth(const std::string& service, CallOptions call) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  absl::StatusOr<grpc::health::v1::HealthCheckResponse> response =
      Call<grpc::health::v1::HealthCheckResponse>(
          "Health/Check", true, absl::ZeroDuration(), call,
          [&](grpc::ClientContext* context, grpc::health::v1::HealthCheckResponse* out, absl::Time,
              absl::Duration) { return stub->Check(context, request, out); });
  if (!response.ok()) return response.status();
  return static_cast<ServingStatus>(response->status());
}

}  // namespace muster::rdzv
