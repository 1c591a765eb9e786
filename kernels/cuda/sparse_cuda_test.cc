// Tests of the CUDA vertical-slash sparse prefill (sparse_cuda.h) against the exact CPU path
// (kernels/vertical_slash.h, kernels/sparse_prefill_cpu.h) and an fp64 estimation written here:
//   - estimation scores vs fp64 (relative 2e-3),
//   - selected index sets equal to the CPU's, except where the fp64 scores of the differing
//     indices tie with the k-th score (within 1e-3 relative): on separated inputs, equal sets,
//   - stage lists and converter blocks equal to the CPU's MapToStages / ConvertVerticalSlash run on
//     the GPU's selection (exact),
//   - outputs vs the CPU attention over the same sets, and a whole multi-piece call vs
//     DcaSparsePrefillCpu, within the bf16 bars of DCA.md; outputs poisoned with NaN first,
//   - the golden case sparse_vs within the bf16 bars.
// Skips loudly where no CUDA device is present.
#include "kernels/cuda/sparse_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/cuda/testing/gpu_test.h"
#include "kernels/dca.h"
#include "kernels/dca_cpu.h"
#include "kernels/paged_kv.h"
#include "kernels/sparse_prefill_cpu.h"
#include "kernels/vertical_slash.h"
#include "nlohmann/json.hpp"
#include "tests/testdata/golden_dir.h"

namespace attnd {
namespace {

constexpr double kMaxAbsBar = 2e-2;  // DCA.md "Numerics": bf16 vs an fp32 reference
constexpr double kMeanAbsBar = 2e-3;

#define CUDA_ASSERT(expr) \
  ASSERT_EQ(cudaSuccess, (expr)) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

using gpu_test::DevBuf;

template <typename T>
std::vector<T> Download(const T* dev, size_t n) {
  std::vector<T> out(n);
  if (n > 0) cudaMemcpy(out.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost);
  return out;
}

float RoundBf16(float x) { return Bf16ToFloat(FloatToBf16(x)); }

// One sequence, one layer: bf16-exact fp32 host copies of q and the cached K/V, the same values
// in a bf16 device pool and an fp32 host pool sharing one shuffled page table.
struct Case {
  DcaGeometry g;
  int64_t length = 0;
  std::vector<VsBudget> budgets;
  float softmax_scale = 0.f;
  std::vector<float> q;     // [length, 5, Hq, D]
  std::vector<float> k, v;  // [length, Hkv, D], as cached
  int64_t last_q = 64;
};

struct Pools {
  static constexpr int32_t kPage = 16;
  std::vector<int32_t> table;
  std::vector<float> hk, hv;  // host pool [pages, page, Hkv, D]
  DevBuf* dk = nullptr;
  DevBuf* dv = nullptr;
  DevBuf* dtable = nullptr;
  DevBuf* dq = nullptr;
  PagedKv<float> host;
  PagedKv<Bf16> dev;

  explicit Pools(const Case& c) {
    const int64_t pages = (c.length + kPage - 1) / kPage + 3;
    const int64_t row = static_cast<int64_t>(c.g.num_kv_heads) * c.g.head_dim;
    table.resize(pages);
    std::iota(table.begin(), table.end(), 0);
    std::mt19937 rng(7);
    std::shuffle(table.begin(), table.end(), rng);
    hk.assign(pages * kPage * row, 0.f);
    hv.assign(pages * kPage * row, 0.f);
    host =
        PagedKv<float>{hk.data(), hv.data(), table.data(), kPage, c.g.num_kv_heads, c.g.head_dim};
    for (int64_t p = 0; p < c.length; ++p) {
      for (int h = 0; h < c.g.num_kv_heads; ++h) {
        std::memcpy(host.Key(p, h), &c.k[(p * c.g.num_kv_heads + h) * c.g.head_dim],
                    c.g.head_dim * sizeof(float));
        std::memcpy(host.Value(p, h), &c.v[(p * c.g.num_kv_heads + h) * c.g.head_dim],
                    c.g.head_dim * sizeof(float));
      }
    }
    std::vector<uint16_t> bk(hk.size()), bv(hv.size()), bq(c.q.size());
    for (size_t i = 0; i < hk.size(); ++i) {
      bk[i] = FloatToBf16(hk[i]);
      bv[i] = FloatToBf16(hv[i]);
    }
    for (size_t i = 0; i < c.q.size(); ++i) bq[i] = FloatToBf16(c.q[i]);
    dk = new DevBuf(bk.size() * 2);
    dv = new DevBuf(bv.size() * 2);
    dtable = new DevBuf(table.size() * 4);
    dq = new DevBuf(bq.size() * 2);
    cudaMemcpy(dk->get(), bk.data(), bk.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dv->get(), bv.data(), bv.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dtable->get(), table.data(), table.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dq->get(), bq.data(), bq.size() * 2, cudaMemcpyHostToDevice);
    dev = PagedKv<Bf16>{dk->get<Bf16>(), dv->get<Bf16>(),  dtable->get<int32_t>(),
                        kPage,           c.g.num_kv_heads, c.g.head_dim};
  }
  ~Pools() {
    delete dk;
    delete dv;
    delete dtable;
    delete dq;
  }
};

// Separated scores: every key carries a random strength c_j along a per-kv-head direction u and
// every query a fixed multiple of u, so column (and sliding-window diagonal) sums are spread
// log-normally; the rest is small noise. Values rounded to bf16.
Case MakeCase(int hq, int hkv, int64_t cl, int64_t length, std::vector<VsBudget> budgets,
              uint32_t seed) {
  Case c;
  c.g.num_q_heads = hq;
  c.g.num_kv_heads = hkv;
  c.g.head_dim = 128;
  c.g.chunk_len = cl;
  c.g.original_max_position_embeddings = 0;
  c.g.softmax_scale = 1.f / std::sqrt(128.f);
  c.softmax_scale = c.g.softmax_scale;
  c.length = length;
  c.budgets = std::move(budgets);
  const int d = 128;
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::vector<float> u(static_cast<size_t>(hkv) * d);
  for (int h = 0; h < hkv; ++h) {
    double norm = 0;
    for (int e = 0; e < d; ++e) norm += (u[h * d + e] = n01(rng)) * u[h * d + e];
    for (int e = 0; e < d; ++e) u[h * d + e] /= static_cast<float>(std::sqrt(norm));
  }
  c.k.resize(length * hkv * d);
  c.v.resize(length * hkv * d);
  for (int64_t p = 0; p < length; ++p) {
    for (int h = 0; h < hkv; ++h) {
      const float strength = 5.f * n01(rng);
      for (int e = 0; e < d; ++e) {
        c.k[(p * hkv + h) * d + e] = RoundBf16(strength * u[h * d + e] + 0.5f * n01(rng));
        c.v[(p * hkv + h) * d + e] = RoundBf16(n01(rng));
      }
    }
  }
  c.q.resize(length * kNumQueryVariants * hq * d);
  for (int64_t p = 0; p < length; ++p) {
    for (int var = 0; var < kNumQueryVariants; ++var) {
      for (int h = 0; h < hq; ++h) {
        const int kvh = h / (hq / hkv);
        for (int e = 0; e < d; ++e) {
          c.q[((p * kNumQueryVariants + var) * hq + h) * d + e] =
              RoundBf16(4.f * u[kvh * d + e] + 0.5f * n01(rng));
        }
      }
    }
  }
  return c;
}

// Runs the GPU sparse prefill for tokens [start, start + num), fp32 output poisoned first.
// Returns the output and (optionally) a copy of the workspace.
struct GpuRun {
  std::vector<float> out;
  std::vector<char> workspace;
  SparsePrefillParams params;
};

void RunGpu(const Case& c, Pools& pools, int64_t start, int64_t num, GpuRun* run,
            int32_t slice = kDefaultRowBlockSlice) {
  const int64_t hq = c.g.num_q_heads, d = c.g.head_dim;
  DevBuf out(num * hq * d * sizeof(float));
  ASSERT_NE(out.get(), nullptr);
  CUDA_ASSERT(cudaMemset(out.get(), 0xff, out.bytes()));
  SparsePrefillParams sp;
  sp.prefill.kv = pools.dev;
  sp.prefill.q = pools.dq->get<Bf16>() + start * kNumQueryVariants * hq * d;
  sp.prefill.out = out.get();
  sp.prefill.out_dtype = DType::kFp32;
  sp.prefill.start = start;
  sp.prefill.num_tokens = num;
  sp.prefill.softmax_scale = c.softmax_scale;
  sp.budgets = c.budgets;
  sp.last_q = c.last_q;
  sp.row_block_slice = slice;
  const size_t bytes = SparsePrefillWorkspaceBytes(c.g, c.budgets, start, num, c.last_q, slice);
  ASSERT_GT(bytes, 0u);
  DevBuf ws(bytes);
  ASSERT_NE(ws.get(), nullptr);
  CUDA_ASSERT(cudaMemset(ws.get(), 0xff, bytes));  // stale garbage must not matter
  sp.workspace = ws.get();
  sp.workspace_bytes = bytes;
  const absl::Status st = LaunchSparsePrefill(c.g, sp, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT(cudaDeviceSynchronize());
  run->out = Download(out.get<float>(), num * hq * d);
  run->workspace.resize(bytes);
  CUDA_ASSERT(cudaMemcpy(run->workspace.data(), ws.get(), bytes, cudaMemcpyDeviceToHost));
  // Re-point the params at the host copy so SparseDebugViewOf addresses it.
  sp.workspace = run->workspace.data();
  sp.prefill.out = nullptr;
  run->params = sp;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0, sum = 0;
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++bad;
      continue;
    }
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, e);
    sum += e;
  }
  EXPECT_EQ(bad, 0u) << what << ": non-finite outputs";
  const double mean = sum / std::max<size_t>(1, got.size());
  EXPECT_LE(worst, kMaxAbsBar) << what;
  EXPECT_LE(mean, kMeanAbsBar) << what;
  std::printf("%s: max abs %.3g, mean abs %.3g over %zu values\n", what.c_str(), worst, mean,
              got.size());
}

// fp64 estimation scores of one head and piece (DCA.md step 1), without the forced +inf.
void RefScores(const Case& c, const VsPiece& piece, int h, std::vector<double>* vert,
               std::vector<double>* slash) {
  const int d = c.g.head_dim, hq = c.g.num_q_heads, hkv = c.g.num_kv_heads;
  const int kvh = h / (hq / hkv);
  const int64_t end = piece.end, cl = c.g.chunk_len, prev = piece.prev;
  const int64_t n = std::min<int64_t>(piece.end - piece.begin, c.last_q);
  vert->assign(end, 0.0);
  slash->assign(end, 0.0);
  std::vector<double> logit(end);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = end - n + i;
    double mx = -INFINITY;
    for (int64_t j = 0; j <= pos; ++j) {
      const int var = j >= prev ? kIntra : (j >= prev - cl ? kSuccCritical : kInterCritical);
      const float* q = &c.q[((pos * kNumQueryVariants + var) * hq + h) * d];
      const float* k = &c.k[(j * hkv + kvh) * d];
      double s = 0;
      for (int e = 0; e < d; ++e) s += static_cast<double>(q[e]) * k[e];
      logit[j] = s * c.softmax_scale;
      mx = std::max(mx, logit[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j <= pos; ++j) sum += (logit[j] = std::exp(logit[j] - mx));
    for (int64_t j = 0; j <= pos; ++j) {
      (*vert)[j] += logit[j] / sum;
      (*slash)[j + n - 1 - i] += logit[j] / sum;
    }
  }
}

// Every index in the symmetric difference of got and want must tie (within 1e-3 relative) with
// the k-th largest reference score; forced entries count as +inf.
void ExpectSameSelection(const std::vector<int64_t>& got, const std::vector<int64_t>& want,
                         std::vector<double> ref, bool slash, int64_t end, const std::string& what,
                         int* exact, int* total) {
  ++*total;
  ASSERT_EQ(got.size(), want.size()) << what;
  if (got == want) {
    ++*exact;
    return;
  }
  for (int64_t j = 0; j < end; ++j) {
    if (slash ? j >= end - kVsForcedSlashes : j < kVsForcedVerticals) ref[j] = INFINITY;
  }
  std::vector<double> sorted = ref;
  std::sort(sorted.rbegin(), sorted.rend());
  const double kth = sorted[want.size() - 1];
  std::set<int64_t> a(got.begin(), got.end()), b(want.begin(), want.end());
  int diffs = 0;
  for (int64_t x : got) {
    if (b.count(x)) continue;
    ++diffs;
    EXPECT_NEAR(ref[x], kth, 1e-3 * kth) << what << ": GPU picked " << x << " (not a tie)";
  }
  for (int64_t x : want) {
    if (a.count(x)) continue;
    EXPECT_NEAR(ref[x], kth, 1e-3 * kth) << what << ": GPU missed " << x << " (not a tie)";
  }
  std::printf("%s: %d near-tie differences at the cut\n", what.c_str(), diffs);
}

// Budgets cycling over small versions of the shipped pattern's shapes, one head taking all.
std::vector<VsBudget> TestBudgets(int hq) {
  const VsBudget kinds[] = {{130, 100},  {200, 300}, {64, 700}, {500, 50},
                            {1000, 150}, {30, 5000}, {333, 120}};
  std::vector<VsBudget> b(hq);
  for (int h = 0; h < hq; ++h) b[h] = kinds[h % 7];
  return b;
}

TEST(SparseCudaTest, RejectsBadArguments) {
  const Case c = MakeCase(8, 2, 256, 16, TestBudgets(8), 1);
  SparsePrefillParams sp;
  sp.budgets = c.budgets;
  sp.prefill.num_tokens = 16;
  EXPECT_EQ(LaunchSparsePrefill(c.g, sp, nullptr).code(), absl::StatusCode::kInvalidArgument);
  std::vector<VsBudget> short_budgets(3);
  EXPECT_EQ(SparsePrefillWorkspaceBytes(c.g, short_budgets, 0, 16, 64), 0u);
  EXPECT_GT(SparsePrefillWorkspaceBytes(c.g, c.budgets, 0, 16, 64), 0u);
}

// The engine-wide bound covers every call within its limits (mid-chunk starts, calls spanning
// pieces, slices). Host arithmetic: runs without a GPU.
TEST(SparseCudaTest, WorkspaceBoundCoversEveryCall) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t cl = std::uniform_int_distribution<int64_t>(64, 5000)(rng);
    const int64_t max_length = std::uniform_int_distribution<int64_t>(1, 6 * cl)(rng);
    const int64_t max_tokens = std::uniform_int_distribution<int64_t>(1, max_length)(rng);
    const int32_t slice = std::uniform_int_distribution<int32_t>(1, 100)(rng);
    Case c = MakeCase(8, 2, cl, 1, TestBudgets(8), 1);
    for (VsBudget& b : c.budgets) {
      b.vertical = std::uniform_int_distribution<int64_t>(1, 3000)(rng);
      b.slash = std::uniform_int_distribution<int64_t>(1, 3000)(rng);
    }
    const size_t bound =
        SparsePrefillWorkspaceBound(c.g, c.budgets, max_length, max_tokens, 64, slice);
    ASSERT_GT(bound, 0u);
    for (int k = 0; k < 20; ++k) {
      const int64_t num = std::uniform_int_distribution<int64_t>(1, max_tokens)(rng);
      const int64_t start = std::uniform_int_distribution<int64_t>(0, max_length - num)(rng);
      ASSERT_LE(SparsePrefillWorkspaceBytes(c.g, c.budgets, start, num, 64, slice), bound)
          << "cl " << cl << " max_length " << max_length << " max_tokens " << max_tokens
          << " start " << start << " num " << num << " slice " << slice;
    }
  }
}

// Per piece: estimation, selections, stage lists, converter blocks and outputs vs the CPU path.
TEST(SparseCudaTest, PiecesMatchCpuPath) {
  REQUIRE_GPU();
  const int hq = 28, hkv = 4;
  const int64_t cl = 512, length = 1700;  // pieces 512, 512, 512, 164 (+ [1100, 1536)): all stages
  Case c = MakeCase(hq, hkv, cl, length, TestBudgets(hq), 11);
  Pools pools(c);
  ThreadPool pool(2);
  int exact = 0, total = 0;
  // From 0, and from inside a chunk (the first piece then has p + n_q != end).
  std::vector<VsPiece> pieces = SplitIntoPieces(0, length, cl);
  for (const VsPiece& piece : SplitIntoPieces(1100, length - 1100, cl)) {
    if (piece.begin != piece.prev) pieces.push_back(piece);
  }
  for (const VsPiece& piece : pieces) {
    SCOPED_TRACE(absl::StrCat("piece [", piece.begin, ", ", piece.end, ")"));
    GpuRun run;
    RunGpu(c, pools, piece.begin, piece.end - piece.begin, &run);
    if (HasFatalFailure()) return;
    const SparseDebugView view = SparseDebugViewOf(c.g, run.params);
    CpuPrefillParams cp;
    cp.q = c.q.data() + piece.begin * kNumQueryVariants * hq * c.g.head_dim;
    cp.start = piece.begin;
    cp.num_tokens = piece.end - piece.begin;
    cp.softmax_scale = c.softmax_scale;
    std::vector<VsHeadPlan> plans(hq);
    for (int h = 0; h < hq; ++h) {
      const std::string tag = absl::StrCat("head ", h);
      // Estimation scores vs fp64.
      std::vector<double> rv, rs;
      RefScores(c, piece, h, &rv, &rs);
      double worst_rel = 0;
      for (int64_t j = 0; j < piece.end; ++j) {
        const double gv = view.vertical_scores[h * view.score_stride + j];
        const double gs = view.slash_scores[h * view.score_stride + j];
        worst_rel = std::max(worst_rel, std::fabs(gv - rv[j]) / (std::fabs(rv[j]) + 1e-4));
        worst_rel = std::max(worst_rel, std::fabs(gs - rs[j]) / (std::fabs(rs[j]) + 1e-4));
      }
      EXPECT_LE(worst_rel, 2e-3) << tag << ": estimation scores vs fp64";
      // Selections vs the CPU path.
      const VsSelection cpu =
          EstimateVerticalSlash<float>(c.g, pools.host, cp, piece, h, c.last_q, c.budgets[h]);
      VsSelection gpu;
      const int64_t nv = std::min(c.budgets[h].vertical, piece.end);
      const int64_t ns = std::min(c.budgets[h].slash, piece.end);
      for (int64_t i = 0; i < nv; ++i)
        gpu.vertical.push_back(view.vertical[h * view.vertical_stride + i]);
      for (int64_t i = 0; i < ns; ++i) gpu.slash.push_back(view.slash[h * view.slash_stride + i]);
      ExpectSameSelection(gpu.vertical, cpu.vertical, rv, false, piece.end, tag + " vertical",
                          &exact, &total);
      ExpectSameSelection(gpu.slash, cpu.slash, rs, true, piece.end, tag + " slash", &exact,
                          &total);
      ASSERT_TRUE(std::is_sorted(gpu.vertical.begin(), gpu.vertical.end())) << tag;
      ASSERT_TRUE(std::is_sorted(gpu.slash.begin(), gpu.slash.end())) << tag;
      // Index construction on the GPU's selection vs the CPU's.
      VsHeadPlan& plan = plans[h];
      plan.selection = gpu;
      plan.stages = MapToStages(gpu, piece, cl);
      for (int s = 0; s < kVsNumStages; ++s) {
        const VsStageLists& st = plan.stages[s];
        const int32_t* cnt = view.stage_counts + (h * 3 + s) * 2;
        if (!st.present) {
          EXPECT_EQ(cnt[1], 0) << tag << " stage " << s;
          continue;
        }
        plan.row_blocks[s] =
            ConvertVerticalSlash(st.q_len, st.kv_len, st.causal, st.columns, st.offsets);
        ASSERT_EQ(cnt[0], static_cast<int32_t>(st.columns.size())) << tag << " stage " << s;
        ASSERT_EQ(cnt[1], static_cast<int32_t>(st.offsets.size())) << tag << " stage " << s;
        for (size_t i = 0; i < st.columns.size(); ++i) {
          ASSERT_EQ(view.stage_columns[(h * 3 + s) * view.vertical_stride + i], st.columns[i]);
        }
        for (size_t i = 0; i < st.offsets.size(); ++i) {
          ASSERT_EQ(view.stage_offsets[(h * 3 + s) * view.slash_stride + i], st.offsets[i]);
        }
        ASSERT_EQ(view.rb_offset, 0) << "the piece fits one slice";
        for (int64_t m = 0; m < view.row_blocks; ++m) {
          const std::vector<int64_t>& want = plan.row_blocks[s][m].block_starts;
          const int32_t n = view.block_counts[(h * 3 + s) * view.row_blocks + m];
          const int32_t* got =
              view.blocks + view.block_base[h * 3 + s] + m * view.block_cap[h * 3 + s];
          ASSERT_EQ(n, static_cast<int32_t>(want.size())) << tag << " stage " << s << " rb " << m;
          for (int32_t i = 0; i < n; ++i) {
            ASSERT_EQ(got[i], want[i]) << tag << " stage " << s << " rb " << m << " #" << i;
          }
          // Columns the GPU attends (not masked as inside a block) vs the converter's columns:
          // equal for succ / inter; for the causal intra stage the GPU also keeps columns right
          // of the last band, which must lie past every row of the block (causally masked).
          const uint32_t* mask = view.column_masks + view.mask_base[h] +
                                 (s * view.row_blocks + m) * view.mask_words[h];
          std::vector<int64_t> kept;
          for (size_t i = 0; i < st.columns.size(); ++i) {
            if (!((mask[i / 32] >> (i % 32)) & 1u)) kept.push_back(st.columns[i]);
          }
          const std::vector<int64_t>& cpu_cols = plan.row_blocks[s][m].columns;
          if (!st.causal) {
            ASSERT_EQ(kept, cpu_cols) << tag << " stage " << s << " rb " << m;
          } else {
            const int64_t horizon = st.kv_len - st.q_len + std::min((m + 1) * 64, st.q_len) - 1;
            size_t ci = 0;
            for (int64_t x : kept) {
              if (ci < cpu_cols.size() && cpu_cols[ci] == x) {
                ++ci;
              } else {
                ASSERT_GT(x, horizon) << tag << " intra rb " << m << ": extra visible column";
              }
            }
            ASSERT_EQ(ci, cpu_cols.size()) << tag << " intra rb " << m << ": a column is missing";
          }
        }
      }
    }
    // Attention over the GPU's sets vs the CPU's attention over the same sets.
    std::vector<float> want((piece.end - piece.begin) * hq * c.g.head_dim, NAN);
    cp.out = want.data();
    AttendVerticalSlashPiece<float>(c.g, pools.host, cp, piece, plans, &pool);
    ExpectClose(run.out, want, absl::StrCat("piece ", piece.begin, " output vs CPU same sets"));
  }
  std::printf("selections equal to the CPU's: %d of %d\n", exact, total);
}

// A whole multi-piece call (start 0 and a start inside a chunk) vs DcaSparsePrefillCpu.
TEST(SparseCudaTest, WholeCallMatchesCpu) {
  REQUIRE_GPU();
  const int hq = 28, hkv = 4;
  const int64_t cl = 384, length = 1500;
  Case c = MakeCase(hq, hkv, cl, length, TestBudgets(hq), 23);
  Pools pools(c);
  ThreadPool pool(2);
  for (int64_t start : {int64_t{0}, int64_t{700}}) {
    GpuRun run;
    RunGpu(c, pools, start, length - start, &run);
    if (HasFatalFailure()) return;
    std::vector<float> want((length - start) * hq * c.g.head_dim, NAN);
    CpuPrefillParams cp;
    cp.q = c.q.data() + start * kNumQueryVariants * hq * c.g.head_dim;
    cp.out = want.data();
    cp.start = start;
    cp.num_tokens = length - start;
    cp.softmax_scale = c.softmax_scale;
    DcaSparsePrefillCpu<float>(c.g, pools.host, cp, c.budgets, c.last_q, &pool);
    ExpectClose(run.out, want, absl::StrCat("whole call from ", start, " vs DcaSparsePrefillCpu"));
    // Row blocks in slices of 3 (several converter / attention launches per piece, the block
    // lists reused): the same arithmetic, so the same bits.
    GpuRun sliced;
    RunGpu(c, pools, start, length - start, &sliced, /*slice=*/3);
    if (HasFatalFailure()) return;
    ASSERT_EQ(sliced.out.size(), run.out.size());
    size_t differ = 0;
    for (size_t i = 0; i < run.out.size(); ++i) {
      differ += std::memcmp(&sliced.out[i], &run.out[i], sizeof(float)) != 0;
    }
    EXPECT_EQ(differ, 0u) << "slices of 3 row blocks vs one slice, from " << start;
    EXPECT_LT(SparsePrefillWorkspaceBytes(c.g, c.budgets, start, length - start, c.last_q, 3),
              SparsePrefillWorkspaceBytes(c.g, c.budgets, start, length - start, c.last_q));
  }
}

// The step launches of a caller that stages a call through small buffers: per piece, the estimate
// from a q buffer holding only its last queries, then the rows in 128-row chunks (last chunk
// first), each from buffers holding only that chunk, with block lists stored two row blocks at a
// time. The same kernels on the same inputs per row block as one launch over the call: the same
// bits.
TEST(SparseCudaTest, StepsMatchOneLaunch) {
  REQUIRE_GPU();
  const int hq = 28, hkv = 4, d = 128;
  const int64_t cl = 384, length = 1500, start = 700, rows_per_step = 128;
  const int32_t slice = 2;
  Case c = MakeCase(hq, hkv, cl, length, TestBudgets(hq), 29);
  Pools pools(c);
  GpuRun one;
  RunGpu(c, pools, start, length - start, &one);
  if (HasFatalFailure()) return;

  const int64_t q_row = kNumQueryVariants * hq * d, out_row = hq * d;
  DevBuf q_buf(rows_per_step * q_row * 2), out_buf(rows_per_step * out_row * sizeof(float));
  const size_t bytes =
      SparsePrefillWorkspaceBound(c.g, c.budgets, length, rows_per_step, c.last_q, slice);
  ASSERT_GT(bytes, 0u);
  DevBuf ws(bytes);
  CUDA_ASSERT(cudaMemset(ws.get(), 0xff, bytes));
  SparsePrefillParams sp;
  sp.prefill.kv = pools.dev;
  sp.prefill.q = q_buf.get<Bf16>();
  sp.prefill.out = out_buf.get();
  sp.prefill.out_dtype = DType::kFp32;
  sp.prefill.softmax_scale = c.softmax_scale;
  sp.budgets = c.budgets;
  sp.last_q = c.last_q;
  sp.row_block_slice = slice;
  sp.workspace = ws.get();
  sp.workspace_bytes = bytes;
  // Only rows [first, first + n) of the call's queries are in the buffer, the rest poisoned.
  const auto stage = [&](int64_t first, int64_t n) {
    CUDA_ASSERT(cudaMemset(q_buf.get(), 0xff, q_buf.bytes()));
    CUDA_ASSERT(cudaMemcpy(q_buf.get(), pools.dq->get<Bf16>() + first * q_row, n * q_row * 2,
                           cudaMemcpyDeviceToDevice));
    sp.prefill.start = first;
    sp.prefill.num_tokens = n;
  };
  std::vector<float> stepped((length - start) * out_row, NAN);
  const std::vector<VsPiece> pieces = SplitIntoPieces(start, length - start, cl);
  ASSERT_GE(pieces.size(), 3u);
  for (const VsPiece& piece : pieces) {
    const int64_t rows = piece.end - piece.begin, n_est = std::min<int64_t>(rows, c.last_q);
    stage(piece.end - n_est, n_est);
    if (HasFatalFailure()) return;
    ASSERT_TRUE(LaunchSparseEstimate(c.g, sp, piece, nullptr).ok());
    const int64_t last = (rows - 1) / rows_per_step * rows_per_step;
    for (int64_t first = last; first >= 0; first -= rows_per_step) {
      const int64_t n = std::min(rows_per_step, rows - first);
      stage(piece.begin + first, n);
      if (HasFatalFailure()) return;
      CUDA_ASSERT(cudaMemset(out_buf.get(), 0xff, out_buf.bytes()));
      const absl::Status st = LaunchSparseAttendRows(c.g, sp, piece, first, n, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      CUDA_ASSERT(cudaMemcpy(stepped.data() + (piece.begin + first - start) * out_row,
                             out_buf.get(), n * out_row * sizeof(float), cudaMemcpyDeviceToHost));
    }
  }
  size_t differ = 0;
  for (size_t i = 0; i < stepped.size(); ++i) {
    differ += std::memcmp(&stepped[i], &one.out[i], sizeof(float)) != 0;
  }
  EXPECT_EQ(differ, 0u) << "of " << stepped.size() << " outputs differ from one launch";
}

TEST(SparseCudaTest, StepLaunchesRefuseRowsThatAreNotWholeBlocks) {
  const Case c = MakeCase(8, 2, 256, 16, TestBudgets(8), 1);
  SparsePrefillParams sp;
  sp.budgets = c.budgets;
  const VsPiece piece{0, 0, 200};
  const std::pair<int64_t, int64_t> bad[] = {{10, 64}, {0, 100}, {192, 9}, {-64, 64}};
  for (const auto& [first, n] : bad) {
    const absl::Status st = LaunchSparseAttendRows(c.g, sp, piece, first, n, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << first << " " << n;
    EXPECT_NE(std::string(st.message()).find("64-row blocks"), std::string::npos) << st;
  }
  // A range that ends the piece may end mid-block; it then fails later, on the null buffers.
  const absl::Status st = LaunchSparseAttendRows(c.g, sp, piece, 192, 8, nullptr);
  EXPECT_EQ(st.message().find("64-row blocks"), absl::string_view::npos) << st;
}

TEST(SparseCudaTest, GoldenSparseVs) {
  REQUIRE_GPU();
  const std::string dir = testing::GoldenCaseDir("sparse_vs");
  ASSERT_TRUE(std::ifstream(dir + "/case.json").good())
      << "no golden case in " << dir << " (//tests/testdata:dca in the test's data)";
  std::ifstream json_file(dir + "/case.json");
  const nlohmann::json j = nlohmann::json::parse(json_file, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  std::stringstream buffer;
  buffer << std::ifstream(dir + "/tensors.bin", std::ios::binary).rdbuf();
  const std::string blob = buffer.str();
  auto get = [&](const std::string& name) {
    const nlohmann::json& e = j.at("tensors").at(name);
    const DType dt = e.at("dtype") == "bf16" ? DType::kBf16 : DType::kFp32;
    std::vector<float> v(e.at("nbytes").get<size_t>() / ElementSize(dt));
    ConvertToFloat(blob.data() + e.at("offset").get<size_t>(), dt, v.size(), v.data());
    return v;
  };
  const nlohmann::json& dca = j.at("dual_chunk_attention_config");
  Case c;
  c.g.num_q_heads = j.at("num_q_heads");
  c.g.num_kv_heads = j.at("num_kv_heads");
  c.g.head_dim = j.at("head_dim");
  c.g.chunk_len = dca.at("chunk_size").get<int64_t>() - dca.at("local_size").get<int64_t>();
  c.g.original_max_position_embeddings = dca.at("original_max_position_embeddings");
  c.g.softmax_scale = j.at("softmax_scale").get<float>();
  c.budgets.resize(c.g.num_q_heads);
  for (const auto& [head, entry] : dca.at("sparse_attention_config").at(0).items()) {
    const int64_t vertical = entry.at(1), slash = entry.at(2);
    c.budgets.at(std::stoi(head)) = VsBudget{vertical == 30 ? 130 : vertical, slash};
  }
  c.last_q = dca.at("sparse_attention_last_q");
  const nlohmann::json& step = j.at("steps").at(0);
  ASSERT_EQ(step.at("op"), "prefill");
  ASSERT_EQ(step.at("start"), 0);
  c.length = step.at("tokens");
  const int64_t prompt = step.at("prompt_len");
  const float s = LengthScale(prompt, c.g.original_max_position_embeddings);
  c.softmax_scale = c.g.softmax_scale * s;
  c.q = get(step.at("q"));
  c.k = get(step.at("k"));
  c.v = get(step.at("v"));
  for (float& x : c.k) x = RoundBf16(x * s);  // cached keys: s(L) * k rounded once to bf16
  const std::vector<float> want = get(step.at("out"));
  Pools pools(c);
  GpuRun run;
  RunGpu(c, pools, 0, c.length, &run);
  if (HasFatalFailure()) return;
  ExpectClose(run.out, want, "golden sparse_vs");
}

}  // namespace
}  // namespace attnd
