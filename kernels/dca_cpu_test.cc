// The CPU DCA kernels against the independent fp64 reference (kernels/testing/naive_dca.h):
// every output element within the per-dtype tolerance, and no NaN/Inf. Unused pool slots are
// filled with NaN, so a kernel that reads a key or value it should not see fails loudly. For fp8
// and int8 KV the reference holds its cache as rows quantised by its own code
// (kernels/testing/naive_fp8.h, naive_int8.h), so the kernels must match it to the fp32 bar: what
// the formats themselves cost is measured elsewhere (server/engine/cpu_engine_kv_accuracy_test.cc),
// here only whether the kernels store and read them right.
#include "kernels/dca_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/fp8.h"
#include "base/int8_kv.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/paged_kv.h"
#include "kernels/testing/naive_dca.h"
#include "kernels/testing/naive_fp8.h"
#include "kernels/testing/naive_int8.h"

namespace attnd {
namespace {

struct Tolerance {
  double max_abs;
  double mean_abs;
};
constexpr Tolerance kFp32Tol = {1e-5, 1e-6};
constexpr Tolerance kBf16Tol = {2e-2, 2e-3};  // DCA.md's bar for bf16 storage.

template <typename KvT>
constexpr bool kIsFp8 = std::is_same<KvT, Fp8E4m3>::value;
template <typename KvT>
constexpr bool kIsInt8 = std::is_same<KvT, Int8Kv>::value;
// Stored with a scale per token and kv head.
template <typename KvT>
constexpr bool kScaled = kIsFp8<KvT> || kIsInt8<KvT>;

// fp8, int8: the reference quantises K/V exactly as the cache must (same fp32 inputs, same codes),
// so only fp32 arithmetic and the fp32 rounding of code * scale remain.
template <typename KvT>
Tolerance TolFor() {
  return std::is_same<KvT, uint16_t>::value ? kBf16Tol : kFp32Tol;
}

template <typename KvT>
KvT PoisonValue() {
  if constexpr (std::is_same<KvT, float>::value) {
    return std::numeric_limits<float>::quiet_NaN();
  } else if constexpr (kIsFp8<KvT>) {
    return Fp8E4m3{0x7f};
  } else if constexpr (kIsInt8<KvT>) {
    return Int8Kv{-128};  // never written; its NaN scale makes it read back as NaN
  } else {
    return FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  }
}

void ExpectClose(const std::vector<float>& actual, const std::vector<float>& expected,
                 Tolerance tol, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double max_err = 0, sum_err = 0;
  size_t worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_TRUE(std::isfinite(actual[i])) << what << ": element " << i << " = " << actual[i];
    const double err = std::fabs(static_cast<double>(actual[i]) - expected[i]);
    sum_err += err;
    if (err > max_err) {
      max_err = err;
      worst = i;
    }
  }
  EXPECT_LE(max_err, tol.max_abs) << what << ": worst element " << worst << " got " << actual[worst]
                                  << " want " << expected[worst];
  EXPECT_LE(sum_err / actual.size(), tol.mean_abs) << what << ": mean abs error";
}

DcaGeometry MakeGeometry(int hq, int hkv, int d, int64_t cl, int64_t orig) {
  DcaGeometry geo;
  geo.num_q_heads = hq;
  geo.num_kv_heads = hkv;
  geo.head_dim = d;
  geo.chunk_len = cl;
  geo.original_max_position_embeddings = orig;
  geo.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
  return geo;
}

std::vector<float> RandomVector(size_t n, std::mt19937* rng, float stddev = 1.f) {
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(*rng);
  return v;
}

// A KV pool of one layer shared by several sequences (pages handed out by the test).
template <typename KvT>
struct Pool {
  Pool(const DcaGeometry& geo, int32_t page_size, int64_t num_pages)
      : page_size(page_size), row(static_cast<int64_t>(geo.num_kv_heads) * geo.head_dim) {
    k.assign(num_pages * page_size * row, PoisonValue<KvT>());
    v.assign(num_pages * page_size * row, PoisonValue<KvT>());
    const float nan = std::numeric_limits<float>::quiet_NaN();
    k_scale.assign(num_pages * page_size * geo.num_kv_heads, nan);
    v_scale.assign(k_scale.size(), nan);
  }
  int32_t page_size;
  int64_t row;
  std::vector<KvT> k, v;
  std::vector<float> k_scale, v_scale;  // [num_pages, page_size, num_kv_heads]; fp8, int8 only
};

// One sequence run by both the kernels (paged) and the reference.
template <typename KvT>
class Sequence {
 public:
  Sequence(const DcaGeometry& geo, Pool<KvT>* pool, std::vector<int32_t> pages)
      : geo_(geo), pool_(pool), pages_(std::move(pages)), naive_(geo, 1) {
    if (kIsFp8<KvT>) naive_.set_kv_storage(naive::NaiveSequence::KvStorage::kFp8E4m3);
    if (kIsInt8<KvT>) naive_.set_kv_storage(naive::NaiveSequence::KvStorage::kInt8);
  }

  // Query magnitude and the tolerance that goes with it (large logits amplify fp32 rounding).
  void SetQueryScale(float stddev, Tolerance tol) {
    q_stddev_ = stddev;
    tol_ = tol;
  }
  // Makes every generated K/V value a bf16 value, so that (with s = 1) bf16 storage is exact and
  // the bf16 kernels can be held to the fp32 bar.
  void SetBf16Inputs(bool on) { bf16_inputs_ = on; }

  PagedKv<KvT> View() const {
    PagedKv<KvT> kv;
    kv.k = pool_->k.data();
    kv.v = pool_->v.data();
    kv.page_table = pages_.data();
    kv.page_size = pool_->page_size;
    kv.num_kv_heads = geo_.num_kv_heads;
    kv.head_dim = geo_.head_dim;
    if (kScaled<KvT>) {
      kv.k_scale = pool_->k_scale.data();
      kv.v_scale = pool_->v_scale.data();
    }
    return kv;
  }

  // Prefills t tokens (part of a prompt of prompt_len) and compares with the reference.
  void Prefill(int64_t t, int64_t prompt_len, std::mt19937* rng, ThreadPool* threads,
               const std::string& what) {
    const int64_t hq = geo_.num_q_heads, d = geo_.head_dim;
    const std::vector<float> q = RandomVector(t * kNumQueryVariants * hq * d, rng, q_stddev_);
    const std::vector<float> k = KvVector(t * pool_->row, rng);
    const std::vector<float> v = KvVector(t * pool_->row, rng);
    auto expected = naive_.Prefill(0, q, k, v, prompt_len);
    ASSERT_TRUE(expected.ok()) << expected.status();

    const float s = LengthScale(prompt_len, geo_.original_max_position_embeddings);
    CpuAppendParams append;
    append.k = k.data();
    append.v = v.data();
    append.start = length_;
    append.num_tokens = t;
    append.key_scale = s;
    AppendKvCpu(View(), append, threads);
    std::vector<float> out(t * hq * d, std::numeric_limits<float>::quiet_NaN());
    CpuPrefillParams params;
    params.q = q.data();
    params.out = out.data();
    params.start = length_;
    params.num_tokens = t;
    params.softmax_scale = geo_.softmax_scale * s;
    DcaPrefillCpu(geo_, View(), params, threads);
    length_ += t;
    ExpectClose(out, *expected, tol_,
                absl::StrCat(what, " prefill of ", t, " ending at ", length_));
  }

  // Prepares one decode step; the caller batches items and then calls Check().
  CpuDecodeItem<KvT> StartDecode(std::mt19937* rng, ThreadPool* threads) {
    const int64_t hq = geo_.num_q_heads, d = geo_.head_dim;
    q_ = RandomVector(kNumDecodeVariants * hq * d, rng, q_stddev_);
    const std::vector<float> k = KvVector(pool_->row, rng);
    const std::vector<float> v = KvVector(pool_->row, rng);
    auto expected = naive_.Decode(0, q_, k, v);
    EXPECT_TRUE(expected.ok()) << expected.status();
    expected_ = *std::move(expected);
    const int64_t length = length_ + 1;
    const float s = LengthScale(length, geo_.original_max_position_embeddings);
    CpuAppendParams append;
    append.k = k.data();
    append.v = v.data();
    append.start = length_;
    append.num_tokens = 1;
    append.key_scale = s;
    AppendKvCpu(View(), append, threads);
    out_.assign(hq * d, std::numeric_limits<float>::quiet_NaN());
    length_ = length;
    CpuDecodeItem<KvT> item;
    item.kv = View();
    item.q = q_.data();
    item.out = out_.data();
    item.length = length;
    item.q_scale = s;
    return item;
  }
  void CheckDecode(const std::string& what) {
    ExpectClose(out_, expected_, tol_, absl::StrCat(what, " decode at L=", length_));
  }

  int64_t length() const { return length_; }

 private:
  std::vector<float> KvVector(size_t n, std::mt19937* rng) const {
    std::vector<float> x = RandomVector(n, rng);
    if (bf16_inputs_) {
      for (float& e : x) e = Bf16ToFloat(FloatToBf16(e));
    }
    return x;
  }

  DcaGeometry geo_;
  Pool<KvT>* pool_;
  std::vector<int32_t> pages_;
  naive::NaiveSequence naive_;
  int64_t length_ = 0;
  float q_stddev_ = 1.f;
  bool bf16_inputs_ = false;
  Tolerance tol_ = TolFor<KvT>();
  std::vector<float> q_, out_, expected_;
};

struct Scenario {
  DcaGeometry geo;
  int32_t page_size = 16;
  bool shuffle_pages = false;
  int threads = 2;
  std::vector<int64_t> prefill_chunks;  // one prompt sent in these pieces
  int decode_steps = 0;
  float q_stddev = 1.f;
  Tolerance tol = {0, 0};  // {0, 0}: the KV type's default
  bool bf16_inputs = false;
};

template <typename KvT>
void Run(const Scenario& sc, const std::string& what) {
  const int64_t prompt =
      std::accumulate(sc.prefill_chunks.begin(), sc.prefill_chunks.end(), int64_t{0});
  const int64_t total = prompt + sc.decode_steps;
  const int64_t pages_needed = (total + sc.page_size - 1) / sc.page_size;
  // Twice the pages needed: the sequence's pages are scattered among unused (NaN) ones.
  const int64_t num_pages = 2 * pages_needed + 1;
  Pool<KvT> pool(sc.geo, sc.page_size, num_pages);
  std::vector<int32_t> ids(num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(1234);
  if (sc.shuffle_pages) std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(pages_needed);
  ThreadPool threads(sc.threads);
  Sequence<KvT> seq(sc.geo, &pool, ids);
  seq.SetQueryScale(sc.q_stddev, sc.tol.max_abs > 0 ? sc.tol : TolFor<KvT>());
  seq.SetBf16Inputs(sc.bf16_inputs);
  for (int64_t t : sc.prefill_chunks) {
    seq.Prefill(t, prompt, &rng, &threads, what);
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (int i = 0; i < sc.decode_steps; ++i) {
    CpuDecodeItem<KvT> item = seq.StartDecode(&rng, &threads);
    DcaDecodeCpu<KvT>(sc.geo, absl::MakeConstSpan(&item, 1), &threads);
    seq.CheckDecode(what);
  }
}

// Every test runs for both KV types and both SIMD paths (AVX2 ones skip on CPUs without it).
template <typename KvT, CpuSimd kSimd>
struct Config {
  using Kv = KvT;
  static constexpr CpuSimd simd = kSimd;
};

template <typename C>
class DcaCpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!SetCpuSimd(C::simd)) GTEST_SKIP() << "this CPU has no AVX2+FMA";
    // head_dim 64: both widths divide it, so the requested path is the one that runs.
    ASSERT_STREQ(CpuSimdName(64), C::simd == CpuSimd::kAvx2 ? "avx2" : "sse2");
  }
  void TearDown() override { SetCpuSimd(CpuSimd::kAuto); }
};

struct ConfigName {
  template <typename C>
  static std::string GetName(int) {
    using KvT = typename C::Kv;
    return absl::StrCat(std::is_same<KvT, float>::value ? "fp32"
                        : kIsFp8<KvT>                   ? "fp8"
                        : kIsInt8<KvT>                  ? "int8"
                                                        : "bf16",
                        C::simd == CpuSimd::kAvx2 ? "_avx2" : "_sse2");
  }
};

using Configs = ::testing::Types<Config<float, CpuSimd::kSse2>, Config<uint16_t, CpuSimd::kSse2>,
                                 Config<Fp8E4m3, CpuSimd::kSse2>, Config<Int8Kv, CpuSimd::kSse2>,
                                 Config<float, CpuSimd::kAvx2>, Config<uint16_t, CpuSimd::kAvx2>,
                                 Config<Fp8E4m3, CpuSimd::kAvx2>, Config<Int8Kv, CpuSimd::kAvx2>>;
TYPED_TEST_SUITE(DcaCpuTest, Configs, ConfigName);

TYPED_TEST(DcaCpuTest, OneToken) {
  Scenario sc;
  sc.geo = MakeGeometry(4, 2, 32, 128, 0);
  sc.prefill_chunks = {1};
  sc.decode_steps = 2;
  Run<typename TypeParam::Kv>(sc, "one token");
}

TYPED_TEST(DcaCpuTest, PageBoundaryLengths) {
  for (int64_t n : {15, 16, 17, 31, 32, 33}) {
    Scenario sc;
    sc.geo = MakeGeometry(4, 2, 32, 128, 0);
    sc.page_size = 16;
    sc.prefill_chunks = {n};
    sc.decode_steps = 2;
    Run<typename TypeParam::Kv>(sc, absl::StrCat("page boundary n=", n));
  }
}

TYPED_TEST(DcaCpuTest, ChunkBoundaryLengths) {
  // cl = 128; 520 tokens span 5 chunks, so inter keys cover several chunks.
  for (int64_t n : {127, 128, 129, 255, 256, 257, 520}) {
    Scenario sc;
    sc.geo = MakeGeometry(4, 2, 32, 128, 0);
    sc.prefill_chunks = {n};
    sc.decode_steps = 1;
    Run<typename TypeParam::Kv>(sc, absl::StrCat("chunk boundary n=", n));
  }
}

TYPED_TEST(DcaCpuTest, DecodeAcrossChunkBoundaries) {
  // Decode steps L = 126..131 and 254..259 cross cl = 128 and 2cl.
  for (int64_t n : {125, 253}) {
    Scenario sc;
    sc.geo = MakeGeometry(4, 2, 32, 128, 0);
    sc.prefill_chunks = {n};
    sc.decode_steps = 6;
    Run<typename TypeParam::Kv>(sc, absl::StrCat("decode across boundary from ", n));
  }
}

TYPED_TEST(DcaCpuTest, ChunkLengthNotAPageMultiple) {
  // cl = 50 with page_size 16: variant boundaries fall inside pages and tiles.
  Scenario sc;
  sc.geo = MakeGeometry(4, 2, 32, 50, 0);
  sc.page_size = 16;
  sc.prefill_chunks = {90, 1, 70};
  sc.decode_steps = 4;
  Run<typename TypeParam::Kv>(sc, "cl 50");
}

TYPED_TEST(DcaCpuTest, ChunkedPrefillThenDecode) {
  Scenario sc;
  sc.geo = MakeGeometry(4, 2, 32, 128, 64);  // scaling on: s(L) > 1
  sc.prefill_chunks = {50, 1, 77, 130, 3, 100};
  sc.decode_steps = 4;
  Run<typename TypeParam::Kv>(sc, "chunked prefill");
}

TYPED_TEST(DcaCpuTest, GqaGroupSizes) {
  for (int group : {1, 2, 7}) {
    Scenario sc;
    sc.geo = MakeGeometry(2 * group, 2, 64, 128, 0);
    sc.prefill_chunks = {200, 100};
    sc.decode_steps = 2;
    Run<typename TypeParam::Kv>(sc, absl::StrCat("group ", group));
  }
}

TYPED_TEST(DcaCpuTest, LengthScalingOnAndOff) {
  for (int64_t orig : {0, 64, 100000}) {
    Scenario sc;
    sc.geo = MakeGeometry(4, 2, 32, 128, orig);
    sc.prefill_chunks = {300};
    sc.decode_steps = 3;
    Run<typename TypeParam::Kv>(sc, absl::StrCat("orig ", orig));
  }
}

TYPED_TEST(DcaCpuTest, ShuffledPages) {
  for (int32_t page_size : {16, 5, 1}) {
    Scenario sc;
    sc.geo = MakeGeometry(6, 2, 32, 128, 64);
    sc.page_size = page_size;
    sc.shuffle_pages = true;
    sc.prefill_chunks = {140, 160};
    sc.decode_steps = 3;
    Run<typename TypeParam::Kv>(sc, absl::StrCat("shuffled pages of ", page_size));
  }
}

TYPED_TEST(DcaCpuTest, HeadDimNotAMultipleOfEight) {
  Scenario sc;
  sc.geo = MakeGeometry(4, 2, 20, 128, 0);
  sc.prefill_chunks = {150};
  sc.decode_steps = 2;
  Run<typename TypeParam::Kv>(sc, "head_dim 20");
}

TYPED_TEST(DcaCpuTest, ThreadCountsAndKeySplits) {
  // 1 thread: no key splitting. 8 threads: few work items, so long rows are split by key range
  // and merged by log-sum-exp (decode and the 2-token prefill chunk over > 1024 keys).
  for (int threads : {1, 3, 8}) {
    Scenario sc;
    sc.geo = MakeGeometry(4, 2, 32, 128, 64);
    sc.threads = threads;
    sc.prefill_chunks = {1200, 2};
    sc.decode_steps = 2;
    Run<typename TypeParam::Kv>(sc, absl::StrCat(threads, " threads"));
  }
}

TYPED_TEST(DcaCpuTest, LargeLogits) {
  // Logits with a standard deviation of ~20: most softmax weights underflow, which exercises the
  // exp's clamp and the running-max rescaling. fp32 logit rounding (~1e-6 relative of |logit|)
  // moves the weights by ~1e-5, so the bar is looser than the unit-scale one. bf16 rounding of
  // keys would move such logits by ~0.1, so K/V are drawn as bf16 values with s = 1 (no scaling):
  // storage is then exact and both KV types must meet the same fp32 bar.
  Scenario sc;
  sc.geo = MakeGeometry(4, 2, 32, 128, 0);
  sc.q_stddev = 20.f;
  sc.tol = {2e-4, 1e-5};
  sc.bf16_inputs = true;
  sc.prefill_chunks = {300, 40};
  sc.decode_steps = 3;
  Run<typename TypeParam::Kv>(sc, "large logits");
}

TYPED_TEST(DcaCpuTest, Bf16ExactInputsMeetTheFp32Bar) {
  // With bf16-representable K/V and no length scaling, the bf16 path loses nothing to storage:
  // any error beyond fp32 rounding is a kernel bug, not bf16.
  Scenario sc;
  sc.geo = MakeGeometry(14, 2, 64, 128, 0);
  sc.tol = kFp32Tol;
  sc.bf16_inputs = true;
  sc.shuffle_pages = true;
  sc.prefill_chunks = {200, 1, 150};
  sc.decode_steps = 3;
  Run<typename TypeParam::Kv>(sc, "bf16-exact inputs");
}

TYPED_TEST(DcaCpuTest, EmptyCallsDoNothing) {
  using KvT = typename TypeParam::Kv;
  const DcaGeometry geo = MakeGeometry(4, 2, 32, 128, 0);
  Pool<KvT> pool(geo, 16, 1);
  const std::vector<int32_t> pages = {0};
  Sequence<KvT> seq(geo, &pool, pages);
  ThreadPool threads(2);
  DcaDecodeCpu<KvT>(geo, {}, &threads);
  std::vector<float> out(4, 7.f);
  CpuPrefillParams params;
  params.out = out.data();
  params.num_tokens = 0;
  DcaPrefillCpu<KvT>(geo, seq.View(), params, &threads);
  CpuAppendParams append;
  append.num_tokens = 0;
  AppendKvCpu<KvT>(seq.View(), append, &threads);
  EXPECT_EQ(out, std::vector<float>(4, 7.f));
  for (size_t i = 0; i < pool.k.size(); ++i) {
    ASSERT_EQ(std::memcmp(&pool.k[i], &pool.v[i], sizeof(KvT)), 0);  // both still the poison
  }
}

TYPED_TEST(DcaCpuTest, DecodeBatchWithMixedLengths) {
  using KvT = typename TypeParam::Kv;
  const DcaGeometry geo = MakeGeometry(14, 2, 32, 128, 64);
  const int32_t page_size = 16;
  const std::vector<int64_t> prompts = {1, 17, 130, 300, 1100};
  const int steps = 3;
  int64_t total_pages = 0;
  for (int64_t p : prompts) total_pages += (p + steps + page_size - 1) / page_size;
  Pool<KvT> pool(geo, page_size, total_pages);
  // Deal the pages out shuffled, so the sequences' pages interleave in the pool.
  std::vector<int32_t> ids(total_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(99);
  std::shuffle(ids.begin(), ids.end(), rng);
  ThreadPool threads(4);
  std::vector<std::unique_ptr<Sequence<KvT>>> seqs;
  size_t next = 0;
  for (int64_t p : prompts) {
    const int64_t n = (p + steps + page_size - 1) / page_size;
    std::vector<int32_t> pages(ids.begin() + next, ids.begin() + next + n);
    next += n;
    seqs.push_back(std::make_unique<Sequence<KvT>>(geo, &pool, pages));
    seqs.back()->Prefill(p, p, &rng, &threads, absl::StrCat("batch prompt ", p));
  }
  for (int step = 0; step < steps; ++step) {
    std::vector<CpuDecodeItem<KvT>> items;
    for (auto& s : seqs) items.push_back(s->StartDecode(&rng, &threads));
    DcaDecodeCpu<KvT>(geo, items, &threads);
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i]->CheckDecode(absl::StrCat("batch item ", i, " step ", step));
    }
  }
}

// Append stores s * k and v in the slot the page table names, rounding to the KV type; checked
// with the layout arithmetic written out here rather than PagedKv's.
TYPED_TEST(DcaCpuTest, AppendWritesScaledKeysIntoTheirSlots) {
  using KvT = typename TypeParam::Kv;
  if (kScaled<KvT>)
    GTEST_SKIP() << "scaled rows: ScaledRowsTest.AppendStoresTheReferenceCodesAndScales";
  const DcaGeometry geo = MakeGeometry(4, 2, 8, 128, 0);
  const int32_t page_size = 4;
  Pool<KvT> pool(geo, page_size, 6);
  const std::vector<int32_t> pages = {4, 1, 5};
  PagedKv<KvT> kv;
  kv.k = pool.k.data();
  kv.v = pool.v.data();
  kv.page_table = pages.data();
  kv.page_size = page_size;
  kv.num_kv_heads = 2;
  kv.head_dim = 8;
  std::mt19937 rng(5);
  const int64_t start = 3, n = 7;
  const std::vector<float> k = RandomVector(n * 16, &rng);
  const std::vector<float> v = RandomVector(n * 16, &rng);
  CpuAppendParams params;
  params.k = k.data();
  params.v = v.data();
  params.start = start;
  params.num_tokens = n;
  params.key_scale = 1.25f;
  ThreadPool threads(2);
  AppendKvCpu(kv, params, &threads);
  int written = 0;
  for (size_t i = 0; i < pool.k.size(); ++i) {
    const int64_t slot = static_cast<int64_t>(i) / 16;  // page * 4 + offset
    const int64_t page = slot / page_size, offset = slot % page_size;
    const int64_t logical = std::find(pages.begin(), pages.end(), page) - pages.begin();
    const int64_t pos = logical * page_size + offset;
    const bool in_range = logical < 3 && pos >= start && pos < start + n;
    float got_k = 0, got_v = 0;
    if constexpr (std::is_same<KvT, float>::value) {
      got_k = pool.k[i];
      got_v = pool.v[i];
    } else if constexpr (std::is_same<KvT, uint16_t>::value) {
      got_k = Bf16ToFloat(pool.k[i]);
      got_v = Bf16ToFloat(pool.v[i]);
    }
    if (!in_range) {
      EXPECT_TRUE(std::isnan(got_k) && std::isnan(got_v)) << "slot " << slot << " was written";
      continue;
    }
    const size_t src = (pos - start) * 16 + i % 16;
    float want_k = k[src] * 1.25f, want_v = v[src];
    if constexpr (std::is_same<KvT, uint16_t>::value) {
      want_k = Bf16ToFloat(FloatToBf16(want_k));
      want_v = Bf16ToFloat(FloatToBf16(want_v));
    }
    EXPECT_EQ(got_k, want_k) << "pos " << pos;
    EXPECT_EQ(got_v, want_v) << "pos " << pos;
    ++written;
  }
  EXPECT_EQ(written, n * 16);
}

// The independent quantiser's row for a scaled KV type (codes as ints, its scale), what a code
// reads back as, and half a quantisation step at a value: E4M3 is relative (2^-4, or 2^-10 of the
// scale among the subnormals), int8 absolute (half the scale).
struct RefRow {
  std::vector<int> codes;
  float scale = 0.f;
};
int CodeOf(Fp8E4m3 c) { return c.bits; }
int CodeOf(Int8Kv c) { return c.code; }
template <typename KvT>
RefRow ReferenceRow(absl::Span<const float> x) {
  if constexpr (kIsFp8<KvT>) {
    const naive::Fp8Row r = naive::QuantizeFp8Row(x);
    return {std::vector<int>(r.codes.begin(), r.codes.end()), r.scale};
  } else {
    const naive::Int8Row r = naive::QuantizeInt8Row(x);
    return {std::vector<int>(r.codes.begin(), r.codes.end()), r.scale};
  }
}
template <typename KvT>
double ReadBack(KvT code, float scale) {
  if constexpr (kIsFp8<KvT>) {
    return naive::Fp8E4m3Value(code.bits) * scale;
  } else {
    return static_cast<double>(code.code) * scale;
  }
}
template <typename KvT>
double HalfStep(double value, float scale) {
  if constexpr (kIsFp8<KvT>) {
    return std::max(std::fabs(value) / 16, scale / 1024.0);
  } else {
    return scale / 2.0;
  }
}

template <typename KvT>
class ScaledRowsTest : public ::testing::Test {};
struct ScaledName {
  template <typename KvT>
  static std::string GetName(int) {
    return kIsFp8<KvT> ? "fp8" : "int8";
  }
};
using ScaledTypes = ::testing::Types<Fp8E4m3, Int8Kv>;
TYPED_TEST_SUITE(ScaledRowsTest, ScaledTypes, ScaledName);

// Append stores, per token and kv head, exactly the codes and the scale the independent quantiser
// gives for fp32(k) * fp32(s) (and v), in the slot and scale slot the page table names (layout
// arithmetic written out here); nothing else in the pool changes.
TYPED_TEST(ScaledRowsTest, AppendStoresTheReferenceCodesAndScales) {
  using KvT = TypeParam;
  const DcaGeometry geo = MakeGeometry(4, 2, 8, 128, 0);
  const int32_t page_size = 4, hkv = 2, d = 8;
  Pool<KvT> pool(geo, page_size, 6);
  const std::vector<int32_t> pages = {4, 1, 5};
  Sequence<KvT> seq(geo, &pool, pages);
  std::mt19937 rng(5);
  const int64_t start = 3, n = 7;
  std::vector<float> k = RandomVector(n * hkv * d, &rng);
  const std::vector<float> v = RandomVector(n * hkv * d, &rng);
  for (int i = 0; i < d; ++i) k[2 * d + i] = 0.f;  // token 1, head 0: an all-zero row
  k[5] = 1e-30f;                                   // a tiny value in a normal row
  CpuAppendParams params;
  params.k = k.data();
  params.v = v.data();
  params.start = start;
  params.num_tokens = n;
  params.key_scale = 1.25f;
  ThreadPool threads(2);
  AppendKvCpu(seq.View(), params, &threads);
  const int poison = CodeOf(PoisonValue<KvT>());
  int written = 0;
  for (int64_t slot = 0; slot < 6 * page_size; ++slot) {  // pool slot = page * 4 + offset
    const int64_t page = slot / page_size, offset = slot % page_size;
    const int64_t logical = std::find(pages.begin(), pages.end(), page) - pages.begin();
    const int64_t pos = logical * page_size + offset;
    const bool in_range = logical < 3 && pos >= start && pos < start + n;
    for (int h = 0; h < hkv; ++h) {
      const int64_t at = slot * hkv + h;
      if (!in_range) {
        EXPECT_TRUE(std::isnan(pool.k_scale[at]) && std::isnan(pool.v_scale[at])) << slot;
        for (int i = 0; i < d; ++i) {
          EXPECT_EQ(CodeOf(pool.k[at * d + i]), poison) << slot;
          EXPECT_EQ(CodeOf(pool.v[at * d + i]), poison) << slot;
        }
        continue;
      }
      const size_t src = ((pos - start) * hkv + h) * d;
      std::vector<float> key(d);
      for (int i = 0; i < d; ++i) key[i] = k[src + i] * 1.25f;
      const RefRow want_k = ReferenceRow<KvT>(key);
      const RefRow want_v = ReferenceRow<KvT>(absl::MakeConstSpan(&v[src], d));
      EXPECT_EQ(pool.k_scale[at], want_k.scale) << "pos " << pos << " head " << h;
      EXPECT_EQ(pool.v_scale[at], want_v.scale) << "pos " << pos << " head " << h;
      for (int i = 0; i < d; ++i) {
        EXPECT_EQ(CodeOf(pool.k[at * d + i]), want_k.codes[i]) << "pos " << pos << " i " << i;
        EXPECT_EQ(CodeOf(pool.v[at * d + i]), want_v.codes[i]) << "pos " << pos << " i " << i;
      }
      if (pos == start + 1 && h == 0) EXPECT_EQ(pool.k_scale[at], 0.f);  // the zero row
      ++written;
    }
  }
  EXPECT_EQ(written, n * hkv);
}

// Per-row scales keep rows of very different magnitudes (a huge key beside tiny ones, which one
// scale per page would flush to zero) each stored to the format's precision for that row.
TYPED_TEST(ScaledRowsTest, RowsOfDifferentMagnitudesKeepTheirPrecision) {
  using KvT = TypeParam;
  const DcaGeometry geo = MakeGeometry(2, 1, 16, 128, 0);
  Pool<KvT> pool(geo, 4, 2);
  Sequence<KvT> seq(geo, &pool, {1, 0});
  std::mt19937 rng(8);
  std::vector<float> k = RandomVector(8 * 16, &rng), v = RandomVector(8 * 16, &rng);
  for (int i = 0; i < 16; ++i) {
    k[3 * 16 + i] *= 1e4f;   // token 3: huge
    k[5 * 16 + i] *= 1e-4f;  // token 5: tiny
  }
  CpuAppendParams params;
  params.k = k.data();
  params.v = v.data();
  params.num_tokens = 8;
  ThreadPool threads(1);
  AppendKvCpu(seq.View(), params, &threads);
  for (int t = 0; t < 8; ++t) {
    const PagedKv<KvT> kv = seq.View();
    const float scale = *kv.KeyScale(t, 0);
    for (int i = 0; i < 16; ++i) {
      const double got = ReadBack(kv.Key(t, 0)[i], scale);
      const double want = k[t * 16 + i];
      EXPECT_LE(std::fabs(got - want), HalfStep<KvT>(want, scale) * 1.0001)
          << "token " << t << " i " << i;
    }
  }
}

}  // namespace
}  // namespace attnd
