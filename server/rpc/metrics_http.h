// Serves the Prometheus registry over plain HTTP: GET /metrics (text format 0.0.4) and GET /healthz
// (200 "ok" when ready, 503 otherwise), on its own small thread pool so scrapes never touch the
// gRPC threads. Plain HTTP on purpose: bind it to loopback or a cluster-internal address.
#ifndef ATTND_SERVER_RPC_METRICS_HTTP_H_
#define ATTND_SERVER_RPC_METRICS_HTTP_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/rpc/metrics.h"

namespace attnd {

struct MetricsHttpOptions {
  // host:port (IPv6 as [::1]:9400; an empty host means all interfaces); port 0 picks a free port.
  std::string listen = "127.0.0.1:9400";
  // Scrapes are rare and cheap, but a client that sends its request a byte at a time holds a
  // worker until it is done or idle for the read timeout: enough workers that a few such clients
  // cannot take them all (issue #13).
  int threads = 16;
};

// Thread-safe: port() from any thread; Stop() from any thread except a handler.
class MetricsHttpServer {
 public:
  // Binds, then serves on a background thread. `registry` must outlive the server. `ready` decides
  // /healthz (null: always ready). INVALID_ARGUMENT for a malformed address, UNAVAILABLE when the
  // address cannot be bound; both messages name the address.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsHttpOptions& options, const MetricsRegistry* registry,
      std::function<bool()> ready = nullptr);

  ~MetricsHttpServer();  // Stop()s
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }  // the bound port
  // Closes the listening socket and joins the serving thread. Idempotent.
  void Stop();

 private:
  struct Impl;
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  const int port_;
};

// Splits "host:port" / "[v6]:port" / ":port" into host and port. Exposed for tests and main.cc.
absl::Status ParseHostPort(const std::string& address, std::string* host, int* port);

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_METRICS_HTTP_H_
