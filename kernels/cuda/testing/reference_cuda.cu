#include <math_constants.h>

#include <cstdint>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dca_cuda_kernels.cuh"
#include "kernels/cuda/dca_cuda_launch.cuh"
#include "kernels/cuda/head_dim.h"
#include "kernels/cuda/testing/reference_cuda.h"

namespace attnd {
namespace cuda_kernels {

// One warp computes one query row at position q_pos: q_variants points at the row's intra query,
// successive variants `variant_stride` elements apart. Scalar fp32 with an online softmax.
template <int D>
__device__ void ReferenceRow(const PagedKv<Bf16>& kv, int32_t kv_head, const Bf16* q_intra,
                             int64_t variant_stride, int32_t q_pos, int32_t chunk_len,
                             float score_scale, void* out, int out_dtype, int64_t out_index) {
  constexpr int kPerLane = D / 32;
  const int lane = threadIdx.x % 32;
  float qv[3][kPerLane];
  for (int v = 0; v < 3; ++v)
    for (int i = 0; i < kPerLane; ++i)
      qv[v][i] = __bfloat162float(q_intra[v * variant_stride + lane + 32 * i]);
  const int32_t prev = (q_pos / chunk_len) * chunk_len;
  float m = -CUDART_INF_F, l = 0.f, acc[kPerLane];
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  for (int32_t k = 0; k <= q_pos; ++k) {
    const int v = VariantOfKey(k, prev, chunk_len);
    const Bf16* key = kv.Key(k, kv_head);
    const Bf16* val = kv.Value(k, kv_head);
    float dot = 0.f;
    for (int i = 0; i < kPerLane; ++i) dot += qv[v][i] * __bfloat162float(key[lane + 32 * i]);
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float x = dot * score_scale;
    const float m_new = fmaxf(m, x);
    const float alpha = expf(m - m_new);
    const float p = expf(x - m_new);
    l = l * alpha + p;
    for (int i = 0; i < kPerLane; ++i)
      acc[i] = acc[i] * alpha + p * __bfloat162float(val[lane + 32 * i]);
    m = m_new;
  }
  for (int i = 0; i < kPerLane; ++i)
    StoreOne(out, out_dtype, out_index + lane + 32 * i, acc[i] / l);
}

// grid (num_tokens, num_q_heads), block 32.
template <int D>
__global__ void DcaPrefillReferenceKernel(PagedKv<Bf16> kv, const Bf16* q, void* out, int out_dtype,
                                          int32_t start, int32_t chunk_len, int32_t num_q_heads,
                                          int32_t group, float softmax_scale) {
  const int32_t t = blockIdx.x, h = blockIdx.y;
  const Bf16* q_intra = q + (static_cast<int64_t>(t) * kNumQueryVariants * num_q_heads + h) * D;
  ReferenceRow<D>(kv, h / group, q_intra, static_cast<int64_t>(num_q_heads) * D, start + t,
                  chunk_len, softmax_scale, out, out_dtype,
                  (static_cast<int64_t>(t) * num_q_heads + h) * D);
}

// grid (batch, num_q_heads), block 32.
template <int D>
__global__ void DcaDecodeReferenceKernel(PagedKvBatch kvb, const int32_t* lengths, const Bf16* q,
                                         void* out, int out_dtype, int32_t chunk_len,
                                         int32_t num_q_heads, int32_t group, float softmax_scale,
                                         int64_t orig) {
  const int32_t b = blockIdx.x, h = blockIdx.y;
  const int32_t len = lengths[b];
  const Bf16* q_intra = q + (static_cast<int64_t>(b) * kNumDecodeVariants * num_q_heads + h) * D;
  ReferenceRow<D>(kvb.Seq(b), h / group, q_intra, static_cast<int64_t>(num_q_heads) * D, len - 1,
                  chunk_len, softmax_scale * LengthScale(len, orig), out, out_dtype,
                  (static_cast<int64_t>(b) * num_q_heads + h) * D);
}

}  // namespace cuda_kernels

using cuda_launch::CheckDecode;
using cuda_launch::CheckPrefill;

absl::Status LaunchDcaPrefillReference(const DcaGeometry& g, const CudaPrefillParams& p,
                                       cudaStream_t stream) {
  if (absl::Status s = CheckPrefill(g, p); !s.ok()) return s;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), g.num_q_heads);
  const int out = static_cast<int>(p.out_dtype);
  const auto start = static_cast<int32_t>(p.start);
  const auto cl = static_cast<int32_t>(g.chunk_len);
  WithHeadDim(g.head_dim, [&](auto dim) {
    cuda_kernels::DcaPrefillReferenceKernel<decltype(dim)::value><<<grid, 32, 0, stream>>>(
        p.kv, p.q, p.out, out, start, cl, g.num_q_heads, g.group_size(), p.softmax_scale);
  });
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaPrefillReferenceKernel");
  return absl::OkStatus();
}

absl::Status LaunchDcaDecodeReference(const DcaGeometry& g, const CudaDecodeParams& p,
                                      cudaStream_t stream) {
  if (absl::Status s = CheckDecode(g, p); !s.ok()) return s;
  const dim3 grid(p.batch, g.num_q_heads);
  const int out = static_cast<int>(p.out_dtype);
  const auto cl = static_cast<int32_t>(g.chunk_len);
  WithHeadDim(g.head_dim, [&](auto dim) {
    cuda_kernels::DcaDecodeReferenceKernel<decltype(dim)::value><<<grid, 32, 0, stream>>>(
        p.kv, p.lengths, p.q, p.out, out, cl, g.num_q_heads, g.group_size(), g.softmax_scale,
        g.original_max_position_embeddings);
  });
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaDecodeReferenceKernel");
  return absl::OkStatus();
}

}  // namespace attnd
