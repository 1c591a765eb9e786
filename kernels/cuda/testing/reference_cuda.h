// Simple reference kernels of the CUDA DCA attention, for the kernels' tests: one warp per query
// row (prefill) or per (sequence, q head) (decode), scalar fp32 with an online softmax, no tiling.
// Slow. They read the product's layouts (CudaPrefillParams, CudaDecodeParams) so a test runs them
// on the same buffers as the kernels it checks; nothing in the daemon links them.
#ifndef ATTND_KERNELS_CUDA_TESTING_REFERENCE_CUDA_H_
#define ATTND_KERNELS_CUDA_TESTING_REFERENCE_CUDA_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/dca.h"

namespace attnd {

absl::Status LaunchDcaPrefillReference(const DcaGeometry& geometry, const CudaPrefillParams& params,
                                       cudaStream_t stream);

// Ignores the workspace and row_outs.
absl::Status LaunchDcaDecodeReference(const DcaGeometry& geometry, const CudaDecodeParams& params,
                                      cudaStream_t stream);

}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_TESTING_REFERENCE_CUDA_H_
