#include "server/rpc/metrics_http.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/mutex.h"

namespace attnd {

struct MetricsHttpServer::Impl {
  httplib::Server http;
  std::thread thread;
  std::atomic<bool> thread_done{false};
  Mutex stop_mu;
  bool stopped ABSL_GUARDED_BY(stop_mu) = false;
};

absl::Status ParseHostPort(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  std::string h = address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') {
    h = h.substr(1, h.size() - 2);
  } else if (h.find(':') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': write IPv6 hosts as [addr]:port"));
  }
  int p = -1;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &p) || p < 0 || p > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': port must be 0..65535"));
  }
  *host = h.empty() ? "0.0.0.0" : h;
  *port = p;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpOptions& options, const MetricsRegistry* registry,
    std::function<bool()> ready) {
  std::string host;
  int port = 0;
  absl::Status parsed = ParseHostPort(options.listen, &host, &port);
  if (!parsed.ok()) return parsed;

  auto impl = std::make_unique<Impl>();
  httplib::Server& http = impl->http;
  const int threads = options.threads > 0 ? options.threads : 1;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // httplib's default also sets SO_REUSEPORT, which lets a second daemon bind the same port and
  // silently share scrapes with the first: keep only SO_REUSEADDR so a busy port is an error.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Scrapers and probes send their whole request at once: a second without a byte is a client to
  // drop. One request per connection, so no idle keep-alive connection holds a worker either.
  http.set_read_timeout(1, 0);
  http.set_write_timeout(5, 0);
  http.set_keep_alive_max_count(1);
  http.set_keep_alive_timeout(1);
  http.Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->RenderPrometheusText(), kPrometheusContentType);
  });
  http.Get("/healthz", [ready = std::move(ready)](const httplib::Request&, httplib::Response& res) {
    const bool ok = !ready || ready();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "ok\n" : "not ready\n", "text/plain; charset=utf-8");
  });

  const int bound =
      port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", options.listen,
                                               " (address in use, or not permitted)"));
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] {
    raw->http.listen_after_bind();
    raw->thread_done = true;
  });
  // Stop() only works once the listen loop runs: wait for it (or for an early exit).
  while (!http.is_running() && !impl->thread_done) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!http.is_running()) {
    impl->thread.join();
    return absl::UnavailableError(
        absl::StrCat("metrics: the HTTP server on ", options.listen, " exited at start"));
  }
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl), bound));
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Stop() {
  MutexLock lock(&impl_->stop_mu);
  if (impl_->stopped) return;
  impl_->stopped = true;
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace attnd
