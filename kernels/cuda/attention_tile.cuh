// The inner step the attention kernels of this package share: which keys of a tile a query row
// sees (mask policies), the online softmax over a tile of scores (SoftmaxState), packing the
// probabilities as the A operand of P V, and merging finished (max, sum) partials. Used by the
// wgmma prefill (prefill_wgmma.cuh), the decode (dca_cuda_kernels.cuh) and the sparse estimate and
// attention (sparse_cuda_kernels.cuh), and by the tuning lab's copies of the first two. The
// mma.sync prefill keeps its own softmax: see the NOTE at DcaPrefillKernel. Device code only:
// included by .cu files through those headers.
//
// NOTE: Fragment layout. Flattened, a thread's accumulator fragment (c[nb][e] of mma.sync m16n8
// tiles, or the register array of a wgmma m64nN) holds at index i the element of the thread's
// row FragRow(i) (0: row gid, 1: row gid + 8 of its 16-row slice) and the tile's column
// FragCol(i, tig); the 4 threads of a quad (one gid) share a row. Every helper here reads
// fragments through that one mapping, so the same code serves both instruction families.
#ifndef ATTND_KERNELS_CUDA_ATTENTION_TILE_CUH_
#define ATTND_KERNELS_CUDA_ATTENTION_TILE_CUH_

#include <math_constants.h>

#include <cstdint>

#include "kernels/cuda/device_common.cuh"

namespace attnd {
namespace cuda_common {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ constexpr int FragRow(int i) { return (i >> 1) & 1; }
__device__ __forceinline__ constexpr int FragCol(int i, int tig) {
  return 8 * (i / 4) + 2 * tig + (i & 1);
}

// A [NB][4] mma.sync fragment array seen as the flat array of the layout above.
template <int NB>
__device__ __forceinline__ float (&Flat(float (&f)[NB][4]))[NB * 4] {
  return reinterpret_cast<float(&)[NB * 4]>(f);
}

// 2^x; inputs are <= 0 here (scores minus their running max), outputs below 2^-126 flush to zero,
// which no row sum can notice.
__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- mask policies: Visible(col, row) for the tile's column col and the thread's row 0 or 1 --

// Keys k0 + col of a contiguous range [.., k_hi); with `causal`, only keys at or before the
// row's position (a sparse estimate's causal corner; pos -1 hides every key). Each row's visible
// keys end at one bound, so the test is a single compare per score.
struct RangeMask {
  int32_t k0;      // the tile's first key
  int32_t end[2];  // the rows' bounds: key < end[row] is visible
  __device__ __forceinline__ RangeMask(int32_t first_key, int32_t k_hi, bool causal, int32_t pos0,
                                       int32_t pos1)
      : k0(first_key),
        end{causal ? min(k_hi, pos0 + 1) : k_hi, causal ? min(k_hi, pos1 + 1) : k_hi} {}
  __device__ __forceinline__ bool Visible(int col, int row) const { return k0 + col < end[row]; }
};

// The keys of RangeMask, tested as two compares: below k_hi, and, for a causal tile, at or before
// the row's position (the wgmma prefill's form; a DCA intra tile is the causal one).
// NOTE: the same set as RangeMask, kept apart for speed: with RangeMask's single bound ptxas
// schedules the wgmma prefill's loop differently, and on the H200 it was 0.3-0.7% slower at 128K
// and 2.7-4.5% at 32K with 4 chunks (docs/BENCHMARKS.md, issue 17). The test is written as the
// hidden condition with bitwise operators: so it compiles to the same SASS, byte for byte, as
// the loop the kernel was tuned with, where `key < k_hi && (...)` made that kernel's code 17%
// larger.
struct TwoBoundMask {
  int32_t k0;    // the tile's first key
  int32_t k_hi;  // the range's end: key < k_hi
  bool causal;   // also key <= the row's position
  int32_t pos0, pos1;
  __device__ __forceinline__ bool Visible(int col, int row) const {
    const int32_t key = k0 + col;
    return !((causal & (key > (row ? pos1 : pos0))) | (key >= k_hi));
  }
};

// Keys gathered into the tile: key[col] absolute, or -1 for an empty slot (sparse attention);
// with `causal`, only keys at or before the row's position (positions are >= 0).
struct GatherMask {
  const int32_t* key;  // [tile columns], in shared memory
  uint32_t last[2];    // the rows' last visible key; -1 (as unsigned) is above every one of them
  __device__ __forceinline__ GatherMask(const int32_t* keys, bool causal, int32_t pos0,
                                        int32_t pos1)
      : key(keys),
        last{causal ? static_cast<uint32_t>(pos0) : 0x7fffffffu,
             causal ? static_cast<uint32_t>(pos1) : 0x7fffffffu} {}
  // NOTE: one unsigned compare: an empty slot (-1) is 0xffffffff, above any position.
  __device__ __forceinline__ bool Visible(int col, int row) const {
    return static_cast<uint32_t>(key[col]) <= last[row];
  }
};

// Sets the scores of the keys the mask hides to -inf.
template <int N, class Mask>
__device__ __forceinline__ void ApplyMask(float (&s)[N], int tig, const Mask& mask) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (!mask.Visible(FragCol(i, tig), FragRow(i))) s[i] = -CUDART_INF_F;
  }
}

// ---- online softmax ------------------------------------------------------------------------

// The running max and sum of a thread's two rows (FlashAttention's online softmax).
// NOTE: m is kept in the domain of the scores handed to Update and scaled inside the exponent,
// p = 2^(s * scale - m * scale), one FFMA per score: kernels pass raw Q K^T scores and
// softmax_scale * log2(e), or scores already in the log2 domain and scale 1.
struct SoftmaxState {
  float m[2];  // running row max; -inf until the row has seen a visible key
  float l[2];  // this thread's part of the row sum (its columns), until ReduceQuad

  __device__ __forceinline__ void Init() {
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.f;
  }

  // One tile of scores s (hidden keys at -inf, fragment layout): the max and sum move on, s
  // becomes the probabilities, and alpha the factor the rows' output so far must be scaled by.
  // kSumTile: sum the tile's probabilities first, then l = l * alpha + sum (the wgmma prefill);
  // otherwise l *= alpha and each probability is added to it.
  // NOTE: the two orders schedule differently at a register limit. On the H200 the sparse
  // attention (168 registers) with the running order is 4% faster at 1M than its code before this
  // helper, and 8% slower than that with the tile sum; the wgmma prefill keeps the tile sum it was
  // tuned with (docs/BENCHMARKS.md, issue 17). Four independent partial maxima and sums per row
  // measured the same as these running values in the wgmma prefill (bench/gpu/NOTES.md).
  template <bool kSumTile = false, int N>
  __device__ __forceinline__ void Update(float (&s)[N], float scale, float (&alpha)[2]) {
    float tile_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int i = 0; i < N; ++i) tile_max[FragRow(i)] = fmaxf(tile_max[FragRow(i)], s[i]);
    float neg_m[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float m_new = fmaxf(m[r], tile_max[r]);
      const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;  // no visible key yet: p = 0
      alpha[r] = Ex2((m[r] - m_use) * scale);
      m[r] = m_new;
      neg_m[r] = -m_use * scale;
    }
    if constexpr (kSumTile) {
      float sum[2] = {0.f, 0.f};
#pragma unroll
      for (int i = 0; i < N; ++i) {
        s[i] = Ex2(fmaf(s[i], scale, neg_m[FragRow(i)]));
        sum[FragRow(i)] += s[i];
      }
      l[0] = l[0] * alpha[0] + sum[0];
      l[1] = l[1] * alpha[1] + sum[1];
    } else {
      l[0] *= alpha[0];
      l[1] *= alpha[1];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        s[i] = Ex2(fmaf(s[i], scale, neg_m[FragRow(i)]));
        l[FragRow(i)] += s[i];
      }
    }
  }

  // Sums l over the quad: afterwards every thread holds its rows' full sums.
  __device__ __forceinline__ void ReduceQuad() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
  }
  // 1 / row sum after ReduceQuad; 0 for a row that saw no key, so its output is zeros, never NaN.
  __device__ __forceinline__ float InvSum(int r) const { return l[r] > 0.f ? 1.f / l[r] : 0.f; }
};

// Scales an output fragment's rows by alpha (SoftmaxState::Update).
template <int N>
__device__ __forceinline__ void RescaleRows(float (&o)[N], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] *= alpha[FragRow(i)];
}

// Probabilities of a tile as the bf16 A fragments of P V, one per 16 keys.
template <int N>
__device__ __forceinline__ void PackProbs(const float (&p)[N], uint32_t (&pa)[N / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 8; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) pa[kk][j] = PackBf16(p[8 * kk + 2 * j], p[8 * kk + 2 * j + 1]);
}

// A warp's whole step for one tile of mma.sync scores s [NB][4]: mask, softmax update, rescale of
// the output fragment o, and P packed for P V (the decode kernels; the wgmma prefill interleaves
// these parts with its wgmmas, so it calls them one by one).
template <int NB, int ND, class Mask>
__device__ __forceinline__ void SoftmaxTile(float (&s)[NB][4], int tig, const Mask& mask,
                                            float scale, SoftmaxState& state, float (&o)[ND][4],
                                            uint32_t (&pa)[NB / 2][4]) {
  float alpha[2];
  ApplyMask(Flat(s), tig, mask);
  state.Update(Flat(s), scale, alpha);
  RescaleRows(Flat(o), alpha);
  PackProbs(Flat(s), pa);
}

// Merges a finished partial (max pm, sum pl; log2 domain) into a running one (m, l).
__device__ __forceinline__ void MergeStats(float& m, float& l, float pm, float pl) {
  if (pm == -CUDART_INF_F) return;  // an empty partial
  const float m_new = fmaxf(m, pm);
  l = l * exp2f(m - m_new) + pl * exp2f(pm - m_new);
  m = m_new;
}

}  // namespace cuda_common
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_ATTENTION_TILE_CUH_
