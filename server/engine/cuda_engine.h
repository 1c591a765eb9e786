// The CUDA backend: the KV pool is one cudaMalloc laid out as kvcache/kv_layout.h says (bf16, int8
// or fp8 K/V; docs/kv_cache.md),
// and attention runs on the kernels of kernels/cuda/dca_cuda.h on two CUDA streams: decode at the
// device's highest priority, prefill at its lowest, so decode blocks are dispatched first.
//
// Prefill: request tensors are packed into pinned host staging buffers, copied to preallocated
// device buffers on the prefill stream, converted to bf16 on the device, appended to the pool,
// attended, and copied back; a prefill longer than the staging buffers runs as consecutive chunks,
// one sync each, which is exactly chunked prefill. A call runs as steps (StartPrefill,
// docs/scheduling.md): each chunk's attention in key-tile windows of bounded length.
//
// Decode: the host only copies each row's tensors (in their own dtype) and page table into fixed
// slots of pinned memory; one step is three kernels and no copies: a stage kernel that reads those
// slots through their mapped addresses (page tables, q converted to bf16, the new K/V appended to
// the pool), the split-K attention, and its reduction, which writes the fp32 outputs straight into
// pinned host memory. Then one synchronisation. Rows whose tensors are device memory (CUDA IPC
// regions) are not copied: their addresses go in the row table, and the same kernels read q/k/v
// and write the output (in its dtype) there, so host and device rows mix in one step. Decode steps
// replay CUDA graphs: at creation (so before the server reports SERVING) the engine captures that
// step for every captured batch size P and every layer. A batch of n < P entries pads with length-0
// rows, which the kernels skip. One graph per (size, layer) rather than one per size: the layer's
// K/V base pointers are kernel arguments, and the graphs are small (docs/batching.md has the
// measured memory and capture time). No CUDA types in this header.
#ifndef ATTND_SERVER_ENGINE_CUDA_ENGINE_H_
#define ATTND_SERVER_ENGINE_CUDA_ENGINE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/dca.h"
#include "kvcache/kv_layout.h"
#include "server/config/sparse_config.h"
#include "server/engine/engine.h"

namespace attnd {

struct CudaEngineOptions {
  DcaGeometry geometry;
  KvLayout layout;     // kv_dtype kBf16, kInt8 or kFp8E4m3; pool_bytes() cudaMalloc'ed at once
  int32_t device = 0;  // CUDA device ordinal
  int32_t max_decode_batch = 256;  // larger decode jobs run in batches of this many
  // Decode batch sizes with a captured CUDA graph (ascending; sizes above max_decode_batch are
  // dropped). A batch of n entries is planned as the smallest size >= n (its split-K layout is
  // that size's), so an eager launch and a graph replay compute bit-identical outputs. Empty: plan
  // each batch by its own size, never capture.
  std::vector<int32_t> graph_batch_sizes = DefaultDecodeBatchSizes();
  // Capture one graph per (size, layer) at creation and replay them (--disable-cuda-graphs: false).
  bool cuda_graphs = true;
  // Vertical-slash sparse prefill budgets (kernels/cuda/sparse_cuda.h), or null: a prefill whose
  // prompt_len passes sparse->UseSparse runs the sparse kernels. Its device workspace is allocated
  // at creation for the longest sequence the pool holds. A call of any size is taken: one longer
  // than a staging chunk is estimated once per DCA piece and attended in staging chunks.
  std::shared_ptr<const SparseAttentionConfig> sparse;
  // Pinned host staging for one prefill chunk (q, k, v in, output out, worst case fp32). Sets the
  // largest prefill chunk: 7B geometry needs ~90 KiB per token, so 512 MiB is ~5.8K tokens.
  // 0 = the default: 512 MiB, and with sparse kernels at least 16,384 tokens (a
  // sparse call longer than a chunk is attended in several launches, slower per token: BENCHMARKS,
  // "Sparse prefill calls of any size").
  int64_t staging_bytes = 0;
  // The bound on one prefill step (Engine::StartPrefill): each block of the prefill kernel walks
  // about this many keys per launch (key-tile windows, its softmax state kept on the device between
  // them), so a decode on the higher-priority stream waits for one window's blocks at most.
  int64_t prefill_step_keys = 16384;
  // SMs the prefill lane leaves to decode: with n > 0 the prefill stream lives in a green context
  // of the device's other SMs (rounded up to the device's partition granularity, 8 on Hopper), so
  // however long its blocks run, a decode step's first blocks find free SMs at once; the decode
  // stream keeps every SM. 0: prefill may use every SM (its blocks then hold the SMs a decode
  // needs until they finish: docs/scheduling.md). Needs a driver with green contexts (CUDA 12.4).
  int32_t decode_reserved_sms = 0;
  // Fewest keys in a decode split (CudaKernelPlanOptions::decode_min_split_keys; 0 = the kernels'
  // default). For benchmarks that compare split plans.
  int32_t decode_min_split_keys = 0;
};

// INVALID_ARGUMENT for a geometry/layout the CUDA kernels do not support (kernels/cuda/dca_cuda.h:
// head_dim 64/128, group size 1..16, bf16, int8 or fp8 KV); FAILED_PRECONDITION when no CUDA device
// is usable (cudaGetDeviceCount() == 0 or no driver); RESOURCE_EXHAUSTED when the pool or staging
// buffers cannot be allocated.
//
// The engine serialises its jobs internally, per lane (decode and prefill: a stream and staging
// buffers each, the decode stream at the higher priority): it is thread-safe, concurrent jobs of
// one kind on disjoint sequences simply queue, and a decode never waits for a prefill's lane.
absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(const CudaEngineOptions& options);

// OK when this binary contains the CUDA backend; FAILED_PRECONDITION, saying how to get it, when it
// was built without a CUDA toolkit (cuda_engine_stub.cc, chosen by server/engine/BUILD).
absl::Status CudaBuildStatus();

// Tests only: the whole KV pool of an engine CreateCudaEngine made (layout().pool_bytes() bytes,
// kvcache/kv_layout.h), copied to the host once the engine's queued work has finished.
// INVALID_ARGUMENT for any other engine.
absl::StatusOr<std::vector<uint8_t>> CopyCudaPoolForTesting(Engine& engine);

// Usable CUDA devices: 0 without a driver or a GPU (never fails; clears the CUDA error it caused).
int CudaDeviceCount();

// Free device memory of `device` in bytes, before the pool is allocated (for --kv-cache-fraction).
absl::StatusOr<int64_t> CudaFreeMemoryBytes(int32_t device);

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_CUDA_ENGINE_H_
