// attention_tile.cuh (the online softmax and masks the attention kernels share) through
// attention_tile_probe.h, against a double-precision softmax computed here.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/attention_tile_probe.h"
#include "kernels/cuda/testing/gpu_test.h"

namespace attnd {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool Visible(const SoftmaxProbeInput& in, int t, int row, int col) {
  if (in.gather) {
    const int32_t k = in.keys[t * kProbeCols + col];
    return k >= 0 && (!in.causal || k <= in.pos[row]);
  }
  const int32_t key = t * kProbeCols + col;
  return key < in.k_hi && (!in.causal || key <= in.pos[row]);
}

// bf16 of x, round to nearest even (the cvt.rn of PackProbs), back as a float.
float Bf16Round(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  float y;
  std::memcpy(&y, &b, 4);
  return y;
}

void CheckAgainstReference(const SoftmaxProbeInput& in) {
  SoftmaxProbeOutput got;
  ASSERT_TRUE(RunSoftmaxProbe(in, &got).ok());
  const int last = in.tiles - 1;
  for (int r = 0; r < kProbeRows; ++r) {
    double m = -kInf;
    for (int t = 0; t < in.tiles; ++t)
      for (int c = 0; c < kProbeCols; ++c)
        if (Visible(in, t, r, c))
          m = std::max(m, double{in.scores[(t * kProbeRows + r) * kProbeCols + c]});
    double sum = 0, acc = 0;
    for (int t = 0; t < in.tiles; ++t)
      for (int c = 0; c < kProbeCols; ++c) {
        if (!Visible(in, t, r, c)) continue;
        const double p =
            std::exp2((in.scores[(t * kProbeRows + r) * kProbeCols + c] - m) * in.scale);
        sum += p;
        acc += p * in.values[t * kProbeCols + c];
      }
    SCOPED_TRACE(testing::Message() << "row " << r);
    if (m == -kInf) {  // sees no key: zeros, never NaN
      EXPECT_EQ(got.max[r], -std::numeric_limits<float>::infinity());
      EXPECT_EQ(got.sum[r], 0.f);
      EXPECT_EQ(got.out[r], 0.f);
      EXPECT_EQ(got.merged[r], -std::numeric_limits<float>::infinity());
    } else {
      const double out = acc / sum, lse = m * in.scale + std::log2(sum);
      EXPECT_EQ(got.max[r], static_cast<float>(m));  // a max of the inputs, exactly
      EXPECT_NEAR(got.out[r], out, 2e-5 * (1 + std::fabs(out)));
      EXPECT_NEAR(std::log2(double{got.sum[r]}) + got.max[r] * in.scale, lse,
                  2e-5 * (1 + std::fabs(lse)));
      EXPECT_NEAR(got.merged[r], lse, 2e-5 * (1 + std::fabs(lse)));
    }
    for (int c = 0; c < kProbeCols; ++c) {
      const double p =
          Visible(in, last, r, c)
              ? std::exp2((in.scores[(last * kProbeRows + r) * kProbeCols + c] - m) * in.scale)
              : 0.0;
      const float gp = got.probs[r * kProbeCols + c];
      EXPECT_NEAR(gp, p, 2e-6 + 2e-6 * p) << "col " << c;
      EXPECT_EQ(got.packed[r * kProbeCols + c], Bf16Round(gp)) << "col " << c;
    }
  }
}

SoftmaxProbeInput RandomInput(int tiles, uint32_t seed, float spread, float drift) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  SoftmaxProbeInput in;
  in.tiles = tiles;
  in.scores.resize(static_cast<size_t>(tiles) * kProbeRows * kProbeCols);
  for (int t = 0; t < tiles; ++t)  // drift > 0: later tiles score higher, so the max moves on
    for (int i = 0; i < kProbeRows * kProbeCols; ++i)
      in.scores[t * kProbeRows * kProbeCols + i] = spread * g(rng) + drift * t;
  in.values.resize(static_cast<size_t>(tiles) * kProbeCols);
  for (float& v : in.values) v = g(rng);
  in.scale = 0.088388f * 1.4426950f;  // 1 / sqrt(128) * log2(e)
  in.pos.assign(kProbeRows, 0);
  return in;
}

class AttentionTile : public testing::TestWithParam<bool> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

// The range cases run through both range policies (RangeMask, TwoBoundMask): the same keys.
TEST_P(AttentionTile, RangeMaskAcrossTilesWithARisingMax) {
  for (const bool two_bound : {false, true}) {
    SCOPED_TRACE(two_bound ? "TwoBoundMask" : "RangeMask");
    SoftmaxProbeInput in = RandomInput(4, 1, 8.f, 12.f);
    in.sum_tile = GetParam();
    in.two_bound = two_bound;
    in.k_hi = 3 * kProbeCols + 21;  // the last tile is partly past the range, its columns hidden
    CheckAgainstReference(in);
  }
}

TEST_P(AttentionTile, CausalRangeMaskWithRowsThatSeeNothing) {
  for (const bool two_bound : {false, true}) {
    SCOPED_TRACE(two_bound ? "TwoBoundMask" : "RangeMask");
    SoftmaxProbeInput in = RandomInput(3, 2, 4.f, -3.f);
    in.sum_tile = GetParam();
    in.two_bound = two_bound;
    in.k_hi = 3 * kProbeCols;
    in.causal = true;
    for (int r = 0; r < kProbeRows; ++r) in.pos[r] = r * 13 - 1;  // row 0 at -1: no key at all
    in.pos[5] = 1000;                                             // past k_hi: the range bounds it
    in.pos[6] = 63;                                               // only the first tile
    CheckAgainstReference(in);
  }
}

TEST_P(AttentionTile, GatherMaskWithEmptySlotsAndCausalRows) {
  SoftmaxProbeInput in = RandomInput(3, 3, 6.f, 2.f);
  in.sum_tile = GetParam();
  in.gather = true;
  in.causal = true;
  std::mt19937 rng(4);
  in.keys.resize(3 * kProbeCols);
  for (int32_t& k : in.keys) k = rng() % 5 == 0 ? -1 : static_cast<int32_t>(rng() % 4096);
  for (int c = 40; c < kProbeCols; ++c) in.keys[2 * kProbeCols + c] = -1;  // a short last tile
  for (int r = 0; r < kProbeRows; ++r) in.pos[r] = 256 * r;  // row 0 sees only key 0, if gathered
  CheckAgainstReference(in);
}

TEST_P(AttentionTile, GatherMaskNotCausalSeesEveryGatheredKey) {
  SoftmaxProbeInput in = RandomInput(2, 5, 3.f, 0.f);
  in.sum_tile = GetParam();
  in.gather = true;
  in.keys.resize(2 * kProbeCols);
  for (int c = 0; c < 2 * kProbeCols; ++c) in.keys[c] = c % 3 == 0 ? -1 : 7 * c;
  for (int r = 0; r < kProbeRows; ++r) in.pos[r] = -1;  // ignored without causal
  CheckAgainstReference(in);
}

INSTANTIATE_TEST_SUITE_P(Orders, AttentionTile, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& p) {
                           return p.param ? "TileSum" : "Running";
                         });

}  // namespace
}  // namespace attnd
