#include "kernels/dual_chunk_rotary.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attnd {
namespace {

// cos and sin of the fp32 angle t * inv_freq[i] (t exact in fp32), each rounded to fp32.
void CosSin(int64_t t, absl::Span<const float> inv_freq, float* cos_out, float* sin_out) {
  const float tf = static_cast<float>(t);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float angle = tf * inv_freq[i];  // an fp32 product, as the reference's fp32 cache
    // glibc's sincos: the values of sin and cos, one argument reduction for both (decode rotates
    // on the host per row, so this is on the per-token path).
    double s, c;
    sincos(static_cast<double>(angle), &s, &c);
    cos_out[i] = static_cast<float>(c);
    sin_out[i] = static_cast<float>(s);
  }
}

// One head row of d elements, neox style: [x1 c - x2 s, x2 c + x1 s] over the first 2 * half dims,
// the rest copied. `out` may be `x`.
void Rotate(const float* x, float* out, const float* c, const float* s, int64_t half, int64_t d) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * s[i];
    out[i + half] = x2 * c[i] + x1 * s[i];
  }
  for (int64_t i = 2 * half; i < d; ++i) out[i] = x[i];
}

}  // namespace

std::vector<float> RotaryInvFreq(double rope_theta, int32_t rotary_dim) {
  std::vector<float> inv_freq(rotary_dim > 0 ? rotary_dim / 2 : 0);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = static_cast<float>(
        1.0 / std::pow(rope_theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim)));
  }
  return inv_freq;
}

absl::Status CheckRotaryGeometry(const DcaGeometry& g) {
  if (g.rotary_dim < 2 || g.rotary_dim % 2 != 0 || g.rotary_dim > g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("the model's rotary dimension ", g.rotary_dim,
                                                   " is not even and in [2, head_dim ", g.head_dim,
                                                   "], so pre-rotary requests cannot be served"));
  }
  if (!(g.rope_theta > 1.0) || !std::isfinite(g.rope_theta)) {
    return absl::InvalidArgumentError(absl::StrCat("the model's rope_theta ", g.rope_theta,
                                                   " is not a finite number greater than 1"));
  }
  if (g.chunk_len <= 0 || g.chunk_size <= g.chunk_len) {
    return absl::InvalidArgumentError(absl::StrCat("the model's chunk_size ", g.chunk_size,
                                                   " must exceed chunk_len ", g.chunk_len));
  }
  return absl::OkStatus();
}

void DualChunkRotaryCpu(const DcaGeometry& g, absl::Span<const float> inv_freq,
                        const CpuRotaryParams& p, ThreadPool* pool) {
  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  const int64_t nv = p.num_variants;
  auto token = [&](int64_t n) {
    const int64_t pos = p.start + n;
    // cos/sin per variant: [nv][half] each.
    std::vector<float> cs(2 * nv * half);
    float* cos_v = cs.data();
    float* sin_v = cs.data() + nv * half;
    for (int64_t v = 0; v < nv; ++v) {
      CosSin(DualChunkRotaryPosition(static_cast<int>(v), pos, g.chunk_size, g.chunk_len), inv_freq,
             cos_v + v * half, sin_v + v * half);
    }
    const float* q = p.q + n * hq * d;
    float* qv = p.q_variants + n * nv * hq * d;
    for (int64_t v = 0; v < nv; ++v) {
      for (int64_t h = 0; h < hq; ++h) {
        Rotate(q + h * d, qv + (v * hq + h) * d, cos_v + v * half, sin_v + v * half, half, d);
      }
    }
    float* k = p.k + n * hkv * d;  // the key: the intra position
    for (int64_t h = 0; h < hkv; ++h) Rotate(k + h * d, k + h * d, cos_v, sin_v, half, d);
  };
  if (pool == nullptr || p.num_tokens == 1) {
    for (int64_t n = 0; n < p.num_tokens; ++n) token(n);
  } else {
    pool->ParallelFor(p.num_tokens, token);
  }
}

}  // namespace attnd
