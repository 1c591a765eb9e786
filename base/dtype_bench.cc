// fp32 -> bf16 for one decode output row of the 7B (28 q heads x 128): ConvertFromFloat, which the
// CUDA engine runs on every decode step, against the value-by-value FloatToBf16 loop it replaced.
// Also the finite check's cost. Not a test: run it by hand,
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

// The finite check (--check-finite) over the q of one 4096-token 7B prefill, pre-rotary bf16
// (4096 x 28 x 128): what the check adds to a prefill request, in bytes per second.
void BM_FirstNonFiniteBf16Prefill(benchmark::State& state) {
  const size_t n = size_t{4096} * 28 * 128;
  std::vector<uint16_t> q(n);
  std::mt19937 rng(2);
  std::normal_distribution<float> g;
  for (uint16_t& x : q) x = FloatToBf16(g(rng));
  for (auto _ : state) {
    benchmark::DoNotOptimize(FirstNonFinite(DType::kBf16, q.data(), n));
  }
  state.SetBytesProcessed(state.iterations() * n * 2);
}
BENCHMARK(BM_FirstNonFiniteBf16Prefill);

void BM_FirstNonFiniteFp32Prefill(benchmark::State& state) {
  const size_t n = size_t{4096} * 28 * 128;
  std::vector<float> q(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> g;
  for (float& x : q) x = g(rng);
  for (auto _ : state) {
    benchmark::DoNotOptimize(FirstNonFinite(DType::kFp32, q.data(), n));
  }
  state.SetBytesProcessed(state.iterations() * n * 4);
}
BENCHMARK(BM_FirstNonFiniteFp32Prefill);

}  // namespace
}  // namespace attnd

BENCHMARK_MAIN();
