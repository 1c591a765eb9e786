// The attnd service in-process for the libFuzzer targets (fuzz/*_fuzz.cc, built by script/fuzz):
// a tiny model on the CPU engine with a 16-page pool, the real AttentionService (the same
// proto -> Runtime translation, work queue and decode queue as attnd) behind a gRPC server with no
// port, reached through an in-process channel, with one registered shm region for RegionRefs. Each
// input gets fresh sequences; after it the harness checks the invariants and aborts (a libFuzzer
// crash) when one does not hold:
//   - every call returns OK or a code attention.proto documents for it, with a non-empty message;
//     INTERNAL counts as a finding (the CPU engine only fails on input validation missed);
//   - pages_free + the pages the live sequences hold == pages_total, during and after;
//   - after releasing the input's sequences: pages_free == pages_total, live_sequences == 0.
#ifndef ATTND_FUZZ_HARNESS_H_
#define ATTND_FUZZ_HARNESS_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/config/model_config.h"
#include "server/dataplane/regions.h"
#include "server/dataplane/ring_frame.h"
#include "server/engine/cpu_engine.h"
#include "server/rpc/service.h"
#include "server/runtime/runtime.h"
#include "server/sched/decode_queue.h"
#include "server/sched/work_queue.h"

namespace attnd {
namespace fuzz {

// 2 layers, Hq 2, Hkv 1, D 8, chunk_len 24, pages of 8 tokens, 16 pages (128 tokens), max 256.
inline constexpr char kTinyConfig[] = R"({
  "_name_or_path": "fuzz-tiny", "num_hidden_layers": 2, "num_attention_heads": 2,
  "num_key_value_heads": 1, "head_dim": 8, "hidden_size": 16, "max_position_embeddings": 256,
  "dual_chunk_attention_config": {"chunk_size": 32, "local_size": 8,
                                  "original_max_position_embeddings": 64}})";
inline constexpr int32_t kPageSize = 8;
inline constexpr int64_t kPages = 16;

// Inputs with malformed UTF-8 in string fields fail to parse by design; protobuf would log each.
inline const bool kQuietProtobuf = (google::protobuf::SetLogHandler(nullptr), true);

#define ATTND_FUZZ_CHECK(cond, ...)                            \
  do {                                                         \
    if (!(cond)) {                                             \
      std::fprintf(stderr, "invariant violated: %s: ", #cond); \
      std::fprintf(stderr, __VA_ARGS__);                       \
      std::fprintf(stderr, "\n");                              \
      std::abort();                                            \
    }                                                          \
  } while (0)

class Harness {
 public:
  static Harness& Get() {
    static Harness* h = new Harness();  // never destroyed: libFuzzer exits with the process
    return *h;
  }

  v1::Attention::Stub& stub() { return *stub_; }
  Runtime& runtime() { return *runtime_; }

  // Two fresh sequences for one input.
  std::vector<std::string> NewSequences(int n) {
    std::vector<std::string> ids;
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<std::string> id = runtime_->CreateSequence("");
      ATTND_FUZZ_CHECK(id.ok(), "CreateSequence: %s", id.status().ToString().c_str());
      ids.push_back(*id);
    }
    return ids;
  }

  // Prefills `tokens` tokens of ones into every layer of `id` through the runtime.
  void Warm(const std::string& id, int64_t tokens) {
    const ModelConfig& m = runtime_->model();
    const std::vector<int64_t> q_shape = {tokens, 5, m.num_q_heads, m.head_dim};
    const std::vector<int64_t> kv_shape = {tokens, m.num_kv_heads, m.head_dim};
    const std::string q(tokens * 5 * m.num_q_heads * m.head_dim * 4, '\0');
    std::vector<float> kv(tokens * m.num_kv_heads * m.head_dim, 0.5f);
    const absl::string_view kv_bytes(reinterpret_cast<const char*>(kv.data()), kv.size() * 4);
    for (int32_t layer = 0; layer < m.num_layers; ++layer) {
      PrefillCall call;
      call.sequence_id = id;
      call.layer = layer;
      call.q = {DType::kFp32, absl::MakeConstSpan(q_shape), q};
      call.k = {DType::kFp32, absl::MakeConstSpan(kv_shape), kv_bytes};
      call.v = {DType::kFp32, absl::MakeConstSpan(kv_shape), kv_bytes};
      absl::StatusOr<PrefillResult> r = runtime_->Prefill(call);
      ATTND_FUZZ_CHECK(r.ok(), "warm-up prefill: %s", r.status().ToString().c_str());
    }
  }

  // The fuzzer cannot guess 128-bit ids: an id of 0 or 1 bytes names one of this input's
  // sequences (by its first byte); longer ids are sent as they are (malformed or unknown).
  static void MapId(const std::vector<std::string>& ids, std::string* id) {
    if (id->size() > 1 || ids.empty()) return;
    const size_t i = id->empty() ? 0 : static_cast<unsigned char>((*id)[0]) % ids.size();
    *id = ids[i];
  }

  // A region id of 0 or 1 bytes names the harness's registered region (a longer one is sent as
  // it is): the fuzzer reaches the offset, size and alignment checks behind the id.
  void MapRegion(v1::RegionRef* ref) const {
    if (ref->region_id().size() <= 1) ref->set_region_id(region_id_);
  }
  void MapTensor(v1::Tensor* t) const {
    if (t->has_region()) MapRegion(t->mutable_region());
  }
  // Sparse (it costs nothing until read), and as large as a client may name: references to
  // gigabytes must be judged before anything is copied (the budget below holds 4 MiB).
  static constexpr uint64_t kRegionBytes = uint64_t{48} << 30;
  static constexpr int64_t kBudgetBytes = int64_t{4} << 20;

  // The ring's path into the service (its handler), minus the shm framing: runs `request` and
  // waits for its answer.
  absl::Status RunAsRing(const v1::SessionRequest& request, v1::SessionResponse* response) {
    Notification done;
    absl::Status result;
    absl::Status s = service_->SubmitSessionRequest(request, "", response, [&](absl::Status st) {
      result = std::move(st);
      done.Notify();
    });
    if (!s.ok()) return s;
    done.WaitForNotification();
    return result;
  }

  // The ring's version 2 path into the service (its frame handler), minus the shm framing: runs
  // `frame` and waits for its answer. The inline output gets a buffer as a ring of
  // kFrameHalfBytes halves would give it (answer->output points into it until the next call).
  static constexpr uint64_t kFrameHalfBytes = 64 << 10;
  absl::Status RunFrame(const RequestFrame& frame, FrameAnswer* answer) {
    answer->output_buffer = [this](uint64_t bytes, uint64_t lengths) -> absl::StatusOr<char*> {
      if (ResponseBytes(lengths, 0, bytes) > kFrameHalfBytes - 8) {
        return absl::ResourceExhaustedError("the response does not fit the ring's response half");
      }
      frame_out_.resize(std::max<uint64_t>(bytes, 1));
      return frame_out_.data();
    };
    Notification done;
    absl::Status result;
    absl::Status s = service_->SubmitRingFrame(frame, "", answer, [&](absl::Status st) {
      result = std::move(st);
      done.Notify();
    });
    if (!s.ok()) return s;
    done.WaitForNotification();
    return result;
  }
  const std::string& region_id() const { return region_id_; }

  // Every request byte taken from the budget is given back once the call is answered (the last
  // references of a decode's copies may end just after its reply).
  void CheckBudgetReturned() {
    for (int i = 0; i < 1000 && service_->inflight_request_bytes() != 0; ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ATTND_FUZZ_CHECK(service_->inflight_request_bytes() == 0, "%lld request bytes kept",
                     static_cast<long long>(service_->inflight_request_bytes()));
  }

  // OK, or a documented code with a message.
  static void CheckStatus(const char* rpc, int code, const std::string& message) {
    if (code == 0) return;
    const bool documented =
        code == grpc::StatusCode::INVALID_ARGUMENT || code == grpc::StatusCode::NOT_FOUND ||
        code == grpc::StatusCode::OUT_OF_RANGE || code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
        code == grpc::StatusCode::FAILED_PRECONDITION;
    ATTND_FUZZ_CHECK(documented, "%s answered code %d: %s", rpc, code, message.c_str());
    ATTND_FUZZ_CHECK(!message.empty(), "%s answered code %d with no message", rpc, code);
  }

  // pages_free + pages held by `ids` (ceil(longest layer / page size) each) == pages_total.
  void CheckPages(const std::vector<std::string>& ids) {
    int64_t held = 0;
    for (const std::string& id : ids) {
      absl::StatusOr<std::vector<int64_t>> lengths = runtime_->LayerLengths(id, "");
      ATTND_FUZZ_CHECK(lengths.ok(), "LayerLengths: %s", lengths.status().ToString().c_str());
      int64_t longest = 0;
      for (int64_t l : *lengths) longest = std::max(longest, l);
      held += (longest + kPageSize - 1) / kPageSize;
    }
    const ServerInfo info = runtime_->Info();
    ATTND_FUZZ_CHECK(info.kv_cache.pages_free + held == info.kv_cache.pages_total,
                     "pages_free %lld + held %lld != total %lld",
                     static_cast<long long>(info.kv_cache.pages_free), static_cast<long long>(held),
                     static_cast<long long>(info.kv_cache.pages_total));
    ATTND_FUZZ_CHECK(info.live_sequences == static_cast<int64_t>(ids.size()),
                     "live_sequences %lld, expected %zu",
                     static_cast<long long>(info.live_sequences), ids.size());
  }

  // Releases `ids`; then the pool must be whole again.
  void ReleaseAll(const std::vector<std::string>& ids) {
    CheckPages(ids);
    for (const std::string& id : ids) {
      absl::StatusOr<int64_t> freed = runtime_->ReleaseSequence(id, "");
      ATTND_FUZZ_CHECK(freed.ok(), "release: %s", freed.status().ToString().c_str());
    }
    const ServerInfo info = runtime_->Info();
    ATTND_FUZZ_CHECK(
        info.kv_cache.pages_free == info.kv_cache.pages_total && info.live_sequences == 0,
        "leak: %lld of %lld pages free, %lld live",
        static_cast<long long>(info.kv_cache.pages_free),
        static_cast<long long>(info.kv_cache.pages_total),
        static_cast<long long>(info.live_sequences));
  }

 private:
  Harness() {
    absl::StatusOr<ModelConfig> model = ParseModelConfig(kTinyConfig, "fuzz-tiny");
    ATTND_FUZZ_CHECK(model.ok(), "%s", model.status().ToString().c_str());
    CpuEngineOptions engine_options;
    engine_options.geometry = model->geometry();
    engine_options.layout.num_layers = model->num_layers;
    engine_options.layout.num_kv_heads = model->num_kv_heads;
    engine_options.layout.head_dim = model->head_dim;
    engine_options.layout.page_size = kPageSize;
    engine_options.layout.kv_dtype = DType::kFp32;
    engine_options.layout.num_pages = kPages;
    engine_options.compute_threads = 1;
    absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(engine_options);
    ATTND_FUZZ_CHECK(engine.ok(), "%s", engine.status().ToString().c_str());
    RuntimeOptions runtime_options;
    runtime_options.max_message_bytes = kBudgetBytes;  // the cap on one tensor, too
    absl::StatusOr<std::unique_ptr<Runtime>> runtime =
        Runtime::Create(*model, std::unique_ptr<Engine>(std::move(*engine)), runtime_options);
    ATTND_FUZZ_CHECK(runtime.ok(), "%s", runtime.status().ToString().c_str());
    runtime_ = std::move(*runtime);
    WorkQueueOptions queue_options;
    queue_options.num_workers = 2;
    work_queue_ = std::make_unique<WorkQueue>(queue_options);
    decode_queue_ = std::make_unique<DirectDecodeQueue>(runtime_.get(), work_queue_.get());
    // One registered shm region (docs/regions.md) that fuzzed RegionRefs may name (MapRegion).
    regions_ = std::make_unique<RegionRegistry>(RegionRegistryOptions(), nullptr, Clock::Real());
    shm_name_ = "/attnd-fuzz-" + std::to_string(getpid());
    const int fd = shm_open(shm_name_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    ATTND_FUZZ_CHECK(fd >= 0 && ftruncate(fd, kRegionBytes) == 0, "cannot create the fuzz shm");
    close(fd);
    absl::StatusOr<std::shared_ptr<const Region>> region =
        regions_->RegisterShm("", shm_name_, 0, kRegionBytes, RegionKind::kSystemShm);
    ATTND_FUZZ_CHECK(region.ok(), "%s", region.status().ToString().c_str());
    region_id_ = (*region)->id;
    shm_unlink(shm_name_.c_str());  // the mapping stays; nothing is left in /dev/shm
    // With the Prefill fast path (server/rpc/wire.h), as attnd runs by default.
    service_ = std::make_unique<AttentionService>(runtime_.get(), work_queue_.get(),
                                                  decode_queue_.get(), nullptr, nullptr, nullptr,
                                                  kBudgetBytes, nullptr, regions_.get(), nullptr,
                                                  std::make_shared<wire::BufferPool>(64 << 20));
    grpc::ServerBuilder builder;
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ATTND_FUZZ_CHECK(server_ != nullptr, "BuildAndStart failed");
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    stub_ = v1::Attention::NewStub(server_->InProcessChannel(args));
  }

  std::unique_ptr<Runtime> runtime_;
  std::unique_ptr<WorkQueue> work_queue_;
  std::unique_ptr<DecodeQueue> decode_queue_;
  std::unique_ptr<RegionRegistry> regions_;
  std::string shm_name_;
  std::string region_id_;
  std::string frame_out_;  // RunFrame's inline output
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

}  // namespace fuzz
}  // namespace attnd

#endif  // ATTND_FUZZ_HARNESS_H_
