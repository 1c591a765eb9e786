// Symmetric int8 for the KV cache: one signed byte a value in [-127, 127] with an fp32 scale per
// row. Plain integer and fp32 arithmetic only (no intrinsics, no dependence on the rounding mode),
// so the CPU kernels and the CUDA kernels share these definitions and agree bit for bit.
//
// How the cache stores a row (one token's head_dim values of one kv head), the same rows as fp8
// (base/fp8.h): x_i = src_i * multiplier (the key length scaling; 1 for values), scale = max_i
// |x_i| / 127, code_i = FloatToInt8Kv(x_i / scale) (nearest integer, ties to even, clamped to
// [-127, 127]); the row reads back as code_i * scale. Each step is one correctly rounded fp32
// operation. NOTE for CUDA: the division must be IEEE (nvcc's default -prec-div=true; not
// --use_fast_math) and denormals kept (-ftz=false) to reproduce the CPU's codes. -128 is never
// written, so the codes are symmetric and negating a row negates its codes.
//
// Edge rows: a row whose max |x| is 0 (or so small that max/127 underflows to 0) gets scale 0 and
// zero codes and reads back as zeros, never 0/0. Callers check inputs finite before they reach the
// cache; should a NaN or an infinity reach a row anyway, that row's scale is NaN or infinity and
// its codes 0, so the whole row reads back as NaN (0 * NaN, 0 * inf): the damage shows where it is
// and stays in that row, rather than being stored as plausible numbers.
#ifndef ATTND_BASE_INT8_KV_H_
#define ATTND_BASE_INT8_KV_H_

#include <math.h>

#include <cstdint>

#include "base/host_device.h"

namespace attnd {

// One int8 element of the KV pool (a distinct type so that kernels templated on the KV element
// pick the int8 paths, which also need the row scales).
struct Int8Kv {
  int8_t code;
};
static_assert(sizeof(Int8Kv) == 1, "one byte an element");

// The largest code magnitude; x / scale lies in [-127, 127] up to the division's rounding.
inline constexpr float kInt8KvMax = 127.f;

// The nearest integer to q, ties to even, clamped to [-127, 127] (infinities included); NaN gives
// 0. The integer part and the remainder are exact in fp32 for |q| < 127, so the comparison with
// one half decides the rounding exactly.
ATTND_HOST_DEVICE int8_t FloatToInt8Kv(float q) {
  if (!(q == q)) return 0;  // NaN
  if (q >= kInt8KvMax) return 127;
  if (q <= -kInt8KvMax) return -127;
  const int t = static_cast<int>(q);                   // toward zero
  const float rem = fabsf(q - static_cast<float>(t));  // in [0, 1)
  const bool odd = (t & 1) != 0;
  const int away = (rem > 0.5f || (rem == 0.5f && odd)) ? 1 : 0;
  return static_cast<int8_t>(q < 0.f ? t - away : t + away);
}

// Quantises one row, n values x_i = src[i] * multiplier, into codes[0, n); returns its scale
// (max |x_i| / 127, 0 for a row of zeros, NaN or infinity for a row holding one). See the header
// comment for the exact steps.
ATTND_HOST_DEVICE float Int8QuantizeRow(const float* src, float multiplier, int n, Int8Kv* codes) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) {
    const float a = fabsf(src[i] * multiplier);
    // A NaN sticks (no later comparison with it is true), so it reaches the scale.
    if (a > amax || a != a) amax = a;
  }
  const float scale = amax / kInt8KvMax;
  for (int i = 0; i < n; ++i) {
    codes[i].code = scale == 0.f ? int8_t{0} : FloatToInt8Kv((src[i] * multiplier) / scale);
  }
  return scale;
}

// The fp32 values of a stored row: code_i * scale (the int8 to fp32 conversion is exact).
ATTND_HOST_DEVICE void Int8DequantizeRow(const Int8Kv* codes, float scale, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(codes[i].code) * scale;
}

}  // namespace attnd

#endif  // ATTND_BASE_INT8_KV_H_
