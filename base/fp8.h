// FP8 E4M3 for the KV cache (the OCP / NVIDIA "e4m3fn" format): 1 sign bit, 4 exponent bits with
// bias 7, 3 mantissa bits, no infinities; S.1111.111 is NaN, so the largest finite magnitude is
// 448 (S.1111.110) and subnormals are m * 2^-9. Plain integer and fp32 arithmetic only (no
// intrinsics, no tables), so the CPU kernels and the CUDA kernels share these definitions and agree
// bit for bit.
//
// How the cache stores a row (one token's head_dim values of one kv head): x_i = src_i * multiplier
// (the key length scaling; 1 for values), scale = max_i |x_i| / 448, code_i = FloatToFp8E4m3(x_i /
// scale); the row reads back as Fp8E4m3ToFloat(code_i) * scale. Each step is one correctly rounded
// fp32 operation. NOTE for CUDA: the division must be IEEE (nvcc's default -prec-div=true; not
// --use_fast_math) and denormals kept (-ftz=false) to reproduce the CPU's codes. A row whose
// max |x| is 0 (or so small that max/448 underflows to 0) gets scale 0 and zero codes: it reads
// back as zeros, never 0/0.
#ifndef ATTND_BASE_FP8_H_
#define ATTND_BASE_FP8_H_

#include <math.h>
#include <string.h>

#include <cstdint>

#include "base/host_device.h"

namespace attnd {

// One E4M3 element of the KV pool (a distinct type so that kernels templated on the KV element
// pick the fp8 paths, which also need the row scales).
struct Fp8E4m3 {
  uint8_t bits;
};
static_assert(sizeof(Fp8E4m3) == 1, "one byte an element");

// The largest finite E4M3 magnitude; x / scale lies in [-448, 448] by construction.
inline constexpr float kFp8E4m3Max = 448.f;

// Exact: every E4M3 value is an fp32. NaN for 0x7f and 0xff; 0x80 is -0.
ATTND_HOST_DEVICE float Fp8E4m3ToFloat(uint8_t code) {
  const uint32_t e = (code >> 3) & 0xfu;
  const uint32_t m = code & 0x7u;
  if (e == 0xfu && m == 0x7u) return NAN;
  // Normal: (1 + m/8) 2^(e-7) = (8 + m) 2^e / 2^10; subnormal: m 2^-9 = 2m / 2^10. The integer is
  // at most 15 * 2^15, so the conversion and the power-of-two product are exact.
  const uint32_t units = e == 0 ? (m << 1) : ((8u + m) << e);
  const float magnitude = static_cast<float>(units) * (1.f / 1024.f);
  return (code & 0x80u) ? -magnitude : magnitude;
}

// Round to nearest, ties to even, saturating: |f| >= 448 (infinity included) gives +-448, never
// NaN; a NaN gives the NaN code with f's sign; -0 gives 0x80.
ATTND_HOST_DEVICE uint8_t FloatToFp8E4m3(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof(x));
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7fu;   // NaN
  if (x >= 0x43e00000u) return sign | 0x7eu;  // >= 448: saturate
  if (x >= 0x3c800000u) {
    // Normal (>= 2^-6): round the 23-bit mantissa to 3 bits, ties to even; a carry into the
    // exponent is the right result. Below 448 the rounding reaches 448 at most (0x7e), never NaN.
    // Rebias the exponent from 127 to 7.
    const uint32_t rounded = x + 0x7ffffu + ((x >> 20) & 1u);
    return sign | static_cast<uint8_t>((rounded - (120u << 23)) >> 20);
  }
  if (x < 0x3a800000u) return sign;  // below 2^-10, half the smallest subnormal: zero
  // Subnormal: code = round(|f| 2^9) with |f| = mant 2^(E - 150), E in [117, 120]. A result of 8
  // is the smallest normal (0x08), which is the right code too.
  const uint32_t shift = 141u - (x >> 23);  // in [21, 24]
  const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
  uint32_t m = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (m & 1u))) ++m;
  return sign | static_cast<uint8_t>(m);
}

// Quantises one row, n values x_i = src[i] * multiplier, into codes[0, n); returns its scale
// (max |x_i| / 448, or 0 for a row of zeros). See the header comment for the exact steps.
ATTND_HOST_DEVICE float Fp8QuantizeRow(const float* src, float multiplier, int n, Fp8E4m3* codes) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) {
    const float a = fabsf(src[i] * multiplier);
    if (a > amax) amax = a;
  }
  const float scale = amax / kFp8E4m3Max;
  for (int i = 0; i < n; ++i) {
    codes[i].bits = scale == 0.f ? uint8_t{0} : FloatToFp8E4m3((src[i] * multiplier) / scale);
  }
  return scale;
}

// The fp32 values of a stored row: Fp8E4m3ToFloat(code_i) * scale.
ATTND_HOST_DEVICE void Fp8DequantizeRow(const Fp8E4m3* codes, float scale, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = Fp8E4m3ToFloat(codes[i].bits) * scale;
}

}  // namespace attnd

#endif  // ATTND_BASE_FP8_H_
