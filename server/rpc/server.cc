// AttndServer: wires model config, engine, runtime, work queue and the gRPC service together.
#include "server/rpc/server.h"

#include <dirent.h>
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "grpc/support/log.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_posix.h"
#include "kvcache/sequence_table.h"
#include "server/config/model_config.h"
#include "server/dataplane/regions.h"
#include "server/dataplane/ring.h"
#include "server/engine/engine_factory.h"
#include "server/rpc/admin_service.h"
#include "server/rpc/auth.h"
#include "server/rpc/health_service.h"
#include "server/rpc/listener.h"
#include "server/rpc/metrics.h"
#include "server/rpc/metrics_http.h"
#include "server/rpc/region_tensors.h"
#include "server/rpc/request_log.h"
#include "server/rpc/service.h"
#include "server/rpc/tls.h"
#include "server/rpc/wire.h"
#include "server/runtime/runtime.h"
#include "server/sched/batcher.h"
#include "server/sched/decode_queue.h"
#include "server/sched/step_scheduler.h"
#include "server/sched/work_queue.h"
#include "spdlog/spdlog.h"
#include "version/build_info.h"

namespace attnd {
namespace {

constexpr char kServiceName[] = "attnd.v1.Attention";

// Set when gRPC reports that accept4 failed (e.g. EMFILE: out of file descriptors). NOTE: gRPC
// 1.51's listener stops for good after such a failure (tcp_server_posix.cc leaves its accept loop)
// and serves nothing new even once fds are free again; the health watch turns the daemon
// NOT_SERVING so probes see it and the orchestrator restarts it. Only listeners left to gRPC (TLS,
// tokens on loopback) can set it: plaintext ones are attnd's own (server/rpc/listener.h), which
// never stop accepting. Process-wide, as gRPC's log is.
std::atomic<bool> g_accept_failed{false};

// gRPC's own log lines go through spdlog (one format, one level); accept failures are noted.
void GrpcLog(gpr_log_func_args* args) {
  const absl::string_view message(args->message);
  if (args->severity == GPR_LOG_SEVERITY_ERROR && absl::StrContains(message, "accept4")) {
    g_accept_failed.store(true);
  }
  const spdlog::level::level_enum level =
      args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
      : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                : spdlog::level::debug;
  spdlog::log(level, "grpc: {} ({}:{})", args->message, args->file, args->line);
}

// File descriptors open now: the entries of /proc/self/fd (-1 where there is no /proc).
int64_t OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int64_t n = 0;
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n - 3;  // ".", ".." and the directory's own fd
}

// The soft RLIMIT_NOFILE raised to the hard limit (a common soft default, 1024, is exhausted by
// about a thousand idle connections); returns the soft limit now in force.
int64_t RaiseFdLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return -1;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return limit.rlim_cur == RLIM_INFINITY ? -1 : static_cast<int64_t>(limit.rlim_cur);
}

// The batcher's options from the server's; errors name the ServerOptions field.
absl::StatusOr<DecodeBatcherOptions> BatcherOptions(const ServerOptions& o) {
  absl::StatusOr<std::vector<int32_t>> sizes = ParseBatchSizes(o.cuda_graph_batch_sizes);
  if (!sizes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::cuda_graph_batch_sizes: ", sizes.status().message()));
  }
  DecodeBatcherOptions b;
  b.max_decode_batch = o.max_decode_batch;
  b.max_queue_delay = absl::Microseconds(o.max_queue_delay_us);
  b.flush_batch_sizes = *std::move(sizes);
  b.max_inflight_batches = o.decode_batches_in_flight;
  if (absl::Status s = CheckDecodeBatcherOptions(b); !s.ok()) return s;
  return b;
}

// "name=value,..." with integer values, names starting "grpc.".
absl::StatusOr<std::vector<std::pair<std::string, int>>> ParseChannelArgs(absl::string_view text) {
  std::vector<std::pair<std::string, int>> out;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    const std::vector<absl::string_view> kv = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    int value = 0;
    if (kv.size() != 2 || !absl::StartsWith(kv[0], "grpc.") || !absl::SimpleAtoi(kv[1], &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ServerOptions::grpc_channel_args: '", entry,
                       "' is not grpc.NAME=INTEGER (e.g. grpc.http2.lookahead_bytes=8388608)"));
    }
    out.emplace_back(std::string(kv[0]), value);
  }
  return out;
}

absl::Status CheckOptions(const ServerOptions& o) {
  // First: it costs nothing, and a fleet's pods all get it from a template.
  if (absl::Status s = CheckInstanceName(o.instance_name); !s.ok()) return s;
  if (o.page_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::page_size must be > 0, got ", o.page_size));
  }
  if (o.max_message_bytes <= 0 || o.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::max_message_bytes must be in [1, ", INT_MAX, "], got ",
                     o.max_message_bytes));
  }
  if (o.max_sequence_length < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerOptions::max_sequence_length must be >= 0, got ", o.max_sequence_length));
  }
  if (o.max_sequences < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::max_sequences must be >= 0, got ", o.max_sequences));
  }
  if (o.compute_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::compute_threads must be >= 0, got ", o.compute_threads));
  }
  if (o.request_workers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::request_workers must be >= 0, got ", o.request_workers));
  }
  if (o.request_log_sample < 0 || o.request_log_max_per_second < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::request_log_sample and "
                     "ServerOptions::request_log_max_per_second must be >= 0, got ",
                     o.request_log_sample, " and ", o.request_log_max_per_second));
  }
  if (o.sequence_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::sequence_idle_timeout must be >= 0, got ",
                     absl::FormatDuration(o.sequence_idle_timeout)));
  }
  if (o.tenant_max_sequences < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerOptions::tenant_max_sequences must be >= 0 (or -1: a share per tenant), got ",
        o.tenant_max_sequences));
  }
  if (o.max_streams_per_connection <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::max_streams_per_connection must be > 0, got ",
                     o.max_streams_per_connection));
  }
  if (o.max_inflight_request_bytes < o.max_message_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::max_inflight_request_bytes (", o.max_inflight_request_bytes,
                     ") must be at least ServerOptions::max_message_bytes (", o.max_message_bytes,
                     "), or the largest request could never run"));
  }
  if (o.wire_buffer_pool_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerOptions::wire_buffer_pool_bytes must be >= 0, got ", o.wire_buffer_pool_bytes));
  }
  if (o.grpc_memory_bytes < (int64_t{64} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerOptions::grpc_memory_bytes must be at least 64 MiB, got ", o.grpc_memory_bytes));
  }
  if (o.max_connections < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::max_connections must be >= 0 (0 = from the fd limit), got ",
                     o.max_connections));
  }
  if (o.connection_preface_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::connection_preface_timeout must be > 0, got ",
                     absl::FormatDuration(o.connection_preface_timeout)));
  }
  if (o.tenant_page_quota < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::tenant_page_quota must be >= 0, got ", o.tenant_page_quota));
  }
  if (absl::StatusOr<std::vector<std::pair<std::string, int>>> args =
          ParseChannelArgs(o.grpc_channel_args);
      !args.ok()) {
    return args.status();
  }
  return absl::OkStatus();
}

absl::Status WithFlag(absl::string_view flag, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(flag, ": ", s.message()));
}

std::string HumanBytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", bytes / 1073741824.0);
  return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
}

class AttndServerImpl : public AttndServer {
 public:
  AttndServerImpl() = default;
  ~AttndServerImpl() override {
    Shutdown(absl::Now());
    Wait();
  }

  absl::Status Init(const ServerOptions& options);

  int port() const override { return port_; }
  int metrics_port() const override { return metrics_http_ != nullptr ? metrics_http_->port() : 0; }
  int health_port() const override { return health_only_ != nullptr ? health_only_->port() : 0; }
  std::string startup_summary() const override { return summary_; }
  void Shutdown(absl::Time deadline) override;
  void Wait() override { shutdown_done_.WaitForNotification(); }

 private:
  // Loads --auth-token-file into tokens_ and makes the processor that gates calls on it.
  absl::Status StartAuth(const ServerOptions& options,
                         std::shared_ptr<grpc::AuthMetadataProcessor>* processor);
  // Every min(timeout / 4, 10 s): releases sequences idle for longer than the timeout.
  void ReaperLoop(absl::Duration timeout);
  void StopReaper();
  // Every 100 ms until Shutdown: once the engine reports its device lost (Engine::healthy),
  // health turns NOT_SERVING for good.
  void HealthWatchLoop();
  void StopHealthWatch();

  int port_ = 0;
  int64_t fd_limit_ = -1;  // the soft RLIMIT_NOFILE after RaiseFdLimit; -1 = unlimited
  std::string summary_;
  Mutex shutdown_mu_;
  bool shutdown_started_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  Notification shutdown_done_;
  // What /healthz answers: true from the end of Init to the start of Shutdown.
  std::atomic<bool> serving_{false};
  Mutex reaper_mu_;
  bool reaper_stop_ ABSL_GUARDED_BY(reaper_mu_) = false;
  std::thread reaper_;
  Mutex health_mu_;
  bool health_stop_ ABSL_GUARDED_BY(health_mu_) = false;
  std::thread health_watch_;
  // Destroyed in reverse order: the listeners before the metrics and runtime their hooks read,
  // the server before the service it calls, the queue (which drains) before the runtime its work
  // uses.
  std::unique_ptr<AttndMetrics> metrics_;
  std::shared_ptr<const TokenStore> tokens_;  // null: auth is off
  std::unique_ptr<AdminService> admin_;       // before the queue: its queued work uses it
  std::unique_ptr<RequestLog> request_log_;   // before the service that writes to it
  std::shared_ptr<StepScheduler> steps_;      // shared with the runtime's options
  Mutex steps_sampled_mu_;                    // scrapes may run at once
  StepScheduler::Stats steps_sampled_ ABSL_GUARDED_BY(steps_sampled_mu_);
  std::unique_ptr<Runtime> runtime_;
  std::unique_ptr<WorkQueue> work_queue_;
  std::unique_ptr<DecodeExecutor> decode_executor_;
  std::unique_ptr<DecodeQueue> decode_queue_;
  BatchingDecodeQueue* batcher_ = nullptr;   // decode_queue_ when batching is on
  std::unique_ptr<RegionRegistry> regions_;  // null: regions and rings are off
  std::unique_ptr<RingServer> rings_;
  std::shared_ptr<wire::BufferPool> buffers_;  // null: the wire fast path is off
  std::unique_ptr<AttentionService> service_;
  std::atomic<const AttentionService*> service_for_metrics_{nullptr};  // service_, once it exists
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Listener> listener_;  // null: gRPC accepts itself (TLS, tokens on loopback)
  std::unique_ptr<HealthOnlyServer> health_only_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
};

absl::Status AttndServerImpl::StartAuth(const ServerOptions& options,
                                        std::shared_ptr<grpc::AuthMetadataProcessor>* processor) {
  if (options.auth_token_file.empty()) {
    if (options.admin_tenant.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "ServerOptions::admin_tenant needs ServerOptions::auth_token_file (tenants come from "
        "tokens); with tokens off, "
        "attnd.v1.Admin serves loopback callers: leave ServerOptions::admin_tenant out");
  }
  absl::StatusOr<TokenStore> store = TokenStore::LoadFile(options.auth_token_file);
  if (!store.ok()) return WithFlag("ServerOptions::auth_token_file", store.status());
  TokenAuthOptions auth_options;
  CounterFamily* failures = metrics_->auth_failures_total;
  auth_options.on_failure = [failures](absl::string_view reason) { failures->Increment({reason}); };
  if (!options.admin_tenant.empty() && !store->HasTenant(options.admin_tenant)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ServerOptions::admin_tenant \"", options.admin_tenant,
                     "\" has no token in ServerOptions::auth_token_file ", options.auth_token_file,
                     ": add a line '", options.admin_tenant, " TOKEN' there"));
  }
  tokens_ = std::make_shared<const TokenStore>(*std::move(store));
  *processor = std::make_shared<TokenAuthProcessor>(tokens_, std::move(auth_options));
  return absl::OkStatus();
}

void AttndServerImpl::ReaperLoop(absl::Duration timeout) {
  const absl::Duration interval =
      std::max(absl::Milliseconds(1), std::min(timeout / 4, absl::Seconds(10)));
  while (true) {
    {
      MutexLock lock(&reaper_mu_);
      const auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(reaper_mu_) { return reaper_stop_; };
      if (reaper_mu_.AwaitWithTimeout(stop, interval)) return;
    }
    const absl::Time now = absl::Now();
    for (const ReclaimedSequence& r : runtime_->ReclaimIdle(now - timeout)) {
      metrics_->idle_reclaimed_total->Increment({});
      spdlog::info(
          "released idle sequence {} of tenant \"{}\" ({} pages): unused for {} "
          "(ServerOptions::sequence_idle_timeout {})",
          r.id, r.tenant, r.pages_freed,
          absl::FormatDuration(absl::Trunc(now - r.last_used, absl::Milliseconds(1))),
          absl::FormatDuration(timeout));
    }
  }
}

void AttndServerImpl::StopReaper() {
  {
    MutexLock lock(&reaper_mu_);
    reaper_stop_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
}

void AttndServerImpl::HealthWatchLoop() {
  int64_t ticks = 0;
  while (true) {
    ++ticks;  // once per 100 ms wait below
#ifdef __GLIBC__
    // Every 5 s: give freed heap back to the OS. Large requests are freed in pieces that glibc
    // keeps in its arenas; without this, RSS stayed hundreds of MB up after a burst (issue #13).
    if (ticks % 50 == 0) malloc_trim(0);
#endif
    // Likewise the Prefill fast path's idle buffers: kept while calls keep coming, freed ~10 s
    // after a burst.
    if (ticks % 50 == 0 && buffers_ != nullptr) buffers_->TrimIdle(absl::Seconds(10));
    if (ticks % 50 == 0) CopyBufferPool::Get().TrimIdle(absl::Seconds(10));
    // Every second: regions and rings no request used for --region-idle-timeout (a client that
    // died holding them) are unregistered.
    if (ticks % 10 == 0 && regions_ != nullptr) {
      const size_t regions = regions_->ReclaimIdle().size();
      const int rings = rings_->ReclaimIdle();
      if (regions > 0) spdlog::info("unregistered {} idle tensor region(s)", regions);
      (void)rings;  // RingServer logs each ring it closes
    }
    {
      MutexLock lock(&health_mu_);
      const auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(health_mu_) { return health_stop_; };
      if (health_mu_.AwaitWithTimeout(stop, absl::Milliseconds(100))) {
        return;
      }
    }
    if (g_accept_failed.load()) {
      spdlog::error(
          "the API listener (gRPC's own, as TLS or tokens on loopback need) stopped accepting "
          "connections: accept4 failed (out of file descriptors? the soft RLIMIT_NOFILE is {}); "
          "gRPC 1.51 does not resume accepting: "
          "health is NOT_SERVING from now on; restart attnd, and raise its fd limit or lower "
          "the number of client connections",
          fd_limit_);
      health_->SetServing(false);
      serving_.store(false);
      if (health_only_ != nullptr) health_only_->SetServing(false);
      return;
    }
    if (runtime_->engine().healthy()) continue;
    spdlog::error("the {} device ({}) is lost: health is NOT_SERVING from now on; restart attnd",
                  runtime_->engine().backend(), runtime_->engine().device_name());
    health_->SetServing(false);
    serving_.store(false);
    if (health_only_ != nullptr) health_only_->SetServing(false);
    return;
  }
}

void AttndServerImpl::StopHealthWatch() {
  {
    MutexLock lock(&health_mu_);
    health_stop_ = true;
  }
  if (health_watch_.joinable()) health_watch_.join();
}

absl::Status AttndServerImpl::Init(const ServerOptions& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  static std::once_flag grpc_log_once;
  std::call_once(grpc_log_once, [] { gpr_set_log_function(GrpcLog); });
  fd_limit_ = RaiseFdLimit();
  absl::StatusOr<DecodeBatcherOptions> batcher_options = BatcherOptions(options);
  if (!batcher_options.ok()) return batcher_options.status();
  absl::StatusOr<ModelConfig> model = Qwen25_7BInstruct1M();
  if (!options.model_config.empty()) {
    model = LoadModelConfig(options.model_config);
    if (!model.ok()) {
      return absl::Status(model.status().code(),
                          absl::StrCat("ServerOptions::model_config ", options.model_config, ": ",
                                       model.status().message()));
    }
  }
  const DcaGeometry geometry = model->geometry();
  if (geometry.chunk_len % options.page_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ServerOptions::page_size ", options.page_size, " must divide the DCA chunk length ",
        geometry.chunk_len, " (chunk_size - local_size) of model ", model->name));
  }

  EngineOptions engine_options;
  engine_options.device = options.device;
  if (!options.devices.empty()) {
    absl::StatusOr<std::vector<int32_t>> devices = ParseDeviceList(options.devices);
    if (!devices.ok()) return devices.status();
    engine_options.devices = *std::move(devices);
  }
  engine_options.shards = options.shards;
  engine_options.geometry = geometry;
  engine_options.num_layers = model->num_layers;
  engine_options.page_size = options.page_size;
  engine_options.kv_dtype = options.kv_dtype;
  engine_options.kv_cache_bytes = options.kv_cache_bytes;
  engine_options.kv_cache_fraction = options.kv_cache_fraction;
  engine_options.compute_threads = options.compute_threads;
  engine_options.sparse = model->sparse;
  // The engine captures a CUDA graph per batch size the batcher pads to: the same list.
  engine_options.max_decode_batch = batcher_options->max_decode_batch;
  engine_options.cuda_graph_batch_sizes = batcher_options->flush_batch_sizes;
  engine_options.cuda_graphs = !options.disable_cuda_graphs;
  engine_options.prefill_step_keys = options.prefill_step_keys;
  engine_options.decode_reserved_sms = options.decode_reserved_sms;
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(engine_options);
  if (!engine.ok()) return engine.status();
  // Vertical-slash sparse prefill runs on the CPU and CUDA engines; on any other backend prefill
  // stays dense, and GetServerInfo must say so.
  if (model->sparse_attention_enabled && (*engine)->backend() != "cpu" &&
      (*engine)->backend() != "cuda") {
    spdlog::warn(
        "{}: sparse attention is configured but the {} backend has no sparse prefill; "
        "prefill runs dense",
        model->sparse != nullptr ? model->sparse->source : model->name, (*engine)->backend());
    model->sparse_attention_enabled = false;
  }
  if (options.decode_reserved_sms > 0 && (*engine)->backend() != "cuda") {
    spdlog::warn("--decode-reserved-sms {} has no effect on the {} backend",
                 options.decode_reserved_sms, (*engine)->backend());
  }
  DeviceMemoryOpener* const ipc_opener = (*engine)->device_memory_opener();
  // A sharded engine's steps run on several devices: one pair of events cannot order them.
  const bool device_events = ipc_opener != nullptr && (*engine)->shards().size() == 1;
  if (options.wrap_engine) *engine = options.wrap_engine(*std::move(engine));

  RuntimeOptions runtime_options;
  runtime_options.version = kVersion;
  runtime_options.max_message_bytes = options.max_message_bytes;
  runtime_options.max_sequence_length = options.max_sequence_length;
  runtime_options.max_sequences = options.max_sequences;
  runtime_options.tenant_page_quota = options.tenant_page_quota;
  runtime_options.check_finite = options.check_finite;
  runtime_options.tenant_max_sequences = options.tenant_max_sequences;
  if (options.tenant_max_sequences < 0) {
    // A share of the sequence slots per tenant, so no tenant can lock the others out with empty
    // sequences. Without tokens every caller is one tenant: no cap beyond max_sequences.
    // (A token file that does not load is reported by StartAuth below.)
    runtime_options.tenant_max_sequences = 0;
    absl::StatusOr<TokenStore> store = options.auth_token_file.empty()
                                           ? absl::NotFoundError("no tokens")
                                           : TokenStore::LoadFile(options.auth_token_file);
    if (store.ok() && store->num_tenants() > 1) {
      const int64_t slots =
          options.max_sequences > 0 ? options.max_sequences : (*engine)->layout().num_pages;
      runtime_options.tenant_max_sequences = std::max<int64_t>(1, slots / store->num_tenants());
    }
  }
  runtime_options.instance_name = options.instance_name;
  runtime_options.advertise_address = options.advertise_address;
  StepSchedulerOptions step_options;
  step_options.overlap = (*engine)->overlaps_prefill_and_decode();
  step_options.prefill_share = options.prefill_share;
  steps_ = std::make_shared<StepScheduler>(step_options);
  runtime_options.device_turns = steps_;
  absl::StatusOr<std::unique_ptr<Runtime>> runtime =
      Runtime::Create(*model, *std::move(engine), runtime_options);
  if (!runtime.ok()) return runtime.status();
  runtime_ = *std::move(runtime);
  // The batcher flushes at the engine's own batch sizes (the captured ones on CUDA); an engine
  // without preferences (the CPU) keeps the configured list as the flush rule.
  if (std::vector<int32_t> sizes = runtime_->engine().decode_batch_sizes(); !sizes.empty()) {
    batcher_options->flush_batch_sizes = std::move(sizes);
  }

  {
    const ServerInfo info = runtime_->Info();
    absl::StatusOr<std::unique_ptr<AttndMetrics>> metrics =
        AttndMetrics::Create(BuildInfo{kVersion, StampedRevision(), info.backend, info.model.name});
    if (!metrics.ok()) return metrics.status();
    metrics_ = *std::move(metrics);
  }
  // Sampled at each scrape; the runtime outlives the metrics listener (stopped in Shutdown).
  metrics_->registry().AddCollectHook([this] {
    const ServerInfo info = runtime_->Info();
    metrics_->kv_pages_used->Set(
        {}, static_cast<double>(info.kv_cache.pages_total - info.kv_cache.pages_free));
    metrics_->kv_pages_free->Set({}, static_cast<double>(info.kv_cache.pages_free));
    metrics_->kv_capacity_tokens->Set(
        {std::string(DTypeName(info.model.kv_dtype))},
        static_cast<double>(info.kv_cache.pages_total) * info.kv_cache.page_size);
    for (size_t i = 0; i < info.devices.size(); ++i) {
      const EngineShard& shard = info.devices[i];
      metrics_->kv_shard_pool_bytes->Set({absl::StrCat(i), shard.device},
                                         static_cast<double>(shard.pool_bytes));
      metrics_->kv_shard_bytes_used->Set({absl::StrCat(i), shard.device},
                                         static_cast<double>(shard.bytes_used));
    }
    metrics_->live_sequences->Set({}, static_cast<double>(info.live_sequences));
    metrics_->open_fds->Set({}, static_cast<double>(OpenFds()));
    metrics_->fd_limit->Set({}, static_cast<double>(fd_limit_));
    metrics_->accepting->Set({}, g_accept_failed.load() ? 0.0 : 1.0);
    if (listener_ != nullptr) {
      metrics_->connections_open->Set({"api"}, static_cast<double>(listener_->stats().open));
    }
    if (health_only_ != nullptr && health_only_->listener() != nullptr) {
      metrics_->connections_open->Set({"health"},
                                      static_cast<double>(health_only_->listener()->stats().open));
    }
    if (steps_ != nullptr) {
      // Counters from the scheduler's cumulative stats: add what grew since the last scrape.
      MutexLock lock(&steps_sampled_mu_);
      const StepScheduler::Stats now = steps_->stats();
      const StepScheduler::Stats& was = steps_sampled_;
      metrics_->device_steps_total->Increment({"decode"}, now.decode_steps - was.decode_steps);
      metrics_->device_steps_total->Increment({"prefill"}, now.prefill_steps - was.prefill_steps);
      metrics_->device_turn_waits_total->Increment({"decode"}, now.decode_waits - was.decode_waits);
      metrics_->device_turn_waits_total->Increment({"prefill"},
                                                   now.prefill_waits - was.prefill_waits);
      metrics_->device_turn_wait_seconds_total->Increment(
          {"decode"}, absl::ToDoubleSeconds(now.decode_wait - was.decode_wait));
      metrics_->device_turn_wait_seconds_total->Increment(
          {"prefill"}, absl::ToDoubleSeconds(now.prefill_wait - was.prefill_wait));
      metrics_->prefill_owed_turns_total->Increment(
          {}, now.prefill_owed_turns - was.prefill_owed_turns);
      steps_sampled_ = now;
    }
    // The metrics listener starts before the service exists: read it through the atomic.
    if (const AttentionService* service = service_for_metrics_.load()) {
      metrics_->inflight_request_bytes->Set({},
                                            static_cast<double>(service->inflight_request_bytes()));
    }
  });

  std::shared_ptr<grpc::AuthMetadataProcessor> auth;
  if (absl::Status s = StartAuth(options, &auth); !s.ok()) return s;
  const TlsOptions tls{options.tls_cert, options.tls_key, options.tls_client_ca};
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(tls, auth, options.listen);
  if (!credentials.ok()) return credentials.status();
  if (!tls.enabled() && auth == nullptr && !IsLoopbackAddress(options.listen)) {
    spdlog::warn(
        "INSECURE: ServerOptions::listen {} is not a loopback address and neither TLS "
        "(ServerOptions::tls_cert/ServerOptions::tls_key) "
        "nor tokens (ServerOptions::auth_token_file) are set: anyone who can reach it can read and "
        "write "
        "every sequence",
        options.listen);
  }

  // The side listeners first: a bad address fails startup before the API serves anything.
  if (!options.metrics_listen.empty()) {
    MetricsHttpOptions http_options;
    http_options.listen = options.metrics_listen;
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http = MetricsHttpServer::Start(
        http_options, &metrics_->registry(), [this] { return serving_.load(); });
    if (!http.ok()) return WithFlag("ServerOptions::metrics_listen", http.status());
    metrics_http_ = *std::move(http);
  }
  if (!options.health_listen.empty()) {
    CounterFamily* closed = metrics_->connections_closed_total;
    absl::StatusOr<std::unique_ptr<HealthOnlyServer>> health =
        HealthOnlyServer::Start(options.health_listen, options.connection_preface_timeout,
                                [closed](absl::string_view reason) {
                                  closed->Increment({"health", reason});
                                });
    if (!health.ok()) return WithFlag("ServerOptions::health_listen", health.status());
    health_only_ = *std::move(health);
  }

  WorkQueueOptions queue_options;
  queue_options.num_workers = options.request_workers;
  work_queue_ = std::make_unique<WorkQueue>(queue_options);
  if (options.decode_batching) {
    AttndMetrics* metrics = metrics_.get();
    batcher_options->on_batch = [metrics](int64_t entries, const DecodeStats& ran) {
      if (metrics != nullptr) metrics->ObserveDecodeBatch(entries, ran);
    };
    decode_executor_ = std::make_unique<RuntimeDecodeExecutor>(runtime_.get());
    WorkQueue* workers = work_queue_.get();
    absl::StatusOr<std::unique_ptr<BatchingDecodeQueue>> batcher = BatchingDecodeQueue::Create(
        *batcher_options, decode_executor_.get(),
        // A batch a ring's own request launches runs on that ring's thread instead
        // (RequestContext::run_on_caller, docs/regions.md, "Rings").
        [workers](std::function<void()> fn) { return workers->Submit(std::move(fn)); },
        Clock::Real(), /*start_timer=*/true);
    if (!batcher.ok()) return batcher.status();
    batcher_ = batcher->get();
    decode_queue_ = *std::move(batcher);
  } else {
    decode_queue_ = std::make_unique<DirectDecodeQueue>(runtime_.get(), work_queue_.get());
  }
  RequestLogOptions log_options;
  log_options.sample = options.request_log_sample;
  log_options.max_lines_per_second = options.request_log_max_per_second;
  request_log_ = std::make_unique<RequestLog>(
      log_options, Clock::Real(), [](const std::string& line) { spdlog::info("{}", line); });
  if (options.max_regions_per_tenant > 0) {
    RegionRegistryOptions region_options;
    region_options.max_regions_per_tenant = options.max_regions_per_tenant;
    region_options.max_bytes_per_tenant = options.max_region_bytes_per_tenant;
    region_options.idle_timeout = options.region_idle_timeout;
    regions_ = std::make_unique<RegionRegistry>(region_options, ipc_opener, Clock::Real());
    RingOptions ring_options;
    ring_options.spin = options.ring_spin;
    ring_options.max_spinning_per_tenant = options.ring_max_spinning_per_tenant;
    ring_options.max_spinning = options.ring_max_spinning;
    ring_options.idle_timeout = options.region_idle_timeout;
    rings_ = std::make_unique<RingServer>(regions_.get(), ring_options);
    if (device_events) rings_->SetDeviceEvents(ipc_opener);
  }
  if (options.wire_fast_path) {
    buffers_ = std::make_shared<wire::BufferPool>(options.wire_buffer_pool_bytes);
  }
  service_ = std::make_unique<AttentionService>(
      runtime_.get(), work_queue_.get(), decode_queue_.get(), metrics_.get(), batcher_, tokens_,
      options.max_inflight_request_bytes, request_log_.get(), regions_.get(), rings_.get(),
      buffers_);
  // Idle shm copy buffers stay within the request budget too (and are freed ~10 s after a burst).
  CopyBufferPool::Get().SetMaxIdleBytes(static_cast<size_t>(
      std::min<int64_t>(options.max_inflight_request_bytes,
                        static_cast<int64_t>(CopyBufferPool::kDefaultMaxIdleBytes))));
  if (rings_ != nullptr) {
    rings_->SetRequestBudget(service_->request_budget(), options.max_message_bytes);
    rings_->SetHandler([service = service_.get()](
                           const v1::SessionRequest& request, absl::string_view tenant,
                           v1::SessionResponse* response, std::function<void(absl::Status)> done) {
      return service->SubmitSessionRequest(request, tenant, response, std::move(done),
                                           /*on_caller=*/true);
    });
    rings_->SetFrameHandler(
        [service = service_.get()](const RequestFrame& frame, absl::string_view tenant,
                                   FrameAnswer* answer, std::function<void(absl::Status)> done) {
          return service->SubmitRingFrame(frame, tenant, answer, std::move(done),
                                          /*on_caller=*/true);
        });
  }
  service_for_metrics_.store(service_.get());
  admin_ = std::make_unique<AdminService>(runtime_.get(), work_queue_.get(), tokens_,
                                          options.admin_tenant);

  // Our own health service, not gRPC's default: its Watch streams end when the drain begins.
  grpc::EnableDefaultHealthCheckService(false);
  health_ = std::make_unique<HealthService>(std::vector<std::string>{kServiceName});
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.RegisterService(health_.get());
  // Plaintext without tokens: attnd accepts, caps and hands connections over itself (listener.h).
  // gRPC 1.51 takes connections from fds only with insecure credentials, so TLS and local
  // credentials (tokens on loopback) keep gRPC's own listener.
  if (!tls.enabled() && auth == nullptr && Listener::Supports(options.listen)) {
    ListenerOptions listener_options;
    listener_options.listen = options.listen;
    listener_options.max_connections =
        options.max_connections > 0 ? options.max_connections : DefaultMaxConnections(fd_limit_);
    listener_options.preface_timeout = options.connection_preface_timeout;
    listener_options.name = "API";
    CounterFamily* closed = metrics_->connections_closed_total;
    listener_options.on_close = [closed](absl::string_view reason) {
      closed->Increment({"api", reason});
    };
    absl::StatusOr<std::unique_ptr<Listener>> listener = Listener::Bind(listener_options);
    if (!listener.ok()) return WithFlag("ServerOptions::listen", listener.status());
    listener_ = *std::move(listener);
    port_ = listener_->port();
  } else {
    builder.AddListeningPort(options.listen, *credentials, &port_);
    builder.AddChannelArgument(
        GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
        static_cast<int>(std::min<int64_t>(
            INT_MAX, absl::ToInt64Milliseconds(options.connection_preface_timeout))));
  }
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // Bounds for clients that open many streams or never read (issue #13): at most this many calls
  // at once per connection, and one memory quota for the transport's buffers.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_streams_per_connection);
  grpc::ResourceQuota quota("attnd");
  quota.Resize(static_cast<size_t>(options.grpc_memory_bytes));
  builder.SetResourceQuota(quota);
  // One daemon per port: a second one on the same port must fail, not share the port's traffic.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Checked by CheckOptions already.
  const std::vector<std::pair<std::string, int>> channel_args =
      ParseChannelArgs(options.grpc_channel_args).value();
  for (const auto& [name, value] : channel_args) {
    builder.AddChannelArgument(name, value);
  }
  builder.RegisterService(service_.get());
  builder.RegisterService(admin_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat("ServerOptions::listen ", options.listen,
                                               ": cannot listen there (malformed address, or the "
                                               "port is in use)"));
  }
  if (listener_ != nullptr) {
    listener_->Start(
        [server = server_.get()](int fd) { grpc::AddInsecureChannelFromFd(server, fd); });
  }
  health_->SetServing(true);
  if (health_only_ != nullptr) health_only_->SetServing(true);
  serving_.store(true);

  health_watch_ = std::thread([this] { HealthWatchLoop(); });
  if (options.sequence_idle_timeout > absl::ZeroDuration()) {
    reaper_ = std::thread([this, timeout = options.sequence_idle_timeout] { ReaperLoop(timeout); });
  }

  const ServerInfo info = runtime_->Info();
  const std::string host = options.listen.substr(0, options.listen.rfind(':'));
  summary_ = absl::StrCat(
      "attnd ", kVersion, " listening on ", host, ":", port_, "; backend ", info.backend, " (",
      info.device, "); model ", info.model.name, " (", info.model.num_layers, " layers, ",
      info.model.num_q_heads, " q heads, ", info.model.num_kv_heads, " kv heads, head_dim ",
      info.model.head_dim, ", chunk_len ", info.dca.chunk_len, "); KV pool ",
      HumanBytes(info.kv_cache.pool_bytes), " ", DTypeName(info.model.kv_dtype), " (",
      info.kv_cache.pages_total, " pages of ", info.kv_cache.page_size, " tokens)");
  absl::StrAppend(&summary_, "; ",
                  tls.enabled() ? (tls.client_ca_file.empty() ? "TLS" : "mutual TLS") : "plaintext",
                  auth != nullptr ? ", bearer tokens" : ", no tokens");
  if (metrics_http_ != nullptr) {
    absl::StrAppend(&summary_, "; metrics on port ", metrics_http_->port());
  }
  if (health_only_ != nullptr) {
    absl::StrAppend(&summary_, "; health-only on port ", health_only_->port());
  }
  if (!options.instance_name.empty()) {
    absl::StrAppend(&summary_, "; instance \"", options.instance_name, "\"",
                    options.advertise_address.empty()
                        ? std::string()
                        : absl::StrCat(" at ", options.advertise_address));
  }
  absl::StrAppend(&summary_, "; fd limit ",
                  fd_limit_ < 0 ? std::string("unlimited") : absl::StrCat(fd_limit_), ", at most ",
                  options.max_streams_per_connection, " calls per connection");
  if (listener_ != nullptr) {
    absl::StrAppend(
        &summary_, ", at most ",
        options.max_connections > 0 ? options.max_connections : DefaultMaxConnections(fd_limit_),
        " connections");
  }
  return absl::OkStatus();
}

void AttndServerImpl::Shutdown(absl::Time deadline) {
  {
    MutexLock lock(&shutdown_mu_);
    if (shutdown_started_) return;
    shutdown_started_ = true;
  }
  StopHealthWatch();
  if (server_ != nullptr) {
    // Load balancers stop sending first; then no new work; then in-flight RPCs get until deadline.
    health_->SetServing(false);
  }
  serving_.store(false);
  if (health_only_ != nullptr) health_only_->SetServing(false);
  if (service_ != nullptr) service_->BeginShutdown();
  // Ends the health service's Watch streams (after NOT_SERVING, sent above), which would otherwise
  // hold the drain to its deadline.
  if (health_ != nullptr) health_->Shutdown();
  // Queued decodes go to the work queue now (no batching delay) while it still accepts, and run.
  if (batcher_ != nullptr) batcher_->Shutdown();
  // Each ring answers its request in flight (the flushed batch runs on the work queue), then
  // tells its client it is closed.
  if (rings_ != nullptr) rings_->Shutdown();
  // The calls in flight finish while gRPC still hands new ones to the handlers, which answer them
  // UNAVAILABLE with a message; gRPC's own Shutdown would cancel the calls it has received but not
  // handed over yet, with no message. A short floor lets calls already on the wire arrive.
  if (service_ != nullptr && server_ != nullptr) {
    absl::SleepFor(
        std::min(absl::Milliseconds(200), std::max(absl::ZeroDuration(), deadline - absl::Now())));
    service_->WaitForCallsToEnd(deadline);
  }
  if (work_queue_ != nullptr) work_queue_->StopAccepting();
  // No new connections from here on, as gRPC's own listener stops at Shutdown.
  if (listener_ != nullptr) listener_->Stop();
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(deadline));
    server_->Wait();
  }
  if (work_queue_ != nullptr) work_queue_->Shutdown();
  StopReaper();
  if (metrics_http_ != nullptr) metrics_http_->Stop();
  if (health_only_ != nullptr) health_only_->Shutdown();
  shutdown_done_.Notify();
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttndServer>> AttndServer::Start(const ServerOptions& options) {
  auto server = std::make_unique<AttndServerImpl>();
  if (absl::Status s = server->Init(options); !s.ok()) return s;
  return std::unique_ptr<AttndServer>(std::move(server));
}

}  // namespace attnd
