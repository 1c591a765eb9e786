#include "kernels/testing/naive_fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attnd {
namespace naive {

double Fp8E4m3Value(int code) {
  const int sign = (code >> 7) & 1, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -magnitude : magnitude;
}

int NearestFp8E4m3(double x) {
  static const std::vector<double> magnitudes = [] {
    std::vector<double> v;
    for (int c = 0; c <= 0x7e; ++c) v.push_back(Fp8E4m3Value(c));  // ascending: v[c] for code c
    return v;
  }();
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  if (a >= magnitudes.back()) return sign | 0x7e;
  // The first magnitude >= a, and the one below it.
  const int hi = static_cast<int>(std::lower_bound(magnitudes.begin(), magnitudes.end(), a) -
                                  magnitudes.begin());
  if (magnitudes[hi] == a || hi == 0) return sign | hi;
  const int lo = hi - 1;
  const double below = a - magnitudes[lo], above = magnitudes[hi] - a;  // exact in fp64
  if (below < above) return sign | lo;
  if (above < below) return sign | hi;
  return sign | (lo % 2 == 0 ? lo : hi);
}

Fp8Row QuantizeFp8Row(absl::Span<const float> x) {
  Fp8Row row;
  float amax = 0.f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  row.scale = amax / 448.f;
  row.codes.resize(x.size(), 0);
  if (row.scale == 0.f) return row;
  for (size_t i = 0; i < x.size(); ++i) {
    const float q = x[i] / row.scale;  // the contract's fp32 division
    row.codes[i] = static_cast<uint8_t>(NearestFp8E4m3(q));
  }
  return row;
}

std::vector<double> DequantizeFp8Row(const Fp8Row& row) {
  std::vector<double> out(row.codes.size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = Fp8E4m3Value(row.codes[i]) * static_cast<double>(row.scale);
  }
  return out;
}

std::vector<double> Fp8RoundTrip(absl::Span<const float> x) {
  return DequantizeFp8Row(QuantizeFp8Row(x));
}

}  // namespace naive
}  // namespace attnd
