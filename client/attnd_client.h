// A C++ client for attnd's v1 gRPC API (proto/attnd/v1/attention.proto). Every call returns an
// absl::Status[Or] whose code is the server's gRPC code (both use the google.rpc.Code numbering)
// and whose message is the server's message, unchanged, so callers can act on both.
//
// Thread safety: AttndClient is thread-safe (one channel, many concurrent calls). A Session is one
// stream: use it from one thread at a time.
#ifndef ATTND_CLIENT_ATTND_CLIENT_H_
#define ATTND_CLIENT_ATTND_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "client/host_tensor.h"
#include "client/prefill_wire.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"

namespace attnd {
namespace client {

struct ClientOptions {
  // Largest message sent or received. Prefill requests grow with T * 5 * Hq * D, so a client that
  // sends large chunks must raise this as the server does (its Limits.max_message_bytes).
  int64_t max_message_bytes = 512ll << 20;
  // How long Connect waits for the channel to become ready; a dead target fails fast with
  // UNAVAILABLE instead of hanging on the first RPC.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Per-RPC deadline; InfiniteDuration = none.
  absl::Duration rpc_timeout = absl::InfiniteDuration();
  // Sent as "authorization: Bearer <token>" on every call when set (attnd --auth-token-file).
  std::string token;
  // TLS: the CA that signed the server's certificate (set = TLS on); a client certificate and key
  // for mutual TLS (attnd --tls-client-ca). PEM files.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // Prefill writes its request by hand into one reused buffer and takes the reply's bytes without
  // a copy (client/prefill_wire.h); false: through the protobuf classes, as PrefillRaw does.
  bool wire_prefill = true;
  // Extra integer channel arguments, e.g. {"grpc.http2.lookahead_bytes", 67108864}
  // (docs/BENCHMARKS.md, "gRPC bytes path").
  std::vector<std::pair<std::string, int>> channel_args;
};

struct PrefillResult {
  HostTensor o;        // [T, Hq, D], the dtype of q
  int64_t length = 0;  // the layer's length after the call
};

struct DecodeInput {
  std::string sequence_id;
  HostTensor q;  // [3 or 5, Hq, D], or [Hq, D] with Q_LAYOUT_PRE_ROTARY
  HostTensor k;  // [Hkv, D] (before the rotary with Q_LAYOUT_PRE_ROTARY)
  HostTensor v;  // [Hkv, D]
  v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS;  // per entry (docs/rotary.md)
};

struct DecodeResult {
  HostTensor o;        // [Hq, D], the dtype of the entry's q
  int64_t length = 0;  // the layer's length after this token
};

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpc(const grpc::Status& status);

class Session;

class AttndClient {
 public:
  // Opens a channel to `target` (host:port) and waits until it is ready.
  static absl::StatusOr<std::unique_ptr<AttndClient>> Connect(const std::string& target,
                                                              const ClientOptions& options = {});

  absl::StatusOr<v1::GetServerInfoResponse> Info();
  absl::StatusOr<std::string> CreateSequence();
  // Returns the number of pages freed.
  absl::StatusOr<int64_t> Release(const std::string& sequence_id);

  // q [T, 5, Hq, D] (the five variants), or with Q_LAYOUT_PRE_ROTARY q [T, Hq, D] and k before
  // the rotary, which the server applies (docs/rotary.md).
  absl::StatusOr<PrefillResult> Prefill(const std::string& sequence_id, int32_t layer,
                                        const HostTensor& q, const HostTensor& k,
                                        const HostTensor& v,
                                        std::optional<int64_t> prompt_len = std::nullopt,
                                        v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS);
  // One token for each entry's sequence, all in `layer`; results in entry order.
  absl::StatusOr<std::vector<DecodeResult>> Decode(int32_t layer,
                                                   const std::vector<DecodeInput>& entries);

  // The same calls on hand-built protos, for requests the typed API cannot express (tests of
  // malformed input, e.g. DTYPE_UNSPECIFIED).
  absl::StatusOr<v1::PrefillResponse> PrefillRaw(const v1::PrefillRequest& request);
  absl::StatusOr<v1::DecodeResponse> DecodeRaw(const v1::DecodeRequest& request);
  absl::StatusOr<v1::ReleaseSequenceResponse> ReleaseRaw(const v1::ReleaseSequenceRequest& request);

  // A new Session stream.
  absl::StatusOr<std::unique_ptr<Session>> OpenSession();

  // grpc.health.v1 Check for `service` ("" = the whole server): true when SERVING.
  absl::StatusOr<bool> Healthy(const std::string& service);

  const ClientOptions& options() const { return options_; }

 private:
  AttndClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);
  // Per-call settings every RPC shares: the deadline and the bearer token.
  void SetDeadline(grpc::ClientContext* context) const;

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  const grpc::internal::RpcMethod prefill_method_;  // Prefill's wire path (raw bytes)
  const std::shared_ptr<SendBuffers> send_buffers_ = std::make_shared<SendBuffers>();
  friend class Session;
};

// Prefill and Decode over one bidirectional stream: each call writes one request and reads its
// response, so requests are answered in order. A request the server rejects returns that error and
// leaves the stream usable; a broken stream returns the stream's final status, and every later
// call fails with it.
class Session {
 public:
  ~Session();

  absl::StatusOr<PrefillResult> Prefill(const std::string& sequence_id, int32_t layer,
                                        const HostTensor& q, const HostTensor& k,
                                        const HostTensor& v,
                                        std::optional<int64_t> prompt_len = std::nullopt,
                                        v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS);
  absl::StatusOr<std::vector<DecodeResult>> Decode(int32_t layer,
                                                   const std::vector<DecodeInput>& entries);
  // Half-closes the stream and returns its final status (OK when the server ended it cleanly).
  absl::Status Close();

 private:
  friend class AttndClient;
  Session() = default;
  absl::StatusOr<v1::SessionResponse> RoundTrip(v1::SessionRequest* request);

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  uint64_t next_tag_ = 1;
  absl::Status broken_;  // set once the stream has failed
  bool closed_ = false;
};

}  // namespace client
}  // namespace attnd

#endif  // ATTND_CLIENT_ATTND_CLIENT_H_
