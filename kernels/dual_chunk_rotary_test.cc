// The CPU dual-chunk rotary against the independent fp64 reference (kernels/testing/naive_dca.h).
#include "kernels/dual_chunk_rotary.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "base/thread_pool.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/testing/naive_dca.h"

namespace attnd {
namespace {

DcaGeometry Geometry(int32_t hq, int32_t hkv, int32_t d, int32_t rotary_dim) {
  DcaGeometry g;
  g.num_q_heads = hq;
  g.num_kv_heads = hkv;
  g.head_dim = d;
  g.chunk_len = 128;
  g.chunk_size = 160;
  g.rope_theta = 10000.0;
  g.rotary_dim = rotary_dim;
  g.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
  return g;
}

std::vector<float> Random(int64_t n, std::mt19937* rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(*rng);
  return v;
}

TEST(DualChunkRotaryPositionTest, FollowsTheContract) {
  // Qwen2.5-1M: chunk_size 262144, chunk_len 253952.
  const int64_t cs = 262144, cl = 253952;
  EXPECT_EQ(DualChunkRotaryPosition(kIntra, 5, cs, cl), 5);
  EXPECT_EQ(DualChunkRotaryPosition(kSucc, 5, cs, cl), 5 + cl);
  EXPECT_EQ(DualChunkRotaryPosition(kSucc, cl + 9000, cs, cl), cs);  // 9000 + cl > cs: clamped
  EXPECT_EQ(DualChunkRotaryPosition(kInter, 5, cs, cl), cs);         // min(2 cl - 1, cs)
  EXPECT_EQ(DualChunkRotaryPosition(kSuccCritical, cl + 9000, cs, cl), 9000 + cl);
  EXPECT_EQ(DualChunkRotaryPosition(kInterCritical, 2 * cl + 7, cs, cl), 7 + cs);
  // A chunk much longer than the local window: inter is 2 cl - 1.
  EXPECT_EQ(DualChunkRotaryPosition(kInter, 0, 1000, 100), 199);
}

TEST(RotaryInvFreqTest, IsThetaToTheMinusTwoIOverDim) {
  const std::vector<float> f = RotaryInvFreq(1e7, 128);
  ASSERT_EQ(f.size(), 64u);
  EXPECT_EQ(f[0], 1.f);
  for (int i = 0; i < 64; ++i) {
    EXPECT_FLOAT_EQ(f[i], static_cast<float>(std::pow(1e7, -2.0 * i / 128))) << i;
  }
}

TEST(CheckRotaryGeometryTest, RejectsWhatCannotBeRotated) {
  EXPECT_TRUE(CheckRotaryGeometry(Geometry(4, 2, 64, 64)).ok());
  EXPECT_TRUE(CheckRotaryGeometry(Geometry(4, 2, 64, 32)).ok());
  for (int32_t rd : {0, 3, 66}) {
    const absl::Status s = CheckRotaryGeometry(Geometry(4, 2, 64, rd));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << rd;
    EXPECT_NE(s.message().find("rotary dimension"), absl::string_view::npos) << s;
  }
  DcaGeometry g = Geometry(4, 2, 64, 64);
  g.chunk_size = 0;
  EXPECT_EQ(CheckRotaryGeometry(g).code(), absl::StatusCode::kInvalidArgument);
}

// Prefill (5 variants) and decode (3), full and partial rotary, tokens across three chunks, on a
// pool and on the calling thread.
TEST(DualChunkRotaryCpuTest, MatchesTheNaiveReference) {
  std::mt19937 rng(16);
  ThreadPool pool(2);
  for (int32_t rotary_dim : {64, 32}) {
    for (int nv : {5, 3}) {
      const DcaGeometry g = Geometry(4, 2, 64, rotary_dim);
      const int64_t start = 100, t = nv == 5 ? 300 : 1;
      const std::vector<float> q = Random(t * 4 * 64, &rng);
      const std::vector<float> k = Random(t * 2 * 64, &rng);
      std::vector<float> k_rot = k, qv(t * nv * 4 * 64);
      CpuRotaryParams p;
      p.q = q.data();
      p.k = k_rot.data();
      p.q_variants = qv.data();
      p.num_variants = nv;
      p.start = start;
      p.num_tokens = t;
      DualChunkRotaryCpu(g, RotaryInvFreq(g.rope_theta, g.rotary_dim), p,
                         nv == 5 ? &pool : nullptr);
      absl::StatusOr<naive::RotatedInputs> want = naive::DualChunkRotary(g, start, q, k, nv);
      ASSERT_TRUE(want.ok()) << want.status();
      // Positions below 300 here: the fp32 angle is within 2e-5 rad of the exact one.
      double worst = 0;
      for (size_t i = 0; i < qv.size(); ++i)
        worst = std::max<double>(worst, std::fabs(qv[i] - want->q_variants[i]));
      for (size_t i = 0; i < k_rot.size(); ++i)
        worst = std::max<double>(worst, std::fabs(k_rot[i] - want->k[i]));
      EXPECT_LE(worst, 5e-5) << "rotary_dim " << rotary_dim << ", " << nv << " variants";
      // Dims past rotary_dim are copied exactly.
      for (int64_t i = rotary_dim; i < 64; ++i) EXPECT_EQ(qv[i], q[i]);
    }
  }
}

// At Qwen's positions the angle is the reference's fp32 product, not the exact one.
TEST(DualChunkRotaryCpuTest, UsesTheFp32AngleAtLargePositions) {
  DcaGeometry g = Geometry(1, 1, 2, 2);
  g.chunk_size = 262144;
  g.chunk_len = 253952;
  g.rope_theta = 1e7;
  const std::vector<float> q = {1.f, 0.f}, k0 = {1.f, 0.f};
  std::vector<float> k = k0, qv(5 * 2);
  CpuRotaryParams p;
  p.q = q.data();
  p.k = k.data();
  p.q_variants = qv.data();
  p.start = 2 * g.chunk_len + 12345;  // r = 12345; inter_critical at r + chunk_size = 274489
  p.num_tokens = 1;
  DualChunkRotaryCpu(g, RotaryInvFreq(g.rope_theta, g.rotary_dim), p, nullptr);
  const float angle = static_cast<float>(274489) * 1.f;  // exact here: inv_freq[0] = 1
  EXPECT_EQ(qv[kInterCritical * 2], static_cast<float>(std::cos(static_cast<double>(angle))));
  EXPECT_EQ(qv[kInterCritical * 2 + 1], static_cast<float>(std::sin(static_cast<double>(angle))));
  EXPECT_EQ(k[0], static_cast<float>(std::cos(12345.0)));
}

}  // namespace
}  // namespace attnd
