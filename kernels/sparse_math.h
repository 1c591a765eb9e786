// Small fp32 vector helpers shared by the sparse prefill CPU code (kernels/vertical_slash.cc,
// kernels/sparse_prefill_cpu.cc). Written over GCC vector extensions at the baseline x86-64
// width (SSE2, 4 lanes) with independent accumulators, so they vectorize without -ffast-math.
#ifndef ATTND_KERNELS_SPARSE_MATH_H_
#define ATTND_KERNELS_SPARSE_MATH_H_

#include <cstdint>
#include <cstring>

namespace attnd {
namespace sparse_math {

typedef float F4 __attribute__((vector_size(16)));

inline F4 Load4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store4(float* p, F4 v) { std::memcpy(p, &v, sizeof(v)); }

}  // namespace sparse_math

// a . b over n floats. NOTE: lane-wise partial sums (pairwise-combined at the end) differ from a
// sequential sum only at fp32 rounding level.
inline float DotF32(const float* a, const float* b, int n) {
  using sparse_math::F4;
  using sparse_math::Load4;
  int i = 0;
  F4 s0 = {}, s1 = {};
  for (; i + 8 <= n; i += 8) {
    s0 += Load4(a + i) * Load4(b + i);
    s1 += Load4(a + i + 4) * Load4(b + i + 4);
  }
  const F4 s = s0 + s1;
  float sum = (s[0] + s[2]) + (s[1] + s[3]);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y += alpha * x over n floats.
inline void AxpyF32(float alpha, const float* x, float* y, int n) {
  using sparse_math::Load4;
  using sparse_math::Store4;
  int i = 0;
  for (; i + 4 <= n; i += 4) Store4(y + i, Load4(y + i) + alpha * Load4(x + i));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace attnd

#endif  // ATTND_KERNELS_SPARSE_MATH_H_
