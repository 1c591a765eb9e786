// Tests of the CUDA DCA kernels (dca_cuda.h) against an fp64 CPU reference written here (it never
// calls production code): every output element within the bf16 bars of DCA.md, NaN/Inf checked,
// outputs and the KV pool poisoned with NaN before every run. Both the fast kernels and the simple
// reference kernels are checked. Skips loudly where no CUDA device is present.
#include "kernels/cuda/dca_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cuda/testing/gpu_test.h"
#include "kernels/cuda/testing/kernels_under_test.h"
#include "kernels/cuda/testing/reference_cuda.h"
#include "kernels/dca.h"
#include "kernels/paged_kv.h"

namespace attnd {
namespace {

constexpr double kMaxAbsBar = 2e-2;  // DCA.md: bf16 vs fp32/fp64 reference
constexpr double kMeanAbsBar = 2e-3;

#define CUDA_ASSERT(expr) \
  ASSERT_EQ(cudaSuccess, (expr)) << #expr << ": " << cudaGetErrorString(expr)

using gpu_test::DevBuf;

double LengthScaleRef(int64_t len, int64_t orig) {
  if (orig <= 0) return 1.0;
  return std::max(1.0, 0.1 * std::log(static_cast<double>(len) / static_cast<double>(orig)) + 1.0);
}

DcaGeometry Geometry(int hq, int hkv, int d, int64_t cl, int64_t orig) {
  DcaGeometry g;
  g.num_q_heads = hq;
  g.num_kv_heads = hkv;
  g.head_dim = d;
  g.chunk_len = cl;
  g.original_max_position_embeddings = orig;
  g.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  return g;
}

// Random unit-scale values, exactly representable in `dtype`; raw bytes in `raw`, values in `val`.
void RandomTensor(size_t n, DType dtype, std::mt19937* rng, std::vector<uint8_t>* raw,
                  std::vector<double>* val) {
  std::normal_distribution<float> dist(0.f, 1.f);
  raw->resize(n * ElementSize(dtype));
  val->resize(n);
  for (size_t i = 0; i < n; ++i) {
    const float x = dist(*rng);
    if (dtype == DType::kFp32) {
      std::memcpy(raw->data() + 4 * i, &x, 4);
      (*val)[i] = x;
    } else if (dtype == DType::kBf16) {
      const uint16_t h = FloatToBf16(x);
      std::memcpy(raw->data() + 2 * i, &h, 2);
      (*val)[i] = Bf16ToFloat(h);
    } else {
      const uint16_t h = FloatToHalf(x);
      std::memcpy(raw->data() + 2 * i, &h, 2);
      (*val)[i] = HalfToFloat(h);
    }
  }
}

std::vector<float> ToFloat(const std::vector<uint8_t>& raw, DType dtype) {
  std::vector<float> out(raw.size() / ElementSize(dtype));
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == DType::kFp32) {
      std::memcpy(&out[i], raw.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      out[i] = dtype == DType::kBf16 ? Bf16ToFloat(h) : HalfToFloat(h);
    }
  }
  return out;
}

// fp64 DCA for one query at position p, q head h: keys [0, p] with the variant DCA.md assigns
// (intra from floor(p/cl)*cl, succ the chunk before, inter below), one softmax.
//   q: pointers to the head's D values of the intra, succ and inter variants
//   keys/values: [positions, Hkv, D] as cached (keys already length-scaled)
void RefAttend(const DcaGeometry& g, int64_t p, int h, const double* const q[3],
               const std::vector<double>& keys, const std::vector<double>& values,
               double score_scale, double* out) {
  const int d = g.head_dim, hkv = g.num_kv_heads, kvh = h / (g.num_q_heads / hkv);
  const int64_t prev = (p / g.chunk_len) * g.chunk_len;
  std::vector<double> logits(p + 1);
  double mx = -INFINITY;
  for (int64_t j = 0; j <= p; ++j) {
    const int variant = j >= prev ? 0 : (j >= prev - g.chunk_len ? 1 : 2);
    const double* k = &keys[(j * hkv + kvh) * d];
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += q[variant][i] * k[i];
    logits[j] = dot * score_scale;
    mx = std::max(mx, logits[j]);
  }
  double sum = 0;
  for (double& x : logits) sum += (x = std::exp(x - mx));
  for (int i = 0; i < d; ++i) out[i] = 0;
  for (int64_t j = 0; j <= p; ++j) {
    const double* v = &values[(j * hkv + kvh) * d];
    for (int i = 0; i < d; ++i) out[i] += logits[j] / sum * v[i];
  }
}

struct ErrStats {
  double max_abs = 0, sum_abs = 0;
  size_t n = 0, nonfinite = 0;
  void Add(float got, double want) {
    ++n;
    if (!std::isfinite(got)) {
      ++nonfinite;
      return;
    }
    const double e = std::fabs(got - want);
    max_abs = std::max(max_abs, e);
    sum_abs += e;
  }
  double mean() const { return n ? sum_abs / n : 0; }
};

void ExpectWithinBars(const ErrStats& s, const std::string& what) {
  EXPECT_GT(s.n, 0u) << what;
  EXPECT_EQ(s.nonfinite, 0u) << what << ": non-finite outputs (unwritten or NaN)";
  EXPECT_LE(s.max_abs, kMaxAbsBar) << what;
  EXPECT_LE(s.mean(), kMeanAbsBar) << what;
  std::printf("  %-48s n=%zu max_abs=%.3g mean_abs=%.3g\n", what.c_str(), s.n, s.max_abs, s.mean());
}

// A shuffled page table drawn from a pool of num_pages pages.
std::vector<int32_t> ShuffledPages(int64_t num_pages, std::mt19937* rng) {
  std::vector<int32_t> pages(num_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), *rng);
  return pages;
}

// ---- prefill
// -------------------------------------------------------------------------------------

struct PrefillCase {
  std::string name;
  int hq, hkv, d;
  int64_t cl;
  int page_size;
  int64_t orig;
  std::vector<int64_t> chunks;  // token counts of successive prefill calls (chunked prefill)
  DType in_dtype = DType::kBf16;
  DType out_dtype = DType::kFp32;
};

void PrintTo(const PrefillCase& c, std::ostream* os) { *os << c.name; }

class PrefillTest : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(PrefillTest, MatchesFp64Reference) {
  REQUIRE_GPU();
  const PrefillCase& c = GetParam();
  const DcaGeometry g = Geometry(c.hq, c.hkv, c.d, c.cl, c.orig);
  const int64_t prompt = std::accumulate(c.chunks.begin(), c.chunks.end(), int64_t{0});
  const double s = LengthScaleRef(prompt, c.orig);
  std::mt19937 rng(1234 + prompt);

  const int64_t seq_pages = (prompt + c.page_size - 1) / c.page_size;
  const int64_t pool_pages = seq_pages + 7;
  const size_t kv_elems = static_cast<size_t>(pool_pages) * c.page_size * c.hkv * c.d;
  DevBuf k_pool(kv_elems * 2), v_pool(kv_elems * 2);
  k_pool.Poison();
  v_pool.Poison();
  std::vector<int32_t> table = ShuffledPages(pool_pages, &rng);
  table.resize(seq_pages);
  DevBuf d_table(table.size() * 4);
  d_table.Upload(table.data());
  PagedKv<Bf16> kv;
  kv.k = k_pool.get<Bf16>();
  kv.v = v_pool.get<Bf16>();
  kv.page_table = d_table.get<int32_t>();
  kv.page_size = c.page_size;
  kv.num_kv_heads = c.hkv;
  kv.head_dim = c.d;

  std::vector<double> keys, values;  // as cached, fp64
  int64_t start = 0;
  for (const int64_t t : c.chunks) {
    std::vector<uint8_t> q_raw, k_raw, v_raw;
    std::vector<double> q_val, k_val, v_val;
    RandomTensor(t * kNumQueryVariants * c.hq * c.d, DType::kBf16, &rng, &q_raw, &q_val);
    RandomTensor(t * c.hkv * c.d, c.in_dtype, &rng, &k_raw, &k_val);
    RandomTensor(t * c.hkv * c.d, c.in_dtype, &rng, &v_raw, &v_val);
    for (double x : k_val) keys.push_back(s * x);
    values.insert(values.end(), v_val.begin(), v_val.end());

    DevBuf dq(q_raw.size()), dk(k_raw.size()), dv(v_raw.size());
    dq.Upload(q_raw.data());
    dk.Upload(k_raw.data());
    dv.Upload(v_raw.data());
    CudaAppendParams ap;
    ap.kv = kv;
    ap.k = dk.get();
    ap.v = dv.get();
    ap.in_dtype = c.in_dtype;
    ap.start = start;
    ap.num_tokens = t;
    ap.key_scale = static_cast<float>(s);
    ASSERT_TRUE(LaunchAppendKv(ap, nullptr).ok());

    const size_t out_bytes = t * c.hq * c.d * ElementSize(c.out_dtype);
    CudaPrefillParams pp;
    pp.kv = kv;
    pp.q = dq.get<Bf16>();
    pp.out_dtype = c.out_dtype;
    pp.start = start;
    pp.num_tokens = t;
    pp.softmax_scale = static_cast<float>(g.softmax_scale * s);
    // The simple kernel and every fast kernel under test, each into its own poisoned output.
    std::vector<std::vector<float>> got;
    std::vector<std::string> label;
    const std::vector<gpu_test::PrefillKernelUnderTest> fast = gpu_test::PrefillKernelsUnderTest();
    for (int k = -1; k < static_cast<int>(fast.size()); ++k) {
      DevBuf out(out_bytes);
      out.Poison();
      pp.out = out.get();
      absl::Status st =
          k < 0 ? LaunchDcaPrefillReference(g, pp, nullptr) : fast[k].launch(g, pp, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      CUDA_ASSERT(cudaDeviceSynchronize());
      CUDA_ASSERT(cudaGetLastError());
      std::vector<uint8_t> raw(out_bytes);
      CUDA_ASSERT(cudaMemcpy(raw.data(), out.get(), out_bytes, cudaMemcpyDeviceToHost));
      got.push_back(ToFloat(raw, c.out_dtype));
      label.push_back(k < 0 ? std::string("simple") : fast[k].label);
    }
    std::vector<ErrStats> err(got.size());
    std::vector<double> want(c.d);
    for (int64_t i = 0; i < t; ++i) {
      for (int h = 0; h < c.hq; ++h) {
        const double* q[3];
        for (int v = 0; v < 3; ++v) q[v] = &q_val[((i * kNumQueryVariants + v) * c.hq + h) * c.d];
        RefAttend(g, start + i, h, q, keys, values, g.softmax_scale * s, want.data());
        for (int x = 0; x < c.d; ++x) {
          for (size_t r = 0; r < got.size(); ++r) {
            err[r].Add(got[r][(i * c.hq + h) * c.d + x], want[x]);
          }
        }
      }
    }
    const std::string where = "[" + std::to_string(start) + "," + std::to_string(start + t) + ")";
    for (size_t r = 0; r < got.size(); ++r)
      ExpectWithinBars(err[r], c.name + " " + label[r] + " " + where);
    // Each fast kernel against the simple reference kernel too (same bars).
    for (size_t r = 1; r < got.size(); ++r) {
      ErrStats vs_simple;
      for (size_t i = 0; i < got[r].size(); ++i) vs_simple.Add(got[r][i], got[0][i]);
      ExpectWithinBars(vs_simple, c.name + " " + label[r] + " vs simple " + where);
    }
    start += t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillTest,
    ::testing::Values(
        PrefillCase{"one_token_7b", 28, 4, 128, 128, 16, 0, {1}},
        PrefillCase{"two_tokens_7b", 28, 4, 128, 128, 16, 0, {2}},
        PrefillCase{"7b_3p5_chunks", 28, 4, 128, 128, 16, 0, {450}},
        PrefillCase{"7b_exact_3_chunks_page_edge", 28, 4, 128, 128, 16, 0, {384}},
        PrefillCase{"7b_chunked_odd", 28, 4, 128, 128, 16, 0, {100, 1, 155, 200}},
        PrefillCase{"7b_scaled_fp32_in", 28, 4, 128, 128, 16, 200, {520}, DType::kFp32},
        PrefillCase{"7b_scaled_chunked_bf16_out",
                    28,
                    4,
                    128,
                    128,
                    32,
                    150,
                    {129, 127, 257},
                    DType::kBf16,
                    DType::kBf16},
        PrefillCase{"gqa1_d64", 8, 8, 64, 256, 16, 0, {256, 544}},
        PrefillCase{
            "gqa1_d64_scaled_fp16", 4, 4, 64, 128, 64, 100, {64, 448}, DType::kFp16, DType::kFp16},
        PrefillCase{"14b_geometry", 40, 8, 128, 256, 16, 500, {333, 667}},
        PrefillCase{"gqa16_d128", 32, 2, 128, 128, 16, 0, {300}},
        // Several 128-key tiles per DCA range, ranges and chunks not multiples of the tile or the
        // page, > 3 chunks, chunked prefill starting mid-chunk (wgmma tiles are 128 x 128).
        PrefillCase{"gqa7_d128_long_3p75_chunks", 7, 1, 128, 400, 16, 0, {1500}},
        PrefillCase{"gqa7_d128_chunked_mid_chunk",
                    14,
                    2,
                    128,
                    300,
                    16,
                    500,
                    {517, 1, 700},
                    DType::kBf16,
                    DType::kBf16},
        PrefillCase{"gqa7_d64_scaled", 14, 2, 64, 320, 16, 600, {700, 333}},
        PrefillCase{"gqa1_d128_long", 2, 2, 128, 384, 16, 0, {1200}},
        // Page sizes off the async loader's fast path (power of two >= its 16 or 8 rows per
        // thread): 8 (generic at head_dim 128, fast at 64) and 12 (not a power of two).
        PrefillCase{"gqa7_d128_page8", 14, 2, 128, 300, 8, 0, {650}},
        PrefillCase{"gqa7_d64_page8_chunked", 14, 2, 64, 300, 8, 0, {333, 400}},
        PrefillCase{"gqa4_d128_page12_chunked", 8, 2, 128, 256, 12, 0, {301, 450}}),
    [](const ::testing::TestParamInfo<PrefillCase>& info) { return info.param.name; });

// ---- prefill in key-tile windows
// ----------------------------------------------------------------

// One call run whole and as windows of key tiles (CudaPrefillParams::key_tile_begin/end) must give
// the same bytes: each window resumes the blocks' saved softmax state. The whole launch is checked
// against the simple reference kernel first (so two equally wrong outputs cannot pass).
struct WindowCase {
  std::string name;
  int hq, hkv, d;
  int64_t cl;
  int64_t start, num_tokens;
  DType out_dtype;
};

void PrintTo(const WindowCase& c, std::ostream* os) { *os << c.name; }

class PrefillWindowTest : public ::testing::TestWithParam<WindowCase> {};

std::vector<uint8_t> Download(const DevBuf& b) {
  std::vector<uint8_t> out(b.bytes());
  cudaMemcpy(out.data(), b.get(), b.bytes(), cudaMemcpyDeviceToHost);
  return out;
}

TEST_P(PrefillWindowTest, WindowsMatchTheWholeLaunchBitForBit) {
  REQUIRE_GPU();
  const WindowCase& c = GetParam();
  const DcaGeometry g = Geometry(c.hq, c.hkv, c.d, c.cl, 0);
  const int page_size = 16;
  const int64_t keys = c.start + c.num_tokens;
  const int64_t seq_pages = (keys + page_size - 1) / page_size;
  std::mt19937 rng(4321 + keys);
  std::vector<uint8_t> raw;
  std::vector<double> val;
  const size_t kv_elems = static_cast<size_t>(seq_pages) * page_size * c.hkv * c.d;
  DevBuf k_pool(kv_elems * 2), v_pool(kv_elems * 2), d_table(seq_pages * 4);
  RandomTensor(kv_elems, DType::kBf16, &rng, &raw, &val);
  k_pool.Upload(raw.data());
  RandomTensor(kv_elems, DType::kBf16, &rng, &raw, &val);
  v_pool.Upload(raw.data());
  const std::vector<int32_t> table = ShuffledPages(seq_pages, &rng);
  d_table.Upload(table.data());
  DevBuf dq(static_cast<size_t>(c.num_tokens) * kNumQueryVariants * c.hq * c.d * 2);
  RandomTensor(dq.bytes() / 2, DType::kBf16, &rng, &raw, &val);
  dq.Upload(raw.data());

  CudaPrefillParams pp;
  pp.kv.k = k_pool.get<Bf16>();
  pp.kv.v = v_pool.get<Bf16>();
  pp.kv.page_table = d_table.get<int32_t>();
  pp.kv.page_size = page_size;
  pp.kv.num_kv_heads = c.hkv;
  pp.kv.head_dim = c.d;
  pp.q = dq.get<Bf16>();
  pp.out_dtype = c.out_dtype;
  pp.start = c.start;
  pp.num_tokens = c.num_tokens;
  pp.softmax_scale = g.softmax_scale;
  const size_t out_bytes =
      static_cast<size_t>(c.num_tokens) * c.hq * c.d * ElementSize(c.out_dtype);

  DevBuf simple(out_bytes);
  simple.Poison();
  pp.out = simple.get();
  ASSERT_TRUE(LaunchDcaPrefillReference(g, pp, nullptr).ok());
  CUDA_ASSERT(cudaDeviceSynchronize());
  const std::vector<float> want = ToFloat(Download(simple), c.out_dtype);

  for (const PrefillKernel kernel : {PrefillKernel::kWgmma, PrefillKernel::kMmaSync}) {
    CudaKernelPlanOptions options;
    options.prefill = kernel;
    absl::StatusOr<CudaKernelPlan> plan = CudaKernelPlan::Create(g, 0, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    if (plan->prefill_kernel() != kernel) continue;  // wgmma needs compute capability 9.0
    const std::string label = c.name + " " + PrefillKernelName(kernel);
    ASSERT_TRUE(PrefillTakesWindows(*plan)) << label;

    DevBuf whole(out_bytes);
    whole.Poison();
    pp.out = whole.get();
    pp.key_tile_begin = pp.key_tile_end = 0;
    absl::Status st = LaunchDcaPrefill(*plan, pp, nullptr);
    ASSERT_TRUE(st.ok()) << label << ": " << st;
    CUDA_ASSERT(cudaDeviceSynchronize());
    const std::vector<uint8_t> whole_bytes = Download(whole);
    {
      const std::vector<float> got = ToFloat(whole_bytes, c.out_dtype);
      ErrStats e;
      for (size_t i = 0; i < got.size(); ++i) e.Add(got[i], want[i]);
      ExpectWithinBars(e, label + " whole vs simple");
    }

    const int64_t total = PrefillKeyTiles(*plan, g, c.start, c.num_tokens);
    ASSERT_GE(total, 1) << label;
    const size_t state_bytes = PrefillWindowStateBytes(*plan, g, c.num_tokens);
    ASSERT_GT(state_bytes, 0u) << label;
    DevBuf state(state_bytes);
    for (const int64_t w : {int64_t{1}, int64_t{3}, int64_t{7}, total}) {
      const std::string what =
          label + " windows of " + std::to_string(w) + " of " + std::to_string(total) + " tiles";
      DevBuf out(out_bytes);
      out.Poison();
      state.Poison();
      pp.out = out.get();
      pp.window_state = state.get();
      pp.window_state_bytes = state_bytes;
      int launches = 0;
      for (int64_t b = 0; b < total; b += w) {
        if (w == 1 && b == total - 1) {
          // Every tile but the last: some block must still be unfinished (PrefillKeyTiles is
          // the real maximum, not more).
          CUDA_ASSERT(cudaDeviceSynchronize());
          EXPECT_NE(Download(out), whole_bytes) << what << ": finished before the last tile";
        }
        pp.key_tile_begin = static_cast<int32_t>(b);
        // The last window of 7 says "to the end" (0).
        pp.key_tile_end = w == 7 && b + w >= total ? 0 : static_cast<int32_t>(b + w);
        st = LaunchDcaPrefill(*plan, pp, nullptr);
        ASSERT_TRUE(st.ok()) << what << " at " << b << ": " << st;
        ++launches;
      }
      CUDA_ASSERT(cudaDeviceSynchronize());
      CUDA_ASSERT(cudaGetLastError());
      EXPECT_EQ(launches, (total + w - 1) / w);
      const std::vector<uint8_t> got = Download(out);
      ASSERT_EQ(got.size(), whole_bytes.size());
      size_t differ = 0;
      for (size_t i = 0; i < got.size(); ++i) differ += got[i] != whole_bytes[i];
      EXPECT_EQ(differ, 0u) << what << ": bytes differ from the whole launch";
      std::printf("  %-60s %d launches, %s\n", what.c_str(), launches,
                  differ == 0 ? "identical" : "DIFFERENT");
    }
    pp.window_state = nullptr;
    pp.window_state_bytes = 0;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillWindowTest,
    ::testing::Values(WindowCase{"one_piece_short_7b_bf16", 28, 4, 128, 1024, 0, 100, DType::kBf16},
                      WindowCase{"four_chunks_gqa7_d128", 14, 2, 128, 128, 0, 480, DType::kFp32},
                      WindowCase{"start_2900_long_7b", 28, 4, 128, 256, 2900, 300, DType::kFp32},
                      WindowCase{"gqa1_d64_bf16", 8, 8, 64, 128, 200, 400, DType::kBf16},
                      WindowCase{"gqa7_d64_start_1000", 14, 2, 64, 320, 1000, 333, DType::kFp32}),
    [](const ::testing::TestParamInfo<WindowCase>& info) { return info.param.name; });

// Bad windows and missing state are refused with INVALID_ARGUMENT and leave the output alone; a
// window from 0 that covers every tile is the whole launch and needs no state.
TEST(PrefillWindow, RefusesBadWindowsAndMissingState) {
  REQUIRE_GPU();
  const DcaGeometry g = Geometry(14, 2, 128, 128, 0);
  const int64_t start = 100, n = 200, keys = start + n;
  DevBuf k_pool(keys * 2 * 128 * 2), v_pool(keys * 2 * 128 * 2), table(keys * 4);
  std::vector<int32_t> ids(keys);
  std::iota(ids.begin(), ids.end(), 0);
  table.Upload(ids.data());
  cudaMemset(k_pool.get(), 0, k_pool.bytes());
  cudaMemset(v_pool.get(), 0, v_pool.bytes());
  DevBuf dq(n * kNumQueryVariants * 14 * 128 * 2), out(n * 14 * 128 * 4);
  cudaMemset(dq.get(), 0, dq.bytes());
  CudaPrefillParams pp;
  pp.kv.k = k_pool.get<Bf16>();
  pp.kv.v = v_pool.get<Bf16>();
  pp.kv.page_table = table.get<int32_t>();
  pp.kv.page_size = 1;
  pp.kv.num_kv_heads = 2;
  pp.kv.head_dim = 128;
  pp.q = dq.get<Bf16>();
  pp.out = out.get();
  pp.start = start;
  pp.num_tokens = n;
  pp.softmax_scale = g.softmax_scale;
  for (const PrefillKernel kernel : {PrefillKernel::kWgmma, PrefillKernel::kMmaSync}) {
    CudaKernelPlanOptions options;
    options.prefill = kernel;
    absl::StatusOr<CudaKernelPlan> plan = CudaKernelPlan::Create(g, 0, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const int64_t total = PrefillKeyTiles(*plan, g, start, n);
    ASSERT_GE(total, 3);
    const size_t need = PrefillWindowStateBytes(*plan, g, n);
    DevBuf state(need);
    struct Bad {
      int32_t begin, end;
      bool with_state;
      size_t state_bytes;
      const char* message;
    };
    const std::vector<Bad> bad = {
        {-1, 0, true, need, "key tile window [-1, 0) invalid"},
        {0, -2, true, need, "key tile window [0, -2) invalid"},
        {2, 2, true, need, "expected 0 <= key_tile_begin < key_tile_end"},
        {3, 1, true, need, "key tile window [3, 1) invalid"},
        {1, 0, false, need, "needs window_state"},
        {0, 1, false, 0, "needs window_state"},
        {1, 2, true, 16, "got a pointer of 16 bytes"},
    };
    for (const Bad& b : bad) {
      out.Poison();
      pp.key_tile_begin = b.begin;
      pp.key_tile_end = b.end;
      pp.window_state = b.with_state ? state.get() : nullptr;
      pp.window_state_bytes = b.state_bytes;
      const absl::Status st = LaunchDcaPrefill(*plan, pp, nullptr);
      const std::string what = std::string(PrefillKernelName(kernel)) + " [" +
                               std::to_string(b.begin) + ", " + std::to_string(b.end) + ")";
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << what << ": " << st;
      EXPECT_NE(std::string(st.message()).find(b.message), std::string::npos) << what << ": " << st;
      CUDA_ASSERT(cudaDeviceSynchronize());
      const std::vector<uint8_t> bytes = Download(out);
      EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](uint8_t x) { return x == 0xff; }))
          << what << ": a refused launch wrote the output";
    }
    // The whole call as a window: no state needed; the output is written.
    for (const int32_t end : {static_cast<int32_t>(total), static_cast<int32_t>(total + 5)}) {
      out.Poison();
      pp.key_tile_begin = 0;
      pp.key_tile_end = end;
      pp.window_state = nullptr;
      pp.window_state_bytes = 0;
      const absl::Status st = LaunchDcaPrefill(*plan, pp, nullptr);
      EXPECT_TRUE(st.ok()) << PrefillKernelName(kernel) << " [0, " << end << "): " << st;
      CUDA_ASSERT(cudaDeviceSynchronize());
      const std::vector<float> got = ToFloat(Download(out), DType::kFp32);
      EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return std::isfinite(x); }))
          << PrefillKernelName(kernel) << " [0, " << end << "): output not written";
    }
  }
}

// ---- decode
// --------------------------------------------------------------------------------------

struct DecodeCase {
  std::string name;
  int hq, hkv, d;
  int64_t cl;
  int page_size;
  int64_t orig;
  int batch;
  int64_t max_len;
  DType in_dtype = DType::kBf16;
  DType out_dtype = DType::kFp32;
  int padding_every = 0;  // > 0: every padding_every-th row is a length-0 padding row
};

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

// Mixed lengths: the interesting ones first (1, page and chunk edges), then random.
std::vector<int32_t> MixedLengths(const DecodeCase& c, std::mt19937* rng) {
  const std::vector<int64_t> edges = {
      1,         2,        c.page_size,  c.page_size + 1, c.cl,
      c.cl + 1,  2 * c.cl, 2 * c.cl + 1, 3 * c.cl,        3 * c.cl + 1,
      c.max_len, c.cl - 1};
  std::vector<int32_t> out;
  std::uniform_int_distribution<int64_t> dist(1, c.max_len);
  for (int b = 0; b < c.batch; ++b) {
    const int64_t len = b < static_cast<int>(edges.size()) ? edges[b] : dist(*rng);
    out.push_back(static_cast<int32_t>(std::min(len, c.max_len)));
  }
  if (c.batch == 1) out[0] = static_cast<int32_t>(c.max_len);
  if (c.padding_every > 0) {
    for (int b = c.padding_every - 1; b < c.batch; b += c.padding_every) out[b] = 0;
  }
  return out;
}

class DecodeTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeTest, MatchesFp64Reference) {
  REQUIRE_GPU();
  const DecodeCase& c = GetParam();
  const DcaGeometry g = Geometry(c.hq, c.hkv, c.d, c.cl, c.orig);
  std::mt19937 rng(99 + c.batch);
  const std::vector<int32_t> lengths = MixedLengths(c, &rng);
  const int64_t stride = (c.max_len + c.page_size - 1) / c.page_size;
  int64_t total_pages = 0;
  for (int32_t len : lengths) total_pages += (len + c.page_size - 1) / c.page_size;
  const int64_t pool_pages = total_pages + 3;
  const size_t kv_elems = static_cast<size_t>(pool_pages) * c.page_size * c.hkv * c.d;
  DevBuf k_pool(kv_elems * 2), v_pool(kv_elems * 2);
  k_pool.Poison();
  v_pool.Poison();
  const std::vector<int32_t> perm = ShuffledPages(pool_pages, &rng);
  std::vector<int32_t> tables(c.batch * stride, -1);
  int64_t next = 0;
  for (int b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < (lengths[b] + c.page_size - 1) / c.page_size; ++i) {
      tables[b * stride + i] = perm[next++];
    }
  }
  DevBuf d_tables(tables.size() * 4), d_lengths(lengths.size() * 4);
  d_tables.Upload(tables.data());
  d_lengths.Upload(lengths.data());
  PagedKvBatch kvb;
  kvb.k = k_pool.get<Bf16>();
  kvb.v = v_pool.get<Bf16>();
  kvb.page_tables = d_tables.get<int32_t>();
  kvb.page_table_stride = stride;
  kvb.page_size = c.page_size;
  kvb.num_kv_heads = c.hkv;
  kvb.head_dim = c.d;

  // History: positions [0, L-1) appended as one prefill with prompt L-1; fp64 copies kept.
  const size_t tok = static_cast<size_t>(c.hkv) * c.d;
  std::vector<std::vector<double>> keys(c.batch), values(c.batch);
  for (int b = 0; b < c.batch; ++b) {
    const int64_t hist = lengths[b] - 1;
    if (hist <= 0) continue;  // length 1 (no history) or a padding row
    const double s = LengthScaleRef(hist, c.orig);
    std::vector<uint8_t> k_raw, v_raw;
    std::vector<double> k_val, v_val;
    RandomTensor(hist * tok, c.in_dtype, &rng, &k_raw, &k_val);
    RandomTensor(hist * tok, c.in_dtype, &rng, &v_raw, &v_val);
    for (double x : k_val) keys[b].push_back(s * x);
    values[b] = v_val;
    DevBuf dk(k_raw.size()), dv(v_raw.size());
    dk.Upload(k_raw.data());
    dv.Upload(v_raw.data());
    CudaAppendParams ap;
    ap.kv = kvb.Seq(b);
    ap.k = dk.get();
    ap.v = dv.get();
    ap.in_dtype = c.in_dtype;
    ap.start = 0;
    ap.num_tokens = hist;
    ap.key_scale = static_cast<float>(s);
    ASSERT_TRUE(LaunchAppendKv(ap, nullptr).ok());
    CUDA_ASSERT(cudaDeviceSynchronize());
  }
  // The new token of every sequence, appended by the decode append kernel (key scaled by s(L)).
  std::vector<uint8_t> k_raw, v_raw, q_raw;
  std::vector<double> k_val, v_val, q_val;
  RandomTensor(c.batch * tok, c.in_dtype, &rng, &k_raw, &k_val);
  RandomTensor(c.batch * tok, c.in_dtype, &rng, &v_raw, &v_val);
  RandomTensor(static_cast<size_t>(c.batch) * kNumDecodeVariants * c.hq * c.d, DType::kBf16, &rng,
               &q_raw, &q_val);
  for (int b = 0; b < c.batch; ++b) {
    if (lengths[b] == 0) continue;  // padding: the append kernel skips it
    const double s = LengthScaleRef(lengths[b], c.orig);
    for (size_t i = 0; i < tok; ++i) {
      keys[b].push_back(s * k_val[b * tok + i]);
      values[b].push_back(v_val[b * tok + i]);
    }
  }
  DevBuf dk(k_raw.size()), dv(v_raw.size()), dq(q_raw.size());
  dk.Upload(k_raw.data());
  dv.Upload(v_raw.data());
  dq.Upload(q_raw.data());
  CudaDecodeAppendParams dap;
  dap.kv = kvb;
  dap.lengths = d_lengths.get<int32_t>();
  dap.k = dk.get();
  dap.v = dv.get();
  dap.in_dtype = c.in_dtype;
  dap.batch = c.batch;
  dap.original_max_position_embeddings = c.orig;
  ASSERT_TRUE(LaunchDecodeAppendKv(dap, nullptr).ok());

  // fp64 reference outputs.
  std::vector<double> want(static_cast<size_t>(c.batch) * c.hq * c.d, 0.0);  // padding rows: 0
  for (int b = 0; b < c.batch; ++b) {
    if (lengths[b] == 0) continue;
    const double s = LengthScaleRef(lengths[b], c.orig);
    for (int h = 0; h < c.hq; ++h) {
      const double* q[3];
      for (int v = 0; v < 3; ++v) q[v] = &q_val[((b * kNumDecodeVariants + v) * c.hq + h) * c.d];
      RefAttend(g, lengths[b] - 1, h, q, keys[b], values[b], g.softmax_scale * s,
                &want[(b * c.hq + h) * c.d]);
    }
  }

  const size_t out_bytes = static_cast<size_t>(c.batch) * c.hq * c.d * ElementSize(c.out_dtype);
  // The simple reference kernel first: checked against fp64, then every fast variant against it.
  // (It leaves length-0 rows undefined; the fast kernels must write zeros there.)
  const bool any_rows =
      std::any_of(lengths.begin(), lengths.end(), [](int32_t l) { return l > 0; });
  std::vector<float> simple;
  {
    DevBuf out(out_bytes);
    out.Poison();
    CudaDecodeParams dp;
    dp.kv = kvb;
    dp.lengths = d_lengths.get<int32_t>();
    dp.q = dq.get<Bf16>();
    dp.out = out.get();
    dp.out_dtype = c.out_dtype;
    dp.batch = c.batch;
    absl::Status st = LaunchDcaDecodeReference(g, dp, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_ASSERT(cudaDeviceSynchronize());
    std::vector<uint8_t> raw(out_bytes);
    CUDA_ASSERT(cudaMemcpy(raw.data(), out.get(), out_bytes, cudaMemcpyDeviceToHost));
    simple = ToFloat(raw, c.out_dtype);
    ErrStats e;
    for (size_t i = 0; i < want.size(); ++i) {
      if (lengths[i / (static_cast<size_t>(c.hq) * c.d)] > 0) e.Add(simple[i], want[i]);
    }
    if (any_rows) ExpectWithinBars(e, c.name + " simple");
  }
  // Every fast variant at its planned split count and at 1, 7 and 64 splits (most empty at 64),
  // into a NaN-poisoned output and workspace.
  for (const gpu_test::DecodeKernelUnderTest& kernel : gpu_test::DecodeKernelsUnderTest())
    for (const int32_t splits : {kernel.plan_splits(g, c.batch, c.max_len), 1, 7, 64}) {
      ASSERT_GE(splits, 1) << kernel.label << ": no split plan";
      const std::string what =
          c.name + " " + kernel.label + " max_splits=" + std::to_string(splits);
      DevBuf out(out_bytes);
      out.Poison();
      const size_t slots = static_cast<size_t>(c.batch) * c.hq * splits;
      DevBuf ws((slots * c.d + slots) * 4);
      ws.Poison();
      CudaDecodeParams dp;
      dp.kv = kvb;
      dp.lengths = d_lengths.get<int32_t>();
      dp.q = dq.get<Bf16>();
      dp.out = out.get();
      dp.out_dtype = c.out_dtype;
      dp.batch = c.batch;
      dp.max_splits = splits;
      dp.partial_out = ws.get<float>();
      dp.partial_lse = ws.get<float>() + static_cast<size_t>(c.batch) * c.hq * splits * c.d;
      absl::Status st = kernel.launch(g, dp, nullptr);
      ASSERT_TRUE(st.ok()) << what << ": " << st;
      CUDA_ASSERT(cudaDeviceSynchronize());
      CUDA_ASSERT(cudaGetLastError());
      std::vector<uint8_t> raw(out_bytes);
      CUDA_ASSERT(cudaMemcpy(raw.data(), out.get(), out_bytes, cudaMemcpyDeviceToHost));
      const std::vector<float> got = ToFloat(raw, c.out_dtype);
      ErrStats e, vs_simple;
      size_t padding_nonzero = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        if (lengths[i / (static_cast<size_t>(c.hq) * c.d)] == 0) {
          padding_nonzero += got[i] != 0.f;  // padding rows: exactly 0 (NaN poison counts too)
          continue;
        }
        e.Add(got[i], want[i]);
        vs_simple.Add(got[i], simple[i]);
      }
      EXPECT_EQ(padding_nonzero, 0u) << what << ": length-0 rows must be zeros";
      if (any_rows) {
        ExpectWithinBars(e, what);
        ExpectWithinBars(vs_simple, what + " vs simple");
      }
      // Per-row destinations (row_outs): every other row to its own buffer at an offset of one
      // element (aligned only to its dtype), the rest to `out`; each must hold exactly what `out`
      // held for that row.
      const size_t row_n = static_cast<size_t>(c.hq) * c.d, esize = ElementSize(c.out_dtype);
      DevBuf dests(static_cast<size_t>(c.batch) * (row_n + 1) * esize);
      dests.Poison();
      std::vector<DecodeRowOut> outs(c.batch);
      for (int b = 0; b < c.batch; b += 2) {
        outs[b].out = dests.get<char>() + (static_cast<size_t>(b) * (row_n + 1) + 1) * esize;
        outs[b].dtype = static_cast<int32_t>(c.out_dtype);
      }
      DevBuf d_outs(outs.size() * sizeof(DecodeRowOut));
      d_outs.Upload(outs.data());
      ws.Poison();
      dp.row_outs = d_outs.get<DecodeRowOut>();
      st = kernel.launch(g, dp, nullptr);
      ASSERT_TRUE(st.ok()) << what << " row_outs: " << st;
      CUDA_ASSERT(cudaDeviceSynchronize());
      std::vector<uint8_t> dest_raw(dests.bytes()), raw2(out_bytes);
      CUDA_ASSERT(
          cudaMemcpy(dest_raw.data(), dests.get(), dest_raw.size(), cudaMemcpyDeviceToHost));
      CUDA_ASSERT(cudaMemcpy(raw2.data(), out.get(), out_bytes, cudaMemcpyDeviceToHost));
      size_t mismatches = 0;
      for (int b = 0; b < c.batch; ++b) {
        const uint8_t* at = b % 2 == 0 ? dest_raw.data() + (b * (row_n + 1) + 1) * esize
                                       : raw2.data() + b * row_n * esize;
        mismatches += std::memcmp(at, raw.data() + b * row_n * esize, row_n * esize) != 0;
      }
      EXPECT_EQ(mismatches, 0u) << what << ": rows whose row_outs destination differs from out";
    }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeTest,
    ::testing::Values(DecodeCase{"b1_7b_long", 28, 4, 128, 128, 16, 0, 1, 600},
                      DecodeCase{"b1_len1", 28, 4, 128, 128, 16, 0, 1, 1},
                      DecodeCase{"b12_7b_edges", 28, 4, 128, 128, 16, 0, 12, 520},
                      DecodeCase{"b64_7b_scaled_fp32", 28, 4, 128, 128, 16, 200, 64, 700,
                                 DType::kFp32},
                      DecodeCase{"b256_7b_mixed", 28, 4, 128, 128, 16, 0, 256, 560},
                      DecodeCase{"b37_gqa1_d64_scaled", 8, 8, 64, 128, 32, 150, 37, 600,
                                 DType::kFp16, DType::kBf16},
                      DecodeCase{"b20_14b", 40, 8, 128, 256, 16, 300, 20, 900},
                      DecodeCase{"b9_gqa16", 32, 2, 128, 128, 64, 0, 9, 500},
                      // > 3 chunks, ~80 key tiles in one split (the rings wrap many times).
                      DecodeCase{"b3_7b_5k", 28, 4, 128, 1024, 16, 0, 3, 5000},
                      DecodeCase{"b40_7b_padding", 28, 4, 128, 128, 16, 0, 40, 520, DType::kBf16,
                                 DType::kBf16, 3},
                      DecodeCase{"b33_gqa7_d64_padding", 14, 2, 64, 96, 16, 0, 33, 400,
                                 DType::kBf16, DType::kFp32, 4},
                      DecodeCase{"b8_all_padding", 28, 4, 128, 128, 16, 0, 8, 300, DType::kBf16,
                                 DType::kFp32, 1}),
    [](const ::testing::TestParamInfo<DecodeCase>& info) { return info.param.name; });

// The decode stage kernel (inputs read from pinned host memory) against independent references:
// page tables and lengths byte for byte, q against the host's own bf16 rounding, and the appended
// K/V against LaunchDecodeAppendKv (device inputs, checked against fp64 by DecodeTest) on a second
// pool, compared whole, so a stray write anywhere fails. Rows mix input dtypes, one is padding,
// and one has a 70000-page table, which takes the kernel more than one pass over its pieces.
struct StageRow {
  int32_t pages;  // 0: a padding row
  DType q, k, v;
};

// Stages `rows` (tables of `stride` ids, a multiple of 4) into a pool of pool_pages pages and
// checks the result: each non-padding row's new token goes to its own page (pool_pages and 31
// coprime, pool_pages >= the rows).
void CheckDecodeStage(const std::vector<StageRow>& rows, int64_t stride, int pool_pages) {
  const int hq = 28, hkv = 4, d = 128, ps = 16;
  const int64_t orig = 4096;
  const int batch = static_cast<int>(rows.size());
  std::mt19937 rng(77);
  std::uniform_int_distribution<int32_t> page_id(0, pool_pages - 1);
  const size_t q_n = 3 * hq * d, kv_n = hkv * d, q_slot = q_n * 4, kv_slot = kv_n * 4;

  DecodeStageRow* h_rows = nullptr;
  int32_t* h_tables = nullptr;
  char *h_q = nullptr, *h_k = nullptr, *h_v = nullptr;
  CUDA_ASSERT(cudaMallocHost(reinterpret_cast<void**>(&h_rows), batch * sizeof(DecodeStageRow)));
  CUDA_ASSERT(cudaMallocHost(reinterpret_cast<void**>(&h_tables), batch * stride * 4));
  CUDA_ASSERT(cudaMallocHost(reinterpret_cast<void**>(&h_q), batch * q_slot));
  CUDA_ASSERT(cudaMallocHost(reinterpret_cast<void**>(&h_k), batch * kv_slot));
  CUDA_ASSERT(cudaMallocHost(reinterpret_cast<void**>(&h_v), batch * kv_slot));
  std::vector<std::vector<double>> q_val(batch), k_val(batch), v_val(batch);
  std::vector<int32_t> lengths(batch, 0);
  for (int r = 0; r < batch; ++r) {
    const StageRow& row = rows[r];
    lengths[r] = row.pages == 0 ? 0 : (row.pages - 1) * ps + 5;  // the new token in the last page
    h_rows[r] = DecodeStageRow{lengths[r], row.pages, static_cast<int32_t>(row.q),
                               static_cast<int32_t>(row.k), static_cast<int32_t>(row.v)};
    for (int64_t i = 0; i < stride; ++i) h_tables[r * stride + i] = page_id(rng);
    h_tables[r * stride + std::max(0, row.pages - 1)] = (11 + 31 * r) % pool_pages;  // distinct
    std::vector<uint8_t> raw;
    RandomTensor(q_n, row.q, &rng, &raw, &q_val[r]);
    std::memcpy(h_q + r * q_slot, raw.data(), raw.size());
    RandomTensor(kv_n, row.k, &rng, &raw, &k_val[r]);
    std::memcpy(h_k + r * kv_slot, raw.data(), raw.size());
    RandomTensor(kv_n, row.v, &rng, &raw, &v_val[r]);
    std::memcpy(h_v + r * kv_slot, raw.data(), raw.size());
  }

  const size_t pool_elems = static_cast<size_t>(pool_pages) * ps * hkv * d;
  DevBuf k_pool(pool_elems * 2), v_pool(pool_elems * 2), k_ref(pool_elems * 2),
      v_ref(pool_elems * 2), d_tables(batch * stride * 4), d_len(batch * 4), d_q(batch * q_n * 2);
  for (const DevBuf* b : {&k_pool, &v_pool, &k_ref, &v_ref, &d_tables, &d_len, &d_q}) b->Poison();
  PagedKvBatch kvb;
  kvb.k = k_pool.get<Bf16>();
  kvb.v = v_pool.get<Bf16>();
  kvb.page_tables = d_tables.get<int32_t>();
  kvb.page_table_stride = stride;
  kvb.page_size = ps;
  kvb.num_kv_heads = hkv;
  kvb.head_dim = d;
  CudaDecodeStageParams sp;
  sp.kv = kvb;
  sp.rows = h_rows;
  sp.host_tables = h_tables;
  sp.host_q = h_q;
  sp.host_k = h_k;
  sp.host_v = h_v;
  sp.q_row_bytes = static_cast<int64_t>(q_slot);
  sp.kv_row_bytes = static_cast<int64_t>(kv_slot);
  sp.lengths = d_len.get<int32_t>();
  sp.q = d_q.get<Bf16>();
  sp.num_q_heads = hq;
  sp.batch = batch;
  sp.original_max_position_embeddings = orig;
  absl::Status st = LaunchDecodeStage(sp, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT(cudaDeviceSynchronize());

  // The reference append, one row at a time from device fp32 copies (exact for every dtype here).
  for (int r = 0; r < batch; ++r) {
    if (lengths[r] == 0) continue;
    std::vector<float> k32(k_val[r].begin(), k_val[r].end()), v32(v_val[r].begin(), v_val[r].end());
    DevBuf dk(kv_n * 4), dv(kv_n * 4), table(stride * 4), len(4);
    dk.Upload(k32.data());
    dv.Upload(v32.data());
    table.Upload(h_tables + r * stride);
    len.Upload(&lengths[r]);
    CudaDecodeAppendParams ap;
    ap.kv = kvb;
    ap.kv.k = k_ref.get<Bf16>();
    ap.kv.v = v_ref.get<Bf16>();
    ap.kv.page_tables = table.get<int32_t>();
    ap.lengths = len.get<int32_t>();
    ap.k = dk.get();
    ap.v = dv.get();
    ap.in_dtype = DType::kFp32;
    ap.batch = 1;
    ap.original_max_position_embeddings = orig;
    ASSERT_TRUE(LaunchDecodeAppendKv(ap, nullptr).ok());
    CUDA_ASSERT(cudaDeviceSynchronize());
  }
  auto download = [](const DevBuf& b) {
    std::vector<uint8_t> out(b.bytes());
    cudaMemcpy(out.data(), b.get(), b.bytes(), cudaMemcpyDeviceToHost);
    return out;
  };
  EXPECT_TRUE(download(k_pool) == download(k_ref)) << "K pool differs from LaunchDecodeAppendKv's";
  EXPECT_TRUE(download(v_pool) == download(v_ref)) << "V pool differs from LaunchDecodeAppendKv's";
  std::vector<int32_t> got_len(batch), got_tables(batch * stride);
  CUDA_ASSERT(cudaMemcpy(got_len.data(), d_len.get(), batch * 4, cudaMemcpyDeviceToHost));
  CUDA_ASSERT(
      cudaMemcpy(got_tables.data(), d_tables.get(), batch * stride * 4, cudaMemcpyDeviceToHost));
  std::vector<uint16_t> got_q(batch * q_n);
  CUDA_ASSERT(cudaMemcpy(got_q.data(), d_q.get(), batch * q_n * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got_len, lengths);
  for (int r = 0; r < batch; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    int bad_table = 0, bad_q = 0;
    for (int32_t i = 0; i < rows[r].pages; ++i) {
      bad_table += got_tables[r * stride + i] != h_tables[r * stride + i];
    }
    for (size_t i = 0; i < q_n && lengths[r] > 0; ++i) {
      bad_q += got_q[r * q_n + i] != FloatToBf16(static_cast<float>(q_val[r][i]));
    }
    EXPECT_EQ(bad_table, 0) << "page-table entries copied wrong";
    EXPECT_EQ(bad_q, 0) << "q elements converted wrong";
    if (lengths[r] == 0) {  // padding: its table row and q were not written (still poisoned)
      EXPECT_EQ(got_tables[r * stride], -1);
      EXPECT_EQ(got_q[r * q_n], 0xffff);
    }
  }
  cudaFreeHost(h_rows);
  cudaFreeHost(h_tables);
  cudaFreeHost(h_q);
  cudaFreeHost(h_k);
  cudaFreeHost(h_v);
}

TEST(CudaDecodeStage, MatchesTheDeviceAppendAndTheHostRounding) {
  REQUIRE_GPU();
  CheckDecodeStage({{70000, DType::kFp32, DType::kBf16, DType::kFp16},
                    {0, DType::kBf16, DType::kBf16, DType::kBf16},  // padding
                    {3, DType::kBf16, DType::kFp32, DType::kFp32}},
                   /*stride=*/70004, /*pool_pages=*/64);
}

// Larger batches spread each row over fewer blocks (down to one at 256 rows and up): every row
// must still be staged whole.
TEST(CudaDecodeStage, LargeBatchesMatchWithFewerBlocksPerRow) {
  REQUIRE_GPU();
  const DType dtypes[] = {DType::kBf16, DType::kFp32, DType::kFp16};
  for (const int batch : {40, 300}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    std::vector<StageRow> rows;
    for (int r = 0; r < batch; ++r) {
      rows.push_back(
          {r % 7 == 6 ? 0 : 1 + r % 60, dtypes[r % 3], dtypes[(r + 1) % 3], dtypes[(r + 2) % 3]});
    }
    CheckDecodeStage(rows, /*stride=*/64, /*pool_pages=*/307);
  }
}

// ---- host-only checks (run in CI without a GPU)
// ---------------------------------------------------

TEST(CudaGeometry, RejectsUnsupportedShapes) {
  DcaGeometry g = Geometry(28, 4, 96, 128, 0);
  absl::Status s = CheckCudaGeometry(g);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("head_dim 96"), std::string::npos) << s;
  g = Geometry(34, 2, 128, 128, 0);  // group 17
  s = CheckCudaGeometry(g);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("group size"), std::string::npos) << s;
  EXPECT_TRUE(CheckCudaGeometry(Geometry(28, 4, 128, 253952, 262144)).ok());
  EXPECT_TRUE(CheckCudaGeometry(Geometry(8, 8, 64, 128, 0)).ok());
}

TEST(CudaKernelPlan, DecodeStagesAndSplits) {
  REQUIRE_GPU();
  const DcaGeometry g = Geometry(28, 4, 128, 253952, 262144);
  absl::StatusOr<CudaKernelPlan> plan = CudaKernelPlan::Create(g, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int32_t sms = plan->num_sms(), per_sm = plan->DecodeBlocksPerSm(2);
  ASSERT_GE(sms, 1);
  ASSERT_GE(per_sm, plan->DecodeBlocksPerSm(3));  // a deeper ring never fits more blocks
  // Ring depth 2 while batch x kv heads fits one wave at its occupancy, 3 past it.
  const int32_t one_wave_batch = sms * per_sm / g.num_kv_heads;
  EXPECT_EQ(plan->DecodeStages(1), 2);
  EXPECT_EQ(plan->DecodeStages(one_wave_batch), 2);
  EXPECT_EQ(plan->DecodeStages(one_wave_batch + 1), 3);
  // Splits: one wave of blocks, at least one, at most one per 256 keys and 1024.
  EXPECT_EQ(plan->DecodeSplits(1, 1), 1);
  EXPECT_EQ(plan->DecodeSplits(1, 1 << 20), std::min(1024, sms * per_sm / g.num_kv_heads));
  EXPECT_EQ(plan->DecodeSplits(32, 32768), std::max(1, sms * per_sm / (32 * g.num_kv_heads)));
  EXPECT_EQ(plan->DecodeSplits(256, 1 << 17), 1);
  EXPECT_LE(plan->DecodeSplits(1, int64_t{1} << 30), 1024);
  EXPECT_EQ(plan->DecodeWorkspaceFloats(2, 3), size_t{2} * 28 * 3 * 128 + size_t{2} * 28 * 3);
  // The H200's figures (bench/gpu/NOTES.md): 3 blocks per SM at ring depth 2, 2 at depth 3.
  cudaDeviceProp prop;
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  if (std::string(prop.name).find("H200") != std::string::npos) {
    EXPECT_EQ(per_sm, 3);
    EXPECT_EQ(plan->DecodeBlocksPerSm(3), 2);
    EXPECT_EQ(plan->prefill_kernel(), PrefillKernel::kWgmma);
  }
}

TEST(CudaKernelPlan, RejectsBadGeometryAndOptions) {
  REQUIRE_GPU();
  absl::StatusOr<CudaKernelPlan> plan = CudaKernelPlan::Create(Geometry(28, 4, 96, 128, 0), 0);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  CudaKernelPlanOptions options;
  options.decode_stages = 4;
  plan = CudaKernelPlan::Create(Geometry(28, 4, 128, 128, 0), 0, options);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_NE(std::string(plan.status().message()).find("decode_stages 4"), std::string::npos);
  plan = CudaKernelPlan::Create(Geometry(28, 4, 128, 128, 0), 1 << 20);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
}

}  // namespace
}  // namespace attnd
