#include "server/rpc/tls.h"

#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/rpc/auth.h"
#include "server/rpc/test_certs.h"

namespace attnd {
namespace {

// Certificates are generated per test run with the openssl CLI (server/rpc/test_certs.h); nothing
// is checked in.
using Certs = TestCerts;

struct CallResult {
  grpc::Status status;
  std::string body;
};

// A unary call with raw bytes (no generated code needed for the health service).
CallResult Call(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                const std::string& token = "") {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  grpc::Slice empty("");
  grpc::ByteBuffer req(&empty, 1), resp;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &req, &resp,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  CallResult result;
  result.status = done.get_future().get();
  std::vector<grpc::Slice> slices;
  if (result.status.ok() && resp.Dump(&slices).ok()) {
    for (const auto& s : slices) {
      result.body.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  return result;
}

constexpr char kHealthCheck[] = "/grpc.health.v1.Health/Check";
const std::string kServing("\x08\x01", 2);     // HealthCheckResponse{status: SERVING}
const std::string kNotServing("\x08\x02", 2);  // HealthCheckResponse{status: NOT_SERVING}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(Certs::Get().ok()) << "openssl failed to make test certs"; }
  std::string P(const std::string& name) { return Certs::Get().Path(name); }

  // Starts a health-only server with `creds` on 127.0.0.1:0.
  void StartServer(std::shared_ptr<grpc::ServerCredentials> creds) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", creds, &port_);
    builder.RegisterCallbackGenericService(&unimplemented_);  // see HealthOnlyServer
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  std::shared_ptr<grpc::Channel> TlsChannel(const TlsClientOptions& options) {
    auto creds = MakeChannelCredentials(options);
    EXPECT_TRUE(creds.ok()) << creds.status();
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), *creds);
  }
  std::shared_ptr<grpc::Channel> PlainChannel() {
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_),
                               grpc::InsecureChannelCredentials());
  }

  grpc::CallbackGenericService unimplemented_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(TlsTest, ServerTlsAcceptsVerifyingClientsOnly) {
  auto creds =
      MakeServerCredentials({P("server.pem"), P("server.key"), ""}, nullptr, "127.0.0.1:0");
  ASSERT_TRUE(creds.ok()) << creds.status();
  StartServer(*creds);

  CallResult r = Call(TlsChannel({P("ca.pem"), "", ""}), kHealthCheck);
  ASSERT_TRUE(r.status.ok()) << r.status.error_code() << " " << r.status.error_message();
  EXPECT_EQ(r.body, kServing);

  r = Call(PlainChannel(), kHealthCheck);  // plaintext against TLS
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);

  r = Call(TlsChannel({P("other-ca.pem"), "", ""}), kHealthCheck);  // cannot verify the server
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificateFromTheClientCa) {
  auto creds =
      MakeServerCredentials({P("server.pem"), P("server.key"), P("ca.pem")}, nullptr, "0.0.0.0:0");
  ASSERT_TRUE(creds.ok()) << creds.status();
  StartServer(*creds);

  CallResult r = Call(TlsChannel({P("ca.pem"), P("client.pem"), P("client.key")}), kHealthCheck);
  ASSERT_TRUE(r.status.ok()) << r.status.error_code() << " " << r.status.error_message();
  EXPECT_EQ(r.body, kServing);

  r = Call(TlsChannel({P("ca.pem"), "", ""}), kHealthCheck);  // no client certificate
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);

  r = Call(TlsChannel({P("ca.pem"), P("other-client.pem"), P("other-client.key")}), kHealthCheck);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);  // signed by another CA

  r = Call(PlainChannel(), kHealthCheck);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, TokensOverTlsWithHealthLeftOpen) {
  auto store = TokenStore::Parse("tenant-a 0123456789abcdef0123\n", "tokens");
  ASSERT_TRUE(store.ok());
  auto processor = std::make_shared<TokenAuthProcessor>(
      std::make_shared<const TokenStore>(std::move(*store)), TokenAuthOptions());
  auto creds =
      MakeServerCredentials({P("server.pem"), P("server.key"), ""}, processor, "0.0.0.0:0");
  ASSERT_TRUE(creds.ok()) << creds.status();
  StartServer(*creds);
  auto channel = TlsChannel({P("ca.pem"), "", ""});

  CallResult r = Call(channel, kHealthCheck);  // no token: health is open
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.body, kServing);
  r = Call(channel, "/attnd.v1.Attention/Prefill");
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(r.status.error_message(),
            "missing credentials: send 'authorization: Bearer <token>' metadata");
  // With the token the call passes auth and reaches the (absent) method.
  r = Call(channel, "/attnd.v1.Attention/Prefill", "0123456789abcdef0123");
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(TlsTest, BadFilesAreNamedAtStartup) {
  auto only_cert = MakeSslServerCredentials({P("server.pem"), "", ""});
  EXPECT_EQ(only_cert.status().message(),
            "TlsOptions::cert_file and TlsOptions::key_file must be given together (got only "
            "TlsOptions::cert_file)");

  auto missing = MakeSslServerCredentials({P("nope.pem"), P("server.key"), ""});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "cannot read TlsOptions::cert_file " + P("nope.pem") + ": No such file or directory");

  auto garbage = MakeSslServerCredentials({P("garbage.pem"), P("server.key"), ""});
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(garbage.status().message(),
            "TlsOptions::cert_file " + P("garbage.pem") +
                ": no PEM certificate (-----BEGIN CERTIFICATE-----) found");

  auto key_not_pem = MakeSslServerCredentials({P("server.pem"), P("garbage.pem"), ""});
  EXPECT_EQ(key_not_pem.status().message(),
            "TlsOptions::key_file " + P("garbage.pem") + ": no unencrypted PEM private key found");

  auto mismatch = MakeSslServerCredentials({P("server.pem"), P("client.key"), ""});
  EXPECT_EQ(mismatch.status().message(),
            "TlsOptions::key_file " + P("client.key") +
                " does not match the certificate in TlsOptions::cert_file " + P("server.pem"));

  auto bad_ca = MakeSslServerCredentials({P("server.pem"), P("server.key"), P("garbage.pem")});
  EXPECT_EQ(bad_ca.status().message(),
            "TlsOptions::client_ca_file " + P("garbage.pem") +
                ": no PEM certificate (-----BEGIN CERTIFICATE-----) found");

  auto ca_alone = MakeServerCredentials({"", "", P("ca.pem")}, nullptr, "127.0.0.1:1");
  EXPECT_EQ(ca_alone.status().message(),
            "TlsOptions::client_ca_file needs TlsOptions::cert_file and TlsOptions::key_file");

  auto client_half = MakeChannelCredentials({P("ca.pem"), P("client.pem"), ""});
  EXPECT_EQ(client_half.status().message(),
            "TlsClientOptions::cert_file and TlsClientOptions::key_file must be given together");
}

TEST(LoopbackTest, RecognisesLoopbackHosts) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:50051"));
  EXPECT_TRUE(IsLoopbackAddress("127.1.2.3:0"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:50051"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:50051"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:50051"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:50051"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.1:50051"));
  EXPECT_FALSE(IsLoopbackAddress("127.example.com:50051"));
}

TEST(HealthOnlyServerTest, ServesOnlyHealthInPlaintext) {
  auto health = HealthOnlyServer::Start("127.0.0.1:0");
  ASSERT_TRUE(health.ok()) << health.status();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*health)->port()),
                                     grpc::InsecureChannelCredentials());
  CallResult r = Call(channel, kHealthCheck);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.body, kNotServing);
  (*health)->SetServing(true);
  r = Call(channel, kHealthCheck);
  EXPECT_EQ(r.body, kServing);
  (*health)->SetServing(false);
  EXPECT_EQ(Call(channel, kHealthCheck).body, kNotServing);
  r = Call(channel, "/attnd.v1.Attention/Prefill");
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  (*health)->Shutdown();
  (*health)->Shutdown();
}

}  // namespace
}  // namespace attnd
