// Connection floods against attnd's plaintext listeners (server/rpc/listener.h): the daemon runs
// out of file descriptors under idle connections and must keep serving once they close; a
// connection that never sends the HTTP/2 preface is closed; a second daemon on a busy port fails
// clearly; the loopback check of attnd.v1.Admin still sees the caller's address.
//
// The fd test runs the attnd binary ($ATTND_BINARY) in a child process with RLIMIT_NOFILE 256 (soft
// and hard, so attnd cannot raise it), as the tester did at 20,000.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnd/v1/admin.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/ops/ops_util.h"

namespace attnd {
namespace ops_testing {
namespace {

// The attnd binary (its runfiles path, from the BUILD rule's env).
const char* AttndBinary() { return getenv("ATTND_BINARY"); }

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the server closed `fd` within `timeout` (EOF or reset).
bool ClosedByServer(int fd, absl::Duration timeout) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) <= 0) return false;
  char c;
  return recv(fd, &c, 1, MSG_DONTWAIT) <= 0;
}

grpc::Status ServerInfo(const std::string& target, absl::Duration timeout) {
  auto stub =
      v1::Attention::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::GetServerInfoResponse info;
  return stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info);
}

// attnd in a child process with a 256-fd limit; its log goes to a file under TEST_TMPDIR.
class ChildDaemon {
 public:
  ChildDaemon() {
    log_ = absl::StrCat(getenv("TEST_TMPDIR"), "/attnd-", getpid(), ".log");
    pid_ = fork();
    if (pid_ == 0) {
      const rlimit limit{256, 256};
      setrlimit(RLIMIT_NOFILE, &limit);
      FILE* out = freopen(log_.c_str(), "w", stdout);
      (void)out;
      dup2(fileno(stdout), STDERR_FILENO);
      execl(AttndBinary(), AttndBinary(), "--model_config=configs/tiny/config.json", "--device=cpu",
            "--listen=127.0.0.1:0", "--health_listen=127.0.0.1:0",
            "--metrics_listen=", "--kv_cache_bytes=2097152", "--compute_threads=1",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    // The startup summary names both ports.
    const std::regex ports("listening on 127\\.0\\.0\\.1:([0-9]+);.*health-only on port ([0-9]+)");
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (absl::Now() < give_up && port_ == 0 && waitpid(pid_, nullptr, WNOHANG) == 0) {
      std::ifstream in(log_);
      std::stringstream text;
      text << in.rdbuf();
      std::smatch m;
      const std::string s = text.str();
      if (std::regex_search(s, m, ports)) {
        port_ = std::stoi(m[1]);
        health_port_ = std::stoi(m[2]);
      } else {
        absl::SleepFor(absl::Milliseconds(50));
      }
    }
  }
  ~ChildDaemon() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  int port() const { return port_; }
  int health_port() const { return health_port_; }
  std::string log() const {
    std::ifstream in(log_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int port_ = 0;
  int health_port_ = 0;
};

TEST(ConnectionsTest, IdleConnectionsPastTheFdLimitDoNotWedgeTheApi) {
  ASSERT_NE(AttndBinary(), nullptr) << "set ATTND_BINARY to the attnd binary";
  ChildDaemon daemon;
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  const std::string target = absl::StrCat("127.0.0.1:", daemon.port());
  const std::string health_target = absl::StrCat("127.0.0.1:", daemon.health_port());
  ASSERT_TRUE(ServerInfo(target, absl::Seconds(10)).ok());

  // More idle (silent) connections than the daemon has fds: 400 on the API, 100 on the health
  // port.
  std::vector<int> api, health;
  for (int i = 0; i < 400; ++i) {
    const int c = Connect(daemon.port());
    ASSERT_GE(c, 0) << i;
    api.push_back(c);
  }
  for (int i = 0; i < 100; ++i) {
    const int c = Connect(daemon.health_port());
    ASSERT_GE(c, 0) << i;
    health.push_back(c);
  }
  absl::SleepFor(absl::Milliseconds(500));
  // The oldest silent ones were closed to stay under the cap (256 fds less the reserve: 192 on
  // the API, 64 on the health port); the newest still wait for their preface.
  EXPECT_TRUE(ClosedByServer(api.front(), absl::Seconds(5)));
  EXPECT_FALSE(ClosedByServer(api.back(), absl::Milliseconds(100)));
  EXPECT_TRUE(ClosedByServer(health.front(), absl::Seconds(5)));
  int api_closed = 0;
  for (int c : api) api_closed += ClosedByServer(c, absl::ZeroDuration());
  EXPECT_GE(api_closed, 400 - 192);
  EXPECT_LT(api_closed, 400);
  // A real client is served even now: it takes the place of the oldest silent connection.
  grpc::Status during = ServerInfo(target, absl::Seconds(10));
  EXPECT_TRUE(during.ok()) << during.error_code() << ": " << during.error_message();

  // Once they close, the API and the health port answer.
  for (int c : api) close(c);
  for (int c : health) close(c);
  const absl::Time closed = absl::Now();
  grpc::Status after = ServerInfo(target, absl::Seconds(5));
  EXPECT_TRUE(after.ok()) << after.error_code() << ": " << after.error_message() << "\n"
                          << daemon.log();
  grpc::Status health_error;
  EXPECT_EQ(HealthStatus(grpc::CreateChannel(health_target, grpc::InsecureChannelCredentials()), "",
                         &health_error),
            1)
      << health_error.error_message();
  EXPECT_LT(absl::Now() - closed, absl::Seconds(5));
}

TEST(ConnectionsTest, AConnectionWithoutAPrefaceIsClosed) {
  ServerOptions o = TinyOptions(8);
  o.connection_preface_timeout = absl::Milliseconds(300);
  Daemon daemon(o);
  ASSERT_TRUE(daemon.ok());
  const absl::Time t0 = absl::Now();
  const int c = Connect(daemon.server().port());
  ASSERT_GE(c, 0);
  EXPECT_TRUE(ClosedByServer(c, absl::Seconds(5)));
  const absl::Duration waited = absl::Now() - t0;
  EXPECT_GE(waited, absl::Milliseconds(250));
  EXPECT_LT(waited, absl::Seconds(3));
  close(c);
  // One that sends something else is closed at once.
  const int http1 = Connect(daemon.server().port());
  const std::string get = "GET /metrics HTTP/1.1\r\n\r\n";
  ASSERT_EQ(send(http1, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
  EXPECT_TRUE(ClosedByServer(http1, absl::Milliseconds(200)));
  close(http1);
  // A real client is not affected, and the metrics count both.
  auto stub = daemon.Stub();
  MustCreate(stub.get());
  std::optional<std::string> m = HttpGet(daemon.server().metrics_port(), "/metrics");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(
      SampleOr0(*m, R"(attnd_connections_closed_total{listener="api",reason="preface_timeout"})"),
      1);
  EXPECT_EQ(SampleOr0(*m, R"(attnd_connections_closed_total{listener="api",reason="bad_preface"})"),
            1);
  EXPECT_GE(Sample(*m, R"(attnd_connections_open{listener="api"})").value_or(0), 1);
}

TEST(ConnectionsTest, ASecondDaemonOnTheSamePortFailsAtStartup) {
  Daemon first(TinyOptions(8));
  ASSERT_TRUE(first.ok());
  ServerOptions o = TinyOptions(8);
  o.listen = absl::StrCat("127.0.0.1:", first.server().port());
  absl::StatusOr<std::unique_ptr<AttndServer>> second = AttndServer::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(second.status().message(),
            absl::StrCat("ServerOptions::listen: 127.0.0.1:", first.server().port(),
                         ": the address is in use (another attnd, or another program, listens "
                         "there)"));
  // The first one is unaffected.
  auto stub = first.Stub();
  MustCreate(stub.get());
}

TEST(ConnectionsTest, AdminFromLoopbackWorksWithTokensOff) {
  Daemon daemon(TinyOptions(8));
  ASSERT_TRUE(daemon.ok());
  auto admin = v1::Admin::NewStub(daemon.Channel());
  auto ctx = Context();
  v1::AdminListSequencesResponse list;
  grpc::Status s = admin->ListSequences(ctx.get(), v1::AdminListSequencesRequest(), &list);
  EXPECT_TRUE(s.ok()) << s.error_code() << ": " << s.error_message();
}

}  // namespace
}  // namespace ops_testing
}  // namespace attnd
