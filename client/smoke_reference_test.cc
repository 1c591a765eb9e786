#include "client/smoke_reference.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/testing/naive_dca.h"

namespace attnd {
namespace client {
namespace {

std::vector<float> Random(std::mt19937* rng, size_t n) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(*rng);
  return v;
}

// Small chunks and scaling on (orig 40 < lengths), so all three stages and s(L) > 1 are exercised.
DcaGeometry Geometry() {
  DcaGeometry g;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 8;
  g.chunk_len = 24;
  g.original_max_position_embeddings = 40;
  g.softmax_scale = 1.f / std::sqrt(8.f);
  return g;
}

TEST(SmokeReferenceTest, MatchesNaiveSequenceOnEveryRowAndSubset) {
  const DcaGeometry g = Geometry();
  SmokeReference ref(g, 2, 3);
  naive::NaiveSequence naive(g, 2);
  std::mt19937 rng(7);
  const int64_t prompt = 90;
  const int64_t qrow = 5 * 4 * 8, kvrow = 2 * 8, orow = 4 * 8;
  for (int layer = 0; layer < 2; ++layer) {
    for (int64_t t : {30, 1, 59}) {
      const auto q = Random(&rng, t * qrow), k = Random(&rng, t * kvrow),
                 v = Random(&rng, t * kvrow);
      const int64_t start = ref.length(layer);
      // Layer 1 checks a sampled subset; layer 0 every row.
      const std::vector<int64_t> rows = RowsToCheck(g, start, t, layer == 0 ? 1e12 : 2000);
      if (layer == 0) {
        ASSERT_EQ(static_cast<int64_t>(rows.size()), t);
      }
      const auto got = ref.Prefill(layer, q, k, v, prompt, rows);
      const auto want = naive.Prefill(layer, q, k, v, prompt);
      ASSERT_TRUE(got.ok() && want.ok());
      ASSERT_EQ(got->size(), rows.size() * orow);
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int64_t e = 0; e < orow; ++e) {
          ASSERT_EQ((*got)[i * orow + e], (*want)[rows[i] * orow + e]) << "row " << rows[i];
        }
      }
    }
    for (int step = 0; step < 5; ++step) {
      const auto q = Random(&rng, (step % 2 ? 3 : 5) * orow), k = Random(&rng, kvrow),
                 v = Random(&rng, kvrow);
      const auto got = ref.Decode(layer, q, k, v);
      const auto want = naive.Decode(layer, q, k, v);
      ASSERT_TRUE(got.ok() && want.ok());
      EXPECT_EQ(*got, *want);
    }
    EXPECT_EQ(ref.length(layer), naive.length(layer));
  }
}

TEST(SmokeReferenceTest, RowsToCheckKeepsBoundariesWhenSampling) {
  const DcaGeometry g = Geometry();
  const std::vector<int64_t> rows = RowsToCheck(g, 10, 60, 1);  // tiny budget: sample
  // Positions 10..69; chunk boundaries at 24 and 48 -> rows 13,14,15 and 37,38,39.
  for (int64_t r : {0, 13, 14, 15, 37, 38, 39, 59}) {
    EXPECT_NE(std::find(rows.begin(), rows.end(), r), rows.end()) << r;
  }
  EXPECT_LT(rows.size(), 60u);
  EXPECT_TRUE(std::is_sorted(rows.begin(), rows.end()));
}

}  // namespace
}  // namespace client
}  // namespace attnd
