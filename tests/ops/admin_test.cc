// attnd.v1.Admin over loopback gRPC: the admin tenant (--admin-tenant) lists every tenant's
// sequences and releases another tenant's, whose pages go back to the pool; other tenants get
// PERMISSION_DENIED naming the tenant needed; with tokens off loopback callers may use it; start-up
// refuses an --admin-tenant that has no token. attnctl sequences / release print it.
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include "attnd/v1/admin.grpc.pb.h"
#include "client/attnctl.h"
#include "client/attnd_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace ops_testing;  // NOLINT

ServerOptions AdminOptions() {
  ServerOptions o = TinyOptions(64);
  o.auth_token_file = WriteTwoTenantTokenFile("admin-tokens.txt");
  o.admin_tenant = "team-a";
  return o;
}

// The pool's free pages, as /metrics reports them (tenants' GetServerInfo shows only their own).
int64_t PagesFree(Daemon& daemon) {
  std::optional<std::string> m = HttpGet(daemon.server().metrics_port(), "/metrics");
  EXPECT_TRUE(m.has_value());
  std::optional<double> free = Sample(m.value_or(""), "attnd_kv_pages_free");
  EXPECT_TRUE(free.has_value());
  return static_cast<int64_t>(free.value_or(-1));
}

grpc::Status List(v1::Admin::Stub* admin, const std::string& token,
                  v1::AdminListSequencesResponse* out, const std::string& tenant = "") {
  auto ctx = Context(token);
  v1::AdminListSequencesRequest req;
  req.set_tenant(tenant);
  return admin->ListSequences(ctx.get(), req, out);
}

grpc::Status AdminRelease(v1::Admin::Stub* admin, const std::string& token, const std::string& id,
                          v1::AdminReleaseSequenceResponse* out) {
  auto ctx = Context(token);
  v1::AdminReleaseSequenceRequest req;
  req.set_sequence_id(id);
  return admin->ReleaseSequence(ctx.get(), req, out);
}

void MustPrefill(v1::Attention::Stub* stub, const std::string& token, const std::string& id,
                 int64_t tokens, std::mt19937* rng) {
  for (int32_t layer = 0; layer < 2; ++layer) {
    auto ctx = Context(token);
    v1::PrefillResponse resp;
    const grpc::Status s = stub->Prefill(ctx.get(), MakePrefill(id, layer, tokens, rng), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
}

TEST(AdminTest, AdminListsAndReleasesAnotherTenantsSequence) {
  Daemon daemon(AdminOptions());
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  auto admin = v1::Admin::NewStub(daemon.Channel());
  std::mt19937 rng(7);
  const int64_t pages_before = PagesFree(daemon);

  const std::string b_id = MustCreate(stub.get(), kTeamBToken);
  MustPrefill(stub.get(), kTeamBToken, b_id, 40, &rng);  // 40 tokens: 3 pages of 16
  const std::string a_id = MustCreate(stub.get(), kTeamAToken);
  const int64_t pages_held = pages_before - PagesFree(daemon);
  ASSERT_GT(pages_held, 0);

  v1::AdminListSequencesResponse list;
  grpc::Status s = List(admin.get(), kTeamAToken, &list);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(list.sequences_size(), 2);
  const v1::AdminSequence* b = nullptr;
  for (const v1::AdminSequence& q : list.sequences()) {
    if (q.sequence_id() == b_id) b = &q;
  }
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->tenant(), "team-b");
  EXPECT_EQ(b->pages(), pages_held);
  EXPECT_EQ(b->min_length(), 40);
  EXPECT_EQ(b->max_length(), 40);
  ASSERT_EQ(b->layer_lengths_size(), 2);
  EXPECT_GE(b->idle_seconds(), 0.0);
  EXPECT_EQ(list.pages_free(), pages_before - pages_held);

  // One tenant only.
  v1::AdminListSequencesResponse only_a;
  ASSERT_TRUE(List(admin.get(), kTeamAToken, &only_a, "team-a").ok());
  ASSERT_EQ(only_a.sequences_size(), 1);
  EXPECT_EQ(only_a.sequences(0).sequence_id(), a_id);

  // team-b may not use Admin at all, not even to see its own.
  v1::AdminListSequencesResponse denied;
  s = List(admin.get(), kTeamBToken, &denied);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("--admin-tenant"));
  EXPECT_THAT(s.error_message(), Not(HasSubstr("team-a")));  // the admin is not named
  v1::AdminReleaseSequenceResponse released;
  s = AdminRelease(admin.get(), kTeamBToken, a_id, &released);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // The admin releases team-b's sequence: its pages come back, and team-b's id is gone.
  s = AdminRelease(admin.get(), kTeamAToken, b_id, &released);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(released.pages_freed(), pages_held);
  EXPECT_EQ(released.tenant(), "team-b");
  EXPECT_EQ(PagesFree(daemon), pages_before);
  auto ctx = Context(kTeamBToken);
  v1::PrefillResponse resp;
  EXPECT_EQ(stub->Prefill(ctx.get(), MakePrefill(b_id, 0, 1, &rng), &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  s = AdminRelease(admin.get(), kTeamAToken, b_id, &released);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  s = AdminRelease(admin.get(), kTeamAToken, "not-an-id", &released);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Without a token the auth processor turns the call away before Admin sees it.
  s = List(admin.get(), "", &denied);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST(AdminTest, AttnctlSequencesAndRelease) {
  Daemon daemon(AdminOptions());
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  std::mt19937 rng(8);
  const std::string b_id = MustCreate(stub.get(), kTeamBToken);
  MustPrefill(stub.get(), kTeamBToken, b_id, 20, &rng);

  client::ClientOptions admin_options;
  admin_options.token = kTeamAToken;
  auto admin = client::AttndClient::Connect(daemon.target(), admin_options);
  ASSERT_TRUE(admin.ok()) << admin.status();
  std::ostringstream out, err;
  ASSERT_EQ(client::RunSequences(**admin, "", out, err), 0) << err.str();
  EXPECT_THAT(out.str(), HasSubstr(b_id));
  EXPECT_THAT(out.str(), HasSubstr("team-b"));
  EXPECT_THAT(out.str(), HasSubstr("1 sequences holding 2 pages"));

  client::ClientOptions b_options;
  b_options.token = kTeamBToken;
  auto b = client::AttndClient::Connect(daemon.target(), b_options);
  ASSERT_TRUE(b.ok());
  std::ostringstream b_out, b_err;
  EXPECT_EQ(client::RunRelease(**b, b_id, b_out, b_err), 2);
  EXPECT_THAT(b_err.str(), HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(b_err.str(), HasSubstr("--admin-tenant"));
  EXPECT_THAT(b_err.str(), Not(HasSubstr("team-a")));

  std::ostringstream r_out, r_err;
  ASSERT_EQ(client::RunRelease(**admin, b_id, r_out, r_err), 0) << r_err.str();
  EXPECT_THAT(r_out.str(), HasSubstr("of tenant team-b: 2 pages freed"));
}

TEST(AdminTest, TokensOffServesLoopback) {
  Daemon daemon(TinyOptions(64));
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  auto admin = v1::Admin::NewStub(daemon.Channel());
  const std::string id = MustCreate(stub.get());
  v1::AdminListSequencesResponse list;
  ASSERT_TRUE(List(admin.get(), "", &list).ok());
  ASSERT_EQ(list.sequences_size(), 1);
  EXPECT_EQ(list.sequences(0).sequence_id(), id);
  EXPECT_EQ(list.sequences(0).tenant(), "");
  v1::AdminReleaseSequenceResponse released;
  ASSERT_TRUE(AdminRelease(admin.get(), "", id, &released).ok());
  ASSERT_TRUE(List(admin.get(), "", &list).ok());
  EXPECT_EQ(list.sequences_size(), 0);
}

TEST(AdminTest, StartupRefusesAnAdminTenantWithoutToken) {
  ServerOptions o = AdminOptions();
  o.admin_tenant = "nobody";
  absl::StatusOr<std::unique_ptr<AttndServer>> s = AttndServer::Start(o);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("ServerOptions::admin_tenant \"nobody\""));

  o = TinyOptions(64);
  o.admin_tenant = "team-a";
  s = AttndServer::Start(o);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("ServerOptions::admin_tenant needs ServerOptions::auth_token_file"));
}

}  // namespace
}  // namespace attnd
