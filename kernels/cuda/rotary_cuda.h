// The dual-chunk rotary on the GPU (kernels/dual_chunk_rotary.h has the positions and the numerics;
// docs/rotary.md): a pre-rotary prefill chunk becomes the five bf16 query variants the DCA
// prefill kernels (dca_cuda.h, sparse_cuda.h) read, and its keys are rotated in place, before the
// KV append scales them. Plain C++ header; the kernel lives in rotary_cuda_kernels.cuh.
#ifndef ATTND_KERNELS_CUDA_ROTARY_CUDA_H_
#define ATTND_KERNELS_CUDA_ROTARY_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/dca.h"

namespace attnd {

// num_tokens consecutive tokens of one sequence, the first at absolute position `start`. Every
// pointer is device memory.
struct CudaRotaryParams {
  // Either may be null (with q, q_variants): a caller that stages queries and keys at different
  // times rotates each when it has it.
  const void* q = nullptr;     // [num_tokens, num_q_heads, head_dim] of dtype, pre-rotary
  void* k = nullptr;           // [num_tokens, num_kv_heads, head_dim] of dtype: rotated in place
  DType dtype = DType::kBf16;  // of q and k: bf16, fp16 or fp32
  Bf16* q_variants = nullptr;  // [num_tokens, 5, num_q_heads, head_dim], written
  const float* inv_freq = nullptr;  // [rotary_dim / 2]: RotaryInvFreq(rope_theta, rotary_dim)
  int64_t start = 0;
  int64_t num_tokens = 0;
};

// Grid: one block per token. The block computes cos/sin of the token's five rotary positions
// (5 x rotary_dim/2, fp32 angle, fp64 sincos rounded to fp32, as on the CPU) into shared memory;
// then each thread writes query-variant elements (one per thread per step, coalesced) and rotates
// key dim pairs (i, i + rotary_dim/2) in place. Dims past rotary_dim are copied.
// INVALID_ARGUMENT for a geometry without a usable rotary (CheckRotaryGeometry) or bad params.
absl::Status LaunchDualChunkRotary(const DcaGeometry& geometry, const CudaRotaryParams& params,
                                   cudaStream_t stream);

}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_ROTARY_CUDA_H_
