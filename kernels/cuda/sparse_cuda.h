// Vertical-slash sparse prefill on NVIDIA GPUs (docs/DCA.md "Vertical-slash sparse
// prefill"), the device twin of kernels/sparse_prefill_cpu.h: same pieces, same estimation, same
// top-k tie rules, same stage mapping and fallbacks, same 64x64 converter, attention over the same
// key sets. One call = one sequence, one layer; everything is enqueued on one stream with no host
// synchronisation (the per-piece plan is host arithmetic over the host-side budgets).
//
// Per piece of the prefill loop (SplitIntoPieces), kernels in stream order:
//   1. estimation, two passes over the keys [0, end) in 2048-key segments (grid segments x q heads,
//      mma.sync bf16, fp32 softmax): pass 1 row max / sum per segment, a combine kernel, pass 2 the
//      normalised probabilities -> vertical column sums (plain stores) and slash diagonal sums
//      (shared-memory atomics, then one global atomic per anchor and segment). [H, 64, L] is never
//      stored; the scores are [H, L] fp32.
//   2. top-k: one 1024-thread block per (q head, vertical|slash): exact 4 x 8-bit radix select on
//      the fp32 bits, then an ordered compaction (cub::BlockScan) with the CPU's tie rules
//      (verticals prefer the smaller index, slashes the larger anchor), indices ascending.
//   3. stage mapping with the fallbacks (one block per q head).
//   4. the converter: one thread per (q head, stage, 64-row block) walks the offsets exactly as
//      ConvertVerticalSlash does and stores the block starts. Columns are not copied per row block:
//      a row block's key set is its blocks plus the stage's whole column list minus the columns
//      that lie inside its blocks (the CPU converter drops exactly those, and for the causal intra
//      stage also columns right of its last band, which are future keys the causal mask removes
//      anyway).
//   5. block-sparse attention, grid (64-row blocks, q heads), 4 warps x 16 rows, mma.sync bf16 with
//      fp32 online softmax; walks inter, succ and intra tiles (block tiles, then 64-column gathers)
//      with each stage's query variant in one launch; K/V read through the page table (cp.async,
//      double-buffered), by kv head (GQA, no repeat). A row with no key writes zeros.
// Supported: head_dim 64 or 128, group size 1..16, num_q_heads <= kMaxSparseHeads, bf16 KV / q.
#ifndef ATTND_KERNELS_CUDA_SPARSE_CUDA_H_
#define ATTND_KERNELS_CUDA_SPARSE_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/dca.h"
#include "kernels/vertical_slash.h"

namespace attnd {

inline constexpr int kMaxSparseHeads = 64;
inline constexpr int32_t kDefaultRowBlockSlice = 512;  // 32768 query rows

// Everything one sparse prefill call needs. `prefill` is the dense call's parameters (variant is
// ignored); budgets are HOST memory, [num_q_heads], vertical 30 already read as 130 (the layer's
// SparseAttentionConfig::layer()). workspace: device memory of at least
// SparsePrefillWorkspaceBytes(...) bytes (256-byte aligned), reused by every piece.
struct SparsePrefillParams {
  CudaPrefillParams prefill;
  absl::Span<const VsBudget> budgets;
  int64_t last_q = 64;  // sparse_attention_last_q (>= 1)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // The converter and the attention run over slices of this many 64-row blocks of a piece (the
  // block lists are stored per slice, so the workspace scales with it); >= 1.
  int32_t row_block_slice = kDefaultRowBlockSlice;
};

// Device bytes the call for (start, num_tokens) with these budgets needs. Host arithmetic only;
// monotone in the budgets, so the element-wise maximum of all layers' budgets sizes one
// workspace for every layer. Terms: 2 x Hq x (start + num_tokens) fp32 scores; the converter's
// block lists, sized for the worst case of every (head, stage, row block of a slice):
// min(#offsets + 1, ceil(kv_len / 64) + 1) int32 block starts; column masks (one bit per
// (column, row block of a slice)); small selection / stage lists. 0 when the inputs are invalid
// (the launch then says why).
size_t SparsePrefillWorkspaceBytes(const DcaGeometry& geometry, absl::Span<const VsBudget> budgets,
                                   int64_t start, int64_t num_tokens, int64_t last_q,
                                   int32_t row_block_slice = kDefaultRowBlockSlice);

// An upper bound of SparsePrefillWorkspaceBytes over every call with start + num_tokens <=
// max_length and num_tokens <= max_tokens (any start, including mid-chunk): what an engine
// allocates once for all its calls (take the maximum over layers, or pass the element-wise maximum
// of all layers' budgets). Host arithmetic only; 0 for invalid inputs.
size_t SparsePrefillWorkspaceBound(const DcaGeometry& geometry, absl::Span<const VsBudget> budgets,
                                   int64_t max_length, int64_t max_tokens, int64_t last_q,
                                   int32_t row_block_slice = kDefaultRowBlockSlice);

// Enqueues the sparse prefill (all pieces) on `stream`. K/V of the new tokens must already be
// appended (LaunchAppendKv). INVALID_ARGUMENT for unsupported shapes or a short workspace,
// INTERNAL when a launch fails.
absl::Status LaunchSparsePrefill(const DcaGeometry& geometry, const SparsePrefillParams& params,
                                 cudaStream_t stream);

// One piece in steps, for a caller whose q and out buffers hold only some of the call's rows (the
// CUDA engine stages a large call through fixed buffers): LaunchSparseEstimate once per piece
// (steps 1-3; the pattern stays in the workspace), then LaunchSparseAttendRows over the piece's
// rows in any order and any split into whole 64-row blocks (steps 4-5). Every row gets what
// LaunchSparsePrefill gives it for a call that contains the whole piece, bit for bit: the same
// kernels on the same inputs per row block. K/V of the whole piece, [0, piece.end), must be
// appended before the estimate. Here params.prefill.q / out hold rows for positions
// [prefill.start, prefill.start + prefill.num_tokens) (not necessarily the call's start), and the
// workspace must hold SparsePrefillWorkspaceBytes(geometry, budgets, piece.begin, piece.end -
// piece.begin, last_q, row_block_slice) bytes, which SparsePrefillWorkspaceBound(max_length,
// max_tokens = row_block_slice * 64) covers for every piece up to max_length.
// The estimate reads q rows [piece.end - min(piece rows, last_q), piece.end).
absl::Status LaunchSparseEstimate(const DcaGeometry& geometry, const SparsePrefillParams& params,
                                  const VsPiece& piece, cudaStream_t stream);
// Rows [first_row, first_row + num_rows) of the piece (0 = piece.begin): first_row a multiple of
// 64, num_rows too unless the range ends the piece. Reads their q, writes their out.
absl::Status LaunchSparseAttendRows(const DcaGeometry& geometry, const SparsePrefillParams& params,
                                    const VsPiece& piece, int64_t first_row, int64_t num_rows,
                                    cudaStream_t stream);

// For benchmarks: the same launch, recording events on the stream at piece i's stage boundaries
// (i < max_pieces; null arrays record nothing). Attention runs from index_end[i] to the end of
// the piece.
struct SparsePrefillTimers {
  cudaEvent_t* estimate_begin = nullptr;  // [pieces] recorded before each piece's estimation
  cudaEvent_t* estimate_end = nullptr;    // [pieces] after estimation + top-k
  cudaEvent_t* index_end = nullptr;       // [pieces] after stage mapping
  int max_pieces = 0;
  // Around each converter launch (one per slice of each piece, in launch order), up to
  // max_converts of them.
  cudaEvent_t* convert_begin = nullptr;
  cudaEvent_t* convert_end = nullptr;
  int max_converts = 0;
  // Optional device counters the attention adds to: [0] 64-key tiles attended (blocks + column
  // gathers, all heads and row blocks), [1] the column gathers among them.
  unsigned long long* tile_stats = nullptr;
};
absl::Status LaunchSparsePrefillTimed(const DcaGeometry& geometry,
                                      const SparsePrefillParams& params,
                                      const SparsePrefillTimers& timers, cudaStream_t stream);

// Where the last piece's intermediate results live inside the workspace (for tests; valid after
// the call's work has finished). All device pointers; rows of the per-head arrays are strided.
struct SparseDebugView {
  const float* vertical_scores = nullptr;  // [Hq][score_stride] (entries [0, end))
  const float* slash_scores = nullptr;     // [Hq][score_stride]
  int64_t score_stride = 0;
  const int32_t* vertical = nullptr;  // [Hq][vertical_stride], min(V_h, end) entries ascending
  const int32_t* slash = nullptr;     // [Hq][slash_stride], min(S_h, end) entries ascending
  int64_t vertical_stride = 0, slash_stride = 0;
  const int32_t* stage_columns = nullptr;  // [Hq][3][vertical_stride]
  const int32_t* stage_offsets = nullptr;  // [Hq][3][slash_stride]
  const int32_t* stage_counts = nullptr;   // [Hq][3][2]: columns, offsets (0, 0 if absent)
  const int32_t* block_counts = nullptr;   // [Hq][3][row_blocks]
  const int32_t* blocks = nullptr;         // block starts of (h, s, m) at block_base[h*3+s] + m*cap
  std::vector<int64_t> block_base;         // [Hq * 3]
  std::vector<int32_t> block_cap;          // [Hq * 3]
  int64_t row_blocks = 0;                  // of the last slice of the last piece
  int64_t rb_offset = 0;                   // its first row block
  // Bit i of (h, s, m) at column_masks + mask_base[h] + (s * row_blocks + m) * mask_words[h]:
  // stage column i lies inside one of the row block's blocks (the attention skips it).
  const uint32_t* column_masks = nullptr;
  std::vector<int64_t> mask_base;   // [Hq]
  std::vector<int32_t> mask_words;  // [Hq]
};
// The view for a call with these inputs (the last slice of the last piece of
// SplitIntoPieces(start, num_tokens)).
SparseDebugView SparseDebugViewOf(const DcaGeometry& geometry, const SparsePrefillParams& params);

}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_SPARSE_CUDA_H_
