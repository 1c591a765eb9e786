// The protobuf-free core of the daemon: the model, the KV page bookkeeping and the engine, plus
// request validation and the all-or-nothing transactions of docs/ARCHITECTURE.md ("Request flow").
// The gRPC service only translates protos to these calls and back.
#ifndef ATTND_SERVER_RUNTIME_RUNTIME_H_
#define ATTND_SERVER_RUNTIME_RUNTIME_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "kernels/dca.h"
#include "kvcache/page_allocator.h"
#include "kvcache/sequence_table.h"
#include "server/config/model_config.h"
#include "server/engine/engine.h"
#include "server/runtime/device_turns.h"

namespace attnd {

// A tensor as it arrived, not yet checked: dtype is the wire value cast to DType (it may be 0 or
// unknown), shape and bytes point into the request (no copy).
struct RequestTensor {
  DType dtype = DType::kFp32;
  absl::Span<const int64_t> shape;
  absl::string_view bytes;  // with on_device, a device address range (never dereferenced here)
  bool on_device = false;   // TensorView::on_device
};

// Where an output tensor of `bytes` bytes is written, e.g. a response's bytes field resized to fit
// (so results are never copied). Called once per output after validation, before the engine runs.
using OutputBufferFn = std::function<void*(int64_t bytes)>;

struct PrefillCall {
  absl::string_view sequence_id;
  absl::string_view tenant;  // "" when auth is off
  int32_t layer = 0;
  // What q and k hold (the wire value, checked): kVariants q [T, 5, Hq, D]; kPreRotary q
  // [T, Hq, D] and k before the rotary, which the engine applies (docs/rotary.md).
  QLayout q_layout = QLayout::kVariants;
  RequestTensor q;                    // [T, 5, Hq, D] or [T, Hq, D]
  RequestTensor k;                    // [T, Hkv, D]
  RequestTensor v;                    // [T, Hkv, D]
  std::optional<int64_t> prompt_len;  // absent: the layer's length after this call
  OutputBufferFn output;              // unset: the result owns the output in `out`
  bool output_on_device = false;      // output returns device memory (PrefillJob::out_on_device)
  // Runs after the engine succeeded and before the call is committed (e.g. copies a staged output
  // into the client's shm region): an error fails the call, which then changes nothing.
  std::function<absl::Status()> before_commit;
  // Asked before each device step of the call (Engine::StartPrefill), e.g. whether the client
  // cancelled or its deadline passed: an error stops the call there, which then changes nothing.
  std::function<absl::Status()> keep_going;
  const DeviceOrder* order = nullptr;  // PrefillJob::order
};

struct PrefillResult {
  std::string out;                 // the output when the call gave no OutputBufferFn
  DType out_dtype = DType::kFp32;  // q's dtype
  std::vector<int64_t> out_shape;  // [T, Hq, D]
  int64_t length = 0;              // the layer's length after the call
};

struct DecodeCall {
  struct Entry {
    absl::string_view sequence_id;
    RequestTensor q;        // [3 or 5, Hq, D] or [Hq, D]
    RequestTensor k;        // [Hkv, D]
    RequestTensor v;        // [Hkv, D]
    OutputBufferFn output;  // unset: the result owns the output
    bool output_on_device = false;
    QLayout q_layout = QLayout::kVariants;  // per entry; kPreRotary: q [Hq, D], k before the rotary
    const DeviceOrder* order = nullptr;     // DecodeJob::Entry::order
  };
  absl::string_view tenant;
  int32_t layer = 0;
  std::vector<Entry> entries;  // at least one; distinct sequences
  // As PrefillCall::before_commit, for the whole call.
  std::function<absl::Status()> before_commit;
  // (The RPC's deadline and cancellation travel beside the call, in a RequestContext that the
  // decode queue checks when it dequeues the call: server/sched/request_context.h.)
};

struct DecodeResult {
  struct Output {
    std::string out;  // when the entry gave no OutputBufferFn
    DType out_dtype = DType::kFp32;
    std::vector<int64_t> out_shape;  // [Hq, D]
    int64_t length = 0;
  };
  std::vector<Output> outputs;  // one per entry, in call order
  DecodeStats stats;            // what the engine ran: graph replays, eager launches, padding
};

// Everything GetServerInfo reports, as plain values.
// Most tokens of a Prefill call whose inline tensors fit max_message_bytes (request and response,
// each with 1 KiB of framing): q_rows query rows of num_q_heads x head_dim per token (5 variants,
// or 1 pre-rotary), k and v, and the output, all element_bytes per element. 0 if none fits.
int64_t PrefillTokensPerMessage(const DcaGeometry& geometry, int64_t max_message_bytes,
                                int64_t q_rows, int64_t element_bytes);

struct ServerInfo {
  std::string version;
  std::string backend;
  std::string device;
  struct Model {
    std::string name;
    int32_t num_layers = 0;
    int32_t num_q_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t head_dim = 0;
    DType kv_dtype = DType::kFp32;
    int64_t max_position_embeddings = 0;
    float softmax_scale = 0.f;
    double rope_theta = 0.0;
    float partial_rotary_factor = 0.f;
    int32_t rotary_dim = 0;
  } model;
  struct Dca {
    int64_t chunk_size = 0;
    int64_t local_size = 0;
    int64_t chunk_len = 0;
    int64_t original_max_position_embeddings = 0;
    bool sparse_attention_enabled = false;
    int64_t sparse_attention_threshold = 0;
    int64_t sparse_attention_last_q = 0;
  } dca;
  struct KvCache {
    int32_t page_size = 0;
    int64_t pages_total = 0;
    int64_t pages_free = 0;
    int64_t bytes_per_page = 0;
    int64_t pool_bytes = 0;
  } kv_cache;
  // The engine's shards in head order (one for an unsharded engine); pool bytes per device.
  std::vector<EngineShard> devices;
  int64_t live_sequences = 0;
  struct Limits {
    int64_t max_message_bytes = 0;
    int64_t max_sequence_length = 0;
    int64_t max_sequences = 0;
    int64_t tenant_max_sequences = 0;  // 0 = unlimited
    int64_t tenant_page_quota = 0;     // 0 = unlimited
    // What max_message_bytes allows a Prefill call with inline fp32 five-variant tensors
    // (Limits.max_prefill_tokens_per_call in attention.proto; PrefillTokensPerMessage).
    int64_t max_prefill_tokens_per_call = 0;
  } limits;
  struct Instance {
    std::string name;               // "" = not part of a named fleet
    std::string advertise_address;  // host:port clients should use for this instance; "" = unset
  } instance;
};

// What one tenant holds (GetServerInfo with tokens on shows a tenant only its own).
struct TenantUsage {
  int64_t sequences = 0;
  int64_t pages = 0;
};

struct RuntimeOptions {
  std::string version = "dev";
  int64_t max_message_bytes = 0;     // reported only; gRPC enforces it
  int64_t max_sequence_length = 0;   // 0 = the model's max_position_embeddings
  int64_t max_sequences = 0;         // 0 = one per KV page (each non-empty sequence holds a page)
  int64_t tenant_page_quota = 0;     // KV pages per tenant; 0 = unlimited
  int64_t tenant_max_sequences = 0;  // live sequences per tenant; 0 = unlimited
  // Refuse q/k/v holding a NaN or an infinity (host tensors; device tensors are not read here).
  bool check_finite = true;
  // A fleet member's name (SequenceTableOptions::instance_name: ids become "<name>.<32 hex>") and
  // the address clients should reach it at; both reported by Info(). "" = unnamed, ids as ever.
  std::string instance_name;
  std::string advertise_address;
  // Turns on the device for decode batches and prefill steps (server/runtime/device_turns.h);
  // null: every step runs when it comes.
  std::shared_ptr<DeviceTurns> device_turns;
};

// Thread-safe: any thread may call any method. Requests on one sequence run one at a time
// (they wait for the sequence's lock); requests on different sequences run concurrently.
class Runtime {
 public:
  // The engine's layout and geometry must describe `model` (checked: INVALID_ARGUMENT).
  static absl::StatusOr<std::unique_ptr<Runtime>> Create(const ModelConfig& model,
                                                         std::unique_ptr<Engine> engine,
                                                         const RuntimeOptions& options);

  ServerInfo Info() const;
  TenantUsage Usage(absl::string_view tenant) const;
  // Live sequences of `tenant` (all tenants when `all_tenants`), for operators.
  std::vector<SequenceTable::Listing> ListSequences(absl::string_view tenant,
                                                    bool all_tenants) const {
    return table_.List(tenant, all_tenants);
  }

  // The new sequence's id. RESOURCE_EXHAUSTED past max_sequences.
  absl::StatusOr<std::string> CreateSequence(absl::string_view tenant);
  // OK if `id` has this instance's form; FAILED_PRECONDITION naming the owner for another
  // instance's id; INVALID_ARGUMENT if malformed (SequenceTable::CheckId).
  absl::Status CheckSequenceId(absl::string_view id) const { return table_.CheckId(id); }
  // Pages freed. INVALID_ARGUMENT for a malformed id, FAILED_PRECONDITION for another instance's,
  // NOT_FOUND for an unknown one.
  absl::StatusOr<int64_t> ReleaseSequence(absl::string_view id, absl::string_view tenant);
  // Releases every sequence last used before `cutoff` that is not busy right now (any tenant).
  std::vector<ReclaimedSequence> ReclaimIdle(absl::Time cutoff);
  // Tokens cached per layer (for tests and introspection).
  absl::StatusOr<std::vector<int64_t>> LayerLengths(absl::string_view id,
                                                    absl::string_view tenant) const;

  // What a prefill's or a decode entry's tensors claim (dtypes, layout, shapes; a prefill's length
  // against the maximum sequence length), without reading their bytes: a request whose tensors
  // live in registered regions is judged by these before any region memory is copied.
  absl::Status CheckPrefillShapes(const PrefillCall& call, int64_t* num_tokens) const;
  absl::Status CheckDecodeShapes(const DecodeCall::Entry& entry) const;

  // Codes as attention.proto says; a failed call changes nothing.
  absl::StatusOr<PrefillResult> Prefill(const PrefillCall& call);
  absl::StatusOr<DecodeResult> Decode(const DecodeCall& call);

  const ModelConfig& model() const { return model_; }
  const Engine& engine() const { return *engine_; }
  int64_t max_sequence_length() const { return max_sequence_length_; }

 private:
  Runtime(const ModelConfig& model, std::unique_ptr<Engine> engine, const RuntimeOptions& options,
          int64_t max_sequence_length, int64_t max_sequences);

  // FAILED_PRECONDITION when `id` is another instance's (checked first: a misrouted call is
  // told where to go before anything else about it is judged); OK otherwise.
  absl::Status Misrouted(absl::string_view id) const;
  absl::Status CheckLayer(int32_t layer) const;
  absl::Status CheckPrefillLayout(const PrefillCall& call, int64_t* num_tokens) const;
  absl::Status CheckPrefillTensors(const PrefillCall& call, int64_t* num_tokens) const;
  absl::Status CheckDecodeEntry(const DecodeCall::Entry& entry) const;
  absl::Status CheckFinite(absl::string_view prefix, absl::string_view name,
                           const RequestTensor& t) const;

  const ModelConfig model_;
  const std::unique_ptr<Engine> engine_;
  const RuntimeOptions options_;
  const int64_t max_sequence_length_;
  const int64_t max_sequences_;  // options_.max_sequences, or its default from the pool
  PageAllocator allocator_;
  SequenceTable table_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_RUNTIME_RUNTIME_H_
