// Sparse vs dense CPU prefill for the Qwen2.5-7B-Instruct-1M geometry (28 q heads, 4 kv heads,
// head_dim 128), one layer, one call of N tokens. Not a test: run it by hand, e.g.
//   bazel run -c opt //kernels:sparse_prefill_cpu_bench -- --benchmark_filter=4096
// Args: tokens, vertical budget, slash budget (all heads), chunk_len (0 = the model's 253952).
// Work is proportional to the share of (row, key) pairs the pattern makes visible. The 7B
// pattern's commonest budget (1000, 6096) covers every diagonal below ~6K tokens, and on these
// random inputs the chosen slashes scatter, so each 64-wide band adds new keys: (130, 800) is
// still ~dense at 8K; (130, 100) -- the forced nearest diagonals only -- shows a sparse head.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "base/thread_pool.h"
#include "benchmark/benchmark.h"
#include "kernels/dca.h"
#include "kernels/dca_cpu.h"
#include "kernels/paged_kv.h"
#include "kernels/sparse_prefill_cpu.h"
#include "kernels/vertical_slash.h"

namespace attnd {
namespace {

constexpr int32_t kPageSize = 16;

DcaGeometry Qwen7B(int64_t chunk_len) {
  DcaGeometry geo;
  geo.num_q_heads = 28;
  geo.num_kv_heads = 4;
  geo.head_dim = 128;
  geo.chunk_len = chunk_len > 0 ? chunk_len : 262144 - 8192;
  geo.softmax_scale = 1.f / std::sqrt(128.f);
  return geo;
}

struct Inputs {
  Inputs(const DcaGeometry& geo, int64_t tokens) {
    std::mt19937 rng(1);
    std::normal_distribution<float> dist(0.f, 1.f);
    const int64_t row = static_cast<int64_t>(geo.num_kv_heads) * geo.head_dim;
    const int64_t pages = (tokens + kPageSize - 1) / kPageSize;
    k.resize(pages * kPageSize * row);
    v.resize(pages * kPageSize * row);
    for (float& x : k) x = dist(rng);
    for (float& x : v) x = dist(rng);
    q.resize(tokens * kNumQueryVariants * geo.num_q_heads * geo.head_dim);
    for (float& x : q) x = dist(rng);
    out.resize(tokens * geo.num_q_heads * geo.head_dim);
    for (int64_t i = 0; i < pages; ++i) table.push_back(static_cast<int32_t>(i));
    kv =
        PagedKv<float>{k.data(), v.data(), table.data(), kPageSize, geo.num_kv_heads, geo.head_dim};
    params.q = q.data();
    params.out = out.data();
    params.num_tokens = tokens;
    params.softmax_scale = geo.softmax_scale;
  }
  std::vector<float> k, v, q, out;
  std::vector<int32_t> table;
  PagedKv<float> kv;
  CpuPrefillParams params;
};

ThreadPool& Pool() {
  static ThreadPool* pool = new ThreadPool(0);
  return *pool;
}

void BM_SparsePrefill(benchmark::State& state) {
  const DcaGeometry geo = Qwen7B(state.range(3));
  Inputs in(geo, state.range(0));
  const std::vector<VsBudget> budgets(geo.num_q_heads, VsBudget{state.range(1), state.range(2)});
  for (auto _ : state) {
    DcaSparsePrefillCpu<float>(geo, in.kv, in.params, budgets, 64, &Pool());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_DensePrefill(benchmark::State& state) {
  const DcaGeometry geo = Qwen7B(state.range(1));
  Inputs in(geo, state.range(0));
  for (auto _ : state) DcaPrefillCpu<float>(geo, in.kv, in.params, &Pool());
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

BENCHMARK(BM_SparsePrefill)
    ->Args({4096, 1000, 6096, 0})
    ->Args({4096, 130, 100, 0})
    ->Args({8192, 130, 100, 0})
    ->Args({8192, 130, 800, 0})
    ->Args({8192, 130, 100, 2048})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DensePrefill)
    ->Args({4096, 0})
    ->Args({8192, 0})
    ->Args({8192, 2048})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace attnd

BENCHMARK_MAIN();
