// The backend seam: an Engine owns the KV pool's memory and computes attention over it. The CPU
// engine (server/cpu_engine.h) is the embedded default; a CUDA engine implements the same
// interface. Engines never see protobuf; the runtime validates requests and owns the page
// bookkeeping.
#ifndef ATTND_SERVER_ENGINE_H_
#define ATTND_SERVER_ENGINE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/dca.h"
#include "kernels/dtype.h"
#include "kvcache/kv_layout.h"

namespace attnd {

class DeviceMemoryOpener;  // server/regions.h

// A validated request tensor: dtype and shape checked against the model, data holding exactly
// product(shape) * ElementSize(dtype) bytes (any alignment).
struct TensorView {
  DType dtype = DType::kFp32;
  const void* data = nullptr;
  std::vector<int64_t> shape;
  // data is device memory of the engine's GPU (a CUDA IPC region, docs/regions.md), not host
  // memory. Only the CUDA engine accepts it.
  bool on_device = false;
};

// Append num_tokens tokens to one layer of one sequence and compute their attention.
struct PrefillJob {
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
  bool out_on_device = false;  // out is device memory (as TensorView::on_device)
};

// One decode step in one layer for a batch of distinct sequences.
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
    // kPreRotary: q is [Hq, D] and k before the rotary, both rotated for position L - 1.
    QLayout q_layout = QLayout::kVariants;
    bool out_on_device = false;  // out is device memory (as TensorView::on_device)
  };
  int32_t layer = 0;
  std::vector<Entry> entries;
  // Set by a graph backend to whether it replayed a captured CUDA graph (else left unchanged).
  bool* graph_replayed = nullptr;
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
  virtual absl::Status Decode(const DecodeJob& job) = 0;

  // False once the device is lost for good (e.g. a GPU fell off the bus): the server then turns
  // its health NOT_SERVING (it polls this). Engines that cannot lose their device keep the default.
  virtual bool healthy() const { return true; }

  // The GPU's UUID ("GPU-..."), for clients deciding whether CUDA IPC can reach this engine's
  // device; "" for engines without one.
  virtual std::string device_uuid() const { return ""; }
  // Opens CUDA IPC handles on this engine's device, for CUDA IPC regions; null when the engine
  // cannot (the CPU engine). Lives as long as the engine.
  virtual DeviceMemoryOpener* device_memory_opener() { return nullptr; }
};

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_H_
