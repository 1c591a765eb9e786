// The C++ client (and so attnctl) against a daemon that requires tokens or mutual TLS: the client's
// token and TLS options get it in, their absence keeps it out, and the health check answers without
// a token.
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/attnd_client.h"
#include "gtest/gtest.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace ops_testing {
namespace {

using client::AttndClient;
using client::ClientOptions;

const std::string kToken = "client-credentials-test-token-42";

std::string WriteTokenFile() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp ? tmp : "/tmp", "/client-tokens.txt");
  std::ofstream(path) << "team-c " << kToken << "\n";
  return path;
}

ClientOptions Quick() {
  ClientOptions o;
  o.connect_timeout = absl::Seconds(5);
  o.rpc_timeout = absl::Seconds(30);
  return o;
}

TEST(ClientCredentialsTest, TokenGetsInAndHealthNeedsNone) {
  ServerOptions server = TinyOptions(8);
  server.auth_token_file = WriteTokenFile();
  Daemon daemon(server);
  ASSERT_TRUE(daemon.ok());

  ClientOptions with = Quick();
  with.token = kToken;
  absl::StatusOr<std::unique_ptr<AttndClient>> good = AttndClient::Connect(daemon.target(), with);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE((*good)->Info().ok());
  absl::StatusOr<std::string> id = (*good)->CreateSequence();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE((*good)->Release(*id).ok());

  absl::StatusOr<std::unique_ptr<AttndClient>> none =
      AttndClient::Connect(daemon.target(), Quick());
  ASSERT_TRUE(none.ok()) << none.status();
  absl::StatusOr<v1::GetServerInfoResponse> refused = (*none)->Info();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  absl::StatusOr<bool> healthy = (*none)->Healthy("");
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  EXPECT_TRUE(*healthy);
  healthy = (*none)->Healthy("attnd.v1.Attention");
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  EXPECT_TRUE(*healthy);
  EXPECT_EQ((*none)->Healthy("no.such.Service").status().code(), absl::StatusCode::kNotFound);

  ClientOptions wrong = Quick();
  wrong.token = "not-the-token";
  absl::StatusOr<std::unique_ptr<AttndClient>> bad = AttndClient::Connect(daemon.target(), wrong);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ((*bad)->CreateSequence().status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(ClientCredentialsTest, MutualTlsNeedsTheClientCertificate) {
  ASSERT_TRUE(Certs::Get().ok()) << "openssl failed to make test certificates";
  const Certs& certs = Certs::Get();
  ServerOptions server = TinyOptions(8);
  server.tls_cert = certs.Path("server.pem");
  server.tls_key = certs.Path("server.key");
  server.tls_client_ca = certs.Path("ca.pem");
  Daemon daemon(server);
  ASSERT_TRUE(daemon.ok());

  ClientOptions mtls = Quick();
  mtls.tls_ca_file = certs.Path("ca.pem");
  mtls.tls_cert_file = certs.Path("client.pem");
  mtls.tls_key_file = certs.Path("client.key");
  absl::StatusOr<std::unique_ptr<AttndClient>> good = AttndClient::Connect(daemon.target(), mtls);
  ASSERT_TRUE(good.ok()) << good.status();
  absl::StatusOr<bool> healthy = (*good)->Healthy("");
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  EXPECT_TRUE(*healthy);
  EXPECT_TRUE((*good)->Info().ok());

  ClientOptions no_cert = Quick();
  no_cert.connect_timeout = absl::Seconds(2);
  no_cert.tls_ca_file = certs.Path("ca.pem");
  absl::StatusOr<std::unique_ptr<AttndClient>> refused =
      AttndClient::Connect(daemon.target(), no_cert);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
}

TEST(ClientCredentialsTest, BadCredentialFilesAreNamed) {
  ClientOptions o = Quick();
  o.tls_ca_file = "/nonexistent/ca.pem";
  absl::StatusOr<std::unique_ptr<AttndClient>> c = AttndClient::Connect("127.0.0.1:1", o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(), "TLS CA file /nonexistent/ca.pem cannot be read");

  o = Quick();
  o.tls_cert_file = "/some/client.pem";
  c = AttndClient::Connect("127.0.0.1:1", o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), "a TLS client certificate needs the server's CA file too");
}

}  // namespace
}  // namespace ops_testing
}  // namespace attnd
