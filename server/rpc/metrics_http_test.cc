#include "server/rpc/metrics_http.h"

#include <httplib.h>

#include <atomic>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(ParseHostPortTest, AcceptsHostsAndRejectsGarbage) {
  std::string host;
  int port = -1;
  ASSERT_TRUE(ParseHostPort("127.0.0.1:9400", &host, &port).ok());
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 9400);
  ASSERT_TRUE(ParseHostPort("[::1]:0", &host, &port).ok());
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 0);
  ASSERT_TRUE(ParseHostPort(":9400", &host, &port).ok());
  EXPECT_EQ(host, "0.0.0.0");
  EXPECT_EQ(ParseHostPort("9400", &host, &port).message(),
            "metrics address '9400' is not host:port");
  EXPECT_EQ(ParseHostPort("h:99999", &host, &port).message(),
            "metrics address 'h:99999': port must be 0..65535");
  EXPECT_EQ(ParseHostPort("::1:80", &host, &port).code(), absl::StatusCode::kInvalidArgument);
}

class MetricsHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto metrics = AttndMetrics::Create({"1.2.3", "", "cpu", "tiny"});
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    metrics_ = std::move(*metrics);
  }
  std::unique_ptr<AttndMetrics> metrics_;
  std::atomic<bool> ready_{false};
};

TEST_F(MetricsHttpTest, ServesMetricsAndHealthOnAnEphemeralPort) {
  auto server = MetricsHttpServer::Start({"127.0.0.1:0"}, &metrics_->registry(),
                                         [this] { return ready_.load(); });
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);

  metrics_->RecordRequest("Decode", "OK", 0.001, 0.002, 0.004, 10, 20);
  metrics_->registry().AddCollectHook([this] { metrics_->kv_pages_free->Set({}, 77); });

  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_connection_timeout(5, 0);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_THAT(res->get_header_value("Content-Type"), StartsWith("text/plain; version=0.0.4"));
  EXPECT_THAT(res->body, HasSubstr("attnd_requests_total{rpc=\"Decode\",code=\"OK\"} 1\n"));
  EXPECT_THAT(res->body, HasSubstr("\nattnd_kv_pages_free 77\n"));
  EXPECT_THAT(res->body, HasSubstr("attnd_build_info{version=\"1.2.3\",revision=\"\","
                                   "backend=\"cpu\",model=\"tiny\"} 1\n"));
  EXPECT_THAT(res->body, HasSubstr("# TYPE attnd_request_duration_seconds histogram\n"));

  // A second scrape sees new values.
  metrics_->RecordRequest("Decode", "OK", 0.001, 0.002, 0.004, 10, 20);
  res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_THAT(res->body, HasSubstr("attnd_requests_total{rpc=\"Decode\",code=\"OK\"} 2\n"));

  res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503);
  EXPECT_EQ(res->body, "not ready\n");
  ready_ = true;
  res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "ok\n");

  res = client.Get("/nothing-here");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);

  const int port = (*server)->port();
  (*server)->Stop();
  (*server)->Stop();  // idempotent
  httplib::Client after("127.0.0.1", port);
  after.set_connection_timeout(2, 0);
  EXPECT_FALSE(after.Get("/metrics"));  // nothing listens any more
}

TEST_F(MetricsHttpTest, ABusyPortIsAClearError) {
  auto first = MetricsHttpServer::Start({"127.0.0.1:0"}, &metrics_->registry());
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = "127.0.0.1:" + std::to_string((*first)->port());
  auto second = MetricsHttpServer::Start({address}, &metrics_->registry());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(second.status().message(),
            "metrics: cannot listen on " + address + " (address in use, or not permitted)");
  auto bad = MetricsHttpServer::Start({"no-port"}, &metrics_->registry());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(MetricsHttpTest, StopRightAfterStartDoesNotHang) {
  for (int i = 0; i < 20; ++i) {
    auto server = MetricsHttpServer::Start({"127.0.0.1:0"}, &metrics_->registry());
    ASSERT_TRUE(server.ok()) << server.status();
  }  // destructors Stop()
}

}  // namespace
}  // namespace attnd
