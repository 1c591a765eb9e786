// attnd: the daemon. Flags live here only; they are read once into ServerOptions.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/engine/engine.h"
#include "server/flag_types.h"
#include "server/rpc/server.h"
#include "spdlog/spdlog.h"
#include "version/build_info.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "host:port to serve on; port 0 picks a free one");
ABSL_FLAG(std::string, model_config, "",
          "path to the model's Hugging Face config.json; empty = Qwen2.5-7B-Instruct-1M");
ABSL_FLAG(std::string, device, "auto", "auto | cpu | cuda");
ABSL_FLAG(std::string, devices, "",
          "cuda: the GPUs (ordinals) to split the kv heads over, one shard each, e.g. 0,1; a GPU "
          "may be named twice (0,0: two shards on one GPU); empty = GPU 0 alone");
ABSL_FLAG(int32_t, shards, 0,
          "cpu: split the kv heads over this many shards (as --devices does on cuda); 0 or 1 = "
          "unsharded");
ABSL_FLAG(attnd::ByteSize, kv_cache_bytes, attnd::ByteSize{0},
          "KV pool size in bytes (4096, 512Mi, 4Gi, 1.5G: K/M/G/T powers of 1000, Ki/Mi/Gi/Ti of "
          "1024); 0 = the backend's default (CPU: min(4 GiB, RAM / 4); "
          "cuda: --kv-cache-fraction of free GPU memory)");
ABSL_FLAG(double, kv_cache_fraction, 0.9,
          "cuda only, when --kv-cache-bytes is 0: the share of the GPU's free memory at start-up "
          "that becomes the KV pool");
ABSL_FLAG(
    std::string, kv_dtype, "auto",
    "auto | bf16 | fp32 | fp8 | int8 (auto: fp32 on cpu, bf16 on cuda; fp8: E4M3, int8: "
    "symmetric int8, each with a scale per token and kv head; cuda takes bf16, int8 and fp8)");
ABSL_FLAG(int32_t, page_size, 16, "tokens per KV page; must divide the DCA chunk length");
ABSL_FLAG(attnd::ByteSize, max_message_bytes, attnd::ByteSize{512ll << 20},
          "largest request or response (bytes, or 512Mi, 1Gi, ...)");
ABSL_FLAG(int64_t, max_sequence_length, 0, "most tokens per sequence; 0 = the model's maximum");
ABSL_FLAG(int64_t, max_sequences, 0,
          "most live sequences, all tenants together; 0 = one per KV page");
ABSL_FLAG(int32_t, compute_threads, 0, "CPU kernel threads; 0 = all cores");
ABSL_FLAG(int32_t, request_workers, 0, "threads running requests; 0 = 2 x cores (at least 4)");
ABSL_FLAG(bool, decode_batching, true,
          "merge decodes of one layer from concurrent Decode RPCs and Session streams into one "
          "engine batch; false: every Decode runs as its own batch");
ABSL_FLAG(int32_t, max_decode_batch, 256, "most entries in one merged decode batch");
ABSL_FLAG(int64_t, max_queue_delay_us, 100,
          "longest a decode waits for more calls to batch with, in microseconds; 0 = never wait");
ABSL_FLAG(std::string, cuda_graph_batch_sizes, absl::StrJoin(attnd::DefaultDecodeBatchSizes(), ","),
          "decode batch sizes with a captured CUDA graph: a batch that reaches one launches at "
          "once, and on CUDA a batch is padded up to the next one; on the CPU backend only the "
          "launch rule applies");
ABSL_FLAG(bool, disable_cuda_graphs, false,
          "never capture or replay CUDA decode graphs: batches launch eagerly, planned as the next "
          "size as before (accepted on the CPU backend, where it has no effect)");
ABSL_FLAG(
    int32_t, decode_batches_in_flight, 2,
    "merged decode batches of one layer that may run at once (2: the next batch is formed and "
    "launched while the previous one answers its calls; docs/batching.md)");
ABSL_FLAG(
    int32_t, decode_reserved_sms, 0,
    "CUDA: SMs the prefill kernels never use, kept free for decode steps (rounded up to the "
    "device's green-context granularity, 8 on Hopper): a decode beside a long prefill starts "
    "at once instead of waiting for prefill blocks to finish, at the cost of those SMs' share "
    "of prefill throughput; 0 = prefill uses every SM (docs/scheduling.md)");
ABSL_FLAG(int64_t, prefill_step_keys, 0,
          "the bound on one prefill step, in keys each query row attends per step: a prefill call "
          "runs as steps of about this much work per 128-row tile (CUDA: key-tile windows, CPU: "
          "query rows), and a decode waits for one step at most, never a whole call; 0 = the "
          "backend's default: 16384 on CUDA, 512 on the CPU (docs/scheduling.md)");
ABSL_FLAG(double, prefill_share, 0.25,
          "in [0, 1]: the least share of the device a waiting prefill gets while decodes keep "
          "coming, on an engine that alternates the two (decode goes first otherwise); the CUDA "
          "and CPU engines overlap them and hold neither");
ABSL_FLAG(std::string, log_level, "info", "trace | debug | info | warn | error | critical | off");
ABSL_FLAG(int64_t, request_log_sample, 1000,
          "the request log (--log-level info): one line per RPC for one in N OK requests and every "
          "error; 1 = every request, 0 = errors only");
ABSL_FLAG(int64_t, request_log_max_per_second, 50,
          "at most this many request log lines per second (0 = no cap); the rest are counted and "
          "reported as 'suppressed N'");
ABSL_FLAG(attnd::FlexDuration, drain_timeout, attnd::FlexDuration{absl::Seconds(30)},
          "on SIGINT/SIGTERM, how long in-flight requests may run before they are cancelled (30s, "
          "1m, 500ms; a bare number is seconds)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9400",
          "host:port for HTTP GET /metrics (Prometheus) and /healthz; empty = off");
ABSL_FLAG(std::string, health_listen, "",
          "host:port of a plaintext gRPC listener serving only grpc.health.v1.Health (for probes "
          "that cannot do TLS); empty = off");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain; with --tls-key the API uses TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key (unencrypted) for --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; set = mutual TLS: clients must present a certificate it signed");
ABSL_FLAG(std::string, auth_token_file, "",
          "file of 'TENANT TOKEN' lines; clients send 'authorization: Bearer TOKEN'; empty = off");
ABSL_FLAG(std::string, admin_tenant, "",
          "the tenant of --auth-token-file that may call attnd.v1.Admin (attnctl sequences / "
          "release: every tenant's sequences); empty = nobody; with tokens off, loopback callers "
          "may");
ABSL_FLAG(attnd::FlexDuration, sequence_idle_timeout, attnd::FlexDuration{absl::Minutes(10)},
          "release sequences unused for this long (10m, 90s; a bare number is seconds), freeing "
          "their pages (a killed client's sequences); 0 = never");
ABSL_FLAG(int64_t, tenant_page_quota, 0,
          "most KV pages one tenant's sequences may hold; 0 = no limit");
ABSL_FLAG(int64_t, tenant_max_sequences, -1,
          "most live sequences of one tenant, empty ones included; 0 = no limit; -1 = "
          "--max-sequences divided by the number of tenants in --auth-token-file (no limit with "
          "tokens off, where every caller is one tenant)");
ABSL_FLAG(int32_t, max_streams_per_connection, 64,
          "most concurrent calls (HTTP/2 streams) on one client connection");
ABSL_FLAG(int64_t, max_connections, 0,
          "most client connections open at once on a plaintext --listen; at the cap the oldest "
          "one that has not sent its HTTP/2 preface is closed, else the new one is refused; 0 = "
          "the fd limit less min(512, a quarter of it)");
ABSL_FLAG(attnd::FlexDuration, connection_preface_timeout, attnd::FlexDuration{absl::Seconds(10)},
          "a client connection that has not sent its HTTP/2 preface (with TLS: finished its "
          "handshake) this long after accept is closed (10s, 500ms; a bare number is seconds)");
ABSL_FLAG(attnd::ByteSize, max_inflight_request_bytes, attnd::ByteSize{0},
          "requests being served, in bytes (or 2Gi, ...), all together, with attnd's copies of the "
          "shared memory they name; beyond it a request gets RESOURCE_EXHAUSTED at once; at least "
          "--max-message-bytes; 0 = min(2Gi, an eighth of the memory attnd may use)");
ABSL_FLAG(attnd::ByteSize, grpc_memory_bytes, attnd::ByteSize{0},
          "gRPC's memory quota for its transport buffers, in bytes (or 4Gi, ...; at least 64Mi); "
          "0 = min(4Gi, an eighth of the memory attnd may use)");
ABSL_FLAG(int64_t, max_regions_per_tenant, 64,
          "tensor regions and shared-memory rings one tenant may hold (docs/regions.md); 0 turns "
          "regions and rings off");
ABSL_FLAG(attnd::ByteSize, max_region_bytes_per_tenant, attnd::ByteSize{64ll << 30},
          "bytes of regions and rings one tenant may have mapped (or 64Gi, ...)");
ABSL_FLAG(absl::Duration, region_idle_timeout, absl::Seconds(300),
          "a region or ring no request used for this long is unregistered (e.g. 300s; 0 = never)");
ABSL_FLAG(int64_t, ring_spin_us, 50,
          "microseconds a ring's server thread spins for the next request before it sleeps");
ABSL_FLAG(int32_t, ring_max_spinning_per_tenant, 1,
          "ring threads of one tenant that may spin at once (the others sleep on the futex)");
ABSL_FLAG(int32_t, ring_max_spinning, 2, "ring threads of all tenants that may spin at once");
ABSL_FLAG(bool, check_finite, true,
          "refuse q/k/v in host memory that hold a NaN or an infinity (INVALID_ARGUMENT)");
ABSL_FLAG(bool, wire_fast_path, true,
          "read unary Prefill requests straight from gRPC's buffers and write replies around the "
          "engine's output (false: protobuf parses and serializes every message)");
ABSL_FLAG(attnd::ByteSize, wire_buffer_pool_bytes, attnd::ByteSize{1ll << 30},
          "bytes of idle request/reply buffers the Prefill fast path keeps for reuse (or 1Gi, ...; "
          "freed after about 10 s unused)");
ABSL_FLAG(std::string, grpc_channel_args, "",
          "extra integer gRPC channel arguments for the API listener, name=value,... (e.g. "
          "grpc.http2.lookahead_bytes=8388608,grpc.http2.max_frame_size=1048576)");
ABSL_FLAG(
    std::string, instance_name, "",
    "this daemon's name in a fleet (a DNS label, e.g. the StatefulSet pod name): sequence ids "
    "become NAME.<32 hex> and calls for other instances' ids fail FAILED_PRECONDITION; "
    "empty: ids are 32 hex characters");
ABSL_FLAG(std::string, advertise_address, "",
          "host:port clients should use to reach this instance (reported by GetServerInfo)");

namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "attnd: %s\n", message.c_str());
  return 1;
}

// The documented spelling is --kv-cache-bytes, but Abseil flag names are C++ identifiers
// (kv_cache_bytes), so dashes in flag names (not in values) become underscores before parsing.
void DashesToUnderscores(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* arg = argv[i];
    if (arg[0] != '-' || arg[1] != '-') continue;
    if (arg[2] == '\0') break;  // "--" ends the flags
    for (char* c = arg + 2; *c != '\0' && *c != '='; ++c) {
      if (*c == '-') *c = '_';
    }
  }
}

// The memory attnd may use: the host's RAM, or the cgroup's limit (a container's) when lower.
int64_t UsableMemoryBytes() {
  int64_t bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    if (FILE* f = std::fopen(path, "r")) {
      long long limit = 0;
      if (std::fscanf(f, "%lld", &limit) == 1 && limit > 0 && limit < bytes) bytes = limit;
      std::fclose(f);
    }
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "dual-chunk attention over gRPC (docs/operations.md lists every flag).\n"
      "usage: attnd [--flag=value ...]   flags may be spelled --kv-cache-bytes or "
      "--kv_cache_bytes\n"
      "  -h, --help  these flags    --helpfull  gRPC's and absl's too    --version  version and "
      "build");
  attnd::SetUsageConfig("attnd", "server/main.cc");
  attnd::ShortHelpToHelp(argc, argv);
  DashesToUnderscores(argc, argv);
  absl::ParseCommandLine(argc, argv);

  const std::string level = absl::GetFlag(FLAGS_log_level);
  const spdlog::level::level_enum parsed = spdlog::level::from_str(level);
  // from_str maps unknown names to "off"; only "off" itself may mean off.
  if (parsed == spdlog::level::off && level != "off") {
    return Fail(
        absl::StrCat("--log-level must be trace, debug, info, warn, error, critical or "
                     "off, got \"",
                     level, "\""));
  }
  spdlog::set_level(parsed);
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout).value;
  if (drain < absl::ZeroDuration()) {
    return Fail(absl::StrCat("--drain-timeout must be >= 0, got ", absl::FormatDuration(drain)));
  }

  // Block the shutdown signals in every thread (gRPC's included, which inherit the mask) before any
  // is created; this thread then takes them synchronously with sigwait: no async handler at all.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  attnd::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.model_config = absl::GetFlag(FLAGS_model_config);
  options.device = absl::GetFlag(FLAGS_device);
  options.devices = absl::GetFlag(FLAGS_devices);
  options.shards = absl::GetFlag(FLAGS_shards);
  options.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes).bytes;
  options.kv_cache_fraction = absl::GetFlag(FLAGS_kv_cache_fraction);
  options.kv_dtype = absl::GetFlag(FLAGS_kv_dtype);
  options.page_size = absl::GetFlag(FLAGS_page_size);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  options.max_sequence_length = absl::GetFlag(FLAGS_max_sequence_length);
  options.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  options.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  options.request_workers = absl::GetFlag(FLAGS_request_workers);
  options.decode_batching = absl::GetFlag(FLAGS_decode_batching);
  options.max_decode_batch = absl::GetFlag(FLAGS_max_decode_batch);
  options.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  options.cuda_graph_batch_sizes = absl::GetFlag(FLAGS_cuda_graph_batch_sizes);
  options.disable_cuda_graphs = absl::GetFlag(FLAGS_disable_cuda_graphs);
  options.prefill_step_keys = absl::GetFlag(FLAGS_prefill_step_keys);
  options.decode_reserved_sms = absl::GetFlag(FLAGS_decode_reserved_sms);
  if (options.decode_reserved_sms < 0) {
    return Fail(absl::StrCat("--decode-reserved-sms must be 0 (off) or more, got ",
                             options.decode_reserved_sms));
  }
  options.prefill_share = absl::GetFlag(FLAGS_prefill_share);
  if (options.prefill_step_keys < 0) {
    return Fail(absl::StrCat("--prefill-step-keys must be 0 (the backend's default) or more, got ",
                             options.prefill_step_keys));
  }
  if (!(options.prefill_share >= 0 && options.prefill_share <= 1)) {
    return Fail(absl::StrCat("--prefill-share must be in [0, 1], got ", options.prefill_share));
  }
  options.decode_batches_in_flight = absl::GetFlag(FLAGS_decode_batches_in_flight);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.admin_tenant = absl::GetFlag(FLAGS_admin_tenant);
  options.request_log_sample = absl::GetFlag(FLAGS_request_log_sample);
  options.request_log_max_per_second = absl::GetFlag(FLAGS_request_log_max_per_second);
  options.sequence_idle_timeout = absl::GetFlag(FLAGS_sequence_idle_timeout).value;
  options.tenant_page_quota = absl::GetFlag(FLAGS_tenant_page_quota);
  options.tenant_max_sequences = absl::GetFlag(FLAGS_tenant_max_sequences);
  options.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  options.max_connections = absl::GetFlag(FLAGS_max_connections);
  options.connection_preface_timeout = absl::GetFlag(FLAGS_connection_preface_timeout).value;
  options.max_inflight_request_bytes = absl::GetFlag(FLAGS_max_inflight_request_bytes).bytes;
  options.grpc_memory_bytes = absl::GetFlag(FLAGS_grpc_memory_bytes).bytes;
  // What clients that send and never read can make attnd hold is these two together: by default a
  // quarter of the memory attnd may use, at most 6 GiB (docs/operations.md, "Limits").
  const int64_t eighth = UsableMemoryBytes() / 8;
  if (options.max_inflight_request_bytes == 0) {
    options.max_inflight_request_bytes =
        std::max(options.max_message_bytes, std::min<int64_t>(int64_t{2} << 30, eighth));
  }
  if (options.grpc_memory_bytes == 0) {
    options.grpc_memory_bytes =
        std::max<int64_t>(int64_t{64} << 20, std::min<int64_t>(int64_t{4} << 30, eighth));
  }
  options.max_regions_per_tenant = absl::GetFlag(FLAGS_max_regions_per_tenant);
  options.max_region_bytes_per_tenant = absl::GetFlag(FLAGS_max_region_bytes_per_tenant).bytes;
  options.region_idle_timeout = absl::GetFlag(FLAGS_region_idle_timeout);
  options.ring_spin = absl::Microseconds(absl::GetFlag(FLAGS_ring_spin_us));
  options.ring_max_spinning_per_tenant = absl::GetFlag(FLAGS_ring_max_spinning_per_tenant);
  options.ring_max_spinning = absl::GetFlag(FLAGS_ring_max_spinning);
  options.check_finite = absl::GetFlag(FLAGS_check_finite);
  options.grpc_channel_args = absl::GetFlag(FLAGS_grpc_channel_args);
  options.wire_fast_path = absl::GetFlag(FLAGS_wire_fast_path);
  options.wire_buffer_pool_bytes = absl::GetFlag(FLAGS_wire_buffer_pool_bytes).bytes;
  options.instance_name = absl::GetFlag(FLAGS_instance_name);
  options.advertise_address = absl::GetFlag(FLAGS_advertise_address);

  absl::StatusOr<std::unique_ptr<attnd::AttndServer>> server = attnd::AttndServer::Start(options);
  if (!server.ok()) return Fail(std::string(server.status().message()));
  spdlog::info("{}", (*server)->startup_summary());
  spdlog::info(
      "memory bounds: {} bytes of requests in flight (--max-inflight-request-bytes), {} "
      "bytes of gRPC transport buffers (--grpc-memory-bytes)",
      options.max_inflight_request_bytes, options.grpc_memory_bytes);

  int signal_number = 0;
  while (sigwait(&signals, &signal_number) != 0) {
  }
  spdlog::info("received {}; shutting down: draining in-flight requests for up to {}",
               signal_number == SIGINT ? "SIGINT" : "SIGTERM", absl::FormatDuration(drain));
  (*server)->Shutdown(absl::Now() + drain);
  (*server)->Wait();
  spdlog::info("shut down");
  return 0;
}
