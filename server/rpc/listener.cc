#include "server/rpc/listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/mutex.h"
#include "spdlog/spdlog.h"

namespace attnd {
namespace {

// RFC 9113 3.4: every HTTP/2 client connection starts with these 24 octets.
constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr size_t kPrefaceLen = sizeof(kPreface) - 1;
static_assert(kPrefaceLen == 24);

// Served connections are counted (one fstat each) at most this often while at the cap.
constexpr absl::Duration kCountInterval = absl::Milliseconds(100);
// One warning line per this interval at most; the rest are counted into the next one.
constexpr absl::Duration kLogInterval = absl::Seconds(10);
// Connections accepted per wake-up before the loop looks at pending prefaces again.
constexpr int kAcceptBatch = 256;

struct HostPort {
  std::string host;  // without brackets; "" = every address
  int port = 0;
};

// "host:port", "[v6]:port" or ":port"; nullopt-like error for anything else (schemes such as
// "unix:" or "ipv4:" included).
absl::StatusOr<HostPort> SplitHostPort(absl::string_view listen) {
  const size_t colon = listen.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", listen, "' is not host:port"));
  }
  absl::string_view host = listen.substr(0, colon);
  const absl::string_view port = listen.substr(colon + 1);
  HostPort out;
  if (!absl::SimpleAtoi(port, &out.port) || out.port < 0 || out.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", listen, "': the port must be a number in [0, 65535]"));
  }
  if (absl::ConsumePrefix(&host, "[")) {
    if (!absl::ConsumeSuffix(&host, "]")) {
      return absl::InvalidArgumentError(absl::StrCat("'", listen, "': unbalanced '['"));
    }
  } else if (absl::StrContains(host, ':')) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", listen, "' is not host:port (write an IPv6 host as [addr]:port)"));
  }
  out.host = std::string(host);
  return out;
}

// The address as gRPC writes peers: "ipv4:1.2.3.4:5", "ipv6:[::1]:5" (v4-mapped as ipv4).
std::string FormatPeer(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
    return absl::StrCat("ipv4:", text, ":", ntohs(v4->sin_port));
  }
  if (addr.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {
      inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], text, sizeof(text));
      return absl::StrCat("ipv4:", text, ":", ntohs(v6->sin6_port));
    }
    inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
    return absl::StrCat("ipv6:[", text, "]:", ntohs(v6->sin6_port));
  }
  return "unknown";
}

// fd -> peer address of the connections Listeners handed to gRPC. An fd number is reused only
// after its connection was closed, and a reuse overwrites the entry, so stale entries are never
// read for a live connection.
class PeerRegistry {
 public:
  static PeerRegistry& Get() {
    static PeerRegistry* registry = new PeerRegistry();  // never destroyed: used at exit by gRPC
    return *registry;
  }
  void Set(int fd, std::string peer) {
    MutexLock lock(&mu_);
    peers_[fd] = std::move(peer);
  }
  std::string Find(int fd) {
    MutexLock lock(&mu_);
    auto it = peers_.find(fd);
    return it == peers_.end() ? std::string() : it->second;
  }

 private:
  Mutex mu_;
  absl::flat_hash_map<int, std::string> peers_ ABSL_GUARDED_BY(mu_);
};

int OpenReserve() { return open("/dev/null", O_RDONLY | O_CLOEXEC); }

}  // namespace

bool Listener::Supports(absl::string_view listen) { return SplitHostPort(listen).ok(); }

absl::StatusOr<std::unique_ptr<Listener>> Listener::Bind(const ListenerOptions& options) {
  if (options.max_connections <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ListenerOptions::max_connections must be > 0, got ", options.max_connections));
  }
  if (options.preface_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ListenerOptions::preface_timeout must be > 0, got ",
                     absl::FormatDuration(options.preface_timeout)));
  }
  absl::StatusOr<HostPort> hp = SplitHostPort(options.listen);
  if (!hp.ok()) return hp.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = absl::StrCat(hp->port);
  if (int rc = getaddrinfo(hp->host.empty() ? nullptr : hp->host.c_str(), port_text.c_str(), &hints,
                           &found);
      rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.listen, ": cannot resolve '", hp->host, "': ", gai_strerror(rc)));
  }
  bool has_v4 = false, has_v6 = false;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    has_v4 |= a->ai_family == AF_INET;
    has_v6 |= a->ai_family == AF_INET6;
  }
  std::unique_ptr<Listener> listener(new Listener(options));
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    sockaddr_storage addr{};
    std::memcpy(&addr, a->ai_addr, a->ai_addrlen);
    if (listener->port_ != 0) {  // port 0: every address gets the port the first one got
      if (addr.ss_family == AF_INET) {
        reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(listener->port_);
      } else {
        reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(listener->port_);
      }
    }
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    // Lets a restarted daemon bind while old connections sit in TIME_WAIT; unlike SO_REUSEPORT it
    // never lets two listening sockets share the port.
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (a->ai_family == AF_INET6) {
      // "[::]" alone serves IPv4 too (as gRPC's listener does); next to an IPv4 address it must
      // not, or the two binds collide.
      const int v6only = has_v4 ? 1 : 0;
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only));
    }
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), a->ai_addrlen) != 0 || listen(fd, 4096) != 0) {
      const int err = errno;
      close(fd);
      if (err == EADDRINUSE) {
        freeaddrinfo(found);
        return absl::UnavailableError(
            absl::StrCat(options.listen,
                         ": the address is in use (another attnd, or another program, listens "
                         "there)"));
      }
      last_error = std::strerror(err);
      continue;
    }
    listener->listen_fds_.push_back(fd);
    if (listener->port_ == 0) {
      sockaddr_storage bound{};
      socklen_t len = sizeof(bound);
      getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
      listener->port_ =
          ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    }
  }
  freeaddrinfo(found);
  (void)has_v6;
  if (listener->listen_fds_.empty()) {
    return absl::UnavailableError(
        absl::StrCat(options.listen, ": cannot listen there: ", last_error));
  }
  listener->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  listener->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  listener->reserve_fd_ = OpenReserve();
  if (listener->epoll_fd_ < 0 || listener->wake_fd_ < 0 || listener->reserve_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat(options.listen, ": cannot set up the accept loop: ", std::strerror(errno)));
  }
  return listener;
}

Listener::~Listener() {
  Stop();
  for (int fd : {epoll_fd_, wake_fd_, reserve_fd_}) {
    if (fd >= 0) close(fd);
  }
}

void Listener::Start(std::function<void(int fd)> serve) {
  serve_ = std::move(serve);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  for (int fd : listen_fds_) {
    ev.data.fd = fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
  thread_ = std::thread([this] { Loop(); });
}

void Listener::Stop() {
  if (stopped_.exchange(true)) return;
  stopping_.store(true);
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  for (const Pending& p : pending_) close(p.fd);
  pending_.clear();
  pending_by_fd_.clear();
  for (int fd : listen_fds_) close(fd);
  listen_fds_.clear();
}

ListenerStats Listener::stats() const {
  ListenerStats s;
  s.served = served_total_.load();
  s.preface_timeouts = preface_timeouts_.load();
  s.bad_prefaces = bad_prefaces_.load();
  s.shed_pending = shed_pending_.load();
  s.refused_at_cap = refused_at_cap_.load();
  s.refused_no_fds = refused_no_fds_.load();
  s.open = open_.load();
  return s;
}

void Listener::Loop() {
  epoll_event events[64];
  while (!stopping_.load()) {
    int timeout_ms = -1;
    if (!pending_.empty()) {
      const absl::Duration left = pending_.front().deadline - absl::Now();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), 0, 3600 * 1000));
    }
    const int n = epoll_wait(epoll_fd_, events, 64, timeout_ms);
    if (n < 0 && errno != EINTR) {
      LogRateLimited(absl::StrCat("epoll_wait failed: ", std::strerror(errno)));
      absl::SleepFor(absl::Milliseconds(10));
    }
    for (int i = 0; i < n && !stopping_.load(); ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) continue;
      if (std::find(listen_fds_.begin(), listen_fds_.end(), fd) != listen_fds_.end()) {
        AcceptAll(fd);
      } else {
        CheckPreface(fd);
      }
    }
    ExpirePending(absl::Now());
    open_.store(static_cast<int64_t>(pending_.size() + served_.size()));
  }
}

void Listener::AcceptAll(int listen_fd) {
  for (int i = 0; i < kAcceptBatch && !stopping_.load(); ++i) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd =
        accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EMFILE || err == ENFILE) {
        // Connections still silent hold fds for nothing: they go first.
        if (!pending_.empty()) {
          Closed(&shed_pending_, "shed_pending");
          ClosePending(pending_.front().fd);
          continue;
        }
        if (!RefuseOnReserve(listen_fd)) return;
        continue;
      }
      LogRateLimited(absl::StrCat("accept4 failed: ", std::strerror(err)));
      absl::SleepFor(absl::Milliseconds(10));  // e.g. ENOBUFS: give the kernel a moment
      return;
    }
    if (static_cast<int64_t>(pending_.size() + served_.size()) >= options_.max_connections &&
        !MakeRoom()) {
      close(fd);
      Closed(&refused_at_cap_, "refused_at_cap");
      LogRateLimited(absl::StrCat(
          "all ", options_.max_connections,
          " connections allowed are open and none is waiting for its HTTP/2 preface: refused a "
          "new connection"));
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    pending_.push_back(Pending{fd, absl::Now() + options_.preface_timeout, FormatPeer(addr)});
    pending_by_fd_[fd] = std::prev(pending_.end());
    epoll_event ev{};
    // Edge-triggered: a partial preface is only peeked at (gRPC reads it later), so a
    // level-triggered wait would wake at once, again and again, until the rest arrives.
    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) ClosePending(fd);
  }
}

bool Listener::MakeRoom() {
  const absl::Time now = absl::Now();
  if (now - last_count_ >= kCountInterval) {
    last_count_ = now;
    CountServed();
  }
  if (static_cast<int64_t>(pending_.size() + served_.size()) < options_.max_connections) {
    return true;
  }
  if (pending_.empty()) return false;
  Closed(&shed_pending_, "shed_pending");
  LogRateLimited(absl::StrCat("all ", options_.max_connections,
                              " connections allowed are open: closed the oldest one still waiting "
                              "for its HTTP/2 preface"));
  ClosePending(pending_.front().fd);
  return true;
}

void Listener::CountServed() {
  // gRPC closes a served connection's fd without telling us: the fd is gone, or its number now
  // belongs to another file.
  served_.erase(std::remove_if(served_.begin(), served_.end(),
                               [](const Served& s) {
                                 struct stat st {};
                                 return fstat(s.fd, &st) != 0 || !S_ISSOCK(st.st_mode) ||
                                        static_cast<uint64_t>(st.st_ino) != s.inode;
                               }),
                served_.end());
}

void Listener::CheckPreface(int fd) {
  auto it = pending_by_fd_.find(fd);
  if (it == pending_by_fd_.end()) return;  // closed earlier in this wake-up
  char buf[kPrefaceLen];
  const ssize_t n = recv(fd, buf, sizeof(buf), MSG_PEEK);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
    ClosePending(fd);  // reset by the client
    return;
  }
  if (n == 0) {
    ClosePending(fd);  // closed by the client before its preface
    return;
  }
  if (std::memcmp(buf, kPreface, static_cast<size_t>(n)) != 0) {
    Closed(&bad_prefaces_, "bad_preface");
    ClosePending(fd);
    return;
  }
  if (static_cast<size_t>(n) < kPrefaceLen) return;  // the rest wakes the loop again
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  struct stat st {};
  fstat(fd, &st);
  PeerRegistry::Get().Set(fd, std::move(it->second->peer));
  pending_.erase(it->second);
  pending_by_fd_.erase(it);
  served_.push_back(Served{fd, static_cast<uint64_t>(st.st_ino)});
  served_total_.fetch_add(1);
  serve_(fd);
}

void Listener::ClosePending(int fd) {
  auto it = pending_by_fd_.find(fd);
  if (it == pending_by_fd_.end()) return;
  pending_.erase(it->second);
  pending_by_fd_.erase(it);
  close(fd);  // also leaves the epoll set
}

void Listener::ExpirePending(absl::Time now) {
  while (!pending_.empty() && pending_.front().deadline <= now) {
    Closed(&preface_timeouts_, "preface_timeout");
    ClosePending(pending_.front().fd);
  }
}

bool Listener::RefuseOnReserve(int listen_fd) {
  if (reserve_fd_ >= 0) {
    close(reserve_fd_);
    reserve_fd_ = -1;
  }
  const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) {
    close(fd);
    Closed(&refused_no_fds_, "refused_no_fds");
  }
  reserve_fd_ = OpenReserve();
  LogRateLimited(
      "out of file descriptors (accept4: EMFILE/ENFILE): refused a connection and kept "
      "accepting; raise the fd limit or lower the connection cap (--max-connections)");
  if (fd < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
    // Another thread took the reserve's fd first: back off instead of spinning on the backlog.
    absl::SleepFor(absl::Milliseconds(5));
    return false;
  }
  return fd >= 0;
}

void Listener::Closed(std::atomic<int64_t>* counter, absl::string_view reason) {
  counter->fetch_add(1);
  if (options_.on_close) options_.on_close(reason);
}

void Listener::LogRateLimited(const std::string& message) {
  const absl::Time now = absl::Now();
  if (now - last_log_ < kLogInterval) {
    ++logs_suppressed_;
    return;
  }
  last_log_ = now;
  spdlog::warn("{} listener {} (port {}): {}{}", options_.name, options_.listen, port_, message,
               logs_suppressed_ > 0
                   ? absl::StrCat(" (", logs_suppressed_, " more such events in the last ",
                                  absl::FormatDuration(kLogInterval), " or more)")
                   : std::string());
  logs_suppressed_ = 0;
}

std::string PeerAddress(absl::string_view grpc_peer) {
  absl::string_view rest = grpc_peer;
  int fd = -1;
  if (absl::ConsumePrefix(&rest, "fd:") && absl::SimpleAtoi(rest, &fd)) {
    std::string peer = PeerRegistry::Get().Find(fd);
    if (!peer.empty()) return peer;
  }
  return std::string(grpc_peer);
}

int64_t DefaultMaxConnections(int64_t fd_limit) {
  if (fd_limit < 0) return 65536;
  const int64_t reserve = std::min<int64_t>(512, fd_limit / 4);
  return std::max<int64_t>(1, fd_limit - reserve);
}

}  // namespace attnd
