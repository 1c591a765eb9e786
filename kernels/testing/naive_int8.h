// A deliberately naive int8 KV row, written from the cache's contract (base/int8_kv.h's header
// comment) without calling base/int8_kv.h: the fp32 scale max|x| / 127, the fp32 quotient rounded
// by fp64 nearbyint (half to even in the default rounding mode) and clamped to [-127, 127], read
// back in fp64. Tests quantise K/V with it and run the fp64 reference on what it reads back.
#ifndef ATTND_KERNELS_TESTING_NAIVE_INT8_H_
#define ATTND_KERNELS_TESTING_NAIVE_INT8_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace attnd {
namespace naive {

// One stored row: the codes and the fp32 scale.
struct Int8Row {
  std::vector<int8_t> codes;
  float scale = 0.f;
};

// The cache's quantisation of a row of finite fp32 values x: scale = max|x| / 127 in fp32, code_i
// = the integer nearest to x_i / scale (that division in fp32), ties to even, clamped to
// [-127, 127]; a row whose scale is 0 gets zero codes.
Int8Row QuantizeInt8Row(absl::Span<const float> x);

// What the row reads back as, in fp64: code_i * scale.
std::vector<double> DequantizeInt8Row(const Int8Row& row);

// Both: a row of fp32 values as an int8 cache holds it.
std::vector<double> Int8RoundTrip(absl::Span<const float> x);

}  // namespace naive
}  // namespace attnd

#endif  // ATTND_KERNELS_TESTING_NAIVE_INT8_H_
