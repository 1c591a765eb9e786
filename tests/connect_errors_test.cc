// What AttndClient::Connect (and so attnctl) says when --target is wrong: a port nobody listens on
// fails at once with "connection refused" (it used to wait the whole 10 s connect timeout), attnd's
// metrics port is named as an HTTP port, and the health-only port as a gRPC port without attnd's
// API. Every message names the target.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

using ::testing::HasSubstr;

// A loopback port that was free a moment ago and has no listener now.
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

client::ClientOptions SlowTimeout() {
  client::ClientOptions options;
  options.connect_timeout = absl::Seconds(20);
  return options;
}

TEST(ConnectErrors, RefusedFailsFastAndSaysSo) {
  const std::string target = absl::StrCat("127.0.0.1:", ClosedPort());
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<client::AttndClient>> c =
      client::AttndClient::Connect(target, SlowTimeout());
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(c.status().message(), HasSubstr(absl::StrCat("cannot reach attnd at ", target)));
  EXPECT_THAT(c.status().message(), HasSubstr("connection refused; is the daemon running?"));
  EXPECT_LT(took, absl::Seconds(5)) << "waited for the connect timeout instead of failing fast";
}

TEST(ConnectErrors, UnresolvableHostIsNamed) {
  absl::StatusOr<std::unique_ptr<client::AttndClient>> c =
      client::AttndClient::Connect("no-such-host.invalid:50051", SlowTimeout());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("no-such-host.invalid:50051"));
}

class DaemonPorts : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.kv_dtype = "fp32";
    options.kv_cache_bytes = 4ll << 20;
    options.compute_threads = 1;
    options.metrics_listen = "127.0.0.1:0";
    options.health_listen = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
        testing::TestDaemon::Start(testing::ModelGeometry(), options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
  }
  std::unique_ptr<testing::TestDaemon> daemon_;
};

TEST_F(DaemonPorts, MetricsPortIsNamedAsHttp) {
  const std::string target = absl::StrCat("127.0.0.1:", daemon_->server().metrics_port());
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<client::AttndClient>> c =
      client::AttndClient::Connect(target, SlowTimeout());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(absl::StrCat("cannot reach attnd at ", target)));
  EXPECT_THAT(c.status().message(), HasSubstr("answers HTTP, not gRPC"));
  EXPECT_THAT(c.status().message(), HasSubstr("metrics port"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_F(DaemonPorts, HealthOnlyPortIsNamed) {
  const std::string target = absl::StrCat("127.0.0.1:", daemon_->server().health_port());
  absl::StatusOr<std::unique_ptr<client::AttndClient>> c =
      client::AttndClient::Connect(target, SlowTimeout());
  ASSERT_TRUE(c.ok()) << c.status();  // it is a gRPC server
  absl::StatusOr<bool> healthy = (*c)->Healthy("");
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  absl::StatusOr<v1::GetServerInfoResponse> info = (*c)->Info();
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(info.status().message(), HasSubstr(target));
  EXPECT_THAT(info.status().message(), HasSubstr("health-only port"));
  // The API port itself still connects and answers.
  EXPECT_TRUE(daemon_->client().Info().ok());
}

}  // namespace
}  // namespace attnd
