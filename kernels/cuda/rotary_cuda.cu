#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/rotary_cuda.h"
#include "kernels/cuda/rotary_cuda_kernels.cuh"

namespace attnd {

absl::Status LaunchDualChunkRotary(const DcaGeometry& g, const CudaRotaryParams& p,
                                   cudaStream_t stream) {
  if (absl::Status s = CheckRotaryGeometry(g); !s.ok()) return s;
  if ((p.q == nullptr) != (p.q_variants == nullptr) || (p.q == nullptr && p.k == nullptr) ||
      p.inv_freq == nullptr || !IsKnownDType(p.dtype) || p.start < 0 || p.num_tokens < 0 ||
      p.num_tokens > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotary: bad params (", p.num_tokens, " tokens from ", p.start, ")"));
  }
  if (p.num_tokens == 0) return absl::OkStatus();
  rotary_kernels::RotaryArgs a;
  a.p = p;
  a.num_q_heads = g.num_q_heads;
  a.num_kv_heads = g.num_kv_heads;
  a.head_dim = g.head_dim;
  a.half = g.rotary_dim / 2;
  a.chunk_size = g.chunk_size;
  a.chunk_len = g.chunk_len;
  const size_t shared = 2 * kNumQueryVariants * a.half * sizeof(float);
  rotary_kernels::
      DualChunkRotaryKernel<<<static_cast<unsigned>(p.num_tokens), 256, shared, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DualChunkRotaryKernel");
  return absl::OkStatus();
}

}  // namespace attnd
