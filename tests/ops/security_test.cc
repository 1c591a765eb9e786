// Tokens, tenants and mutual TLS against the real daemon: UNAUTHENTICATED with the reason in the
// message (and in attnd_auth_failures_total), health open without a token, another tenant's
// sequence indistinguishable from an unknown one and left untouched, and mTLS handshakes that
// only a certificate from --tls-client-ca passes.
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace ops_testing {
namespace {

const std::string kTokenA = "token-of-team-a-0123456789abcdef";
const std::string kTokenB = "token-of-team-b-fedcba9876543210";

std::string WriteTokenFile() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp ? tmp : "/tmp", "/ops-tokens.txt");
  std::ofstream(path) << "# test tokens\nteam-a " << kTokenA << "\nteam-b " << kTokenB << "\n";
  return path;
}

class TokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o = TinyOptions(32);
    o.auth_token_file = WriteTokenFile();
    daemon_ = std::make_unique<Daemon>(o);
    ASSERT_TRUE(daemon_->ok());
    stub_ = daemon_->Stub();
  }
  std::string Metrics() {
    std::optional<std::string> m = HttpGet(daemon_->server().metrics_port(), "/metrics");
    EXPECT_TRUE(m.has_value());
    return m.value_or("");
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

TEST_F(TokenTest, RejectsMissingMalformedAndUnknownTokensAndLeavesHealthOpen) {
  std::string id;
  grpc::Status s = Create(stub_.get(), "", &id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(s.error_message(),
            "missing credentials: send 'authorization: Bearer <token>' metadata");
  s = Create(stub_.get(), "not-a-token-of-anyone-000000", &id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(s.error_message(), "invalid bearer token");
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Basic dXNlcjpwYXNz");
    v1::GetServerInfoResponse info;
    s = stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(s.error_message(), "malformed authorization metadata: expected 'Bearer <token>'");
  }
  // A good token on the same connection still works.
  const std::string a = MustCreate(stub_.get(), kTokenA);
  EXPECT_EQ(a.size(), 32u);

  // Health needs no token, over the same port.
  EXPECT_EQ(HealthStatus(daemon_->Channel(), ""), 1);
  EXPECT_EQ(HealthStatus(daemon_->Channel(), "attnd.v1.Attention"), 1);

  const std::string m = Metrics();
  EXPECT_EQ(SampleOr0(m, "attnd_auth_failures_total{reason=\"missing\"}"), 1);
  EXPECT_EQ(SampleOr0(m, "attnd_auth_failures_total{reason=\"invalid\"}"), 1);
  EXPECT_EQ(SampleOr0(m, "attnd_auth_failures_total{reason=\"malformed\"}"), 1);
  // Rejected calls never reached a handler.
  EXPECT_EQ(SampleOr0(m, "attnd_requests_total{rpc=\"CreateSequence\",code=\"OK\"}"), 1);
  EXPECT_EQ(Sample(m, "attnd_requests_total{rpc=\"CreateSequence\",code=\"UNAUTHENTICATED\"}"),
            std::nullopt);
}

TEST_F(TokenTest, AnotherTenantsSequenceLooksUnknownAndIsLeftAlone) {
  std::mt19937 rng(11);
  const std::string a = MustCreate(stub_.get(), kTokenA);
  {
    v1::PrefillResponse resp;
    auto ctx = Context(kTokenA);
    grpc::Status s = stub_->Prefill(ctx.get(), MakePrefill(a, 0, 20, &rng), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.length(), 20);
  }
  const std::string unknown = "0123456789abcdef0123456789abcdef";
  // Tenant B: the same code, and the same message up to the id, for A's id and for an unknown id.
  for (const std::string& id : {a, unknown}) {
    SCOPED_TRACE(id == a ? "tenant A's sequence" : "unknown sequence");
    v1::PrefillResponse presp;
    auto c1 = Context(kTokenB);
    grpc::Status s = stub_->Prefill(c1.get(), MakePrefill(id, 0, 4, &rng), &presp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(s.error_message(), absl::StrCat("sequence ", id, " not found"));

    v1::DecodeResponse dresp;
    auto c2 = Context(kTokenB);
    s = stub_->Decode(c2.get(), MakeDecode(0, {id}, &rng), &dresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(s.error_message(), absl::StrCat("entries[0]: sequence ", id, " not found"));

    v1::ReleaseSequenceRequest rreq;
    rreq.set_sequence_id(id);
    v1::ReleaseSequenceResponse rresp;
    auto c3 = Context(kTokenB);
    s = stub_->ReleaseSequence(c3.get(), rreq, &rresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(s.error_message(), absl::StrCat("sequence ", id, " not found"));

    // The same on a Session stream.
    auto c4 = Context(kTokenB);
    auto stream = stub_->Session(c4.get());
    v1::SessionRequest sreq;
    *sreq.mutable_prefill() = MakePrefill(id, 0, 4, &rng);
    v1::SessionResponse sresp;
    ASSERT_TRUE(stream->Write(sreq));
    ASSERT_TRUE(stream->Read(&sresp));
    EXPECT_EQ(sresp.code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
    EXPECT_EQ(sresp.message(), absl::StrCat("sequence ", id, " not found"));
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  // A's sequence is unchanged: still 20 tokens in layer 0 (the next decode is token 21), and
  // still A's to release (2 pages).
  {
    v1::DecodeResponse resp;
    auto ctx = Context(kTokenA);
    grpc::Status s = stub_->Decode(ctx.get(), MakeDecode(0, {a}, &rng), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.outputs(0).length(), 21);
  }
  v1::ReleaseSequenceRequest rreq;
  rreq.set_sequence_id(a);
  v1::ReleaseSequenceResponse rresp;
  auto ctx = Context(kTokenA);
  ASSERT_TRUE(stub_->ReleaseSequence(ctx.get(), rreq, &rresp).ok());
  EXPECT_EQ(rresp.pages_freed(), 2);
}

TEST(OpsStartupTest, TokensWithoutTlsOffLoopbackAndBadTokenFilesFailStartup) {
  ServerOptions o = TinyOptions(8);
  o.listen = "0.0.0.0:0";
  o.auth_token_file = WriteTokenFile();
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      server.status().message(),
      "token auth needs TlsOptions::cert_file/key_file unless the listen address is a loopback "
      "address "
      "(bearer tokens would cross the network in clear text); the listen address is 0.0.0.0:0");

  o = TinyOptions(8);
  o.auth_token_file = "/nonexistent/tokens.txt";
  server = AttndServer::Start(o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StartsWith(server.status().message(), "ServerOptions::auth_token_file: "))
      << server.status().message();
  EXPECT_NE(server.status().message().find("/nonexistent/tokens.txt"), absl::string_view::npos)
      << server.status().message();
}

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(OpsStartupTest, WarnsOnceWhenListeningOffLoopbackWithoutTlsOrTokens) {
  ASSERT_TRUE(Certs::Get().ok());
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  spdlog::default_logger()->sinks().push_back(sink);
  {
    ServerOptions o = TinyOptions(8);
    o.listen = "0.0.0.0:0";
    Daemon daemon(o);
    EXPECT_TRUE(daemon.ok());
  }
  const std::string insecure = log.str();
  {
    ServerOptions o = TinyOptions(8);  // loopback
    Daemon daemon(o);
    EXPECT_TRUE(daemon.ok());
    o.listen = "0.0.0.0:0";  // off loopback, with TLS
    o.tls_cert = Certs::Get().Path("server.pem");
    o.tls_key = Certs::Get().Path("server.key");
    Daemon tls_daemon(o);
    EXPECT_TRUE(tls_daemon.ok());
  }
  spdlog::default_logger()->sinks().pop_back();
  EXPECT_EQ(Count(insecure, "INSECURE"), 1) << insecure;
  EXPECT_EQ(Count(insecure,
                  "[warning] INSECURE: ServerOptions::listen 0.0.0.0:0 is not a loopback address "
                  "and neither "
                  "TLS (ServerOptions::tls_cert/ServerOptions::tls_key) nor tokens "
                  "(ServerOptions::auth_token_file) are set: anyone who "
                  "can reach it can read and write every sequence\n"),
            1)
      << insecure;
  EXPECT_EQ(Count(log.str(), "INSECURE"), 1) << log.str();
}

class MutualTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Certs::Get().ok()) << "openssl failed to make test certificates";
    ServerOptions o = TinyOptions(8);
    o.tls_cert = P("server.pem");
    o.tls_key = P("server.key");
    o.tls_client_ca = P("ca.pem");
    daemon_ = std::make_unique<Daemon>(o);
    ASSERT_TRUE(daemon_->ok());
  }
  std::string P(const std::string& name) { return Certs::Get().Path(name); }
  std::shared_ptr<grpc::ChannelCredentials> Ssl(const std::string& ca, const std::string& cert,
                                                const std::string& key) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = Certs::Get().Read(ca);
    if (!cert.empty()) {
      ssl.pem_cert_chain = Certs::Get().Read(cert);
      ssl.pem_private_key = Certs::Get().Read(key);
    }
    return grpc::SslCredentials(ssl);
  }
  grpc::Status TryCreate(std::shared_ptr<grpc::ChannelCredentials> creds) {
    auto stub = daemon_->Stub(std::move(creds));
    std::string id;
    return Create(stub.get(), "", &id);
  }

  std::unique_ptr<Daemon> daemon_;
};

TEST_F(MutualTlsTest, OnlyClientsWithACertificateFromTheClientCaGetIn) {
  grpc::Status s = TryCreate(Ssl("ca.pem", "client.pem", "client.key"));
  EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();

  s = TryCreate(Ssl("ca.pem", "", ""));  // no client certificate
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  s = TryCreate(Ssl("ca.pem", "other-client.pem", "other-client.key"));  // another CA
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  s = TryCreate(grpc::InsecureChannelCredentials());  // plaintext on a TLS port
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  s = TryCreate(Ssl("other-ca.pem", "client.pem", "client.key"));  // server not trusted
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();

  // Only the accepted client's call reached the service.
  std::optional<std::string> m = HttpGet(daemon_->server().metrics_port(), "/metrics");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(SampleOr0(*m, "attnd_requests_total{rpc=\"CreateSequence\",code=\"OK\"}"), 1);
  EXPECT_EQ(Sample(*m, "attnd_live_sequences"), 1);
}

}  // namespace
}  // namespace ops_testing
}  // namespace attnd
