// Who may call attnd.v1.Admin: AdminAccess with tokens on (the admin tenant only) and off
// (loopback peers only). The service over gRPC is tested in tests/admin_test.cc.
#include "server/rpc/admin_service.h"

#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(AdminAccess, LoopbackPeersOnlyWhenTokensAreOff) {
  EXPECT_TRUE(IsLoopbackPeer("ipv4:127.0.0.1:5000"));
  EXPECT_TRUE(IsLoopbackPeer("ipv4:127.8.9.1:5000"));
  EXPECT_TRUE(IsLoopbackPeer("ipv6:[::1]:5000"));
  EXPECT_TRUE(IsLoopbackPeer("ipv6:[::ffff:127.0.0.1]:5000"));
  EXPECT_TRUE(IsLoopbackPeer("unix:/run/attnd.sock"));
  EXPECT_FALSE(IsLoopbackPeer("ipv4:10.0.0.7:5000"));
  EXPECT_FALSE(IsLoopbackPeer("ipv6:[2001:db8::1]:5000"));
  EXPECT_FALSE(IsLoopbackPeer("ipv4:1.127.0.0:5000"));

  EXPECT_TRUE(AdminAccess(nullptr, "", "", "ipv4:127.0.0.1:5000").ok());
  const absl::Status remote = AdminAccess(nullptr, "", "", "ipv4:10.0.0.7:5000");
  EXPECT_EQ(remote.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(remote.message().find("ipv4:10.0.0.7:5000"), absl::string_view::npos) << remote;
  EXPECT_NE(remote.message().find("loopback"), absl::string_view::npos) << remote;
}

TEST(AdminAccess, OnlyTheAdminTenantWhenTokensAreOn) {
  absl::StatusOr<TokenStore> store =
      TokenStore::Parse("ops 0123456789abcdef0123\nalice fedcba9876543210fedc\n", "tokens.txt");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(store->HasTenant("ops"));
  EXPECT_FALSE(store->HasTenant("op"));

  EXPECT_TRUE(AdminAccess(&*store, "ops", "ops", "ipv4:10.0.0.7:5000").ok());
  const absl::Status alice = AdminAccess(&*store, "ops", "alice", "ipv4:127.0.0.1:5000");
  EXPECT_EQ(alice.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(alice.message().find("ops"), absl::string_view::npos) << "names the admin: " << alice;
  EXPECT_NE(alice.message().find("--admin-tenant"), absl::string_view::npos) << alice;
  EXPECT_NE(alice.message().find("this call is tenant \"alice\""), absl::string_view::npos);
  // Tokens on and no admin tenant: nobody, loopback or not.
  const absl::Status off = AdminAccess(&*store, "", "ops", "ipv4:127.0.0.1:5000");
  EXPECT_EQ(off.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(off.message().find("--admin-tenant"), absl::string_view::npos) << off;
}

}  // namespace
}  // namespace attnd
