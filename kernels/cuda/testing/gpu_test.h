// What the gpu-tagged tests share: whether a CUDA device is usable, and REQUIRE_GPU(), which skips
// the current test loudly (stderr and the gtest skip message) where none is.
#ifndef ATTND_KERNELS_CUDA_TESTING_GPU_TEST_H_
#define ATTND_KERNELS_CUDA_TESTING_GPU_TEST_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace attnd::gpu_test {

// True when cudaGetDeviceCount finds a device; otherwise *why says what failed.
inline bool GpuPresent(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    return false;
  }
  if (n == 0) {
    *why = "no CUDA device";
    return false;
  }
  return true;
}

}  // namespace attnd::gpu_test

#define REQUIRE_GPU()                                                                        \
  do {                                                                                       \
    std::string why_;                                                                        \
    if (!::attnd::gpu_test::GpuPresent(&why_)) {                                              \
      std::fprintf(stderr, "*** SKIPPING GPU TEST %s: %s ***\n",                             \
                   ::testing::UnitTest::GetInstance()->current_test_info()->name(),          \
                   why_.c_str());                                                            \
      GTEST_SKIP() << "no usable CUDA device: " << why_;                                     \
    }                                                                                        \
  } while (0)

#endif  // ATTND_KERNELS_CUDA_TESTING_GPU_TEST_H_
