// The CPU vertical-slash sparse prefill against the independent naive fp64 construction
// (kernels/testing/naive_sparse.h): outputs within 1e-5 over several DCA chunks, chunked prefill
// (begin != prev), GQA, fp32 and bf16 KV storage; the per-head plans equal the naive lists; with
// budgets that cover everything it equals the dense kernel; a row with no key gives zeros.
// Unused pool slots hold NaN, so reading a key or value the kernel should not see fails loudly.
#include "kernels/sparse_prefill_cpu.h"

#include <algorithm>
#include <cmath>
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
#include "kernels/dca_cpu.h"
#include "kernels/paged_kv.h"
#include "kernels/testing/naive_fp8.h"
#include "kernels/testing/naive_int8.h"
#include "kernels/testing/naive_sparse.h"
#include "kernels/vertical_slash.h"

namespace attnd {
namespace {

template <typename KvT>
KvT Poison() {
  if constexpr (std::is_same<KvT, float>::value) {
    return std::numeric_limits<float>::quiet_NaN();
  } else if constexpr (std::is_same<KvT, Fp8E4m3>::value) {
    return Fp8E4m3{0x7f};
  } else if constexpr (std::is_same<KvT, Int8Kv>::value) {
    return Int8Kv{-128};  // never written; its NaN scale makes it read back as NaN
  } else {
    return FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  }
}

// One layer's paged K/V with shuffled pages, NaN in every slot not written.
template <typename KvT>
struct Pool {
  std::vector<KvT> k, v;
  std::vector<float> k_scale, v_scale;  // fp8's and int8's scale per token and kv head
  std::vector<int32_t> table;
  PagedKv<KvT> view;
  Pool(const DcaGeometry& g, int64_t capacity, int32_t page_size, std::mt19937* rng) {
    const int64_t used = (capacity + page_size - 1) / page_size;
    const int64_t pages = used + 5;
    const int64_t n = pages * page_size * g.num_kv_heads * g.head_dim;
    k.assign(n, Poison<KvT>());
    v.assign(n, Poison<KvT>());
    k_scale.assign(pages * page_size * g.num_kv_heads, std::nanf(""));
    v_scale.assign(k_scale.size(), std::nanf(""));
    std::vector<int32_t> ids(pages);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), *rng);
    table.assign(ids.begin(), ids.begin() + used);
    view.k = k.data();
    view.v = v.data();
    view.page_table = table.data();
    view.page_size = page_size;
    view.num_kv_heads = g.num_kv_heads;
    view.head_dim = g.head_dim;
    if (std::is_same<KvT, Fp8E4m3>::value || std::is_same<KvT, Int8Kv>::value) {
      view.k_scale = k_scale.data();
      view.v_scale = v_scale.data();
    }
  }
};

// What the cache holds for rows of head_dim values: the values themselves, or (fp8, int8) what the
// independent quantiser reads back, row by row (kernels/testing/naive_fp8.h, naive_int8.h).
template <typename KvT>
std::vector<double> Cached(const std::vector<float>& x, int d) {
  constexpr bool fp8 = std::is_same<KvT, Fp8E4m3>::value, int8 = std::is_same<KvT, Int8Kv>::value;
  if (!fp8 && !int8) return std::vector<double>(x.begin(), x.end());
  std::vector<double> out;
  for (size_t row = 0; row < x.size(); row += d) {
    const absl::Span<const float> r = absl::MakeConstSpan(&x[row], d);
    for (double e : fp8 ? naive::Fp8RoundTrip(r) : naive::Int8RoundTrip(r)) out.push_back(e);
  }
  return out;
}

DcaGeometry TestGeometry() {
  DcaGeometry g;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 32;
  g.chunk_len = 96;  // chunk_size 128, local_size 32
  g.softmax_scale = static_cast<float>(1.0 / std::sqrt(32.0));
  return g;
}

// Values exactly representable in bf16, so fp32 and bf16 storage hold the same numbers.
std::vector<float> RandomBf16(std::mt19937* rng, int64_t n, float scale) {
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> x(n);
  for (float& e : x) e = Bf16ToFloat(FloatToBf16(normal(*rng)));
  return x;
}

struct MaxErr {
  double max_abs = 0;
  bool finite = true;
};
MaxErr Compare(const std::vector<float>& got, const std::vector<double>& want) {
  MaxErr e;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) e.finite = false;
    e.max_abs = std::max(e.max_abs, std::fabs(got[i] - want[i]));
  }
  return e;
}

// A prompt sent in calls of the given sizes; per call, the kernel vs the naive reference.
template <typename KvT>
void RunPrompt(const std::vector<int64_t>& calls, const std::vector<VsBudget>& budgets,
               int64_t last_q, int seed, ThreadPool* pool) {
  const DcaGeometry g = TestGeometry();
  const int64_t total = std::accumulate(calls.begin(), calls.end(), int64_t{0});
  std::mt19937 rng(seed);
  Pool<KvT> kv(g, total, 16, &rng);
  const int64_t q_row = 5ll * g.num_q_heads * g.head_dim;
  const int64_t kv_row = int64_t{g.num_kv_heads} * g.head_dim;
  const int64_t o_row = int64_t{g.num_q_heads} * g.head_dim;
  const std::vector<float> q = RandomBf16(&rng, total * q_row, 2.f);
  const std::vector<float> k = RandomBf16(&rng, total * kv_row, 1.f);
  const std::vector<float> v = RandomBf16(&rng, total * kv_row, 1.f);
  const std::vector<double> keys = Cached<KvT>(k, g.head_dim), values = Cached<KvT>(v, g.head_dim);
  std::vector<naive::SparseBudget> nb;
  for (const VsBudget& b : budgets) nb.push_back({b.vertical, b.slash});

  int64_t start = 0;
  for (int64_t t : calls) {
    SCOPED_TRACE(absl::StrCat("call [", start, ", ", start + t, ")"));
    CpuAppendParams ap;
    ap.k = k.data() + start * kv_row;
    ap.v = v.data() + start * kv_row;
    ap.start = start;
    ap.num_tokens = t;
    AppendKvCpu<KvT>(kv.view, ap, pool);
    std::vector<float> out(t * o_row, std::nanf(""));
    CpuPrefillParams p;
    p.q = q.data() + start * q_row;
    p.out = out.data();
    p.start = start;
    p.num_tokens = t;
    p.softmax_scale = g.softmax_scale;
    DcaSparsePrefillCpu<KvT>(g, kv.view, p, budgets, last_q, pool);
    const std::vector<double> want = naive::SparsePrefill(
        g, absl::MakeConstSpan(q.data() + start * q_row, t * q_row), start,
        absl::MakeConstSpan(keys.data(), (start + t) * kv_row),
        absl::MakeConstSpan(values.data(), (start + t) * kv_row), g.softmax_scale, nb, last_q);
    const MaxErr e = Compare(out, want);
    EXPECT_TRUE(e.finite);
    EXPECT_LE(e.max_abs, 1e-5);
    start += t;
  }
}

class SparsePrefillTest : public ::testing::Test {
 protected:
  ThreadPool pool_{3};
  // Budgets of every kind: forced-only (vertical < 30, slash < 100), data-driven, and larger
  // than the keys.
  std::vector<VsBudget> budgets_ = {{20, 50}, {130, 120}, {40, 160}, {1000, 1000}};
};

TEST_F(SparsePrefillTest, OneCallOverFourChunksFp32) {
  RunPrompt<float>({350}, budgets_, 64, 1, &pool_);
}

TEST_F(SparsePrefillTest, ChunkedPrefillFp32) {
  // Calls that start mid-chunk (begin != prev) and one shorter than last_q.
  RunPrompt<float>({70, 5, 130, 100, 45}, budgets_, 64, 2, &pool_);
}

TEST_F(SparsePrefillTest, SmallLastQAndBf16Storage) {
  RunPrompt<uint16_t>({120, 200}, budgets_, 16, 3, &pool_);
}

// fp8 and int8: append quantises, estimation and attention dequantise; the reference runs on its
// own quantisation of the same rows, so the fp32 bar holds.
TEST_F(SparsePrefillTest, Fp8AndInt8Storage) {
  RunPrompt<Fp8E4m3>({120, 200}, budgets_, 16, 3, &pool_);
  RunPrompt<Fp8E4m3>({70, 5, 130, 100, 45}, budgets_, 64, 2, &pool_);
  RunPrompt<Int8Kv>({120, 200}, budgets_, 16, 3, &pool_);
  RunPrompt<Int8Kv>({70, 5, 130, 100, 45}, budgets_, 64, 2, &pool_);
}

TEST_F(SparsePrefillTest, Sse2Path) {
  // The estimation and attention loops exist per SIMD width; force the baseline one.
  ASSERT_TRUE(SetCpuSimd(CpuSimd::kSse2));
  RunPrompt<float>({70, 5, 230}, budgets_, 64, 12, &pool_);
  RunPrompt<uint16_t>({300}, budgets_, 32, 13, &pool_);
  RunPrompt<Fp8E4m3>({300}, budgets_, 32, 13, &pool_);
  RunPrompt<Int8Kv>({300}, budgets_, 32, 13, &pool_);
  ASSERT_TRUE(SetCpuSimd(CpuSimd::kAuto));
}

TEST_F(SparsePrefillTest, OneThread) {
  ThreadPool one(1);
  RunPrompt<float>({300}, budgets_, 64, 4, &one);
}

TEST_F(SparsePrefillTest, PlansEqualTheNaiveLists) {
  const DcaGeometry g = TestGeometry();
  std::mt19937 rng(5);
  const int64_t total = 330;
  Pool<float> kv(g, total, 16, &rng);
  const int64_t q_row = 5ll * g.num_q_heads * g.head_dim;
  const int64_t kv_row = int64_t{g.num_kv_heads} * g.head_dim;
  const std::vector<float> q = RandomBf16(&rng, total * q_row, 2.f);
  const std::vector<float> k = RandomBf16(&rng, total * kv_row, 1.f);
  const std::vector<float> v = RandomBf16(&rng, total * kv_row, 1.f);
  const std::vector<double> keys(k.begin(), k.end());
  CpuAppendParams ap;
  ap.k = k.data();
  ap.v = v.data();
  ap.num_tokens = total;
  AppendKvCpu<float>(kv.view, ap, &pool_);
  CpuPrefillParams p;
  p.q = q.data();
  p.num_tokens = total;
  p.softmax_scale = g.softmax_scale;
  for (const VsPiece& piece : SplitIntoPieces(0, total, g.chunk_len)) {
    const std::vector<VsHeadPlan> plans =
        PlanVerticalSlashPiece<float>(g, kv.view, p, piece, budgets_, 64, &pool_);
    ASSERT_EQ(plans.size(), 4u);
    for (int32_t h = 0; h < g.num_q_heads; ++h) {
      SCOPED_TRACE(absl::StrCat("piece ", piece.prev, " head ", h));
      const naive::SparseScores sc = naive::EstimateScores(g, q, 0, keys, piece.prev, piece.begin,
                                                           piece.end, h, g.softmax_scale, 64);
      const std::vector<int64_t> vt = naive::TopK(sc.vertical, budgets_[h].vertical, false);
      const std::vector<int64_t> st = naive::TopK(sc.slash, budgets_[h].slash, true);
      EXPECT_EQ(plans[h].selection.vertical, vt);
      EXPECT_EQ(plans[h].selection.slash, st);
      for (int s = 0; s < kVsNumStages; ++s) {
        const naive::NaiveStage ns =
            naive::MapStage(s, vt, st, piece.prev, piece.begin, piece.end, g.chunk_len);
        ASSERT_EQ(plans[h].stages[s].present, ns.present);
        if (!ns.present) continue;
        EXPECT_EQ(plans[h].stages[s].columns, ns.columns);
        EXPECT_EQ(plans[h].stages[s].offsets, ns.offsets);
        EXPECT_EQ(static_cast<int64_t>(plans[h].row_blocks[s].size()),
                  (piece.end - piece.begin + 63) / 64);
      }
    }
  }
}

TEST_F(SparsePrefillTest, BudgetsCoveringEverythingEqualDense) {
  const DcaGeometry g = TestGeometry();
  std::mt19937 rng(6);
  const int64_t total = 400;
  Pool<float> kv(g, total, 16, &rng);
  const int64_t q_row = 5ll * g.num_q_heads * g.head_dim;
  const int64_t kv_row = int64_t{g.num_kv_heads} * g.head_dim;
  const int64_t o_row = int64_t{g.num_q_heads} * g.head_dim;
  const std::vector<float> q = RandomBf16(&rng, total * q_row, 2.f);
  const std::vector<float> k = RandomBf16(&rng, total * kv_row, 1.f);
  const std::vector<float> v = RandomBf16(&rng, total * kv_row, 1.f);
  CpuAppendParams ap;
  ap.k = k.data();
  ap.v = v.data();
  ap.num_tokens = total;
  AppendKvCpu<float>(kv.view, ap, &pool_);
  // Second call of a chunked prefill: rows [150, 400).
  std::vector<float> sparse(250 * o_row), dense(250 * o_row);
  CpuPrefillParams p;
  p.q = q.data() + 150 * q_row;
  p.start = 150;
  p.num_tokens = 250;
  p.softmax_scale = g.softmax_scale;
  p.out = sparse.data();
  const std::vector<VsBudget> all(4, VsBudget{100000, 100000});
  DcaSparsePrefillCpu<float>(g, kv.view, p, all, 64, &pool_);
  p.out = dense.data();
  DcaPrefillCpu<float>(g, kv.view, p, &pool_);
  double worst = 0;
  for (size_t i = 0; i < sparse.size(); ++i) {
    ASSERT_TRUE(std::isfinite(sparse[i])) << i;
    worst = std::max(worst, static_cast<double>(std::fabs(sparse[i] - dense[i])));
  }
  EXPECT_LE(worst, 1e-5);
}

TEST_F(SparsePrefillTest, RowsWithNoKeysGiveZerosNotNaN) {
  // A hand-made plan whose second row block has neither blocks nor columns in any stage.
  const DcaGeometry g = TestGeometry();
  std::mt19937 rng(8);
  Pool<float> kv(g, 100, 16, &rng);
  const std::vector<float> q = RandomBf16(&rng, 100 * 5 * g.num_q_heads * g.head_dim, 1.f);
  const std::vector<float> k = RandomBf16(&rng, 100 * g.num_kv_heads * g.head_dim, 1.f);
  CpuAppendParams ap;
  ap.k = k.data();
  ap.v = k.data();
  ap.num_tokens = 100;
  AppendKvCpu<float>(kv.view, ap, &pool_);
  const VsPiece piece{0, 0, 96};
  std::vector<VsHeadPlan> plans(g.num_q_heads);
  for (VsHeadPlan& plan : plans) {
    VsStageLists& intra = plan.stages[kVsIntraStage];
    intra.present = true;
    intra.causal = true;
    intra.kv_len = 96;
    intra.q_len = 96;
    plan.row_blocks[kVsIntraStage].resize(2);
    plan.row_blocks[kVsIntraStage][0].block_starts = {0};
  }
  std::vector<float> out(96 * g.num_q_heads * g.head_dim, std::nanf(""));
  CpuPrefillParams p;
  p.q = q.data();
  p.out = out.data();
  p.num_tokens = 96;
  p.softmax_scale = g.softmax_scale;
  AttendVerticalSlashPiece<float>(g, kv.view, p, piece, plans, &pool_);
  const int64_t o_row = int64_t{g.num_q_heads} * g.head_dim;
  for (int64_t r = 0; r < 96; ++r) {
    for (int64_t i = 0; i < o_row; ++i) {
      const float x = out[r * o_row + i];
      ASSERT_TRUE(std::isfinite(x)) << "row " << r;
      if (r >= 64) {
        EXPECT_EQ(x, 0.f) << "row " << r;
      }
    }
  }
}

}  // namespace
}  // namespace attnd
