// Dense dual chunk attention on NVIDIA GPUs (Hopper first): KV append, fused prefill and split-K
// paged decode over one layer of a bf16 paged KV pool (kvcache/kv_layout.h, kernels/paged_kv.h).
// Semantics: docs/DCA.md ("Dense prefill", "Decode", "Length scaling").
//
// Plain C++ header: device code lives in dca_cuda_kernels.cuh and kv_write_kernels.cuh, included by
// the family files only (dca_prefill.cu, dca_decode.cu, kv_write.cu; dca_plan.cu prepares them).
// Every pointer in these Params structs is DEVICE memory unless it says otherwise. Launch functions
// only enqueue work on `stream` (no host synchronisation) and return INTERNAL when a launch fails,
// INVALID_ARGUMENT for shapes outside the supported set (CheckCudaGeometry).
//
// Supported set (one dispatch per kernel family): head_dim 64 or 128; group size (Hq / Hkv) 1..16;
// bf16 KV, and the scaled one-byte KV dtypes, int8 (base/int8_kv.h) and fp8 E4M3 (base/fp8.h), for
// the appends, the decode kernel and the dequantisation that feeds the bf16 prefill kernels
// (LaunchDequantizeKv). Query tensors are bf16; outputs are bf16, fp16 or fp32.
//
// Only the kernels production runs live here: prefill's Hopper default and portable fallback, the
// decode kernel (any GPU, ring depth 2 or 3), and a simple reference per family for tests; every
// other configuration measured on the way is in the tuning lab (bench/gpu/lab/). A CudaKernelPlan,
// built once per device and geometry, picks among them. How fast each is, against which peer, is in
// docs/BENCHMARKS.md ("CUDA backend"); the tuning history is in bench/gpu/NOTES.md. Numbers are
// kept there, not here, so that they have one home and a date.
#ifndef ATTND_KERNELS_CUDA_DCA_CUDA_H_
#define ATTND_KERNELS_CUDA_DCA_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "base/fp8.h"
#include "base/int8_kv.h"
#include "kernels/dca.h"
#include "kernels/paged_kv.h"

namespace attnd {

using Bf16 = __nv_bfloat16;

// OK when the geometry is in the supported set above, else INVALID_ARGUMENT naming the field.
absl::Status CheckCudaGeometry(const DcaGeometry& geometry);

// A batch of sequences over one layer: sequence b's page table is row b of `page_tables`. Same page
// arithmetic as PagedKv (Seq(b) is a PagedKv); trivially copyable, passed by value to kernels.
struct PagedKvBatch {
  Bf16* k = nullptr;                     // [num_pages, page_size, num_kv_heads, head_dim]
  Bf16* v = nullptr;                     // [num_pages, page_size, num_kv_heads, head_dim]
  const int32_t* page_tables = nullptr;  // [batch, page_table_stride]
  int64_t page_table_stride = 0;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;

  ATTND_HOST_DEVICE PagedKv<Bf16> Seq(int64_t b) const {
    PagedKv<Bf16> kv;
    kv.k = k;
    kv.v = v;
    kv.page_table = page_tables + b * page_table_stride;
    kv.page_size = page_size;
    kv.num_kv_heads = num_kv_heads;
    kv.head_dim = head_dim;
    return kv;
  }
};

// KV element types stored as one-byte codes with an fp32 scale per (token, kv head) row: int8 and
// fp8 E4M3. Every launcher below that takes one has an overload for each.
template <typename KvT>
inline constexpr bool kScaledKv =
    std::is_same<KvT, Int8Kv>::value || std::is_same<KvT, Fp8E4m3>::value;

// The same for a pool of scaled codes (CodeT = Int8Kv or Fp8E4m3): codes and the per-(token, kv
// head) fp32 scales of one layer (kvcache/kv_layout.h's scale regions).
template <typename CodeT>
struct PagedKvBatchScaled {
  static_assert(kScaledKv<CodeT>, "int8 or fp8 codes");
  CodeT* k = nullptr;                    // [num_pages, page_size, num_kv_heads, head_dim]
  CodeT* v = nullptr;                    // [num_pages, page_size, num_kv_heads, head_dim]
  float* k_scale = nullptr;              // [num_pages, page_size, num_kv_heads]
  float* v_scale = nullptr;              // [num_pages, page_size, num_kv_heads]
  const int32_t* page_tables = nullptr;  // [batch, page_table_stride]
  int64_t page_table_stride = 0;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;

  ATTND_HOST_DEVICE PagedKv<CodeT> Seq(int64_t b) const {
    PagedKv<CodeT> kv;
    kv.k = k;
    kv.v = v;
    kv.k_scale = k_scale;
    kv.v_scale = v_scale;
    kv.page_table = page_tables + b * page_table_stride;
    kv.page_size = page_size;
    kv.num_kv_heads = num_kv_heads;
    kv.head_dim = head_dim;
    return kv;
  }
};
using PagedKvBatchInt8 = PagedKvBatchScaled<Int8Kv>;

// The batch view of a pool of KvT (Bf16, Int8Kv or Fp8E4m3).
template <typename KvT>
using PagedKvBatchOf = std::conditional_t<kScaledKv<KvT>, PagedKvBatchScaled<KvT>, PagedKvBatch>;

// ---- KV append ---------------------------------------------------------------------------------

// Prefill append: tokens start .. start+num_tokens-1 of one sequence; keys are stored as
// key_scale * k, rounded once to bf16 (k/v may be bf16, fp16 or fp32). Into a pool of scaled codes
// (KvT = Int8Kv or Fp8E4m3) each (token, kv head) row of key_scale * k, and of v, is quantised with
// base/int8_kv.h's Int8QuantizeRow or base/fp8.h's Fp8QuantizeRow arithmetic, its codes and scale
// the CPU engine's bit for bit.
template <typename KvT>
struct CudaAppendParamsOf {
  PagedKv<KvT> kv;          // one layer; kv.page_table in device memory (codes: and the scales)
  const void* k = nullptr;  // [num_tokens, num_kv_heads, head_dim] of in_dtype, unscaled
  const void* v = nullptr;  // [num_tokens, num_kv_heads, head_dim] of in_dtype
  DType in_dtype = DType::kBf16;
  int64_t start = 0;
  int64_t num_tokens = 0;
  float key_scale = 1.f;  // s(prompt_len)
};
using CudaAppendParams = CudaAppendParamsOf<Bf16>;
absl::Status LaunchAppendKv(const CudaAppendParams& params, cudaStream_t stream);
absl::Status LaunchAppendKv(const CudaAppendParamsOf<Int8Kv>& params, cudaStream_t stream);
absl::Status LaunchAppendKv(const CudaAppendParamsOf<Fp8E4m3>& params, cudaStream_t stream);

// Decode append: one new token per sequence at position lengths[b] - 1, key stored as s(L) * k
// with L = lengths[b] (computed on the device from original_max_position_embeddings); into a pool
// of scaled codes quantised as LaunchAppendKv does.
template <typename KvT>
struct CudaDecodeAppendParamsOf {
  PagedKvBatchOf<KvT> kv;
  const int32_t* lengths = nullptr;  // [batch] L including the new token; 0 = padding row, skipped
  const void* k = nullptr;           // [batch, num_kv_heads, head_dim] of in_dtype, unscaled
  const void* v = nullptr;           // [batch, num_kv_heads, head_dim] of in_dtype
  DType in_dtype = DType::kBf16;
  int32_t batch = 0;
  int64_t original_max_position_embeddings = 0;
};
using CudaDecodeAppendParams = CudaDecodeAppendParamsOf<Bf16>;
absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParams& params, cudaStream_t stream);
absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParamsOf<Int8Kv>& params,
                                  cudaStream_t stream);
absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParamsOf<Fp8E4m3>& params,
                                  cudaStream_t stream);

// Decode staging: one kernel that takes a decode step's inputs straight from pinned host memory
// (read over the bus through its mapped address: no copies to launch or wait for) and leaves what
// the decode kernels read in device memory. Per row r with length L = rows[r].length >= 1:
//   page_tables (device, kv.page_tables at kv.page_table_stride) row r <- host_tables row r
//     (the first rows[r].num_pages entries; host_tables has the same stride);
//   q (device bf16 [batch, 3, num_q_heads, head_dim]) row r <- the first 3 query variants of
//     host_q + r * q_row_bytes (or of rows[r].q), in rows[r].q_dtype;
//   the new token at position L - 1 appended as LaunchDecodeAppendKv does (key scaled by s(L)),
//     from host_k / host_v + r * kv_row_bytes (or rows[r].k / v) in rows[r].k_dtype / v_dtype,
//     through the host table;
//   lengths[r] <- L; row_outs[r] <- rows[r].out, out_dtype.
// A row with L = 0 (padding of a captured batch size) only gets lengths[r] = 0 and an empty
// row_outs[r]. Every field is read on the device, so a captured graph of this kernel serves any
// lengths, tables, dtypes and mix of host and device rows.
// Requires 16-byte aligned pointers (the params'; a row's device tensors may have any alignment
// of their dtype), a page-table stride that is a multiple of 4, head_dim a
// multiple of 8, and slots of at least fp32 rows, 16-byte multiples (INVALID_ARGUMENT otherwise).
struct DecodeStageRow {
  int32_t length = 0;
  int32_t num_pages = 0;
  int32_t q_dtype = 0;  // static_cast<int32_t>(DType)
  int32_t k_dtype = 0;
  int32_t v_dtype = 0;
  // 1: a pre-rotary row: its q slot holds q [Hq, D] and its k slot k [Hkv, D], both before the
  // rotary, in q_dtype / k_dtype. The stage applies the dual-chunk rotary
  // (CudaDecodeStageParams::rotary) on the way: the three bf16 variants of q, each by its
  // position, and the key by the intra position before it is scaled and appended.
  int32_t rotary = 0;
  // Device rows (CUDA IPC regions, docs/regions.md): tensors in device memory of the launching
  // device are read in place, any alignment of their dtype. Null: the row's pinned slot. A device
  // q is the row's first three variants, variant rows q_pitch bytes apart ([Hq, D] for a
  // pre-rotary row).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_pitch = 0;
  // Null: the reduction writes the row's fp32 output into CudaDecodeParams::out. Else memory the
  // device can write, [Hq, D] of out_dtype (a device tensor, or mapped pinned memory such as the
  // engine's slot for a host row), which the reduction writes instead (the same fp32 values,
  // converted on the device).
  void* out = nullptr;
  int32_t out_dtype = 0;  // static_cast<int32_t>(DType)
};
// A row's output destination as the stage kernel leaves it on the device for the reduction
// (DecodeStageRow::out, out_dtype; null for host rows and padding).
struct DecodeRowOut {
  void* out = nullptr;
  int32_t dtype = 0;
};
struct CudaDecodeStageParams {
  PagedKvBatch kv;                       // the layer's pool; page_tables = the device table to fill
  const DecodeStageRow* rows = nullptr;  // pinned host [batch]
  const int32_t* host_tables = nullptr;  // pinned host [batch, kv.page_table_stride]
  const void* host_q = nullptr;          // pinned host, row r at r * q_row_bytes
  const void* host_k = nullptr;          // pinned host, row r at r * kv_row_bytes
  const void* host_v = nullptr;
  int64_t q_row_bytes = 0;
  int64_t kv_row_bytes = 0;
  int32_t* lengths = nullptr;        // device [batch]
  Bf16* q = nullptr;                 // device [batch, 3, num_q_heads, head_dim]
  DecodeRowOut* row_outs = nullptr;  // device [batch], or null: not written
  // The dual-chunk rotary of pre-rotary rows (kernels/dual_chunk_rotary.h: positions, fp32 angle,
  // fp64 sincos rounded to fp32, as the prefill's LaunchDualChunkRotary). inv_freq null: the
  // model has no rotary, and no row may be pre-rotary.
  struct Rotary {
    const float* inv_freq = nullptr;  // device [half]
    int32_t half = 0;                 // rotary_dim / 2
    int64_t chunk_size = 0;
    int64_t chunk_len = 0;
  } rotary;
  int32_t num_q_heads = 0;
  int32_t batch = 0;
  int64_t original_max_position_embeddings = 0;
  // Device [batch, 2, num_kv_heads, head_dim] fp32, or null. Set for a pool of scaled codes (int8,
  // fp8): the stage does
  // not append; it leaves row r's new key, length-scaled (s(L) * k, one fp32 product), in
  // kv_rows[r][0] and its value in kv_rows[r][1], and LaunchDecodeQuantizeRows, next in the step,
  // quantises them into the pool (a row needs all its values for its scale, which the stage's
  // 16-byte pieces, spread over blocks, never hold together). kv.k / kv.v are then unused.
  float* kv_rows = nullptr;
};
absl::Status LaunchDecodeStage(const CudaDecodeStageParams& params, cudaStream_t stream);

// The append of a decode step over scaled codes: for each row r with lengths[r] >= 1,
// kv_rows[r][0] (the length-scaled key) and kv_rows[r][1] (the value) of each kv head quantised
// (Int8QuantizeRow's or Fp8QuantizeRow's arithmetic, multiplier 1: the stage already scaled the
// key) into the pool at position lengths[r] - 1 through row r of kv.page_tables. Launched after
// the stage kernel in the same step (programmatic dependent launch; capturable).
template <typename CodeT>
struct CudaDecodeQuantizeRowsParamsOf {
  PagedKvBatchScaled<CodeT> kv;
  const int32_t* lengths = nullptr;  // device [batch]; 0 = padding row, skipped
  const float* kv_rows = nullptr;    // device [batch, 2, num_kv_heads, head_dim]
  int32_t batch = 0;
};
absl::Status LaunchDecodeQuantizeRows(const CudaDecodeQuantizeRowsParamsOf<Int8Kv>& params,
                                      cudaStream_t stream);
absl::Status LaunchDecodeQuantizeRows(const CudaDecodeQuantizeRowsParamsOf<Fp8E4m3>& params,
                                      cudaStream_t stream);

// Dequantises positions [0, num_tokens) of one sequence's scaled K/V codes (one layer, CodeT =
// Int8Kv or Fp8E4m3) into bf16 rows
// bf16(code * scale) (one fp32 multiply, rounded to nearest even) at k_out / v_out
// [num_tokens, num_kv_heads, head_dim]: pages 0, 1, ... of page_size tokens, which a PagedKv<Bf16>
// over an identity page table reads back as the sequence. This is how the bf16 prefill kernels
// (dense and sparse) attend an int8 or fp8 cache.
template <typename CodeT>
struct CudaDequantizeKvParamsOf {
  PagedKv<CodeT> kv;      // one layer; kv.page_table in device memory
  Bf16* k_out = nullptr;  // [num_tokens, num_kv_heads, head_dim]
  Bf16* v_out = nullptr;  // [num_tokens, num_kv_heads, head_dim]
  int64_t num_tokens = 0;
};
absl::Status LaunchDequantizeKv(const CudaDequantizeKvParamsOf<Int8Kv>& params,
                                cudaStream_t stream);
absl::Status LaunchDequantizeKv(const CudaDequantizeKvParamsOf<Fp8E4m3>& params,
                                cudaStream_t stream);

// dst[i] = bf16(src[i]) for n elements (src bf16, fp16 or fp32).
absl::Status LaunchConvertToBf16(const void* src, DType src_dtype, int64_t n, Bf16* dst,
                                 cudaStream_t stream);

// ---- Plan --------------------------------------------------------------------------------------

// The fused prefill kernels of the product (their alternatives live in the tuning lab,
// bench/gpu/lab/, which never links into the daemon):
//   kWgmma    Hopper wgmma (sm_90a; prefill_wgmma.cuh): warp-specialised, an asynchronous
//             producer warpgroup, softmax overlapped with P V, ping-pong between the two consumer
//             warpgroups; 128 query rows per block. The default; compute capability 9.0 only.
//   kMmaSync  mma.sync m16n8k16 (dca_cuda_kernels.cuh): 4 warps of two 16-row tiles, 64-key
//             tiles in a 2-deep cp.async ring; any GPU this library targets. The fallback.
// Both handle every shape CheckCudaGeometry accepts, with the same results within the bf16 bars.
enum class PrefillKernel : int32_t { kWgmma = 0, kMmaSync = 1 };
const char* PrefillKernelName(PrefillKernel kernel);

struct CudaKernelPlanOptions {
  // kWgmma runs kMmaSync on GPUs other than compute capability 9.0; kMmaSync forces the fallback.
  PrefillKernel prefill = PrefillKernel::kWgmma;
  // K/V ring depth of the decode kernel: 0 = by batch (2 while every (sequence, kv head) block
  // fits one wave at the 2-deep ring's occupancy, 3 past it), else 2 or 3 for every batch.
  int32_t decode_stages = 0;
  // The pool's element type, kBf16, kInt8 or kFp8E4m3: the decode kernel whose occupancy sets the
  // ring depth and split-K plan (the one-byte kernels' shared memory differs).
  DType kv_dtype = DType::kBf16;
  // Fewest keys in a decode split (a multiple of 64, 64..65536; 0 = kMinSplitKeys): a row shorter
  // than max_splits times this runs on fewer, longer splits.
  int32_t decode_min_split_keys = 0;
};

// Fewest keys in a decode split unless the plan says otherwise (CudaKernelPlanOptions): two
// 64-key tiles. A short row then spreads over more multiprocessors, each block's load latency
// shorter, for a few more partials to merge (docs/BENCHMARKS.md has the 64 / 128 / 256 sweep).
inline constexpr int32_t kMinSplitKeys = 128;

// The split-K rule for `batch` sequences of up to max_length keys when `blocks_per_sm` decode
// blocks fit on each of `num_sms` multiprocessors: as many splits as keep every (batch x kv head x
// split) block resident in one wave, at least 1, at most 1024, with at least min_split_keys keys
// per split at max_length. CudaKernelPlan::DecodeSplits applies it; so does the tuning lab.
int32_t DecodeSplitsFor(const DcaGeometry& geometry, int32_t num_sms, int32_t blocks_per_sm,
                        int32_t batch, int64_t max_length, int32_t min_split_keys = kMinSplitKeys);

// Everything about the launches that depends on the device and the geometry, decided once: the
// prefill kernel, the decode ring depth per batch size and its split-K plan (from the occupancy the
// CUDA runtime reports for the kernels at this geometry), and the kernels' shared-memory
// attributes (set on `device` here, never at launch). Launch functions then only enqueue. Cheap to
// copy; valid for the life of the process on the device it was built for.
class CudaKernelPlan {
 public:
  // INVALID_ARGUMENT for a geometry outside the supported set or bad options; INTERNAL when the
  // device cannot be read. Leaves the calling thread's current device as it was.
  static absl::StatusOr<CudaKernelPlan> Create(const DcaGeometry& geometry, int device,
                                               const CudaKernelPlanOptions& options = {});

  const DcaGeometry& geometry() const { return geometry_; }
  int device() const { return device_; }
  int32_t num_sms() const { return num_sms_; }
  PrefillKernel prefill_kernel() const { return prefill_; }
  // The pool element type the decode occupancy was read for (CudaKernelPlanOptions::kv_dtype).
  DType kv_dtype() const { return kv_dtype_; }
  // Decode ring depth (2 or 3) for `batch` sequences; depends only on the batch, so a captured
  // graph keeps its kernel for any lengths.
  int32_t DecodeStages(int32_t batch) const;
  // Resident decode blocks per multiprocessor at ring depth `stages` (2 or 3), as the runtime's
  // occupancy calculator reports it.
  int32_t DecodeBlocksPerSm(int32_t stages) const { return stages == 3 ? blocks_s3_ : blocks_s2_; }
  // Split-K plan: as many splits as keep every (batch x kv head x split) block resident in one
  // wave, at least 1, with at least DecodeMinSplitKeys() keys per split at max_length.
  int32_t DecodeSplits(int32_t batch, int64_t max_length) const;
  // Fewest keys in a split of any row (the kernels' and the reduction's split rule).
  int32_t DecodeMinSplitKeys() const { return decode_min_split_keys_; }
  // Workspace floats a decode of (batch, max_splits) needs: partial_out then partial_lse.
  size_t DecodeWorkspaceFloats(int32_t batch, int32_t max_splits) const;

 private:
  DcaGeometry geometry_;
  int device_ = 0;
  int32_t num_sms_ = 0;
  PrefillKernel prefill_ = PrefillKernel::kWgmma;
  int32_t decode_stages_ = 0;
  int32_t decode_min_split_keys_ = kMinSplitKeys;
  DType kv_dtype_ = DType::kBf16;
  int32_t blocks_s2_ = 1;
  int32_t blocks_s3_ = 1;
};

// ---- Prefill -----------------------------------------------------------------------------------

// Attention for num_tokens new tokens at positions start .. start+num_tokens-1 of one sequence,
// whose K/V are already appended (keys [0, start+num_tokens) valid).
struct CudaPrefillParams {
  PagedKv<Bf16> kv;         // one layer; kv.page_table in device memory
  const Bf16* q = nullptr;  // [num_tokens, 5, num_q_heads, head_dim] (variants as in dca.h)
  void* out = nullptr;      // [num_tokens, num_q_heads, head_dim] of out_dtype
  DType out_dtype = DType::kFp32;
  int64_t start = 0;
  int64_t num_tokens = 0;
  float softmax_scale = 0.f;  // geometry scale * s(prompt_len)
  // Key-tile window, so that the caller can cut one call into launches of bounded duration (a
  // block of a long call walks all its keys; a decode on another stream waits for blocks to end).
  // Each block visits its key tiles in a fixed order (inter, succ, intra, each from its start);
  // a launch with window [key_tile_begin, key_tile_end) processes only the tiles of that index
  // range (key_tile_end 0 = to the end). Launches of the windows [0, w), [w, 2w), ... up to
  // PrefillKeyTiles(...) tiles, in that order on one stream with the same params otherwise, write
  // the output of the whole launch bit for bit; until the last one, `out` is incomplete. (0, 0),
  // or any window from 0 that covers PrefillKeyTiles(...) tiles, is the whole launch: no state is
  // read or written. Any other window needs PrefillTakesWindows(plan) and window_state.
  int32_t key_tile_begin = 0;
  int32_t key_tile_end = 0;
  // [PrefillWindowStateBytes(plan, geometry, num_tokens)] device workspace, 4-byte aligned, kept
  // untouched between the launches of one call (its layout is the kernel's own). window_state_bytes
  // is its size, checked against what this call needs.
  void* window_state = nullptr;
  size_t window_state_bytes = 0;
};

// Fused tensor-core kernel of the plan (plan.prefill_kernel()): one launch covers every piece and
// the three stages (or the params' key-tile window of them). Grid: one block per (query tile of one
// piece, kv head); a tile's rows are (token, q head of the kv head's group) pairs, so each K/V tile
// read through the page table serves the whole GQA group. INVALID_ARGUMENT for a bad window (not
// 0 <= key_tile_begin < key_tile_end, or key_tile_end 0), for a partial window without a large
// enough window_state, and for a partial window on a plan whose kernel does not take windows.
absl::Status LaunchDcaPrefill(const CudaKernelPlan& plan, const CudaPrefillParams& params,
                              cudaStream_t stream);
// Whether the plan's prefill kernel takes key-tile windows (both the wgmma and the mma.sync
// kernel do; kept as a question so that a kernel without them can join the plan).
bool PrefillTakesWindows(const CudaKernelPlan& plan);
// The most key tiles any block of the call (start, num_tokens) visits: windows of w tiles cover the
// call in ceil(PrefillKeyTiles / w) launches. The tile size is the plan's kernel's (128 keys for
// wgmma, 64 for mma.sync).
int64_t PrefillKeyTiles(const CudaKernelPlan& plan, const DcaGeometry& geometry, int64_t start,
                        int64_t num_tokens);
// Keys per key tile of the plan's prefill kernel.
int32_t PrefillKeyTileKeys(const CudaKernelPlan& plan);
// Bytes of window_state a windowed call of num_tokens tokens needs at any start (an upper bound
// over starts); 0 when the plan's kernel takes no windows.
size_t PrefillWindowStateBytes(const CudaKernelPlan& plan, const DcaGeometry& geometry,
                               int64_t num_tokens);

// ---- Decode ------------------------------------------------------------------------------------

// One decode step for a batch of sequences of mixed lengths. Launch configuration depends only on
// (batch, max_splits) and the plan: lengths are read from device memory, so a captured CUDA graph
// can be replayed for other lengths up to the planned maximum. KvT = Int8Kv or Fp8E4m3 reads a
// pool of scaled codes (codes and scales).
template <typename KvT>
struct CudaDecodeParamsOf {
  PagedKvBatchOf<KvT> kv;
  const int32_t* lengths = nullptr;  // [batch] L incl. the new token (appended); 0 = padding, out 0
  const Bf16* q = nullptr;  // [batch, 3, num_q_heads, head_dim]: intra, succ, inter; unscaled
  void* out = nullptr;      // [batch, num_q_heads, head_dim] of out_dtype
  DType out_dtype = DType::kFp32;
  int32_t batch = 0;
  int32_t max_splits = 1;  // from CudaKernelPlan::DecodeSplits
  // The batch size the launch is planned for (>= batch; 0 = batch): the ring depth is
  // plan.DecodeStages(planned_batch), so a padded size's eager launch runs its graph's kernel.
  int32_t planned_batch = 0;
  float* partial_out = nullptr;  // [batch, num_q_heads, max_splits, head_dim] workspace
  float* partial_lse = nullptr;  // [batch, num_q_heads, max_splits] workspace
  // [batch] or null: a row whose entry has an out pointer is written there ([num_q_heads,
  // head_dim] of its dtype) instead of into `out` (the stage kernel fills it each step, so a
  // captured graph serves any mix). Ignored by the reference kernel.
  const DecodeRowOut* row_outs = nullptr;
};
using CudaDecodeParams = CudaDecodeParamsOf<Bf16>;

// Split-K (flash-decoding) kernel, grid (max_splits, num_kv_heads, batch): each block walks its key
// range (64-key tiles, page indices loaded a tile ahead, a plan.DecodeStages(batch)-deep cp.async
// ring) with the group's q heads as the M dimension of mma tiles; then a reduction kernel, grid
// (batch, num_q_heads), merges the splits by log-sum-exp. With max_splits 1 there is nothing to
// merge: the split kernel stores the outputs itself (as the reduction would) and no reduction runs.
// The int8 and fp8 kernels (plan built with that kv_dtype) copy each tile's codes and scales with
// cp.async (half the bytes of bf16) and compute on the codes' exact values in fp16 (every int8 and
// every E4M3 value is an fp16): Q K^T with the query in fp16 (each row scaled by a power of two
// into fp16's range) and each key's K scale applied to its score after the mma; P V over the codes
// with each key's V scale folded into its fp16 weight (fp8: the codes times 2^-6, exact, and the
// weights times 2^6, which keeps weights of small V scales out of fp16's subnormals). So they round
// q and the weights to fp16 (11 bits) where the bf16 kernel rounds q, K, V and the weights to bf16
// (8 bits): closer to the CPU engine's fp32 over the same codes than bf16 over the dequantised
// values is. V scales are bounded by fp16's range: |v| up to about 8e6 (65504 * 127) for int8,
// 4.5e5 (65504 * 448 / 64) for fp8.
absl::Status LaunchDcaDecode(const CudaKernelPlan& plan, const CudaDecodeParams& params,
                             cudaStream_t stream);
absl::Status LaunchDcaDecode(const CudaKernelPlan& plan, const CudaDecodeParamsOf<Int8Kv>& params,
                             cudaStream_t stream);
absl::Status LaunchDcaDecode(const CudaKernelPlan& plan, const CudaDecodeParamsOf<Fp8E4m3>& params,
                             cudaStream_t stream);

}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_DCA_CUDA_H_
