#include "base/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/base/casts.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_EQ(DTypeName(DType::kBf16), "bf16");
  EXPECT_EQ(DTypeName(DType::kFp16), "fp16");
  EXPECT_EQ(DTypeName(DType::kFp32), "fp32");
  EXPECT_EQ(ElementSize(DType::kBf16), 2u);
  EXPECT_EQ(ElementSize(DType::kFp16), 2u);
  EXPECT_EQ(ElementSize(DType::kFp32), 4u);
}

TEST(DTypeTest, IsKnownDType) {
  EXPECT_TRUE(IsKnownDType(DType::kBf16));
  EXPECT_TRUE(IsKnownDType(DType::kFp16));
  EXPECT_TRUE(IsKnownDType(DType::kFp32));
  EXPECT_FALSE(IsKnownDType(static_cast<DType>(0)));  // unspecified on the wire
  EXPECT_FALSE(IsKnownDType(DType::kFp8E4m3));        // a KV dtype only
  EXPECT_FALSE(IsKnownDType(DType::kInt8));           // a KV dtype only
  EXPECT_FALSE(IsKnownDType(static_cast<DType>(6)));
  EXPECT_FALSE(IsKnownDType(static_cast<DType>(-1)));
  static_assert(IsKnownDType(DType::kFp32), "usable in constant expressions");
}

TEST(Bf16Test, EveryBf16RoundTripsExactly) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    EXPECT_EQ(absl::bit_cast<uint32_t>(f), h << 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(f))));
    } else {
      ASSERT_EQ(FloatToBf16(f), h) << std::hex << h;
    }
  }
}

TEST(Bf16Test, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly between bf16 1.0 (0x3f80) and 1 + 2^-7 (0x3f81): even mantissa wins.
  EXPECT_EQ(FloatToBf16(absl::bit_cast<float>(0x3f808000u)), 0x3f80);
  // 1 + 3 * 2^-8 is between 0x3f81 and 0x3f82: rounds to the even 0x3f82.
  EXPECT_EQ(FloatToBf16(absl::bit_cast<float>(0x3f818000u)), 0x3f82);
  // Just above / below the midpoint.
  EXPECT_EQ(FloatToBf16(absl::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(FloatToBf16(absl::bit_cast<float>(0x3f807fffu)), 0x3f80);
  // Negative values round the magnitude the same way.
  EXPECT_EQ(FloatToBf16(absl::bit_cast<float>(0xbf818000u)), 0xbf82);
  // The largest finite float rounds up to infinity.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(Bf16Test, NanAndInf) {
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // A NaN whose payload sits only in the low 16 bits must not turn into Inf.
  const uint16_t nan = FloatToBf16(absl::bit_cast<float>(0x7f800001u));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(nan)));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

// Independent fp16 decoder: value = (-1)^s * 2^(e-15) * (1 + m/1024), subnormals 2^-14 * m/1024.
double HalfValue(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0) {
    v = std::ldexp(m / 1024.0, -14);
  } else if (e == 31) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else {
    v = std::ldexp(1.0 + m / 1024.0, e - 15);
  }
  return s ? -v : v;
}

TEST(HalfTest, EveryHalfDecodesAndRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t half = static_cast<uint16_t>(h);
    const float f = HalfToFloat(half);
    const double expected = HalfValue(half);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), expected) << std::hex << h;
    ASSERT_EQ(FloatToHalf(f), half) << std::hex << h;
  }
}

// Brute-force nearest-even rounding over all finite halves of the same sign, as the reference.
uint16_t NearestHalf(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;  // halfway to 2^16 and beyond round to infinity
  uint16_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (uint16_t m = 0; m < 0x7c00; ++m) {
    const double err = std::fabs(HalfValue(m) - a);
    if (err < best_err || (err == best_err && (m & 1) == 0)) {
      best = m;
      best_err = err;
    }
  }
  return sign | best;
}

TEST(HalfTest, RoundsToNearestEvenIncludingSubnormals) {
  std::vector<float> cases = {
      1.0f + std::ldexp(1.0f, -11),                   // tie between 1 and 1+2^-10: even (1.0)
      1.0f + 3 * std::ldexp(1.0f, -11),               // tie: rounds up to even
      std::ldexp(1.0f, -25),                          // half the smallest subnormal: ties to zero
      std::ldexp(1.5f, -25),                          // above the tie: smallest subnormal
      std::ldexp(3.0f, -25),                          // 1.5 ulp of subnormals: tie to even (2)
      std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25),  // rounds up to the smallest normal
      65504.f,
      65519.f,
      65520.f,
      1e6f,
      -2.5e-6f,
      6.1e-5f,
      -0.f,
      0.f,
      1e-10f};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-26.f, 17.f);
  std::uniform_real_distribution<float> mantissa(1.f, 2.f);
  for (int i = 0; i < 300; ++i) {
    cases.push_back(std::ldexp(mantissa(rng), static_cast<int>(exponent(rng))) *
                    (i % 2 ? -1.f : 1.f));
  }
  for (float f : cases) {
    EXPECT_EQ(FloatToHalf(f), NearestHalf(f)) << f;
  }
  EXPECT_EQ(FloatToHalf(-0.f), 0x8000);
}

TEST(HalfTest, NanAndInf) {
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToHalf(1e30f), 0x7c00);
  // Payload below the bits fp16 keeps: must still be a NaN.
  const uint16_t nan = FloatToHalf(absl::bit_cast<float>(0x7f800001u));
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x3ff, 0);
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
}

// ConvertFromFloat to bf16 (vectorised where the CPU allows) equals FloatToBf16 value by value:
// random values of every magnitude, ties, NaNs of both signs and payloads, infinities, zeros,
// subnormals and the values next to FLT_MAX, at every length and offset around the vector width.
TEST(ConvertTest, Bf16ArraysMatchTheScalarConversion) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x3f808000u,
                                0x3f818000u, 0x3f80ffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u,
                                0x7f800000u, 0xff800000u, 0x7f800001u, 0xffc00000u, 0x7fffffffu,
                                0x7fbfffffu, 0x3f7f8000u, 0xbf7f7fffu};
  std::mt19937 rng(12);
  for (int i = 0; i < 4096; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  for (int i = 0; i < 256; ++i)
    bits.push_back((static_cast<uint32_t>(rng()) & 0xffff0000u) | 0x8000u);
  std::vector<float> src(bits.size());
  std::memcpy(src.data(), bits.data(), bits.size() * 4);
  for (size_t offset : {size_t{0}, size_t{1}, size_t{3}}) {
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{17}, src.size() - offset}) {
      std::vector<unsigned char> out(1 + 2 * n, 0xab);
      ConvertFromFloat(src.data() + offset, n, DType::kBf16, out.data() + 1);
      for (size_t i = 0; i < n; ++i) {
        uint16_t got;
        std::memcpy(&got, out.data() + 1 + 2 * i, 2);
        ASSERT_EQ(got, FloatToBf16(src[offset + i]))
            << "bits 0x" << std::hex << bits[offset + i] << " at " << std::dec << i << " of " << n;
      }
      EXPECT_EQ(out[0], 0xab);  // nothing written before the buffer
    }
  }
}

TEST(ConvertTest, RoundTripsThroughUnalignedBuffers) {
  const std::vector<float> src = {1.f, -2.5f, 0.1f, 65504.f, 3.14159f, -1e-6f};
  for (DType t : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    // One byte of offset: conversions must not assume alignment.
    std::vector<unsigned char> buf(1 + src.size() * ElementSize(t));
    ConvertFromFloat(src.data(), src.size(), t, buf.data() + 1);
    std::vector<float> back(src.size());
    ConvertToFloat(buf.data() + 1, t, src.size(), back.data());
    for (size_t i = 0; i < src.size(); ++i) {
      float expected = src[i];
      if (t == DType::kBf16) expected = Bf16ToFloat(FloatToBf16(src[i]));
      if (t == DType::kFp16) expected = HalfToFloat(FloatToHalf(src[i]));
      EXPECT_EQ(back[i], expected) << DTypeName(t) << " " << i;
    }
    // Little-endian element bytes: check the first element by hand.
    if (t == DType::kBf16) {
      EXPECT_EQ(buf[1], 0x80);  // 1.0 = 0x3f80
      EXPECT_EQ(buf[2], 0x3f);
    }
    if (t == DType::kFp16) {
      EXPECT_EQ(buf[1], 0x00);  // 1.0 = 0x3c00
      EXPECT_EQ(buf[2], 0x3c);
    }
  }
}

// Every bf16 and fp16 bit pattern is judged by its value: not finite exactly when the decoded
// float is NaN or infinite; the index found is the first bad one, at any alignment.
TEST(FirstNonFiniteTest, AgreesWithTheDecodedValues) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    EXPECT_EQ(FirstNonFinite(DType::kBf16, &h, 1) == 0, !std::isfinite(Bf16ToFloat(h))) << bits;
    EXPECT_EQ(FirstNonFinite(DType::kFp16, &h, 1) == 0, !std::isfinite(HalfToFloat(h))) << bits;
  }
  for (float f : {0.f, -0.f, 1e-45f, 3.4e38f, -3.4e38f}) {
    EXPECT_EQ(FirstNonFinite(DType::kFp32, &f, 1), -1) << f;
  }
  std::vector<char> buffer(4 * 1000 + 1);
  for (size_t bad : {size_t{0}, size_t{255}, size_t{256}, size_t{999}}) {
    std::vector<float> x(1000, 1.5f);
    x[bad] = std::numeric_limits<float>::infinity();
    std::memcpy(buffer.data() + 1, x.data(), 4 * x.size());  // unaligned on purpose
    EXPECT_EQ(FirstNonFinite(DType::kFp32, buffer.data() + 1, x.size()), static_cast<int64_t>(bad));
    x[bad] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(FirstNonFinite(DType::kFp32, x.data(), x.size()), static_cast<int64_t>(bad));
  }
  std::vector<float> clean(1000, -2.f);
  EXPECT_EQ(FirstNonFinite(DType::kFp32, clean.data(), clean.size()), -1);
}

}  // namespace
}  // namespace attnd
