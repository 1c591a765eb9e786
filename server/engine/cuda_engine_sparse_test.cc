// CudaEngine's sparse prefill (docs/DCA.md "Vertical-slash sparse prefill") for calls of any size:
// a call larger than the prefill staging buffer is staged per DCA piece and per staging chunk, and
// must give what the same call gives through staging that holds it whole (one estimate and one
// attention launch per piece), and what the CPU engine gives. Sparse selection is discrete and the
// GPU estimate sums diagonals with atomics, so a near-tie may pick another key block for a row: the
// bars are the bf16 ones of docs/DCA.md "Numerics" on the mean, and on all but 0.1% of elements.
// The 128K case also prints the per-token time of 5,957-, 8,192- and 16,384-token calls ending at
// 128K (bench/gpu/sparse_calls.sh). GPU parts skip loudly without a CUDA device.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cuda/testing/gpu_test.h"
#include "kernels/dca.h"
#include "kvcache/kv_layout.h"
#include "server/config/sparse_config.h"
#include "server/engine/cpu_engine.h"
#include "server/engine/cuda_engine.h"
#include "server/engine/engine.h"
#include "server/engine/engine_jobs_for_testing.h"

namespace attnd {
namespace {

// 7B geometry: 28 q heads, 4 kv heads, head_dim 128.
DcaGeometry Geometry(int64_t chunk_len) {
  DcaGeometry g;
  g.num_q_heads = 28;
  g.num_kv_heads = 4;
  g.head_dim = 128;
  g.chunk_len = chunk_len;
  g.original_max_position_embeddings = 262144;
  g.softmax_scale = 1.f / std::sqrt(128.f);
  return g;
}

// One layer; a mix of the shipped 7B budgets (configs/qwen2.5-7b-instruct-1m, vertical 30 read
// as 130).
std::shared_ptr<const SparseAttentionConfig> Sparse(int64_t threshold) {
  auto sp = std::make_shared<SparseAttentionConfig>();
  sp->source = "test";
  sp->num_layers = 1;
  sp->num_q_heads = 28;
  sp->enabled = true;
  sp->threshold = threshold;
  sp->last_q = 64;
  const VsBudget mix[] = {{1000, 6096}, {3500, 100},  {1000, 6096}, {15436, 20432},
                          {500, 700},   {1000, 6096}, {130, 800},   {5096, 10192}};
  for (int h = 0; h < 28; ++h) sp->budgets.push_back(mix[h % 8]);
  return sp;
}

constexpr int64_t kPerToken = 90112;  // staging bytes per token of this geometry (cuda_engine.cc)

CudaEngineOptions CudaOptions(int64_t chunk_len, int64_t num_pages, int64_t staging_tokens,
                              int64_t threshold) {
  CudaEngineOptions o;
  o.geometry = Geometry(chunk_len);
  o.layout.num_layers = 1;
  o.layout.num_kv_heads = 4;
  o.layout.head_dim = 128;
  o.layout.page_size = 16;
  o.layout.kv_dtype = DType::kBf16;
  o.layout.num_pages = num_pages;
  o.max_decode_batch = 1;
  o.cuda_graphs = false;
  o.staging_bytes = staging_tokens * kPerToken;
  o.sparse = Sparse(threshold);
  return o;
}

// Random bf16 inputs, cut from one pool (a prompt of 128K tokens would take minutes to draw).
class Inputs {
 public:
  Inputs() : pool_(size_t{1} << 24) {
    std::mt19937 rng(5);
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<float> x(pool_.size());
    for (float& v : x) v = dist(rng);
    ConvertFromFloat(x.data(), x.size(), DType::kBf16, pool_.data());
  }
  // n bf16 elements starting at a seed-dependent place of the pool.
  std::vector<uint16_t> Take(int64_t n, uint64_t seed) const {
    std::vector<uint16_t> out(n);
    size_t at = (seed * 2654435761u) % pool_.size();
    for (int64_t done = 0; done < n;) {
      const int64_t m = std::min<int64_t>(n - done, pool_.size() - at);
      std::memcpy(out.data() + done, pool_.data() + at, m * 2);
      done += m;
      at = 0;
    }
    return out;
  }

 private:
  std::vector<uint16_t> pool_;
};

struct Call {
  std::vector<uint16_t> q, k, v;
  int64_t start = 0, tokens = 0;
};

Call MakeCall(const Inputs& in, int64_t start, int64_t tokens) {
  Call c;
  c.start = start;
  c.tokens = tokens;
  c.q = in.Take(tokens * kNumQueryVariants * 28 * 128, 3 * start + 1);
  c.k = in.Take(tokens * 4 * 128, 3 * start + 2);
  c.v = in.Take(tokens * 4 * 128, 3 * start + 3);
  return c;
}

// Runs the call on `engine` over `pages`; fp32 outputs [tokens, 28, 128]; *seconds its wall time.
std::vector<float> RunCall(Engine& engine, const Call& c, const std::vector<int32_t>& pages,
                           int64_t prompt_len, double* seconds = nullptr) {
  std::vector<float> out(c.tokens * 28 * 128, std::nanf(""));
  PrefillJob job = EngineJobsForTesting::Prefill();
  job.layer = 0;
  job.page_table = pages.data();
  job.num_pages = static_cast<int64_t>(pages.size());
  job.start = c.start;
  job.num_tokens = c.tokens;
  job.prompt_len = prompt_len;
  job.q = {DType::kBf16, c.q.data(), {c.tokens, kNumQueryVariants, 28, 128}};
  job.k = {DType::kBf16, c.k.data(), {c.tokens, 4, 128}};
  job.v = {DType::kBf16, c.v.data(), {c.tokens, 4, 128}};
  job.out = out.data();
  job.out_dtype = DType::kFp32;
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s = engine.Prefill(job);
  if (seconds != nullptr) {
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double sum = 0, worst = 0;
  size_t over = 0, bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++bad;
      continue;
    }
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    sum += e;
    worst = std::max(worst, e);
    over += e > 2e-2;
  }
  EXPECT_EQ(bad, 0u) << what << ": non-finite outputs";
  EXPECT_LE(sum / got.size(), 2e-3) << what;
  EXPECT_LE(static_cast<double>(over), 1e-3 * got.size()) << what << ": elements over 2e-2";
  std::printf("  %-48s mean_abs=%.3g max_abs=%.3g over_2e-2=%zu/%zu\n", what.c_str(),
              sum / got.size(), worst, over, got.size());
}

// Calls over several DCA pieces of 512 tokens, through 64-token staging (the smallest a sparse
// engine takes), through staging that holds each call whole, and on the CPU engine.
TEST(CudaEngineSparse, StagedCallsMatchWholeCallsAndTheCpuEngine) {
  REQUIRE_GPU();
  const int64_t pages = 256;  // 4096 tokens
  auto small = CreateCudaEngine(CudaOptions(512, pages, 1, /*threshold=*/256));
  ASSERT_TRUE(small.ok()) << small.status();
  auto whole = CreateCudaEngine(CudaOptions(512, pages, 2048, 256));
  ASSERT_TRUE(whole.ok()) << whole.status();
  CpuEngineOptions co;
  co.geometry = Geometry(512);
  co.layout = CudaOptions(512, pages, 1, 256).layout;
  co.sparse = Sparse(256);
  auto cpu = CpuEngine::Create(co);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<int32_t> table(pages);
  std::iota(table.rbegin(), table.rend(), 0);
  const Inputs in;
  const int64_t prompt = 3000;
  int64_t start = 0;
  // Mid-piece starts, a one-row block at the end, several pieces per call.
  for (int64_t t : {700, 1500, 65, 735}) {
    const Call c = MakeCall(in, start, t);
    const std::vector<float> a = RunCall(**small, c, table, prompt);
    const std::vector<float> b = RunCall(**whole, c, table, prompt);
    const std::vector<float> want = RunCall(**cpu, c, table, prompt);
    const std::string at = absl::StrCat("[", start, ", ", start + t, ")");
    ExpectNear(a, b, "64-token staging vs whole " + at);
    ExpectNear(a, want, "64-token staging vs cpu " + at);
    start += t;
  }
}

// The chunk sizes serving stacks send: 8,192- and 16,384-token calls at 128K context on the 7B
// geometry (one DCA chunk: chunk_len 253,952), through 512 MiB of staging (5,957 tokens),
// against staging that holds 16,384 tokens (the sparse default); then per-token times of calls
// ending at 128K.
TEST(CudaEngineSparse, LargeCallsAt128K) {
  REQUIRE_GPU();
  const int64_t context = 131072, prefix = context - 16384;
  // Prefix pages shared by three tails of 16,384 tokens each.
  const int64_t prefix_pages = prefix / 16, tail_pages = 16384 / 16;
  const int64_t pages = prefix_pages + 3 * tail_pages;
  auto dflt = CreateCudaEngine(CudaOptions(253952, pages, 5957, 32768));
  ASSERT_TRUE(dflt.ok()) << dflt.status();
  auto big = CreateCudaEngine(CudaOptions(253952, pages, 16384, 32768));
  ASSERT_TRUE(big.ok()) << big.status();
  std::vector<int32_t> shared(prefix_pages);
  std::iota(shared.begin(), shared.end(), 0);
  std::vector<std::vector<int32_t>> tables(3, shared);
  for (int i = 0; i < 3; ++i) {
    for (int64_t p = 0; p < tail_pages; ++p) tables[i].push_back(prefix_pages + i * tail_pages + p);
  }
  const Inputs in;
  // The prefix in 8,192-token calls (sparse: the prompt is 128K), compared every fourth call.
  for (int64_t first = 0; first < prefix; first += 8192) {
    const Call c = MakeCall(in, first, 8192);
    const std::vector<float> a = RunCall(**dflt, c, tables[0], context);
    const std::vector<float> b = RunCall(**big, c, tables[0], context);
    if (first / 8192 % 4 == 3) {
      ExpectNear(a, b, absl::StrCat("8192-token call at ", first));
    }
  }
  // Tails: fill up to 128K - t, then time the t-token call ending at 128K.
  const int64_t sizes[3] = {5957, 8192, 16384};
  for (int i = 0; i < 3; ++i) {
    const int64_t t = sizes[i], fill = context - t - prefix;
    if (fill > 0) {
      const Call c = MakeCall(in, prefix, fill);
      RunCall(**dflt, c, tables[i], context);
      RunCall(**big, c, tables[i], context);
    }
    const Call c = MakeCall(in, context - t, t);
    double s_dflt = 0, s_big = 0;
    const std::vector<float> a = RunCall(**dflt, c, tables[i], context, &s_dflt);
    const std::vector<float> b = RunCall(**big, c, tables[i], context, &s_big);
    ExpectNear(a, b, absl::StrCat(t, "-token call ending at 128K"));
    std::printf(
        "sparse call of %5lld tokens ending at 128K: %8.2f ms, %6.2f us/token "
        "(staging 5957 tokens); %8.2f ms, %6.2f us/token (staging 16384)\n",
        static_cast<long long>(t), s_dflt * 1e3, s_dflt * 1e6 / t, s_big * 1e3, s_big * 1e6 / t);
  }
}

}  // namespace
}  // namespace attnd
