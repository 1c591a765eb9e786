// Device code of the dual-chunk rotary (rotary_cuda.h). Included by rotary_cuda.cu only.
#ifndef ATTND_KERNELS_CUDA_ROTARY_CUDA_KERNELS_CUH_
#define ATTND_KERNELS_CUDA_ROTARY_CUDA_KERNELS_CUH_

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/rotary_cuda.h"
#include "kernels/cuda/rotary_device.cuh"
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
// [half] each), the block's threads together (RotaryCosSin's numerics).
__device__ __forceinline__ void FillCosSin(int num_variants, int64_t pos, int half,
                                           int64_t chunk_size, int64_t chunk_len,
                                           const float* inv_freq, float* cos_v, float* sin_v) {
  for (int j = threadIdx.x; j < num_variants * half; j += blockDim.x) {
    const int v = j / half, i = j - v * half;
    cuda_common::RotaryCosSin(v, pos, i, chunk_size, chunk_len, inv_freq, &cos_v[j], &sin_v[j]);
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

}  // namespace rotary_kernels
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_ROTARY_CUDA_KERNELS_CUH_
