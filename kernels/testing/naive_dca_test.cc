// Checks the reference itself on cases small enough to write out by hand.
#include "kernels/testing/naive_dca.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace attnd {
namespace naive {
namespace {

TEST(LengthScaleF64Test, FollowsTheFormula) {
  EXPECT_EQ(LengthScaleF64(1000, 0), 1.0);
  EXPECT_EQ(LengthScaleF64(64, 64), 1.0);
  EXPECT_EQ(LengthScaleF64(10, 64), 1.0);
  EXPECT_NEAR(LengthScaleF64(640, 64), 0.1 * std::log(10.0) + 1.0, 1e-15);
}

// One head, D = 1, cl = 2: the query at p = 4 has prev = 4, so key 4 is intra, keys 2..3 succ and
// keys 0..1 inter.
TEST(AttendTest, PicksTheVariantPerStage) {
  DcaGeometry geo;
  geo.num_q_heads = 1;
  geo.num_kv_heads = 1;
  geo.head_dim = 1;
  geo.chunk_len = 2;
  const std::vector<double> q = {0.5, -1.0, 2.0};  // intra, succ, inter
  const std::vector<double> k = {0.1, -0.2, 0.3, 0.4, -0.5};
  const std::vector<double> v = {1.0, 2.0, 3.0, 4.0, 5.0};
  const double scale = 0.7;
  const std::vector<double> out = Attend(geo, 4, q, k, v, scale);
  const double logits[5] = {scale * 2.0 * 0.1, scale * 2.0 * -0.2, scale * -1.0 * 0.3,
                            scale * -1.0 * 0.4, scale * 0.5 * -0.5};
  double num = 0, den = 0;
  for (int j = 0; j < 5; ++j) {
    num += std::exp(logits[j]) * v[j];
    den += std::exp(logits[j]);
  }
  ASSERT_EQ(out.size(), 1u);
  EXPECT_NEAR(out[0], num / den, 1e-12);

  // p = 1 is in chunk 0: both keys are intra, the other variants are unused.
  const std::vector<double> out1 = Attend(geo, 1, q, k, v, scale);
  const double l0 = scale * 0.5 * 0.1, l1 = scale * 0.5 * -0.2;
  EXPECT_NEAR(out1[0], (std::exp(l0) * 1.0 + std::exp(l1) * 2.0) / (std::exp(l0) + std::exp(l1)),
              1e-12);
}

TEST(NaiveSequenceTest, DecodeScalesKeyAndQuery) {
  DcaGeometry geo;
  geo.num_q_heads = 1;
  geo.num_kv_heads = 1;
  geo.head_dim = 1;
  geo.chunk_len = 100;
  geo.original_max_position_embeddings = 1;
  geo.softmax_scale = 1.f;
  NaiveSequence seq(geo, 1);
  // Prefill 1 token with prompt_len 1: s = 1, output = its own value.
  const std::vector<float> q5 = {1, 0, 0, 0, 0};
  auto out = seq.Prefill(0, q5, {1.f}, {3.f}, 1);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FLOAT_EQ((*out)[0], 3.f);
  // Decode at L = 2: s = 0.1 ln 2 + 1; logits s*k0*s*q and s*k1*s*q.
  auto out2 = seq.Decode(0, {0.5f, 0.f, 0.f}, {2.f}, {7.f});
  ASSERT_TRUE(out2.ok()) << out2.status();
  const double s = 0.1 * std::log(2.0) + 1.0;
  const double l0 = s * 0.5 * 1.0, l1 = s * 0.5 * s * 2.0;
  EXPECT_NEAR((*out2)[0], (std::exp(l0) * 3 + std::exp(l1) * 7) / (std::exp(l0) + std::exp(l1)),
              1e-6);
  EXPECT_EQ(seq.length(0), 2);
}

TEST(NaiveSequenceTest, RejectsBadInput) {
  DcaGeometry geo;
  geo.num_q_heads = 1;
  geo.num_kv_heads = 1;
  geo.head_dim = 1;
  geo.chunk_len = 100;
  NaiveSequence seq(geo, 1);
  auto bad_layer = seq.Prefill(1, {1, 0, 0, 0, 0}, {1.f}, {1.f}, 1);
  EXPECT_EQ(bad_layer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad_layer.status().message(), "layer 1 out of range [0, 1)");
  auto short_prompt = seq.Prefill(0, {1, 0, 0, 0, 0, 1, 0, 0, 0, 0}, {1.f, 2.f}, {1.f, 2.f}, 1);
  EXPECT_EQ(short_prompt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(short_prompt.status().message(), "prompt_len 1 < length after prefill 2");
  auto bad_q = seq.Decode(0, {1.f}, {1.f}, {1.f});
  EXPECT_EQ(bad_q.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad_q.status().message(), "decode sizes q=1 k=1 v=1 do not match one token");
  EXPECT_EQ(seq.length(0), 0);
}

// D = 4, rotary_dim 2 (dims 2..3 pass through), theta 100, cl = 6, chunk_size 8: the token at
// p = 9 has r = 3, so intra/key rotate by 3, succ by min(9, 8) = 8, inter by min(11, 8) = 8,
// succ_critical by 9 and inter_critical by 11, all at frequency 1 (i = 0 only).
TEST(DualChunkRotaryTest, RotatesEachVariantByItsPosition) {
  DcaGeometry geo;
  geo.num_q_heads = 1;
  geo.num_kv_heads = 1;
  geo.head_dim = 4;
  geo.chunk_len = 6;
  geo.chunk_size = 8;
  geo.rope_theta = 100.0;
  geo.rotary_dim = 2;
  const std::vector<float> q = {1.f, 0.5f, 7.f, -3.f};
  const std::vector<float> k = {-2.f, 1.f, 4.f, 5.f};
  absl::StatusOr<RotatedInputs> r = DualChunkRotary(geo, 9, q, k, 5);
  ASSERT_TRUE(r.ok()) << r.status();
  const double positions[5] = {3, 8, 8, 9, 11};
  for (int v = 0; v < 5; ++v) {
    const double a = positions[v];
    EXPECT_NEAR(r->q_variants[v * 4 + 0], 1.0 * std::cos(a) - 0.5 * std::sin(a), 1e-6) << v;
    EXPECT_NEAR(r->q_variants[v * 4 + 1], 0.5 * std::cos(a) + 1.0 * std::sin(a), 1e-6) << v;
    EXPECT_EQ(r->q_variants[v * 4 + 2], 7.f);
    EXPECT_EQ(r->q_variants[v * 4 + 3], -3.f);
  }
  EXPECT_NEAR(r->k[0], -2.0 * std::cos(3.0) - 1.0 * std::sin(3.0), 1e-6);
  EXPECT_NEAR(r->k[1], 1.0 * std::cos(3.0) - 2.0 * std::sin(3.0), 1e-6);
  EXPECT_EQ(r->k[2], 4.f);
  EXPECT_EQ(r->k[3], 5.f);

  geo.rotary_dim = 0;
  EXPECT_FALSE(DualChunkRotary(geo, 9, q, k, 5).ok());
}

}  // namespace
}  // namespace naive
}  // namespace attnd
