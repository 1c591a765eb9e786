// The attnd daemon as a library: model config + engine + KV cache + gRPC service, started on an
// address. main.cc wraps it with flags and signals; tests start it in-process on 127.0.0.1:0.
#ifndef ATTND_SERVER_RPC_SERVER_H_
#define ATTND_SERVER_RPC_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "server/engine/engine.h"

namespace attnd {

struct ServerOptions {
  std::string listen = "127.0.0.1:50051";  // host:port; port 0 picks a free one
  std::string model_config;                // path to a Hugging Face config.json; "" = Qwen2.5-7B-1M
  std::string device = "auto";             // auto | cpu | cuda
  // cuda: CUDA device ordinals to shard the kv heads over, e.g. "0,1" or "0,0" (two shards on one
  // GPU); "" = device 0 alone. cpu: shards (0 or 1 = unsharded). docs/sharding.md.
  std::string devices;
  int32_t shards = 0;
  int64_t kv_cache_bytes = 0;      // 0 = the backend's default
  double kv_cache_fraction = 0.9;  // cuda with kv_cache_bytes 0: share of free device memory
  std::string kv_dtype = "auto";   // auto | bf16 | fp32 | fp8 | int8 (auto: fp32 on cpu)
  int32_t page_size = 16;          // tokens per page; must divide the DCA chunk length
  int64_t max_message_bytes = 512ll << 20;  // fits a 4096-token fp32 prefill of the 14B model
  int64_t max_sequence_length = 0;          // 0 = the model's max_position_embeddings
  int64_t max_sequences = 0;                // 0 = unlimited
  bool check_finite = true;                 // refuse NaN/Inf in host q/k/v (RuntimeOptions)
  int32_t compute_threads = 0;              // CPU kernel threads; 0 = all cores
  int32_t request_workers = 0;              // threads running requests; 0 = a default

  // Cross-RPC decode batching (docs/batching.md).
  bool decode_batching = true;       // false: every Decode runs as its own batch
  int32_t max_decode_batch = 256;    // entries per merged batch
  int64_t max_queue_delay_us = 100;  // longest wait for more calls; 0 = never wait
  std::string cuda_graph_batch_sizes = absl::StrJoin(DefaultDecodeBatchSizes(), ",");
  bool disable_cuda_graphs = false;      // never capture or replay graphs (no effect on CPU)
  int32_t decode_batches_in_flight = 2;  // merged batches of one layer running at once
  // The device's step scheduler (server/sched/step_scheduler.h, docs/scheduling.md).
  int64_t prefill_step_keys = 0;    // bound on one prefill step (EngineOptions); 0: the backend's
  int32_t decode_reserved_sms = 0;  // SMs kept free of prefill (EngineOptions; CUDA only)
  double prefill_share = 0.25;      // least device share of a waiting prefill

  // Operations (docs/operations.md).
  // HTTP /metrics and /healthz; "" = off. Off here so in-process servers (tests) never collide
  // on a fixed port; attnd's --metrics-listen defaults to 127.0.0.1:9400.
  std::string metrics_listen;
  std::string health_listen;    // plaintext health-only gRPC; "" = off
  std::string tls_cert;         // PEM chain; with tls_key, the API uses TLS
  std::string tls_key;          // PEM private key
  std::string tls_client_ca;    // PEM CA bundle; set = mutual TLS
  std::string auth_token_file;  // "TENANT TOKEN" lines; "" = auth off
  // The tenant (of auth_token_file) that may call attnd.v1.Admin; "" = none. With auth off the
  // Admin service serves loopback peers instead, and this must be "".
  std::string admin_tenant;
  // The request log (server/rpc/request_log.h): one info line per RPC, one in request_log_sample OK
  // requests (0 = none) and every error, at most request_log_max_per_second lines a second (0 = no
  // cap; the rest are counted as suppressed).
  int64_t request_log_sample = 1000;
  int64_t request_log_max_per_second = 50;
  // Defaults safe with several tenants (docs/operations.md, "Limits"): a killed client's sequences
  // are freed after 10 minutes, and with tokens no tenant takes more than its share of
  // max_sequences.
  absl::Duration sequence_idle_timeout = absl::Minutes(10);  // 0 = never reclaim
  int64_t tenant_page_quota = 0;                             // KV pages per tenant; 0 = unlimited
  // Live sequences per tenant; 0 = unlimited; -1 = max_sequences / the number of tenants of
  // auth_token_file (unlimited with auth off: every caller is then one tenant).
  int64_t tenant_max_sequences = -1;

  // Memory and connection bounds (docs/operations.md, "Limits"). A client that sends and never
  // reads is held to them: HTTP/2 flow control stops it once they are reached.
  int32_t max_streams_per_connection = 64;  // concurrent calls (streams) on one connection
  // Client connections open at once on a plaintext API listener (server/rpc/listener.h): at the
  // cap the oldest one that has not sent its HTTP/2 preface is closed, else the new one is
  // refused. 0 = the soft fd limit less a reserve (DefaultMaxConnections). TLS listeners keep
  // gRPC's own accept loop, which this does not bound.
  int64_t max_connections = 0;
  // A connection that has not sent the HTTP/2 client preface this long after accept is closed
  // (with TLS: the handshake must finish in this time).
  absl::Duration connection_preface_timeout = absl::Seconds(10);
  // Requests being served, all together: messages, shm copies, ring requests. Idle shm copy
  // buffers kept for reuse stay below it too.
  int64_t max_inflight_request_bytes = 2ll << 30;
  int64_t grpc_memory_bytes = 4ll << 30;  // gRPC's resource quota (transport buffers)
  // Extra integer channel arguments for the API listener, "name=value,..." (e.g.
  // "grpc.http2.lookahead_bytes=8388608"), after attnd's own; "" = none (docs/operations.md).
  std::string grpc_channel_args;
  // Unary Prefill requests read from the message's slices and replies written around the engine's
  // output (server/rpc/wire.h); false: protobuf parses and serializes every message.
  bool wire_fast_path = true;
  // Idle request/reply buffers the fast path keeps for reuse (freed after ~10 s unused).
  int64_t wire_buffer_pool_bytes = 1ll << 30;

  // Tensor regions and shared-memory rings (docs/regions.md). max_regions_per_tenant 0 turns
  // both off.
  int64_t max_regions_per_tenant = 64;                      // regions and rings of one tenant
  int64_t max_region_bytes_per_tenant = 64ll << 30;         // their mapped bytes
  absl::Duration region_idle_timeout = absl::Seconds(300);  // unused this long: unregistered
  absl::Duration ring_spin = absl::Microseconds(50);  // a ring's thread spins this long per request
  // Ring threads that may spin at once, of one tenant and of all (RingOptions).
  int32_t ring_max_spinning_per_tenant = 1;
  int32_t ring_max_spinning = 2;

  // A fleet member (docs/fleet.md): sequence ids become "<instance_name>.<32 hex>", and calls for
  // another instance's ids fail FAILED_PRECONDITION naming it. "" = unnamed, ids as ever.
  std::string instance_name;
  std::string advertise_address;  // host:port clients should use to reach this instance; reported

  // Tests only (fault injection, tests/reliability): wraps the engine before the runtime takes it,
  // e.g. in server/engine/fault_engine.h's FaultEngine. Unset = the engine as created.
  std::function<std::unique_ptr<Engine>(std::unique_ptr<Engine>)> wrap_engine;
};

class AttndServer {
 public:
  // Loads the model, allocates the pool, starts serving; health says SERVING once this returns.
  // Errors name the flag, file or key that was wrong.
  static absl::StatusOr<std::unique_ptr<AttndServer>> Start(const ServerOptions& options);
  virtual ~AttndServer() = default;

  virtual int port() const = 0;                     // the bound port
  virtual int metrics_port() const = 0;             // the bound metrics port; 0 = metrics off
  virtual int health_port() const = 0;              // the bound health-only port; 0 = off
  virtual std::string startup_summary() const = 0;  // address, backend, model, pool size
  // Health turns NOT_SERVING (gRPC health, the health-only port, /healthz), new work gets
  // UNAVAILABLE, in-flight RPCs may finish until `deadline`, then the rest are cancelled; then the
  // idle reaper and the metrics and health listeners stop.
  virtual void Shutdown(absl::Time deadline) = 0;
  virtual void Wait() = 0;  // blocks until Shutdown has completed
};

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_SERVER_H_
