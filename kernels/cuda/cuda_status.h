// CUDA runtime errors as absl::Status: the one place where a cudaError_t becomes a Status.
#ifndef ATTND_KERNELS_CUDA_CUDA_STATUS_H_
#define ATTND_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnd {

// INTERNAL "<what>: <cuda error name>: <description>" for a failed call; OK for cudaSuccess.
inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

}  // namespace attnd

// Evaluates a CUDA runtime call; returns INTERNAL from the enclosing function when it fails.
#define ATTND_CUDA_RETURN_IF_ERROR(expr)                                                    \
  do {                                                                                      \
    const cudaError_t attnd_cuda_err_ = (expr);                                             \
    if (attnd_cuda_err_ != cudaSuccess) return ::attnd::CudaStatus(attnd_cuda_err_, #expr); \
  } while (0)

// After a kernel launch: returns INTERNAL naming `what` when the launch failed (bad configuration,
// no device, too much shared memory...).
#define ATTND_CUDA_RETURN_IF_LAUNCH_ERROR(what)                                            \
  do {                                                                                     \
    const cudaError_t attnd_cuda_err_ = cudaGetLastError();                                \
    if (attnd_cuda_err_ != cudaSuccess) return ::attnd::CudaStatus(attnd_cuda_err_, what); \
  } while (0)

#endif  // ATTND_KERNELS_CUDA_CUDA_STATUS_H_
