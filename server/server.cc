// AttndServer: wires model config, engine, runtime, work queue and the gRPC service together.
#include "server/server.h"

#include <chrono>
#include <climits>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/decode_queue.h"
#include "server/engine_factory.h"
#include "server/model_config.h"
#include "server/runtime.h"
#include "server/service.h"
#include "server/work_queue.h"

namespace attnd {
namespace {

constexpr char kVersion[] = "0.1.0";
constexpr char kServiceName[] = "attnd.v1.Attention";

absl::Status CheckOptions(const ServerOptions& o) {
  if (o.page_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--page-size must be > 0, got ", o.page_size));
  }
  if (o.max_message_bytes <= 0 || o.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--max-message-bytes must be in [1, ", INT_MAX,
                                                   "], got ", o.max_message_bytes));
  }
  if (o.max_sequence_length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-sequence-length must be >= 0, got ", o.max_sequence_length));
  }
  if (o.max_sequences < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-sequences must be >= 0, got ", o.max_sequences));
  }
  if (o.compute_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--compute-threads must be >= 0, got ", o.compute_threads));
  }
  if (o.request_workers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--request-workers must be >= 0, got ", o.request_workers));
  }
  return absl::OkStatus();
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
  std::string startup_summary() const override { return summary_; }
  void Shutdown(absl::Time deadline) override;
  void Wait() override { shutdown_done_.WaitForNotification(); }

 private:
  int port_ = 0;
  std::string summary_;
  absl::Mutex shutdown_mu_;
  bool shutdown_started_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  absl::Notification shutdown_done_;
  // Destroyed in reverse order: the server before the service it calls, the queue (which drains)
  // before the runtime its work uses.
  std::unique_ptr<Runtime> runtime_;
  std::unique_ptr<WorkQueue> work_queue_;
  std::unique_ptr<DecodeQueue> decode_queue_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<grpc::Server> server_;
};

absl::Status AttndServerImpl::Init(const ServerOptions& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  absl::StatusOr<ModelConfig> model = Qwen25_7BInstruct1M();
  if (!options.model_config.empty()) {
    model = LoadModelConfig(options.model_config);
    if (!model.ok()) {
      return absl::Status(
          model.status().code(),
          absl::StrCat("--model-config ", options.model_config, ": ", model.status().message()));
    }
  }
  const DcaGeometry geometry = model->geometry();
  if (geometry.chunk_len % options.page_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--page-size ", options.page_size, " must divide the DCA chunk length ",
                     geometry.chunk_len, " (chunk_size - local_size) of model ", model->name));
  }

  EngineOptions engine_options;
  engine_options.device = options.device;
  engine_options.geometry = geometry;
  engine_options.num_layers = model->num_layers;
  engine_options.page_size = options.page_size;
  engine_options.kv_dtype = options.kv_dtype;
  engine_options.kv_cache_bytes = options.kv_cache_bytes;
  engine_options.compute_threads = options.compute_threads;
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(engine_options);
  if (!engine.ok()) return engine.status();

  RuntimeOptions runtime_options;
  runtime_options.version = kVersion;
  runtime_options.max_message_bytes = options.max_message_bytes;
  runtime_options.max_sequence_length = options.max_sequence_length;
  runtime_options.max_sequences = options.max_sequences;
  absl::StatusOr<std::unique_ptr<Runtime>> runtime =
      Runtime::Create(*model, *std::move(engine), runtime_options);
  if (!runtime.ok()) return runtime.status();
  runtime_ = *std::move(runtime);

  WorkQueueOptions queue_options;
  queue_options.num_workers = options.request_workers;
  work_queue_ = std::make_unique<WorkQueue>(queue_options);
  decode_queue_ = std::make_unique<DirectDecodeQueue>(runtime_.get(), work_queue_.get());
  service_ =
      std::make_unique<AttentionService>(runtime_.get(), work_queue_.get(), decode_queue_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat("--listen ", options.listen,
                                               ": cannot listen there (malformed address, or the "
                                               "port is in use)"));
  }
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);

  const ServerInfo info = runtime_->Info();
  const std::string host = options.listen.substr(0, options.listen.rfind(':'));
  summary_ = absl::StrCat(
      "attnd ", kVersion, " listening on ", host, ":", port_, "; backend ", info.backend, " (",
      info.device, "); model ", info.model.name, " (", info.model.num_layers, " layers, ",
      info.model.num_q_heads, " q heads, ", info.model.num_kv_heads, " kv heads, head_dim ",
      info.model.head_dim, ", chunk_len ", info.dca.chunk_len, "); KV pool ",
      HumanBytes(info.kv_cache.pool_bytes), " ", DTypeName(info.model.kv_dtype), " (",
      info.kv_cache.pages_total, " pages of ", info.kv_cache.page_size, " tokens)");
  return absl::OkStatus();
}

void AttndServerImpl::Shutdown(absl::Time deadline) {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shutdown_started_) return;
    shutdown_started_ = true;
  }
  if (server_ != nullptr) {
    // Load balancers stop sending first; then no new work; then in-flight RPCs get until deadline.
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    health->SetServingStatus("", false);
    health->SetServingStatus(kServiceName, false);
  }
  if (service_ != nullptr) service_->BeginShutdown();
  if (work_queue_ != nullptr) work_queue_->StopAccepting();
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(deadline));
    server_->Wait();
  }
  if (work_queue_ != nullptr) work_queue_->Shutdown();
  shutdown_done_.Notify();
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttndServer>> AttndServer::Start(const ServerOptions& options) {
  auto server = std::make_unique<AttndServerImpl>();
  if (absl::Status s = server->Init(options); !s.ok()) return s;
  return std::unique_ptr<AttndServer>(std::move(server));
}

}  // namespace attnd
