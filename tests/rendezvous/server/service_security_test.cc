// TLS, mTLS, the bearer token and job secrets, the quota of jobs per
// identity, and who may reach /metrics, against an in-process server.
// Certificates are made at test time with the openssl CLI.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include <httplib.h>
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>

#include "absl/strings/match.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

#include "tests/rendezvous/server/service_test_util.h"

namespace muster::rdzv::testing {
namespace {

constexpr char kToken[] = "s3cr3t-token";

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
  REQUIRE(out.good());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// A CA, a server certificate for localhost/127.0.0.1 and a client
// certificate, all signed by the CA, written into `dir`.
void MakeCertificates(const std::string& dir) {
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string sign = " -CA ca.crt -CAkey ca.key -CAcreateserial -days 2";
  std::string script = "set -e; cd '" + dir +
                       "';"
                       "openssl req -x509 " +
                       key +
                       " -keyout ca.key -out ca.crt -days 2 -subj /CN=muster-test-ca;"
                       "openssl req " +
                       key +
                       " -keyout server.key -out server.csr -subj /CN=localhost;"
                       "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n"
                       "extendedKeyUsage=serverAuth\\n' > server.ext;"
                       "openssl x509 -req -in server.csr -out server.crt -extfile server.ext" +
                       sign +
                       ";"
                       "openssl req " +
                       key +
                       " -keyout client.key -out client.csr -subj /CN=muster-client;"
                       "printf 'extendedKeyUsage=clientAuth\\n' > client.ext;"
                       "openssl x509 -req -in client.csr -out client.crt -extfile client.ext" +
                       sign + ";";
  std::string command = "sh -c \"" + script + "\" >/dev/null 2>&1";
  // The script holds single quotes only; double quotes would break it.
  REQUIRE(script.find('"') == std::string::npos);
  REQUIRE(std::system(command.c_str()) == 0);
}

std::shared_ptr<grpc::ChannelCredentials> TlsClient(const std::string& dir, bool with_client_cert) {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ReadFile(dir + "/ca.crt");
  if (with_client_cert) {
    options.pem_private_key = ReadFile(dir + "/client.key");
    options.pem_cert_chain = ReadFile(dir + "/client.crt");
  }
  return grpc::SslCredentials(options);
}

grpc::StatusCode ListJobsCode(Stub& stub, const CallOptions& options) {
  pb::ListJobsResponse jobs;
  return stub.ListJobs(Context(options).get(), pb::ListJobsRequest(), &jobs).error_code();
}

CallOptions WithToken(const std::string& token, const std::string& secret = "") {
  CallOptions options;
  options.token = token;
  options.secret = secret;
  options.timeout = absl::Seconds(5);
  return options;
}

TEST_CASE("TLS with a bearer token and job secrets") {
  TempDir dir;
  MakeCertificates(dir.path());
  WriteFile(dir.path() + "/token", std::string("  ") + kToken + " \n");
  ServerOptions options = LocalOptions();
  options.tls_cert_file = dir.path() + "/server.crt";
  options.tls_key_file = dir.path() + "/server.key";
  options.token_file = dir.path() + "/token";
  std::unique_ptr<Server> server = StartOrFail(options);

  std::unique_ptr<Stub> plaintext = StubFor(*server);
  CHECK(ListJobsCode(*plaintext, WithToken(kToken)) == grpc::StatusCode::UNAVAILABLE);

  std::unique_ptr<Stub> stub = StubFor(*server, TlsClient(dir.path(), false));
  CHECK(ListJobsCode(*stub, WithToken("")) == grpc::StatusCode::UNAUTHENTICATED);
  CHECK(ListJobsCode(*stub, WithToken("wrong-token")) == grpc::StatusCode::UNAUTHENTICATED);
  CHECK(ListJobsCode(*stub, WithToken(kToken)) == grpc::StatusCode::OK);

  // A job created with a secret.
  pb::JoinResponse joined;
  grpc::Status status = stub->Join(Context(WithToken(kToken, "job-pass")).get(),
                                   JoinRequestFor("job-sec", 1, 1), &joined);
  INFO(status.error_message());
  REQUIRE(status.ok());
  pb::JoinResponse ignored;
  CHECK(stub->Join(Context(WithToken("")).get(), JoinRequestFor("job-sec", 1, 1), &ignored)
            .error_code() == grpc::StatusCode::UNAUTHENTICATED);

  auto describe_code = [&](const CallOptions& call) {
    pb::DescribeJobRequest request;
    request.set_job_id("job-sec");
    pb::DescribeJobResponse response;
    return stub->DescribeJob(Context(call).get(), request, &response).error_code();
  };
  CHECK(describe_code(WithToken(kToken)) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(describe_code(WithToken(kToken, "not-the-pass")) == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(describe_code(WithToken(kToken, "job-pass")) == grpc::StatusCode::OK);

  // The listing shows a job with a secret only to callers holding it; the
  // others learn how many they do not see.
  auto listed = [&](const CallOptions& call) {
    pb::ListJobsResponse jobs;
    REQUIRE(stub->ListJobs(Context(call).get(), pb::ListJobsRequest(), &jobs).ok());
    return jobs;
  };
  pb::ListJobsResponse without = listed(WithToken(kToken));
  CHECK(without.jobs_size() == 0);
  CHECK(without.hidden() == 1);
  pb::ListJobsResponse with = listed(WithToken(kToken, "job-pass"));
  REQUIRE(with.jobs_size() == 1);
  CHECK(with.jobs(0).job_id() == "job-sec");
  CHECK(with.hidden() == 0);

  auto any_state = [](const pb::JobState&) { return true; };
  WatchResult unauthenticated = WatchUntil(*stub, "job-sec", any_state, WithToken(""));
  CHECK(unauthenticated.status.error_code() == grpc::StatusCode::UNAUTHENTICATED);
  WatchResult no_secret = WatchUntil(*stub, "job-sec", any_state, WithToken(kToken));
  CHECK(no_secret.status.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  WatchResult allowed = WatchUntil(*stub, "job-sec", any_state, WithToken(kToken, "job-pass"));
  INFO(allowed.status.error_message());
  CHECK(allowed.matched.has_value());
}

// The server's log while it lives: spdlog's default logger writes to a
// stream that any thread may read through Text().
class CapturedLog {
 public:
  CapturedLog() : previous_(spdlog::default_logger()) {
    spdlog::set_default_logger(std::make_shared<spdlog::logger>(
        "captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(text_)));
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }
  std::string Text() {
    spdlog::default_logger()->flush();
    // The sink writes under its own mutex; a copy taken while it writes
    // may end mid-line, which the callers' searches tolerate.
    return text_.str();
  }

 private:
  std::ostringstream text_;
  std::shared_ptr<spdlog::logger> previous_;
};

// Polls `condition` until it holds or `timeout` passes: for a server that
// looks at its files on its own schedule.
bool Eventually(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// Replaces `path` the way tools that rotate secrets do: a new file renamed
// over the old, so no reader sees it half-written.
void Replace(const std::string& path, const std::string& contents) {
  WriteFile(path + ".new", contents);
  REQUIRE(std::rename((path + ".new").c_str(), path.c_str()) == 0);
}

TEST_CASE("the token file is read again when it changes: rotation without a restart") {
  CapturedLog log;
  TempDir dir;
  const std::string token_file = dir.path() + "/token";
  WriteFile(token_file, "# the rendezvous token\nold-token\n");
  ServerOptions options = LocalOptions();
  options.token_file = token_file;
  options.credentials_refresh = absl::Milliseconds(1);
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);
  auto code = [&](const std::string& token) { return ListJobsCode(*stub, WithToken(token)); };
  CHECK(code("old-token") == grpc::StatusCode::OK);
  CHECK(code("# the rendezvous token") == grpc::StatusCode::UNAUTHENTICATED);  // a comment
  CHECK(code("new-token") == grpc::StatusCode::UNAUTHENTICATED);

  // 1. The server accepts both while the clients move to the new token.
  Replace(token_file, "old-token\nnew-token\n");
  REQUIRE(Eventually([&] { return code("new-token") == grpc::StatusCode::OK; }, absl::Seconds(10)));
  CHECK(code("old-token") == grpc::StatusCode::OK);
  // 2. Then the old one goes. Edited in place this time (same inode).
  WriteFile(token_file, "new-token\n");
  REQUIRE(Eventually([&] { return code("old-token") == grpc::StatusCode::UNAUTHENTICATED; },
                     absl::Seconds(10)));
  CHECK(code("new-token") == grpc::StatusCode::OK);
  CHECK(absl::StrContains(
      log.Text(), "token file '" + token_file + "' changed: 1 token(s) accepted now, 2 before"));

  // A bad edit (no token left, or the file gone) locks no one out: the
  // tokens before stay, and the log says why. The server looks at the file
  // when a call comes, so each poll makes one.
  auto logged = [&](const std::string& what) {
    return Eventually(
        [&] {
          (void)code("new-token");
          return absl::StrContains(log.Text(), what);
        },
        absl::Seconds(10));
  };
  Replace(token_file, "\n# nothing here\n");
  REQUIRE(logged("holds no token"));
  CHECK(code("new-token") == grpc::StatusCode::OK);
  CHECK(absl::StrContains(log.Text(), "token file '" + token_file +
                                          "' holds no token; expected a bearer token a line "
                                          "(changed); still accepting the 1 token(s) read before"));
  REQUIRE(std::remove(token_file.c_str()) == 0);
  REQUIRE(logged("cannot read token file"));
  CHECK(code("new-token") == grpc::StatusCode::OK);
  // Fixed: read again.
  WriteFile(token_file, "third-token\n");
  REQUIRE(
      Eventually([&] { return code("third-token") == grpc::StatusCode::OK; }, absl::Seconds(10)));
  CHECK(code("new-token") == grpc::StatusCode::UNAUTHENTICATED);
}

TEST_CASE("new connections get the TLS certificate the files hold now") {
  TempDir dir;
  for (const char* set : {"a", "b"}) {
    std::filesystem::create_directories(dir.path() + "/" + set);
    MakeCertificates(dir.path() + "/" + set);  // two CAs, a server certificate each
  }
  const std::string live = dir.path() + "/live";
  std::filesystem::create_directories(live);
  for (const char* file : {"server.crt", "server.key"}) {
    Replace(live + "/" + file, ReadFile(dir.path() + "/a/" + file));
  }
  ServerOptions options = LocalOptions();
  options.tls_cert_file = live + "/server.crt";
  options.tls_key_file = live + "/server.key";
  options.credentials_refresh = absl::Seconds(1);  // gRPC's watcher: whole seconds
  std::unique_ptr<Server> server = StartOrFail(options);
  // A fresh channel each time: a new handshake sees the certificate now.
  CallOptions quick;
  quick.timeout = absl::Milliseconds(500);
  auto trusting = [&](const char* set) {
    return ListJobsCode(*StubFor(*server, TlsClient(dir.path() + "/" + set, false)), quick);
  };
  CHECK(trusting("a") == grpc::StatusCode::OK);
  CHECK(trusting("b") != grpc::StatusCode::OK);

  // The certificate is renewed (here by another CA): key first, then the
  // certificate, each renamed into place. The watcher takes the pair only
  // once the two match.
  Replace(live + "/server.key", ReadFile(dir.path() + "/b/server.key"));
  Replace(live + "/server.crt", ReadFile(dir.path() + "/b/server.crt"));
  REQUIRE(Eventually([&] { return trusting("b") == grpc::StatusCode::OK; }, absl::Seconds(15)));
  CHECK(trusting("a") != grpc::StatusCode::OK);
}

TEST_CASE("mTLS refuses a client without a certificate") {
  TempDir dir;
  MakeCertificates(dir.path());
  ServerOptions options = LocalOptions();
  options.tls_cert_file = dir.path() + "/server.crt";
  options.tls_key_file = dir.path() + "/server.key";
  options.tls_client_ca_file = dir.path() + "/ca.crt";
  std::unique_ptr<Server> server = StartOrFail(options);

  std::unique_ptr<Stub> without = StubFor(*server, TlsClient(dir.path(), false));
  CHECK(ListJobsCode(*without, WithToken("")) == grpc::StatusCode::UNAVAILABLE);
  std::unique_ptr<Stub> with = StubFor(*server, TlsClient(dir.path(), true));
  CHECK(ListJobsCode(*with, WithToken("")) == grpc::StatusCode::OK);
}

TEST_CASE("credential files that cannot be used fail Start, naming the file") {
  TempDir dir;
  ServerOptions options = LocalOptions();

  SECTION("empty token file") {
    options.token_file = dir.path() + "/empty-token";
    WriteFile(options.token_file, " \n\t");
  }
  SECTION("missing token file") { options.token_file = dir.path() + "/no-such-token"; }
  SECTION("missing certificate") {
    options.tls_cert_file = dir.path() + "/no-such.crt";
    options.tls_key_file = dir.path() + "/no-such.key";
    WriteFile(options.tls_key_file, "-----BEGIN PRIVATE KEY-----\n");
  }
  SECTION("a key that is not the certificate's") {
    // gRPC would serve with it and fail every handshake after.
    MakeCertificates(dir.path());
    options.tls_cert_file = dir.path() + "/server.crt";
    options.tls_key_file = dir.path() + "/client.key";
  }
  SECTION("a client CA that does not load") {
    // gRPC would serve and refuse every client, naming no file.
    MakeCertificates(dir.path());
    options.tls_cert_file = dir.path() + "/server.crt";
    options.tls_key_file = dir.path() + "/server.key";
    options.tls_client_ca_file = dir.path() + "/corrupt-ca.crt";
    WriteFile(options.tls_client_ca_file,
              ReadFile(dir.path() + "/ca.crt").substr(0, 300) + "\n-----END CERTIFICATE-----\n");
  }
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  REQUIRE(!server.ok());
  CHECK(server.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(server.status().message().find(dir.path()) != std::string::npos);
}

TEST_CASE("a server certificate out of its validity dates is served with a warning") {
  TempDir dir;
  MakeCertificates(dir.path());
  // `openssl ca` is the CLI that sets both dates; x509 -req only counts days from now.
  const std::string script =
      "set -e; cd '" + dir.path() +
      "'; mkdir db; touch db/index; echo 01 > db/serial;"
      "printf "
      "'[ca]\\ndefault_ca=c\\n[c]\\ndatabase=db/index\\nnew_certs_dir=db\\nunique_subject=no\\n"
      "serial=db/serial\\ndefault_md=sha256\\npolicy=p\\n[p]\\ncommonName=supplied\\n' > ca.cnf;"
      "openssl ca -batch -config ca.cnf -cert ca.crt -keyfile ca.key -in server.csr "
      "-out old.crt -startdate 20000101000000Z -enddate 20010101000000Z;"
      "openssl ca -batch -config ca.cnf -cert ca.crt -keyfile ca.key -in server.csr "
      "-out future.crt -startdate 20990101000000Z -enddate 21000101000000Z;";
  REQUIRE(std::system(("sh -c \"" + script + "\" >/dev/null 2>&1").c_str()) == 0);
  ServerOptions options = LocalOptions();
  options.tls_key_file = dir.path() + "/server.key";
  std::string expected;
  SECTION("expired") {
    options.tls_cert_file = dir.path() + "/old.crt";
    expected = "' expired on Jan  1 00:00:00 2001 GMT";
  }
  SECTION("not valid yet") {
    options.tls_cert_file = dir.path() + "/future.crt";
    expected = "' is not valid until Jan  1 00:00:00 2099 GMT";
  }
  SECTION("valid") { options.tls_cert_file = dir.path() + "/server.crt"; }
  CapturedLog log;
  std::unique_ptr<Server> server = StartOrFail(options);
  INFO(log.Text());
  if (expected.empty()) {
    CHECK(log.Text().find("TLS certificate") == std::string::npos);
  } else {
    CHECK(log.Text().find("TLS certificate '" + options.tls_cert_file + expected) !=
          std::string::npos);
  }
}

grpc::StatusCode CreateJob(Stub& stub, const std::string& job_id, const std::string& secret,
                           std::string* message = nullptr) {
  CallOptions call;
  call.secret = secret;
  pb::JoinResponse joined;
  grpc::Status status = stub.Join(Context(call).get(), JoinRequestFor(job_id, 2, 2), &joined);
  if (message != nullptr) *message = status.error_message();
  return status.error_code();
}

TEST_CASE("one identity cannot fill the server with jobs") {
  ServerOptions options = LocalOptions();
  options.max_jobs_per_identity = 2;
  options.limits.closed_retention = absl::ZeroDuration();
  std::unique_ptr<Server> server = StartOrFail(options);
  std::unique_ptr<Stub> stub = StubFor(*server);

  CHECK(CreateJob(*stub, "a-1", "tenant-a") == grpc::StatusCode::OK);
  CHECK(CreateJob(*stub, "a-2", "tenant-a") == grpc::StatusCode::OK);
  std::string message;
  CHECK(CreateJob(*stub, "a-3", "tenant-a", &message) == grpc::StatusCode::RESOURCE_EXHAUSTED);
  INFO(message);
  CHECK(message.find("2 jobs") != std::string::npos);
  CHECK(message.find("per identity") != std::string::npos);
  CHECK(message.find("the limit is 2 (rendezvous --max-jobs-per-identity)") != std::string::npos);
  CHECK(message.find("tenant-a") == std::string::npos);  // never echo a secret
  // Joining a job that exists is not creating one.
  CHECK(CreateJob(*stub, "a-1", "tenant-a") == grpc::StatusCode::OK);
  // Other identities are untouched; callers without a secret share one.
  CHECK(CreateJob(*stub, "b-1", "tenant-b") == grpc::StatusCode::OK);
  CHECK(CreateJob(*stub, "anon-1", "") == grpc::StatusCode::OK);
  CHECK(CreateJob(*stub, "anon-2", "") == grpc::StatusCode::OK);
  CHECK(CreateJob(*stub, "anon-3", "") == grpc::StatusCode::RESOURCE_EXHAUSTED);

  // A job that is closed and dropped frees its place.
  CallOptions as_a;
  as_a.secret = "tenant-a";
  pb::CloseJobRequest close;
  close.set_job_id("a-1");
  pb::CloseJobResponse closed;
  REQUIRE(stub->CloseJob(Context(as_a).get(), close, &closed).ok());
  grpc::StatusCode again = grpc::StatusCode::UNKNOWN;
  for (absl::Time give_up = absl::Now() + absl::Seconds(5); absl::Now() < give_up;
       absl::SleepFor(absl::Milliseconds(20))) {
    again = CreateJob(*stub, "a-3", "tenant-a");
    if (again == grpc::StatusCode::OK) break;
  }
  CHECK(again == grpc::StatusCode::OK);
}

// Connects a plain TCP socket; -1 if refused.
int ConnectTcp(const char* host, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  inet_pton(AF_INET, host, &address.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int MetricsStatus(const Server& server, const std::string& authorization = "") {
  httplib::Client http("127.0.0.1", server.metrics_port());
  http.set_connection_timeout(5);
  http.set_read_timeout(5);
  httplib::Headers headers;
  if (!authorization.empty()) headers.emplace("Authorization", authorization);
  httplib::Result scraped = http.Get("/metrics", headers);
  return scraped ? scraped->status : -1;
}

TEST_CASE("/metrics listens on the gRPC listen host by default") {
  ServerOptions options = LocalOptions();  // 127.0.0.1:0
  options.metrics_port = -1;
  std::unique_ptr<Server> server = StartOrFail(options);
  REQUIRE(server->metrics_port() > 0);
  CHECK(MetricsStatus(*server) == 200);
  // Another loopback address reaches a wildcard socket, not this one.
  int other = ConnectTcp("127.0.0.2", server->metrics_port());
  if (other >= 0) close(other);
  CHECK(other < 0);
}

TEST_CASE("/metrics refuses connections beyond its cap with 503") {
  ServerOptions options = LocalOptions();
  options.metrics_port = -1;
  options.metrics_max_connections = 2;
  std::unique_ptr<Server> server = StartOrFail(options);
  std::vector<int> idle;
  for (int i = 0; i < 2; ++i) {
    idle.push_back(ConnectTcp("127.0.0.1", server->metrics_port()));
    REQUIRE(idle.back() >= 0);
  }
  absl::SleepFor(absl::Milliseconds(200));  // both accepted and being read
  const absl::Time start = absl::Now();
  CHECK(MetricsStatus(*server) == 503);
  CHECK(absl::Now() - start < absl::Seconds(2));
  for (int fd : idle) close(fd);
  int status = -1;
  for (absl::Time give_up = absl::Now() + absl::Seconds(5); absl::Now() < give_up && status != 200;
       absl::SleepFor(absl::Milliseconds(20))) {
    status = MetricsStatus(*server);
  }
  CHECK(status == 200);
}

TEST_CASE("/metrics can require the bearer token") {
  TempDir dir;
  WriteFile(dir.path() + "/token", kToken);
  ServerOptions options = LocalOptions();
  options.metrics_port = -1;
  options.metrics_require_token = true;

  SECTION("without a token file the server does not start") {
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
    REQUIRE(!server.ok());
    CHECK(server.status().code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("with one, a scrape must present it") {
    options.token_file = dir.path() + "/token";
    std::unique_ptr<Server> server = StartOrFail(options);
    CHECK(MetricsStatus(*server) == 401);
    CHECK(MetricsStatus(*server, "Bearer wrong") == 401);
    CHECK(MetricsStatus(*server, kToken) == 401);
    CHECK(MetricsStatus(*server, std::string("Bearer ") + kToken) == 200);
  }
}

}  // namespace
}  // namespace muster::rdzv::testing
