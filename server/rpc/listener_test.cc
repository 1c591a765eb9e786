// Listener over real loopback sockets, with a fake "gRPC" that keeps the connections it is handed
// (and writes one byte on each, so the client can tell a served connection from a pending one).
#include "server/rpc/listener.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

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

int LocalPort(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.sin_port);
}

void Send(int fd, const std::string& data) {
  ASSERT_EQ(send(fd, data.data(), data.size(), MSG_NOSIGNAL), static_cast<ssize_t>(data.size()));
}

// What the server did with the connection within `timeout`: 'S' (served: the fake gRPC's byte),
// 'C' (closed), or 'W' (still waiting: nothing happened).
char Outcome(int fd, absl::Duration timeout) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) <= 0) return 'W';
  char c = 0;
  const ssize_t n = recv(fd, &c, 1, 0);
  if (n == 1) return c;
  return 'C';
}

// Keeps what it is handed, as gRPC would; Release closes one, as gRPC does when a client leaves.
class FakeGrpc {
 public:
  void Serve(int fd) {
    MutexLock lock(&mu_);
    fds_.push_back(fd);
    (void)!write(fd, "S", 1);
  }
  std::vector<int> fds() {
    MutexLock lock(&mu_);
    return fds_;
  }
  void CloseAll() {
    MutexLock lock(&mu_);
    for (int fd : fds_) close(fd);
    fds_.clear();
  }
  ~FakeGrpc() { CloseAll(); }

 private:
  Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<Listener> StartListener(ListenerOptions o, FakeGrpc* grpc) {
  absl::StatusOr<std::unique_ptr<Listener>> l = Listener::Bind(o);
  EXPECT_TRUE(l.ok()) << l.status();
  if (!l.ok()) return nullptr;
  (*l)->Start([grpc](int fd) { grpc->Serve(fd); });
  return *std::move(l);
}

TEST(ListenerTest, ServesAfterThePrefaceAndReportsThePeer) {
  FakeGrpc grpc;
  auto l = StartListener({"127.0.0.1:0"}, &grpc);
  ASSERT_NE(l, nullptr);
  ASSERT_GT(l->port(), 0);
  const int c = Connect(l->port());
  ASSERT_GE(c, 0);
  // Half the preface: not yet served.
  Send(c, std::string(kPreface, 10));
  EXPECT_EQ(Outcome(c, absl::Milliseconds(200)), 'W');
  Send(c, std::string(kPreface + 10));
  EXPECT_EQ(Outcome(c, absl::Seconds(5)), 'S');
  ASSERT_EQ(grpc.fds().size(), 1u);
  const int served = grpc.fds()[0];
  EXPECT_EQ(PeerAddress(absl::StrCat("fd:", served)),
            absl::StrCat("ipv4:127.0.0.1:", LocalPort(c)));
  EXPECT_EQ(PeerAddress("ipv4:10.0.0.1:99"), "ipv4:10.0.0.1:99");
  // The preface was only peeked at: the served socket still has it for gRPC to read.
  char buf[24];
  EXPECT_EQ(recv(served, buf, sizeof(buf), 0), 24);
  EXPECT_EQ(std::string(buf, 24), kPreface);
  EXPECT_EQ(l->stats().served, 1);
  close(c);
}

TEST(ListenerTest, ClosesOtherProtocolsAndSilentConnections) {
  FakeGrpc grpc;
  ListenerOptions o{"127.0.0.1:0"};
  o.preface_timeout = absl::Milliseconds(300);
  auto l = StartListener(o, &grpc);
  ASSERT_NE(l, nullptr);
  const int http1 = Connect(l->port());
  Send(http1, "GET / HTTP/1.1\r\n\r\n");
  EXPECT_EQ(Outcome(http1, absl::Seconds(5)), 'C');
  const absl::Time t0 = absl::Now();
  const int silent = Connect(l->port());
  EXPECT_EQ(Outcome(silent, absl::Seconds(5)), 'C');
  const absl::Duration waited = absl::Now() - t0;
  EXPECT_GE(waited, absl::Milliseconds(250));
  EXPECT_LT(waited, absl::Seconds(3));
  const ListenerStats s = l->stats();
  EXPECT_EQ(s.bad_prefaces, 1);
  EXPECT_EQ(s.preface_timeouts, 1);
  EXPECT_EQ(s.served, 0);
  EXPECT_TRUE(grpc.fds().empty());
  close(http1);
  close(silent);
}

TEST(ListenerTest, AtTheCapShedsTheOldestPendingThenRefuses) {
  FakeGrpc grpc;
  ListenerOptions o{"127.0.0.1:0"};
  o.max_connections = 3;
  auto l = StartListener(o, &grpc);
  ASSERT_NE(l, nullptr);
  int idle[4];
  for (int& c : idle) {
    c = Connect(l->port());
    absl::SleepFor(absl::Milliseconds(50));  // accepted in this order
  }
  // The fourth made room by closing the oldest silent one; the others still wait.
  EXPECT_EQ(Outcome(idle[0], absl::Seconds(5)), 'C');
  for (int i = 1; i < 4; ++i) EXPECT_EQ(Outcome(idle[i], absl::Milliseconds(100)), 'W') << i;
  for (int i = 1; i < 4; ++i) Send(idle[i], kPreface);
  for (int i = 1; i < 4; ++i) EXPECT_EQ(Outcome(idle[i], absl::Seconds(5)), 'S') << i;
  // Three served, none pending: a new one is refused.
  const int extra = Connect(l->port());
  EXPECT_EQ(Outcome(extra, absl::Seconds(5)), 'C');
  EXPECT_EQ(l->stats().shed_pending, 1);
  EXPECT_EQ(l->stats().refused_at_cap, 1);
  // gRPC closes one: there is room again.
  close(grpc.fds()[0]);
  absl::SleepFor(absl::Milliseconds(150));  // past the served-count interval
  const int again = Connect(l->port());
  Send(again, kPreface);
  EXPECT_EQ(Outcome(again, absl::Seconds(5)), 'S');
  for (int c : idle) close(c);
  close(extra);
  close(again);
}

TEST(ListenerTest, ASecondListenerOnThePortFails) {
  FakeGrpc grpc;
  auto l = StartListener({"127.0.0.1:0"}, &grpc);
  ASSERT_NE(l, nullptr);
  absl::StatusOr<std::unique_ptr<Listener>> second =
      Listener::Bind({absl::StrCat("127.0.0.1:", l->port())});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(second.status().message(), "the address is in use"))
      << second.status();
}

TEST(ListenerTest, RejectsAddressesItCannotBind) {
  EXPECT_FALSE(Listener::Supports("unix:/tmp/attnd.sock"));
  EXPECT_FALSE(Listener::Supports("ipv4:127.0.0.1:5"));
  EXPECT_TRUE(Listener::Supports("[::1]:0"));
  EXPECT_TRUE(Listener::Supports("localhost:50051"));
  EXPECT_TRUE(Listener::Supports(":50051"));
  absl::StatusOr<std::unique_ptr<Listener>> bad = Listener::Bind({"127.0.0.1:99999"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "port must be a number in [0, 65535]"))
      << bad.status();
  ListenerOptions zero{"127.0.0.1:0"};
  zero.max_connections = 0;
  EXPECT_EQ(Listener::Bind(zero).status().message(),
            "ListenerOptions::max_connections must be > 0, got 0");
}

TEST(ListenerTest, DefaultCapLeavesFdsInReserve) {
  EXPECT_EQ(DefaultMaxConnections(20000), 19488);
  EXPECT_EQ(DefaultMaxConnections(256), 192);
  EXPECT_EQ(DefaultMaxConnections(-1), 65536);
}

// The process runs out of fds (the cap is above the fd limit, and "gRPC" keeps every connection):
// new connections are refused, and once connections close, accepting goes on. Runs in a child with
// a soft and hard RLIMIT_NOFILE of 64, so the test process keeps its own fds.
TEST(ListenerTest, KeepsAcceptingAfterTheFdsRanOut) {
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(ready[0]);
    const rlimit low{64, 64};
    if (setrlimit(RLIMIT_NOFILE, &low) != 0) _exit(2);
    ListenerOptions o{"127.0.0.1:0"};
    o.max_connections = 100000;
    absl::StatusOr<std::unique_ptr<Listener>> l = Listener::Bind(o);
    if (!l.ok()) _exit(3);
    // gRPC's part: keeps each connection until the client closes it.
    Mutex mu;
    std::vector<int> fds;
    (*l)->Start([&](int fd) {
      (void)!write(fd, "S", 1);
      MutexLock lock(&mu);
      fds.push_back(fd);
    });
    const int port = (*l)->port();
    (void)!write(ready[1], &port, sizeof(port));
    while (true) {
      absl::SleepFor(absl::Milliseconds(10));
      MutexLock lock(&mu);
      for (auto it = fds.begin(); it != fds.end();) {
        pollfd p{*it, POLLRDHUP, 0};
        if (poll(&p, 1, 0) == 1) {
          close(*it);
          it = fds.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  close(ready[1]);
  int port = 0;
  ASSERT_EQ(read(ready[0], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  close(ready[0]);
  std::vector<int> clients;
  int served = 0, closed = 0;
  for (int i = 0; i < 100; ++i) {
    const int c = Connect(port);
    ASSERT_GE(c, 0);
    Send(c, kPreface);
    const char outcome = Outcome(c, absl::Seconds(5));
    served += outcome == 'S';
    closed += outcome == 'C';
    clients.push_back(c);
  }
  EXPECT_GT(served, 30);  // about 64 less the listener's own fds
  EXPECT_LT(served, 64);
  EXPECT_GT(closed, 30);  // refused once the fds ran out, not left hanging
  EXPECT_EQ(served + closed, 100);
  for (int c : clients) close(c);
  absl::SleepFor(absl::Milliseconds(300));  // the child's "gRPC" notices and closes them
  // Accepting went on: new connections are served again.
  for (int i = 0; i < 20; ++i) {
    const int c = Connect(port);
    ASSERT_GE(c, 0);
    Send(c, kPreface);
    EXPECT_EQ(Outcome(c, absl::Seconds(5)), 'S') << i;
    close(c);
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
}

}  // namespace
}  // namespace attnd
