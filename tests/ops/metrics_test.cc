// After known traffic against the real daemon, /metrics reports exactly that traffic: requests by
// rpc and code, failures, latency histogram counts, bytes, KV pages, live sequences, decode batch
// sizes, build info; /healthz answers 200 while serving.
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/ops/ops_util.h"
#include "version/build_info.h"

namespace attnd {
namespace ops_testing {
namespace {

TEST(OpsMetricsTest, ScrapeMatchesTheCallsMade) {
  Daemon daemon(TinyOptions(64));
  ASSERT_TRUE(daemon.ok());
  const int metrics_port = daemon.server().metrics_port();
  ASSERT_GT(metrics_port, 0);
  auto stub = daemon.Stub();
  std::mt19937 rng(7);

  const std::string s1 = MustCreate(stub.get());
  const std::string s2 = MustCreate(stub.get());

  // Prefill: one OK (20 tokens = 2 pages), one INVALID_ARGUMENT, one NOT_FOUND.
  int64_t prefill_in = 0, prefill_out = 0;
  {
    v1::PrefillRequest req = MakePrefill(s1, 0, 20, &rng);
    v1::PrefillResponse resp;
    auto ctx = Context();
    grpc::Status s = stub->Prefill(ctx.get(), req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.length(), 20);
    prefill_in += static_cast<int64_t>(req.ByteSizeLong());
    prefill_out += static_cast<int64_t>(resp.ByteSizeLong());
  }
  {
    v1::PrefillRequest req = MakePrefill("not-an-id", 0, 1, &rng);
    v1::PrefillResponse resp;
    auto ctx = Context();
    EXPECT_EQ(stub->Prefill(ctx.get(), req, &resp).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    prefill_in += static_cast<int64_t>(req.ByteSizeLong());
  }
  {
    v1::PrefillRequest req = MakePrefill(std::string(32, 'a'), 0, 1, &rng);
    v1::PrefillResponse resp;
    auto ctx = Context();
    EXPECT_EQ(stub->Prefill(ctx.get(), req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
    prefill_in += static_cast<int64_t>(req.ByteSizeLong());
  }
  // Decode: one OK batch of one sequence; one FAILED_PRECONDITION (s2's layer is empty).
  {
    v1::DecodeRequest req = MakeDecode(0, {s1}, &rng);
    v1::DecodeResponse resp;
    auto ctx = Context();
    grpc::Status s = stub->Decode(ctx.get(), req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.outputs(0).length(), 21);
    v1::DecodeRequest bad = MakeDecode(0, {s2}, &rng);
    auto ctx2 = Context();
    EXPECT_EQ(stub->Decode(ctx2.get(), bad, &resp).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  {
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(s2);
    v1::ReleaseSequenceResponse resp;
    auto ctx = Context();
    ASSERT_TRUE(stub->ReleaseSequence(ctx.get(), req, &resp).ok());
  }
  v1::GetServerInfoResponse info;
  {
    auto ctx = Context();
    ASSERT_TRUE(stub->GetServerInfo(ctx.get(), v1::GetServerInfoRequest(), &info).ok());
  }
  // A Session stream: one prefill (layer 1 of s1, 4 tokens) and one decode, then a clean close.
  {
    auto ctx = Context();
    auto stream = stub->Session(ctx.get());
    v1::SessionRequest req;
    *req.mutable_prefill() = MakePrefill(s1, 1, 4, &rng);
    v1::SessionResponse resp;
    ASSERT_TRUE(stream->Write(req));
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_EQ(resp.code(), 0) << resp.message();
    req.Clear();
    *req.mutable_decode() = MakeDecode(1, {s1}, &rng);
    ASSERT_TRUE(stream->Write(req));
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_EQ(resp.code(), 0) << resp.message();
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }

  int status = 0;
  std::optional<std::string> text = HttpGet(metrics_port, "/metrics", &status);
  ASSERT_TRUE(text.has_value());
  ASSERT_EQ(status, 200);
  const std::string& m = *text;
  auto req_total = [&](const std::string& rpc, const std::string& code) {
    return SampleOr0(m,
                     absl::StrCat("attnd_requests_total{rpc=\"", rpc, "\",code=\"", code, "\"}"));
  };
  EXPECT_EQ(req_total("CreateSequence", "OK"), 2);
  EXPECT_EQ(req_total("Prefill", "OK"), 1);
  EXPECT_EQ(req_total("Prefill", "INVALID_ARGUMENT"), 1);
  EXPECT_EQ(req_total("Prefill", "NOT_FOUND"), 1);
  EXPECT_EQ(req_total("Decode", "OK"), 1);
  EXPECT_EQ(req_total("Decode", "FAILED_PRECONDITION"), 1);
  EXPECT_EQ(req_total("ReleaseSequence", "OK"), 1);
  EXPECT_EQ(req_total("GetServerInfo", "OK"), 1);
  EXPECT_EQ(req_total("Session.Prefill", "OK"), 1);
  EXPECT_EQ(req_total("Session.Decode", "OK"), 1);
  EXPECT_EQ(req_total("Session", "OK"), 1);
  EXPECT_EQ(SampleOr0(m, "attnd_request_failures_total{rpc=\"Prefill\",code=\"NOT_FOUND\"}"), 1);
  EXPECT_EQ(Sample(m, "attnd_request_failures_total{rpc=\"Prefill\",code=\"OK\"}"), std::nullopt);

  // Every unary RPC that reached a worker has all three latencies; GetServerInfo runs inline.
  for (const auto& [rpc, n] : std::vector<std::pair<std::string, int>>{
           {"CreateSequence", 2}, {"Prefill", 3}, {"Decode", 2}, {"ReleaseSequence", 1}}) {
    for (const char* h : {"attnd_request_duration_seconds", "attnd_request_queue_seconds",
                          "attnd_request_compute_seconds"}) {
      EXPECT_EQ(SampleOr0(m, absl::StrCat(h, "_count{rpc=\"", rpc, "\"}")), n) << h << " " << rpc;
      EXPECT_EQ(SampleOr0(m, absl::StrCat(h, "_bucket{rpc=\"", rpc, "\",le=\"+Inf\"}")), n)
          << h << " " << rpc;
    }
  }
  EXPECT_EQ(SampleOr0(m, "attnd_request_duration_seconds_count{rpc=\"GetServerInfo\"}"), 1);
  EXPECT_GT(SampleOr0(m, "attnd_request_duration_seconds_sum{rpc=\"Prefill\"}"), 0);

  EXPECT_EQ(SampleOr0(m, "attnd_received_bytes_total{rpc=\"Prefill\"}"), prefill_in);
  EXPECT_EQ(SampleOr0(m, "attnd_sent_bytes_total{rpc=\"Prefill\"}"), prefill_out);

  // s1 holds 21 tokens in layer 0 (2 pages) and 5 in layer 1 (the same pages); s2 is gone.
  EXPECT_EQ(Sample(m, "attnd_kv_pages_used"), 2);
  EXPECT_EQ(Sample(m, "attnd_kv_pages_free"), info.kv_cache().pages_total() - 2);
  EXPECT_EQ(Sample(m, "attnd_live_sequences"), 1);
  EXPECT_EQ(info.kv_cache().pages_total(), 64);
  // One shard (unsharded): the whole pool on the CPU, two pages of it held.
  EXPECT_EQ(Sample(m, "attnd_kv_shard_pool_bytes{shard=\"0\",device=\"cpu\"}"),
            info.kv_cache().pool_bytes());
  EXPECT_EQ(Sample(m, "attnd_kv_shard_bytes_used{shard=\"0\",device=\"cpu\"}"),
            2 * info.kv_cache().bytes_per_page());

  // Two executed decode batches of one sequence each (unary and session).
  EXPECT_EQ(Sample(m, "attnd_decode_batch_size_count"), 2);
  // The device's steps: those two batches, and two steps for each of the two prefills that ran
  // (the CPU engine stages a call, then attends its rows; these rows fit one step). The tiny
  // calls never met each other, so nothing waited.
  EXPECT_EQ(Sample(m, "attnd_device_steps_total{work=\"decode\"}"), 2);
  EXPECT_EQ(Sample(m, "attnd_device_steps_total{work=\"prefill\"}"), 4);
  EXPECT_EQ(Sample(m, "attnd_device_turn_waits_total{work=\"decode\"}"), 0);
  EXPECT_EQ(Sample(m, "attnd_prefill_owed_turns_total"), 0);
  EXPECT_EQ(Sample(m, "attnd_decode_batch_size_sum"), 2);
  EXPECT_EQ(Sample(m, "attnd_build_info{version=\"" + info.version() + "\",revision=\"" +
                          StampedRevision() + "\",backend=\"" + info.backend() + "\",model=\"" +
                          info.model().name() + "\"}"),
            1);

  std::optional<std::string> health = HttpGet(metrics_port, "/healthz", &status);
  ASSERT_TRUE(health.has_value());
  EXPECT_EQ(status, 200);
  EXPECT_EQ(*health, "ok\n");
}

TEST(OpsMetricsTest, MetricsListenerIsOffWhenEmptyAndBadAddressesFailStartup) {
  ServerOptions off = TinyOptions(8);
  off.metrics_listen = "";
  Daemon daemon(off);
  ASSERT_TRUE(daemon.ok());
  EXPECT_EQ(daemon.server().metrics_port(), 0);

  ServerOptions bad = TinyOptions(8);
  bad.metrics_listen = "127.0.0.1:notaport";
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(bad);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(server.status().message(), "ServerOptions::metrics_listen: "))
      << server.status().message();
  EXPECT_NE(server.status().message().find("127.0.0.1:notaport"), absl::string_view::npos)
      << server.status().message();
}

}  // namespace
}  // namespace ops_testing
}  // namespace attnd
