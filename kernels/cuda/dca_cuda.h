// Dense dual chunk attention on NVIDIA GPUs (Hopper first): KV append, fused prefill and split-K
// paged decode over one layer of a bf16 paged KV pool (kvcache/kv_layout.h, kernels/paged_kv.h).
// Semantics: docs/DCA.md ("Dense prefill", "Decode", "Length scaling").
//
// Plain C++ header: device code lives in dca_cuda_kernels.cuh, included by dca_cuda.cu only.
// Every pointer in these Params structs is DEVICE memory unless it says otherwise. Launch functions
// only enqueue work on `stream` (no host synchronisation) and return INTERNAL when a launch fails,
// INVALID_ARGUMENT for shapes outside the supported set (CheckCudaGeometry).
//
// Supported set (one dispatch per kernel family): head_dim 64 or 128; group size (Hq / Hkv) 1..16;
// bf16 KV. Query tensors are bf16; outputs are bf16, fp16 or fp32.
//
// The default prefill is a warp-specialised wgmma kernel (prefill_wgmma.cuh), with an mma.sync
// fallback; decode is split-K over the page table. How fast each is, against which peer, is in
// docs/BENCHMARKS.md ("CUDA backend"); the tuning history is in bench/gpu/NOTES.md. Numbers are
// kept there, not here, so that they have one home and a date.
#ifndef ATTND_KERNELS_CUDA_DCA_CUDA_H_
#define ATTND_KERNELS_CUDA_DCA_CUDA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "base/dtype.h"
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

// ---- KV append ---------------------------------------------------------------------------------

// Prefill append: tokens start .. start+num_tokens-1 of one sequence; keys are stored as
// key_scale * k, rounded once to bf16 (k/v may be bf16, fp16 or fp32).
struct CudaAppendParams {
  PagedKv<Bf16> kv;         // one layer; kv.page_table in device memory
  const void* k = nullptr;  // [num_tokens, num_kv_heads, head_dim] of in_dtype, unscaled
  const void* v = nullptr;  // [num_tokens, num_kv_heads, head_dim] of in_dtype
  DType in_dtype = DType::kBf16;
  int64_t start = 0;
  int64_t num_tokens = 0;
  float key_scale = 1.f;  // s(prompt_len)
};
absl::Status LaunchAppendKv(const CudaAppendParams& params, cudaStream_t stream);

// Decode append: one new token per sequence at position lengths[b] - 1, key stored as s(L) * k
// with L = lengths[b] (computed on the device from original_max_position_embeddings).
struct CudaDecodeAppendParams {
  PagedKvBatch kv;
  const int32_t* lengths = nullptr;  // [batch] L including the new token; 0 = padding row, skipped
  const void* k = nullptr;           // [batch, num_kv_heads, head_dim] of in_dtype, unscaled
  const void* v = nullptr;           // [batch, num_kv_heads, head_dim] of in_dtype
  DType in_dtype = DType::kBf16;
  int32_t batch = 0;
  int64_t original_max_position_embeddings = 0;
};
absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParams& params, cudaStream_t stream);

// Decode staging: one kernel that takes a decode step's inputs straight from pinned host memory
// (read over the bus through its mapped address: no copies to launch or wait for) and leaves what
// the decode kernels read in device memory. Per row r with length L = rows[r].length >= 1:
//   page_tables (device, kv.page_tables at kv.page_table_stride) row r <- host_tables row r
//     (the first rows[r].num_pages entries; host_tables has the same stride);
//   q (device bf16 [batch, 3, num_q_heads, head_dim]) row r <- the first 3 query variants of
//     host_q + r * q_row_bytes, in rows[r].q_dtype;
//   the new token at position L - 1 appended as LaunchDecodeAppendKv does (key scaled by s(L)),
//     from host_k / host_v + r * kv_row_bytes in rows[r].k_dtype / v_dtype, through the host table;
//   lengths[r] <- L.
// A row with L = 0 (padding of a captured batch size) only gets lengths[r] = 0. Every field is
// read on the device, so a captured graph of this kernel serves any lengths, tables and dtypes.
// Requires 16-byte aligned pointers, a page-table stride that is a multiple of 4, head_dim a
// multiple of 8, and slots of at least fp32 rows, 16-byte multiples (INVALID_ARGUMENT otherwise).
struct DecodeStageRow {
  int32_t length = 0;
  int32_t num_pages = 0;
  int32_t q_dtype = 0;  // static_cast<int32_t>(DType)
  int32_t k_dtype = 0;
  int32_t v_dtype = 0;
  // 1: a pre-rotary row (rotary_cuda.h, LaunchDecodeRotary): its q slot holds q [Hq, D] and its k
  // slot k [Hkv, D], both before the rotary, in q_dtype / k_dtype. The rotary kernel, launched
  // before this one, wrote the row's three bf16 variants into `q` and its rotated key as fp32 into
  // the k slot, so the stage leaves q alone and reads k as fp32.
  int32_t rotary = 0;
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
  int32_t* lengths = nullptr;  // device [batch]
  Bf16* q = nullptr;           // device [batch, 3, num_q_heads, head_dim]
  int32_t num_q_heads = 0;
  int32_t batch = 0;
  int64_t original_max_position_embeddings = 0;
};
absl::Status LaunchDecodeStage(const CudaDecodeStageParams& params, cudaStream_t stream);

// dst[i] = bf16(src[i]) for n elements (src bf16, fp16 or fp32).
absl::Status LaunchConvertToBf16(const void* src, DType src_dtype, int64_t n, Bf16* dst,
                                 cudaStream_t stream);

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
  // Tuning variant of the fast kernel (tests and benchmarks sweep it): -1 = the default
  // (kDefaultPrefillVariant), else an index into kPrefillVariants.
  int32_t variant = -1;
};

// mma.sync: query rows per block = 16 * m_tiles * warps (each warp owns m_tiles 16-row mma tiles,
// reusing every K/V fragment m_tiles times); wgmma: 128 rows (two consumer warpgroups of 64). K/V
// tiles of block_n keys in a `stages`-deep cp.async ring.
// kernel: which fused kernel runs the variant:
//   kPrefillMmaSync      mma.sync m16n8k16 (HMMA), any CUDA GPU this library targets;
//   kPrefillWgmma        Hopper wgmma (sm_90a; prefill_wgmma.cuh): two warpgroups of 64 rows,
//                        m_tiles = 1; warps = 8: all threads issue the K/V cp.async ring, one
//                        __syncthreads per tile; warps = 12: warp-specialised, a third
//                        warpgroup produces K/V tiles and hands them over through mbarriers;
//   kPrefillWgmmaOverlap the same, with the S wgmma of tile j issued beside the P·V wgmma of tile
//                        j-1 so the softmax overlaps the tensor cores (stages >= 3); with
//                        warps = 12 the two consumer warpgroups also take turns (ping-pong);
//   kPrefillWgmmaAsync   warps = 12 with an asynchronous producer (prefill_wgmma.cuh,
//                        kOptAsyncProducer): all page-table reads of a tile issued up front
//                        (shift/mask for power-of-two pages), each tile published by
//                        cp.async.mbarrier.arrive as its copies land (the producer never waits for
//                        its own copies), registers 56 / 224 so that nothing spills;
//   kPrefillWgmmaAsyncOverlap  the same plus the intra-warpgroup overlap, without ping-pong;
//   kPrefillWgmmaAsyncPingPong the same plus the intra-warpgroup overlap and the ping-pong;
//   kPrefillWgmmaAsyncLate     kPrefillWgmmaAsyncOverlap with FA3's order inside an iteration
//                        (O rescaled after the next S wgmma is issued, not before).
// A wgmma variant asked for on a GPU other than compute capability 9.0 runs the mma.sync variant
// kFallbackPrefillVariant instead (same results within the bf16 bars; the wgmma code only exists
// as sm_90a machine code). All variants handle every shape CheckCudaGeometry accepts.
inline constexpr int32_t kPrefillMmaSync = 0;
inline constexpr int32_t kPrefillWgmma = 1;
inline constexpr int32_t kPrefillWgmmaOverlap = 2;
inline constexpr int32_t kPrefillWgmmaAsync = 3;
inline constexpr int32_t kPrefillWgmmaAsyncOverlap = 4;
inline constexpr int32_t kPrefillWgmmaAsyncPingPong = 5;
inline constexpr int32_t kPrefillWgmmaAsyncLate = 6;
struct PrefillVariant {
  int32_t warps;
  int32_t stages;
  int32_t m_tiles;
  int32_t block_n;
  int32_t kernel = kPrefillMmaSync;
};
inline constexpr PrefillVariant kPrefillVariants[] = {{4, 2, 1, 64},
                                                      {8, 2, 1, 64},
                                                      {8, 3, 1, 64},
                                                      {4, 2, 2, 32},
                                                      {4, 3, 2, 32},
                                                      {4, 2, 2, 64},
                                                      {8, 2, 1, 128, kPrefillWgmma},
                                                      {8, 3, 1, 128, kPrefillWgmmaOverlap},
                                                      {8, 4, 1, 64, kPrefillWgmmaOverlap},
                                                      {12, 3, 1, 128, kPrefillWgmma},
                                                      {12, 3, 1, 128, kPrefillWgmmaOverlap},
                                                      {12, 3, 1, 128, kPrefillWgmmaAsync},
                                                      {12, 3, 1, 128, kPrefillWgmmaAsyncOverlap},
                                                      {12, 3, 1, 128, kPrefillWgmmaAsyncPingPong},
                                                      {12, 3, 1, 128, kPrefillWgmmaAsyncLate}};
inline constexpr int kNumPrefillVariants = 15;
inline constexpr int kFallbackPrefillVariant = 5;  // {4, 2, 2, 64}: fastest mma.sync (NOTES.md)
// {12, 3, 1, 128} warp-specialised wgmma with the asynchronous producer, softmax/P.V overlap and
// ping-pong between the consumer warpgroups: the fastest variant measured on the H200
// (docs/BENCHMARKS.md, bench/gpu/NOTES.md) and within the bf16 bars in every test.
inline constexpr int kDefaultPrefillVariant = 13;
inline constexpr int kDefaultDecodeStages = 2;

// Fused tensor-core kernel: one launch covers every piece and the three stages. Grid: one block per
// (query tile of one piece, kv head); a tile's 128 rows (64 for variant 0) are
// (token, q head of the kv head's group) pairs, so each K/V tile read through the page table serves
// the whole GQA group. INVALID_ARGUMENT for a variant outside kPrefillVariants. The default (a
// wgmma variant) runs kFallbackPrefillVariant on GPUs other than compute capability 9.0.
absl::Status LaunchDcaPrefill(const DcaGeometry& geometry, const CudaPrefillParams& params,
                              cudaStream_t stream);
// Simple reference kernel (one warp per query row, scalar fp32, no tiling). Slow; for tests.
absl::Status LaunchDcaPrefillReference(const DcaGeometry& geometry, const CudaPrefillParams& params,
                                       cudaStream_t stream);

// ---- Decode ------------------------------------------------------------------------------------

// One decode step for a batch of sequences of mixed lengths. Launch configuration depends only on
// (batch, num_kv_heads, max_splits): lengths are read from device memory, so a captured CUDA graph
// can be replayed for other lengths up to the planned maximum.
struct CudaDecodeParams {
  PagedKvBatch kv;
  const int32_t* lengths = nullptr;  // [batch] L incl. the new token (appended); 0 = padding, out 0
  const Bf16* q = nullptr;  // [batch, 3, num_q_heads, head_dim]: intra, succ, inter; unscaled
  void* out = nullptr;      // [batch, num_q_heads, head_dim] of out_dtype
  DType out_dtype = DType::kFp32;
  int32_t batch = 0;
  int32_t max_splits = 1;        // from PlanDecodeSplits
  float* partial_out = nullptr;  // [batch, num_q_heads, max_splits, head_dim] workspace
  float* partial_lse = nullptr;  // [batch, num_q_heads, max_splits] workspace
  // cp.async stages of the split kernel: 0 = the default, else 2 or 4 (tests/benchmarks sweep it).
  // Ignored when `variant` >= 0.
  int32_t kv_stages = 0;
  // Decode kernel variant (tests/benchmarks sweep it): -1 = chosen by kv_stages (0: the default,
  // DefaultDecodeVariant(batch); 2: variant 0; 4: variant 1), else an index into kDecodeVariants.
  int32_t variant = -1;
};

// Decode kernel families (kDecodeVariants[i].kernel):
//   kDecodeSplit      DcaDecodeSplitKernel: K/V tiles of 64 keys in padded rows, one page-table
//                     lookup per row right before its copies, two barriers per tile;
//   kDecodePipelined  DcaDecodePipeKernel with 16-byte cp.async: 16 * warps keys per tile in
//                     XOR-swizzled (unpadded) rows, page indices loaded one tile ahead, one barrier
//                     per tile, the GQA group's queries kept compact (3 * group rows + a zero row);
//   kDecodeBulk       the same kernel with one cp.async.bulk per K or V row (head_dim * 2 bytes)
//                     into padded rows, completing on an mbarrier per ring slot.
// All variants take the same workspace and produce the same results within the bf16 bars; the
// launch configuration depends only on (batch, num_kv_heads, max_splits, the geometry).
inline constexpr int32_t kDecodeSplit = 0;
inline constexpr int32_t kDecodePipelined = 1;
inline constexpr int32_t kDecodeBulk = 2;
struct DecodeVariant {
  int32_t warps;   // keys per tile = 16 * warps
  int32_t stages;  // ring depth
  int32_t kernel;
};
inline constexpr DecodeVariant kDecodeVariants[] = {
    {4, 2, kDecodeSplit},     {4, 4, kDecodeSplit},     {4, 2, kDecodePipelined},
    {4, 3, kDecodePipelined}, {4, 4, kDecodePipelined}, {8, 2, kDecodePipelined},
    {4, 3, kDecodeBulk},      {8, 2, kDecodeBulk}};
inline constexpr int kNumDecodeKernelVariants = 8;
// The default (kv_stages 0, variant -1) depends on the batch, as measured on the H200
// (bench/gpu/NOTES.md, "Decode variants"; docs/BENCHMARKS.md): {4, 2, pipelined} while every
// (sequence, kv head) block fits one wave at that variant's occupancy, {4, 3, pipelined} past it,
// where the 2-stage ring no longer keeps enough bytes in flight.
inline constexpr int kDefaultDecodeVariant = 2;
inline constexpr int kDefaultLargeBatchDecodeVariant = 3;
// The default variant for `batch` sequences on `num_sms` multiprocessors (host arithmetic).
int32_t DefaultDecodeVariant(const DcaGeometry& geometry, int32_t batch, int32_t num_sms);
// The variant a (kv_stages, variant) pair of CudaDecodeParams selects, or -1 when unsupported;
// (0, -1) gives kDefaultDecodeVariant here (the batch-aware choice is DefaultDecodeVariant's).
int32_t ResolveDecodeVariant(int32_t kv_stages, int32_t variant);

// Split-K plan for the decode variant that (kv_stages, variant) selects (as in CudaDecodeParams;
// both defaulted = DefaultDecodeVariant(batch)): as many splits as keep every (batch x kv head x
// split) block resident in one wave on `num_sms` multiprocessors, at least 1, with at least 256
// keys per split at max_length. Host-only arithmetic (shared memory and threads per block).
int32_t PlanDecodeSplits(const DcaGeometry& geometry, int32_t batch, int64_t max_length,
                         int32_t num_sms, int32_t kv_stages = 0, int32_t variant = -1);
// Workspace floats needed for (batch, max_splits): partial_out then partial_lse.
size_t DecodeWorkspaceFloats(const DcaGeometry& geometry, int32_t batch, int32_t max_splits);

// Split-K (flash-decoding) kernel, grid (max_splits, num_kv_heads, batch): each block walks its key
// range with the group's q heads as the M dimension of mma tiles, then a reduction kernel, grid
// (batch, num_q_heads), merges the splits by log-sum-exp.
absl::Status LaunchDcaDecode(const DcaGeometry& geometry, const CudaDecodeParams& params,
                             cudaStream_t stream);
// Simple reference kernel (one warp per (sequence, q head), scalar fp32). Ignores the workspace.
absl::Status LaunchDcaDecodeReference(const DcaGeometry& geometry, const CudaDecodeParams& params,
                                      cudaStream_t stream);

}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_DCA_CUDA_H_
