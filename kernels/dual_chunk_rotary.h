// The dual-chunk rotary embedding (docs/DCA.md, "Dual-chunk rotary"; docs/rotary.md): what
// a pre-rotary request's q and k become before the DCA kernels see them. The positions and
// frequencies are here for the CPU conversion (DualChunkRotaryCpu) and the CUDA one
// (kernels/cuda/rotary_cuda.h) alike, so both backends rotate by the same angles.
//
// NOTE numerics follow the reference (SGLang's DualChunkRotaryEmbedding, which caches cos/sin in
// fp32): inv_freq in fp32; the angle t * inv_freq as an fp32 product (t is exact in fp32 below
// 2^24); cos and sin of that fp32 angle, rounded to fp32; the rotation itself in fp32. A cos/sin
// table would hold exactly these values; they are computed per token instead, because a table over
// every position DCA rotates by (chunk_size + chunk_len of them) is 264 MB for Qwen2.5-1M. At
// Qwen's positions (up to ~516K) the fp32 angle differs from the exact one by up to ~0.03 rad for
// the fastest frequency: that is the reference's own rounding, which the model was served with.
#ifndef ATTND_KERNELS_DUAL_CHUNK_ROTARY_H_
#define ATTND_KERNELS_DUAL_CHUNK_ROTARY_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/thread_pool.h"
#include "kernels/dca.h"
#include "kernels/host_device.h"

namespace attnd {

// The position query variant `variant` (dca.h's QueryVariant) of the token at absolute position p
// is rotated by, with r = p mod chunk_len: intra r; succ min(r + cl, chunk_size); inter
// min(2 cl - 1, chunk_size) (the same for every token); succ_critical r + cl; inter_critical
// r + chunk_size. The token's key is rotated by r, the intra position.
ATTND_HOST_DEVICE int64_t DualChunkRotaryPosition(int variant, int64_t p, int64_t chunk_size,
                                                  int64_t chunk_len) {
  const int64_t r = p % chunk_len;
  switch (variant) {
    case kSucc:
      return r + chunk_len < chunk_size ? r + chunk_len : chunk_size;
    case kInter:
      return 2 * chunk_len - 1 < chunk_size ? 2 * chunk_len - 1 : chunk_size;
    case kSuccCritical:
      return r + chunk_len;
    case kInterCritical:
      return r + chunk_size;
    default:  // kIntra
      return r;
  }
}

// inv_freq[i] = rope_theta^(-2i / rotary_dim) rounded to fp32, for i < rotary_dim / 2.
std::vector<float> RotaryInvFreq(double rope_theta, int32_t rotary_dim);

// OK when `geometry` describes a rotary the conversion can apply (rotary_dim even, in
// [2, head_dim]; rope_theta > 1; chunk_size > chunk_len), else INVALID_ARGUMENT saying why.
absl::Status CheckRotaryGeometry(const DcaGeometry& geometry);

// Pre-rotary q and k of num_tokens consecutive tokens, the first at absolute position `start`.
struct CpuRotaryParams {
  const float* q = nullptr;  // [num_tokens, Hq, D], pre-rotary
  float* k = nullptr;        // [num_tokens, Hkv, D], pre-rotary; rotated in place (not scaled)
  // [num_tokens, num_variants, Hq, D]: the first num_variants query variants, in dca.h's order.
  float* q_variants = nullptr;
  int32_t num_variants = kNumQueryVariants;  // 5 for prefill, 3 (kNumDecodeVariants) for decode
  int64_t start = 0;
  int64_t num_tokens = 0;
};

// Applies the dual-chunk rotary (neox style: each head's first rotary_dim dims as two halves; dims
// past rotary_dim copied unchanged). `inv_freq` is RotaryInvFreq's. Tokens run in parallel on
// `pool` (null: on the calling thread). The geometry must pass CheckRotaryGeometry.
void DualChunkRotaryCpu(const DcaGeometry& geometry, absl::Span<const float> inv_freq,
                        const CpuRotaryParams& params, ThreadPool* pool);

}  // namespace attnd

#endif  // ATTND_KERNELS_DUAL_CHUNK_ROTARY_H_
