#include "kernels/testing/naive_int8.h"

#include <algorithm>
#include <cmath>

namespace attnd {
namespace naive {

Int8Row QuantizeInt8Row(absl::Span<const float> x) {
  Int8Row row;
  float amax = 0.f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  row.scale = amax / 127.f;
  row.codes.resize(x.size(), 0);
  if (row.scale == 0.f) return row;
  for (size_t i = 0; i < x.size(); ++i) {
    const float q = x[i] / row.scale;  // the contract's fp32 division
    const double r = std::nearbyint(static_cast<double>(q));
    row.codes[i] = static_cast<int8_t>(std::min(127.0, std::max(-127.0, r)));
  }
  return row;
}

std::vector<double> DequantizeInt8Row(const Int8Row& row) {
  std::vector<double> out(row.codes.size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<double>(row.codes[i]) * static_cast<double>(row.scale);
  }
  return out;
}

std::vector<double> Int8RoundTrip(absl::Span<const float> x) {
  return DequantizeInt8Row(QuantizeInt8Row(x));
}

}  // namespace naive
}  // namespace attnd
