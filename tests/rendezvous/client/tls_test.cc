// The client's TLS options against a TLS / mTLS server, and what a client
// whose handshake fails is told. Certificates are made at test time with
// the openssl CLI.
#include <cstdlib>
#include <filesystem>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rendezvous/client/client.h"
#include "rendezvous/server/server.h"
#include "tests/rendezvous/client/test_util.h"

namespace muster::rdzv {
namespace {

// A CA, a server certificate for localhost/127.0.0.1, one for another
// name only (elsewhere.crt) and a client certificate, all signed by the
// CA, written into a fresh directory.
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
      " -keyout elsewhere.key -out elsewhere.csr -subj /CN=elsewhere.example;"
      "printf 'subjectAltName=DNS:elsewhere.example\\n"
      "extendedKeyUsage=serverAuth\\n' > elsewhere.ext;"
      "openssl x509 -req -in elsewhere.csr -out elsewhere.crt -extfile elsewhere.ext" +
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

TEST_CASE("A client reads its TLS files again when they change", "[client][tls]") {
  // Two CAs, each with a server and a client certificate.
  const std::string a = MakeCertificates(), b = MakeCertificates();
  REQUIRE(a != b);
  const std::string live = a + "/live";
  std::filesystem::create_directories(live);
  // Renamed into place, as tools that renew certificates write them.
  auto install = [&](const std::string& from) {
    for (const char* file : {"ca.crt", "client.crt", "client.key"}) {
      std::filesystem::copy_file(from + "/" + file, live + "/" + file + ".new",
                                 std::filesystem::copy_options::overwrite_existing);
      std::filesystem::rename(live + "/" + file + ".new", live + "/" + file);
    }
  };
  install(a);
  auto serve = [](const std::string& set, int port) {
    ServerOptions server_options;
    server_options.listen_address = absl::StrCat("127.0.0.1:", port);
    server_options.tls_cert_file = set + "/server.crt";
    server_options.tls_key_file = set + "/server.key";
    server_options.tls_client_ca_file = set + "/ca.crt";
    return testing::StartLocalServer(server_options);
  };
  auto server = serve(a, 0);
  const int port = server->port();

  ClientOptions options;
  options.endpoint = absl::StrCat("127.0.0.1:", port);
  options.rpc_timeout = absl::Seconds(3);
  options.tls_ca_file = live + "/ca.crt";
  options.tls_cert_file = live + "/client.crt";
  options.tls_key_file = live + "/client.key";
  options.credentials_refresh = absl::Seconds(1);
  auto client = Client::Connect(options);
  REQUIRE(client.ok());
  REQUIRE((*client)->ListJobs().ok());

  // Everything is renewed under CA b: the client's files, then the server
  // (restarted on the same port with b's certificate and client CA). The
  // running client's next handshake uses b's files; one that kept a's, as
  // a client that read its files once does, is refused.
  install(b);
  server.reset();
  server = serve(b, port);
  CHECK(testing::Eventually([&] { return (*client)->ListJobs().ok(); }, absl::Seconds(20)));
  ClientOptions stale = options;
  for (auto [path, file] :
       {std::pair{&stale.tls_ca_file, "ca.crt"}, std::pair{&stale.tls_cert_file, "client.crt"},
        std::pair{&stale.tls_key_file, "client.key"}}) {
    *path = a + "/" + file;
  }
  CallOptions short_call;
  short_call.timeout = absl::Milliseconds(500);
  CHECK_FALSE((*Client::Connect(stale))->ListJobs({}, short_call).ok());
}

TEST_CASE("A client that cannot make its TLS handshake is told why", "[client][tls]") {
  const std::string dir = MakeCertificates(), other = MakeCertificates();
  auto serve = [&](const std::string& cert, bool mtls) {
    ServerOptions server_options;
    server_options.tls_cert_file = dir + "/" + cert + ".crt";
    server_options.tls_key_file = dir + "/" + cert + ".key";
    if (mtls) server_options.tls_client_ca_file = dir + "/ca.crt";
    return testing::StartLocalServer(server_options);
  };
  auto tls = serve("server", false), mtls = serve("server", true);
  auto misnamed = serve("elsewhere", false);
  auto plaintext = testing::StartLocalServer();
  auto gone = testing::StartLocalServer();
  const int gone_port = gone->port();
  gone->Shutdown(absl::Seconds(1));
  gone.reset();

  struct Case {
    const char* what;
    int port;
    std::string ca;        // tls_ca; none (and no use_tls): no TLS
    std::string cert_dir;  // of the client certificate; none: no mTLS
    std::string says;      // the message, before gRPC's own words
    const char* grpc_says;
    bool use_tls = false;  // with no tls_ca: the system's CAs
  };
  const std::string ca = dir + "/ca.crt";
  auto server_at = [](int port) {
    return absl::StrCat("the rendezvous server at 127.0.0.1:", port);
  };
  auto handshake = [&](int port) {
    return absl::StrCat("ListJobs: TLS handshake with ", server_at(port), " failed: ");
  };
  const Case cases[] = {
      {"a CA that did not sign the server's certificate", tls->port(), other + "/ca.crt", "",
       handshake(tls->port()) +
           "its certificate did not verify (certificate verify failed): is tls_ca the CA "
           "that signed the server's certificate, and is that certificate within its dates?",
       "certificate verify failed"},
      {"the system's CAs, none of which signed the server's certificate", tls->port(), "", "",
       handshake(tls->port()) +
           "its certificate did not verify (certificate verify failed): no tls_ca is given, so "
           "it must chain to a CA this system trusts; give tls_ca, the CA that signed the "
           "server's certificate",
       "Ssl handshake failed", true},
      {"TLS to a server without", plaintext->port(), ca, "",
       handshake(plaintext->port()) +
           "the server answered without TLS (wrong version number): it serves plaintext; "
           "give no tls_ca, tls_cert or tls_key, or start it with --tls-cert and --tls-key",
       "wrong version number"},
      {"no TLS to a server with", tls->port(), "", "",
       absl::StrCat("ListJobs: ", server_at(tls->port()),
                    " closed the connection before speaking gRPC: it likely serves TLS, "
                    "which this client does not; give tls_ca, the CA that signed the "
                    "server's certificate"),
       "Socket closed"},
      {"a certificate for another name", misnamed->port(), ca, "",
       handshake(misnamed->port()) +
           "its certificate does not name \"127.0.0.1\": connect by a name or address that "
           "the certificate lists",
       "Hostname Verification Check failed"},
      {"no client certificate for mTLS", mtls->port(), ca, "",
       absl::StrCat("ListJobs: ", server_at(mtls->port()),
                    " closed the connection during the TLS handshake: it likely requires a "
                    "client certificate (mTLS); give tls_cert and tls_key"),
       "Socket closed"},
      {"a client certificate from another CA", mtls->port(), ca, other,
       absl::StrCat("ListJobs: ", server_at(mtls->port()),
                    " closed the connection during the TLS handshake: it likely does not "
                    "trust this client's certificate; is tls_cert signed by the CA that the "
                    "server's --tls-client-ca names?"),
       "Socket closed"},
      // Nobody listens: no handshake began, and no TLS cause is made up.
      {"no server", gone_port, ca, "",
       absl::StrCat("ListJobs: no connection to ", server_at(gone_port), " within 3s"),
       "Connection refused"},
  };

  // Each call waits out its deadline (gRPC queues it while the handshake
  // fails), so the cases run at once.
  std::vector<std::future<absl::Status>> results;
  for (const Case& c : cases) {
    ClientOptions options;
    options.endpoint = absl::StrCat("127.0.0.1:", c.port);
    options.rpc_timeout = absl::Seconds(3);
    options.tls_ca_file = c.ca;
    options.use_tls = c.use_tls;
    if (!c.cert_dir.empty()) {
      options.tls_cert_file = c.cert_dir + "/client.crt";
      options.tls_key_file = c.cert_dir + "/client.key";
    }
    auto client = Client::Connect(options);
    REQUIRE(client.ok());
    results.push_back(std::async(
        std::launch::async, [client = *std::move(client)] { return client->ListJobs().status(); }));
  }
  for (size_t i = 0; i < results.size(); ++i) {
    const Case& c = cases[i];
    const absl::Status status = results[i].get();
    const std::string message(status.message());
    INFO(c.what << ": " << message);
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK(absl::StartsWith(message, c.says + " ("));
    CHECK(message.find(c.grpc_says, c.says.size()) != std::string::npos);
  }
}

}  // namespace
}  // namespace muster::rdzv
