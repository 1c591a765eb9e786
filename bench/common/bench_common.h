// What the host-side benchmarks share (bench/data_plane, bench/sharding): list flags, random
// bf16 inputs, percentiles and a microsecond timer.
#ifndef ATTND_BENCH_COMMON_BENCH_COMMON_H_
#define ATTND_BENCH_COMMON_BENCH_COMMON_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"

namespace attnd::bench {

using Clock = std::chrono::steady_clock;

inline double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// "1,8,64" as numbers; items that are not integers are skipped.
inline std::vector<int64_t> ParseList(absl::string_view text) {
  std::vector<int64_t> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (absl::SimpleAtoi(item, &v)) out.push_back(v);
  }
  return out;
}

// bf16 bytes of n random values in [-1, 1).
inline std::string RandomBf16(std::mt19937* rng, int64_t n) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> f(n);
  for (float& x : f) x = u(*rng);
  std::string out(n * 2, '\0');
  ConvertFromFloat(f.data(), n, DType::kBf16, out.data());
  return out;
}

// The p-quantile (0..1) of v, nearest rank; 0 for none.
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace attnd::bench

#endif  // ATTND_BENCH_COMMON_BENCH_COMMON_H_
