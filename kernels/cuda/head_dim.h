// The head dimensions the CUDA kernels are compiled for, and the one place a runtime head_dim
// becomes a compile-time one. A launcher checks SupportedHeadDim (naming the set in its error),
// then WithHeadDim(d, [&](auto dim) { ... Kernel<decltype(dim)::value> ... }).
#ifndef ATTND_KERNELS_CUDA_HEAD_DIM_H_
#define ATTND_KERNELS_CUDA_HEAD_DIM_H_

#include <type_traits>
#include <utility>

namespace attnd {

// What the error messages name: "64, 128".
inline constexpr const char* kSupportedHeadDims = "64, 128";

constexpr bool SupportedHeadDim(int d) { return d == 64 || d == 128; }

// f(std::integral_constant<int, D>{}) for the supported D equal to d (callers check d first:
// an unsupported d runs the 64 instantiation).
template <typename F>
decltype(auto) WithHeadDim(int d, F&& f) {
  if (d == 128) return std::forward<F>(f)(std::integral_constant<int, 128>{});
  return std::forward<F>(f)(std::integral_constant<int, 64>{});
}

}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_HEAD_DIM_H_
