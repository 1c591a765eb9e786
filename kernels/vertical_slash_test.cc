// The planning side of vertical-slash sparse prefill against the independent naive construction
// (kernels/testing/naive_sparse.h): top-k tie rules, pieces, the stage mapping with its
// fallbacks, the 64x64 converter (hand-worked quirk cases with exact lists, then random cases
// whose visible (row, key) masks must equal the naive mask exactly), and the estimation's
// selected index sets (exact, on data whose scores are well separated at the top-k boundary).
#include "kernels/vertical_slash.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/dca_cpu.h"
#include "kernels/paged_kv.h"
#include "kernels/testing/naive_sparse.h"

namespace attnd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// ---- top-k and pieces ----

TEST(TopKIndicesTest, TieRules) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> s = {1, 3, 3, 2, inf, inf};
  EXPECT_EQ(TopKIndices(s, 3, false), (std::vector<int64_t>{1, 4, 5}));
  EXPECT_EQ(TopKIndices(s, 3, true), (std::vector<int64_t>{2, 4, 5}));
  EXPECT_EQ(TopKIndices(s, 1, false), (std::vector<int64_t>{4}));
  EXPECT_EQ(TopKIndices(s, 1, true), (std::vector<int64_t>{5}));
  EXPECT_EQ(TopKIndices(s, 10, false), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_THAT(TopKIndices(s, 0, false), IsEmpty());
  EXPECT_EQ(TopKIndices(s, 4, false), naive::TopK(s, 4, false));
  EXPECT_EQ(TopKIndices(s, 4, true), naive::TopK(s, 4, true));
}

TEST(SplitIntoPiecesTest, SplitsAtChunkBoundaries) {
  const std::vector<VsPiece> p = SplitIntoPieces(100, 500, 128);
  ASSERT_EQ(p.size(), 5u);
  const int64_t expect[5][3] = {
      {0, 100, 128}, {128, 128, 256}, {256, 256, 384}, {384, 384, 512}, {512, 512, 600}};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(p[i].prev, expect[i][0]);
    EXPECT_EQ(p[i].begin, expect[i][1]);
    EXPECT_EQ(p[i].end, expect[i][2]);
  }
  EXPECT_THAT(SplitIntoPieces(5, 0, 128), IsEmpty());
}

// ---- the converter: hand-worked cases ----

TEST(ConvertVerticalSlashTest, CausalDiagonalAndColumn) {
  const std::vector<VsRowBlock> rb = ConvertVerticalSlash(128, 128, true, {5}, {0});
  ASSERT_EQ(rb.size(), 2u);
  EXPECT_THAT(rb[0].block_starts, ElementsAre(0));
  EXPECT_THAT(rb[0].columns, IsEmpty());  // inside the diagonal band
  EXPECT_THAT(rb[1].block_starts, ElementsAre(64));
  EXPECT_THAT(rb[1].columns, ElementsAre(5));
}

TEST(ConvertVerticalSlashTest, BandsMergeAndTrailingColumn) {
  // Non-causal, kv 300: rows sit at 300 + r. d=250 -> band [50,114); d=200 ends at 164, within
  // 64 of 114 -> range [50,178); d=190 ends inside. Column 10 is left of the range, 100 and 150
  // inside, 299 right of it and the last column: kept.
  const std::vector<VsRowBlock> rb =
      ConvertVerticalSlash(64, 300, false, {10, 100, 150, 299}, {250, 200, 190});
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_THAT(rb[0].block_starts, ElementsAre(50, 114));
  EXPECT_THAT(rb[0].columns, ElementsAre(10, 299));
}

TEST(ConvertVerticalSlashTest, SlashesLeftOfKeyZeroAreSkippedAndBandEndsClampTo64) {
  // Causal, off 0: d=100 and d=64 end at or left of key 0; d=30 ends at 34, clamped to [0, 64).
  const std::vector<VsRowBlock> rb = ConvertVerticalSlash(64, 64, true, {3}, {100, 64, 30, 0});
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_THAT(rb[0].block_starts, ElementsAre(0));
  EXPECT_THAT(rb[0].columns, IsEmpty());
}

TEST(ConvertVerticalSlashTest, LastSlashEndingExactlyAtZeroStillCovers0To64) {
  // Non-causal kv 10, base = 74: a lone d=74 ends exactly at 0 and becomes [0, 64) (clipped to
  // 10); a lone d=75 ends left of 0 and leaves no band, so the column is kept.
  std::vector<VsRowBlock> rb = ConvertVerticalSlash(64, 10, false, {9}, {74});
  EXPECT_THAT(rb[0].block_starts, ElementsAre(0));
  EXPECT_THAT(rb[0].columns, IsEmpty());
  rb = ConvertVerticalSlash(64, 10, false, {9}, {75});
  EXPECT_THAT(rb[0].block_starts, IsEmpty());
  EXPECT_THAT(rb[0].columns, ElementsAre(9));
}

TEST(ConvertVerticalSlashTest, NonCausalSkipsOffsetsBelowTheRowBlock) {
  const std::vector<VsRowBlock> rb = ConvertVerticalSlash(128, 100, false, {0}, {120, 5});
  ASSERT_EQ(rb.size(), 2u);
  // Block 0: d=120 -> [0,64) (clamped), d=5 -> [95,159) clipped to 100.
  EXPECT_THAT(rb[0].block_starts, ElementsAre(0, 95));
  EXPECT_THAT(rb[0].columns, IsEmpty());
  // Block 1 (rows 64..127): d=120 -> [44,108); d=5 < 64 is never used.
  EXPECT_THAT(rb[1].block_starts, ElementsAre(44));
  EXPECT_THAT(rb[1].columns, ElementsAre(0));
}

TEST(ConvertVerticalSlashTest, NonCausalKeepsColumnsRightOfTheLastBand) {
  const std::vector<VsRowBlock> rb = ConvertVerticalSlash(64, 300, false, {10, 100, 200}, {300});
  EXPECT_THAT(rb[0].block_starts, ElementsAre(0));
  EXPECT_THAT(rb[0].columns, ElementsAre(100, 200));
}

TEST(ConvertVerticalSlashTest, CausalDropsColumnsRightOfTheLastRange) {
  // off = 136: d=150 ends at 50 -> [0, 64); column 100 lies right of it and is dropped although
  // rows 0..63 (positions 136..199) could see it -- the converter's causal rule.
  const std::vector<VsRowBlock> rb = ConvertVerticalSlash(64, 200, true, {100, 150}, {150});
  EXPECT_THAT(rb[0].block_starts, ElementsAre(0));
  EXPECT_THAT(rb[0].columns, IsEmpty());
}

TEST(ConvertVerticalSlashTest, EmptyListsGiveNothing) {
  EXPECT_THAT(ConvertVerticalSlash(64, 64, true, {}, {0})[0].block_starts, IsEmpty());
  EXPECT_THAT(ConvertVerticalSlash(64, 64, true, {1}, {})[0].columns, IsEmpty());
}

// ---- the converter: random cases vs the naive mask ----

// The (row, key) pairs the converter's lists make visible: blocks [b, b+64) and columns, inside
// [0, kv_len), intra also causal.
std::vector<uint8_t> MaskOf(const std::vector<VsRowBlock>& rbs, int64_t q_len, int64_t kv_len,
                            bool causal) {
  std::vector<uint8_t> mask(q_len * kv_len, 0);
  const int64_t off = kv_len - q_len;
  for (int64_t r = 0; r < q_len; ++r) {
    const VsRowBlock& rb = rbs[r / 64];
    for (int64_t b : rb.block_starts) {
      for (int64_t k = b; k < b + 64 && k < kv_len; ++k) mask[r * kv_len + k] = 1;
    }
    for (int64_t c : rb.columns) mask[r * kv_len + c] = 1;
    if (causal) {
      for (int64_t k = std::max<int64_t>(0, off + r + 1); k < kv_len; ++k) mask[r * kv_len + k] = 0;
    }
  }
  return mask;
}

void CheckInvariants(const std::vector<VsRowBlock>& rbs, int64_t kv_len, const std::string& what) {
  for (size_t m = 0; m < rbs.size(); ++m) {
    const VsRowBlock& rb = rbs[m];
    EXPECT_TRUE(std::is_sorted(rb.block_starts.begin(), rb.block_starts.end())) << what;
    EXPECT_TRUE(std::adjacent_find(rb.columns.begin(), rb.columns.end(),
                                   [](int64_t a, int64_t b) { return a >= b; }) == rb.columns.end())
        << what << ": columns not strictly ascending in row block " << m;
    for (size_t i = 0; i < rb.block_starts.size(); ++i) {
      EXPECT_GE(rb.block_starts[i], 0) << what;
      EXPECT_LT(rb.block_starts[i], kv_len) << what;
      if (i > 0) {
        EXPECT_GE(rb.block_starts[i], rb.block_starts[i - 1] + 64) << what;
      }
    }
    for (int64_t c : rb.columns) {
      EXPECT_GE(c, 0) << what;
      EXPECT_LT(c, kv_len) << what;
      for (int64_t b : rb.block_starts) {
        EXPECT_FALSE(c >= b && c < b + 64) << what << ": column " << c << " inside block " << b;
      }
    }
  }
}

std::vector<int64_t> RandomSubset(std::mt19937* rng, int64_t lo, int64_t hi, int64_t max_count) {
  std::set<int64_t> s;
  std::uniform_int_distribution<int64_t> pick(lo, hi - 1);
  std::uniform_int_distribution<int64_t> count(1, max_count);
  const int64_t n = std::min(count(*rng), hi - lo);
  while (static_cast<int64_t>(s.size()) < n) s.insert(pick(*rng));
  return std::vector<int64_t>(s.begin(), s.end());
}

TEST(ConvertVerticalSlashTest, RandomCasesMatchTheNaiveMaskExactly) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> coin(0, 1);
  for (int iter = 0; iter < 3000; ++iter) {
    const bool causal = coin(rng);
    std::uniform_int_distribution<int64_t> len(1, 330);
    const int64_t q_len = len(rng);
    const int64_t kv_len = causal ? q_len + len(rng) - 1 : len(rng);
    // Sparse and dense index lists; offsets reach left of key 0 and right of every key.
    const int64_t max_cols = coin(rng) ? 6 : 60;
    const int64_t max_offs = coin(rng) ? 6 : 60;
    const std::vector<int64_t> columns = RandomSubset(&rng, 0, kv_len, max_cols);
    std::vector<int64_t> offsets = RandomSubset(&rng, 0, kv_len + q_len + 130, max_offs);
    if (causal && coin(rng)) offsets.insert(offsets.begin(), 0);  // the forced main diagonal
    std::sort(offsets.begin(), offsets.end());
    offsets.erase(std::unique(offsets.begin(), offsets.end()), offsets.end());
    std::reverse(offsets.begin(), offsets.end());
    const std::string what =
        absl::StrCat("iter ", iter, " causal ", causal, " q ", q_len, " kv ", kv_len);
    const std::vector<VsRowBlock> rbs =
        ConvertVerticalSlash(q_len, kv_len, causal, columns, offsets);
    ASSERT_EQ(static_cast<int64_t>(rbs.size()), (q_len + 63) / 64) << what;
    CheckInvariants(rbs, kv_len, what);
    const std::vector<uint8_t> got = MaskOf(rbs, q_len, kv_len, causal);
    const std::vector<uint8_t> want = naive::StageMask(q_len, kv_len, causal, columns, offsets);
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << what << ": row " << i / kv_len << " key " << i % kv_len;
    }
  }
}

// ---- stage mapping ----

void ExpectStagesMatchNaive(const VsSelection& sel, const VsPiece& piece, int64_t cl,
                            const std::string& what) {
  const std::array<VsStageLists, kVsNumStages> st = MapToStages(sel, piece, cl);
  for (int s = 0; s < kVsNumStages; ++s) {
    const naive::NaiveStage want =
        naive::MapStage(s, sel.vertical, sel.slash, piece.prev, piece.begin, piece.end, cl);
    SCOPED_TRACE(absl::StrCat(what, " stage ", s));
    ASSERT_EQ(st[s].present, want.present);
    if (!want.present) continue;
    EXPECT_EQ(st[s].causal, want.causal);
    EXPECT_EQ(st[s].kv_begin, want.kv_begin);
    EXPECT_EQ(st[s].kv_len, want.kv_len);
    EXPECT_EQ(st[s].q_len, want.q_len);
    EXPECT_EQ(st[s].columns, want.columns);
    EXPECT_EQ(st[s].offsets, want.offsets);
  }
}

TEST(MapToStagesTest, RandomSelectionsMatchTheNaiveMapping) {
  std::mt19937 rng(11);
  const int64_t cl = 100;
  for (int iter = 0; iter < 500; ++iter) {
    std::uniform_int_distribution<int64_t> chunk(0, 3), inside(0, cl - 1);
    const int64_t prev = chunk(rng) * cl;
    const int64_t begin = prev + inside(rng) / 2;
    const int64_t end = std::min(prev + cl, begin + 1 + inside(rng));
    VsSelection sel;
    sel.vertical = RandomSubset(&rng, 0, end, 1 + iter % 40);
    sel.slash = RandomSubset(&rng, 0, end, 1 + iter % 40);
    ExpectStagesMatchNaive(sel, VsPiece{prev, begin, end}, cl, absl::StrCat("iter ", iter));
  }
}

TEST(MapToStagesTest, FallbacksForEmptyLists) {
  // prev = 200 = 2 cl: all three stages. Every vertical and slash lies in intra.
  const VsPiece piece{200, 230, 260};
  VsSelection sel;
  sel.vertical = {205, 259};
  sel.slash = {259};
  const std::array<VsStageLists, kVsNumStages> st = MapToStages(sel, piece, 100);
  EXPECT_THAT(st[kVsIntraStage].columns, ElementsAre(5, 59));
  EXPECT_THAT(st[kVsIntraStage].offsets, ElementsAre(0));
  // succ: no column in [100, 200) -> arange(0, 100, 20); the one slash (259) is outside
  // [prev - cl, prev + nq) = [100, 230) -> the same arange as offsets, descending. inter: no
  // column below 100 and 259 >= prev - cl + nq = 130 -> the same.
  EXPECT_THAT(st[kVsSuccStage].columns, ElementsAre(0, 20, 40, 60, 80));
  EXPECT_THAT(st[kVsSuccStage].offsets, ElementsAre(80, 60, 40, 20, 0));
  EXPECT_THAT(st[kVsInterStage].columns, ElementsAre(0, 20, 40, 60, 80));
  EXPECT_THAT(st[kVsInterStage].offsets, ElementsAre(80, 60, 40, 20, 0));
  EXPECT_THAT(VsFallbackIndices(448), ElementsAre(0, 89, 178, 267, 356));
  EXPECT_THAT(VsFallbackIndices(9), ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(VsFallbackIndices(3), ElementsAre(0, 1, 2));
  ExpectStagesMatchNaive(sel, piece, 100, "fallbacks");
}

TEST(MapToStagesTest, SuccAndInterOffsetsFollowTheGeometricDiagonal) {
  // Chunked prefill (begin != prev): a slash anchor t means q_abs - k_abs = end - 1 - t in every
  // stage; check the row/key the converter's virtual positions imply.
  const int64_t cl = 100;
  const VsPiece piece{200, 240, 290};  // nq = 50
  VsSelection sel;
  sel.vertical = {1};
  sel.slash = {50, 150, 250};
  const std::array<VsStageLists, kVsNumStages> st = MapToStages(sel, piece, cl);
  const int64_t nq = piece.end - piece.begin;
  for (int s = 1; s < kVsNumStages; ++s) {
    for (int64_t d : st[s].offsets) {
      // Non-causal: row r sits at kv_len + r, sees key kv_len + r - d (stage-relative).
      const int64_t r = nq - 1;
      const int64_t key_abs = st[s].kv_begin + st[s].kv_len + r - d;
      const int64_t t = key_abs;  // the last row's key on the diagonal is the anchor
      EXPECT_TRUE(std::find(sel.slash.begin(), sel.slash.end(), t) != sel.slash.end())
          << "stage " << s << " offset " << d;
    }
  }
  for (int64_t d : st[kVsIntraStage].offsets) {
    const int64_t off = st[0].kv_len - st[0].q_len;
    const int64_t t = st[0].kv_begin + off + (nq - 1) - d;
    EXPECT_TRUE(std::find(sel.slash.begin(), sel.slash.end(), t) != sel.slash.end()) << d;
  }
}

// ---- estimation ----

// A contiguous-in-memory but shuffled-page KV cache for one layer, fp32.
struct TestKv {
  std::vector<float> k, v;
  std::vector<int32_t> table;
  PagedKv<float> view;
  TestKv(const DcaGeometry& g, int64_t capacity, int32_t page_size, std::mt19937* rng) {
    const int64_t pages = (capacity + page_size - 1) / page_size + 3;
    const int64_t slot = static_cast<int64_t>(g.num_kv_heads) * g.head_dim;
    k.assign(pages * page_size * slot, std::nanf(""));
    v.assign(pages * page_size * slot, std::nanf(""));
    std::vector<int32_t> ids(pages);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), *rng);
    table.assign(ids.begin(), ids.begin() + (capacity + page_size - 1) / page_size);
    view.k = k.data();
    view.v = v.data();
    view.page_table = table.data();
    view.page_size = page_size;
    view.num_kv_heads = g.num_kv_heads;
    view.head_dim = g.head_dim;
  }
  void Put(int64_t pos, const float* key, const float* value) {
    const int n = view.num_kv_heads * view.head_dim;
    std::copy(key, key + n, view.Key(pos, 0));
    std::copy(value, value + n, view.Value(pos, 0));
  }
};

DcaGeometry SmallGeometry() {
  DcaGeometry g;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 16;
  g.chunk_len = 96;
  g.softmax_scale = 0.25f;
  return g;
}

// True when the k-th and (k+1)-th largest scores are both +inf (a tie the rule decides) or
// differ by more than `gap` (fp32 vs fp64 rounding cannot swap them).
bool Separated(std::vector<double> s, int64_t k, double gap) {
  std::sort(s.begin(), s.end(), std::greater<double>());
  if (k <= 0 || k >= static_cast<int64_t>(s.size())) return true;
  if (std::isinf(s[k - 1]) && std::isinf(s[k])) return true;
  return s[k - 1] - s[k] > gap;
}

class EstimateTest : public ::testing::Test {
 protected:
  void Fill(bool zero_queries, int seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    kv_ = std::make_unique<TestKv>(geo_, length_, 16, &rng);
    const int64_t slot = int64_t{geo_.num_kv_heads} * geo_.head_dim;
    std::vector<float> kr(slot), vr(slot);
    keys_.assign(length_ * slot, 0.0);
    for (int64_t p = 0; p < length_; ++p) {
      for (int64_t i = 0; i < slot; ++i) {
        kr[i] = normal(rng);
        vr[i] = normal(rng);
        keys_[p * slot + i] = kr[i];
      }
      kv_->Put(p, kr.data(), vr.data());
    }
    q_.assign(length_ * 5 * geo_.num_q_heads * geo_.head_dim, 0.f);
    if (!zero_queries) {
      for (float& x : q_) x = 1.5f * normal(rng);
    }
  }
  CpuPrefillParams Params() const {
    CpuPrefillParams p;
    p.q = q_.data();
    p.start = 0;
    p.num_tokens = length_;
    p.softmax_scale = geo_.softmax_scale;
    return p;
  }

  DcaGeometry geo_ = SmallGeometry();
  int64_t length_ = 300;
  std::unique_ptr<TestKv> kv_;
  std::vector<float> q_;
  std::vector<double> keys_;
};

TEST_F(EstimateTest, SelectionMatchesTheNaiveTopKExactly) {
  Fill(false, 3);
  const int64_t cl = geo_.chunk_len;
  // Pieces of every kind: chunk 0, chunk 1 (succ), chunk 3 (inter) with begin != prev, and a
  // piece shorter than last_q.
  const std::vector<VsPiece> pieces = {
      {0, 10, 96}, {cl, cl, 2 * cl}, {3 * cl, 3 * cl + 4, 300}, {2 * cl, 2 * cl + 90, 3 * cl}};
  const std::vector<VsBudget> budgets = {{40, 110}, {130, 150}, {31, 100}, {60, 170}};
  int compared = 0;
  for (const VsPiece& piece : pieces) {
    for (int32_t h = 0; h < geo_.num_q_heads; ++h) {
      for (int64_t last_q : {64, 8}) {
        const std::string what =
            absl::StrCat("piece [", piece.begin, ",", piece.end, ") head ", h, " last_q ", last_q);
        const naive::SparseScores sc = naive::EstimateScores(
            geo_, q_, 0, keys_, piece.prev, piece.begin, piece.end, h, geo_.softmax_scale, last_q);
        ASSERT_TRUE(Separated(sc.vertical, budgets[h].vertical, 1e-6))
            << what << ": vertical scores not separated at the budget; pick another seed";
        ASSERT_TRUE(Separated(sc.slash, budgets[h].slash, 1e-6))
            << what << ": slash scores not separated at the budget; pick another seed";
        const VsSelection sel =
            EstimateVerticalSlash<float>(geo_, kv_->view, Params(), piece, h, last_q, budgets[h]);
        EXPECT_EQ(sel.vertical, naive::TopK(sc.vertical, budgets[h].vertical, false)) << what;
        EXPECT_EQ(sel.slash, naive::TopK(sc.slash, budgets[h].slash, true)) << what;
        EXPECT_EQ(static_cast<int64_t>(sel.vertical.size()),
                  std::min<int64_t>(budgets[h].vertical, piece.end));
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 32);
}

TEST_F(EstimateTest, ZeroQueriesTieEverywhereAndTheTieRuleDecides) {
  // All logits 0: every row is uniform over the keys it sees, so the scores tie in large groups
  // and the selection is decided by the tie rule alone (smaller key first for verticals, nearer
  // diagonal first for slashes).
  Fill(true, 5);
  const VsPiece piece{192, 200, 300};
  const VsBudget budget{45, 120};
  const VsSelection sel =
      EstimateVerticalSlash<float>(geo_, kv_->view, Params(), piece, 1, 64, budget);
  const naive::SparseScores sc = naive::EstimateScores(geo_, q_, 0, keys_, piece.prev, piece.begin,
                                                       piece.end, 1, geo_.softmax_scale, 64);
  EXPECT_EQ(sel.vertical, naive::TopK(sc.vertical, budget.vertical, false));
  EXPECT_EQ(sel.slash, naive::TopK(sc.slash, budget.slash, true));
  // Columns 0..29 forced, then 30..44 (equal sums, smaller first).
  std::vector<int64_t> want_v(45);
  std::iota(want_v.begin(), want_v.end(), 0);
  EXPECT_EQ(sel.vertical, want_v);
  // The 100 nearest anchors forced, then the next 20 nearest.
  std::vector<int64_t> want_s(120);
  std::iota(want_s.begin(), want_s.end(), 300 - 120);
  EXPECT_EQ(sel.slash, want_s);
}

TEST_F(EstimateTest, BudgetsLargerThanTheKeysTakeEverything) {
  Fill(false, 9);
  const VsPiece piece{0, 0, 20};
  const VsSelection sel =
      EstimateVerticalSlash<float>(geo_, kv_->view, Params(), piece, 0, 64, VsBudget{130, 6096});
  std::vector<int64_t> all(20);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(sel.vertical, all);
  EXPECT_EQ(sel.slash, all);
}

}  // namespace
}  // namespace attnd
