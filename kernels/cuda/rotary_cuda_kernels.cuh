// Device code of the dual-chunk rotary (rotary_cuda.h). Included by rotary_cuda.cu only.
#ifndef ATTND_KERNELS_CUDA_ROTARY_CUDA_KERNELS_CUH_
#define ATTND_KERNELS_CUDA_ROTARY_CUDA_KERNELS_CUH_

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/rotary_cuda.h"
#include "kernels/dual_chunk_rotary.h"

namespace attnd {
namespace rotary_kernels {

struct RotaryArgs {
  CudaRotaryParams p;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t half;  // rotary_dim / 2
  int64_t chunk_size;
  int64_t chunk_len;
};

// cos/sin of `num_variants` rotary positions of the token at `pos` into cos_v / sin_v ([variant]
// [half] each), the block's threads together: fp32 angle (as the reference's fp32 cache), fp64
// sincos rounded to fp32, as on the CPU (kernels/dual_chunk_rotary.cc).
__device__ __forceinline__ void FillCosSin(int num_variants, int64_t pos, int half,
                                           int64_t chunk_size, int64_t chunk_len,
                                           const float* inv_freq, float* cos_v, float* sin_v) {
  for (int j = threadIdx.x; j < num_variants * half; j += blockDim.x) {
    const int v = j / half, i = j - v * half;
    const int64_t t = DualChunkRotaryPosition(v, pos, chunk_size, chunk_len);
    const float angle = __fmul_rn(static_cast<float>(t), inv_freq[i]);
    double s, c;
    sincos(static_cast<double>(angle), &s, &c);
    cos_v[j] = static_cast<float>(c);
    sin_v[j] = static_cast<float>(s);
  }
}

// The dim pair (x1, x2) = (q[i], q[i + half]) of one head, rotated by each of NV variants' cos/sin
// and written as bf16 to o[v * stride] and o[v * stride + half] (o: the head's element i of
// variant 0).
template <int NV>
__device__ __forceinline__ void StoreRotatedPair(float x1, float x2, int i, int half,
                                                 const float* cos_v, const float* sin_v, Bf16* o,
                                                 int stride) {
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const float c = cos_v[v * half + i], s = sin_v[v * half + i];
    o[v * stride] = __float2bfloat16_rn(x1 * c - x2 * s);
    o[v * stride + half] = __float2bfloat16_rn(x2 * c + x1 * s);
  }
}

// Grid: (num_tokens); dynamic shared memory: 2 * 5 * half floats (cos, then sin, per variant).
__global__ void DualChunkRotaryKernel(RotaryArgs a) {
  extern __shared__ float trig[];
  float* cos_v = trig;
  float* sin_v = trig + kNumQueryVariants * a.half;
  const int64_t n = blockIdx.x;
  const int64_t pos = a.p.start + n;
  const int dtype = static_cast<int>(a.p.dtype);
  FillCosSin(kNumQueryVariants, pos, a.half, a.chunk_size, a.chunk_len, a.p.inv_freq, cos_v, sin_v);
  __syncthreads();

  const int d = a.head_dim, half = a.half, rd = 2 * a.half;
  // Query variants: one thread per dim pair (h, i < half) of the token's q, which it loads once
  // and writes, rotated, into all five variants of [5, Hq, D] (one divide per pair, not three
  // per element: the loop was integer-bound).
  const int64_t q_base = n * a.num_q_heads * d;
  const int row_elems = a.num_q_heads * d;
  Bf16* out = a.p.q_variants + n * kNumQueryVariants * row_elems;
  const int q_pairs = a.p.q != nullptr ? a.num_q_heads * half : 0;  // null: key only
  for (int e = threadIdx.x; e < q_pairs; e += blockDim.x) {
    const int h = e / half, i = e - h * half;
    const int64_t row = q_base + static_cast<int64_t>(h) * d;
    StoreRotatedPair<kNumQueryVariants>(cuda_common::LoadAsFloat(a.p.q, dtype, row + i),
                                        cuda_common::LoadAsFloat(a.p.q, dtype, row + i + half), i,
                                        half, cos_v, sin_v, out + h * d + i, row_elems);
  }
  // Dims past rotary_dim (partial rotary): copied into every variant.
  const int rest = d - rd;
  for (int e = threadIdx.x; rest > 0 && q_pairs > 0 && e < a.num_q_heads * rest; e += blockDim.x) {
    const int h = e / rest, i = rd + (e - h * rest);
    const float x =
        cuda_common::LoadAsFloat(a.p.q, dtype, q_base + static_cast<int64_t>(h) * d + i);
    for (int v = 0; v < kNumQueryVariants; ++v)
      out[v * row_elems + h * d + i] = __float2bfloat16_rn(x);
  }
  // The key, in place, by the intra position: one thread per dim pair, so no element is read
  // after another thread wrote it. Dims past rotary_dim stay as they are.
  const int64_t k_base = n * a.num_kv_heads * d;
  const int k_pairs = a.p.k != nullptr ? a.num_kv_heads * half : 0;  // null: queries only
  for (int e = threadIdx.x; e < k_pairs; e += blockDim.x) {
    const int h = e / half, i = e % half;
    const int64_t row = k_base + static_cast<int64_t>(h) * d;
    const float x1 = cuda_common::LoadAsFloat(a.p.k, dtype, row + i);
    const float x2 = cuda_common::LoadAsFloat(a.p.k, dtype, row + i + half);
    cuda_common::StoreOne(a.p.k, dtype, row + i, x1 * cos_v[i] - x2 * sin_v[i]);
    cuda_common::StoreOne(a.p.k, dtype, row + i + half, x2 * cos_v[i] + x1 * sin_v[i]);
  }
}

struct DecodeRotaryArgs {
  CudaDecodeRotaryParams p;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t half;
  int64_t chunk_size;
  int64_t chunk_len;
};

// Heads of q per block of the decode rotary: q comes from pinned host memory, so each load is a
// PCIe round trip; spreading a row over blocks keeps one round trip per thread.
inline constexpr int kDecodeRotaryHeadsPerBlock = 4;

// Grid: (batch, ceil(num_q_heads / kDecodeRotaryHeadsPerBlock)), 256 threads; dynamic shared
// memory: 2 * 3 * half floats, then (block y = 0, which also rotates the key) the row's raw key as
// fp32 (num_kv_heads * head_dim floats), read once (each rotated element needs two of them, and a
// host row's key is a PCIe read away).
__global__ void DecodeRotaryKernel(DecodeRotaryArgs a) {
  cuda_common::StepKernelEntry();
  extern __shared__ float smem[];
  const int r = blockIdx.x;
  const DecodeStageRow row = a.p.rows[r];
  if (row.rotary == 0 || row.length < 1) return;
  constexpr int kNv = kNumDecodeVariants;
  const int half = a.half, d = a.head_dim, rd = 2 * a.half;
  float* cos_v = smem;
  float* sin_v = smem + kNv * half;
  float* raw_k = smem + 2 * kNv * half;
  const int64_t pos = row.length - 1;
  FillCosSin(kNv, pos, half, a.chunk_size, a.chunk_len, a.p.inv_freq, cos_v, sin_v);
  // A device row's q and k are read in place, a host row's from its slots.
  const char* qrow = row.q != nullptr ? static_cast<const char*>(row.q)
                                      : static_cast<const char*>(a.p.host_q) + r * a.p.q_row_bytes;
  const void* k_src =
      row.k != nullptr ? row.k : static_cast<const char*>(a.p.host_k) + r * a.p.kv_row_bytes;
  const bool does_key = blockIdx.y == 0;
  const int kv_elems = a.num_kv_heads * d;
  for (int e = threadIdx.x; does_key && e < kv_elems; e += blockDim.x) {
    raw_k[e] = cuda_common::LoadAsFloat(k_src, row.k_dtype, e);
  }
  __syncthreads();
  const int row_elems = a.num_q_heads * d;
  Bf16* out = a.p.q + static_cast<int64_t>(r) * kNv * row_elems;
  const int h0 = blockIdx.y * kDecodeRotaryHeadsPerBlock;
  const int heads = min(kDecodeRotaryHeadsPerBlock, a.num_q_heads - h0);
  for (int e = threadIdx.x; e < heads * half; e += blockDim.x) {
    const int h = h0 + e / half, i = e % half;
    StoreRotatedPair<kNv>(cuda_common::LoadAsFloat(qrow, row.q_dtype, h * d + i),
                          cuda_common::LoadAsFloat(qrow, row.q_dtype, h * d + i + half), i, half,
                          cos_v, sin_v, out + h * d + i, row_elems);
  }
  const int rest = d - rd;
  for (int e = threadIdx.x; rest > 0 && e < heads * rest; e += blockDim.x) {
    const int h = h0 + e / rest, i = rd + e % rest;
    const float x = cuda_common::LoadAsFloat(qrow, row.q_dtype, h * d + i);
    for (int v = 0; v < kNv; ++v) out[v * row_elems + h * d + i] = __float2bfloat16_rn(x);
  }
  // The key by the intra position, as fp32 into k_out (the stage reads it from there).
  float* kout = a.p.k_out + static_cast<int64_t>(r) * kv_elems;
  for (int e = threadIdx.x; does_key && e < kv_elems; e += blockDim.x) {
    const int h = e / d, i = e - h * d;
    const float* k = raw_k + h * d;
    float x;
    if (i < half) {
      x = k[i] * cos_v[i] - k[i + half] * sin_v[i];
    } else if (i < rd) {
      x = k[i] * cos_v[i - half] + k[i - half] * sin_v[i - half];
    } else {
      x = k[i];
    }
    kout[e] = x;
  }
}

}  // namespace rotary_kernels
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_ROTARY_CUDA_KERNELS_CUH_
