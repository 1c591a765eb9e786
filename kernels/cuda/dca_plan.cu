// CudaKernelPlan (dca_cuda.h): the device's properties, the kernels' attributes and occupancy,
// read once; the decode ring depth and split-K plan; the supported geometries.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/cuda/dca_cuda_kernels.cuh"
#include "kernels/cuda/dca_cuda_launch.cuh"
#include "kernels/cuda/dca_families.h"
#include "kernels/cuda/head_dim.h"

namespace attnd {
namespace {

using cuda_launch::kMaxPosition;

// Restores the calling thread's current device when it leaves scope.
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() { ok_ = cudaGetDevice(&saved_) == cudaSuccess; }
  ~CurrentDeviceGuard() {
    if (ok_) cudaSetDevice(saved_);
  }

 private:
  int saved_ = 0;
  bool ok_ = false;
};

}  // namespace

const char* PrefillKernelName(PrefillKernel kernel) {
  switch (kernel) {
    case PrefillKernel::kWgmma:
      return "wgmma";
    case PrefillKernel::kMmaSync:
      return "mma.sync";
  }
  return "unknown";
}

absl::StatusOr<CudaKernelPlan> CudaKernelPlan::Create(const DcaGeometry& g, int device,
                                                      const CudaKernelPlanOptions& options) {
  ATTND_RETURN_IF_ERROR(CheckCudaGeometry(g));
  if (options.prefill != PrefillKernel::kWgmma && options.prefill != PrefillKernel::kMmaSync) {
    return absl::InvalidArgumentError("kernel plan: unknown prefill kernel");
  }
  if (options.decode_stages != 0 && options.decode_stages != 2 && options.decode_stages != 3) {
    return absl::InvalidArgumentError(absl::StrCat("kernel plan: decode_stages ",
                                                   options.decode_stages,
                                                   " unsupported (0 = by batch, 2 or 3)"));
  }
  if (options.kv_dtype != DType::kBf16 && options.kv_dtype != DType::kInt8 &&
      options.kv_dtype != DType::kFp8E4m3) {
    return absl::InvalidArgumentError(absl::StrCat("kernel plan: KV dtype ",
                                                   DTypeName(options.kv_dtype),
                                                   " unsupported (bf16, int8 or fp8_e4m3)"));
  }
  const int32_t min_keys = options.decode_min_split_keys;
  if (min_keys != 0 && (min_keys < 64 || min_keys > 65536 || min_keys % 64 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("kernel plan: decode_min_split_keys ", min_keys,
                                                   " not a multiple of 64 in 64..65536 (or 0)"));
  }
  CudaKernelPlan plan;
  plan.geometry_ = g;
  plan.decode_min_split_keys_ = min_keys != 0 ? min_keys : kMinSplitKeys;
  plan.kv_dtype_ = options.kv_dtype;
  plan.device_ = device;
  plan.decode_stages_ = options.decode_stages;
  CurrentDeviceGuard guard;
  int major = 0, minor = 0, sms = 0;
  if (cudaSetDevice(device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error behind
    return absl::InternalError(absl::StrCat("kernel plan: cannot read CUDA device ", device));
  }
  plan.num_sms_ = sms;
  // The wgmma kernel exists as sm_90a machine code only.
  plan.prefill_ = options.prefill == PrefillKernel::kWgmma && major == 9 && minor == 0
                      ? PrefillKernel::kWgmma
                      : PrefillKernel::kMmaSync;
  const bool wgmma = plan.prefill_ == PrefillKernel::kWgmma;
  ATTND_RETURN_IF_ERROR(cuda_families::PreparePrefillKernels(g, wgmma));
  ATTND_RETURN_IF_ERROR(
      cuda_families::PrepareDecodeKernels(g, plan.kv_dtype_, &plan.blocks_s2_, &plan.blocks_s3_));
  return plan;
}

int32_t CudaKernelPlan::DecodeStages(int32_t batch) const {
  if (decode_stages_ != 0) return decode_stages_;
  const int64_t blocks = int64_t{std::max(1, batch)} * std::max(1, geometry_.num_kv_heads);
  return blocks > int64_t{std::max(1, num_sms_)} * blocks_s2_ ? 3 : 2;
}

int32_t DecodeSplitsFor(const DcaGeometry& g, int32_t num_sms, int32_t blocks_per_sm, int32_t batch,
                        int64_t max_length, int32_t min_split_keys) {
  const int64_t resident = int64_t{std::max(1, num_sms)} * std::max(1, blocks_per_sm);
  const int64_t blocks = std::max<int64_t>(1, int64_t{batch} * std::max(1, g.num_kv_heads));
  const int64_t want = resident / blocks;  // splits that still fit in one wave
  // At least the minimum keys per split (DecodeSplitLen) in every split.
  const int64_t min_keys = std::max(1, min_split_keys);
  const int64_t cap = std::max<int64_t>(1, (max_length + min_keys - 1) / min_keys);
  return static_cast<int32_t>(std::clamp<int64_t>(want, 1, std::min<int64_t>(cap, 1024)));
}

int32_t CudaKernelPlan::DecodeSplits(int32_t batch, int64_t max_length) const {
  return DecodeSplitsFor(geometry_, num_sms_, DecodeBlocksPerSm(DecodeStages(batch)), batch,
                         max_length, decode_min_split_keys_);
}

size_t CudaKernelPlan::DecodeWorkspaceFloats(int32_t batch, int32_t max_splits) const {
  const size_t slots = static_cast<size_t>(batch) * geometry_.num_q_heads * max_splits;
  return slots * geometry_.head_dim + slots;
}

absl::Status CheckCudaGeometry(const DcaGeometry& g) {
  if (!SupportedHeadDim(g.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda: head_dim ", g.head_dim, " unsupported (supported: ", kSupportedHeadDims, ")"));
  }
  if (g.num_kv_heads < 1 || g.num_q_heads < g.num_kv_heads || g.num_q_heads % g.num_kv_heads != 0 ||
      g.group_size() > 16) {
    return absl::InvalidArgumentError(absl::StrCat("cuda: ", g.num_q_heads, " q heads / ",
                                                   g.num_kv_heads,
                                                   " kv heads unsupported (group size 1..16)"));
  }
  if (g.chunk_len < 1 || g.chunk_len > kMaxPosition) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: chunk_len ", g.chunk_len, " out of range"));
  }
  return absl::OkStatus();
}

}  // namespace attnd
