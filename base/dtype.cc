#include "base/dtype.h"

#include <algorithm>
#include <cstring>

#include "base/fp8.h"
#include "base/int8_kv.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace attnd {

// Request tensors are little-endian on the wire; we reinterpret them in place.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "attnd assumes a little-endian host");

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      return "fp16";
    case DType::kFp32:
      return "fp32";
    case DType::kFp8E4m3:
      return "fp8_e4m3";
    case DType::kInt8:
      return "int8";
  }
  return "unknown";
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in fp32 (2^-24 is a power of two).
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    std::memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // Inf, or NaN with its payload.
  } else {
    bits = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) {
    // NaN: keep the top payload bits and force the quiet bit so it never becomes Inf.
    return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  // 65520 = 0x477ff000 is the midpoint between the largest half (65504) and 2^16: ties round to
  // the even neighbour, which is infinity.
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (x >= 0x38800000u) {
    // Normal half. Round to nearest even on the 13 dropped bits; a carry into the exponent is
    // the correct result (mantissa overflow rounds up to the next binade).
    const uint32_t rounded = x + 0xfffu + ((x >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - ((127u - 15u) << 23)) >> 13));
  }
  if (x < 0x33000000u) return sign;  // Below 2^-25 (or exactly it: a tie to even zero).
  // Subnormal half: m = round(|f| * 2^24), |f| = mant * 2^(e - 150).
  const uint32_t e = x >> 23;
  const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // in [14, 24]
  uint32_t m = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (m & 1u))) ++m;  // m == 0x400 is the smallest normal: fine.
  return static_cast<uint16_t>(sign | m);
}

void ConvertToFloat(const void* src, DType src_type, size_t n, float* dst) {
  const unsigned char* bytes = static_cast<const unsigned char*>(src);
  switch (src_type) {
    case DType::kFp32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBf16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, sizeof(h));
        dst[i] = Bf16ToFloat(h);
      }
      return;
    case DType::kFp16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, sizeof(h));
        dst[i] = HalfToFloat(h);
      }
      return;
    case DType::kFp8E4m3:
      for (size_t i = 0; i < n; ++i) dst[i] = Fp8E4m3ToFloat(bytes[i]);
      return;
    case DType::kInt8:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(bytes[i]));
      return;
  }
}

void ConvertFromFloat(const float* src, size_t n, DType dst_type, void* dst) {
  unsigned char* bytes = static_cast<unsigned char*>(dst);
  switch (dst_type) {
    case DType::kFp32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBf16: {
      size_t i = 0;
#if defined(__SSE2__)
      // FloatToBf16 on 8 values at a time (the scalar loop took ~1 ns a value: 3.4 us for one
      // decode row of the 7B, on the path of every decode step).
      const __m128i round_bias = _mm_set1_epi32(0x7fff), one = _mm_set1_epi32(1);
      const __m128i abs_mask = _mm_set1_epi32(0x7fffffff), inf = _mm_set1_epi32(0x7f800000);
      const __m128i quiet = _mm_set1_epi32(0x40);
      auto eight_to_four = [&](const float* at) {
        const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
        const __m128i high = _mm_srli_epi32(bits, 16);
        const __m128i rounded = _mm_srli_epi32(
            _mm_add_epi32(_mm_add_epi32(bits, round_bias), _mm_and_si128(high, one)), 16);
        // |bits| <= 0x7fffffff, so the signed compare is exact.
        const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(bits, abs_mask), inf);
        const __m128i h = _mm_or_si128(_mm_and_si128(nan, _mm_or_si128(high, quiet)),
                                       _mm_andnot_si128(nan, rounded));
        // Sign-extend the 16-bit values so the signed pack keeps them as they are.
        return _mm_srai_epi32(_mm_slli_epi32(h, 16), 16);
      };
      for (; i + 8 <= n; i += 8) {
        const __m128i packed = _mm_packs_epi32(eight_to_four(src + i), eight_to_four(src + i + 4));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + 2 * i), packed);
      }
#endif
      for (; i < n; ++i) {
        const uint16_t h = FloatToBf16(src[i]);
        std::memcpy(bytes + 2 * i, &h, sizeof(h));
      }
      return;
    }
    case DType::kFp16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToHalf(src[i]);
        std::memcpy(bytes + 2 * i, &h, sizeof(h));
      }
      return;
    case DType::kFp8E4m3:
      for (size_t i = 0; i < n; ++i) bytes[i] = FloatToFp8E4m3(src[i]);
      return;
    case DType::kInt8:
      for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>(FloatToInt8Kv(src[i]));
      return;
  }
}

namespace {

// Loads through memcpy: a tensor's bytes may sit at any address (a gRPC slice, a region offset).
template <typename Bits>
Bits Load(const char* p) {
  Bits b;
  std::memcpy(&b, p, sizeof(b));
  return b;
}

// A lane of Bits replicated over a 64-bit word.
template <typename Bits>
constexpr uint64_t Replicate(Bits lane) {
  uint64_t w = 0;
  for (size_t i = 0; i < sizeof(uint64_t) / sizeof(Bits); ++i) w = (w << (8 * sizeof(Bits))) | lane;
  return w;
}

// An element is not finite when its exponent bits are all ones. Eight bytes at a time (SWAR): with
// x = (w & E) ^ E a bad lane is a zero lane of x, found by the classic has-zero test (it may also
// flag a lane above a zero one, never miss one: only a flagged block is searched again). The
// exponent masks leave each lane's top bit clear, which the test needs.
template <typename Bits>
int64_t FirstWithExponent(const void* data, size_t n, Bits exponent) {
  const char* x = static_cast<const char*>(data);
  constexpr size_t kPerWord = sizeof(uint64_t) / sizeof(Bits);
  constexpr size_t kBlock = 256;  // elements
  const uint64_t kE = Replicate<Bits>(exponent);
  constexpr uint64_t kLow = Replicate<Bits>(1);
  constexpr uint64_t kHigh = Replicate<Bits>(static_cast<Bits>(Bits{1} << (8 * sizeof(Bits) - 1)));
  size_t first = 0;
  for (; first + kBlock <= n; first += kBlock) {
    uint64_t any = 0;
    for (size_t i = 0; i < kBlock; i += kPerWord) {
      const uint64_t v = (Load<uint64_t>(x + (first + i) * sizeof(Bits)) & kE) ^ kE;
      any |= (v - kLow) & ~v & kHigh;
    }
    if (any == 0) continue;
    for (size_t i = first; i < first + kBlock; ++i) {
      if ((Load<Bits>(x + i * sizeof(Bits)) & exponent) == exponent) return static_cast<int64_t>(i);
    }
  }
  for (size_t i = first; i < n; ++i) {
    if ((Load<Bits>(x + i * sizeof(Bits)) & exponent) == exponent) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace

int64_t FirstNonFinite(DType t, const void* data, size_t n) {
  switch (t) {
    case DType::kBf16:
      return FirstWithExponent(data, n, uint16_t{0x7f80});
    case DType::kFp16:
      return FirstWithExponent(data, n, uint16_t{0x7c00});
    case DType::kFp32:
      return FirstWithExponent(data, n, uint32_t{0x7f800000});
    case DType::kFp8E4m3:  // no infinities: only S.1111.111, NaN
      for (size_t i = 0; i < n; ++i) {
        if ((static_cast<const unsigned char*>(data)[i] & 0x7fu) == 0x7fu) {
          return static_cast<int64_t>(i);
        }
      }
      return -1;
    case DType::kInt8:  // every code is a finite integer
      return -1;
  }
  return -1;
}

}  // namespace attnd
