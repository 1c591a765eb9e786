// How the kernel families' files (dca_prefill.cu, dca_decode.cu) prepare their kernels for a
// CudaKernelPlan (dca_plan.cu). Internal to //kernels/cuda.
#ifndef ATTND_KERNELS_CUDA_DCA_FAMILIES_H_
#define ATTND_KERNELS_CUDA_DCA_FAMILIES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "kernels/dca.h"

namespace attnd {
namespace cuda_families {

// Sets the prefill kernels' dynamic shared-memory limits on the current device (the wgmma kernel's
// only when `wgmma`).
absl::Status PreparePrefillKernels(const DcaGeometry& geometry, bool wgmma);

// Sets both decode kernels' limits for both pool dtypes on the current device (so either may be
// launched) and reads the occupancy (blocks per multiprocessor, ring depth 2 and 3) of the decode
// kernel for kv_dtype.
absl::Status PrepareDecodeKernels(const DcaGeometry& geometry, DType kv_dtype, int32_t* blocks_s2,
                                  int32_t* blocks_s3);

}  // namespace cuda_families
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_DCA_FAMILIES_H_
