// The backend seam: an Engine owns the KV pool's memory and computes attention over it. The CPU
// engine (server/engine/cpu_engine.h) is the embedded default; a CUDA engine implements the same
// interface. Engines never see protobuf; the runtime validates requests and owns the page
// bookkeeping.
#ifndef ATTND_SERVER_ENGINE_ENGINE_H_
#define ATTND_SERVER_ENGINE_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "kernels/dca.h"
#include "kvcache/kv_layout.h"

namespace attnd {

class DeviceMemoryOpener;    // server/dataplane/regions.h
class Runtime;               // server/runtime/runtime.h
class EngineJobsForTesting;  // server/engine/engine_jobs_for_testing.h

// The passkey of the job structs below: only the runtime makes jobs, from requests it validated
// (Runtime::Prefill, Runtime::Decode: dtypes, shapes, layouts, lengths, prompt_len, pages). An
// engine therefore checks only what its kernels could not survive if a job were wrong anyway
// (null pointers, page ids and tables against its pool, element counts of the buffers it reads,
// device memory it cannot reach), and an engine may copy a job it was given and adjust the copy
// (a shard's slice of the heads). Tests and benchmarks make jobs through the testing-only
// EngineJobsForTesting.
class EngineJobKey {
 private:
  EngineJobKey() {}  // user-provided, so `EngineJobKey{}` cannot bypass it
  friend class Runtime;
  friend class EngineJobsForTesting;
};

// A validated request tensor: dtype and shape checked against the model, data holding exactly
// product(shape) * ElementSize(dtype) bytes (any alignment).
struct TensorView {
  DType dtype = DType::kFp32;
  const void* data = nullptr;
  std::vector<int64_t> shape;
  // data is device memory of the engine's GPU (a CUDA IPC region, docs/regions.md), not host
  // memory. Only the CUDA engine accepts it.
  bool on_device = false;
  // Bytes from one row (the last two dimensions, [heads, D]) to the next; 0: the rows are dense.
  // A sharded engine (server/engine/sharded_engine.h) hands each shard its heads of a larger tensor
  // this way, so no shard's input is copied to be split.
  int64_t row_pitch = 0;
};

// product(shape): the elements a view holds.
int64_t NumElements(const TensorView& view);
// Rows of a view (product of all but the last two dimensions; 1 for rank < 2) and the bytes of
// one row's data.
int64_t NumRows(const TensorView& view);
int64_t RowBytes(const TensorView& view);
// Bytes from one row to the next: row_pitch, or RowBytes when the view is dense.
int64_t RowPitch(const TensorView& view);
// The view of heads [first, first + count) of `view` (its second-to-last dimension): the same
// memory with the first head's address and the row pitch of `view`. No data is touched.
TensorView SliceHeads(const TensorView& view, int64_t first, int64_t count);
// Copies rows [first_row, first_row + rows) of a host view into `dst`, densely.
void CopyRowsToDense(const TensorView& view, int64_t first_row, int64_t rows, void* dst);
// INVALID_ARGUMENT naming `name` unless the view has data and exactly `expected` elements.
absl::Status CheckElements(absl::string_view name, const TensorView& view, int64_t expected);

// Device-side ordering with a client's CUDA stream (docs/regions.md, "Device-ordered rings"): the
// engine records `record` (a cudaEvent_t shared with the client by CUDA IPC, opaque here; the
// client's stream waits for it) once the job's outputs are written, and a decode whose outputs
// are all device memory returns as soon as its step is queued, without waiting for the device.
// With `wait_word`, the step first waits on the device until the 64-bit word there reaches
// `wait_value` (the ring's gate, DeviceMemoryOpener::Gate: written once the client's inputs are,
// or by attnd's host when the client's stream is stuck, so no client holds the stream for ever);
// without it, the ring has waited on the host. The client's own event never enters the engine's
// streams. Null: the host orders the job, as for any other.
struct DeviceOrder {
  void* record = nullptr;
  const void* wait_word = nullptr;
  uint64_t wait_value = 0;
};

// Append num_tokens tokens to one layer of one sequence and compute their attention.
struct PrefillJob {
  explicit PrefillJob(EngineJobKey) {}
  int32_t layer = 0;
  const int32_t* page_table =
      nullptr;  // [num_pages] the sequence's pages, covering start+num_tokens
  int64_t num_pages = 0;
  int64_t start = 0;  // tokens already in this layer; the new ones are start .. start+num_tokens-1
  int64_t num_tokens = 0;  // T >= 1
  int64_t prompt_len = 0;  // L for length scaling (>= start + num_tokens)
  // kPreRotary: q is [T, Hq, D] and k is before the rotary; the engine applies the dual-chunk
  // rotary at positions start .. start+T-1 (kernels/dual_chunk_rotary.h), then scales keys as
  // usual.
  QLayout q_layout = QLayout::kVariants;
  TensorView q;         // [T, 5, Hq, D] (kVariants) or [T, Hq, D] (kPreRotary)
  TensorView k;         // [T, Hkv, D]
  TensorView v;         // [T, Hkv, D]
  void* out = nullptr;  // [T, Hq, D] of out_dtype
  DType out_dtype = DType::kFp32;
  bool out_on_device = false;          // out is device memory (as TensorView::on_device)
  int64_t out_row_pitch = 0;           // bytes from one token's [Hq, D] to the next; 0: dense
  const DeviceOrder* order = nullptr;  // engines without a device ignore it
};

// One decode step in one layer for a batch of distinct sequences. (Entries are plain values: they
// mean something only inside a DecodeJob, which only the runtime makes.)
struct DecodeJob {
  struct Entry {
    const int32_t* page_table = nullptr;  // the sequence's pages, covering `length`
    int64_t num_pages = 0;
    int64_t length = 0;   // L: the layer's length including the new token (>= 1)
    TensorView q;         // [3 or 5, Hq, D] (only the first three variants used), or [Hq, D]
    TensorView k;         // [Hkv, D]
    TensorView v;         // [Hkv, D]
    void* out = nullptr;  // [Hq, D] of out_dtype
    DType out_dtype = DType::kFp32;
    // q may have a row pitch (its variants' rows); k, v and out are one row each.
    // kPreRotary: q is [Hq, D] and k before the rotary, both rotated for position L - 1.
    QLayout q_layout = QLayout::kVariants;
    bool out_on_device = false;          // out is device memory (as TensorView::on_device)
    const DeviceOrder* order = nullptr;  // entries of one call share it; engines without a device
                                         // ignore it
  };
  explicit DecodeJob(EngineJobKey) {}
  int32_t layer = 0;
  std::vector<Entry> entries;
};

// What one Engine::Decode ran (a job may run as several launches of at most the engine's batch).
struct DecodeStats {
  int32_t graph_replays = 0;    // launches that replayed a captured CUDA graph
  int32_t eager_launches = 0;   // launches that did not
  int64_t padding_entries = 0;  // length-0 rows added to reach a planned batch size
};

// The decode batch sizes engines plan around unless configured otherwise
// (--cuda-graph-batch-sizes), SGLang/vLLM-style: dense at small sizes. The CUDA engine captures a
// graph per size and pads a batch to the next one; the batcher launches a batch at once when it
// reaches one of the engine's sizes.
const std::vector<int32_t>& DefaultDecodeBatchSizes();

// What one shard of an engine holds: its device, its slice of the heads and its part of the pool.
// An unsharded engine is one shard with every head.
struct EngineShard {
  std::string device;       // "cpu", "cuda:0", ...
  std::string device_name;  // the CPU model or GPU name
  std::string device_uuid;  // "GPU-..." or ""
  int32_t first_kv_head = 0;
  int32_t num_kv_heads = 0;
  int32_t first_q_head = 0;
  int32_t num_q_heads = 0;
  int64_t pool_bytes = 0;  // this shard's K/V memory (every shard holds every page)
  int64_t bytes_used = 0;  // of it, pages held by sequences (the runtime's count; engines say 0)
};

// A decode that an engine has started and not yet finished (Engine::StartDecode).
class PendingDecode {
 public:
  virtual ~PendingDecode() = default;  // finishes the decode if Finish was not called
  // Waits for the decode and writes its outputs; call once.
  virtual absl::StatusOr<DecodeStats> Finish() = 0;
};

// A prefill job run as device steps (Engine::StartPrefill), so that whoever schedules the device
// can run decode steps between them and stop the call between two steps. Not thread-safe: one
// thread drives a run.
class PrefillRun {
 public:
  // Stops a run that is not done: waits for the device work it queued. Whatever it wrote lies past
  // the layer's committed length, as for a failed job.
  virtual ~PrefillRun() = default;
  virtual bool done() const = 0;
  // Runs the next step. After an error the run is done and the job failed.
  virtual absl::Status Step() = 0;
};

// Thread-safe for jobs on disjoint sequences (callers serialise jobs per sequence). A failed job
// returns INTERNAL (or INVALID_ARGUMENT for a request the backend cannot serve) and may have
// written K/V only at positions past the layer's committed length.
class Engine {
 public:
  virtual ~Engine() = default;

  virtual std::string backend() const = 0;      // "cpu", "cuda"
  virtual std::string device_name() const = 0;  // e.g. the CPU model or GPU name
  virtual const KvLayout& layout() const = 0;
  virtual const DcaGeometry& geometry() const = 0;

  virtual absl::Status Prefill(const PrefillJob& job) = 0;
  // The job as steps of bounded device work (engines cut where their kernels can: the CUDA engine
  // at staging chunks and key-tile windows, the CPU engine at query rows), each output bit for bit
  // what Prefill writes. The job's memory must outlive the run. The default runs Prefill as one
  // step. An error here (a job the engine refuses) means nothing ran.
  virtual absl::StatusOr<std::unique_ptr<PrefillRun>> StartPrefill(const PrefillJob& job);
  // Whether decode steps run on the device while a prefill step runs (the CUDA engine: separate
  // streams, decode at the higher priority, so the device itself puts decode first). When false,
  // the steps should take turns (server/runtime/device_turns.h).
  virtual bool overlaps_prefill_and_decode() const { return false; }
  virtual absl::StatusOr<DecodeStats> Decode(const DecodeJob& job) = 0;
  // Decode in two halves, for a caller that drives several engines from one thread (the sharded
  // engine): the work is queued on the device and this returns; PendingDecode::Finish waits for
  // it. The job's memory must outlive the pending decode, and the engine runs nothing else until
  // it is finished. Null (OK) when this engine or this job cannot be split (the CPU, device
  // tensors, more entries than one launch): call Decode.
  virtual absl::StatusOr<std::unique_ptr<PendingDecode>> StartDecode(const DecodeJob& /*job*/) {
    return std::unique_ptr<PendingDecode>();
  }

  // The batch sizes this engine runs best (it pads to them); empty when any size is as good (the
  // CPU). The batcher flushes a batch that reaches one.
  virtual std::vector<int32_t> decode_batch_sizes() const { return {}; }
  // Whether decodes replay captured CUDA graphs.
  virtual bool decode_graphs() const { return false; }

  // False once the device is lost for good (e.g. a GPU fell off the bus): the server then turns
  // its health NOT_SERVING (it polls this). Engines that cannot lose their device keep the default.
  virtual bool healthy() const { return true; }

  // The GPU's UUID ("GPU-..."), for clients deciding whether CUDA IPC can reach this engine's
  // device; "" for engines without one.
  virtual std::string device_uuid() const { return ""; }
  // Whether the engine's CUDA context is a CUDA MPS client (false without a GPU).
  virtual bool cuda_mps() const { return false; }
  // Opens CUDA IPC handles on this engine's device, for CUDA IPC regions; null when the engine
  // cannot (the CPU engine). Lives as long as the engine.
  virtual DeviceMemoryOpener* device_memory_opener() { return nullptr; }

  // The engine's shards, in head order. The default: this engine, one shard with every head.
  virtual std::vector<EngineShard> shards() const;
  // "cpu" or "cuda:<ordinal>": where this engine's pool lives.
  virtual std::string device() const { return backend(); }
};

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_ENGINE_H_
