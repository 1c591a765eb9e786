// The E4M3 conversions of base/fp8.h against an independent decoding formula (written in fp64 with
// ldexp from the format's definition) and a brute-force nearest-value search over the 254 finite
// codes: every code, every halfway point between neighbours, saturation, subnormals, signed zero
// and NaN; then the row quantisation.
#include "base/fp8.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/base/casts.h"
#include "base/dtype.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

// The format's definition: (-1)^s 2^(e-7) (1 + m/8) for e in 1..15 (except e = 15, m = 7: NaN),
// (-1)^s 2^-6 (m/8) for e = 0.
double Reference(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -magnitude : magnitude;
}

// Brute force: the finite code nearest to x, ties to the code with an even mantissa (its lowest
// bit clear), |x| past the largest value saturating to +-448. NaN not handled here.
int NearestCode(double x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x7f; ++c) {  // 0x7f is NaN
    const double err = std::fabs(Reference(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return sign | best;
}

TEST(Fp8E4m3Test, EveryCodeDecodesToTheFormatsValue) {
  for (int c = 0; c < 256; ++c) {
    const float got = Fp8E4m3ToFloat(static_cast<uint8_t>(c));
    const double want = Reference(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << c;
    EXPECT_EQ(std::signbit(got), c >= 0x80) << c;  // 0x80 is -0
  }
  // Landmarks of the format.
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.f);
  EXPECT_EQ(Fp8E4m3ToFloat(0xfe), -448.f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x08), 1.f / 64);   // smallest normal
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), 1.f / 512);  // smallest subnormal
  EXPECT_EQ(Fp8E4m3ToFloat(0x07), 7.f / 512);  // largest subnormal
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0xff)));
}

TEST(Fp8E4m3Test, EveryFiniteCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(FloatToFp8E4m3(Fp8E4m3ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
}

// Between every pair of neighbouring codes (same sign): the midpoint goes to the even one, the
// floats just either side of it to the nearer one.
TEST(Fp8E4m3Test, HalfwayCasesRoundToEven) {
  int checked = 0;
  for (int sign : {0, 0x80}) {
    for (int c = 0; c < 0x7e; ++c) {
      const double lo = Reference(sign | c), hi = Reference(sign | (c + 1));
      const float mid = static_cast<float>((lo + hi) / 2);  // exact: a few bits
      ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
      const int even = (c & 1) == 0 ? c : c + 1;
      EXPECT_EQ(FloatToFp8E4m3(mid), sign | even) << "between " << lo << " and " << hi;
      const float toward_lo = std::nextafter(mid, static_cast<float>(lo));
      const float toward_hi = std::nextafter(mid, static_cast<float>(hi));
      EXPECT_EQ(FloatToFp8E4m3(toward_lo), sign | c) << toward_lo;
      EXPECT_EQ(FloatToFp8E4m3(toward_hi), sign | (c + 1)) << toward_hi;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 126);
  // Named cases: 1 + 1/16 is halfway between 1 (0x38, even) and 1.125 (0x39).
  EXPECT_EQ(FloatToFp8E4m3(1.0625f), 0x38);
  EXPECT_EQ(FloatToFp8E4m3(1.1875f), 0x3a);  // between 0x39 and 0x3a: 0x3a is even
  EXPECT_EQ(FloatToFp8E4m3(-1.0625f), 0xb8);
}

TEST(Fp8E4m3Test, MatchesBruteForceOverAGridOfFloats) {
  // Every 4099th float from 0 to past 2^9 (normal, subnormal, halfway and saturated inputs), both
  // signs, plus random floats in the cache's working range.
  int64_t n = 0;
  for (uint32_t bits = 0; bits < 0x44100000u; bits += 4099) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float f = absl::bit_cast<float>(bits | sign);
      ASSERT_EQ(FloatToFp8E4m3(f), NearestCode(f)) << f;
      ++n;
    }
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> wide(-500.f, 500.f);
  std::uniform_real_distribution<float> narrow(-0.03f, 0.03f);
  for (int i = 0; i < 100000; ++i) {
    const float f = i % 2 ? wide(rng) : narrow(rng);
    ASSERT_EQ(FloatToFp8E4m3(f), NearestCode(f)) << f;
  }
  EXPECT_GT(n, 500000);
}

TEST(Fp8E4m3Test, SaturatesAt448) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float f :
       {448.f, 448.5f, 463.99f, 464.f, 480.f, 1e6f, std::numeric_limits<float>::max(), inf}) {
    EXPECT_EQ(FloatToFp8E4m3(f), 0x7e) << f;
    EXPECT_EQ(FloatToFp8E4m3(-f), 0xfe) << f;
  }
  // The largest finite below 448 rounds to 416 or 448, never to the NaN code.
  EXPECT_EQ(FloatToFp8E4m3(std::nextafter(448.f, 0.f)), 0x7e);
  EXPECT_EQ(FloatToFp8E4m3(432.f), 0x7e);  // halfway 416 / 448: 448 (0x7e) is even
  EXPECT_EQ(FloatToFp8E4m3(431.f), 0x7d);
}

TEST(Fp8E4m3Test, Subnormals) {
  EXPECT_EQ(FloatToFp8E4m3(1.f / 512), 0x01);
  EXPECT_EQ(FloatToFp8E4m3(1.f / 1024), 0x00);   // halfway 0 / 2^-9: zero is even
  EXPECT_EQ(FloatToFp8E4m3(-1.f / 1024), 0x80);  // and keeps the sign
  EXPECT_EQ(FloatToFp8E4m3(std::nextafter(1.f / 1024, 1.f)), 0x01);
  EXPECT_EQ(FloatToFp8E4m3(3.f / 1024), 0x02);   // halfway 0x01 / 0x02
  EXPECT_EQ(FloatToFp8E4m3(5.f / 1024), 0x02);   // halfway 0x02 / 0x03
  EXPECT_EQ(FloatToFp8E4m3(15.f / 1024), 0x08);  // halfway 7/512 and 8/512 = 2^-6: the normal
  EXPECT_EQ(FloatToFp8E4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(FloatToFp8E4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(FloatToFp8E4m3(std::numeric_limits<float>::min()), 0x00);
}

TEST(Fp8E4m3Test, SignedZeroAndNan) {
  EXPECT_EQ(FloatToFp8E4m3(0.f), 0x00);
  EXPECT_EQ(FloatToFp8E4m3(-0.f), 0x80);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FloatToFp8E4m3(nan), 0x7f);
  EXPECT_EQ(FloatToFp8E4m3(-nan), 0xff);
  EXPECT_EQ(FloatToFp8E4m3(absl::bit_cast<float>(0x7f800001u)),
            0x7f);  // a signalling NaN, low payload only
}

TEST(Fp8E4m3Test, DTypeConversionsUseTheCodes) {
  EXPECT_EQ(DTypeName(DType::kFp8E4m3), "fp8_e4m3");
  EXPECT_EQ(ElementSize(DType::kFp8E4m3), 1u);
  EXPECT_FALSE(IsKnownDType(DType::kFp8E4m3));  // never a request tensor
  EXPECT_TRUE(IsKvDType(DType::kFp8E4m3));
  const float in[4] = {1.f, -448.f, 1000.f, 1.f / 512};
  uint8_t codes[4];
  ConvertFromFloat(in, 4, DType::kFp8E4m3, codes);
  EXPECT_EQ(codes[0], 0x38);
  EXPECT_EQ(codes[1], 0xfe);
  EXPECT_EQ(codes[2], 0x7e);
  EXPECT_EQ(codes[3], 0x01);
  float back[4];
  ConvertToFloat(codes, DType::kFp8E4m3, 4, back);
  EXPECT_EQ(back[0], 1.f);
  EXPECT_EQ(back[2], 448.f);
  const uint8_t with_nan[3] = {0x38, 0xff, 0x7e};
  EXPECT_EQ(FirstNonFinite(DType::kFp8E4m3, with_nan, 3), 1);
  EXPECT_EQ(FirstNonFinite(DType::kFp8E4m3, codes, 4), -1);
}

TEST(Fp8QuantizeRowTest, ScaleIsTheRowMaxOver448AndTheMaxIsExact) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.f, 3.f);
  std::vector<float> x(128);
  for (float& v : x) v = dist(rng);
  x[17] = -20.f;  // the largest magnitude
  std::vector<Fp8E4m3> codes(x.size());
  const float multiplier = 1.25f;
  const float scale = Fp8QuantizeRow(x.data(), multiplier, 128, codes.data());
  EXPECT_EQ(scale, (20.f * multiplier) / 448.f);
  EXPECT_EQ(codes[17].bits, 0xfe);  // -448
  std::vector<float> back(x.size());
  Fp8DequantizeRow(codes.data(), scale, 128, back.data());
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = static_cast<double>(x[i] * multiplier);
    // Half an E4M3 step: 2^-4 relative in the normal range, 2^-10 scale among subnormals.
    const double bound = std::max(std::fabs(want) / 16, std::ldexp(1.0, -10) * scale) * 1.0001;
    EXPECT_LE(std::fabs(back[i] - want), bound) << i;
    // The code is the brute-force nearest to x / scale.
    EXPECT_EQ(codes[i].bits, NearestCode((x[i] * multiplier) / scale)) << i;
  }
}

TEST(Fp8QuantizeRowTest, ZeroRowHasScaleZeroAndReadsBackAsZeros) {
  std::vector<float> x(64, 0.f);
  x[3] = -0.f;
  std::vector<Fp8E4m3> codes(64, Fp8E4m3{0x55});
  EXPECT_EQ(Fp8QuantizeRow(x.data(), 2.f, 64, codes.data()), 0.f);
  std::vector<float> back(64, 1.f);
  Fp8DequantizeRow(codes.data(), 0.f, 64, back.data());
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(codes[i].bits, 0) << i;
    EXPECT_EQ(back[i], 0.f) << i;
  }
}

}  // namespace
}  // namespace attnd
