// Launch side of sparse_cuda.h: the workspace layout, the per-piece plan (host arithmetic over the
// host-side budgets) and the kernel sequence of each piece.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/head_dim.h"
#include "kernels/cuda/sparse_cuda.h"
#include "kernels/cuda/sparse_cuda_kernels.cuh"

namespace attnd {
namespace {

namespace sk = sparse_kernels;

// The prefill loop's pieces are vertical_slash.h's (SplitIntoPieces).
using Piece = VsPiece;

constexpr size_t Align(size_t x) { return (x + 255) / 256 * 256; }

// Block-list capacity of (h, s) in a piece: the converter emits at most one block per offset it
// consumes, and its blocks are disjoint 64-key blocks starting inside [0, kv_len).
struct PiecePlan {
  int64_t row_blocks = 0;
  int64_t slice_row_blocks = 0;
  int64_t base[kMaxSparseHeads * 3] = {};
  int32_t cap[kMaxSparseHeads * 3] = {};
  int64_t total = 0;  // int32 entries
  // Column masks: ceil(column capacity / 32) words per (h, s, row block).
  int64_t mask_base[kMaxSparseHeads] = {};
  int32_t mask_words[kMaxSparseHeads] = {};
  int64_t mask_total = 0;  // uint32 words
};

// row_blocks: the piece's; slice_row_blocks: the storage per (h, s) (min(row_blocks, slice)).
PiecePlan PlanPiece(const DcaGeometry& g, absl::Span<const VsBudget> budgets, const Piece& p,
                    int32_t slice) {
  PiecePlan plan;
  const int64_t cl = g.chunk_len;
  const int64_t nq = p.end - p.begin;
  plan.row_blocks = (nq + sk::kRows - 1) / sk::kRows;
  plan.slice_row_blocks = std::min<int64_t>(plan.row_blocks, slice);
  for (int h = 0; h < g.num_q_heads; ++h) {
    const int64_t n_offsets = std::max<int64_t>(std::min<int64_t>(budgets[h].slash, p.end), 5);
    for (int s = 0; s < 3; ++s) {
      const bool present = s == 0 || (s == 1 ? p.prev >= cl : p.prev >= 2 * cl);
      const int64_t kv_len = s == 0 ? p.end - p.prev : (s == 1 ? cl : p.prev - cl);
      const int64_t cap =
          present ? std::min(n_offsets + 1, (kv_len + sk::kRows - 1) / sk::kRows + 1) : 0;
      plan.base[h * 3 + s] = plan.total;
      plan.cap[h * 3 + s] = static_cast<int32_t>(cap);
      plan.total += cap * plan.slice_row_blocks;
    }
    const int64_t n_columns = std::max<int64_t>(std::min<int64_t>(budgets[h].vertical, p.end), 5);
    plan.mask_words[h] = static_cast<int32_t>((n_columns + 31) / 32);
    plan.mask_base[h] = plan.mask_total;
    plan.mask_total += 3 * plan.slice_row_blocks * plan.mask_words[h];
  }
  return plan;
}

struct Layout {
  int64_t length = 0;  // start + num_tokens: every piece's end is <= it
  int64_t vstride = 0, sstride = 0;
  int64_t max_segments = 0, max_row_blocks = 0, max_blocks = 0, max_masks = 0;
  size_t vscore = 0, sscore = 0, partial = 0, rowstat = 0, vsel = 0, ssel = 0, stage_cols = 0,
         stage_offs = 0, stage_counts = 0, block_counts = 0, blocks = 0, col_masks = 0, total = 0;
};

Layout MakeLayout(const DcaGeometry& g, absl::Span<const VsBudget> budgets, int64_t start,
                  int64_t num_tokens, int32_t slice) {
  Layout l;
  const int64_t hq = g.num_q_heads;
  l.length = start + num_tokens;
  for (int h = 0; h < hq; ++h) {
    l.vstride = std::max(l.vstride, std::max<int64_t>(std::min(budgets[h].vertical, l.length), 5));
    l.sstride = std::max(l.sstride, std::max<int64_t>(std::min(budgets[h].slash, l.length), 5));
  }
  for (const Piece& p : SplitIntoPieces(start, num_tokens, g.chunk_len)) {
    const PiecePlan plan = PlanPiece(g, budgets, p, slice);
    l.max_segments = std::max(l.max_segments, (p.end + sk::kEstSegment - 1) / sk::kEstSegment);
    l.max_row_blocks = std::max(l.max_row_blocks, plan.slice_row_blocks);
    l.max_blocks = std::max(l.max_blocks, plan.total);
    l.max_masks = std::max(l.max_masks, plan.mask_total);
  }
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += Align(bytes);
    return at;
  };
  l.vscore = take(hq * l.length * sizeof(float));
  l.sscore = take(hq * l.length * sizeof(float));
  l.partial = take(hq * l.max_segments * sk::kRows * 2 * sizeof(float));
  l.rowstat = take(hq * sk::kRows * 2 * sizeof(float));
  l.vsel = take(hq * l.vstride * sizeof(int32_t));
  l.ssel = take(hq * l.sstride * sizeof(int32_t));
  l.stage_cols = take(hq * 3 * l.vstride * sizeof(int32_t));
  l.stage_offs = take(hq * 3 * l.sstride * sizeof(int32_t));
  l.stage_counts = take(hq * 3 * 2 * sizeof(int32_t));
  l.block_counts = take(hq * 3 * l.max_row_blocks * sizeof(int32_t));
  l.blocks = take(l.max_blocks * sizeof(int32_t));
  l.col_masks = take(l.max_masks * sizeof(uint32_t));
  l.total = off;
  return l;
}

absl::Status Check(const DcaGeometry& g, const SparsePrefillParams& sp) {
  if (absl::Status s = CheckCudaGeometry(g); !s.ok()) return s;
  const CudaPrefillParams& p = sp.prefill;
  if (g.num_q_heads > kMaxSparseHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse: ", g.num_q_heads, " q heads > ", kMaxSparseHeads));
  }
  if (static_cast<int64_t>(sp.budgets.size()) != g.num_q_heads) {
    return absl::InvalidArgumentError("sparse: budgets must have num_q_heads entries");
  }
  for (const VsBudget& b : sp.budgets) {
    if (b.vertical < 1 || b.slash < 1 || b.vertical > INT32_MAX || b.slash > INT32_MAX) {
      return absl::InvalidArgumentError("sparse: budgets must be >= 1");
    }
  }
  if (sp.row_block_slice < 1) {
    return absl::InvalidArgumentError("sparse: row_block_slice must be >= 1");
  }
  if (sp.last_q < 1 || sp.last_q > sk::kRows) {
    return absl::InvalidArgumentError(absl::StrCat("sparse: last_q ", sp.last_q, " not in 1..64"));
  }
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.page_table == nullptr || p.q == nullptr ||
      p.out == nullptr || p.kv.num_kv_heads != g.num_kv_heads || p.kv.head_dim != g.head_dim ||
      p.kv.page_size <= 0) {
    return absl::InvalidArgumentError("sparse: null pointer or KV shape mismatch");
  }
  if (!IsKnownDType(p.out_dtype)) {
    return absl::InvalidArgumentError("sparse: bad out_dtype");
  }
  if (p.start < 0 || p.num_tokens < 1 || p.start + p.num_tokens > INT32_MAX / 2) {
    return absl::InvalidArgumentError("sparse: bad token range");
  }
  return absl::OkStatus();
}

// The kernels' dynamic shared-memory limits, set once per device (function attributes are
// per device): the first launch on a device sets them, later launches only enqueue.
template <int D>
constexpr size_t EstimateSmemBytes() {
  return 2 * sk::kTileN * (D + 8) * sizeof(Bf16) +
         (4 * sk::kTileN + sk::kEstSegment + sk::kTileN) * sizeof(float);
}
template <int D>
constexpr size_t AttendSmemBytes() {
  return 4 * sk::kTileN * (D + 8) * sizeof(Bf16) + 2 * sk::kTileN * sizeof(int32_t);
}
template <int D>
absl::Status PrepareKernelsOnce() {
  static std::atomic<uint64_t> prepared{0};  // bit d: device d is done (devices 0..63)
  int device = 0;
  ATTND_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (prepared.load(std::memory_order_acquire) & bit) != 0) return absl::OkStatus();
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(sk::EstimateKernel<D, false>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  EstimateSmemBytes<D>()));
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(sk::EstimateKernel<D, true>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  EstimateSmemBytes<D>()));
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      sk::AttendKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, AttendSmemBytes<D>()));
  prepared.fetch_or(bit, std::memory_order_acq_rel);  // idempotent: a racing second set is harmless
  return absl::OkStatus();
}

// The kernel arguments of one piece (the host plan over the host-side budgets), ~4 KB passed by
// value to every launch of the piece.
sk::PieceArgs MakePieceArgs(const DcaGeometry& g, const SparsePrefillParams& sp, const Layout& l,
                            const PiecePlan& plan, const Piece& piece,
                            const SparsePrefillTimers& timers) {
  const CudaPrefillParams& p = sp.prefill;
  char* ws = static_cast<char*>(sp.workspace);
  sk::PieceArgs a;
  std::memset(&a, 0, sizeof(a));
  a.kv = p.kv;
  a.q = p.q;
  a.out = p.out;
  a.out_dtype = static_cast<int>(p.out_dtype);
  a.start = static_cast<int32_t>(p.start);
  a.begin = static_cast<int32_t>(piece.begin);
  a.end = static_cast<int32_t>(piece.end);
  a.prev = static_cast<int32_t>(piece.prev);
  a.cl = static_cast<int32_t>(g.chunk_len);
  a.hq = g.num_q_heads;
  a.group = g.group_size();
  a.n_est = static_cast<int32_t>(std::min<int64_t>(piece.end - piece.begin, sp.last_q));
  a.num_segments = static_cast<int32_t>((piece.end + sk::kEstSegment - 1) / sk::kEstSegment);
  a.scale_log2 = p.softmax_scale * sk::kLog2e;
  a.vscore = reinterpret_cast<float*>(ws + l.vscore);
  a.sscore = reinterpret_cast<float*>(ws + l.sscore);
  a.score_stride = l.length;
  a.partial = reinterpret_cast<float*>(ws + l.partial);
  a.rowstat = reinterpret_cast<float*>(ws + l.rowstat);
  a.vsel = reinterpret_cast<int32_t*>(ws + l.vsel);
  a.ssel = reinterpret_cast<int32_t*>(ws + l.ssel);
  a.vstride = static_cast<int32_t>(l.vstride);
  a.sstride = static_cast<int32_t>(l.sstride);
  a.stage_cols = reinterpret_cast<int32_t*>(ws + l.stage_cols);
  a.stage_offs = reinterpret_cast<int32_t*>(ws + l.stage_offs);
  a.stage_counts = reinterpret_cast<int32_t*>(ws + l.stage_counts);
  a.block_counts = reinterpret_cast<int32_t*>(ws + l.block_counts);
  a.blocks = reinterpret_cast<int32_t*>(ws + l.blocks);
  a.col_masks = reinterpret_cast<uint32_t*>(ws + l.col_masks);
  a.tile_stats = timers.tile_stats;
  for (int i = 0; i < g.num_q_heads * 3; ++i) {
    a.block_base[i] = plan.base[i];
    a.block_cap[i] = plan.cap[i];
  }
  for (int h = 0; h < g.num_q_heads; ++h) {
    a.mask_base[h] = plan.mask_base[h];
    a.mask_words[h] = plan.mask_words[h];
    a.vbudget[h] = static_cast<int32_t>(sp.budgets[h].vertical);
    a.sbudget[h] = static_cast<int32_t>(sp.budgets[h].slash);
  }
  return a;
}

// Steps 1-3 of a piece: estimation, top-k and stage mapping, into the workspace.
template <int D>
absl::Status LaunchEstimate(const DcaGeometry& g, const Layout& l, const sk::PieceArgs& a,
                            const SparsePrefillTimers& timers, int piece_index,
                            cudaStream_t stream) {
  const bool timed = piece_index < timers.max_pieces;
  if (timed && timers.estimate_begin != nullptr) {
    ATTND_CUDA_RETURN_IF_ERROR(cudaEventRecord(timers.estimate_begin[piece_index], stream));
  }
  // 1. estimation
  ATTND_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      a.sscore, 0, static_cast<size_t>(g.num_q_heads) * l.length * sizeof(float), stream));
  ATTND_RETURN_IF_ERROR(PrepareKernelsOnce<D>());
  constexpr size_t est_smem = EstimateSmemBytes<D>();
  const dim3 est_grid(a.num_segments, g.num_q_heads);
  sk::EstimateKernel<D, false><<<est_grid, sk::kThreads, est_smem, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("EstimateKernel<stats>");
  sk::EstimateCombineKernel<<<g.num_q_heads, sk::kRows, 0, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("EstimateCombineKernel");
  sk::EstimateKernel<D, true><<<est_grid, sk::kThreads, est_smem, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("EstimateKernel<scores>");
  // 2. top-k
  sk::TopKKernel<<<dim3(g.num_q_heads, 2), sk::kTopKThreads, 0, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("TopKKernel");
  if (timed && timers.estimate_end != nullptr) {
    ATTND_CUDA_RETURN_IF_ERROR(cudaEventRecord(timers.estimate_end[piece_index], stream));
  }
  // 3. stages
  sk::MapStagesKernel<<<g.num_q_heads, 256, 0, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("MapStagesKernel");
  if (timed && timers.index_end != nullptr) {
    ATTND_CUDA_RETURN_IF_ERROR(cudaEventRecord(timers.index_end[piece_index], stream));
  }
  return absl::OkStatus();
}

// Steps 4-5 for the piece's row blocks [rb_begin, rb_end): the converter and the attention, per
// slice of row blocks (the block lists are stored per slice). Each row block's result depends on
// the piece's pattern only, never on which launch covers it.
template <int D>
absl::Status LaunchAttend(const DcaGeometry& g, const PiecePlan& plan, sk::PieceArgs a,
                          int64_t rb_begin, int64_t rb_end, const SparsePrefillTimers& timers,
                          int* convert_index, cudaStream_t stream) {
  ATTND_RETURN_IF_ERROR(PrepareKernelsOnce<D>());
  constexpr size_t att_smem = AttendSmemBytes<D>();
  for (int64_t first = rb_begin; first < rb_end; first += plan.slice_row_blocks) {
    a.rb_offset = static_cast<int32_t>(first);
    a.row_blocks = static_cast<int32_t>(std::min(plan.slice_row_blocks, rb_end - first));
    const bool timed_convert = *convert_index < timers.max_converts;
    if (timed_convert && timers.convert_begin != nullptr) {
      ATTND_CUDA_RETURN_IF_ERROR(cudaEventRecord(timers.convert_begin[*convert_index], stream));
    }
    const int64_t walkers = static_cast<int64_t>(g.num_q_heads) * 3 * a.row_blocks;
    sk::ConvertKernel<<<static_cast<unsigned>((walkers + 127) / 128), 128, 0, stream>>>(a);
    ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("ConvertKernel");
    if (timed_convert && timers.convert_end != nullptr) {
      ATTND_CUDA_RETURN_IF_ERROR(cudaEventRecord(timers.convert_end[*convert_index], stream));
    }
    ++*convert_index;
    sk::AttendKernel<D><<<dim3(static_cast<unsigned>(a.row_blocks), g.num_q_heads), sk::kThreads,
                          att_smem, stream>>>(a);
    ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("AttendKernel");
  }
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchPiece(const DcaGeometry& g, const SparsePrefillParams& sp, const Layout& l,
                         const Piece& piece, const SparsePrefillTimers& timers, int piece_index,
                         int* convert_index, cudaStream_t stream) {
  const PiecePlan plan = PlanPiece(g, sp.budgets, piece, sp.row_block_slice);
  const sk::PieceArgs a = MakePieceArgs(g, sp, l, plan, piece, timers);
  ATTND_RETURN_IF_ERROR(LaunchEstimate<D>(g, l, a, timers, piece_index, stream));
  return LaunchAttend<D>(g, plan, a, 0, plan.row_blocks, timers, convert_index, stream);
}

// The checks of a step launch: `piece` is one piece (inside one chunk), the workspace holds its
// layout, and q / out hold positions [first, first + count) of it.
absl::Status CheckStep(const DcaGeometry& g, const SparsePrefillParams& sp, const Piece& piece,
                       int64_t first, int64_t count, Layout* layout) {
  if (absl::Status s = Check(g, sp); !s.ok()) return s;
  if (piece.prev < 0 || piece.prev % g.chunk_len != 0 || piece.begin < piece.prev ||
      piece.end <= piece.begin || piece.end > piece.prev + g.chunk_len ||
      piece.end > INT32_MAX / 2) {
    return absl::InvalidArgumentError(absl::StrCat("sparse: [", piece.begin, ", ", piece.end,
                                                   ") is not a piece of the chunk at ",
                                                   piece.prev));
  }
  const int64_t start = sp.prefill.start, rows = sp.prefill.num_tokens;
  if (first < start || first + count > start + rows) {
    return absl::InvalidArgumentError(absl::StrCat("sparse: positions [", first, ", ",
                                                   first + count, ") are not among q's [", start,
                                                   ", ", start + rows, ")"));
  }
  *layout = MakeLayout(g, sp.budgets, piece.begin, piece.end - piece.begin, sp.row_block_slice);
  if (sp.workspace == nullptr || sp.workspace_bytes < layout->total) {
    return absl::InvalidArgumentError(absl::StrCat("sparse: workspace of ", sp.workspace_bytes,
                                                   " bytes < ", layout->total, " needed"));
  }
  return absl::OkStatus();
}

}  // namespace

size_t SparsePrefillWorkspaceBytes(const DcaGeometry& g, absl::Span<const VsBudget> budgets,
                                   int64_t start, int64_t num_tokens, int64_t /*last_q*/,
                                   int32_t row_block_slice) {
  if (g.chunk_len < 1 || g.num_q_heads < 1 || g.num_q_heads > kMaxSparseHeads ||
      static_cast<int64_t>(budgets.size()) != g.num_q_heads || start < 0 || num_tokens < 1 ||
      row_block_slice < 1) {
    return 0;
  }
  return MakeLayout(g, budgets, start, num_tokens, row_block_slice).total;
}

size_t SparsePrefillWorkspaceBound(const DcaGeometry& g, absl::Span<const VsBudget> budgets,
                                   int64_t max_length, int64_t max_tokens, int64_t /*last_q*/,
                                   int32_t row_block_slice) {
  if (g.chunk_len < 1 || g.num_q_heads < 1 || g.num_q_heads > kMaxSparseHeads ||
      static_cast<int64_t>(budgets.size()) != g.num_q_heads || max_length < 1 || max_tokens < 1 ||
      row_block_slice < 1) {
    return 0;
  }
  // Every term of MakeLayout, bounded over the calls: piece ends <= L, a piece's row blocks
  // <= ceil(min(max_tokens, cl) / 64), intra kv_len <= min(cl, L), inter kv_len <= L - 1 - cl.
  const int64_t hq = g.num_q_heads, cl = g.chunk_len, L = max_length;
  int64_t vstride = 0, sstride = 0;
  for (int h = 0; h < hq; ++h) {
    vstride = std::max(vstride, std::max<int64_t>(std::min(budgets[h].vertical, L), 5));
    sstride = std::max(sstride, std::max<int64_t>(std::min(budgets[h].slash, L), 5));
  }
  const int64_t rbs = std::min<int64_t>(
      (std::min(std::min(max_tokens, L), cl) + sk::kRows - 1) / sk::kRows, row_block_slice);
  const int64_t kv_max[3] = {std::min(cl, L), cl, std::max<int64_t>(0, L - 1 - cl)};
  const bool present[3] = {true, L > cl, L > 2 * cl};
  int64_t blocks = 0, masks = 0;
  for (int h = 0; h < hq; ++h) {
    const int64_t n_offsets = std::max<int64_t>(std::min<int64_t>(budgets[h].slash, L), 5);
    for (int s = 0; s < 3; ++s) {
      if (!present[s]) continue;
      blocks += rbs * std::min(n_offsets + 1, (kv_max[s] + sk::kRows - 1) / sk::kRows + 1);
    }
    const int64_t n_columns = std::max<int64_t>(std::min<int64_t>(budgets[h].vertical, L), 5);
    masks += 3 * rbs * ((n_columns + 31) / 32);
  }
  const int64_t segments = (L + sk::kEstSegment - 1) / sk::kEstSegment;
  size_t total = 0;
  for (const size_t bytes :
       {hq * L * sizeof(float), hq * L * sizeof(float),
        hq * segments * sk::kRows * 2 * sizeof(float), hq * sk::kRows * 2 * sizeof(float),
        hq * vstride * sizeof(int32_t), hq * sstride * sizeof(int32_t),
        hq * 3 * vstride * sizeof(int32_t), hq * 3 * sstride * sizeof(int32_t),
        hq * 3 * 2 * sizeof(int32_t), hq * 3 * rbs * sizeof(int32_t), blocks * sizeof(int32_t),
        masks * sizeof(uint32_t)}) {
    total += Align(bytes);
  }
  return total;
}

absl::Status LaunchSparsePrefillTimed(const DcaGeometry& g, const SparsePrefillParams& sp,
                                      const SparsePrefillTimers& timers, cudaStream_t stream) {
  if (absl::Status s = Check(g, sp); !s.ok()) return s;
  const Layout l =
      MakeLayout(g, sp.budgets, sp.prefill.start, sp.prefill.num_tokens, sp.row_block_slice);
  if (sp.workspace == nullptr || sp.workspace_bytes < l.total) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse: workspace of ", sp.workspace_bytes, " bytes < ", l.total, " needed"));
  }
  const std::vector<Piece> pieces =
      SplitIntoPieces(sp.prefill.start, sp.prefill.num_tokens, g.chunk_len);
  int convert_index = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int pi = static_cast<int>(i);
    ATTND_RETURN_IF_ERROR(WithHeadDim(g.head_dim, [&](auto dim) {
      return LaunchPiece<decltype(dim)::value>(g, sp, l, pieces[i], timers, pi, &convert_index,
                                               stream);
    }));
  }
  return absl::OkStatus();
}

absl::Status LaunchSparsePrefill(const DcaGeometry& g, const SparsePrefillParams& sp,
                                 cudaStream_t stream) {
  return LaunchSparsePrefillTimed(g, sp, SparsePrefillTimers{}, stream);
}

absl::Status LaunchSparseEstimate(const DcaGeometry& g, const SparsePrefillParams& sp,
                                  const VsPiece& piece, cudaStream_t stream) {
  const int64_t n_est = std::min<int64_t>(piece.end - piece.begin, sp.last_q);
  Layout l;
  ATTND_RETURN_IF_ERROR(CheckStep(g, sp, piece, piece.end - n_est, n_est, &l));
  const PiecePlan plan = PlanPiece(g, sp.budgets, piece, sp.row_block_slice);
  const sk::PieceArgs a = MakePieceArgs(g, sp, l, plan, piece, SparsePrefillTimers{});
  return WithHeadDim(g.head_dim, [&](auto dim) {
    return LaunchEstimate<decltype(dim)::value>(g, l, a, SparsePrefillTimers{}, 0, stream);
  });
}

absl::Status LaunchSparseAttendRows(const DcaGeometry& g, const SparsePrefillParams& sp,
                                    const VsPiece& piece, int64_t first_row, int64_t num_rows,
                                    cudaStream_t stream) {
  const int64_t rows = piece.end - piece.begin;
  if (first_row < 0 || num_rows < 1 || first_row % sk::kRows != 0 || first_row + num_rows > rows ||
      (first_row + num_rows < rows && num_rows % sk::kRows != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sparse: rows [", first_row, ", ", first_row + num_rows, ") of a ", rows,
        "-row piece are not whole 64-row blocks (only the piece's last block may be partial)"));
  }
  Layout l;
  ATTND_RETURN_IF_ERROR(CheckStep(g, sp, piece, piece.begin + first_row, num_rows, &l));
  const PiecePlan plan = PlanPiece(g, sp.budgets, piece, sp.row_block_slice);
  const sk::PieceArgs a = MakePieceArgs(g, sp, l, plan, piece, SparsePrefillTimers{});
  const int64_t rb_begin = first_row / sk::kRows;
  const int64_t rb_end = (first_row + num_rows + sk::kRows - 1) / sk::kRows;
  int convert_index = 0;
  return WithHeadDim(g.head_dim, [&](auto dim) {
    return LaunchAttend<decltype(dim)::value>(g, plan, a, rb_begin, rb_end, SparsePrefillTimers{},
                                              &convert_index, stream);
  });
}

SparseDebugView SparseDebugViewOf(const DcaGeometry& g, const SparsePrefillParams& sp) {
  SparseDebugView v;
  const Layout l =
      MakeLayout(g, sp.budgets, sp.prefill.start, sp.prefill.num_tokens, sp.row_block_slice);
  const char* ws = static_cast<const char*>(sp.workspace);
  v.vertical_scores = reinterpret_cast<const float*>(ws + l.vscore);
  v.slash_scores = reinterpret_cast<const float*>(ws + l.sscore);
  v.score_stride = l.length;
  v.vertical = reinterpret_cast<const int32_t*>(ws + l.vsel);
  v.slash = reinterpret_cast<const int32_t*>(ws + l.ssel);
  v.vertical_stride = l.vstride;
  v.slash_stride = l.sstride;
  v.stage_columns = reinterpret_cast<const int32_t*>(ws + l.stage_cols);
  v.stage_offsets = reinterpret_cast<const int32_t*>(ws + l.stage_offs);
  v.stage_counts = reinterpret_cast<const int32_t*>(ws + l.stage_counts);
  v.block_counts = reinterpret_cast<const int32_t*>(ws + l.block_counts);
  v.blocks = reinterpret_cast<const int32_t*>(ws + l.blocks);
  v.column_masks = reinterpret_cast<const uint32_t*>(ws + l.col_masks);
  const std::vector<Piece> pieces =
      SplitIntoPieces(sp.prefill.start, sp.prefill.num_tokens, g.chunk_len);
  const PiecePlan plan = PlanPiece(g, sp.budgets, pieces.back(), sp.row_block_slice);
  v.block_base.assign(plan.base, plan.base + g.num_q_heads * 3);
  v.block_cap.assign(plan.cap, plan.cap + g.num_q_heads * 3);
  v.rb_offset = (plan.row_blocks - 1) / plan.slice_row_blocks * plan.slice_row_blocks;
  v.row_blocks = plan.row_blocks - v.rb_offset;
  v.mask_base.assign(plan.mask_base, plan.mask_base + g.num_q_heads);
  v.mask_words.assign(plan.mask_words, plan.mask_words + g.num_q_heads);
  return v;
}

}  // namespace attnd
