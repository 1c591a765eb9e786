// The int8 conversions of base/int8_kv.h against an independent rounding (fp64 nearbyint, which
// rounds half to even in the default mode, then a clamp): every code, every halfway point between
// neighbours and the floats either side of it, a grid over every binade up to past the clamp,
// the clamp itself, signed zero and NaN; then the row quantisation (scale, codes, error bound,
// zero, tiny and non-finite rows) and the DType conversions.
#include "base/int8_kv.h"

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

// The format's rounding, independently: nearest integer, ties to even, then clamped.
int Reference(double q) {
  const double r = std::nearbyint(q);
  return static_cast<int>(std::fmax(-127.0, std::fmin(127.0, r)));
}

TEST(Int8KvTest, EveryCodeRoundTrips) {
  for (int c = -127; c <= 127; ++c) {
    EXPECT_EQ(FloatToInt8Kv(static_cast<float>(c)), c) << c;
  }
}

// Between every pair of neighbouring codes: the midpoint goes to the even one, the floats just
// either side of it to the nearer one.
TEST(Int8KvTest, HalfwayCasesRoundToEven) {
  int checked = 0;
  for (int c = -127; c < 127; ++c) {
    const float mid = static_cast<float>(c) + 0.5f;  // exact
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(FloatToInt8Kv(mid), even) << mid;
    EXPECT_EQ(FloatToInt8Kv(std::nextafter(mid, -1000.f)), c) << mid;
    EXPECT_EQ(FloatToInt8Kv(std::nextafter(mid, 1000.f)), c + 1) << mid;
    ++checked;
  }
  EXPECT_EQ(checked, 254);
  // Named cases, both signs: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0, -1.5 -> -2, -2.5 -> -2.
  EXPECT_EQ(FloatToInt8Kv(0.5f), 0);
  EXPECT_EQ(FloatToInt8Kv(1.5f), 2);
  EXPECT_EQ(FloatToInt8Kv(2.5f), 2);
  EXPECT_EQ(FloatToInt8Kv(-0.5f), 0);
  EXPECT_EQ(FloatToInt8Kv(-1.5f), -2);
  EXPECT_EQ(FloatToInt8Kv(-2.5f), -2);
  EXPECT_EQ(FloatToInt8Kv(126.5f), 126);
  EXPECT_EQ(FloatToInt8Kv(-126.5f), -126);
}

TEST(Int8KvTest, MatchesTheReferenceOverAGridOfFloats) {
  // Every 127th float from 0 to 2^9 (every binade below the clamp, the clamp and past it), both
  // signs: about 18 million inputs.
  int64_t n = 0;
  for (uint32_t bits = 0; bits < 0x44000000u; bits += 127) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float f = absl::bit_cast<float>(bits | sign);
      const int8_t got = FloatToInt8Kv(f);
      if (got != Reference(f)) {
        ASSERT_EQ(got, Reference(f)) << f;
      }
      ++n;
    }
  }
  EXPECT_GT(n, 17000000);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-130.f, 130.f);
  for (int i = 0; i < 200000; ++i) {
    const float f = dist(rng);
    ASSERT_EQ(FloatToInt8Kv(f), Reference(f)) << f;
  }
}

// The division x / scale may land a little past 127 for the row's largest element; anything past
// 127 (infinity included) is 127 and -128 is never produced.
TEST(Int8KvTest, ClampsToPlusMinus127) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {127.f, std::nextafter(127.f, 200.f), 127.4f, 127.5f, 128.f, 1e6f,
                  std::numeric_limits<float>::max(), inf}) {
    EXPECT_EQ(FloatToInt8Kv(f), 127) << f;
    EXPECT_EQ(FloatToInt8Kv(-f), -127) << f;
  }
  EXPECT_EQ(FloatToInt8Kv(std::nextafter(127.f, 0.f)), 127);
  EXPECT_EQ(FloatToInt8Kv(-128.f), -127);
  EXPECT_EQ(FloatToInt8Kv(-128.5f), -127);
}

TEST(Int8KvTest, SignedZeroTinyValuesAndNan) {
  EXPECT_EQ(FloatToInt8Kv(0.f), 0);
  EXPECT_EQ(FloatToInt8Kv(-0.f), 0);
  EXPECT_EQ(FloatToInt8Kv(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(FloatToInt8Kv(-std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(FloatToInt8Kv(std::nextafter(0.5f, 0.f)), 0);
  EXPECT_EQ(FloatToInt8Kv(-std::nextafter(0.5f, 1.f)), -1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FloatToInt8Kv(nan), 0);
  EXPECT_EQ(FloatToInt8Kv(-nan), 0);
  EXPECT_EQ(FloatToInt8Kv(absl::bit_cast<float>(0x7f800001u)), 0);  // a signalling NaN
}

TEST(Int8KvTest, DTypeConversionsUseTheCodes) {
  EXPECT_EQ(DTypeName(DType::kInt8), "int8");
  EXPECT_EQ(ElementSize(DType::kInt8), 1u);
  EXPECT_FALSE(IsKnownDType(DType::kInt8));  // never a request tensor
  EXPECT_TRUE(IsKvDType(DType::kInt8));
  EXPECT_TRUE(HasRowScale(DType::kInt8));
  EXPECT_TRUE(HasRowScale(DType::kFp8E4m3));
  EXPECT_FALSE(HasRowScale(DType::kBf16));
  EXPECT_FALSE(HasRowScale(DType::kFp32));
  const float in[5] = {1.f, -127.f, 1000.f, 2.5f, -3.5f};
  int8_t codes[5];
  ConvertFromFloat(in, 5, DType::kInt8, codes);
  EXPECT_EQ(codes[0], 1);
  EXPECT_EQ(codes[1], -127);
  EXPECT_EQ(codes[2], 127);
  EXPECT_EQ(codes[3], 2);
  EXPECT_EQ(codes[4], -4);
  float back[5];
  ConvertToFloat(codes, DType::kInt8, 5, back);
  EXPECT_EQ(back[1], -127.f);
  EXPECT_EQ(back[4], -4.f);
  EXPECT_EQ(FirstNonFinite(DType::kInt8, codes, 5), -1);
}

TEST(Int8QuantizeRowTest, ScaleIsTheRowMaxOver127AndTheMaxIsExact) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.f, 3.f);
  std::vector<float> x(128);
  for (float& v : x) v = dist(rng);
  x[17] = -20.f;  // the largest magnitude
  std::vector<Int8Kv> codes(x.size());
  const float multiplier = 1.25f;
  const float scale = Int8QuantizeRow(x.data(), multiplier, 128, codes.data());
  EXPECT_EQ(scale, (20.f * multiplier) / 127.f);
  EXPECT_EQ(codes[17].code, -127);
  std::vector<float> back(x.size());
  Int8DequantizeRow(codes.data(), scale, 128, back.data());
  for (size_t i = 0; i < x.size(); ++i) {
    const float xi = x[i] * multiplier;
    // The code is the reference's nearest integer to the fp32 quotient, and the value it reads
    // back is one fp32 product, within half a step of x (plus the fp32 roundings).
    EXPECT_EQ(codes[i].code, Reference(xi / scale)) << i;
    EXPECT_EQ(back[i], static_cast<float>(codes[i].code) * scale) << i;
    EXPECT_LE(std::fabs(static_cast<double>(back[i]) - xi), scale * 0.5 * 1.0001) << i;
  }
}

// Negating a row negates its codes and keeps its scale (no -128: the codes are symmetric).
TEST(Int8QuantizeRowTest, IsSymmetric) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> dist(-4.f, 4.f);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> x(64), neg(64);
    for (int i = 0; i < 64; ++i) neg[i] = -(x[i] = dist(rng));
    std::vector<Int8Kv> a(64), b(64);
    ASSERT_EQ(Int8QuantizeRow(x.data(), 0.75f, 64, a.data()),
              Int8QuantizeRow(neg.data(), 0.75f, 64, b.data()));
    for (int i = 0; i < 64; ++i) {
      ASSERT_EQ(a[i].code, -b[i].code) << i;
      ASSERT_NE(a[i].code, -128) << i;
    }
  }
}

TEST(Int8QuantizeRowTest, ZeroRowHasScaleZeroAndReadsBackAsZeros) {
  std::vector<float> x(64, 0.f);
  x[3] = -0.f;
  std::vector<Int8Kv> codes(64, Int8Kv{55});
  EXPECT_EQ(Int8QuantizeRow(x.data(), 2.f, 64, codes.data()), 0.f);
  std::vector<float> back(64, 1.f);
  Int8DequantizeRow(codes.data(), 0.f, 64, back.data());
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(codes[i].code, 0) << i;
    EXPECT_EQ(back[i], 0.f) << i;
  }
  // A row so small that max / 127 underflows to 0 is a zero row too (never 0 / 0).
  std::vector<float> tiny(8, 0.f);
  tiny[2] = std::numeric_limits<float>::denorm_min() * 63;
  EXPECT_EQ(Int8QuantizeRow(tiny.data(), 1.f, 8, codes.data()), 0.f);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(codes[i].code, 0) << i;
}

// A NaN or an infinity anywhere in a row (inputs are checked finite upstream; this is what happens
// if one gets through) makes that row's scale non-finite and its codes 0: the whole row reads back
// as NaN, whatever position the bad value has.
TEST(Int8QuantizeRowTest, ANonFiniteValuePoisonsItsRowOnly) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, -nan, inf, -inf}) {
    for (int at : {0, 5, 15}) {
      std::vector<float> x = {1.f, -2.f, 3.f, 0.5f, 7.f, -1.f, 0.f, 2.f,
                              1.f, 1.f,  1.f, 1.f,  1.f, 1.f,  1.f, 1.f};
      x[at] = bad;
      std::vector<Int8Kv> codes(16, Int8Kv{9});
      const float scale = Int8QuantizeRow(x.data(), 1.f, 16, codes.data());
      EXPECT_FALSE(std::isfinite(scale)) << bad << " at " << at;
      EXPECT_EQ(std::isnan(scale), std::isnan(bad)) << bad << " at " << at;
      std::vector<float> back(16);
      Int8DequantizeRow(codes.data(), scale, 16, back.data());
      for (int i = 0; i < 16; ++i) {
        EXPECT_EQ(codes[i].code, 0) << i;
        EXPECT_TRUE(std::isnan(back[i])) << bad << " at " << at << ", element " << i;
      }
    }
  }
  // Both kinds in one row: the NaN wins, wherever it is.
  std::vector<float> both = {nan, inf, 1.f}, both2 = {inf, 1.f, nan};
  std::vector<Int8Kv> codes(3);
  EXPECT_TRUE(std::isnan(Int8QuantizeRow(both.data(), 1.f, 3, codes.data())));
  EXPECT_TRUE(std::isnan(Int8QuantizeRow(both2.data(), 1.f, 3, codes.data())));
}

}  // namespace
}  // namespace attnd
