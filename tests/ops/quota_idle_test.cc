// Per-tenant page quota and idle reclaim against the real daemon.
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace ops_testing {
namespace {

const std::string kTokenA = "token-of-team-a-0123456789abcdef";
const std::string kTokenB = "token-of-team-b-fedcba9876543210";

std::string WriteTokenFile() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp ? tmp : "/tmp", "/quota-tokens.txt");
  std::ofstream(path) << "team-a " << kTokenA << "\nteam-b " << kTokenB << "\n";
  return path;
}

grpc::Status Prefill(v1::Attention::Stub* stub, const std::string& token, const std::string& id,
                     int64_t tokens, std::mt19937* rng, int64_t* length = nullptr) {
  v1::PrefillResponse resp;
  auto ctx = Context(token);
  grpc::Status s = stub->Prefill(ctx.get(), MakePrefill(id, 0, tokens, rng), &resp);
  if (length != nullptr) *length = resp.length();
  return s;
}

std::string Metrics(Daemon& daemon) {
  return HttpGet(daemon.server().metrics_port(), "/metrics").value_or("");
}

TEST(OpsQuotaTest, ATenantPastItsQuotaGetsResourceExhaustedAndNothingChanges) {
  ServerOptions o = TinyOptions(32);
  o.auth_token_file = WriteTokenFile();
  o.tenant_page_quota = 4;
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  std::mt19937 rng(3);

  const std::string a1 = MustCreate(stub.get(), kTokenA);
  const std::string a2 = MustCreate(stub.get(), kTokenA);
  ASSERT_TRUE(Prefill(stub.get(), kTokenA, a1, 48, &rng).ok());  // 3 pages

  grpc::Status s = Prefill(stub.get(), kTokenA, a2, 32, &rng);  // 2 more: 5 > 4
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(),
            absl::StrCat("cannot back 32 tokens of sequence ", a2,
                         " (2 more pages of 16 tokens): tenant \"team-a\" holds 3 pages; quota 4"));
  std::string m = Metrics(daemon);
  EXPECT_EQ(Sample(m, "attnd_kv_pages_used"), 3);
  EXPECT_EQ(SampleOr0(m, "attnd_requests_total{rpc=\"Prefill\",code=\"RESOURCE_EXHAUSTED\"}"), 1);

  // Tenant B is unaffected: it gets its own 4 pages.
  const std::string b1 = MustCreate(stub.get(), kTokenB);
  int64_t length = 0;
  s = Prefill(stub.get(), kTokenB, b1, 64, &rng, &length);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(length, 64);

  // a2 is still empty (the next prefill starts at 0), and what fits in A's quota still fits.
  s = Prefill(stub.get(), kTokenA, a2, 16, &rng, &length);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(length, 16);
  m = Metrics(daemon);
  EXPECT_EQ(Sample(m, "attnd_kv_pages_used"), 8);
  EXPECT_EQ(Sample(m, "attnd_kv_pages_free"), 24);
}

TEST(OpsIdleTest, IdleSequencesAreReclaimedAndBusyOnesKept) {
  ServerOptions o = TinyOptions(16);
  o.sequence_idle_timeout = absl::Milliseconds(800);  // checked every 200 ms
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  auto stub = daemon.Stub();
  std::mt19937 rng(5);

  const std::string idle = MustCreate(stub.get());
  const std::string active = MustCreate(stub.get());
  ASSERT_TRUE(Prefill(stub.get(), "", idle, 20, &rng).ok());    // 2 pages
  ASSERT_TRUE(Prefill(stub.get(), "", active, 20, &rng).ok());  // 2 pages
  EXPECT_EQ(Sample(Metrics(daemon), "attnd_kv_pages_used"), 4);

  // Keep `active` busy with a decode every 100 ms until `idle` has been reclaimed.
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  int64_t active_length = 20;
  std::string m;
  while (absl::Now() < give_up) {
    v1::DecodeResponse resp;
    auto ctx = Context();
    grpc::Status s = stub->Decode(ctx.get(), MakeDecode(0, {active}, &rng), &resp);
    ASSERT_TRUE(s.ok()) << "the active sequence was lost: " << s.error_message();
    active_length = resp.outputs(0).length();
    m = Metrics(daemon);
    if (SampleOr0(m, "attnd_sequences_idle_reclaimed_total") >= 1) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(SampleOr0(m, "attnd_sequences_idle_reclaimed_total"), 1);
  EXPECT_EQ(Sample(m, "attnd_live_sequences"), 1);
  EXPECT_EQ(Sample(m, "attnd_kv_pages_used"), 2);  // idle's two pages are back
  EXPECT_EQ(Sample(m, "attnd_kv_pages_free"), 14);
  EXPECT_GT(active_length, 20);

  grpc::Status s = Prefill(stub.get(), "", idle, 4, &rng);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), absl::StrCat("sequence ", idle, " not found"));
  v1::ReleaseSequenceRequest rreq;
  rreq.set_sequence_id(idle);
  v1::ReleaseSequenceResponse rresp;
  auto ctx = Context();
  EXPECT_EQ(stub->ReleaseSequence(ctx.get(), rreq, &rresp).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST(OpsIdleTest, NegativeTimeoutAndQuotaAreRejected) {
  ServerOptions o = TinyOptions(8);
  o.sequence_idle_timeout = absl::Seconds(-1);
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(o);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.status().message(),
            "ServerOptions::sequence_idle_timeout must be >= 0, got -1s");
  o = TinyOptions(8);
  o.tenant_page_quota = -2;
  server = AttndServer::Start(o);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.status().message(), "ServerOptions::tenant_page_quota must be >= 0, got -2");
}

}  // namespace
}  // namespace ops_testing
}  // namespace attnd
