// What the gpu-tagged tests share: whether a CUDA device is usable, REQUIRE_GPU(), which skips
// the current test loudly (stderr and the gtest skip message) where none is, and DevBuf.
#ifndef ATTND_KERNELS_CUDA_TESTING_GPU_TEST_H_
#define ATTND_KERNELS_CUDA_TESTING_GPU_TEST_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
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

// A device allocation freed on scope exit (null if cudaMalloc failed).
class DevBuf {
 public:
  explicit DevBuf(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&p_, std::max<size_t>(bytes, 16)) != cudaSuccess) p_ = nullptr;
  }
  ~DevBuf() { cudaFree(p_); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
  void Poison() const { cudaMemset(p_, 0xff, bytes_); }  // all-ones: NaN in bf16/fp16/fp32
  void Upload(const void* src) const { cudaMemcpy(p_, src, bytes_, cudaMemcpyHostToDevice); }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

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
