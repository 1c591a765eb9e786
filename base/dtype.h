// Element types of request tensors and of the KV cache, and exact conversions to and from fp32.
#ifndef ATTND_BASE_DTYPE_H_
#define ATTND_BASE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"

namespace attnd {

// kFp8E4m3 and kInt8 are KV cache dtypes only (base/fp8.h: E4M3 codes, base/int8_kv.h: symmetric
// int8 codes, each with an fp32 scale per token and kv head); request and output tensors are bf16,
// fp16 or fp32.
enum class DType : int { kBf16 = 1, kFp16 = 2, kFp32 = 3, kFp8E4m3 = 4, kInt8 = 5 };

// Whether `t` is a request tensor dtype: bf16, fp16 or fp32 (a wire value cast to DType may be 0,
// unknown, or a KV-only dtype). The one spelling of "known dtype": request validation, engines and
// tools all use it.
constexpr bool IsKnownDType(DType t) {
  return t == DType::kBf16 || t == DType::kFp16 || t == DType::kFp32;
}

// Whether the KV cache can hold `t`: fp32, bf16, fp8 E4M3 or int8 (which backends take: their
// engines).
constexpr bool IsKvDType(DType t) {
  return t == DType::kFp32 || t == DType::kBf16 || t == DType::kFp8E4m3 || t == DType::kInt8;
}

// Whether a KV cache of `t` keeps an fp32 scale per token and kv head beside its one-byte codes
// (fp8 and int8; kvcache/kv_layout.h lays the scales out).
constexpr bool HasRowScale(DType t) { return t == DType::kFp8E4m3 || t == DType::kInt8; }

// Bytes per element (fp8, int8: the code alone; the row scales are counted by
// kvcache/kv_layout.h).
constexpr size_t ElementSize(DType t) { return t == DType::kFp32 ? 4 : (HasRowScale(t) ? 1 : 2); }

// "bf16", "fp16", "fp32", "fp8_e4m3", "int8".
absl::string_view DTypeName(DType t);

// bfloat16 <-> fp32. FloatToBf16 rounds to nearest even and keeps NaN a NaN.
inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE half <-> fp32. FloatToHalf rounds to nearest even, saturating to infinity.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);

// The index of the first NaN or infinity among n elements of type t, or -1 when all are finite
// (also for an unknown dtype). Reads all n elements in blocks, so a clean tensor costs one pass at
// memory speed.
int64_t FirstNonFinite(DType t, const void* data, size_t n);

// Converts n little-endian elements of `src` (any alignment) to fp32 (fp8, int8: the codes'
// values, unscaled).
void ConvertToFloat(const void* src, DType src_type, size_t n, float* dst);
// Converts n fp32 values to `dst_type`, writing raw little-endian elements to `dst` (any
// alignment; fp8, int8: saturating codes, unscaled).
void ConvertFromFloat(const float* src, size_t n, DType dst_type, void* dst);

}  // namespace attnd

#endif  // ATTND_BASE_DTYPE_H_
