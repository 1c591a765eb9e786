// attnd's own TCP accept loop for its plaintext gRPC listeners (the API without TLS, the
// health-only port). gRPC 1.51's listener leaves its accept loop for good after one accept4 error
// such as EMFILE, and caps nothing: a client that opens connections until the process runs out of
// file descriptors wedges the daemon until it restarts. A Listener instead:
//   - keeps one fd in reserve (/dev/null): when accept4 fails for want of fds it closes the
//     reserve, accepts the waiting connection, closes it at once and reopens the reserve, so the
//     backlog drains and accepting goes on as soon as fds are free again;
//   - holds at most ListenerOptions::max_connections connections (pending + served); at the cap
//     it closes the oldest connection that has not yet sent the HTTP/2 client preface, and when
//     none is pending it refuses (accepts and closes) the new one;
//   - hands a connection to gRPC (grpc::AddInsecureChannelFromFd) only once its 24-byte HTTP/2
//     preface has arrived, and closes one that sends anything else or nothing within
//     ListenerOptions::preface_timeout.
// TLS cannot be handed over this way in gRPC 1.51 (the fd API takes insecure credentials only), so
// TLS and token-on-loopback (local credentials) listeners keep gRPC's own accept loop.
//
// gRPC names a connection it got from an fd "fd:N" in ServerContext::peer(); PeerAddress maps that
// back to the TCP address the Listener accepted it from.
#ifndef ATTND_SERVER_RPC_LISTENER_H_
#define ATTND_SERVER_RPC_LISTENER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attnd {

struct ListenerOptions {
  std::string listen;  // host:port; port 0 picks a free one; host "" = every address
  // Connections open at once (waiting for their preface + handed to gRPC and still open); > 0.
  int64_t max_connections = 1024;
  // A connection that has not sent the whole HTTP/2 client preface this long after accept is
  // closed; > 0.
  absl::Duration preface_timeout = absl::Seconds(10);
  std::string name = "listener";  // in log lines, e.g. "API" or "health-only"
  // Called on the accept thread for each connection closed unserved, with the reason:
  // "preface_timeout", "bad_preface", "shed_pending", "refused_at_cap" or "refused_no_fds"
  // (ListenerStats' counters). May be null.
  std::function<void(absl::string_view reason)> on_close;
};

// What the Listener did, since it started (the counters) and now (open).
struct ListenerStats {
  int64_t served = 0;            // connections handed to gRPC
  int64_t preface_timeouts = 0;  // closed: no preface within the timeout
  int64_t bad_prefaces = 0;      // closed: sent something other than the HTTP/2 preface
  int64_t shed_pending = 0;      // closed at the cap: the oldest pending connection
  int64_t refused_at_cap = 0;    // accepted and closed at the cap, nothing pending to shed
  int64_t refused_no_fds = 0;    // accepted on the reserve fd and closed (EMFILE/ENFILE)
  int64_t open = 0;              // pending + served still open (as of the last count)
};

// Thread-safe. One accept thread, started by Start, stopped by Stop or the destructor.
class Listener {
 public:
  // Whether `listen` is a host:port the Listener can bind (not e.g. "unix:/path").
  static bool Supports(absl::string_view listen);

  // Binds and listens (SO_REUSEADDR, never SO_REUSEPORT: a second daemon on the same port fails
  // here). UNAVAILABLE naming the address when it is in use or cannot be bound; INVALID_ARGUMENT
  // for a malformed address or option. Nothing is accepted before Start.
  static absl::StatusOr<std::unique_ptr<Listener>> Bind(const ListenerOptions& options);
  ~Listener();

  int port() const { return port_; }

  // Starts the accept thread. `serve` takes each connection that sent its preface (a connected,
  // non-blocking socket) and owns it from then on; it runs on the accept thread.
  void Start(std::function<void(int fd)> serve);
  // Stops accepting and closes the listening sockets and the pending connections; the served
  // ones are gRPC's. Idempotent.
  void Stop();

  ListenerStats stats() const;

 private:
  struct Pending {
    int fd;
    absl::Time deadline;
    std::string peer;
  };
  struct Served {
    int fd;
    uint64_t inode;  // tells this connection from a later one that reuses the fd number
  };

  explicit Listener(const ListenerOptions& options) : options_(options) {}
  void Loop();
  void AcceptAll(int listen_fd);
  // At the cap: makes room (drops served connections gRPC closed, then sheds the oldest pending
  // one); false when there is still no room.
  bool MakeRoom();
  void CountServed();
  void CheckPreface(int fd);
  void ClosePending(int fd);
  void ExpirePending(absl::Time now);
  // Out of fds: accepts one connection on the reserve fd and closes it; false when nothing could
  // be accepted.
  bool RefuseOnReserve(int listen_fd);
  void LogRateLimited(const std::string& message);
  void Closed(std::atomic<int64_t>* counter, absl::string_view reason);

  const ListenerOptions options_;
  int port_ = 0;
  std::vector<int> listen_fds_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;     // eventfd: Stop wakes the loop
  int reserve_fd_ = -1;  // /dev/null, given up to accept one connection when fds run out
  std::thread thread_;
  std::function<void(int fd)> serve_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> stopped_{false};  // Stop has run (or is running)

  // Accept thread only.
  std::list<Pending> pending_;  // oldest first
  absl::flat_hash_map<int, std::list<Pending>::iterator> pending_by_fd_;
  std::vector<Served> served_;
  absl::Time last_count_ = absl::InfinitePast();
  absl::Time last_log_ = absl::InfinitePast();
  int64_t logs_suppressed_ = 0;

  std::atomic<int64_t> served_total_{0}, preface_timeouts_{0}, bad_prefaces_{0}, shed_pending_{0},
      refused_at_cap_{0}, refused_no_fds_{0}, open_{0};
};

// gRPC's peer string for a call: for "fd:N" (a connection a Listener handed over) the address it
// was accepted from, as gRPC would write it ("ipv4:127.0.0.1:5678", "ipv6:[::1]:5678"); any other
// peer unchanged.
std::string PeerAddress(absl::string_view grpc_peer);

// The fd-limit-derived default for ServerOptions::max_connections: the soft RLIMIT_NOFILE less a
// reserve for everything else attnd opens (CUDA, shared memory, files, the health-only port):
// a quarter of the limit, at most 512. `fd_limit` < 0 (unlimited): 65536.
int64_t DefaultMaxConnections(int64_t fd_limit);

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_LISTENER_H_
