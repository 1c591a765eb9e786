// The fast kernels that //kernels/cuda:dca_cuda_test_lib's prefill and decode tests run against the
// fp64 reference and the simple reference kernels. The test library declares them; the binary that
// links it defines them: product_kernels.cc for //kernels/cuda:dca_cuda_test (the product's plan),
// bench/gpu/lab/lab_kernels_under_test.cc for the tuning lab's //bench/gpu/lab:lab_test (every lab
// configuration). The same cases and bars thus hold for both.
#ifndef ATTND_KERNELS_CUDA_TESTING_KERNELS_UNDER_TEST_H_
#define ATTND_KERNELS_CUDA_TESTING_KERNELS_UNDER_TEST_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/dca.h"

namespace attnd::gpu_test {

struct PrefillKernelUnderTest {
  std::string label;
  std::function<absl::Status(const DcaGeometry&, const CudaPrefillParams&, cudaStream_t)> launch;
};
struct DecodeKernelUnderTest {
  std::string label;
  // The split count the kernel's own plan picks for (batch, max_length) on the current device.
  std::function<int32_t(const DcaGeometry&, int32_t batch, int64_t max_length)> plan_splits;
  std::function<absl::Status(const DcaGeometry&, const CudaDecodeParams&, cudaStream_t)> launch;
};

std::vector<PrefillKernelUnderTest> PrefillKernelsUnderTest();
std::vector<DecodeKernelUnderTest> DecodeKernelsUnderTest();

}  // namespace attnd::gpu_test

#endif  // ATTND_KERNELS_CUDA_TESTING_KERNELS_UNDER_TEST_H_
