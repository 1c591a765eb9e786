// The CUDA backend's entry points in a build without a CUDA toolkit (server/engine/BUILD picks this
// file when third_party/cuda_configure.bzl found none): no device is ever usable, so --device=auto
// picks the CPU, and --device=cuda fails at start-up saying how to get a build that has the
// backend.
#include "server/engine/cuda_engine.h"

namespace attnd {

absl::Status CudaBuildStatus() {
  return absl::FailedPreconditionError(
      "the cuda backend: attnd was built without CUDA (no toolkit found at build time); rebuild "
      "with "
      "a "
      "CUDA toolkit >= 12 (see docs/BUILD.md)");
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(const CudaEngineOptions&) {
  return CudaBuildStatus();
}

absl::StatusOr<std::vector<uint8_t>> CopyCudaPoolForTesting(Engine&) { return CudaBuildStatus(); }

int CudaDeviceCount() { return 0; }

absl::StatusOr<int64_t> CudaFreeMemoryBytes(int32_t) { return CudaBuildStatus(); }

}  // namespace attnd
