// Device code for sparse_cuda.h. Included by sparse_cuda.cu only. mma.sync m16n8k16 fragment
// conventions as in dca_cuda_kernels.cuh (lane = 4 * gid + tig; C rows gid / gid + 8, columns
// 2 tig, 2 tig + 1 of each 8-wide n block). Shared tiles are [rows][D + 8] bf16.
#ifndef ATTND_KERNELS_CUDA_SPARSE_CUDA_KERNELS_CUH_
#define ATTND_KERNELS_CUDA_SPARSE_CUDA_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/attention_tile.cuh"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/sparse_cuda.h"

namespace attnd {
namespace sparse_kernels {

constexpr int kRows = 64;          // estimation rows (last_q <= 64 used) and converter row block
constexpr int kTileN = 64;         // keys per K/V tile
constexpr int kThreads = 128;      // 4 warps x 16 rows
constexpr int kEstSegment = 2048;  // keys per estimation block
constexpr int kTopKThreads = 1024;
constexpr int kForcedVerticals = 30;
constexpr int kForcedSlashes = 100;

// Per-piece arguments, passed by value (< 4 KB).
struct PieceArgs {
  PagedKv<Bf16> kv;
  const Bf16* q;  // [num_tokens, 5, Hq, D]
  void* out;      // [num_tokens, Hq, D]
  int out_dtype;
  int32_t start, begin, end, prev, cl;
  int32_t hq, group;
  int32_t n_est;       // estimation rows
  int32_t row_blocks;  // row blocks of this slice of the piece (the converter / attention launch)
  int32_t rb_offset;   // first row block of the slice
  int32_t num_segments;
  float scale_log2;  // softmax scale * log2(e)
  float* vscore;     // [Hq][score_stride]
  float* sscore;
  int64_t score_stride;
  float* partial;  // [Hq][num_segments][64][2] (max, sum), log2 domain
  float* rowstat;  // [Hq][64][2] (max, 1/sum)
  int32_t* vsel;   // [Hq][vstride]
  int32_t* ssel;   // [Hq][sstride]
  int32_t vstride, sstride;
  int32_t* stage_cols;    // [Hq][3][vstride]
  int32_t* stage_offs;    // [Hq][3][sstride]
  int32_t* stage_counts;  // [Hq][3][2]
  int32_t* block_counts;  // [Hq][3][row_blocks] (slice-local row block index)
  int32_t* blocks;
  uint32_t* col_masks;
  unsigned long long*
      tile_stats;  // optional: [0] += K/V tiles attended, [1] += column tiles  // bit i of (h, s,
                   // m): stage column i lies inside a block of row block m
  int64_t mask_base[kMaxSparseHeads];   // (h, s, m) at mask_base[h] + (s * row_blocks + m) * words
  int32_t mask_words[kMaxSparseHeads];  // ceil(column capacity of head h / 32)
  int64_t block_base[kMaxSparseHeads * 3];
  int32_t block_cap[kMaxSparseHeads * 3];
  int32_t vbudget[kMaxSparseHeads];
  int32_t sbudget[kMaxSparseHeads];
};
static_assert(sizeof(PieceArgs) <= 4096, "PieceArgs must fit the kernel parameter space");

// ---- helpers ---------------------------------------------------------------------------------

using cuda_common::ApplyMask;
using cuda_common::CpAsync16;
using cuda_common::CpAsyncCommit;
using cuda_common::CpAsyncWait;
using cuda_common::Flat;
using cuda_common::FragCol;
using cuda_common::FragRow;
using cuda_common::GatherMask;
using cuda_common::kLog2e;
using cuda_common::LdMatrixX4;
using cuda_common::LdMatrixX4Trans;
using cuda_common::MergeStats;
using cuda_common::Mma16816;
using cuda_common::PackBf16;
using cuda_common::PackProbs;
using cuda_common::PagedOffset;
using cuda_common::RangeMask;
using cuda_common::RescaleRows;
using cuda_common::SmemAddr;
using cuda_common::SoftmaxState;
using cuda_common::StorePair;

// Loads the 16 A fragments (8 k-steps x 2 rows) of query rows r0 / r0+8 (this thread's gid rows),
// variant `variant`, q head h; invalid rows read as zeros.
template <int D>
__device__ __forceinline__ void LoadQFrag(const PieceArgs& a, int variant, int h, int32_t tok0,
                                          bool v0, int32_t tok1, bool v1, int tig,
                                          uint32_t (&qf)[D / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int32_t tok = i == 0 ? tok0 : tok1;
      const bool valid = i == 0 ? v0 : v1;
      const uint32_t* src = reinterpret_cast<const uint32_t*>(
          a.q + ((static_cast<int64_t>(tok) * kNumQueryVariants + variant) * a.hq + h) * D +
          kk * 16 + tig * 2);
      qf[kk][i] = valid ? src[0] : 0u;
      qf[kk][2 + i] = valid ? src[4] : 0u;
    }
  }
}

// ---- estimation --------------------------------------------------------------------------------

// grid (num_segments, Hq), kThreads. Rows: the piece's last n_est queries (row i at position
// end - n_est + i), warp w owns rows 16w..16w+15. kScores == false: per-row (max, sum) of the
// segment's keys into partial. kScores == true: probabilities with rowstat's (max, 1/sum), column
// sums stored to vscore, diagonal sums added to sscore.
template <int D, bool kScores>
__global__ void __launch_bounds__(kThreads) EstimateKernel(const PieceArgs a) {
  constexpr int kStride = D + 8;
  constexpr int kTile = kTileN * kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Bf16* ks = reinterpret_cast<Bf16*>(smem_raw);              // [2][64][D + 8]
  float* colsum = reinterpret_cast<float*>(ks + 2 * kTile);  // [4][64]
  float* diag = colsum + 4 * kTileN;                         // [kEstSegment + 64]

  const int seg = blockIdx.x, h = blockIdx.y;
  const int kvh = h / a.group;
  const int32_t k_lo = seg * kEstSegment;
  const int32_t k_hi = min(k_lo + kEstSegment, a.end);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const int n = a.n_est;
  const int r0 = warp * 16 + gid, r1 = r0 + 8;
  const bool v0 = r0 < n, v1 = r1 < n;
  const int32_t pos0 = a.end - n + (v0 ? r0 : 0), pos1 = a.end - n + (v1 ? r1 : 0);
  const int32_t tok0 = pos0 - a.start, tok1 = pos1 - a.start;

  float m_row[2], l_row[2];  // kScores: the rows' (max, 1 / sum) from rowstat
  SoftmaxState stats;        // !kScores: the rows' running (max, sum) over this segment
  stats.Init();
  if (kScores) {
    const float* rs = a.rowstat + static_cast<int64_t>(h) * kRows * 2;
    m_row[0] = v0 ? rs[r0 * 2] : 0.f;
    l_row[0] = v0 ? rs[r0 * 2 + 1] : 0.f;
    m_row[1] = v1 ? rs[r1 * 2] : 0.f;
    l_row[1] = v1 ? rs[r1 * 2 + 1] : 0.f;
    for (int i = threadIdx.x; i < kEstSegment + kTileN; i += kThreads) diag[i] = 0.f;
  }

  const int n_tiles = (k_hi - k_lo + kTileN - 1) / kTileN;
  auto load = [&](int t) {
    constexpr int kChunks = D / 8;
    const int col = (threadIdx.x % kChunks) * 8;
    Bf16* dst = ks + (t & 1) * kTile;
    for (int row = threadIdx.x / kChunks; row < kTileN; row += kThreads / kChunks) {
      const int32_t key = k_lo + t * kTileN + row;
      const bool valid = key < k_hi;
      const int64_t off = valid ? PagedOffset(a.kv, key, kvh) : 0;
      CpAsync16(dst + row * kStride + col, a.kv.k + off + col, valid);
    }
  };
  load(0);
  CpAsyncCommit();
  uint32_t qf[D / 16][4];
  int q_stage = -1;
  for (int t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) load(t + 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    const Bf16* kt = ks + (t & 1) * kTile;
    const int32_t k0 = k_lo + t * kTileN;
    const int st_hi = VariantOfKey(k0, a.prev, a.cl);
    const int st_lo = VariantOfKey(min(k0 + kTileN - 1, k_hi - 1), a.prev, a.cl);
    float s[kTileN / 8][4];
#pragma unroll
    for (int nb = 0; nb < kTileN / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
    for (int st = st_lo; st <= st_hi; ++st) {  // one stage, or two / three at a boundary
      if (st != q_stage) {
        q_stage = st;
        const int variant = st == 0 ? kIntra : (st == 1 ? kSuccCritical : kInterCritical);
        LoadQFrag<D>(a, variant, h, tok0, v0, tok1, v1, tig, qf);
      }
      float acc[kTileN / 8][4];
#pragma unroll
      for (int nb = 0; nb < kTileN / 8; ++nb)
        acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < kTileN / 16; ++np) {
          uint32_t b[4];
          const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int col = kk * 16 + ((lane >> 3) & 1) * 8;
          LdMatrixX4(b, kt + row * kStride + col);
          Mma16816(acc[2 * np], qf[kk], b[0], b[1]);
          Mma16816(acc[2 * np + 1], qf[kk], b[2], b[3]);
        }
      }
#pragma unroll
      for (int nb = 0; nb < kTileN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int32_t key = k0 + nb * 8 + tig * 2 + (e & 1);
          if (st_lo == st_hi || VariantOfKey(key, a.prev, a.cl) == st) s[nb][e] = acc[nb][e];
        }
    }
    // Mask (past the segment, causal corner; rows past n see nothing) and scale to the log2
    // domain, where rowstat lives.
    const RangeMask mask(k0, k_hi, true, v0 ? pos0 : -1, v1 ? pos1 : -1);
#pragma unroll
    for (int i = 0; i < kTileN / 2; ++i) {
      float& x = Flat(s)[i];
      x = mask.Visible(FragCol(i, tig), FragRow(i)) ? x * a.scale_log2 : -CUDART_INF_F;
    }
    if (!kScores) {
      float alpha[2];                     // no output to rescale: only the statistics move on
      stats.Update(Flat(s), 1.f, alpha);  // scores already in the log2 domain
    } else {
#pragma unroll
      for (int nb = 0; nb < kTileN / 8; ++nb) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key_local = nb * 8 + tig * 2 + c;
          const float p0 = v0 ? exp2f(s[nb][c] - m_row[0]) * l_row[0] : 0.f;
          const float p1 = v1 ? exp2f(s[nb][2 + c] - m_row[1]) * l_row[1] : 0.f;
          // Diagonal: row r, key j -> anchor j + (n - 1 - r).
          const int32_t key = k0 + key_local;
          if (p0 > 0.f) atomicAdd(&diag[key + (n - 1 - r0) - k_lo], p0);
          if (p1 > 0.f) atomicAdd(&diag[key + (n - 1 - r1) - k_lo], p1);
          float cs = p0 + p1;
          cs += __shfl_xor_sync(0xffffffffu, cs, 4);
          cs += __shfl_xor_sync(0xffffffffu, cs, 8);
          cs += __shfl_xor_sync(0xffffffffu, cs, 16);
          if (gid == 0) colsum[warp * kTileN + key_local] = cs;
        }
      }
      __syncthreads();
      if (threadIdx.x < kTileN) {
        const int32_t key = k0 + threadIdx.x;
        if (key < k_hi) {
          a.vscore[h * a.score_stride + key] = colsum[threadIdx.x] + colsum[kTileN + threadIdx.x] +
                                               colsum[2 * kTileN + threadIdx.x] +
                                               colsum[3 * kTileN + threadIdx.x];
        }
      }
    }
    __syncthreads();  // the next load overwrites the other buffer; colsum reused
  }
  CpAsyncWait<0>();
  if (!kScores) {
    stats.ReduceQuad();
    if (tig == 0) {
      float* p = a.partial + (static_cast<int64_t>(h) * a.num_segments + seg) * kRows * 2;
      p[r0 * 2] = stats.m[0];
      p[r0 * 2 + 1] = stats.l[0];
      p[r1 * 2] = stats.m[1];
      p[r1 * 2 + 1] = stats.l[1];
    }
  } else {
    __syncthreads();
    for (int i = threadIdx.x; i < kEstSegment + kTileN; i += kThreads) {
      const int32_t t = k_lo + i;
      if (t < a.end && diag[i] != 0.f) atomicAdd(&a.sscore[h * a.score_stride + t], diag[i]);
    }
  }
}

// grid Hq, 64 threads: rowstat[h][r] = (max, 1 / sum) over the segments' partials.
__global__ void EstimateCombineKernel(const PieceArgs a) {
  const int h = blockIdx.x, r = threadIdx.x;
  float m = -CUDART_INF_F, l = 0.f;
  for (int s = 0; s < a.num_segments; ++s) {
    const float* p = a.partial + ((static_cast<int64_t>(h) * a.num_segments + s) * kRows + r) * 2;
    MergeStats(m, l, p[0], p[1]);
  }
  a.rowstat[(static_cast<int64_t>(h) * kRows + r) * 2] = m;
  a.rowstat[(static_cast<int64_t>(h) * kRows + r) * 2 + 1] = l > 0.f ? 1.f / l : 0.f;
}

// ---- top-k -------------------------------------------------------------------------------------

// Order key of a score: its fp32 bits (scores are >= 0), +inf for the forced entries.
__device__ __forceinline__ uint32_t ScoreKey(const float* sc, int32_t j, bool forced) {
  if (forced) return 0x7f800000u;
  const float x = sc[j];
  return x > 0.f ? __float_as_uint(x) : 0u;  // also -0 and NaN -> 0
}

// grid (Hq, 2), kTopKThreads. blockIdx.y 0: verticals (ties: smaller index), 1: slashes (ties:
// larger anchor). Writes the min(budget, end) chosen indices ascending.
__global__ void __launch_bounds__(kTopKThreads) TopKKernel(const PieceArgs a) {
  using Scan = cub::BlockScan<int, kTopKThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need, s_eq_total;
  const int h = blockIdx.x;
  const bool slash = blockIdx.y == 1;
  const int32_t n = a.end;
  const float* sc = (slash ? a.sscore : a.vscore) + h * a.score_stride;
  int32_t* out = slash ? a.ssel + static_cast<int64_t>(h) * a.sstride
                       : a.vsel + static_cast<int64_t>(h) * a.vstride;
  const int32_t k = min(slash ? a.sbudget[h] : a.vbudget[h], n);
  auto forced = [&](int32_t j) { return slash ? j >= n - kForcedSlashes : j < kForcedVerticals; };
  if (k >= n) {
    for (int32_t j = threadIdx.x; j < n; j += kTopKThreads) out[j] = j;
    return;
  }
  uint32_t prefix = 0, mask = 0;
  int need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kTopKThreads) hist[i] = 0;
    __syncthreads();
    for (int32_t j = threadIdx.x; j < n; j += kTopKThreads) {
      const uint32_t u = ScoreKey(sc, j, forced(j));
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int cum = 0, d = 255;
      for (; d > 0; --d) {
        if (cum + hist[d] >= need) break;
        cum += hist[d];
      }
      s_need = need - cum;
      s_prefix = prefix | (static_cast<uint32_t>(d) << shift);
      s_eq_total = hist[d];
    }
    __syncthreads();
    need = s_need;
    prefix = s_prefix;
    mask |= 255u << shift;
    __syncthreads();
  }
  const uint32_t thr = prefix;
  const int eq_total = s_eq_total;  // entries equal to thr (the last pass fixed all 32 bits)
  int eq_seen = 0, sel_seen = 0;
  for (int32_t base = 0; base < n; base += kTopKThreads) {
    const int32_t j = base + threadIdx.x;
    uint32_t u = 0;
    if (j < n) u = ScoreKey(sc, j, forced(j));
    const bool in = j < n;
    const int eq = in && u == thr;
    int eq_rank, eq_block;
    Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_block);
    __syncthreads();
    eq_rank += eq_seen;
    const bool take_eq = eq && (slash ? eq_rank >= eq_total - need : eq_rank < need);
    const int sel = in && (u > thr || take_eq);
    int pos, sel_block;
    Scan(scan_tmp).ExclusiveSum(sel, pos, sel_block);
    __syncthreads();
    if (sel) out[sel_seen + pos] = j;
    eq_seen += eq_block;
    sel_seen += sel_block;
  }
}

// ---- stage mapping -----------------------------------------------------------------------------

__device__ __forceinline__ int32_t LowerBound(const int32_t* v, int32_t n, int32_t x) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (v[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// grid Hq, 256 threads: MapToStages for one q head (kernels/vertical_slash.cc).
__global__ void MapStagesKernel(const PieceArgs a) {
  const int h = blockIdx.x;
  const int32_t p = a.prev, cl = a.cl, end = a.end, nq = a.end - a.begin;
  const int32_t nv = min(a.vbudget[h], end), ns = min(a.sbudget[h], end);
  const int32_t* vsel = a.vsel + static_cast<int64_t>(h) * a.vstride;
  const int32_t* ssel = a.ssel + static_cast<int64_t>(h) * a.sstride;
  __shared__ int32_t b[8];
  if (threadIdx.x == 0) {
    b[0] = LowerBound(vsel, nv, p - cl);
    b[1] = LowerBound(vsel, nv, p);
    b[2] = LowerBound(ssel, ns, p - cl);
    b[3] = LowerBound(ssel, ns, p);
    b[4] = LowerBound(ssel, ns, p - cl + nq);
    b[5] = LowerBound(ssel, ns, p + nq);
  }
  __syncthreads();
  for (int s = 0; s < 3; ++s) {
    const bool present = s == 0 || (s == 1 ? p >= cl : p >= 2 * cl);
    int32_t* cols = a.stage_cols + (static_cast<int64_t>(h) * 3 + s) * a.vstride;
    int32_t* offs = a.stage_offs + (static_cast<int64_t>(h) * 3 + s) * a.sstride;
    int32_t* cnt = a.stage_counts + (h * 3 + s) * 2;
    if (!present) {
      if (threadIdx.x == 0) cnt[0] = cnt[1] = 0;
      continue;
    }
    const int32_t kv_len = s == 0 ? end - p : (s == 1 ? cl : p - cl);
    const int32_t kv_begin = s == 0 ? p : (s == 1 ? p - cl : 0);
    // columns: intra [b1, nv), succ [b0, b1), inter [0, b0)
    const int32_t c_lo = s == 0 ? b[1] : (s == 1 ? b[0] : 0);
    const int32_t c_hi = s == 0 ? nv : (s == 1 ? b[1] : b[0]);
    // offsets: intra t >= p: [b3, ns), end-1-t; succ t in [p - cl, p + nq): [b2, b5), p+nq-1-t;
    // inter t < p - cl + nq: [0, b4), p-cl+nq-1-t. (p + nq == end only when the piece starts its
    // chunk.)
    const int32_t o_lo = s == 0 ? b[3] : (s == 1 ? b[2] : 0);
    const int32_t o_hi = s == 0 ? ns : (s == 1 ? b[5] : b[4]);
    const int32_t o_base = s == 0 ? end - 1 : (s == 1 ? p + nq - 1 : p - cl + nq - 1);
    const int32_t step = max(1, kv_len / 5);
    const int32_t n_fb = min(5, (kv_len + step - 1) / step);
    int32_t n_cols = c_hi - c_lo, n_offs = o_hi - o_lo;
    if (n_cols > 0) {
      for (int32_t i = threadIdx.x; i < n_cols; i += blockDim.x)
        cols[i] = vsel[c_lo + i] - kv_begin;
    } else {
      for (int32_t i = threadIdx.x; i < n_fb; i += blockDim.x) cols[i] = i * step;
      n_cols = n_fb;
    }
    if (n_offs > 0) {
      for (int32_t i = threadIdx.x; i < n_offs; i += blockDim.x) offs[i] = o_base - ssel[o_lo + i];
    } else {
      for (int32_t i = threadIdx.x; i < n_fb; i += blockDim.x) offs[i] = (n_fb - 1 - i) * step;
      n_offs = n_fb;
    }
    if (threadIdx.x == 0) {
      cnt[0] = n_cols;
      cnt[1] = n_offs;
    }
  }
}

// ---- converter ---------------------------------------------------------------------------------

// One thread per (q head, stage, row block): the slash half of ConvertVerticalSlash's row-block
// walk (kernels/vertical_slash.cc ConvertRowBlock); the ranges do not depend on the columns.
__global__ void ConvertKernel(const PieceArgs a) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(a.hq) * 3 * a.row_blocks) return;
  const int32_t ml = static_cast<int32_t>(idx % a.row_blocks);  // storage index in the slice
  const int32_t m = a.rb_offset + ml;                           // row block of the piece
  const int hs = static_cast<int>(idx / a.row_blocks);          // h * 3 + s
  const int s = hs % 3, h = hs / 3;
  int32_t* count = a.block_counts + static_cast<int64_t>(hs) * a.row_blocks + ml;
  const int32_t* cnt = a.stage_counts + hs * 2;
  const int32_t no = cnt[1];
  if (no == 0) {  // absent stage
    *count = 0;
    return;
  }
  const int32_t* offs = a.stage_offs + static_cast<int64_t>(hs) * a.sstride;
  const int32_t p = a.prev, cl = a.cl;
  const int32_t q_len = a.end - a.begin;
  const int32_t kv_len = s == 0 ? a.end - p : (s == 1 ? cl : p - cl);
  const bool causal = s == 0;
  const int32_t cap = a.block_cap[hs];
  int32_t* out = a.blocks + a.block_base[hs] + static_cast<int64_t>(ml) * cap;
  int32_t n_out = 0;
  // Columns inside the emitted blocks, found by merging the (ascending) ranges with the
  // (ascending) column list: their bits are set so the attention skips them (no double count).
  const int32_t nc = cnt[0];
  const int32_t* cols = a.stage_cols + static_cast<int64_t>(hs) * a.vstride;
  const int words = a.mask_words[h];
  uint32_t* mask =
      a.col_masks + a.mask_base[h] + (static_cast<int64_t>(s) * a.row_blocks + ml) * words;
  for (int w = 0; w < (nc + 31) / 32; ++w) mask[w] = 0u;
  int32_t ci = 0;
  uint32_t word = 0u;
  int word_index = 0;
  auto set_bit = [&](int32_t i) {
    if (i / 32 != word_index) {
      if (word != 0u) mask[word_index] = word;
      word_index = i / 32;
      word = 0u;
    }
    word |= 1u << (i % 32);
  };
  auto emit = [&](int32_t rs, int32_t re) {
    if (rs >= kv_len) return;
    re = min(re, kv_len);
    for (int32_t b = rs; b < re; b += kRows) {
      if (n_out < cap) out[n_out] = b;
      ++n_out;
    }
    // Skip the columns left of the range (galloping: first index >= ci with cols >= rs).
    if (ci < nc && cols[ci] < rs) {
      int32_t lo = ci, step = 1;  // cols[lo] < rs
      while (lo + step < nc && cols[lo + step] < rs) {
        lo += step;
        step *= 2;
      }
      int32_t hi = min(lo + step, nc);
      ++lo;
      while (lo < hi) {
        const int32_t mid = (lo + hi) / 2;
        if (cols[mid] < rs)
          lo = mid + 1;
        else
          hi = mid;
      }
      ci = lo;
    }
    while (ci < nc && cols[ci] < re) set_bit(ci++);
  };
  // First index >= from of the (descending) offsets with offs < x, or no; galloping, since the
  // next offset that matters is usually close.
  auto first_below = [&](int32_t from, int32_t x) {
    if (from >= no || offs[from] < x) return from;
    int32_t lo = from, step = 1;  // offs[lo] >= x
    while (lo + step < no && offs[lo + step] >= x) {
      lo += step;
      step *= 2;
    }
    int32_t hi = min(lo + step, no);
    ++lo;
    while (lo < hi) {
      const int32_t mid = (lo + hi) / 2;
      if (offs[mid] < x)
        hi = mid;
      else
        lo = mid + 1;
    }
    return lo;
  };
  const int32_t start_m = m * kRows;
  const int32_t end_m = start_m + kRows;
  const int32_t off = causal ? kv_len - q_len : kv_len;
  const int32_t base = off + end_m;
  const int32_t empty_start = causal ? base : kv_len;
  int32_t si = 0;
  int32_t d = offs[si++];
  // Skip offsets >= base (descending list): binary search for the first < base, keeping the
  // CPU walk's result (it stops at the last entry even if that one is still >= base).
  if (d >= base && si < no) {
    int32_t lo = si, hi = no - 1;  // find first index in [si, no-1] with offs < base, else no-1
    while (lo < hi) {
      const int32_t mid = (lo + hi) / 2;
      if (offs[mid] < base)
        hi = mid;
      else
        lo = mid + 1;
    }
    d = offs[lo];
    si = lo + 1;
  }
  int32_t rs, re;
  if (d <= base) {
    re = max(base - d, kRows);
    rs = re - kRows;
  } else {
    rs = empty_start;
    re = empty_start + kRows;
  }
  // The CPU walk visits every offset; one whose band ends at or left of the range's end
  // (base - d <= re, re >= 64) changes nothing, so jump to the next one that ends past it. (A
  // non-causal stage stops at its first offset below start_m; skipped offsets below it would
  // have stopped the walk with the same result.)
  for (;;) {
    si = first_below(si, base - re);
    if (si >= no || !(causal || offs[si] >= start_m)) break;
    const int32_t be = max(base - offs[si++], kRows);  // > re
    if (be > re + kRows) {
      emit(rs, re);
      rs = be - kRows;
      re = be;
    } else {
      re += kRows;
    }
  }
  emit(rs, re);
  if (word != 0u) mask[word_index] = word;
  *count = min(n_out, cap);
}

// ---- block-sparse attention --------------------------------------------------------------------

// Stage s's layout for this (q head, row block): tiles [0, nb) are block tiles, [nb, nb + nct)
// column gathers of 64.
struct StageTiles {
  int32_t nb, nc, kv_begin, kv_len;
  const int32_t* blocks;
  const int32_t* cols;
  const uint32_t* mask;
};

// One key tile for a warp's MT 16-row m-tiles (AttendKernel runs MT = 1): S = Q K^T over BN keys,
// mask[mt], the online softmax, O += P V. K and V are [BN][kStride] bf16 tiles in shared memory
// (padded rows, so ldmatrix is conflict-free); q_frag(mt, kk, qa) supplies the A fragment of m-tile
// mt for head dims [16 kk, 16 kk + 16). Scores are raw: `scale` is softmax_scale * log2(e).
template <int D, int BN, int MT, int kStride, class QFrag, class Mask>
__device__ __forceinline__ void WarpAttendTile(const QFrag& q_frag, const Bf16* kt, const Bf16* vt,
                                               const Mask (&mask)[MT], float scale,
                                               SoftmaxState (&state)[MT],
                                               float (&o)[MT][D / 8][4]) {
  const int lane = threadIdx.x % 32, tig = lane % 4;
  float s[MT][BN / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
      s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t qa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) q_frag(mt, kk, qa[mt]);
#pragma unroll
    for (int np = 0; np < BN / 16; ++np) {
      uint32_t b[4];
      const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int col = kk * 16 + ((lane >> 3) & 1) * 8;
      LdMatrixX4(b, kt + row * kStride + col);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Mma16816(s[mt][2 * np], qa[mt], b[0], b[1]);
        Mma16816(s[mt][2 * np + 1], qa[mt], b[2], b[3]);
      }
    }
  }
  uint32_t pa[MT][BN / 16][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float alpha[2];
    ApplyMask(Flat(s[mt]), tig, mask[mt]);
    state[mt].Update(Flat(s[mt]), scale, alpha);
    RescaleRows(Flat(o[mt]), alpha);
    PackProbs(Flat(s[mt]), pa[mt]);
  }
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      const int row = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
      const int col = dp * 16 + ((lane >> 4) << 3);
      LdMatrixX4Trans(b, vt + row * kStride + col);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Mma16816(o[mt][2 * dp], pa[mt][kk], b[0], b[1]);
        Mma16816(o[mt][2 * dp + 1], pa[mt][kk], b[2], b[3]);
      }
    }
  }
}

// grid (row blocks of the slice, Hq), kThreads. Block (m, h): rows [64m, 64m + 64) of the
// piece, q head h.
template <int D>
__global__ void __launch_bounds__(kThreads, 3) AttendKernel(const PieceArgs a) {
  constexpr int kStride = D + 8;
  constexpr int kTile = kTileN * kStride;
  constexpr int kDimBlocks = D / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Bf16* ks = reinterpret_cast<Bf16*>(smem_raw);                // [2][64][D + 8]
  Bf16* vs = ks + 2 * kTile;                                   // [2][64][D + 8]
  int32_t* kpos = reinterpret_cast<int32_t*>(vs + 2 * kTile);  // [2][64] absolute key or -1

  const int ml = a.row_blocks - 1 - blockIdx.x;  // heaviest (last) row blocks first
  const int m = a.rb_offset + ml;                // row block of the piece; ml indexes storage
  const int h = blockIdx.y;
  const int kvh = h / a.group;
  const int32_t nq = a.end - a.begin;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const int r0 = m * kRows + warp * 16 + gid, r1 = r0 + 8;
  const bool v0 = r0 < nq, v1 = r1 < nq;
  const int32_t pos0 = a.begin + r0, pos1 = a.begin + r1;
  const int32_t tok0 = v0 ? pos0 - a.start : 0, tok1 = v1 ? pos1 - a.start : 0;

  // Stages in the order inter (2), succ (1), intra (0).
  StageTiles st[3];
  int32_t n_tiles[3];
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const int s = 2 - i;
    const int hs = h * 3 + s;
    const int32_t* cnt = a.stage_counts + hs * 2;
    const bool present = cnt[1] > 0;
    st[i].nb = present ? a.block_counts[static_cast<int64_t>(hs) * a.row_blocks + ml] : 0;
    st[i].nc = present ? cnt[0] : 0;
    if (s == 0 && st[i].nc > 0) {
      // Causal stage: columns right of the block's last row are future keys for every row (the
      // CPU converter drops them too); the list is ascending, so keep its prefix.
      const int32_t horizon = (a.begin - a.prev) + min((m + 1) * kRows, nq) - 1;
      const int32_t* c = a.stage_cols + static_cast<int64_t>(hs) * a.vstride;
      int32_t lo = 0, hi = st[i].nc;
      while (lo < hi) {
        const int32_t mid = (lo + hi) / 2;
        if (c[mid] <= horizon)
          lo = mid + 1;
        else
          hi = mid;
      }
      st[i].nc = lo;
    }
    if (s == 0 && st[i].nb > 0) {  // blocks wholly right of the last row (a range extended past it)
      const int32_t horizon = (a.begin - a.prev) + min((m + 1) * kRows, nq) - 1;
      const int32_t* b = a.blocks + a.block_base[hs] + static_cast<int64_t>(ml) * a.block_cap[hs];
      while (st[i].nb > 0 && b[st[i].nb - 1] > horizon) --st[i].nb;
    }
    st[i].kv_begin = s == 0 ? a.prev : (s == 1 ? a.prev - a.cl : 0);
    st[i].kv_len = s == 0 ? a.end - a.prev : (s == 1 ? a.cl : a.prev - a.cl);
    st[i].blocks = a.blocks + a.block_base[hs] + static_cast<int64_t>(ml) * a.block_cap[hs];
    st[i].cols = a.stage_cols + static_cast<int64_t>(hs) * a.vstride;
    st[i].mask = a.col_masks + a.mask_base[h] +
                 (static_cast<int64_t>(s) * a.row_blocks + ml) * a.mask_words[h];
    n_tiles[i] = st[i].nb + (st[i].nc + kTileN - 1) / kTileN;
  }
  const int total = n_tiles[0] + n_tiles[1] + n_tiles[2];
  if (a.tile_stats != nullptr && threadIdx.x == 0) {
    atomicAdd(&a.tile_stats[0], static_cast<unsigned long long>(total));
    atomicAdd(&a.tile_stats[1],
              static_cast<unsigned long long>(total - st[0].nb - st[1].nb - st[2].nb));
  }
  auto which = [&](int j, int& i, int& local) {
    i = j < n_tiles[0] ? 0 : (j < n_tiles[0] + n_tiles[1] ? 1 : 2);
    local = j - (i == 0 ? 0 : (i == 1 ? n_tiles[0] : n_tiles[0] + n_tiles[1]));
  };
  // Loading a tile is two steps so that the index loads of tile j + 2 overlap tile j's math:
  // fetch() reads the key of each of this thread's rows (block list / column list and mask, in
  // registers), issue() turns them into cp.async copies through the page table.
  constexpr int kChunks = D / 8;
  constexpr int kRowStep = kThreads / kChunks;
  constexpr int kMyRows = kTileN / kRowStep;
  const int col = (threadIdx.x % kChunks) * 8;
  const int row0 = threadIdx.x / kChunks;
  auto fetch = [&](int j, int32_t(&keys)[kMyRows]) {
    if (j >= total) return;
    int i, local;
    which(j, i, local);
    const StageTiles& S = st[i];
#pragma unroll
    for (int t = 0; t < kMyRows; ++t) {
      const int row = row0 + t * kRowStep;
      if (local < S.nb) {
        const int32_t rel = S.blocks[local] + row;
        keys[t] = rel < S.kv_len ? S.kv_begin + rel : -1;
      } else {
        const int32_t c = (local - S.nb) * kTileN + row;
        if (c < S.nc) {
          const bool inside = (S.mask[c / 32] >> (c % 32)) & 1u;
          keys[t] = inside ? -1 : S.kv_begin + S.cols[c];
        } else {
          keys[t] = -1;
        }
      }
    }
  };
  auto issue = [&](int j, const int32_t(&keys)[kMyRows]) {
    Bf16* kd = ks + (j & 1) * kTile;
    Bf16* vd = vs + (j & 1) * kTile;
#pragma unroll
    for (int t = 0; t < kMyRows; ++t) {
      const int row = row0 + t * kRowStep;
      const bool valid = keys[t] >= 0;
      const int64_t off = valid ? PagedOffset(a.kv, keys[t], kvh) : 0;
      CpAsync16(kd + row * kStride + col, a.kv.k + off + col, valid);
      CpAsync16(vd + row * kStride + col, a.kv.v + off + col, valid);
      if (col == 0) kpos[(j & 1) * kTileN + row] = keys[t];
    }
  };

  float o[1][kDimBlocks][4];
#pragma unroll
  for (int d = 0; d < kDimBlocks; ++d) o[0][d][0] = o[0][d][1] = o[0][d][2] = o[0][d][3] = 0.f;
  SoftmaxState softmax[1];
  softmax[0].Init();
  uint32_t qf[D / 16][4];
  int q_stage = -1;

  int32_t keys_next[kMyRows];
  if (total > 0) {
    fetch(0, keys_next);
    issue(0, keys_next);
  }
  CpAsyncCommit();
  fetch(1, keys_next);
  for (int j = 0; j < total; ++j) {
    if (j + 1 < total) issue(j + 1, keys_next);
    CpAsyncCommit();
    fetch(j + 2, keys_next);
    int i, local;
    which(j, i, local);
    const int s = 2 - i;
    if (s != q_stage) {
      q_stage = s;
      LoadQFrag<D>(a, s == 0 ? kIntra : (s == 1 ? kSucc : kInter), h, tok0, v0, tok1, v1, tig, qf);
    }
    CpAsyncWait<1>();
    __syncthreads();
    const Bf16* kt = ks + (j & 1) * kTile;
    const Bf16* vt = vs + (j & 1) * kTile;
    auto q_frag = [&](int, int kk, uint32_t(&qa)[4]) {
      qa[0] = qf[kk][0];
      qa[1] = qf[kk][1];
      qa[2] = qf[kk][2];
      qa[3] = qf[kk][3];
    };
    const GatherMask mask[1] = {GatherMask(kpos + (j & 1) * kTileN, s == 0, pos0, pos1)};
    WarpAttendTile<D, kTileN, 1, kStride>(q_frag, kt, vt, mask, a.scale_log2, softmax, o);
    __syncthreads();
  }
  CpAsyncWait<0>();
  softmax[0].ReduceQuad();
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    if (!(ri == 0 ? v0 : v1)) continue;
    const float inv = softmax[0].InvSum(ri);  // no key: zeros, never NaN
    const int64_t base = (static_cast<int64_t>(ri == 0 ? tok0 : tok1) * a.hq + h) * D;
#pragma unroll
    for (int d = 0; d < kDimBlocks; ++d) {
      StorePair(a.out, a.out_dtype, base + d * 8 + tig * 2, o[0][d][2 * ri] * inv,
                o[0][d][2 * ri + 1] * inv);
    }
  }
}

}  // namespace sparse_kernels
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_SPARSE_CUDA_KERNELS_CUH_
