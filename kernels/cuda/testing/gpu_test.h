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

// True when cudaGetDeviceCount finds a device. Otherwise *why is the skip reason, "no CUDA device",
// and *detail what CUDA said (without a GPU that is usually a driver error such as "CUDA driver
// version is insufficient for CUDA runtime version", which misleads as a skip reason).
inline bool GpuPresent(std::string* why, std::string* detail) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaSuccess && n > 0) return true;
  *why = "no CUDA device";
  if (err != cudaSuccess) {
    cudaGetLastError();
    *detail = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
  } else {
    *detail = "cudaGetDeviceCount found 0 devices";
  }
  return false;
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
  T* get() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }
  void Poison() const { cudaMemset(p_, 0xff, bytes_); }  // all-ones: NaN in bf16/fp16/fp32
  void Upload(const void* src) const { cudaMemcpy(p_, src, bytes_, cudaMemcpyHostToDevice); }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

}  // namespace attnd::gpu_test

#define REQUIRE_GPU()                                                                             \
  do {                                                                                            \
    std::string why_, detail_;                                                                    \
    if (!::attnd::gpu_test::GpuPresent(&why_, &detail_)) {                                        \
      std::fprintf(stderr, "*** SKIPPING GPU TEST %s: %s (%s) ***\n",                             \
                   ::testing::UnitTest::GetInstance()->current_test_info()->name(), why_.c_str(), \
                   detail_.c_str());                                                              \
      GTEST_SKIP() << why_;                                                                       \
    }                                                                                             \
  } while (0)

#endif  // ATTND_KERNELS_CUDA_TESTING_GPU_TEST_H_
