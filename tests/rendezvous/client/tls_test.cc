// The client's TLS options against a TLS / mTLS server. Certificates are
// made at test time with the openssl CLI.
#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "rendezvous/client/client.h"
#include "rendezvous/server/server.h"
#include "tests/rendezvous/client/test_util.h"

namespace muster::rdzv {
namespace {

// A CA, a server certificate for localhost/127.0.0.1 and a client
// certificate, all signed by the CA, written into a fresh directory.
std::string MakeCertificates() {
  const std::string dir =
      absl::StrCat(testing::TempDir(), "/client_tls_", absl::ToUnixMicros(absl::Now()));
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string sign = " -CA ca.crt -CAkey ca.key -CAcreateserial -days 2";
  const std::string script =
      "set -e; mkdir -p '" + dir + "'; cd '" + dir +
      "';"
      "openssl req -x509 " +
      key +
      " -keyout ca.key -out ca.crt -days 2 -subj /CN=client-test-ca;"
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
      " -keyout client.key -out client.csr -subj /CN=client;"
      "printf 'extendedKeyUsage=clientAuth\\n' > client.ext;"
      "openssl x509 -req -in client.csr -out client.crt -extfile client.ext" +
      sign + ";";
  REQUIRE(script.find('"') == std::string::npos);
  REQUIRE(std::system(("sh -c \"" + script + "\" >/dev/null 2>&1").c_str()) == 0);
  return dir;
}

TEST_CASE("Client speaks mTLS with CA, certificate and key files", "[client][tls]") {
  const std::string dir = MakeCertificates();
  ServerOptions server_options;
  server_options.tls_cert_file = dir + "/server.crt";
  server_options.tls_key_file = dir + "/server.key";
  server_options.tls_client_ca_file = dir + "/ca.crt";
  auto server = testing::StartLocalServer(server_options);

  ClientOptions options;
  options.endpoint = absl::StrCat("127.0.0.1:", server->port());
  options.rpc_timeout = absl::Seconds(3);
  options.tls_ca_file = dir + "/ca.crt";
  options.tls_cert_file = dir + "/client.crt";
  options.tls_key_file = dir + "/client.key";
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  CHECK((*client)->ListJobs().ok());

  // The name checked against the server certificate can be overridden.
  ClientOptions by_name = options;
  by_name.tls_server_name = "localhost";
  CHECK((*Client::Connect(by_name))->ListJobs().ok());

  CallOptions short_call;
  short_call.timeout = absl::Milliseconds(500);
  ClientOptions wrong_name = options;
  wrong_name.tls_server_name = "not-the-server.example";
  CHECK_FALSE((*Client::Connect(wrong_name))->ListJobs({}, short_call).ok());

  ClientOptions no_client_cert = options;
  no_client_cert.tls_cert_file.clear();
  no_client_cert.tls_key_file.clear();
  CHECK_FALSE((*Client::Connect(no_client_cert))->ListJobs({}, short_call).ok());

  ClientOptions plaintext;
  plaintext.endpoint = options.endpoint;
  CHECK_FALSE((*Client::Connect(plaintext))->ListJobs({}, short_call).ok());

  ClientOptions missing_ca = options;
  missing_ca.tls_ca_file = dir + "/no-such-ca.crt";
  auto refused = Client::Connect(missing_ca);
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(refused.status().message()).find("no-such-ca.crt") != std::string::npos);
}

}  // namespace
}  // namespace muster::rdzv
