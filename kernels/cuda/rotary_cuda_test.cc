// The CUDA dual-chunk rotary against the CPU one (kernels/dual_chunk_rotary.h, itself checked
// against the fp64 reference): same positions and angles, so the variants agree to the bf16
// rounding of the output and the keys to their own dtype's.
#include "kernels/cuda/rotary_cuda.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cuda/testing/gpu_test.h"
#include "kernels/dca.h"
#include "kernels/dual_chunk_rotary.h"

namespace attnd {
namespace {

using gpu_test::DevBuf;

struct Case {
  int32_t hq, hkv, d, rotary_dim;
  int64_t chunk_size, chunk_len, start, tokens;
  double theta;
  DType dtype;
};

class RotaryCudaTest : public testing::TestWithParam<Case> {};

TEST_P(RotaryCudaTest, MatchesTheCpuRotary) {
  REQUIRE_GPU();
  const Case c = GetParam();
  DcaGeometry g;
  g.num_q_heads = c.hq;
  g.num_kv_heads = c.hkv;
  g.head_dim = c.d;
  g.chunk_len = c.chunk_len;
  g.chunk_size = c.chunk_size;
  g.rope_theta = c.theta;
  g.rotary_dim = c.rotary_dim;
  std::mt19937 rng(16);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const int64_t q_n = c.tokens * c.hq * c.d, k_n = c.tokens * c.hkv * c.d;
  std::vector<float> q(q_n), k(k_n);
  for (float& x : q) x = dist(rng);
  for (float& x : k) x = dist(rng);
  // What the device sees (rounded to the dtype), as the CPU reference's input.
  std::string q_bytes(q_n * ElementSize(c.dtype), '\0'), k_bytes(k_n * ElementSize(c.dtype), '\0');
  ConvertFromFloat(q.data(), q_n, c.dtype, q_bytes.data());
  ConvertFromFloat(k.data(), k_n, c.dtype, k_bytes.data());
  ConvertToFloat(q_bytes.data(), c.dtype, q_n, q.data());
  ConvertToFloat(k_bytes.data(), c.dtype, k_n, k.data());

  const std::vector<float> inv_freq = RotaryInvFreq(g.rope_theta, g.rotary_dim);
  std::vector<float> want_q(c.tokens * kNumQueryVariants * c.hq * c.d), want_k = k;
  CpuRotaryParams cp;
  cp.q = q.data();
  cp.k = want_k.data();
  cp.q_variants = want_q.data();
  cp.start = c.start;
  cp.num_tokens = c.tokens;
  DualChunkRotaryCpu(g, inv_freq, cp, nullptr);

  DevBuf d_q(q_bytes.size()), d_k(k_bytes.size()), d_out(want_q.size() * 2),
      d_freq(inv_freq.size() * 4);
  d_q.Upload(q_bytes.data());
  d_k.Upload(k_bytes.data());
  d_freq.Upload(inv_freq.data());
  d_out.Poison();
  CudaRotaryParams p;
  p.q = d_q.get();
  p.k = d_k.get();
  p.dtype = c.dtype;
  p.q_variants = d_out.get<Bf16>();
  p.inv_freq = d_freq.get<float>();
  p.start = c.start;
  p.num_tokens = c.tokens;
  ASSERT_TRUE(LaunchDualChunkRotary(g, p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::string got_q(d_out.bytes(), '\0'), got_k(k_bytes.size(), '\0');
  cudaMemcpy(got_q.data(), d_out.get(), got_q.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(got_k.data(), d_k.get(), got_k.size(), cudaMemcpyDeviceToHost);
  std::vector<float> gq(want_q.size()), gk(k_n);
  ConvertToFloat(got_q.data(), DType::kBf16, gq.size(), gq.data());
  ConvertToFloat(got_k.data(), c.dtype, gk.size(), gk.data());
  // |x| <= ~1.5 after rotation: one bf16 rounding is <= 2^-8 * 1.5 (and fp32 FMA differences).
  const double q_tol = 6e-3;
  const double k_tol = c.dtype == DType::kFp32 ? 1e-5 : 6e-3;
  for (size_t i = 0; i < gq.size(); ++i) {
    ASSERT_TRUE(std::isfinite(gq[i])) << i;
    ASSERT_NEAR(gq[i], want_q[i], q_tol) << "q element " << i;
  }
  for (size_t i = 0; i < gk.size(); ++i) ASSERT_NEAR(gk[i], want_k[i], k_tol) << "k element " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RotaryCudaTest,
    testing::Values(
        // The tiny model across chunk boundaries, each request dtype.
        Case{4, 2, 64, 64, 160, 128, 100, 300, 1e4, DType::kFp32},
        Case{4, 2, 64, 64, 160, 128, 100, 300, 1e4, DType::kBf16},
        Case{4, 2, 64, 64, 160, 128, 0, 7, 1e4, DType::kFp16},
        // Partial rotary; Qwen2.5-7B-1M geometry at positions past a chunk (fp32 angles ~5e5).
        Case{4, 1, 128, 64, 512, 448, 300, 64, 1e4, DType::kBf16},
        Case{28, 4, 128, 128, 262144, 253952, 253952 + 12000, 33, 1e7, DType::kBf16}));

}  // namespace
}  // namespace attnd
