// fp32 -> bf16 for one decode output row of the 7B (28 q heads x 128): ConvertFromFloat, which the
// CUDA engine runs on every decode step, against the value-by-value FloatToBf16 loop it replaced.
// Not a test: run it by hand,
//   bazel run //base:dtype_bench
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "benchmark/benchmark.h"

namespace attnd {
namespace {

constexpr size_t kRow = 28 * 128;

std::vector<float> Row() {
  std::mt19937 rng(1);
  std::normal_distribution<float> g;
  std::vector<float> v(kRow);
  for (float& x : v) x = g(rng);
  return v;
}

void BM_ConvertFromFloatBf16(benchmark::State& state) {
  const std::vector<float> src = Row();
  std::vector<uint16_t> out(kRow);
  for (auto _ : state) {
    ConvertFromFloat(src.data(), kRow, DType::kBf16, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kRow);
}
BENCHMARK(BM_ConvertFromFloatBf16);

// The peer: the scalar loop (what ConvertFromFloat ran before it was vectorised).
void BM_ScalarFloatToBf16(benchmark::State& state) {
  const std::vector<float> src = Row();
  std::vector<unsigned char> out(2 * kRow);
  for (auto _ : state) {
    for (size_t i = 0; i < kRow; ++i) {
      const uint16_t h = FloatToBf16(src[i]);
      std::memcpy(out.data() + 2 * i, &h, sizeof(h));
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kRow);
}
BENCHMARK(BM_ScalarFloatToBf16);

}  // namespace
}  // namespace attnd

BENCHMARK_MAIN();
