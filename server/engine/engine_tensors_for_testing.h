// Request tensors and output checks shared by the engine tests: a tensor in a request dtype that
// remembers the fp32 values it holds exactly, and the bf16 kernels' closeness bar.
#ifndef ATTND_SERVER_ENGINE_ENGINE_TENSORS_FOR_TESTING_H_
#define ATTND_SERVER_ENGINE_ENGINE_TENSORS_FOR_TESTING_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "server/engine/engine.h"

namespace attnd {
namespace engine_testing {

// A request tensor in `dtype` plus the fp32 values it holds exactly.
struct Tensor {
  DType dtype;
  std::vector<uint8_t> bytes;
  std::vector<float> values;
  std::vector<int64_t> shape;
  TensorView view() const { return TensorView{dtype, bytes.data(), shape}; }
};

inline Tensor FromValues(std::vector<int64_t> shape, DType dtype, const std::vector<float>& raw) {
  Tensor t{dtype, std::vector<uint8_t>(raw.size() * ElementSize(dtype)),
           std::vector<float>(raw.size()), std::move(shape)};
  ConvertFromFloat(raw.data(), raw.size(), dtype, t.bytes.data());
  ConvertToFloat(t.bytes.data(), dtype, raw.size(), t.values.data());
  return t;
}

// Standard normal values, rounded to `dtype`.
inline Tensor RandomTensor(std::vector<int64_t> shape, DType dtype, std::mt19937* rng) {
  const int64_t n =
      std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> raw(n);
  for (float& x : raw) x = dist(*rng);
  return FromValues(std::move(shape), dtype, raw);
}

// The bf16 kernels' bar: every output finite, max abs <= 2e-2 and mean abs <= 2e-3 against
// `want` (or the bars given); prints both errors under `what`.
inline void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                        const std::string& what, double max_bar = 2e-2, double mean_bar = 2e-3) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double max_abs = 0, sum_abs = 0;
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++bad;
      continue;
    }
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    max_abs = std::max(max_abs, e);
    sum_abs += e;
  }
  EXPECT_EQ(bad, 0u) << what << ": non-finite outputs";
  EXPECT_LE(max_abs, max_bar) << what;
  EXPECT_LE(sum_abs / want.size(), mean_bar) << what;
  std::printf("  %-44s n=%zu max_abs=%.3g mean_abs=%.3g\n", what.c_str(), want.size(), max_abs,
              sum_abs / want.size());
}

// The same for outputs stored in `dtype`.
inline void ExpectClose(const std::vector<uint8_t>& got_bytes, DType dtype,
                        const std::vector<float>& want, const std::string& what) {
  std::vector<float> got(want.size());
  ASSERT_GE(got_bytes.size(), want.size() * ElementSize(dtype)) << what;
  ConvertToFloat(got_bytes.data(), dtype, want.size(), got.data());
  ExpectClose(got, want, what);
}

}  // namespace engine_testing
}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_ENGINE_TENSORS_FOR_TESTING_H_
