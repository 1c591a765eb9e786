// Limits a hostile or careless client meets (issue #13): a per-tenant sequence quota (empty
// sequences hold no pages, so the page quota alone let one tenant take every slot), a default
// sequence limit derived from the pool, GetServerInfo scoped to the caller's tenant, the global
// request-bytes budget, and a drain that Watch streams on the health service do not hold up.
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/engine/fault_engine.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace ops_testing {
namespace {

const std::string& kTokenA = kTeamAToken;
const std::string& kTokenB = kTeamBToken;

v1::GetServerInfoResponse Info(v1::Attention::Stub* stub, const std::string& token) {
  auto ctx = Context(token);
  v1::GetServerInfoResponse info;
  grpc::Status s = stub->GetServerInfo(ctx.get(), v1::GetServerInfoRequest(), &info);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return info;
}

TEST(LimitsTest, TenantSequenceQuotaCountsEmptySequences) {
  ServerOptions o = TinyOptions(64);
  o.auth_token_file = WriteTwoTenantTokenFile("limits-tokens.txt");
  o.tenant_max_sequences = 3;
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  std::string ids[3];
  for (std::string& id : ids) id = MustCreate(stub.get(), kTokenA);
  std::string id;
  grpc::Status s = Create(stub.get(), kTokenA, &id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(),
            "tenant \"team-a\" holds 3 live sequences; quota 3 "
            "(SequenceTableOptions::tenant_max_sequences): release "
            "one first");
  // The other tenant is not locked out.
  MustCreate(stub.get(), kTokenB);
  // A released sequence frees its slot.
  auto ctx = Context(kTokenA);
  v1::ReleaseSequenceRequest req;
  req.set_sequence_id(ids[0]);
  v1::ReleaseSequenceResponse resp;
  ASSERT_TRUE(stub->ReleaseSequence(ctx.get(), req, &resp).ok());
  MustCreate(stub.get(), kTokenA);
  EXPECT_EQ(Info(stub.get(), kTokenA).limits().tenant_max_sequences(), 3);
}

TEST(LimitsTest, DefaultSequenceLimitIsOnePerPage) {
  Daemon daemon(TinyOptions(8));
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  const v1::GetServerInfoResponse info = Info(stub.get(), "");
  EXPECT_EQ(info.kv_cache().pages_total(), 8);
  EXPECT_EQ(info.limits().max_sequences(), 8);
  for (int i = 0; i < 8; ++i) MustCreate(stub.get());
  std::string id;
  grpc::Status s = Create(stub.get(), "", &id);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(), "too many live sequences: the limit is 8; release one first");

  // The metrics port shows the fd budget and that the listener accepts.
  std::optional<std::string> m = HttpGet(daemon.server().metrics_port(), "/metrics");
  ASSERT_TRUE(m.has_value());
  EXPECT_GT(Sample(*m, "attnd_open_fds").value_or(0), 3);
  EXPECT_NE(Sample(*m, "attnd_fd_limit").value_or(0), 0);
  EXPECT_EQ(Sample(*m, "attnd_api_accepting").value_or(-1), 1);
  EXPECT_EQ(Sample(*m, "attnd_inflight_request_bytes").value_or(-1), 0);
}

TEST(LimitsTest, ServerInfoShowsATenantOnlyItsOwnUse) {
  ServerOptions o = TinyOptions(64);
  o.auth_token_file = WriteTwoTenantTokenFile("limits-tokens.txt");
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  std::mt19937 rng(1);
  const std::string a = MustCreate(stub.get(), kTokenA);
  for (int i = 0; i < 3; ++i) MustCreate(stub.get(), kTokenB);
  {
    auto ctx = Context(kTokenA);
    v1::PrefillResponse resp;
    ASSERT_TRUE(stub->Prefill(ctx.get(), MakePrefill(a, 0, 40, &rng), &resp).ok());
  }
  const v1::GetServerInfoResponse info = Info(stub.get(), kTokenA);
  EXPECT_TRUE(info.tenant_scoped());
  EXPECT_EQ(info.live_sequences(), 1);                     // not B's three
  EXPECT_EQ(info.kv_cache().tenant_pages(), 3);            // 40 tokens in pages of 16
  EXPECT_EQ(info.kv_cache().pages_total(), 64);            // the capacity is shown
  EXPECT_EQ(info.kv_cache().pages_free(), 0);              // the others' use is not
  EXPECT_TRUE(info.decode_batching().enabled());           // the settings are shown
  EXPECT_EQ(info.decode_batching().calls_submitted(), 0);  // the server-wide counters are not
  EXPECT_EQ(Info(stub.get(), kTokenB).live_sequences(), 3);
  // Without tokens there is one tenant, and it sees the whole server.
  Daemon open(TinyOptions(64));
  ASSERT_TRUE(open.ok());
  auto open_stub = open.Stub();
  MustCreate(open_stub.get());
  const v1::GetServerInfoResponse all = Info(open_stub.get(), "");
  EXPECT_FALSE(all.tenant_scoped());
  EXPECT_EQ(all.kv_cache().pages_free(), 64);
  EXPECT_EQ(all.live_sequences(), 1);
}

TEST(LimitsTest, RequestsPastTheInflightByteBudgetFailAtOnce) {
  ServerOptions o = TinyOptions(64);
  o.max_message_bytes = 1 << 20;
  o.max_inflight_request_bytes = 1 << 20;
  FaultEngine* fault = nullptr;
  o.wrap_engine = [&fault](std::unique_ptr<Engine> e) {
    auto f = std::make_unique<FaultEngine>(std::move(e));
    fault = f.get();
    return f;
  };
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  std::mt19937 rng(2);
  const std::string a = MustCreate(stub.get());
  const std::string b = MustCreate(stub.get());
  // 100 tokens of fp32 q/k/v: about 0.6 MB, more than half the budget.
  const v1::PrefillRequest big_a = MakePrefill(a, 0, 100, &rng);
  const v1::PrefillRequest big_b = MakePrefill(b, 0, 100, &rng);
  ASSERT_GT(big_a.ByteSizeLong(), 600000u);
  fault->HoldPrefills();
  auto first = std::async(std::launch::async, [&] {
    auto ctx = Context();
    v1::PrefillResponse resp;
    return stub->Prefill(ctx.get(), big_a, &resp);
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (fault->held_prefills() == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(fault->held_prefills(), 1);
  {
    auto ctx = Context();
    v1::PrefillResponse resp;
    grpc::Status s = stub->Prefill(ctx.get(), big_b, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "--max-inflight-request-bytes 1048576"))
        << s.error_message();
  }
  fault->ReleasePrefills();
  EXPECT_TRUE(first.get().ok());
  // The budget was given back: the same request now runs.
  auto ctx = Context();
  v1::PrefillResponse resp;
  EXPECT_TRUE(stub->Prefill(ctx.get(), big_b, &resp).ok());
}

TEST(LimitsTest, OpenHealthWatchStreamsDoNotHoldTheDrain) {
  Daemon daemon(TinyOptions(8));
  ASSERT_TRUE(daemon.ok());
  auto channel = daemon.Channel();
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckRequest req;
  auto reader = health->Watch(&ctx, req);
  grpc::health::v1::HealthCheckResponse first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_EQ(first.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  const absl::Time t0 = absl::Now();
  daemon.server().Shutdown(t0 + absl::Seconds(20));
  daemon.server().Wait();
  const absl::Duration took = absl::Now() - t0;
  EXPECT_LT(took, absl::Seconds(3)) << "the drain waited " << took << " for the Watch stream";
  ctx.TryCancel();
}

}  // namespace
}  // namespace ops_testing
}  // namespace attnd
