// The tuning lab's first split-K decode kernel (bench/gpu/lab/README.md): K/V tiles of 64 keys in
// padded rows, one page-table lookup per row right before its copies, two barriers per tile. The
// product's pipelined kernel (kernels/cuda/dca_cuda_kernels.cuh, DcaDecodePipeKernel) replaced it;
// it stays here as the baseline of the decode sweep. Same contract, grid, workspace and reduction
// (DcaDecodeReduceKernel with a tile of kBlockN) as the product kernel. Not linked into the daemon.
#ifndef ATTND_BENCH_GPU_LAB_DECODE_SPLIT_LAB_CUH_
#define ATTND_BENCH_GPU_LAB_DECODE_SPLIT_LAB_CUH_

#include <cuda_bf16.h>
#include <math_constants.h>

#include <cstdint>

#include "kernels/cuda/dca_cuda_kernels.cuh"

namespace attnd {
namespace cuda_kernels {
namespace lab {

// Shared-memory bytes of DcaDecodeSplitKernel<D, Stages>: the K and V rings and the 3 x 16 rows of
// the group's queries, all padded rows.
template <int D, int Stages>
constexpr size_t DecodeSplitSmemBytes() {
  return (2 * Stages * kBlockN + 3 * 16) * (D + 8) * sizeof(Bf16);
}

// grid (max_splits, num_kv_heads, batch), block kThreads. Block (s, h, b): keys
// [s * split_len, (s + 1) * split_len) of sequence b, split_len = DecodeSplitLen(L, max_splits,
// 64). The group's q heads are the 16 rows of an mma tile (rows >= group are zero); each warp takes
// 16 keys of every 64-key tile with its own online softmax; the four warps merge through shared
// memory.
template <int D, int Stages>
__global__ void __launch_bounds__(kThreads) DcaDecodeSplitKernel(const DecodeArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kTile = kBlockN * (D + 8);
  constexpr int kKSteps = D / 16;
  constexpr int kDimBlocks = D / 8;
  Bf16* ks = reinterpret_cast<Bf16*>(smem_raw);  // [Stages][kBlockN][D + 8]
  Bf16* vs = ks + Stages * kTile;                // [Stages][kBlockN][D + 8]
  Bf16* qs = vs + Stages * kTile;                // [3][16][D + 8]

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int32_t len = a.lengths[b];
  const int32_t split_len = DecodeSplitLen(len, a.max_splits, kBlockN, a.min_split_keys);
  const int32_t k_begin = split * split_len;
  const int32_t k_end = min(len, k_begin + split_len);
  if (k_begin >= k_end) {  // empty split: mark it and leave
    if (threadIdx.x < a.group) {
      const int64_t head = kv_head * a.group + threadIdx.x;
      a.partial_lse[(static_cast<int64_t>(b) * a.num_q_heads + head) * a.max_splits + split] =
          -CUDART_INF_F;
    }
    return;
  }
  const PagedKv<Bf16> kv = a.kv.Seq(b);
  const int32_t cl = a.chunk_len;
  const int32_t prev = ((len - 1) / cl) * cl;  // the query is at position len - 1
  const float scale_log2 = a.scale_log2 * LengthScale(len, a.orig);

  // Stage Q: [3][16][D+8], rows >= group zero.
  {
    constexpr int kChunksPerRow = D / 8;
    for (int c = threadIdx.x; c < 3 * 16 * kChunksPerRow; c += kThreads) {
      const int v = c / (16 * kChunksPerRow);
      const int r = (c / kChunksPerRow) % 16;
      const int col = (c % kChunksPerRow) * 8;
      const bool valid = r < a.group;
      const Bf16* src = a.q +
                        ((static_cast<int64_t>(b) * kNumDecodeVariants + v) * a.num_q_heads +
                         kv_head * a.group + (valid ? r : 0)) *
                            D +
                        col;
      CpAsync16(qs + (v * 16 + r) * (D + 8) + col, src, valid);
    }
  }
  const int n_tiles = (k_end - k_begin + kBlockN - 1) / kBlockN;
  for (int t = 0; t < Stages - 1; ++t) {  // prologue (the Q staging joins the first group)
    if (t < n_tiles) {
      LoadKvTile<D>(kv, kv_head, k_begin + t * kBlockN, k_end, ks + t * kTile, vs + t * kTile);
    }
    CpAsyncCommit();
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, tig = lane % 4;
  float o[kDimBlocks][4];
  for (int d = 0; d < kDimBlocks; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  SoftmaxState softmax;
  softmax.Init();

  for (int j = 0; j < n_tiles; ++j) {
    if (j + Stages - 1 < n_tiles) {
      const int t = j + Stages - 1;
      LoadKvTile<D>(kv, kv_head, k_begin + t * kBlockN, k_end, ks + (t % Stages) * kTile,
                    vs + (t % Stages) * kTile);
    }
    CpAsyncCommit();
    CpAsyncWait<Stages - 1>();  // tile j (and the Q staging) has landed
    __syncthreads();
    const Bf16* kt = ks + (j % Stages) * kTile + warp * 16 * (D + 8);  // this warp's 16 keys
    const Bf16* vt = vs + (j % Stages) * kTile + warp * 16 * (D + 8);
    const int32_t kw = k_begin + j * kBlockN + warp * 16;  // first key of this warp's slice
    if (kw < k_end) {
      const int v_hi = VariantOfKey(kw, prev, cl);  // largest variant index
      const int v_lo = VariantOfKey(min(kw + 15, k_end - 1), prev, cl);
      float s[2][4];
      for (int nb = 0; nb < 2; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
      for (int v = v_lo; v <= v_hi; ++v) {  // usually one variant; two or three at a boundary
        float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const Bf16* qv = qs + v * 16 * (D + 8);
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          uint32_t qa[4], kb[4];
          LdMatrixX4(qa, qv + (lane & 15) * (D + 8) + kk * 16 + (lane >> 4) * 8);
          LdMatrixX4(kb, kt + ((lane & 7) + ((lane >> 4) << 3)) * (D + 8) + kk * 16 +
                             ((lane >> 3) & 1) * 8);
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
      uint32_t pa[1][4];
      SoftmaxTile(s, tig, RangeMask(kw, k_end, false, 0, 0), scale_log2, softmax, o, pa);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        LdMatrixX4Trans(vb, vt + ((lane & 7) + (((lane >> 3) & 1) << 3)) * (D + 8) + dp * 16 +
                                ((lane >> 4) << 3));
        Mma16816(o[2 * dp], pa[0], vb[0], vb[1]);
        Mma16816(o[2 * dp + 1], pa[0], vb[2], vb[3]);
      }
    }
    __syncthreads();
  }
  CpAsyncWait<0>();

  // Merge the four warps: per-warp (m, l, O) through shared memory (reusing the K/V tiles).
  softmax.ReduceQuad();
  float* so = reinterpret_cast<float*>(smem_raw);  // [4][16][D]
  float* sm = so + 4 * 16 * D;                     // [4][16]
  float* sl = sm + 4 * 16;                         // [4][16]
  __syncthreads();
#pragma unroll
  for (int d = 0; d < kDimBlocks; ++d) {
    const int col = d * 8 + tig * 2;
    so[(warp * 16 + gid) * D + col] = o[d][0];
    so[(warp * 16 + gid) * D + col + 1] = o[d][1];
    so[(warp * 16 + gid + 8) * D + col] = o[d][2];
    so[(warp * 16 + gid + 8) * D + col + 1] = o[d][3];
  }
  if (tig == 0) {  // maxima to the log2 domain of the partials' log-sum-exp
    sm[warp * 16 + gid] = softmax.m[0] * scale_log2;
    sm[warp * 16 + gid + 8] = softmax.m[1] * scale_log2;
    sl[warp * 16 + gid] = softmax.l[0];
    sl[warp * 16 + gid + 8] = softmax.l[1];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < a.group * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float mx = -CUDART_INF_F;
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, sm[w * 16 + r]);
    float lsum = 0.f, acc = 0.f;
    for (int w = 0; w < 4; ++w) {
      if (sm[w * 16 + r] == -CUDART_INF_F) continue;
      const float wgt = exp2f(sm[w * 16 + r] - mx);
      lsum += sl[w * 16 + r] * wgt;
      acc += so[(w * 16 + r) * D + d] * wgt;
    }
    const int64_t head = kv_head * a.group + r;
    const int64_t slot = (static_cast<int64_t>(b) * a.num_q_heads + head) * a.max_splits + split;
    a.partial_out[slot * D + d] = lsum > 0.f ? acc / lsum : 0.f;
    if (d == 0) a.partial_lse[slot] = lsum > 0.f ? mx + log2f(lsum) : -CUDART_INF_F;
  }
}

}  // namespace lab
}  // namespace cuda_kernels
}  // namespace attnd

#endif  // ATTND_BENCH_GPU_LAB_DECODE_SPLIT_LAB_CUH_
