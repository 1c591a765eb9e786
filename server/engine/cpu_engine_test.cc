// CpuEngine against the independent fp64 reference (kernels/testing/naive_dca.h): prefill in
// chunks that cross DCA chunk boundaries with length scaling on, then decodes in a batch of two
// sequences whose pages interleave in the pool.
#include "server/engine/cpu_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/testing/naive_dca.h"
#include "kernels/testing/naive_sparse.h"
#include "kernels/vertical_slash.h"
#include "kvcache/kv_layout.h"
#include "server/config/sparse_config.h"
#include "server/engine/engine_jobs_for_testing.h"

namespace attnd {
namespace {

// The tiny test model: 2 layers, 4 q heads, 2 kv heads, head_dim 64, chunk 160 - local 32 = 128,
// original_max_position_embeddings 256 (so prompts past 256 tokens are length-scaled).
constexpr int kLayers = 2;
constexpr int kHq = 4;
constexpr int kHkv = 2;
constexpr int kD = 64;
constexpr int kPageSize = 16;

DcaGeometry TinyGeometry() {
  DcaGeometry g;
  g.num_q_heads = kHq;
  g.num_kv_heads = kHkv;
  g.head_dim = kD;
  g.chunk_len = 128;
  g.original_max_position_embeddings = 256;
  g.softmax_scale = 1.f / std::sqrt(static_cast<float>(kD));
  return g;
}

KvLayout TinyLayout(DType kv_dtype, int64_t num_pages) {
  KvLayout layout;
  layout.num_layers = kLayers;
  layout.num_kv_heads = kHkv;
  layout.head_dim = kD;
  layout.page_size = kPageSize;
  layout.kv_dtype = kv_dtype;
  layout.num_pages = num_pages;
  return layout;
}

// How the reference holds its cache for an engine of `kv_dtype`: its own fp8 or int8 rows for the
// scaled dtypes, exact otherwise (bf16's rounding is in the tolerance).
naive::NaiveSequence::KvStorage ReferenceStorage(DType kv_dtype) {
  switch (kv_dtype) {
    case DType::kFp8E4m3:
      return naive::NaiveSequence::KvStorage::kFp8E4m3;
    case DType::kInt8:
      return naive::NaiveSequence::KvStorage::kInt8;
    default:
      return naive::NaiveSequence::KvStorage::kExact;
  }
}

std::unique_ptr<CpuEngine> MakeEngine(DType kv_dtype, int64_t num_pages) {
  CpuEngineOptions options;
  options.geometry = TinyGeometry();
  options.layout = TinyLayout(kv_dtype, num_pages);
  options.compute_threads = 2;
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

// A request tensor in `dtype`, plus the fp32 values it really holds (what the reference sees).
struct Tensor {
  std::string bytes;
  std::vector<float> values;
  std::vector<int64_t> shape;
  DType dtype;
  TensorView view() const {
    TensorView v;
    v.dtype = dtype;
    v.data = bytes.data();
    v.shape = shape;
    return v;
  }
};

Tensor RandomTensor(std::vector<int64_t> shape, DType dtype, std::mt19937* rng) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> raw(n);
  for (float& x : raw) x = dist(*rng);
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.resize(n * ElementSize(dtype));
  ConvertFromFloat(raw.data(), n, dtype, t.bytes.data());
  t.values.resize(n);
  ConvertToFloat(t.bytes.data(), dtype, n, t.values.data());
  return t;
}

std::vector<float> ToFloats(const std::string& bytes, DType dtype) {
  std::vector<float> out(bytes.size() / ElementSize(dtype));
  ConvertToFloat(bytes.data(), dtype, out.size(), out.data());
  return out;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " element " << i;
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  EXPECT_LE(worst, tol) << what;
}

struct Case {
  DType kv_dtype;
  DType io_dtype;
  double tol;  // max abs error vs the fp64 reference
};

class CpuEngineMatchesNaive : public testing::TestWithParam<Case> {};

TEST_P(CpuEngineMatchesNaive, PrefillChunksThenBatchedDecode) {
  const Case c = GetParam();
  constexpr int64_t kPages = 64;
  std::unique_ptr<CpuEngine> engine = MakeEngine(c.kv_dtype, kPages);
  ASSERT_NE(engine, nullptr);
  std::mt19937 rng(7);

  // Two sequences with interleaved, out-of-order pages: a's are odd ids descending, b's even.
  std::vector<int32_t> pages_a, pages_b;
  for (int32_t p = kPages - 1; p >= 0; --p) (p % 2 ? pages_a : pages_b).push_back(p);

  const DcaGeometry g = TinyGeometry();
  naive::NaiveSequence ref_a(g, kLayers), ref_b(g, kLayers);
  // The reference's own fp8 or int8 cache (naive_fp8.h, naive_int8.h).
  ref_a.set_kv_storage(ReferenceStorage(c.kv_dtype));
  ref_b.set_kv_storage(ReferenceStorage(c.kv_dtype));
  // Sequence a: a 300-token prompt (s(300) > 1) in three chunks crossing the chunk boundaries at
  // 128 and 256, in layer 1. Sequence b: a 40-token prompt in layer 1.
  const int64_t prompt_a = 300;
  int64_t start = 0;
  for (int64_t t : {100, 120, 80}) {
    Tensor q = RandomTensor({t, kNumQueryVariants, kHq, kD}, c.io_dtype, &rng);
    Tensor k = RandomTensor({t, kHkv, kD}, c.io_dtype, &rng);
    Tensor v = RandomTensor({t, kHkv, kD}, c.io_dtype, &rng);
    std::string out(t * kHq * kD * ElementSize(c.io_dtype), '\0');
    PrefillJob job = EngineJobsForTesting::Prefill();
    job.layer = 1;
    job.page_table = pages_a.data();
    job.num_pages = static_cast<int64_t>(pages_a.size());
    job.start = start;
    job.num_tokens = t;
    job.prompt_len = prompt_a;
    job.q = q.view();
    job.k = k.view();
    job.v = v.view();
    job.out = out.data();
    job.out_dtype = c.io_dtype;
    ASSERT_TRUE(engine->Prefill(job).ok());
    absl::StatusOr<std::vector<float>> want =
        ref_a.Prefill(1, q.values, k.values, v.values, prompt_a);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectClose(ToFloats(out, c.io_dtype), *want, c.tol, "prefill a @" + std::to_string(start));
    start += t;
  }
  {
    const int64_t t = 40;
    Tensor q = RandomTensor({t, kNumQueryVariants, kHq, kD}, c.io_dtype, &rng);
    Tensor k = RandomTensor({t, kHkv, kD}, c.io_dtype, &rng);
    Tensor v = RandomTensor({t, kHkv, kD}, c.io_dtype, &rng);
    std::string out(t * kHq * kD * ElementSize(c.io_dtype), '\0');
    PrefillJob job = EngineJobsForTesting::Prefill();
    job.layer = 1;
    job.page_table = pages_b.data();
    job.num_pages = static_cast<int64_t>(pages_b.size());
    job.num_tokens = t;
    job.prompt_len = t;
    job.q = q.view();
    job.k = k.view();
    job.v = v.view();
    job.out = out.data();
    job.out_dtype = c.io_dtype;
    ASSERT_TRUE(engine->Prefill(job).ok());
    absl::StatusOr<std::vector<float>> want = ref_b.Prefill(1, q.values, k.values, v.values, t);
    ASSERT_TRUE(want.ok());
    ExpectClose(ToFloats(out, c.io_dtype), *want, c.tol, "prefill b");
  }
  // Three decode steps, both sequences in each batch; a's q carries 5 variants, b's 3.
  for (int step = 0; step < 3; ++step) {
    Tensor qa = RandomTensor({kNumQueryVariants, kHq, kD}, c.io_dtype, &rng);
    Tensor qb = RandomTensor({kNumDecodeVariants, kHq, kD}, c.io_dtype, &rng);
    Tensor ka = RandomTensor({kHkv, kD}, c.io_dtype, &rng),
           va = RandomTensor({kHkv, kD}, c.io_dtype, &rng);
    Tensor kb = RandomTensor({kHkv, kD}, c.io_dtype, &rng),
           vb = RandomTensor({kHkv, kD}, c.io_dtype, &rng);
    std::string out_a(kHq * kD * ElementSize(c.io_dtype), '\0'), out_b = out_a;
    DecodeJob job = EngineJobsForTesting::Decode();
    job.layer = 1;
    job.entries.resize(2);
    job.entries[0] = {pages_a.data(), static_cast<int64_t>(pages_a.size()),
                      301 + step,     qa.view(),
                      ka.view(),      va.view(),
                      out_a.data(),   c.io_dtype};
    job.entries[1] = {pages_b.data(), static_cast<int64_t>(pages_b.size()),
                      41 + step,      qb.view(),
                      kb.view(),      vb.view(),
                      out_b.data(),   c.io_dtype};
    ASSERT_TRUE(engine->Decode(job).ok());
    absl::StatusOr<std::vector<float>> want_a = ref_a.Decode(1, qa.values, ka.values, va.values);
    absl::StatusOr<std::vector<float>> want_b = ref_b.Decode(1, qb.values, kb.values, vb.values);
    ASSERT_TRUE(want_a.ok() && want_b.ok());
    ExpectClose(ToFloats(out_a, c.io_dtype), *want_a, c.tol, "decode a " + std::to_string(step));
    ExpectClose(ToFloats(out_b, c.io_dtype), *want_b, c.tol, "decode b " + std::to_string(step));
  }
}

// fp32 KV is exact up to summation order; bf16 storage (and bf16/fp16 outputs) round. fp8 and int8
// KV against a reference that quantises the same fp32 keys and values with its own code: the codes
// agree, so they are held to the fp32 bar (and to the bf16 output's rounding).
INSTANTIATE_TEST_SUITE_P(Dtypes, CpuEngineMatchesNaive,
                         testing::Values(Case{DType::kFp32, DType::kFp32, 1e-4},
                                         Case{DType::kFp32, DType::kFp16, 2e-3},
                                         Case{DType::kBf16, DType::kBf16, 3e-2},
                                         Case{DType::kBf16, DType::kFp32, 3e-2},
                                         Case{DType::kFp8E4m3, DType::kFp32, 1e-4},
                                         Case{DType::kFp8E4m3, DType::kBf16, 3e-2},
                                         Case{DType::kInt8, DType::kFp32, 1e-4},
                                         Case{DType::kInt8, DType::kBf16, 3e-2}));

// Pre-rotary requests (docs/rotary.md): the engine applies the dual-chunk rotary; the reference
// applies its own fp64 one (naive::DualChunkRotary). Sequence a: a 300-token prompt in three
// chunks across both chunk boundaries, then decodes; sequence b sends the five variants, in the
// same decode batches as a (layouts mix per entry).
class CpuEnginePreRotary : public testing::TestWithParam<Case> {};

TEST_P(CpuEnginePreRotary, MatchesTheNaiveRotaryAndMixesLayoutsInOneDecode) {
  const Case c = GetParam();
  constexpr int64_t kPages = 64;
  for (int32_t rotary_dim : {kD, kD / 2}) {
    SCOPED_TRACE(rotary_dim);
    DcaGeometry g = TinyGeometry();
    g.chunk_size = 160;
    g.rope_theta = 10000.0;
    g.rotary_dim = rotary_dim;
    CpuEngineOptions options;
    options.geometry = g;
    options.layout = TinyLayout(c.kv_dtype, kPages);
    options.compute_threads = 2;
    absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::mt19937 rng(16);
    std::vector<int32_t> pages_a, pages_b;
    for (int32_t p = kPages - 1; p >= 0; --p) (p % 2 ? pages_a : pages_b).push_back(p);
    naive::NaiveSequence ref_a(g, kLayers), ref_b(g, kLayers);
    ref_a.set_kv_storage(ReferenceStorage(c.kv_dtype));
    ref_b.set_kv_storage(ReferenceStorage(c.kv_dtype));
    const int64_t prompt_a = 300;
    int64_t start = 0;
    for (int64_t t : {100, 120, 80}) {
      Tensor q = RandomTensor({t, kHq, kD}, c.io_dtype, &rng);
      Tensor k = RandomTensor({t, kHkv, kD}, c.io_dtype, &rng);
      Tensor v = RandomTensor({t, kHkv, kD}, c.io_dtype, &rng);
      std::string out(t * kHq * kD * ElementSize(c.io_dtype), '\0');
      PrefillJob job = EngineJobsForTesting::Prefill();
      job.layer = 0;
      job.page_table = pages_a.data();
      job.num_pages = static_cast<int64_t>(pages_a.size());
      job.start = start;
      job.num_tokens = t;
      job.prompt_len = prompt_a;
      job.q_layout = QLayout::kPreRotary;
      job.q = q.view();
      job.k = k.view();
      job.v = v.view();
      job.out = out.data();
      job.out_dtype = c.io_dtype;
      ASSERT_TRUE((*engine)->Prefill(job).ok());
      absl::StatusOr<std::vector<float>> want =
          ref_a.PrefillPreRotary(0, q.values, k.values, v.values, prompt_a);
      ASSERT_TRUE(want.ok()) << want.status();
      ExpectClose(ToFloats(out, c.io_dtype), *want, c.tol, "prefill a @" + std::to_string(start));
      start += t;
    }
    {
      const int64_t t = 40;
      Tensor q = RandomTensor({t, kNumQueryVariants, kHq, kD}, c.io_dtype, &rng);
      Tensor k = RandomTensor({t, kHkv, kD}, c.io_dtype, &rng);
      Tensor v = RandomTensor({t, kHkv, kD}, c.io_dtype, &rng);
      std::string out(t * kHq * kD * ElementSize(c.io_dtype), '\0');
      PrefillJob job = EngineJobsForTesting::Prefill();
      job.layer = 0;
      job.page_table = pages_b.data();
      job.num_pages = static_cast<int64_t>(pages_b.size());
      job.num_tokens = t;
      job.prompt_len = t;
      job.q = q.view();
      job.k = k.view();
      job.v = v.view();
      job.out = out.data();
      job.out_dtype = c.io_dtype;
      ASSERT_TRUE((*engine)->Prefill(job).ok());
      ASSERT_TRUE(ref_b.Prefill(0, q.values, k.values, v.values, t).ok());
    }
    for (int step = 0; step < 3; ++step) {
      Tensor qa = RandomTensor({kHq, kD}, c.io_dtype, &rng);
      Tensor qb = RandomTensor({kNumDecodeVariants, kHq, kD}, c.io_dtype, &rng);
      Tensor ka = RandomTensor({kHkv, kD}, c.io_dtype, &rng);
      Tensor va = RandomTensor({kHkv, kD}, c.io_dtype, &rng);
      Tensor kb = RandomTensor({kHkv, kD}, c.io_dtype, &rng);
      Tensor vb = RandomTensor({kHkv, kD}, c.io_dtype, &rng);
      std::string out_a(kHq * kD * ElementSize(c.io_dtype), '\0'), out_b = out_a;
      DecodeJob job = EngineJobsForTesting::Decode();
      job.layer = 0;
      job.entries.resize(2);
      job.entries[0] = {pages_a.data(),     static_cast<int64_t>(pages_a.size()),
                        301 + step,         qa.view(),
                        ka.view(),          va.view(),
                        out_a.data(),       c.io_dtype,
                        QLayout::kPreRotary};
      job.entries[1] = {pages_b.data(), static_cast<int64_t>(pages_b.size()),
                        41 + step,      qb.view(),
                        kb.view(),      vb.view(),
                        out_b.data(),   c.io_dtype};
      ASSERT_TRUE((*engine)->Decode(job).ok());
      absl::StatusOr<std::vector<float>> want_a =
          ref_a.DecodePreRotary(0, qa.values, ka.values, va.values);
      absl::StatusOr<std::vector<float>> want_b = ref_b.Decode(0, qb.values, kb.values, vb.values);
      ASSERT_TRUE(want_a.ok() && want_b.ok());
      ExpectClose(ToFloats(out_a, c.io_dtype), *want_a, c.tol, "decode a " + std::to_string(step));
      ExpectClose(ToFloats(out_b, c.io_dtype), *want_b, c.tol, "decode b " + std::to_string(step));
    }
  }
}

// fp8, int8: the engine rotates keys in fp32, the reference in fp64, so the keys it quantises
// differ by ~1e-6 and the odd code rounds the other way (one step of one element).
INSTANTIATE_TEST_SUITE_P(Dtypes, CpuEnginePreRotary,
                         testing::Values(Case{DType::kFp32, DType::kFp32, 1e-4},
                                         Case{DType::kBf16, DType::kBf16, 3e-2},
                                         Case{DType::kFp8E4m3, DType::kFp32, 1e-3},
                                         Case{DType::kInt8, DType::kFp32, 1e-3}));

// TinyGeometry has no rotary: a pre-rotary job is refused before anything is touched.
TEST(CpuEngineTest, RefusesPreRotaryWithoutARotary) {
  std::unique_ptr<CpuEngine> engine = MakeEngine(DType::kFp32, 4);
  ASSERT_NE(engine, nullptr);
  std::mt19937 rng(1);
  Tensor q = RandomTensor({1, kHq, kD}, DType::kFp32, &rng);
  Tensor k = RandomTensor({1, kHkv, kD}, DType::kFp32, &rng);
  std::vector<float> out(kHq * kD);
  std::vector<int32_t> pages = {0};
  PrefillJob job = EngineJobsForTesting::Prefill();
  job.page_table = pages.data();
  job.num_pages = 1;
  job.num_tokens = 1;
  job.prompt_len = 1;
  job.q_layout = QLayout::kPreRotary;
  job.q = q.view();
  job.k = k.view();
  job.v = k.view();
  job.out = out.data();
  const absl::Status s = engine->Prefill(job);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "engine: q layout 1 needs a model with a rotary");
}

TEST(CpuEngineTest, ReportsItsLayoutAndBackend) {
  std::unique_ptr<CpuEngine> engine = MakeEngine(DType::kBf16, 8);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->backend(), "cpu");
  EXPECT_FALSE(engine->device_name().empty());
  EXPECT_EQ(engine->layout().num_pages, 8);
  EXPECT_EQ(engine->layout().kv_dtype, DType::kBf16);
  EXPECT_EQ(engine->geometry().chunk_len, 128);
}

TEST(CpuEngineTest, RejectsUnsupportedKvDtypeAndMismatchedLayout) {
  CpuEngineOptions options;
  options.geometry = TinyGeometry();
  options.layout = TinyLayout(DType::kFp16, 4);
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message(),
            "cpu engine: KV dtype fp16 is not supported; use fp32, bf16, fp8 or int8");

  options.layout = TinyLayout(DType::kFp32, 4);
  options.layout.head_dim = 32;
  engine = CpuEngine::Create(options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message(),
            "cpu engine: KV layout [2 kv heads, head_dim 32] does not match the model [2, 64]");
}

TEST(CpuEngineTest, RejectsBadLayerAndPagesBeforeTouchingThePool) {
  std::unique_ptr<CpuEngine> engine = MakeEngine(DType::kFp32, 4);
  ASSERT_NE(engine, nullptr);
  std::mt19937 rng(1);
  Tensor q = RandomTensor({1, kNumQueryVariants, kHq, kD}, DType::kFp32, &rng);
  Tensor k = RandomTensor({1, kHkv, kD}, DType::kFp32, &rng);
  std::vector<float> out(kHq * kD);
  std::vector<int32_t> pages = {0};
  PrefillJob job = EngineJobsForTesting::Prefill();
  job.layer = 2;
  job.page_table = pages.data();
  job.num_pages = 1;
  job.num_tokens = 1;
  job.prompt_len = 1;
  job.q = q.view();
  job.k = k.view();
  job.v = k.view();
  job.out = out.data();
  absl::Status s = engine->Prefill(job);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "engine: layer 2 is not in [0, 2)");

  job.layer = 0;
  pages[0] = 4;  // one past the pool
  s = engine->Prefill(job);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "engine: page id 4 is not in the pool");

  pages[0] = 0;
  job.start = 16;  // position 16 needs a second page
  job.prompt_len = 17;
  s = engine->Prefill(job);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "engine: 1 pages do not cover 17 tokens");
}

TEST(CpuEngineTest, DefaultPoolIsAQuarterOfRamCappedAt4GiB) {
  const int64_t ram = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  EXPECT_EQ(DefaultCpuPoolBytes(), std::min<int64_t>(int64_t{4} << 30, ram / 4));
}

// ---- Vertical-slash sparse prefill (kernels/sparse_prefill_cpu.h) ----

std::shared_ptr<const SparseAttentionConfig> TinySparse(int64_t threshold) {
  auto sp = std::make_shared<SparseAttentionConfig>();
  sp->source = "test";
  sp->num_layers = kLayers;
  sp->num_q_heads = kHq;
  sp->enabled = true;
  sp->threshold = threshold;
  sp->last_q = 32;
  // Layer 1 mixes forced-only, data-driven and larger-than-the-prompt budgets.
  sp->budgets = {{130, 100}, {130, 100}, {130, 100}, {130, 100},
                 {20, 50},   {130, 120}, {40, 160},  {1000, 1000}};
  return sp;
}

TEST(CpuEngineSparseTest, PromptsOverTheThresholdTakeTheSparsePath) {
  CpuEngineOptions options;
  options.geometry = TinyGeometry();
  options.layout = TinyLayout(DType::kFp32, 64);
  options.compute_threads = 2;
  options.sparse = TinySparse(/*threshold=*/200);
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const DcaGeometry g = TinyGeometry();
  std::mt19937 rng(11);
  std::vector<int32_t> pages(64);
  std::iota(pages.rbegin(), pages.rend(), 0);

  // A 300-token prompt (> 200, and length-scaled: s(300) > 1) in three chunks across the chunk
  // boundaries at 128 and 256, against the naive sparse reference on the cached (scaled) keys.
  const int64_t prompt = 300;
  const float s = LengthScale(prompt, g.original_max_position_embeddings);
  ASSERT_GT(s, 1.f);
  std::vector<double> keys, values;
  std::vector<naive::SparseBudget> budgets;
  for (const VsBudget& b : options.sparse->layer(1)) budgets.push_back({b.vertical, b.slash});
  int64_t start = 0;
  for (int64_t t : {100, 120, 80}) {
    Tensor q = RandomTensor({t, kNumQueryVariants, kHq, kD}, DType::kFp32, &rng);
    Tensor k = RandomTensor({t, kHkv, kD}, DType::kFp32, &rng);
    Tensor v = RandomTensor({t, kHkv, kD}, DType::kFp32, &rng);
    for (float x : k.values) keys.push_back(x * s);  // cached as fp32(s * k)
    for (float x : v.values) values.push_back(x);
    std::string out(t * kHq * kD * sizeof(float), '\0');
    PrefillJob job = EngineJobsForTesting::Prefill();
    job.layer = 1;
    job.page_table = pages.data();
    job.num_pages = 64;
    job.start = start;
    job.num_tokens = t;
    job.prompt_len = prompt;
    job.q = q.view();
    job.k = k.view();
    job.v = v.view();
    job.out = out.data();
    ASSERT_TRUE((*engine)->Prefill(job).ok());
    const std::vector<double> want = naive::SparsePrefill(
        g, q.values, start, keys, values, static_cast<double>(g.softmax_scale * s), budgets, 32);
    ExpectClose(ToFloats(out, DType::kFp32), std::vector<float>(want.begin(), want.end()), 1e-4,
                "sparse prefill @" + std::to_string(start));
    start += t;
  }

  // At the threshold (not strictly above it) the same engine runs dense.
  naive::NaiveSequence ref(g, kLayers);
  std::vector<int32_t> other(pages.begin(), pages.begin() + 20);
  const int64_t t = 200;
  Tensor q = RandomTensor({t, kNumQueryVariants, kHq, kD}, DType::kFp32, &rng);
  Tensor k = RandomTensor({t, kHkv, kD}, DType::kFp32, &rng);
  Tensor v = RandomTensor({t, kHkv, kD}, DType::kFp32, &rng);
  std::string out(t * kHq * kD * sizeof(float), '\0');
  PrefillJob job = EngineJobsForTesting::Prefill();
  job.layer = 0;
  job.page_table = other.data();
  job.num_pages = 20;
  job.num_tokens = t;
  job.prompt_len = t;
  job.q = q.view();
  job.k = k.view();
  job.v = v.view();
  job.out = out.data();
  ASSERT_TRUE((*engine)->Prefill(job).ok());
  absl::StatusOr<std::vector<float>> want = ref.Prefill(0, q.values, k.values, v.values, t);
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectClose(ToFloats(out, DType::kFp32), *want, 1e-4, "dense at the threshold");
}

// Sparse calls of the sizes serving stacks send (8,192 and 16,384 tokens) over several DCA pieces:
// one big call gives what the same tokens give sent piece by piece (DCA.md: the pattern is
// estimated per piece of a call, so a call split at piece boundaries is the same computation, bit
// for bit on this deterministic fp32 path), and each piece checked matches the naive reference.
TEST(CpuEngineSparseTest, LargeCallsEqualTheirPiecesAndTheReference) {
  DcaGeometry g = TinyGeometry();
  g.chunk_len = 2048;  // a few pieces per call, each small enough for the naive reference
  auto sp = std::make_shared<SparseAttentionConfig>(*TinySparse(/*threshold=*/200));
  // Small slash budgets keep the attention (and the reference) cheap at 24K tokens.
  sp->budgets = {{130, 20}, {40, 30}, {130, 10}, {200, 25},
                 {130, 20}, {40, 30}, {130, 10}, {200, 25}};
  const auto make = [&]() {
    CpuEngineOptions options;
    options.geometry = g;
    options.layout = TinyLayout(DType::kFp32, 1536);  // 24,576 tokens
    options.compute_threads = 2;
    options.sparse = sp;
    absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? *std::move(engine) : nullptr;
  };
  std::unique_ptr<CpuEngine> whole = make(), pieces = make();
  ASSERT_NE(whole, nullptr);
  ASSERT_NE(pieces, nullptr);
  std::vector<int32_t> pages(1536);
  std::iota(pages.rbegin(), pages.rend(), 0);
  const int64_t prompt = 8192 + 16384;
  const float s = LengthScale(prompt, g.original_max_position_embeddings);
  std::vector<naive::SparseBudget> budgets;
  for (const VsBudget& b : sp->layer(0)) budgets.push_back({b.vertical, b.slash});
  std::vector<double> keys, values;
  std::mt19937 rng(23);
  const int64_t q_row = kNumQueryVariants * kHq * kD, kv_row = kHkv * kD, out_row = kHq * kD;
  const auto prefill = [&](CpuEngine& engine, const Tensor& q, const Tensor& k, const Tensor& v,
                           int64_t first, int64_t start, int64_t t, float* out) {
    PrefillJob job = EngineJobsForTesting::Prefill();
    job.layer = 0;
    job.page_table = pages.data();
    job.num_pages = static_cast<int64_t>(pages.size());
    job.start = start;
    job.num_tokens = t;
    job.prompt_len = prompt;
    job.q = {DType::kFp32, q.values.data() + first * q_row, {t, kNumQueryVariants, kHq, kD}};
    job.k = {DType::kFp32, k.values.data() + first * kv_row, {t, kHkv, kD}};
    job.v = {DType::kFp32, v.values.data() + first * kv_row, {t, kHkv, kD}};
    job.out = out;
    job.out_dtype = DType::kFp32;
    return engine.Prefill(job);
  };
  int64_t start = 0;
  for (const int64_t t : {8192, 16384}) {
    const Tensor q = RandomTensor({t, kNumQueryVariants, kHq, kD}, DType::kFp32, &rng);
    const Tensor k = RandomTensor({t, kHkv, kD}, DType::kFp32, &rng);
    const Tensor v = RandomTensor({t, kHkv, kD}, DType::kFp32, &rng);
    for (float x : k.values) keys.push_back(x * s);  // cached as fp32(s * k)
    for (float x : v.values) values.push_back(x);
    std::vector<float> big(t * out_row), split(t * out_row);
    ASSERT_TRUE(prefill(*whole, q, k, v, 0, start, t, big.data()).ok());
    const std::vector<VsPiece> split_at = SplitIntoPieces(start, t, g.chunk_len);
    ASSERT_GE(split_at.size(), 4u);
    for (const VsPiece& piece : split_at) {
      const int64_t first = piece.begin - start, n = piece.end - piece.begin;
      ASSERT_TRUE(
          prefill(*pieces, q, k, v, first, piece.begin, n, split.data() + first * out_row).ok());
    }
    EXPECT_EQ(std::memcmp(big.data(), split.data(), big.size() * sizeof(float)), 0)
        << "a " << t << "-token call differs from its pieces sent one by one";
    // The reference, for the call's first and last pieces (its own queries, keys [0, end)).
    for (const VsPiece& piece : {split_at.front(), split_at.back()}) {
      const int64_t first = piece.begin - start, n = piece.end - piece.begin;
      const std::vector<float> piece_q(q.values.begin() + first * q_row,
                                       q.values.begin() + (first + n) * q_row);
      const std::vector<double> want = naive::SparsePrefill(
          g, piece_q, piece.begin, absl::MakeConstSpan(keys).first(piece.end * kv_row),
          absl::MakeConstSpan(values).first(piece.end * kv_row),
          static_cast<double>(g.softmax_scale * s), budgets, sp->last_q);
      ExpectClose(
          std::vector<float>(big.begin() + first * out_row, big.begin() + (first + n) * out_row),
          std::vector<float>(want.begin(), want.end()), 1e-4,
          absl::StrCat(t, "-token call, piece [", piece.begin, ", ", piece.end, ")"));
    }
    start += t;
  }
}

TEST(CpuEngineSparseTest, ConfigMustMatchTheModel) {
  CpuEngineOptions options;
  options.geometry = TinyGeometry();
  options.layout = TinyLayout(DType::kFp32, 8);
  auto sp = std::make_shared<SparseAttentionConfig>(*TinySparse(10));
  sp->num_q_heads = 2;
  sp->budgets.resize(4);
  options.sparse = sp;
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(options);
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message(),
            "cpu engine: the sparse attention config (2 layers x 2 heads, last_q 32) does not "
            "match the model (2 layers x 4 q heads)");
}

}  // namespace
}  // namespace attnd
