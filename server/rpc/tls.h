// Transport security for attnd: server credentials from --tls-cert/--tls-key (and --tls-client-ca
// for mutual TLS), the matching client-side credentials (tests, attnctl), the one function that
// combines TLS with the token processor of server/rpc/auth.h, and a plaintext health-only listener
// for probes that cannot speak TLS (the kubelet's native gRPC probe).
//
// Files are read and checked once, at startup, with OpenSSL: each error names the flag and file
// (missing/unreadable file, no PEM block, key not matching the certificate, expired certificate),
// instead of the handshake failing later for every client.
#ifndef ATTND_SERVER_RPC_TLS_H_
#define ATTND_SERVER_RPC_TLS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "server/rpc/listener.h"

namespace attnd {

struct TlsOptions {
  std::string cert_file;       // --tls-cert: PEM certificate chain, leaf first
  std::string key_file;        // --tls-key: PEM private key (unencrypted)
  std::string client_ca_file;  // --tls-client-ca: PEM CA bundle; set = clients must present a
                               // certificate signed by one of these CAs (mutual TLS)
  bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
};

// SSL server credentials; INVALID_ARGUMENT unless both cert and key are given.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeSslServerCredentials(
    const TlsOptions& options);

// The credentials to listen on `listen` with (what server.cc passes to AddListeningPort):
//   TLS on,  auth on:   SSL credentials with `auth` installed.
//   TLS on,  auth off:  SSL credentials.
//   TLS off, auth off:  insecure credentials.
//   TLS off, auth on:   gRPC runs AuthMetadataProcessors only on secure credentials, and tokens in
//                       clear text would be readable on the network. On a loopback `listen`
//                       (127.0.0.0/8, ::1, localhost) this uses local TCP credentials, which accept
//                       plaintext clients from this host only; anywhere else it is
//                       INVALID_ARGUMENT naming the flags.
// `auth` may be null (auth off). --tls-client-ca without --tls-cert is INVALID_ARGUMENT.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls, std::shared_ptr<grpc::AuthMetadataProcessor> auth,
    absl::string_view listen);

// Whether the host of "host:port" is a loopback address.
bool IsLoopbackAddress(absl::string_view listen);

struct TlsClientOptions {
  std::string ca_file;    // PEM roots to verify the server; "" = the system's roots
  std::string cert_file;  // client certificate for mutual TLS; "" = none
  std::string key_file;   // its key; required iff cert_file is set
};

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsClientOptions& options);

// A second, plaintext gRPC listener serving only grpc.health.v1.Health, for probes that cannot do
// TLS (Kubernetes' native `grpc:` probe, until KEP-4939). It exposes nothing else: no attention
// RPC, no tenant data. The owner mirrors the main server's health into it with SetServing.
// Connections come through attnd's own Listener (server/rpc/listener.h), capped at
// kMaxConnections: probes are few, and a flood of them must not take the API's fds, nor stop the
// port for good when fds run out. Thread-safe.
class HealthOnlyServer {
 public:
  static constexpr int64_t kMaxConnections = 64;

  // `listen` as host:port; port 0 picks a free one. Starts NOT_SERVING. A connection that has not
  // sent its HTTP/2 preface within `preface_timeout` is closed; `on_close` as in ListenerOptions.
  static absl::StatusOr<std::unique_ptr<HealthOnlyServer>> Start(
      const std::string& listen, absl::Duration preface_timeout = absl::Seconds(10),
      std::function<void(absl::string_view reason)> on_close = nullptr);
  ~HealthOnlyServer();

  int port() const { return port_; }
  const Listener* listener() const { return listener_.get(); }
  // Sets the overall ("") status and every service's status to SERVING / NOT_SERVING.
  void SetServing(bool serving);
  void Shutdown();  // idempotent

 private:
  HealthOnlyServer() = default;
  // gRPC 1.51 refuses to start a server whose only service is the default health service (its
  // completion queue would never be polled): this catch-all answers UNIMPLEMENTED to any other
  // method and keeps the callback queue polled.
  grpc::CallbackGenericService unimplemented_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Listener> listener_;
  int port_ = 0;
};

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_TLS_H_
