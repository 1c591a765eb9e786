// Throughput of the CPU DCA kernels for the Qwen2.5-7B-Instruct-1M geometry (28 q heads, 4 kv
// heads, head_dim 128, cl = 253952). Reports tokens/s: new tokens for prefill, sequences x steps
// for decode. Prefill includes the KV append, as the engine runs it.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "base/thread_pool.h"
#include "benchmark/benchmark.h"
#include "kernels/dca.h"
#include "kernels/dca_cpu.h"
#include "kernels/paged_kv.h"

namespace attnd {
namespace {

constexpr int32_t kPageSize = 16;

DcaGeometry Qwen7B() {
  DcaGeometry geo;
  geo.num_q_heads = 28;
  geo.num_kv_heads = 4;
  geo.head_dim = 128;
  geo.chunk_len = 262144 - 8192;
  geo.original_max_position_embeddings = 262144;
  geo.softmax_scale = 1.f / std::sqrt(128.f);
  return geo;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename KvT>
struct BenchSequence {
  BenchSequence(const DcaGeometry& geo, int64_t tokens) {
    const int64_t pages = (tokens + kPageSize - 1) / kPageSize;
    const int64_t row = static_cast<int64_t>(geo.num_kv_heads) * geo.head_dim;
    k.resize(pages * kPageSize * row);
    v.resize(pages * kPageSize * row);
    for (int64_t i = 0; i < pages; ++i) table.push_back(static_cast<int32_t>(i));
    kv.k = k.data();
    kv.v = v.data();
    kv.page_table = table.data();
    kv.page_size = kPageSize;
    kv.num_kv_heads = geo.num_kv_heads;
    kv.head_dim = geo.head_dim;
  }
  std::vector<KvT> k, v;
  std::vector<int32_t> table;
  PagedKv<KvT> kv;
};

// The last argument of each benchmark picks the SIMD path: 0 = auto (AVX2+FMA where present),
// 1 = SSE2 (the baseline every x86-64 has).
void PickSimd(benchmark::State& state, int64_t arg) {
  SetCpuSimd(arg == 1 ? CpuSimd::kSse2 : CpuSimd::kAuto);
  state.SetLabel(CpuSimdName(128));
}

template <typename KvT>
void BM_Prefill(benchmark::State& state) {
  const DcaGeometry geo = Qwen7B();
  const int64_t t = state.range(0);
  PickSimd(state, state.range(1));
  BenchSequence<KvT> seq(geo, t);
  const std::vector<float> q = Random(t * kNumQueryVariants * geo.num_q_heads * geo.head_dim, 1);
  const std::vector<float> kv = Random(t * geo.num_kv_heads * geo.head_dim, 2);
  std::vector<float> out(t * geo.num_q_heads * geo.head_dim);
  ThreadPool pool(0);
  for (auto _ : state) {
    CpuAppendParams append{kv.data(), kv.data(), 0, t, 1.f};
    AppendKvCpu(seq.kv, append, &pool);
    CpuPrefillParams params{q.data(), out.data(), 0, t, geo.softmax_scale};
    DcaPrefillCpu(geo, seq.kv, params, &pool);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(t) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["threads"] = pool.num_threads();
}

template <typename KvT>
void BM_Decode(benchmark::State& state) {
  const DcaGeometry geo = Qwen7B();
  const int64_t context = state.range(0);
  const int64_t batch = state.range(1);
  PickSimd(state, state.range(2));
  std::vector<BenchSequence<KvT>> seqs;
  seqs.reserve(batch);
  const std::vector<float> kv = Random(context * geo.num_kv_heads * geo.head_dim, 3);
  ThreadPool pool(0);
  for (int64_t b = 0; b < batch; ++b) {
    seqs.emplace_back(geo, context);
    AppendKvCpu(seqs.back().kv, CpuAppendParams{kv.data(), kv.data(), 0, context, 1.f}, &pool);
  }
  const std::vector<float> q = Random(kNumDecodeVariants * geo.num_q_heads * geo.head_dim, 4);
  std::vector<float> out(batch * geo.num_q_heads * geo.head_dim);
  std::vector<CpuDecodeItem<KvT>> items(batch);
  for (int64_t b = 0; b < batch; ++b) {
    items[b].kv = seqs[b].kv;
    items[b].q = q.data();
    items[b].out = out.data() + b * geo.num_q_heads * geo.head_dim;
    items[b].length = context;
    items[b].q_scale = 1.f;
  }
  for (auto _ : state) {
    DcaDecodeCpu<KvT>(geo, items, &pool);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(batch) * state.iterations(),
                                                  benchmark::Counter::kIsRate);
  state.counters["threads"] = pool.num_threads();
}

BENCHMARK_TEMPLATE(BM_Prefill, float)
    ->ArgsProduct({{1024, 4096}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Prefill, uint16_t)
    ->ArgsProduct({{1024, 4096}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Decode, float)
    ->ArgsProduct({{4096, 32768}, {1, 8}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_Decode, uint16_t)
    ->ArgsProduct({{4096, 32768}, {1, 8}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace attnd

BENCHMARK_MAIN();
