// Small fp32 vector helpers shared by the CPU kernels (kernels/dca_cpu.cc, vertical_slash.cc,
// sparse_prefill_cpu.cc). Written once over GCC vector extensions and instantiated per width: V4
// (SSE2, the baseline every x86-64 binary may use) and V8 (AVX2+FMA, used only from functions
// carrying __attribute__((target("avx2,fma"))), picked at run time as the dense kernels pick
// theirs: kernels/dca_cpu.h CpuSimdName). The helpers are always_inline so they are compiled for
// the width of the function that inlines them.
#ifndef ATTND_KERNELS_SIMD_MATH_H_
#define ATTND_KERNELS_SIMD_MATH_H_

#include <cstdint>
#include <cstring>

#define ATTND_SIMD_INLINE __attribute__((always_inline)) inline

// -Wpsabi: 32-byte vectors passed by value have a different ABI with and without AVX; these
// helpers are always inlined, so no such call exists.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace attnd {
namespace simd_math {

struct V4 {
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(16)));
  static constexpr int kLanes = 4;
};
struct V8 {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  static constexpr int kLanes = 8;
};

template <typename S>
ATTND_SIMD_INLINE typename S::F Load(const float* p) {
  typename S::F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename S>
ATTND_SIMD_INLINE void Store(float* p, typename S::F v) {
  std::memcpy(p, &v, sizeof(v));
}
template <typename S>
ATTND_SIMD_INLINE float Sum(typename S::F v) {
  float lanes[S::kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  for (int w = S::kLanes / 2; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  }
  return lanes[0];
}

// a . b over n floats. NOTE: lane-wise partial sums differ from a sequential sum only at fp32
// rounding level.
template <typename S>
ATTND_SIMD_INLINE float Dot(const float* a, const float* b, int n) {
  constexpr int L = S::kLanes;
  typename S::F s0 = {}, s1 = {};
  int i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    s0 += Load<S>(a + i) * Load<S>(b + i);
    s1 += Load<S>(a + i + L) * Load<S>(b + i + L);
  }
  float sum = Sum<S>(s0 + s1);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Four horizontal sums at once, out[j] = sum of vj's lanes, by shuffles (a 4x4 transpose)
// rather than through memory: taking a vector's address to sum its lanes makes GCC keep the
// accumulators on the stack for the whole loop.
ATTND_SIMD_INLINE V4::F Fold(V4::F v) { return v; }
ATTND_SIMD_INLINE V4::F Fold(V8::F v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
}
template <typename S>
ATTND_SIMD_INLINE void Sum4(typename S::F v0, typename S::F v1, typename S::F v2, typename S::F v3,
                            float* out) {
  const V4::F u0 = Fold(v0), u1 = Fold(v1), u2 = Fold(v2), u3 = Fold(v3);
  const V4::F lo01 = __builtin_shufflevector(u0, u1, 0, 4, 1, 5);  // u0_0 u1_0 u0_1 u1_1
  const V4::F hi01 = __builtin_shufflevector(u0, u1, 2, 6, 3, 7);  // u0_2 u1_2 u0_3 u1_3
  const V4::F lo23 = __builtin_shufflevector(u2, u3, 0, 4, 1, 5);
  const V4::F hi23 = __builtin_shufflevector(u2, u3, 2, 6, 3, 7);
  const V4::F p01 = lo01 + hi01;  // [u0_0+u0_2, u1_0+u1_2, u0_1+u0_3, u1_1+u1_3]
  const V4::F p23 = lo23 + hi23;
  Store<V4>(out, __builtin_shufflevector(p01, p23, 0, 1, 4, 5) +
                     __builtin_shufflevector(p01, p23, 2, 3, 6, 7));
}

// out[j] = q . k[j * stride] for j < 4: four keys share each load of q; two accumulators per key
// give eight independent FMA chains.
template <typename S>
ATTND_SIMD_INLINE void Dot4(const float* q, const float* k, int64_t stride, int n, float* out) {
  constexpr int L = S::kLanes;
  if (n % (2 * L) != 0) {
    for (int j = 0; j < 4; ++j) out[j] = Dot<S>(q, k + j * stride, n);
    return;
  }
  const float* k0 = k;
  const float* k1 = k + stride;
  const float* k2 = k + 2 * stride;
  const float* k3 = k + 3 * stride;
  typename S::F a0 = {}, b0 = {}, a1 = {}, b1 = {}, a2 = {}, b2 = {}, a3 = {}, b3 = {};
  for (int i = 0; i < n; i += 2 * L) {
    const typename S::F qa = Load<S>(q + i), qb = Load<S>(q + i + L);
    a0 += qa * Load<S>(k0 + i);
    b0 += qb * Load<S>(k0 + i + L);
    a1 += qa * Load<S>(k1 + i);
    b1 += qb * Load<S>(k1 + i + L);
    a2 += qa * Load<S>(k2 + i);
    b2 += qb * Load<S>(k2 + i + L);
    a3 += qa * Load<S>(k3 + i);
    b3 += qb * Load<S>(k3 + i + L);
  }
  Sum4<S>(a0 + b0, a1 + b1, a2 + b2, a3 + b3, out);
}

// y += alpha * x over n floats.
template <typename S>
ATTND_SIMD_INLINE void Axpy(float alpha, const float* x, float* y, int n) {
  constexpr int L = S::kLanes;
  int i = 0;
  for (; i + L <= n; i += L) Store<S>(y + i, Load<S>(y + i) + alpha * Load<S>(x + i));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// y += sum_j p[j] * x[j * stride] for j < 4: one load and store of y per four rows of x.
template <typename S>
ATTND_SIMD_INLINE void Axpy4(const float* p, const float* x, int64_t stride, float* y, int n) {
  constexpr int L = S::kLanes;
  if (n % L != 0) {
    for (int j = 0; j < 4; ++j) Axpy<S>(p[j], x + j * stride, y, n);
    return;
  }
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
  for (int i = 0; i < n; i += L) {
    const typename S::F t = (p0 * Load<S>(x + i) + p1 * Load<S>(x + stride + i)) +
                            (p2 * Load<S>(x + 2 * stride + i) + p3 * Load<S>(x + 3 * stride + i));
    Store<S>(y + i, Load<S>(y + i) + t);
  }
}

// x[i] = exp(x[i]) for i < n rounded up to the lane count (x must have that room), for arguments
// <= 0 (softmax arguments after subtracting the max). NOTE: x = k ln2 + r with ln2 split in two,
// then a degree-6 polynomial for e^r on |r| <= ln2/2 (relative error ~2e-7); arguments below -87
// are clamped there (e^-87 ~ 1e-38 is nothing next to the max's 1), which keeps 2^k normal.
template <typename S>
ATTND_SIMD_INLINE void ExpNonPositive(float* x, int n) {
  using F = typename S::F;
  const F lo = F{} - 87.f;
  const F zero = {};
  const F magic = F{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  for (int i = 0; i < n; i += S::kLanes) {
    F v = Load<S>(x + i);
    v = v < lo ? lo : v;  // also -inf
    v = v > zero ? zero : v;
    const F k = (v * 1.44269504088896341f + magic) - magic;
    F r = v - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    F p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    const typename S::I bits = (__builtin_convertvector(k, typename S::I) + 127) << 23;
    F two_k;
    std::memcpy(&two_k, &bits, sizeof(two_k));
    Store<S>(x + i, p * two_k);
  }
}

}  // namespace simd_math
}  // namespace attnd

#pragma GCC diagnostic pop

#endif  // ATTND_KERNELS_SIMD_MATH_H_
