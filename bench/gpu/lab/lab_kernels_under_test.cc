// The tuning lab's kernels under test (kernels/cuda/testing/kernels_under_test.h): every prefill
// and decode configuration, through the product's test cases and bars.
#include "bench/gpu/lab/lab_kernels.h"
#include "kernels/cuda/testing/kernels_under_test.h"

namespace attnd::gpu_test {

std::vector<PrefillKernelUnderTest> PrefillKernelsUnderTest() {
  std::vector<PrefillKernelUnderTest> kernels;
  for (int c = 0; c < lab::kNumPrefillConfigs; ++c) {
    kernels.push_back({"lab " + lab::PrefillConfigLabel(c),
                       [c](const DcaGeometry& g, const CudaPrefillParams& p, cudaStream_t stream) {
                         return lab::LaunchLabPrefill(g, p, c, stream);
                       }});
  }
  return kernels;
}

std::vector<DecodeKernelUnderTest> DecodeKernelsUnderTest() {
  std::vector<DecodeKernelUnderTest> kernels;
  for (int c = 0; c < lab::kNumDecodeConfigs; ++c) {
    kernels.push_back({"lab " + lab::DecodeConfigLabel(c),
                       [c](const DcaGeometry& g, int32_t batch, int64_t max_length) {
                         return lab::LabDecodeSplits(g, batch, max_length, c);
                       },
                       [c](const DcaGeometry& g, const CudaDecodeParams& p, cudaStream_t stream) {
                         return lab::LaunchLabDecode(g, p, c, stream);
                       }});
  }
  return kernels;
}

}  // namespace attnd::gpu_test
