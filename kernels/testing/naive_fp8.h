// A deliberately naive fp8 E4M3 KV row, written from the format's definition and the cache's
// contract (base/fp8.h's header comment) without calling base/fp8.h: the 127 non-negative finite
// values from (1 + m/8) 2^(e-7) and m/8 2^-6, the nearest found by search, ties to the even code,
// past 448 saturating. Tests quantise K/V with it and run the fp64 reference on what it reads back.
#ifndef ATTND_KERNELS_TESTING_NAIVE_FP8_H_
#define ATTND_KERNELS_TESTING_NAIVE_FP8_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace attnd {
namespace naive {

// The value of E4M3 code `code` (0..255): NaN for 0x7f and 0xff.
double Fp8E4m3Value(int code);

// The code nearest to x (finite), ties to the code whose lowest bit is clear, |x| > 448 giving
// +-448; the sign bit is x's (so -0 is 0x80).
int NearestFp8E4m3(double x);

// One stored row: the codes and the fp32 scale.
struct Fp8Row {
  std::vector<uint8_t> codes;
  float scale = 0.f;
};

// The cache's quantisation of a row of fp32 values x: scale = max|x| / 448 in fp32, code_i =
// NearestFp8E4m3(x_i / scale) with that division in fp32; a row whose scale is 0 gets zero codes.
Fp8Row QuantizeFp8Row(absl::Span<const float> x);

// What the row reads back as, in fp64: Fp8E4m3Value(code_i) * scale.
std::vector<double> DequantizeFp8Row(const Fp8Row& row);

// Both: a row of fp32 values as an fp8 cache holds it.
std::vector<double> Fp8RoundTrip(absl::Span<const float> x);

}  // namespace naive
}  // namespace attnd

#endif  // ATTND_KERNELS_TESTING_NAIVE_FP8_H_
