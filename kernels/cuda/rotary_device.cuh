// The dual-chunk rotary's cos and sin on the device, shared by the prefill rotary kernel
// (rotary_cuda_kernels.cuh) and the decode stage (kv_write_kernels.cuh), so both rotate exactly as
// the CPU does (kernels/dual_chunk_rotary.cc): the angle in fp32, as the reference's fp32 cache
// holds it, then fp64 sincos rounded to fp32.
#ifndef ATTND_KERNELS_CUDA_ROTARY_DEVICE_CUH_
#define ATTND_KERNELS_CUDA_ROTARY_DEVICE_CUH_

#include <cstdint>

#include "kernels/dual_chunk_rotary.h"

namespace attnd {
namespace cuda_common {

// cos and sin of dim pair i's angle for query variant `variant` of the token at position pos.
__device__ __forceinline__ void RotaryCosSin(int variant, int64_t pos, int i, int64_t chunk_size,
                                             int64_t chunk_len, const float* inv_freq, float* cos,
                                             float* sin) {
  const int64_t t = DualChunkRotaryPosition(variant, pos, chunk_size, chunk_len);
  const float angle = __fmul_rn(static_cast<float>(t), inv_freq[i]);
  double s, c;
  ::sincos(static_cast<double>(angle), &s, &c);
  *cos = static_cast<float>(c);
  *sin = static_cast<float>(s);
}

}  // namespace cuda_common
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_ROTARY_DEVICE_CUH_
