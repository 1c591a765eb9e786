// The naive fp8 reference checked against values worked out by hand from the format (it is what
// the production conversions are tested against, so it gets its own landmarks).
#include "kernels/testing/naive_fp8.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace attnd {
namespace naive {
namespace {

TEST(NaiveFp8Test, Landmarks) {
  EXPECT_EQ(Fp8E4m3Value(0x00), 0.0);
  EXPECT_EQ(Fp8E4m3Value(0x01), 0.001953125);  // 2^-9
  EXPECT_EQ(Fp8E4m3Value(0x08), 0.015625);     // 2^-6
  EXPECT_EQ(Fp8E4m3Value(0x38), 1.0);
  EXPECT_EQ(Fp8E4m3Value(0x3b), 1.375);
  EXPECT_EQ(Fp8E4m3Value(0x7e), 448.0);
  EXPECT_EQ(Fp8E4m3Value(0xfe), -448.0);
  EXPECT_TRUE(std::isnan(Fp8E4m3Value(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4m3Value(0xff)));
  // Ascending over the non-negative codes, so the search is well defined.
  for (int c = 1; c <= 0x7e; ++c) EXPECT_LT(Fp8E4m3Value(c - 1), Fp8E4m3Value(c)) << c;
}

TEST(NaiveFp8Test, NearestTiesToEvenAndSaturates) {
  EXPECT_EQ(NearestFp8E4m3(1.0625), 0x38);  // 1 | 1.125: 0x38 even
  EXPECT_EQ(NearestFp8E4m3(1.1875), 0x3a);  // 1.125 | 1.25: 0x3a even
  EXPECT_EQ(NearestFp8E4m3(1.07), 0x39);
  EXPECT_EQ(NearestFp8E4m3(432.0), 0x7e);  // 416 | 448
  EXPECT_EQ(NearestFp8E4m3(1e9), 0x7e);
  EXPECT_EQ(NearestFp8E4m3(-1e9), 0xfe);
  EXPECT_EQ(NearestFp8E4m3(0.0009765625), 0x00);  // 2^-10: 0 | 2^-9, zero even
  EXPECT_EQ(NearestFp8E4m3(0.0029296875), 0x02);  // 3 * 2^-10
  EXPECT_EQ(NearestFp8E4m3(-0.0), 0x80);
}

TEST(NaiveFp8Test, RowScaleAndRoundTrip) {
  const std::vector<float> x = {0.5f, -3.5f, 1.f, 0.f};
  const Fp8Row row = QuantizeFp8Row(x);
  EXPECT_EQ(row.scale, 3.5f / 448.f);
  EXPECT_EQ(row.codes[1], 0xfe);
  const std::vector<double> back = DequantizeFp8Row(row);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], std::fabs(x[i]) / 16 + 1e-9);
  const Fp8Row zeros = QuantizeFp8Row(std::vector<float>(5, 0.f));
  EXPECT_EQ(zeros.scale, 0.f);
  EXPECT_EQ(zeros.codes, std::vector<uint8_t>(5, 0));
}

}  // namespace
}  // namespace naive
}  // namespace attnd
