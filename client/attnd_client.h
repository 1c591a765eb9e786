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
#include "attnd/v1/admin.grpc.pb.h"
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

// A tensor in a registered region (docs/regions.md): its dtype and shape, and where its bytes are.
struct TensorRef {
  DType dtype = DType::kFp32;
  std::vector<int64_t> shape;
  v1::RegionRef region;

  // [offset, offset + product(shape) * ElementSize(dtype)) of region `region_id`.
  static TensorRef In(const std::string& region_id, uint64_t offset, DType dtype,
                      std::vector<int64_t> shape);
  uint64_t byte_size() const { return region.byte_size(); }
};

// A request tensor: host bytes (borrowed: the HostTensor must outlive the call) or a region
// reference (the server reads the bytes from the region; none travel in the request).
struct TensorArg {
  TensorArg() = default;
  TensorArg(const HostTensor& tensor) : host(&tensor) {}   // NOLINT(runtime/explicit)
  TensorArg(TensorRef tensor) : ref(std::move(tensor)) {}  // NOLINT(runtime/explicit)
  const HostTensor* host = nullptr;
  std::optional<TensorRef> ref;
};

// A prefill with every option: q/k/v as host bytes or region references, and optionally an output
// region (then the result's o has dtype and shape but no data, and o_region says where it went).
struct PrefillInput {
  std::string sequence_id;
  int32_t layer = 0;
  TensorArg q, k, v;
  std::optional<int64_t> prompt_len;
  v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS;
  std::optional<v1::RegionRef> output_region;  // T * Hq * D * ElementSize(q) bytes
};

struct PrefillResult {
  HostTensor o;        // [T, Hq, D], the dtype of q (no data when the output went to a region)
  int64_t length = 0;  // the layer's length after the call
  std::optional<v1::RegionRef> o_region;  // where o was written, with an output region
};

struct DecodeInput {
  std::string sequence_id;
  HostTensor q;  // [3 or 5, Hq, D], or [Hq, D] with Q_LAYOUT_PRE_ROTARY
  HostTensor k;  // [Hkv, D] (before the rotary with Q_LAYOUT_PRE_ROTARY)
  HostTensor v;  // [Hkv, D]
  v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS;  // per entry (docs/rotary.md)
  // Region references used instead of q / k / v when set (the HostTensor is then ignored).
  std::optional<TensorRef> q_ref, k_ref, v_ref;
  std::optional<v1::RegionRef> output_region;  // Hq * D * ElementSize(q) bytes
};

struct DecodeResult {
  HostTensor o;        // [Hq, D], the dtype of the entry's q (no data with an output region)
  int64_t length = 0;  // the layer's length after this token
  std::optional<v1::RegionRef> o_region;  // where o was written, with an output region
};

// The most tokens one Prefill call may carry with q, k and v inline in `dtype` and `q_layout`,
// under the server's limits (GetServerInfo: limits.max_message_bytes and the model's geometry, by
// the rule of Limits.max_prefill_tokens_per_call; limits.max_prefill_tokens_per_call itself holds
// for every encoding). Send a longer prompt in calls of at most this many tokens; tensors in
// registered regions travel outside the message. The engines take any call size.
int64_t MaxPrefillTokens(const v1::GetServerInfoResponse& info, DType dtype, v1::QLayout q_layout);

// The request builders and reply parsers the unary calls, Session and RingClient share.
namespace internal {
void ToProto(const TensorArg& tensor, v1::Tensor* proto);
void BuildPrefill(const PrefillInput& in, v1::PrefillRequest* request);
void BuildDecode(int32_t layer, const std::vector<DecodeInput>& entries,
                 v1::DecodeRequest* request);
absl::StatusOr<PrefillResult> ParsePrefill(const v1::PrefillResponse& response);
// The same, moving the output bytes out of `response`.
absl::StatusOr<PrefillResult> ParsePrefill(v1::PrefillResponse* response);
absl::StatusOr<std::vector<DecodeResult>> ParseDecode(const v1::DecodeResponse& response,
                                                      size_t num_entries);
}  // namespace internal

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpc(const grpc::Status& status);

// Why `target` (host:port) gives no gRPC channel, found by a plain TCP connect and, when that
// succeeds, one HTTP request: UNAVAILABLE "cannot reach attnd at TARGET: connection refused; is
// the daemon running? ...", "... answers HTTP, not gRPC: that is attnd's metrics port ...", or
// that it accepts TCP but the gRPC handshake failed (with the TLS hint that `tls` calls for).
// Waits at most `timeout` for each step.
absl::Status DiagnoseUnreachable(const std::string& target, bool tls, absl::Duration timeout);

class Session;

class AttndClient {
 public:
  // Opens a channel to `target` (host:port) and waits until it is ready, at most
  // options.connect_timeout; fails as soon as the first connection attempt fails (connection
  // refused, or a port that does not speak gRPC), saying why (DiagnoseUnreachable).
  static absl::StatusOr<std::unique_ptr<AttndClient>> Connect(const std::string& target,
                                                              const ClientOptions& options = {});

  absl::StatusOr<v1::GetServerInfoResponse> Info();
  // The same within `timeout` (or rpc_timeout if shorter): DEADLINE_EXCEEDED from a hung server.
  absl::StatusOr<v1::GetServerInfoResponse> Info(absl::Duration timeout);
  absl::StatusOr<std::string> CreateSequence();
  // The same within `timeout` (or rpc_timeout if shorter).
  absl::StatusOr<std::string> CreateSequence(absl::Duration timeout);
  // Returns the number of pages freed.
  absl::StatusOr<int64_t> Release(const std::string& sequence_id);

  // q [T, 5, Hq, D] (the five variants), or with Q_LAYOUT_PRE_ROTARY q [T, Hq, D] and k before
  // the rotary, which the server applies (docs/rotary.md).
  absl::StatusOr<PrefillResult> Prefill(const std::string& sequence_id, int32_t layer,
                                        const HostTensor& q, const HostTensor& k,
                                        const HostTensor& v,
                                        std::optional<int64_t> prompt_len = std::nullopt,
                                        v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS);
  absl::StatusOr<PrefillResult> Prefill(const PrefillInput& input);
  // One token for each entry's sequence, all in `layer`; results in entry order.
  absl::StatusOr<std::vector<DecodeResult>> Decode(int32_t layer,
                                                   const std::vector<DecodeInput>& entries);

  // Tensor regions (docs/regions.md); each returns the region id. RegisteredRegion
  // (client/regions.h) unregisters when it goes away.
  // [offset, offset + bytes) of the POSIX shm object `name` (offset a multiple of 4096).
  absl::StatusOr<std::string> RegisterShm(const std::string& name, uint64_t offset, uint64_t bytes);
  // Device memory shared by cudaIpcGetMemHandle: `handle` is the 64-byte cudaIpcMemHandle_t,
  // `bytes` how much of the allocation (from its start) the region covers.
  absl::StatusOr<std::string> RegisterCudaIpc(const std::string& handle, uint64_t bytes);
  absl::Status UnregisterRegion(const std::string& region_id);
  // Rings (RingClient in client/regions.h lays one out and calls these).
  absl::StatusOr<v1::OpenRingResponse> OpenRing(const std::string& name, uint64_t bytes,
                                                bool device_events = false);
  absl::Status CloseRing(const std::string& ring_id);

  // The same calls on hand-built protos, for requests the typed API cannot express (tests of
  // malformed input, e.g. DTYPE_UNSPECIFIED).
  absl::StatusOr<v1::PrefillResponse> PrefillRaw(const v1::PrefillRequest& request);
  absl::StatusOr<v1::DecodeResponse> DecodeRaw(const v1::DecodeRequest& request);
  absl::StatusOr<v1::ReleaseSequenceResponse> ReleaseRaw(const v1::ReleaseSequenceRequest& request);

  // A new Session stream.
  absl::StatusOr<std::unique_ptr<Session>> OpenSession();

  // attnd.v1.Admin (the admin tenant only, or loopback callers with tokens off): every live
  // sequence (of `tenant` only, when set), and releasing any tenant's sequence.
  absl::StatusOr<v1::AdminListSequencesResponse> ListSequences(const std::string& tenant = "");
  absl::StatusOr<v1::AdminReleaseSequenceResponse> AdminRelease(const std::string& sequence_id);

  // grpc.health.v1 Check for `service` ("" = the whole server): true when SERVING.
  absl::StatusOr<bool> Healthy(const std::string& service);

  const ClientOptions& options() const { return options_; }

 private:
  AttndClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options,
              std::string target);
  // Per-call settings every RPC shares: the deadline and the bearer token.
  // The token, and a deadline of the shorter of `timeout` and the options' rpc_timeout.
  void SetDeadline(grpc::ClientContext* context,
                   absl::Duration timeout = absl::InfiniteDuration()) const;

  // FromGrpc, and an UNIMPLEMENTED attnd.v1 method says that the target serves gRPC but not
  // attnd's API (e.g. attnd's --health-listen port).
  absl::Status Checked(const grpc::Status& status, absl::string_view method) const;

  const ClientOptions options_;
  std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  std::unique_ptr<v1::Admin::Stub> admin_stub_;
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
  absl::StatusOr<PrefillResult> Prefill(const PrefillInput& input);
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
