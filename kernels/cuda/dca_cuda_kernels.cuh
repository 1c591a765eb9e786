// Device code for dca_cuda.h: the prefill and decode kernels. Included by the .cu files of
// //kernels/cuda (its kernels are templates, instantiated where launched).
//
// Fragment conventions (mma.sync.m16n8k16.row.col bf16, fp32 accumulate), lane = 4 * gid + tig:
//   A 16x16: a0 (row gid, k 2tig..+1), a1 (row gid+8), a2 (row gid, k+8), a3 (row gid+8, k+8)
//   B 16x8 : b0 (k 2tig..+1, n gid), b1 (k 2tig+8..+9, n gid)
//   C 16x8 : c0,c1 (row gid, n 2tig..+1), c2,c3 (row gid+8, n 2tig..+1)
// Shared-memory tiles are [rows][head_dim + 8] bf16: the 16-byte pad staggers rows across banks so
// ldmatrix is conflict-free.
#ifndef ATTND_KERNELS_CUDA_DCA_CUDA_KERNELS_CUH_
#define ATTND_KERNELS_CUDA_DCA_CUDA_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_tile.cuh"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/cuda/device_common.cuh"

namespace attnd {
namespace cuda_kernels {

constexpr int kThreads = 128;  // 4 warps: decode blocks (prefill blocks are 32 * Warps)
constexpr int kBlockN = 64;    // keys per K/V tile

// ---- small helpers
// -------------------------------------------------------------------------------

using cuda_common::CpAsync16;
using cuda_common::CpAsyncCommit;
using cuda_common::CpAsyncWait;
using cuda_common::kLog2e;
using cuda_common::LdMatrixX4;
using cuda_common::LdMatrixX4Trans;
using cuda_common::LoadAsFloat;
using cuda_common::Mma16816;
using cuda_common::PackBf16;
using cuda_common::PagedOffset;
using cuda_common::RangeMask;
using cuda_common::SmemAddr;
using cuda_common::SoftmaxState;
using cuda_common::SoftmaxTile;
using cuda_common::StoreOne;
using cuda_common::StorePair;

// Loads K and V rows [k0, k0 + BN) of kv_head into shared tiles [BN][D + 8]; rows at or past k_hi
// are zero-filled and never read from global memory.
template <int D, int NThreads = kThreads, int BN = kBlockN>
__device__ __forceinline__ void LoadKvTile(const PagedKv<Bf16>& kv, int32_t kv_head, int32_t k0,
                                           int32_t k_hi, Bf16* ks, Bf16* vs) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kRowsPerPass = NThreads / kChunksPerRow;
  const int col = (threadIdx.x % kChunksPerRow) * 8;
  for (int row = threadIdx.x / kChunksPerRow; row < BN; row += kRowsPerPass) {
    const int32_t pos = k0 + row;
    const bool valid = pos < k_hi;
    const int64_t off = valid ? PagedOffset(kv, pos, kv_head) : 0;
    CpAsync16(ks + row * (D + 8) + col, kv.k + off + col, valid);
    CpAsync16(vs + row * (D + 8) + col, kv.v + off + col, valid);
  }
}

// ---- fused prefill
// -------------------------------------------------------------------------------

struct PrefillArgs {
  PagedKv<Bf16> kv;
  const Bf16* q;
  void* out;
  int out_dtype;
  int32_t start;
  int32_t num_tokens;
  int32_t chunk_len;
  int32_t num_q_heads;
  int32_t group;
  int32_t tiles_first;  // query tiles of the first piece
  int32_t tiles_full;   // query tiles of a full piece (chunk_len tokens)
  float scale_log2;     // softmax_scale * log2(e)
  // The launch's window of each block's key tiles (CudaPrefillParams::key_tile_begin/end; end 0 =
  // to the end) and the blocks' saved softmax state; read by the windowed instantiations only.
  int32_t key_tile_begin;
  int32_t key_tile_end;
  float* window_state;
};

// A query tile's key tiles of BN keys, in the order the prefill kernels visit them: inter
// [0, prev - cl), succ [prev - cl, prev), intra [prev, max_q_pos], each range cut into tiles from
// its own start; the host counts a call's tiles with it (PrefillKeyTiles).
// NOTE: the kernels spell the same count inline: through this struct ptxas allocated the mma.sync
// kernel's registers differently (same_sass.py), and the whole launch's code is kept as tuned.
struct KeyTiles {
  int32_t inter_hi, succ_lo;  // end of the inter range, start of the succ range
  int n_inter, n_succ, n_intra;
  __host__ __device__ __forceinline__ KeyTiles(int32_t prev, int32_t cl, int32_t max_q_pos, int bn)
      : inter_hi(prev >= 2 * cl ? prev - cl : 0),
        succ_lo(prev >= cl ? prev - cl : prev),
        n_inter((inter_hi + bn - 1) / bn),
        n_succ((prev - succ_lo + bn - 1) / bn),
        n_intra((max_q_pos + 1 - prev + bn - 1) / bn) {}
  __host__ __device__ __forceinline__ int total() const { return n_inter + n_succ + n_intra; }
};

// The key tiles [begin, end) of a block's n_tiles that a launch processes: everything when not
// windowed, else the launch's window clipped to the block's tiles (begin >= n_tiles: none).
struct KeyWindow {
  int begin, end;
};
template <bool kWindowed>
__device__ __forceinline__ KeyWindow KeyWindowOf(const PrefillArgs& a, int n_tiles) {
  if constexpr (!kWindowed) {
    return KeyWindow{0, n_tiles};
  } else {
    return KeyWindow{a.key_tile_begin, a.key_tile_end > 0 ? min(a.key_tile_end, n_tiles) : n_tiles};
  }
}

// A block's online-softmax state between the launches of a windowed call: kFields floats per
// thread of its kThreads, stored [block][field][thread] so a warp's accesses are contiguous. The
// layout is the kernel's own (each thread's fragment registers as they are), opaque to the host.
template <int kFields, int kThreads>
struct WindowState {
  static constexpr size_t kBlockFloats = static_cast<size_t>(kFields) * kThreads;
  float* base;  // this thread's field 0
  __device__ __forceinline__ WindowState(float* state, int thread)
      : base(state + (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kBlockFloats +
             thread) {}
  __device__ __forceinline__ float& operator[](int field) const { return base[field * kThreads]; }
};

// The piece a prefill block works on. Blocks run heaviest first (last pieces, last rows): block
// index blockIdx.x maps to tile gridDim.x - 1 - blockIdx.x, the first piece's tiles_first tiles
// come first, then tiles_full per full chunk.
struct PrefillTile {
  int32_t piece_begin, piece_end;  // the piece's new tokens [piece_begin, piece_end)
  int32_t prev;                    // start of the piece's DCA chunk
  int32_t local;                   // the tile's index inside its piece
};
__device__ __forceinline__ PrefillTile PrefillTileOfBlock(const PrefillArgs& a) {
  const int tile = gridDim.x - 1 - blockIdx.x;
  const int32_t cl = a.chunk_len;
  const int32_t lk = a.start + a.num_tokens;
  const int32_t prev0 = (a.start / cl) * cl;
  const int32_t end0 = min(prev0 + cl, lk);
  PrefillTile t;
  if (tile < a.tiles_first) {
    t.piece_begin = a.start;
    t.piece_end = end0;
    t.prev = prev0;
    t.local = tile;
  } else {
    const int p = (tile - a.tiles_first) / a.tiles_full;
    t.local = (tile - a.tiles_first) % a.tiles_full;
    t.prev = end0 + p * cl;
    t.piece_begin = t.prev;
    t.piece_end = min(t.prev + cl, lk);
  }
  return t;
}

// grid (query tiles over all pieces, num_kv_heads), block 32 * Warps. Block (t, h): a tile of
// kBlockM = 16 * MT * Warps rows (token, q head of h's group) inside one piece; walks inter, succ,
// then intra key tiles of BN keys with that stage's query variant, one online softmax, and writes
// the normalised rows. Each warp owns MT 16-row m-tiles, so every K/V fragment read from shared
// memory feeds MT mma's. K/V tiles go through a Stages-deep cp.async ring. With MT == 1 the query
// fragments live in registers; with MT > 1 the stage's queries are staged in shared memory.
// NOTE: this kernel keeps its own online softmax rather than SoftmaxState (attention_tile.cuh).
// The product's configuration (D 128, 4 warps, MT 2, BN 64) runs at the 255-register limit: every
// shared form tried (SoftmaxState inline, or the sparse kernel's WarpAttendTile) raised ptxas'
// spills from 76 to 112-152 bytes, and the one run on the H200 (WarpAttendTile) was 5-9% slower
// (docs/BENCHMARKS.md, issue 17). Its visibility test stays inline too: through TwoBoundMask
// (attention_tile.cuh) ptxas' spills went from 76 to 128 bytes.
// kWindowed: the block processes only the launch's window of its key tiles (KeyWindowOf), starting
// from the state a previous window saved and saving its own unless the window reaches its last
// tile (dca_cuda.h, CudaPrefillParams::key_tile_begin). Tiles are visited in the same order with
// the same arithmetic, so a windowed call's output is the whole launch's bit for bit.
// Floats of saved state per thread of DcaPrefillKernel (MT m-tiles): its O fragments, then m and
// l of its rows.
__host__ __device__ constexpr int PrefillStateFields(int d, int mt) { return mt * (d / 8 * 4 + 4); }

template <int D, int Warps, int Stages, int MT, int BN, bool kWindowed = false>
__global__ void __launch_bounds__(Warps * 32) DcaPrefillKernel(const PrefillArgs a) {
  constexpr int kBlockM = 16 * MT * Warps;
  constexpr int kBlockThreads = 32 * Warps;
  constexpr int kTile = BN * (D + 8);
  constexpr int kKSteps = D / 16;
  constexpr int kDimBlocks = D / 8;
  constexpr int kKeyBlocks = BN / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Bf16* ks = reinterpret_cast<Bf16*>(smem_raw);  // [Stages][BN][D + 8]
  Bf16* vs = ks + Stages * kTile;                // [Stages][BN][D + 8]
  Bf16* qs = vs + Stages * kTile;                // [kBlockM][D + 8] when MT > 1

  const int kv_head = blockIdx.y;
  const int32_t cl = a.chunk_len;
  const PrefillTile pt = PrefillTileOfBlock(a);
  const int32_t piece_begin = pt.piece_begin, piece_end = pt.piece_end, prev = pt.prev;
  const int32_t local = pt.local;
  const int32_t piece_tokens = piece_end - piece_begin;
  const int64_t piece_rows = static_cast<int64_t>(piece_tokens) * a.group;
  const int64_t row_base = static_cast<int64_t>(local) * kBlockM;
  if (row_base >= piece_rows) return;  // past a short last piece
  const int32_t max_q_pos =
      piece_begin + static_cast<int32_t>(min(piece_rows - 1, row_base + kBlockM - 1) / a.group);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, tig = lane % 4;
  // This thread's rows: (m-tile mt, gid) and (mt, gid + 8) of the warp's 16 * MT.
  int32_t q_pos[MT][2];
  int64_t q_row[MT][2];  // token * Hq + head, token relative to start
  bool row_valid[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t flat = row_base + (warp * MT + mt) * 16 + gid + 8 * i;
      const int32_t tok = static_cast<int32_t>(flat / a.group);
      const int32_t head = kv_head * a.group + static_cast<int32_t>(flat % a.group);
      row_valid[mt][i] = tok < piece_tokens;
      q_pos[mt][i] = row_valid[mt][i] ? piece_begin + tok : max_q_pos;
      const int32_t t_idx = piece_begin + tok - a.start;
      q_row[mt][i] = row_valid[mt][i] ? static_cast<int64_t>(t_idx) * a.num_q_heads + head : 0;
    }
  }

  // Key tiles: inter [0, prev-cl), succ [prev-cl, prev), intra [prev, max_q_pos].
  const int32_t inter_hi = prev >= 2 * cl ? prev - cl : 0;
  const int32_t succ_lo = prev >= cl ? prev - cl : prev;
  const int n_inter = (inter_hi + BN - 1) / BN;
  const int n_succ = (prev - succ_lo + BN - 1) / BN;
  const int n_intra = (max_q_pos + 1 - prev + BN - 1) / BN;
  const int n_tiles = n_inter + n_succ + n_intra;
  const KeyWindow win = KeyWindowOf<kWindowed>(a, n_tiles);
  if (kWindowed && win.begin >= n_tiles) return;  // all this block's tiles came before the window
  auto tile_range = [&](int j, int& stage, int32_t& k0, int32_t& khi) {
    if (j < n_inter) {
      stage = kInter;
      k0 = j * BN;
      khi = inter_hi;
    } else if (j < n_inter + n_succ) {
      stage = kSucc;
      k0 = succ_lo + (j - n_inter) * BN;
      khi = prev;
    } else {
      stage = kIntra;
      k0 = prev + (j - n_inter - n_succ) * BN;
      khi = max_q_pos + 1;
    }
  };

  float o[MT][kDimBlocks][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < kDimBlocks; ++d)
      o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = -CUDART_INF_F;
    l[mt][0] = l[mt][1] = 0.f;
  }
  // The saved state: o, then m and l, per m-tile.
  constexpr int kStateFields = PrefillStateFields(D, MT);
  if constexpr (kWindowed) {
    if (win.begin > 0) {
      const WindowState<kStateFields, kBlockThreads> saved(a.window_state, threadIdx.x);
      int f = 0;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int d = 0; d < kDimBlocks; ++d)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mt][d][e] = saved[f++];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          m[mt][i] = saved[f++];
          l[mt][i] = saved[f++];
        }
      }
    }
  }
  uint32_t qf[MT == 1 ? kKSteps : 1][4];  // MT == 1: the stage's query A fragments
  int q_stage = -1;

  // This launch's tiles [first, end); ring slots count from `first`.
  const int first = win.begin, end = win.end;
  for (int t = 0; t < Stages - 1; ++t) {  // prologue: the first Stages-1 tiles
    if (t < end - first) {
      int st;
      int32_t k0, khi;
      tile_range(first + t, st, k0, khi);
      LoadKvTile<D, kBlockThreads, BN>(a.kv, kv_head, k0, khi, ks + t * kTile, vs + t * kTile);
    }
    CpAsyncCommit();
  }
  for (int j = first; j < end; ++j) {
    if (j + Stages - 1 < end) {
      int st;
      int32_t k0, khi;
      const int t = j + Stages - 1;
      tile_range(t, st, k0, khi);
      LoadKvTile<D, kBlockThreads, BN>(a.kv, kv_head, k0, khi, ks + ((t - first) % Stages) * kTile,
                                       vs + ((t - first) % Stages) * kTile);
    }
    CpAsyncCommit();
    int stage;
    int32_t k0, khi;
    tile_range(j, stage, k0, khi);
    if (stage != q_stage) {  // this stage's query variant
      q_stage = stage;
      if constexpr (MT == 1) {
        for (int kk = 0; kk < kKSteps; ++kk) {
          for (int i = 0; i < 2; ++i) {
            const uint32_t* src = reinterpret_cast<const uint32_t*>(
                a.q +
                ((q_row[0][i] / a.num_q_heads) * kNumQueryVariants + stage) * a.num_q_heads * D +
                (q_row[0][i] % a.num_q_heads) * D + kk * 16 + tig * 2);
            qf[kk][i] = row_valid[0][i] ? src[0] : 0u;
            qf[kk][2 + i] = row_valid[0][i] ? src[4] : 0u;
          }
        }
      } else {
        // Stage rows into qs (previous readers finished at the last iteration's barrier; the
        // barrier below orders these stores before the ldmatrix reads).
        constexpr int kChunksPerRow = D / 8;
        for (int c = threadIdx.x; c < kBlockM * kChunksPerRow; c += kBlockThreads) {
          const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
          const int64_t flat = row_base + r;
          const int32_t tok = static_cast<int32_t>(flat / a.group);
          uint4 val = make_uint4(0u, 0u, 0u, 0u);
          if (tok < piece_tokens) {
            const int32_t head = kv_head * a.group + static_cast<int32_t>(flat % a.group);
            const int64_t t_idx = piece_begin + tok - a.start;
            val = *reinterpret_cast<const uint4*>(
                a.q + ((t_idx * kNumQueryVariants + stage) * a.num_q_heads + head) * D + col);
          }
          *reinterpret_cast<uint4*>(qs + r * (D + 8) + col) = val;
        }
      }
    }
    CpAsyncWait<Stages - 1>();  // tile j has landed
    __syncthreads();
    const Bf16* kt = ks + ((j - first) % Stages) * kTile;
    const Bf16* vt = vs + ((j - first) % Stages) * kTile;

    // S = Q K^T for this warp's MT x 16 rows x BN keys.
    float s[MT][kKeyBlocks][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < kKeyBlocks; ++nb)
        s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (MT == 1) {
          qa[mt][0] = qf[kk][0];
          qa[mt][1] = qf[kk][1];
          qa[mt][2] = qf[kk][2];
          qa[mt][3] = qf[kk][3];
        } else {
          LdMatrixX4(qa[mt], qs + ((warp * MT + mt) * 16 + (lane & 15)) * (D + 8) + kk * 16 +
                                 (lane >> 4) * 8);
        }
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int col = kk * 16 + ((lane >> 3) & 1) * 8;
        LdMatrixX4(b, kt + row * (D + 8) + col);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma16816(s[mt][2 * np], qa[mt], b[0], b[1]);
          Mma16816(s[mt][2 * np + 1], qa[mt], b[2], b[3]);
        }
      }
    }
    // Mask, scale, online softmax.
    uint32_t pa[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float tile_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
      for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e / 2;
          const int32_t key = k0 + nb * 8 + tig * 2 + (e & 1);
          const bool visible = key < khi && (stage != kIntra || key <= q_pos[mt][i]);
          const float x = visible ? s[mt][nb][e] * a.scale_log2 : -CUDART_INF_F;
          s[mt][nb][e] = x;
          tile_max[i] = fmaxf(tile_max[i], x);
        }
      }
      float alpha[2], m_use[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
        const float m_new = fmaxf(m[mt][i], tile_max[i]);
        m_use[i] = m_new == -CUDART_INF_F ? 0.f : m_new;
        alpha[i] = exp2f(m[mt][i] - m_use[i]);
        m[mt][i] = m_new;
        l[mt][i] *= alpha[i];
      }
#pragma unroll
      for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = exp2f(s[mt][nb][e] - m_use[e / 2]);
          s[mt][nb][e] = p;
          l[mt][e / 2] += p;
        }
      }
#pragma unroll
      for (int d = 0; d < kDimBlocks; ++d) {
        o[mt][d][0] *= alpha[0];
        o[mt][d][1] *= alpha[0];
        o[mt][d][2] *= alpha[1];
        o[mt][d][3] *= alpha[1];
      }
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[mt][kk][0] = PackBf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][kk][1] = PackBf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][kk][2] = PackBf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][kk][3] = PackBf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
    }
    // O += P V.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        const int row = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int col = dp * 16 + ((lane >> 4) << 3);
        LdMatrixX4Trans(b, vt + row * (D + 8) + col);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma16816(o[mt][2 * dp], pa[mt][kk], b[0], b[1]);
          Mma16816(o[mt][2 * dp + 1], pa[mt][kk], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this buffer (and maybe qs)
  }
  CpAsyncWait<0>();
  if constexpr (kWindowed) {
    if (end < n_tiles) {  // more tiles to come: save the state, write nothing
      const WindowState<kStateFields, kBlockThreads> saved(a.window_state, threadIdx.x);
      int f = 0;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int d = 0; d < kDimBlocks; ++d)
#pragma unroll
          for (int e = 0; e < 4; ++e) saved[f++] = o[mt][d][e];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          saved[f++] = m[mt][i];
          saved[f++] = l[mt][i];
        }
      }
      return;
    }
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[mt][i] += __shfl_xor_sync(0xffffffffu, l[mt][i], 1);
      l[mt][i] += __shfl_xor_sync(0xffffffffu, l[mt][i], 2);
      if (!row_valid[mt][i]) continue;
      const float inv = l[mt][i] > 0.f ? 1.f / l[mt][i] : 0.f;
      const int64_t base = q_row[mt][i] * D;
#pragma unroll
      for (int d = 0; d < kDimBlocks; ++d) {
        StorePair(a.out, a.out_dtype, base + d * 8 + tig * 2, o[mt][d][2 * i] * inv,
                  o[mt][d][2 * i + 1] * inv);
      }
    }
  }
}

// ---- split-K decode
// ------------------------------------------------------------------------------

template <typename KvT>
struct DecodeArgsOf {
  PagedKvBatchOf<KvT> kv;
  const int32_t* lengths;
  const Bf16* q;
  int32_t chunk_len;
  int32_t num_q_heads;
  int32_t group;
  int32_t max_splits;
  int64_t orig;        // original_max_position_embeddings
  float scale_log2;    // softmax_scale * log2(e); times s(L) per sequence
  float* partial_out;  // [batch, Hq, max_splits, D]
  float* partial_lse;  // [batch, Hq, max_splits], log2 domain; -inf = empty split
  int32_t min_split_keys = kMinSplitKeys;  // the plan's (CudaKernelPlan::DecodeMinSplitKeys)
  // With one split per row the block's own merge is the row's output: when set (max_splits 1),
  // the kernel stores it as the reduction would (out / out_dtype, or the row's row_outs entry)
  // and no reduction runs.
  bool direct_out = false;
  void* out = nullptr;
  int32_t out_dtype = 0;
  const DecodeRowOut* row_outs = nullptr;
};

// A direct-output decode's store of elements d .. d + 3 of q head `head` of row b: into the row's
// own destination (row_outs) or the batch output, as DcaDecodeReduceKernel stores them. One
// vector store where the address allows (a warp then writes whole contiguous lines, which matters
// when the destination is pinned host memory across the bus), else one store per element (a
// device output need only be aligned to its dtype).
template <int D, typename KvT>
__device__ __forceinline__ void StoreDirect(const DecodeArgsOf<KvT>& a, int b, int64_t head, int d,
                                            float4 x) {
  void* out = a.out;
  int dtype = a.out_dtype;
  int64_t i = (static_cast<int64_t>(b) * a.num_q_heads + head) * D + d;
  if (a.row_outs != nullptr) {
    const DecodeRowOut dst = a.row_outs[b];
    if (dst.out != nullptr) {
      out = dst.out;
      dtype = dst.dtype;
      i = head * D + d;
    }
  }
  cuda_common::StoreQuad(out, dtype, i, x);
}

using DecodeArgs = DecodeArgsOf<Bf16>;

// Keys per split of a row of L keys: ceil(L / max_splits), at least min_keys, rounded up to the
// kernel's tile. Splits are a prefix: split s has keys iff s < DecodeLiveSplits. The minimum keeps
// short rows to a few full splits, so the reduction reads a few partials, not max_splits (which is
// planned for the longest sequence the pool holds); a smaller one spreads a short row over more
// multiprocessors (less latency per block, more partials to merge).
__device__ __forceinline__ int32_t DecodeSplitLen(int32_t len, int32_t max_splits, int32_t tile,
                                                  int32_t min_keys) {
  const int32_t per_split = max((len + max_splits - 1) / max_splits, min_keys);
  return (per_split + tile - 1) / tile * tile;
}
__device__ __forceinline__ int32_t DecodeLiveSplits(int32_t len, int32_t max_splits, int32_t tile,
                                                    int32_t min_keys) {
  if (len < 1) return 0;
  const int32_t split_len = DecodeSplitLen(len, max_splits, tile, min_keys);
  return min(max_splits, (len + split_len - 1) / split_len);
}

// ---- pipelined split-K decode
// -----------------------------------------------------------------------
//
// grid (max_splits, num_kv_heads, batch), block 32 * Warps. Block (s, h, b) covers keys
// [s * split_len, (s + 1) * split_len) of sequence b, split_len = DecodeSplitLen(L, max_splits,
// BN); the group's q heads are the 16 rows of an mma tile (rows >= group read a zero row); each
// warp takes 16 keys of every tile with its own online softmax, written as a partial (output and
// log-sum-exp) that DcaDecodeReduceKernel merges. Built so the memory system sees a steady stream
// of copies (the tuning lab's first split kernel, bench/gpu/lab/, did not):
//  - page indices for a tile are loaded one tile ahead (registers), so issuing a tile's copies
//    never waits on a page-table round trip (the old loader did one dependent page-table load per
//    row before each pair of 16-byte copies);
//  - one __syncthreads per tile: the copies for tile j + Stages - 1 are issued right after the
//    barrier that frees its ring slot;
//  - 16-byte cp.async into unpadded tiles with an XOR swizzle (16-byte chunk c of row r at chunk
//    c ^ (r & 7)), so ldmatrix stays conflict-free without the 6% padding;
//  - Q kept compact in shared memory: the group's 3 x group rows plus one zero row that the mma
//    rows >= group point at, so a 2-stage block fits 3 per multiprocessor at group 7.
// Keys per tile BN = 16 * Warps (each warp takes 16 keys of every tile, as in the split kernel).

// Shared-memory bytes of DcaDecodePipeKernel<D, Warps, Stages> for a GQA group of `group`.
__host__ __device__ constexpr size_t DecodePipeSmemBytes(int d, int warps, int stages, int group) {
  return static_cast<size_t>(2 * stages * 16 * warps) * d * sizeof(Bf16) +
         static_cast<size_t>(3 * group + 1) * (d + 8) * sizeof(Bf16);
}
// The int8 and fp8 instantiations': a ring of codes (one byte an element) and scales, one fp16 V
// tile that the warps convert codes into (each warp its own 16 rows), per mma row and variant the
// query's power-of-two factor, and the query as fp16 mma fragments.
__host__ __device__ constexpr size_t DecodePipeCodesSmemBytes(int d, int warps, int stages,
                                                              int group) {
  (void)group;  // the query's fragments have 16 rows whatever the group
  return static_cast<size_t>(2 * stages * 16 * warps) * d +
         static_cast<size_t>(2 * stages * 16 * warps) * sizeof(float) +
         static_cast<size_t>(16 * warps) * d * sizeof(Bf16) + 3 * 16 * sizeof(float) +
         static_cast<size_t>(3 * (d / 16) * 32) * 16;
}

// 4-byte global->shared copy (a row's scale); when !valid the 4 bytes are zero-filled.
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(SmemAddr(smem)), "l"(gmem),
               "r"(src_size));
}

// The code ring's swizzle: 16-byte chunk c of row r lies at chunk c ^ CodeRingSwizzle<D>(r). A
// lane reads the 16-byte chunk 4g + tig of key row gid (QkFromCodes): rows 2p and 2p + 1 share a
// quarter-warp, and with 128-byte rows (D = 128) both would sit on the same 16 banks unless odd
// rows move by 4 chunks; 64-byte rows (D = 64) already fall on different banks.
template <int D>
__device__ __forceinline__ int CodeRingSwizzle(int r) {
  return D >= 128 ? (r & 1) << 2 : 0;
}

// Codes to exact fp16 without the conversion unit: the biased byte c + 128 goes into the mantissa
// of 1024 (fp16 0x6400: integers exact up to 2048) by one byte permute, and one half2 subtract
// removes 1152 = 1024 + 128. `biased` holds four codes each XORed with 0x80; returns codes 0, 1
// (low) or 2, 3 (high) as a half2, the lower code in the low half.
__device__ __forceinline__ uint32_t CodesToHalf2(uint32_t biased, bool high) {
  const uint32_t h = __byte_perm(biased, 0x64646464u, high ? 0x4342u : 0x4140u);
  const __half2 v =
      __hsub2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x6480u)));
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two E4M3 codes (the low or the high 16 bits of `codes`) to their exact fp16 values, the lower
// code in the low half: every E4M3 value is an fp16 (3 mantissa bits, magnitudes 2^-9 to 448).
// One conversion instruction on compute capability 8.9 and newer.
__device__ __forceinline__ uint32_t Fp8ToHalf2(uint32_t codes, bool high) {
  const uint16_t pair = static_cast<uint16_t>(high ? codes >> 16 : codes & 0xffffu);
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(pair));
  return h;
}

// The fp8 kernel's V tile holds each code's value times 2^-6 (exact: the smallest E4M3 step, 2^-9,
// becomes 2^-15, above fp16's 2^-24) and its weights carry the 2^6, so that the weights of rows
// with small scales stay clear of fp16's subnormals.
inline constexpr float kFp8VShift = 64.f;
__device__ __forceinline__ uint32_t Fp8ToShiftedHalf2(uint32_t codes, bool high) {
  const uint32_t h = Fp8ToHalf2(codes, high);
  const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h),
                            __half2half2(__float2half_rn(1.f / kFp8VShift)));
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One warp's 16 rows of V codes in a code ring slot (CodeRingSwizzle) to their exact fp16 values
// (fp8: times 2^-6, Fp8ToShiftedHalf2) in a [16][D] tile with the bf16 ring's XOR swizzle (16-byte
// chunk c of row r at chunk c ^ (r & 7)), so the bf16 kernel's ldmatrix addressing reads it
// unchanged. The scales stay out: each key's V scale multiplies its softmax weight instead.
template <int D, typename CodeT>
__device__ __forceinline__ void CodesToHalfRows(const uint8_t* codes, uint16_t* dst, int lane) {
  constexpr int kPieces = D / 8;  // 8 codes (one 16-byte fp16 chunk) a piece
#pragma unroll
  for (int p = lane; p < 16 * kPieces; p += 32) {
    const int r = p / kPieces, c = p % kPieces;
    const int src = r * D + (((c >> 1) ^ CodeRingSwizzle<D>(r)) << 4) + (c & 1) * 8;
    const uint2 w = *reinterpret_cast<const uint2*>(codes + src);
    uint4 h;
    if constexpr (std::is_same<CodeT, Int8Kv>::value) {
      const uint32_t x = w.x ^ 0x80808080u, y = w.y ^ 0x80808080u;
      h = make_uint4(CodesToHalf2(x, false), CodesToHalf2(x, true), CodesToHalf2(y, false),
                     CodesToHalf2(y, true));
    } else {
      h = make_uint4(Fp8ToShiftedHalf2(w.x, false), Fp8ToShiftedHalf2(w.x, true),
                     Fp8ToShiftedHalf2(w.y, false), Fp8ToShiftedHalf2(w.y, true));
    }
    *reinterpret_cast<uint4*>(dst + r * D + ((c ^ (r & 7)) << 3)) = h;
  }
}

// The query of the int8 and fp8 decode as fp16 A fragments of Q K^T, in shared memory as
// qf[v][kk][lane] (one uint4 each: a lane's four registers), and per mma row r and variant v the
// factor qinv[v * 16 + r] that undoes its scaling. Each row is scaled by a power of two that puts
// its largest magnitude in [2^14, 2^15), so any bf16 query fits fp16's range and keeps 11
// significant bits. The head dimension is permuted, as the K side reads it (QkFromCodes): in k-step
// kk = 4g + i a lane with tig t holds dimensions 16 (4g + t) + 4i + {0, 1} (k slots 2t, 2t + 1) and
// + {2, 3} (slots 2t + 8, 2t + 9), so its K operand is four consecutive codes of one row. Warp w
// builds variants w, w + Warps, ...; rows >= group are zero.
template <int D, int Warps>
__device__ __forceinline__ void StageInt8Query(const Bf16* q, int64_t q_head0_row, int group,
                                               int num_q_heads, int warp, int lane, uint4* qf,
                                               float* qinv) {
  constexpr int kKSteps = D / 16;
  const int gid = lane / 4, tig = lane % 4;
  for (int v = warp; v < kNumDecodeVariants; v += Warps) {
    uint2 raw[kKSteps][2];
    float mx[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = gid + 8 * r;
      const Bf16* src = q + (q_head0_row + static_cast<int64_t>(v) * num_q_heads + row) * D;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        const int dim = 16 * (4 * (kk / 4) + tig) + 4 * (kk % 4);
        raw[kk][r] = row < group ? *reinterpret_cast<const uint2*>(src + dim) : make_uint2(0, 0);
        const float2 lo =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[kk][r].x));
        const float2 hi =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[kk][r].y));
        mx[r] =
            fmaxf(mx[r], fmaxf(fmaxf(fabsf(lo.x), fabsf(lo.y)), fmaxf(fabsf(hi.x), fabsf(hi.y))));
      }
    }
    float f[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      // 2^e <= max < 2^(e + 1); a row below 2^-100 (scores of ~0 whatever its factor) keeps
      // 2^114 so that the factor stays finite in fp32.
      const int e = mx[r] > 0.f ? max(ilogbf(mx[r]), -100) : 0;
      f[r] = exp2f(static_cast<float>(14 - e));
      if (tig == 0) qinv[v * 16 + gid + 8 * r] = exp2f(static_cast<float>(e - 14));
    }
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t a[4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float2 lo =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[kk][r].x));
        const float2 hi =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[kk][r].y));
        a[r] = cuda_common::PackF16(lo.x * f[r], lo.y * f[r]);      // rows gid, gid + 8: slots 2t..
        a[2 + r] = cuda_common::PackF16(hi.x * f[r], hi.y * f[r]);  // slots 2t + 8..
      }
      qf[(v * kKSteps + kk) * 32 + lane] = make_uint4(a[0], a[1], a[2], a[3]);
    }
  }
}

// Q K^T of a warp's 16 keys (rows `codes`, [16][D] of a code ring slot, CodeRingSwizzle) for the
// variants v_lo..v_hi, in fp16 on the codes' exact values: s[nb][e] becomes the score of key kw +
// nb * 8 + 2 tig + (e & 1) with the variant of that key, for mma row gid (e < 2) or gid + 8, times
// the key's K scale and the row's query factor (StageInt8Query); s is left alone for keys of other
// variants. A lane's K operand for k-step 4g + i is word i of chunk 4g + tig of its key row (the
// dimension order StageInt8Query gives the query), so the codes go from one 16-byte load to the
// mma.
template <int D, typename CodeT>
__device__ __forceinline__ void QkFromCodes(const uint8_t* codes, const uint4* qf,
                                            const float* qinv, const float* kscale, int32_t kw,
                                            int32_t prev, int32_t cl, int v_lo, int v_hi, int lane,
                                            float (&s)[2][4]) {
  constexpr int kKSteps = D / 16, kGroups = D / 64;
  const int gid = lane / 4, tig = lane % 4;
  uint4 kc[2][kGroups];
  float ksc[2][2];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    const int row = nb * 8 + gid;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      uint4 w = *reinterpret_cast<const uint4*>(codes + row * D +
                                                (((4 * g + tig) ^ CodeRingSwizzle<D>(row)) << 4));
      if constexpr (std::is_same<CodeT, Int8Kv>::value) {
        w.x ^= 0x80808080u;
        w.y ^= 0x80808080u;
        w.z ^= 0x80808080u;
        w.w ^= 0x80808080u;
      }
      kc[nb][g] = w;
    }
    ksc[nb][0] = kscale[nb * 8 + 2 * tig];
    ksc[nb][1] = kscale[nb * 8 + 2 * tig + 1];
  }
  for (int v = v_lo; v <= v_hi; ++v) {  // usually one variant; two or three at a boundary
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const uint4 q4 = qf[(v * kKSteps + kk) * 32 + lane];
      const uint32_t qa[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        const uint4& w = kc[nb][kk / 4];
        const int i = kk % 4;
        const uint32_t word = i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
        if constexpr (std::is_same<CodeT, Int8Kv>::value) {
          cuda_common::Mma16816F16(acc[nb], qa, CodesToHalf2(word, false),
                                   CodesToHalf2(word, true));
        } else {
          cuda_common::Mma16816F16(acc[nb], qa, Fp8ToHalf2(word, false), Fp8ToHalf2(word, true));
        }
      }
    }
    const float row_factor[2] = {qinv[v * 16 + gid], qinv[v * 16 + gid + 8]};
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t key = kw + nb * 8 + tig * 2 + (e & 1);
        if (VariantOfKey(key, prev, cl) == v) {
          s[nb][e] = acc[nb][e] * ksc[nb][e & 1] * row_factor[e >> 1];
        }
      }
  }
}

// P V of a warp's 16 keys straight from their V codes (rows `codes`, [16][D] of a code ring slot,
// CodeRingSwizzle) without an fp16 tile: each lane loads the codes of keys 2 tig, 2 tig + 1,
// 2 tig + 8 and 2 tig + 9 at dims [gid * D / 8, (gid + 1) * D / 8) and pairs them into its B
// fragments itself (a byte permute, then the codes' fp16 values as CodesToHalfRows gives them), so
// column n of n-block j is dim n * D / 8 + j: o[j] holds that permuted block. The tuning lab's
// candidate for the one-byte kernels (DcaDecodePipeBody with VRegs); pa: the weights' A fragment.
template <int D, typename CodeT>
__device__ __forceinline__ void PvFromCodes(const uint8_t* codes, const uint32_t (&pa)[4], int lane,
                                            float (&o)[D / 8][4]) {
  constexpr int kDims = D / 8;       // dims of one lane: 16 (D = 128) or 8 (D = 64)
  constexpr int kWords = kDims / 4;  // 32-bit words of them per key
  const int gid = lane / 4, tig = lane % 4;
  const int byte = gid * kDims;
  uint32_t w[4][kWords];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = 2 * tig + (r & 1) + (r >> 1) * 8;
    const uint8_t* src =
        codes + row * D + (((byte >> 4) ^ CodeRingSwizzle<D>(row)) << 4) + (byte & 15);
    if constexpr (kWords == 4) {
      const uint4 x = *reinterpret_cast<const uint4*>(src);
      w[r][0] = x.x;
      w[r][1] = x.y;
      w[r][2] = x.z;
      w[r][3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(src);
      w[r][0] = x.x;
      w[r][1] = x.y;
    }
  }
  auto half2_of = [](uint32_t pair_codes, bool high) {
    if constexpr (std::is_same<CodeT, Int8Kv>::value) {
      return CodesToHalf2(pair_codes ^ 0x80808080u, high);
    } else {
      return Fp8ToShiftedHalf2(pair_codes, high);
    }
  };
#pragma unroll
  for (int q = 0; q < kWords; ++q) {
    // Keys (2 tig, 2 tig + 1) and (2 tig + 8, 2 tig + 9) interleaved: dims 4q, 4q + 1 | 4q + 2, 4q
    // + 3.
    const uint32_t lo = __byte_perm(w[0][q], w[1][q], 0x5140),
                   hi = __byte_perm(w[0][q], w[1][q], 0x7362);
    const uint32_t lo8 = __byte_perm(w[2][q], w[3][q], 0x5140),
                   hi8 = __byte_perm(w[2][q], w[3][q], 0x7362);
    cuda_common::Mma16816F16(o[4 * q], pa, half2_of(lo, false), half2_of(lo8, false));
    cuda_common::Mma16816F16(o[4 * q + 1], pa, half2_of(lo, true), half2_of(lo8, true));
    cuda_common::Mma16816F16(o[4 * q + 2], pa, half2_of(hi, false), half2_of(hi8, false));
    cuda_common::Mma16816F16(o[4 * q + 3], pa, half2_of(hi, true), half2_of(hi8, true));
  }
}

// Where a decode block's warps spend their cycles, for the tuning lab: the kernel's body calls
// probe.Mark(phase) as each phase of a tile ends (and once before the loop and once at the end);
// the product's kernel passes NoDecodeProbe, whose calls compile to nothing.
enum DecodeProbePhase : int {
  kProbePrologue = 0,  // Q staging, the first tiles' copies issued
  kProbeWait = 1,      // waiting for tile j (cp.async + barrier), issuing tile j + Stages - 1
  kProbeConvert = 2,   // one-byte pools: V codes to the fp16 tile
  kProbeQk = 3,        // Q K^T
  kProbeSoftmax = 4,   // mask, online softmax, the weights
  kProbePv = 5,        // P V
  kProbeMerge = 6,     // the warps' merge and the partial's store
  kNumProbePhases = 7
};
struct NoDecodeProbe {
  __device__ __forceinline__ void Mark(int) {}
};

// KvT = Bf16: the bf16 pool. KvT = Int8Kv or Fp8E4m3: a pool of scaled codes; the ring holds
// codes and scales. Q K^T runs in fp16 on the codes' exact values read straight from the ring into
// registers (QkFromCodes), each key's K scale and the row's query factor multiply its score after
// the mma; each warp turns its 16 rows of V codes into fp16 in a tile that P V reads as the bf16
// kernel does, with each key's V scale folded into its weight (fp16). VRegs (one-byte pools, the
// tuning lab's candidate): P V from the codes in registers (PvFromCodes), no fp16 V tile.
template <int D, int Warps, int Stages, typename KvT, typename Probe, bool VRegs = false>
__device__ __forceinline__ void DcaDecodePipeBody(const DecodeArgsOf<KvT> a, Probe& probe) {
  cuda_common::StepKernelEntry();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr bool kInt8 = kScaledKv<KvT>;  // int8 or fp8: one-byte codes and row scales
  static_assert(kInt8 || !VRegs, "P V from registers reads one-byte codes");
  // fp8: the V tile's values are the codes' times 2^-6 (CodesToHalfRows), so the weights carry 2^6.
  constexpr float kVShift = std::is_same<KvT, Fp8E4m3>::value ? kFp8VShift : 1.f;
  constexpr int kT = Warps * 32;
  constexpr int BN = 16 * Warps;
  constexpr int kPitch = D;  // K/V row pitch in elements
  constexpr int kTile = BN * kPitch;
  constexpr int kKSteps = D / 16;
  constexpr int kDimBlocks = D / 8;
  constexpr int kChunks = D * static_cast<int>(sizeof(KvT)) / 16;  // 16-byte chunks per row
  // cp.async loader: thread t copies chunk t % kChunks of rows t / kChunks + i * kRowsPerPass.
  constexpr int kRowsPerPass = kT / kChunks;
  constexpr int kPasses = BN / kRowsPerPass;
  constexpr int kPages = kPasses;  // page-table entries a thread holds for one tile
  static_assert(kRowsPerPass % 8 == 0 && BN % kRowsPerPass == 0, "loader shape");

  // bf16: ks, vs [Stages][BN][kPitch] bf16, then qs. int8: codes ks, vs [Stages][BN][D], scales
  // kss, vss [Stages][BN], the warps' fp16 V tile vh [BN][D], then qinv [3][16] and qf
  // (StageInt8Query).
  KvT* ks = reinterpret_cast<KvT*>(smem_raw);
  KvT* vs = ks + Stages * kTile;
  float* kss = reinterpret_cast<float*>(vs + Stages * kTile);
  float* vss = kss + Stages * BN;
  uint16_t* vh = reinterpret_cast<uint16_t*>(vss + Stages * BN);
  float* qinv = reinterpret_cast<float*>(vh + (VRegs ? 0 : kTile));
  uint4* qf = reinterpret_cast<uint4*>(qinv + kNumDecodeVariants * 16);
  Bf16* qs = reinterpret_cast<Bf16*>(vs + Stages * kTile);
  // [3 * group + 1][D + 8], last row zero
  const int group = a.group;

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int32_t len = a.lengths[b];
  const int32_t split_len = DecodeSplitLen(len, a.max_splits, BN, a.min_split_keys);
  const int32_t k_begin = split * split_len;
  const int32_t k_end = min(len, k_begin + split_len);
  if (k_begin >= k_end) {  // empty split (or a length-0 padding row): mark it and leave
    if (a.direct_out) {    // the row's output is zeros, as the reduction writes it
      for (int e = 4 * threadIdx.x; e < group * D; e += 4 * kT) {
        StoreDirect<D>(a, b, int64_t{kv_head} * group + e / D, e % D,
                       make_float4(0.f, 0.f, 0.f, 0.f));
      }
      return;
    }
    if (threadIdx.x < group) {
      const int64_t head = kv_head * group + threadIdx.x;
      a.partial_lse[(static_cast<int64_t>(b) * a.num_q_heads + head) * a.max_splits + split] =
          -CUDART_INF_F;
    }
    return;
  }
  const int32_t* page_table = a.kv.page_tables + b * a.kv.page_table_stride;
  const uint32_t ps = static_cast<uint32_t>(a.kv.page_size);
  const PageIndexer pages(a.kv.page_size);  // power-of-two pages: a shift and a mask
  auto page_of = [&](uint32_t pos) { return pages.Page(pos); };
  auto in_page = [&](uint32_t pos) { return pages.Slot(pos); };
  const int64_t row_stride = static_cast<int64_t>(a.kv.num_kv_heads) * D;  // elements per token
  const KvT* kbase = a.kv.k + static_cast<int64_t>(kv_head) * D;
  const KvT* vbase = a.kv.v + static_cast<int64_t>(kv_head) * D;
  const int32_t cl = a.chunk_len;
  const int32_t prev = ((len - 1) / cl) * cl;  // the query is at position len - 1
  const float scale_log2 = a.scale_log2 * LengthScale(len, a.orig);
  const int n_tiles = (k_end - k_begin + BN - 1) / BN;

  // This thread's rows of a tile (relative to the tile's first key).
  const int ld_chunk = threadIdx.x % kChunks;
  const int ld_row0 = static_cast<int>(threadIdx.x) / kChunks;
  // The swizzled column in the tile: bf16's XOR of the row's low 3 bits, int8's CodeRingSwizzle
  // (rows ld_row0 + i * kRowsPerPass share both, kRowsPerPass being a multiple of 8).
  const int ld_col =
      kInt8 ? (ld_chunk ^ CodeRingSwizzle<D>(ld_row0)) << 4 : (ld_chunk ^ (ld_row0 & 7)) << 3;

  // Page indices of this thread's rows of tile t (0 for rows past k_end: never dereferenced).
  auto load_pages = [&](int t, int32_t(&pg)[kPages]) {
    const int32_t k0 = k_begin + t * BN;
#pragma unroll
    for (int i = 0; i < kPages; ++i) {
      const int32_t pos = k0 + ld_row0 + i * kRowsPerPass;
      pg[i] = pos < k_end ? __ldg(page_table + page_of(static_cast<uint32_t>(pos))) : 0;
    }
  };
  // Issues this thread's copies of tile t into ring slot `slot`.
  auto issue_tile = [&](int t, const int32_t(&pg)[kPages], int slot) {
    const int32_t k0 = k_begin + t * BN;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = ld_row0 + i * kRowsPerPass;
      const int32_t pos = k0 + row;
      const bool valid = pos < k_end;
      const int64_t tok = PagedTokenIndex(pg[i], in_page(static_cast<uint32_t>(pos)), ps);
      const int64_t off = valid ? tok * row_stride + ld_chunk * (16 / sizeof(KvT)) : 0;
      const int so = slot * kTile + row * kPitch + ld_col;
      CpAsync16(ks + so, kbase + off, valid);
      CpAsync16(vs + so, vbase + off, valid);
      if constexpr (kInt8) {
        if (ld_chunk == 0) {  // the row's scales, in the same commit group
          const int64_t sc = valid ? tok * a.kv.num_kv_heads + kv_head : 0;
          CpAsync4(kss + slot * BN + row, a.kv.k_scale + sc, valid);
          CpAsync4(vss + slot * BN + row, a.kv.v_scale + sc, valid);
        }
      }
    }
  };

  // Stage Q (bf16): rows v * group + r, and the zero row 3 * group. Q is bf16 whatever the pool
  // holds, so its rows have D / 8 16-byte chunks (kChunks counts the pool's). The int8 kernel
  // builds its fp16 fragments once the first tiles are on their way.
  constexpr int kQChunks = D / 8;
  for (int c = threadIdx.x; !kInt8 && c < 3 * group * kQChunks; c += kT) {
    const int row = c / kQChunks;  // v * group + r
    const int v = row / group, r = row % group;
    const int col = (c % kQChunks) * 8;
    const Bf16* src =
        a.q +
        ((static_cast<int64_t>(b) * kNumDecodeVariants + v) * a.num_q_heads + kv_head * group + r) *
            D +
        col;
    CpAsync16(qs + row * (D + 8) + col, src, true);
  }
  for (int c = threadIdx.x; !kInt8 && c < kQChunks; c += kT) {
    *reinterpret_cast<uint4*>(qs + 3 * group * (D + 8) + c * 8) = make_uint4(0, 0, 0, 0);
  }

  int32_t pg[kPages];
  for (int t = 0; t < Stages - 1; ++t) {  // prologue (the Q staging joins the first group)
    if (t < n_tiles) {
      load_pages(t, pg);
      issue_tile(t, pg, t);
    }
    CpAsyncCommit();
  }
  if (Stages - 1 < n_tiles) load_pages(Stages - 1, pg);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, tig = lane % 4;
  if constexpr (kInt8) {  // visible to every warp after the loop's first barrier
    StageInt8Query<D, Warps>(
        a.q, static_cast<int64_t>(b) * kNumDecodeVariants * a.num_q_heads + kv_head * group, group,
        a.num_q_heads, warp, lane, qf, qinv);
  }
  // This lane's ldmatrix row of Q for variant v: row (lane & 15) of the mma tile, or the zero row.
  const int q_lane_row = lane & 15;
  const bool q_lane_valid = q_lane_row < group;
  float o[kDimBlocks][4];
#pragma unroll
  for (int d = 0; d < kDimBlocks; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  SoftmaxState softmax;
  softmax.Init();
  probe.Mark(kProbePrologue);

  for (int j = 0; j < n_tiles; ++j) {
    const int slot = j % Stages;
    CpAsyncWait<Stages - 2>();  // this thread's copies of tile j (and the Q staging) have landed
    __syncthreads();            // tile j visible to all; every warp is done with tile j - 1's slot
    {
      const int t = j + Stages - 1;
      if (t < n_tiles) issue_tile(t, pg, t % Stages);
      CpAsyncCommit();
      if (t + 1 < n_tiles) load_pages(t + 1, pg);
    }
    probe.Mark(kProbeWait);
    if constexpr (kInt8) {
      const int32_t kw = k_begin + j * BN + warp * 16;  // first key of this warp's slice
      if (kw < k_end) {
        const int first_row = slot * BN + warp * 16;
        uint16_t* vt = vh + warp * 16 * kPitch;
        if constexpr (!VRegs) {
          // The barrier above ordered this warp's reads of its rows of vh (the previous tile)
          // before these writes; __syncwarp orders them before this tile's ldmatrix.
          CodesToHalfRows<D, KvT>(reinterpret_cast<const uint8_t*>(vs) + first_row * D, vt, lane);
          __syncwarp();
        }
        probe.Mark(kProbeConvert);
        float s[2][4];
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
        QkFromCodes<D, KvT>(reinterpret_cast<const uint8_t*>(ks) + first_row * D, qf, qinv,
                            kss + first_row, kw, prev, cl,
                            VariantOfKey(min(kw + 15, k_end - 1), prev, cl),
                            VariantOfKey(kw, prev, cl), lane, s);
        probe.Mark(kProbeQk);
        float alpha[2];
        cuda_common::ApplyMask(cuda_common::Flat(s), tig, RangeMask(kw, k_end, false, 0, 0));
        softmax.Update(cuda_common::Flat(s), scale_log2, alpha);
        cuda_common::RescaleRows(cuda_common::Flat(o), alpha);
        // P V with each key's V scale in its weight: fp16 weights over the exact fp16 codes.
        const float* vsc = vss + first_row + 2 * tig;  // keys 2 tig, 2 tig + 1, then + 8
        uint32_t pa[4];
        if constexpr (kVShift == 1.f) {
          pa[0] = cuda_common::PackF16(s[0][0] * vsc[0], s[0][1] * vsc[1]);
          pa[1] = cuda_common::PackF16(s[0][2] * vsc[0], s[0][3] * vsc[1]);
          pa[2] = cuda_common::PackF16(s[1][0] * vsc[8], s[1][1] * vsc[9]);
          pa[3] = cuda_common::PackF16(s[1][2] * vsc[8], s[1][3] * vsc[9]);
        } else {
          const float w[4] = {vsc[0] * kVShift, vsc[1] * kVShift, vsc[8] * kVShift,
                              vsc[9] * kVShift};
          pa[0] = cuda_common::PackF16(s[0][0] * w[0], s[0][1] * w[1]);
          pa[1] = cuda_common::PackF16(s[0][2] * w[0], s[0][3] * w[1]);
          pa[2] = cuda_common::PackF16(s[1][0] * w[2], s[1][1] * w[3]);
          pa[3] = cuda_common::PackF16(s[1][2] * w[2], s[1][3] * w[3]);
        }
        probe.Mark(kProbeSoftmax);
        if constexpr (VRegs) {
          PvFromCodes<D, KvT>(reinterpret_cast<const uint8_t*>(vs) + first_row * D, pa, lane, o);
        } else {
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t vb[4];
            const int vr = (lane & 7) + (((lane >> 3) & 1) << 3);
            const int vc = dp * 2 + (lane >> 4);
            LdMatrixX4Trans(vb, vt + vr * kPitch + ((vc ^ (vr & 7)) << 3));
            cuda_common::Mma16816F16(o[2 * dp], pa, vb[0], vb[1]);
            cuda_common::Mma16816F16(o[2 * dp + 1], pa, vb[2], vb[3]);
          }
        }
        probe.Mark(kProbePv);
      }
    } else {
      Bf16* kt = ks + slot * kTile + warp * 16 * kPitch;  // this warp's 16 keys
      Bf16* vt = vs + slot * kTile + warp * 16 * kPitch;
      const int32_t kw = k_begin + j * BN + warp * 16;  // first key of this warp's slice
      if (kw < k_end) {
        const int v_hi = VariantOfKey(kw, prev, cl);  // largest variant index
        const int v_lo = VariantOfKey(min(kw + 15, k_end - 1), prev, cl);
        float s[2][4];
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
        for (int v = v_lo; v <= v_hi; ++v) {  // usually one variant; two or three at a boundary
          float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
          const Bf16* qrow = qs + (q_lane_valid ? v * group + q_lane_row : 3 * group) * (D + 8);
#pragma unroll
          for (int kk = 0; kk < kKSteps; ++kk) {
            uint32_t qa[4], kb[4];
            LdMatrixX4(qa, qrow + kk * 16 + (lane >> 4) * 8);
            const int kr = (lane & 7) + ((lane >> 4) << 3);
            const int kc = kk * 2 + ((lane >> 3) & 1);
            LdMatrixX4(kb, kt + kr * kPitch + ((kc ^ (kr & 7)) << 3));
            Mma16816(acc[0], qa, kb[0], kb[1]);
            Mma16816(acc[1], qa, kb[2], kb[3]);
          }
#pragma unroll
          for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int32_t key = kw + nb * 8 + tig * 2 + (e & 1);
              if (VariantOfKey(key, prev, cl) == v) s[nb][e] = acc[nb][e];
            }
        }
        probe.Mark(kProbeQk);
        uint32_t pa[1][4];
        SoftmaxTile(s, tig, RangeMask(kw, k_end, false, 0, 0), scale_log2, softmax, o, pa);
        probe.Mark(kProbeSoftmax);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t vb[4];
          const int vr = (lane & 7) + (((lane >> 3) & 1) << 3);
          const int vc = dp * 2 + (lane >> 4);
          LdMatrixX4Trans(vb, vt + vr * kPitch + ((vc ^ (vr & 7)) << 3));
          Mma16816(o[2 * dp], pa[0], vb[0], vb[1]);
          Mma16816(o[2 * dp + 1], pa[0], vb[2], vb[3]);
        }
        probe.Mark(kProbePv);
      }
    }
  }
  CpAsyncWait<0>();

  // Merge the warps: per-warp (m, l, O) of the group's rows through shared memory (reusing the K/V
  // ring: every warp has passed its last tile once all have reached the barrier below).
  softmax.ReduceQuad();
  float* so = reinterpret_cast<float*>(smem_raw);  // [Warps][16][D]
  float* sm = so + Warps * 16 * D;                 // [Warps][16]
  float* sl = sm + Warps * 16;                     // [Warps][16]
  // (int8: the ring, its scales and the fp16 V tile, which lie before the query's fragments.)
  static_assert(
      (Warps * 16 * D + 2 * Warps * 16) * sizeof(float) <=
          2 * Stages * BN * kPitch * sizeof(KvT) +
              (kInt8 ? 2 * Stages * BN * sizeof(float) + (VRegs ? 0 : kTile) * sizeof(uint16_t)
                     : 0),
      "merge scratch must fit in the K/V ring");
  __syncthreads();
  if constexpr (VRegs) {  // block j's columns n are dims n * D / 8 + j (PvFromCodes)
#pragma unroll
    for (int d = 0; d < kDimBlocks; ++d) {
      const int c0 = (2 * tig) * kDimBlocks + d, c1 = c0 + kDimBlocks;
      so[(warp * 16 + gid) * D + c0] = o[d][0];
      so[(warp * 16 + gid) * D + c1] = o[d][1];
      so[(warp * 16 + gid + 8) * D + c0] = o[d][2];
      so[(warp * 16 + gid + 8) * D + c1] = o[d][3];
    }
  } else {
#pragma unroll
    for (int d = 0; d < kDimBlocks; ++d) {
      const int col = d * 8 + tig * 2;
      *reinterpret_cast<float2*>(&so[(warp * 16 + gid) * D + col]) = make_float2(o[d][0], o[d][1]);
      *reinterpret_cast<float2*>(&so[(warp * 16 + gid + 8) * D + col]) =
          make_float2(o[d][2], o[d][3]);
    }
  }
  if (tig == 0) {  // maxima to the log2 domain of the partials' log-sum-exp
    sm[warp * 16 + gid] = softmax.m[0] * scale_log2;
    sm[warp * 16 + gid + 8] = softmax.m[1] * scale_log2;
    sl[warp * 16 + gid] = softmax.l[0];
    sl[warp * 16 + gid + 8] = softmax.l[1];
  }
  __syncthreads();
  // Thread -> (row r, 4 consecutive dims): 16-byte partial writes.
  for (int idx = threadIdx.x; idx < group * (D / 4); idx += kT) {
    const int r = idx / (D / 4), d4 = (idx % (D / 4)) * 4;
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < Warps; ++w) mx = fmaxf(mx, sm[w * 16 + r]);
    float lsum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < Warps; ++w) {
      const float mw = sm[w * 16 + r];
      if (mw == -CUDART_INF_F) continue;
      const float wgt = exp2f(mw - mx);
      lsum += sl[w * 16 + r] * wgt;
      const float4 x = *reinterpret_cast<const float4*>(&so[(w * 16 + r) * D + d4]);
      acc.x += x.x * wgt;
      acc.y += x.y * wgt;
      acc.z += x.z * wgt;
      acc.w += x.w * wgt;
    }
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const int64_t head = kv_head * group + r;
    if (a.direct_out) {
      StoreDirect<D>(a, b, head, d4,
                     make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
      continue;
    }
    const int64_t slot = (static_cast<int64_t>(b) * a.num_q_heads + head) * a.max_splits + split;
    *reinterpret_cast<float4*>(&a.partial_out[slot * D + d4]) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if (d4 == 0) a.partial_lse[slot] = lsum > 0.f ? mx + log2f(lsum) : -CUDART_INF_F;
  }
  probe.Mark(kProbeMerge);
}

template <int D, int Warps, int Stages, typename KvT = Bf16>
__global__ void __launch_bounds__(Warps * 32) DcaDecodePipeKernel(const DecodeArgsOf<KvT> a) {
  NoDecodeProbe probe;
  DcaDecodePipeBody<D, Warps, Stages, KvT>(a, probe);
}

// grid (batch, num_q_heads), block kDecodeReduceThreads: out = sum_s w_s * partial_out_s with
// w_s = 2^(lse_s - max) / sum over the row's live splits (DecodeLiveSplits with the split kernel's
// tile and minimum), skipping empty ones. A row with a row_outs entry is stored there, in its
// dtype. Latency-bound at small batches (a few blocks, each a chain of loads): the weights are
// computed once into shared memory by the whole block, then groups of D / 4 threads (a float4
// each) take every kGroups-th split, four loads in flight per thread, and the groups' sums meet in
// shared memory. A single thread walking the splits in order waited out one load per split.
inline constexpr int kDecodeReduceThreads = 256;
inline constexpr int kDecodeReduceMaxSplits = 1024;  // DecodeSplitsFor's ceiling
template <int D>
__global__ void __launch_bounds__(kDecodeReduceThreads)
    DcaDecodeReduceKernel(const float* partial_out, const float* partial_lse,
                          const int32_t* lengths, int max_splits, int split_tile,
                          int min_split_keys, void* out, int out_dtype,
                          const DecodeRowOut* row_outs = nullptr) {
  constexpr int kT = kDecodeReduceThreads, kWarps = kT / 32;
  constexpr int kLanes = D / 4, kGroups = kT / kLanes;  // threads per split row, rows at once
  static_assert(kT % kLanes == 0, "a whole number of split rows per pass");
  __shared__ float weight[kDecodeReduceMaxSplits];
  __shared__ float4 sums[kGroups][kLanes];
  __shared__ float red[kWarps];
  cuda_common::StepKernelEntry();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y;
  const int live = min(kDecodeReduceMaxSplits, DecodeLiveSplits(lengths[blockIdx.x], max_splits,
                                                                split_tile, min_split_keys));
  const float* lse = partial_lse + slot * max_splits;
  // Output element tid of this (row, head): to the row's own destination if it has one.
  auto store = [&](float o) {
    if (row_outs != nullptr) {
      const DecodeRowOut dst = row_outs[blockIdx.x];
      if (dst.out != nullptr) {
        StoreOne(dst.out, dst.dtype, static_cast<int64_t>(blockIdx.y) * D + tid, o);
        return;
      }
    }
    StoreOne(out, out_dtype, slot * D + tid, o);
  };
  if (live <= 1) {  // one split (or none): its partial is the output (weight 1 / 1, or zeros)
    if (tid < D) {
      store(live == 1 && lse[0] != -CUDART_INF_F ? partial_out[slot * max_splits * D + tid] : 0.f);
    }
    return;
  }
  // The block's maximum, then each split's weight and the weights' sum.
  float mx = -CUDART_INF_F;
  for (int s = tid; s < live; s += kT) mx = fmaxf(mx, lse[s]);
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();  // red is reused for the sum
  float wsum = 0.f;
  for (int s = tid; s < live; s += kT) {
    const float x = lse[s];
    const float w = x == -CUDART_INF_F ? 0.f : exp2f(x - mx);
    weight[s] = w;
    wsum += w;
  }
  for (int o = 16; o > 0; o /= 2) wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
  if (lane == 0) red[warp] = wsum;
  __syncthreads();  // also publishes the weights
  wsum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) wsum += red[w];
  // Group g sums splits g, g + kGroups, ...; an empty split (weight 0) may hold stale values, so
  // its term is selected away rather than multiplied by zero.
  const int group = tid / kLanes, d4 = (tid % kLanes) * 4;
  const float* po = partial_out + slot * max_splits * D + d4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = group; s0 < live; s0 += 4 * kGroups) {
    float w[4];
    float4 x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // every load issued before the first is used
      const int s = s0 + k * kGroups;
      w[k] = s < live ? weight[s] : 0.f;
      x[k] = s < live ? *reinterpret_cast<const float4*>(po + static_cast<int64_t>(s) * D)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (w[k] > 0.f) {
        acc.x += w[k] * x[k].x;
        acc.y += w[k] * x[k].y;
        acc.z += w[k] * x[k].z;
        acc.w += w[k] * x[k].w;
      }
    }
  }
  sums[group][tid % kLanes] = acc;
  __syncthreads();
  if (tid >= D) return;
  const int lane4 = tid / 4, e = tid % 4;  // output element tid = 4 * lane4 + e
  float o = 0.f;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const float4 v = sums[g][lane4];
    o += e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
  }
  store(wsum > 0.f ? o / wsum : 0.f);
}

}  // namespace cuda_kernels
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_DCA_CUDA_KERNELS_CUH_
