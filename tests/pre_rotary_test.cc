// Pre-rotary requests over gRPC (CPU backend, fp32): a sequence sent pre-rotary gives the same
// outputs as a twin sequence sent the five variants and rotated keys that the naive fp64 rotary
// (kernels/testing/naive_dca.h) computes from the same inputs, dense (prefill in two chunks across
// chunk boundaries, then decodes mixing both layouts in one batch) and sparse (tiny-sparse: a
// prompt past the sparse threshold, whose estimation reads the critical variants).
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/testing/naive_dca.h"
#include "server/rpc/server.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

using client::DecodeInput;
using client::HostTensor;

// What the caller would send with Q_LAYOUT_VARIANTS for pre-rotary q/k of tokens at start.. .
naive::RotatedInputs Variants(const DcaGeometry& g, int64_t start, const std::vector<float>& q,
                              const std::vector<float>& k, int num_variants) {
  absl::StatusOr<naive::RotatedInputs> r = naive::DualChunkRotary(g, start, q, k, num_variants);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : naive::RotatedInputs{};
}

void ExpectSame(const HostTensor& got, const HostTensor& want, double tol,
                const std::string& what) {
  const testing::ErrorStats e = testing::CompareOutputs(got.ToFloats(), want.ToFloats());
  EXPECT_TRUE(e.finite) << what;
  EXPECT_LE(e.max_abs, tol) << what;
}

// One pre-rotary prefill chunk on `pre` and its variants twin on `twin`; outputs compared.
void PrefillBoth(client::AttndClient& c, const DcaGeometry& g, const std::string& pre,
                 const std::string& twin, int64_t start, int64_t t, int64_t prompt_len,
                 std::mt19937* rng, double tol) {
  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  const std::vector<float> q = testing::RandomInputs(rng, t * hq * d);
  const std::vector<float> k = testing::RandomInputs(rng, t * hkv * d);
  const std::vector<float> v = testing::RandomInputs(rng, t * hkv * d);
  const naive::RotatedInputs r = Variants(g, start, q, k, kNumQueryVariants);
  const HostTensor vt = HostTensor::FromFloats(DType::kFp32, {t, hkv, d}, v);
  absl::StatusOr<client::PrefillResult> a =
      c.Prefill(pre, 0, HostTensor::FromFloats(DType::kFp32, {t, hq, d}, q),
                HostTensor::FromFloats(DType::kFp32, {t, hkv, d}, k), vt, prompt_len,
                v1::Q_LAYOUT_PRE_ROTARY);
  absl::StatusOr<client::PrefillResult> b = c.Prefill(
      twin, 0, HostTensor::FromFloats(DType::kFp32, {t, kNumQueryVariants, hq, d}, r.q_variants),
      HostTensor::FromFloats(DType::kFp32, {t, hkv, d}, r.k), vt, prompt_len);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->length, start + t);
  EXPECT_EQ(a->o.shape, (std::vector<int64_t>{t, hq, d}));
  ExpectSame(a->o, b->o, tol, absl::StrCat("prefill of ", t, " tokens at ", start));
}

TEST(PreRotaryTest, DenseMatchesTheVariantsComputedFromIt) {
  testing::ModelGeometry geometry;  // the tiny model: chunk 160 - local 32, scaling past 256
  ServerOptions options;
  options.device = "cpu";
  options.kv_dtype = "fp32";
  options.kv_cache_bytes = 32ll << 20;
  options.compute_threads = 2;
  absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
      testing::TestDaemon::Start(geometry, options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::AttndClient& c = (*daemon)->client();
  DcaGeometry g = geometry.dca();
  g.chunk_size = geometry.chunk_size;
  g.rope_theta = geometry.rope_theta;
  g.rotary_dim = geometry.head_dim;
  const std::string pre = *c.CreateSequence(), twin = *c.CreateSequence();
  std::mt19937 rng(16);
  PrefillBoth(c, g, pre, twin, 0, 200, 330, &rng, 1e-4);
  PrefillBoth(c, g, pre, twin, 200, 130, 330, &rng, 1e-4);

  const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  for (int64_t step = 0; step < 3; ++step) {
    const int64_t pos = 330 + step;
    const std::vector<float> q = testing::RandomInputs(&rng, hq * d);
    const std::vector<float> k = testing::RandomInputs(&rng, hkv * d);
    const std::vector<float> v = testing::RandomInputs(&rng, hkv * d);
    const naive::RotatedInputs r = Variants(g, pos, q, k, kNumDecodeVariants);
    std::vector<DecodeInput> entries(2);
    entries[0].sequence_id = pre;
    entries[0].q = HostTensor::FromFloats(DType::kFp32, {hq, d}, q);
    entries[0].k = HostTensor::FromFloats(DType::kFp32, {hkv, d}, k);
    entries[0].q_layout = v1::Q_LAYOUT_PRE_ROTARY;
    entries[1].sequence_id = twin;
    entries[1].q = HostTensor::FromFloats(DType::kFp32, {kNumDecodeVariants, hq, d}, r.q_variants);
    entries[1].k = HostTensor::FromFloats(DType::kFp32, {hkv, d}, r.k);
    entries[0].v = entries[1].v = HostTensor::FromFloats(DType::kFp32, {hkv, d}, v);
    absl::StatusOr<std::vector<client::DecodeResult>> out = c.Decode(0, entries);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), 2u);
    EXPECT_EQ((*out)[0].length, pos + 1);
    ExpectSame((*out)[0].o, (*out)[1].o, 1e-4, absl::StrCat("decode at ", pos));
  }
}

TEST(PreRotaryTest, SparsePrefillMatchesTheVariantsComputedFromIt) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.model_config = "configs/tiny-sparse";  // chunk 512 - local 64, sparse past 256 tokens
  options.device = "cpu";
  options.kv_dtype = "fp32";
  options.kv_cache_bytes = 64ll << 20;
  options.compute_threads = 2;
  absl::StatusOr<std::unique_ptr<AttndServer>> server = AttndServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  client::ClientOptions client_options;
  client_options.max_message_bytes = 1ll << 30;
  absl::StatusOr<std::unique_ptr<client::AttndClient>> c =
      client::AttndClient::Connect(absl::StrCat("127.0.0.1:", (*server)->port()), client_options);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<v1::GetServerInfoResponse> info = (*c)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(info->dca().sparse_attention_enabled());
  DcaGeometry g;
  g.num_q_heads = info->model().num_q_heads();
  g.num_kv_heads = info->model().num_kv_heads();
  g.head_dim = info->model().head_dim();
  g.chunk_len = info->dca().chunk_len();
  g.chunk_size = info->dca().chunk_size();
  g.rope_theta = info->model().rope_theta();
  g.rotary_dim = info->model().rotary_dim();
  g.original_max_position_embeddings = info->dca().original_max_position_embeddings();
  const std::string pre = *(*c)->CreateSequence(), twin = *(*c)->CreateSequence();
  std::mt19937 rng(61);
  // 1000 tokens (> the 256 threshold) in two calls, the second crossing two chunk boundaries
  // (448, 896): the succ and inter stages, and their critical variants, are all estimated.
  PrefillBoth(**c, g, pre, twin, 0, 300, 1000, &rng, 1e-4);
  PrefillBoth(**c, g, pre, twin, 300, 700, 1000, &rng, 1e-4);
  c->reset();
  (*server)->Shutdown(absl::Now() + absl::Seconds(5));
  (*server)->Wait();
}

}  // namespace
}  // namespace attnd
