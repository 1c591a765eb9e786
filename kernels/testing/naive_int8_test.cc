// The naive int8 reference checked against values worked out by hand (it is what the production
// kernels' int8 rows are tested against, so it gets its own landmarks).
#include "kernels/testing/naive_int8.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace attnd {
namespace naive {
namespace {

TEST(NaiveInt8Test, ScaleCodesTiesAndRoundTrip) {
  // max |x| = 127 gives scale 1, so the codes are x rounded: ties to even, both signs.
  const std::vector<float> x = {127.f, -127.f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 3.49f, 0.f};
  const Int8Row row = QuantizeInt8Row(x);
  EXPECT_EQ(row.scale, 1.f);
  EXPECT_EQ(row.codes, (std::vector<int8_t>{127, -127, 0, 2, 2, 0, -2, -2, 3, 0}));
  const std::vector<double> back = DequantizeInt8Row(row);
  EXPECT_EQ(back[3], 2.0);
  EXPECT_EQ(back[6], -2.0);

  // A row whose max is 12.7: scale 0.1 (in fp32), every value within half a step.
  const std::vector<float> y = {12.7f, -6.35f, 0.05f, 3.f};
  const Int8Row r2 = QuantizeInt8Row(y);
  EXPECT_EQ(r2.scale, 12.7f / 127.f);
  EXPECT_EQ(r2.codes[0], 127);
  EXPECT_EQ(r2.codes[3], 30);
  const std::vector<double> back2 = Int8RoundTrip(y);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_LE(std::fabs(back2[i] - y[i]), 0.05 * 1.0001) << i;
}

TEST(NaiveInt8Test, ZeroRow) {
  const Int8Row zeros = QuantizeInt8Row(std::vector<float>(5, 0.f));
  EXPECT_EQ(zeros.scale, 0.f);
  EXPECT_EQ(zeros.codes, std::vector<int8_t>(5, 0));
  for (double v : DequantizeInt8Row(zeros)) EXPECT_EQ(v, 0.0);
}

}  // namespace
}  // namespace naive
}  // namespace attnd
