// TLS, mTLS, the bearer token and job secrets, against an in-process
// server. Certificates are made at test time with the openssl CLI.
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <catch2/catch.hpp>

#include "tests/rendezvous/service_test_util.h"

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
  std::string script =
      "set -e; cd '" + dir + "';"
      "openssl req -x509 " + key +
      " -keyout ca.key -out ca.crt -days 2 -subj /CN=muster-test-ca;"
      "openssl req " + key +
      " -keyout server.key -out server.csr -subj /CN=localhost;"
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n"
      "extendedKeyUsage=serverAuth\\n' > server.ext;"
      "openssl x509 -req -in server.csr -out server.crt -extfile server.ext" +
      sign + ";"
      "openssl req " + key +
      " -keyout client.key -out client.csr -subj /CN=muster-client;"
      "printf 'extendedKeyUsage=clientAuth\\n' > client.ext;"
      "openssl x509 -req -in client.csr -out client.crt -extfile client.ext" +
      sign + ";";
  std::string command = "sh -c \"" + script + "\" >/dev/null 2>&1";
  // The script holds single quotes only; double quotes would break it.
  REQUIRE(script.find('"') == std::string::npos);
  REQUIRE(std::system(command.c_str()) == 0);
}

std::shared_ptr<grpc::ChannelCredentials> TlsClient(const std::string& dir,
                                                    bool with_client_cert) {
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
  return stub.ListJobs(Context(options).get(), pb::ListJobsRequest(), &jobs)
      .error_code();
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
  CHECK(ListJobsCode(*plaintext, WithToken(kToken)) ==
        grpc::StatusCode::UNAVAILABLE);

  std::unique_ptr<Stub> stub = StubFor(*server, TlsClient(dir.path(), false));
  CHECK(ListJobsCode(*stub, WithToken("")) ==
        grpc::StatusCode::UNAUTHENTICATED);
  CHECK(ListJobsCode(*stub, WithToken("wrong-token")) ==
        grpc::StatusCode::UNAUTHENTICATED);
  CHECK(ListJobsCode(*stub, WithToken(kToken)) == grpc::StatusCode::OK);

  // A job created with a secret.
  pb::JoinResponse joined;
  grpc::Status status = stub->Join(Context(WithToken(kToken, "job-pass")).get(),
                                   JoinRequestFor("job-sec", 1, 1), &joined);
  INFO(status.error_message());
  REQUIRE(status.ok());
  pb::JoinResponse ignored;
  CHECK(stub->Join(Context(WithToken("")).get(),
                   JoinRequestFor("job-sec", 1, 1), &ignored)
            .error_code() == grpc::StatusCode::UNAUTHENTICATED);

  auto describe_code = [&](const CallOptions& call) {
    pb::DescribeJobRequest request;
    request.set_job_id("job-sec");
    pb::DescribeJobResponse response;
    return stub->DescribeJob(Context(call).get(), request, &response)
        .error_code();
  };
  CHECK(describe_code(WithToken(kToken)) ==
        grpc::StatusCode::PERMISSION_DENIED);
  CHECK(describe_code(WithToken(kToken, "not-the-pass")) ==
        grpc::StatusCode::PERMISSION_DENIED);
  CHECK(describe_code(WithToken(kToken, "job-pass")) == grpc::StatusCode::OK);

  auto any_state = [](const pb::JobState&) { return true; };
  WatchResult unauthenticated =
      WatchUntil(*stub, "job-sec", any_state, WithToken(""));
  CHECK(unauthenticated.status.error_code() ==
        grpc::StatusCode::UNAUTHENTICATED);
  WatchResult no_secret =
      WatchUntil(*stub, "job-sec", any_state, WithToken(kToken));
  CHECK(no_secret.status.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  WatchResult allowed =
      WatchUntil(*stub, "job-sec", any_state, WithToken(kToken, "job-pass"));
  INFO(allowed.status.error_message());
  CHECK(allowed.matched.has_value());
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
  SECTION("missing token file") {
    options.token_file = dir.path() + "/no-such-token";
  }
  SECTION("missing certificate") {
    options.tls_cert_file = dir.path() + "/no-such.crt";
    options.tls_key_file = dir.path() + "/no-such.key";
    WriteFile(options.tls_key_file, "-----BEGIN PRIVATE KEY-----\n");
  }
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  REQUIRE(!server.ok());
  CHECK(server.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(server.status().message().find(dir.path()) != std::string::npos);
}

}  // namespace
}  // namespace muster::rdzv::testing
