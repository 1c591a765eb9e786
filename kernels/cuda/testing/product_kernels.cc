// The product's kernels under test (kernels_under_test.h): both prefill kernels of the plan and
// the decode kernel at both ring depths.
#include <utility>

#include "kernels/cuda/testing/kernels_under_test.h"

namespace attnd::gpu_test {
namespace {

absl::StatusOr<CudaKernelPlan> PlanOnCurrentDevice(const DcaGeometry& g,
                                                   const CudaKernelPlanOptions& options) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return absl::InternalError("no current device");
  return CudaKernelPlan::Create(g, device, options);
}

}  // namespace

std::vector<PrefillKernelUnderTest> PrefillKernelsUnderTest() {
  std::vector<PrefillKernelUnderTest> kernels;
  for (PrefillKernel k : {PrefillKernel::kWgmma, PrefillKernel::kMmaSync}) {
    CudaKernelPlanOptions options;
    options.prefill = k;
    kernels.push_back({std::string("product ") + PrefillKernelName(k),
                       [options](const DcaGeometry& g, const CudaPrefillParams& p,
                                 cudaStream_t stream) -> absl::Status {
                         absl::StatusOr<CudaKernelPlan> plan = PlanOnCurrentDevice(g, options);
                         if (!plan.ok()) return plan.status();
                         return LaunchDcaPrefill(*plan, p, stream);
                       }});
  }
  return kernels;
}

std::vector<DecodeKernelUnderTest> DecodeKernelsUnderTest() {
  std::vector<DecodeKernelUnderTest> kernels;
  // Both ring depths at the default split minimum, and each with another (more or fewer splits on
  // short rows: more or fewer partials for the reduction).
  const std::pair<int, int32_t> configs[] = {{2, 0}, {3, 0}, {2, 64}, {3, 256}};
  for (const auto& [stages, min_keys] : configs) {
    CudaKernelPlanOptions options;
    options.decode_stages = stages;
    options.decode_min_split_keys = min_keys;
    kernels.push_back({"product ring " + std::to_string(stages) +
                           (min_keys != 0 ? ", splits of >= " + std::to_string(min_keys) : ""),
                       [options](const DcaGeometry& g, int32_t batch, int64_t max_length) {
                         absl::StatusOr<CudaKernelPlan> plan = PlanOnCurrentDevice(g, options);
                         return plan.ok() ? plan->DecodeSplits(batch, max_length) : 0;
                       },
                       [options](const DcaGeometry& g, const CudaDecodeParams& p,
                                 cudaStream_t stream) -> absl::Status {
                         absl::StatusOr<CudaKernelPlan> plan = PlanOnCurrentDevice(g, options);
                         if (!plan.ok()) return plan.status();
                         return LaunchDcaDecode(*plan, p, stream);
                       }});
  }
  return kernels;
}

}  // namespace attnd::gpu_test
