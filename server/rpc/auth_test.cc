#include "server/rpc/auth.h"

#include <cstdio>
#include <fstream>
#include <future>
#include <map>
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
#include "server/rpc/tls.h"

namespace attnd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kAliceToken[] = "alice-token-0123456789abcdef";
constexpr char kAliceToken2[] = "alice-rotated-token-000000000";
constexpr char kBobToken[] = "bob-token-fedcba9876543210";

std::string GoodFile() {
  return absl::StrCat("# attnd tokens\n\n   # indented comment\n", "alice ", kAliceToken, "\n",
                      "alice\t", kAliceToken2, "  \r\n", "  bob   ", kBobToken, "\n");
}

TEST(TokenStoreTest, ParsesCommentsBlanksTabsAndCrlf) {
  auto store = TokenStore::Parse(GoodFile(), "tokens.txt");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(store->size(), 3u);
  EXPECT_EQ(store->Authenticate(kAliceToken), "alice");
  EXPECT_EQ(store->Authenticate(kAliceToken2), "alice");
  EXPECT_EQ(store->Authenticate(kBobToken), "bob");
  EXPECT_EQ(store->Authenticate("bob-token-fedcba987654321"), std::nullopt);  // a prefix
  EXPECT_EQ(store->Authenticate("bob-token-fedcba98765432100"), std::nullopt);
  EXPECT_EQ(store->Authenticate(""), std::nullopt);
}

TEST(TokenStoreTest, RejectsMalformedFilesNamingFileAndLine) {
  struct Case {
    std::string contents;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"alice\n", "t.txt:1: expected 'TENANT TOKEN' (2 fields), found 1 fields"},
      {"# c\nalice tok1111111111111111 extra\n",
       "t.txt:2: expected 'TENANT TOKEN' (2 fields), found 3 fields"},
      {"\n\nal/ice 0123456789abcdef\n",
       "t.txt:3: tenant 'al/ice' must be 1-64 characters of [A-Za-z0-9._-]"},
      {"alice short\n", "t.txt:1: token for tenant 'alice' has 5 characters; need 16-512"},
      {"alice 0123456789abcdef\xc3\xa9\n",
       "t.txt:1: token for tenant 'alice' must be printable ASCII without spaces"},
      {absl::StrCat("alice ", kAliceToken, "\nbob ", kAliceToken, "\n"),
       "t.txt:2: duplicate token (tenant 'bob'); every token must be unique"},
      {"# only comments\n\n", "t.txt: no tokens (expected lines of 'TENANT TOKEN')"},
      {"", "t.txt: no tokens (expected lines of 'TENANT TOKEN')"},
  };
  for (const Case& c : cases) {
    auto store = TokenStore::Parse(c.contents, "t.txt");
    ASSERT_FALSE(store.ok()) << c.contents;
    EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(store.status().message(), c.message);
  }
  // Errors never echo a token.
  auto dup = TokenStore::Parse(absl::StrCat("a ", kAliceToken, "\nb ", kAliceToken), "t");
  EXPECT_THAT(std::string(dup.status().message()), Not(HasSubstr(kAliceToken)));
}

TEST(TokenStoreTest, LoadsFilesAndNamesMissingOnes) {
  const std::string path = absl::StrCat(testing::TempDir(), "/tokens.txt");
  {
    std::ofstream out(path);
    out << GoodFile();
  }
  auto store = TokenStore::LoadFile(path);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(store->Authenticate(kBobToken), "bob");

  {
    std::ofstream out(path);
    out << "alice " << kAliceToken << "\nbroken\n";
  }
  EXPECT_EQ(TokenStore::LoadFile(path).status().message(),
            path + ":2: expected 'TENANT TOKEN' (2 fields), found 1 fields");

  auto missing = TokenStore::LoadFile(path + ".nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "cannot read token file " + path + ".nope: No such file or directory");
}

// An AuthContext that records what the processor sets.
class FakeAuthContext : public grpc::AuthContext {
 public:
  bool IsPeerAuthenticated() const override { return !identity_name_.empty(); }
  std::vector<grpc::string_ref> GetPeerIdentity() const override {
    return FindPropertyValues(identity_name_);
  }
  std::string GetPeerIdentityPropertyName() const override { return identity_name_; }
  std::vector<grpc::string_ref> FindPropertyValues(const std::string& name) const override {
    std::vector<grpc::string_ref> values;
    auto range = properties_.equal_range(name);
    for (auto it = range.first; it != range.second; ++it) values.emplace_back(it->second);
    return values;
  }
  grpc::AuthPropertyIterator begin() const override { return Iter(); }
  grpc::AuthPropertyIterator end() const override { return Iter(); }
  void AddProperty(const std::string& key, const grpc::string_ref& value) override {
    properties_.emplace(key, std::string(value.data(), value.size()));
  }
  bool SetPeerIdentityPropertyName(const std::string& name) override {
    identity_name_ = name;
    return true;
  }
  std::multimap<std::string, std::string> properties_;

 private:
  struct Iter : grpc::AuthPropertyIterator {};
  std::string identity_name_;
};

class ProcessorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = TokenStore::Parse(GoodFile(), "tokens.txt");
    ASSERT_TRUE(store.ok());
    TokenAuthOptions options;
    options.on_failure = [this](absl::string_view reason) { failures_.emplace_back(reason); };
    processor_ = std::make_unique<TokenAuthProcessor>(
        std::make_shared<const TokenStore>(std::move(*store)), options);
  }

  grpc::Status Run(std::vector<std::pair<std::string, std::string>> metadata) {
    storage_ = std::move(metadata);
    grpc::AuthMetadataProcessor::InputMetadata input;
    for (const auto& kv : storage_) input.emplace(kv.first, kv.second);
    consumed_.clear();
    context_ = FakeAuthContext();
    return processor_->Process(input, &context_, &consumed_, &response_);
  }

  std::unique_ptr<TokenAuthProcessor> processor_;
  std::vector<std::string> failures_;
  std::vector<std::pair<std::string, std::string>> storage_;
  FakeAuthContext context_;
  grpc::AuthMetadataProcessor::OutputMetadata consumed_, response_;
};

// The processor only gates: the auth context it is given is the connection's, shared by every call
// on it, so it must not be written (issue #13); the token stays in the call's metadata, where
// TenantOf reads it.
TEST_F(ProcessorTest, AcceptsABearerTokenAndLeavesTheConnectionsContextAlone) {
  grpc::Status status = Run({{":path", "/attnd.v1.Attention/Prefill"},
                             {"authorization", absl::StrCat("Bearer ", kBobToken)}});
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(context_.properties_.empty());
  EXPECT_EQ(context_.GetPeerIdentityPropertyName(), "");
  EXPECT_EQ(consumed_.count("authorization"), 0u);
  EXPECT_TRUE(failures_.empty());

  // The scheme is case-insensitive.
  status = Run({{"authorization", absl::StrCat("bearer ", kAliceToken2)}});
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(context_.properties_.empty());
}

TEST_F(ProcessorTest, RejectsMissingMalformedAndInvalidTokens) {
  grpc::Status status = Run({{":path", "/attnd.v1.Attention/Prefill"}});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(status.error_message(),
            "missing credentials: send 'authorization: Bearer <token>' metadata");

  for (const std::string& value :
       {std::string("Basic YWxhZGRpbjpvcGVuc2VzYW1l"), std::string("Bearer"),
        std::string("Bearer "), std::string(kBobToken)}) {
    status = Run({{"authorization", value}});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << value;
    EXPECT_EQ(status.error_message(),
              "malformed authorization metadata: expected 'Bearer <token>'");
  }
  status = Run({{"authorization", absl::StrCat("Bearer ", kBobToken)},
                {"authorization", absl::StrCat("Bearer ", kAliceToken)}});
  EXPECT_EQ(status.error_message(), "malformed authorization metadata: expected 'Bearer <token>'");

  status = Run({{"authorization", "Bearer not-a-known-token-at-all"}});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(status.error_message(), "invalid bearer token");
  EXPECT_TRUE(context_.properties_.empty());
  EXPECT_EQ(failures_, (std::vector<std::string>{"missing", "malformed", "malformed", "malformed",
                                                 "malformed", "malformed", "invalid"}));
}

TEST_F(ProcessorTest, HealthChecksNeedNoToken) {
  grpc::Status status = Run({{":path", "/grpc.health.v1.Health/Check"}});
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(context_.properties_.empty());  // open paths get no tenant
  status = Run({{":path", "/grpc.health.v1.HealthX/Check"}});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

// ---- End to end: a real gRPC server with the processor on local (loopback) credentials ----

// Replies "<tenant>|<whether the handler saw an authorization header>".
class WhoAmIService : public grpc::CallbackGenericService {
 public:
  explicit WhoAmIService(const TokenStore* store) : store_(store) {}

 private:
  const TokenStore* const store_;
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    class Reactor : public grpc::ServerGenericBidiReactor {
     public:
      Reactor(const TokenStore* store, grpc::GenericCallbackServerContext* ctx)
          : store_(store), ctx_(ctx) {
        StartRead(&request_);
      }
      void OnReadDone(bool ok) override {
        if (!ok) return Finish(grpc::Status(grpc::StatusCode::INTERNAL, "no request"));
        const bool saw_token = ctx_->client_metadata().count("authorization") > 0;
        absl::StatusOr<std::string> tenant = TenantOf(store_, *ctx_);
        grpc::Slice slice((tenant.ok() ? *tenant : std::string(tenant.status().message())) + "|" +
                          (saw_token ? "token-visible" : "token-hidden"));
        response_ = grpc::ByteBuffer(&slice, 1);
        StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      const TokenStore* const store_;
      grpc::GenericCallbackServerContext* ctx_;
      grpc::ByteBuffer request_, response_;
    };
    return new Reactor(store_, ctx);
  }
};

struct CallResult {
  grpc::Status status;
  std::string body;
};

CallResult Call(grpc::Channel* channel, const std::string& method, const std::string& token,
                const std::string& request = "") {
  grpc::GenericStub stub(channel->shared_from_this());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &req, &resp,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  CallResult result;
  result.status = done.get_future().get();
  std::vector<grpc::Slice> slices;
  if (result.status.ok() && resp.Dump(&slices).ok()) {
    for (const auto& s : slices)
      result.body.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return result;
}

TEST(AuthEndToEndTest, TenantsOverLocalCredentials) {
  auto store = TokenStore::Parse(GoodFile(), "tokens.txt");
  ASSERT_TRUE(store.ok());
  auto tokens = std::make_shared<const TokenStore>(std::move(*store));
  auto processor = std::make_shared<TokenAuthProcessor>(tokens, TokenAuthOptions());
  auto creds = MakeServerCredentials(TlsOptions(), processor, "127.0.0.1:0");
  ASSERT_TRUE(creds.ok()) << creds.status();

  grpc::EnableDefaultHealthCheckService(true);
  WhoAmIService service(tokens.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", *creds, &port);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  // A plaintext client on this host (local credentials do no handshake on the wire).
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  CallResult r = Call(channel.get(), "/test.WhoAmI/Get", kAliceToken);
  ASSERT_TRUE(r.status.ok()) << r.status.error_code() << " " << r.status.error_message();
  EXPECT_EQ(r.body, "alice|token-visible");
  // Same connection, another tenant's token: the tenant is per call, never carried over.
  r = Call(channel.get(), "/test.WhoAmI/Get", kBobToken);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.body, "bob|token-visible");

  r = Call(channel.get(), "/test.WhoAmI/Get", "");
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(r.status.error_message(),
            "missing credentials: send 'authorization: Bearer <token>' metadata");
  r = Call(channel.get(), "/test.WhoAmI/Get", "wrong-token-0000000000000");
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(r.status.error_message(), "invalid bearer token");
  // After a rejected call, alice's token still works on the same channel.
  r = Call(channel.get(), "/test.WhoAmI/Get", kAliceToken);
  EXPECT_EQ(r.body, "alice|token-visible");

  // Health stays open: an empty HealthCheckRequest, and the reply is status = SERVING (field 1 =
  // 1).
  r = Call(channel.get(), "/grpc.health.v1.Health/Check", "");
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.body, std::string("\x08\x01", 2));

  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST(AuthEndToEndTest, TokensWithoutTlsOnlyOnLoopback) {
  auto store = TokenStore::Parse(GoodFile(), "tokens.txt");
  ASSERT_TRUE(store.ok());
  auto processor = std::make_shared<TokenAuthProcessor>(
      std::make_shared<const TokenStore>(std::move(*store)), TokenAuthOptions());
  auto creds = MakeServerCredentials(TlsOptions(), processor, "0.0.0.0:50051");
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      creds.status().message(),
      "token auth needs TlsOptions::cert_file/key_file unless the listen address is a loopback "
      "address "
      "(bearer tokens would cross the network in clear text); the listen address is 0.0.0.0:50051");
  EXPECT_TRUE(MakeServerCredentials(TlsOptions(), processor, "[::1]:50051").ok());
  EXPECT_TRUE(MakeServerCredentials(TlsOptions(), processor, "localhost:50051").ok());
  EXPECT_TRUE(MakeServerCredentials(TlsOptions(), nullptr, "0.0.0.0:50051").ok());
}

}  // namespace
}  // namespace attnd
