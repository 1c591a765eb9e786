// The decode launchers of dca_cuda.h: the split-K kernel (bf16, int8 and fp8 pools) and its
// reduction, their shared-memory limits and occupancy.
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

using cuda_launch::CheckDecode;
using cuda_launch::DecodeArgsFor;
using cuda_launch::LaunchAfterPrevious;

// The decode kernel: 4 warps, 64-key tiles, a ring of Stages (2 or 3).
constexpr int kDecodeWarps = 4;
template <int D, int Stages, typename KvT = Bf16>
constexpr auto DecodeKernel() {
  return cuda_kernels::DcaDecodePipeKernel<D, kDecodeWarps, Stages, KvT>;
}
template <typename KvT = Bf16>
size_t DecodeSmemBytes(const DcaGeometry& g, int stages) {
  if constexpr (kScaledKv<KvT>) {
    return cuda_kernels::DecodePipeCodesSmemBytes(g.head_dim, kDecodeWarps, stages, g.group_size());
  }
  return cuda_kernels::DecodePipeSmemBytes(g.head_dim, kDecodeWarps, stages, g.group_size());
}

// The decode kernels' shared-memory limits for KvT, and their occupancy at this geometry (blocks
// per multiprocessor, ring depth 2 and 3).
template <int D, typename KvT>
absl::Status PrepareDecodeKernelsFor(const DcaGeometry& g, int32_t* blocks_s2, int32_t* blocks_s3) {
  const size_t smem2 = DecodeSmemBytes<KvT>(g, 2), smem3 = DecodeSmemBytes<KvT>(g, 3);
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(DecodeKernel<D, 2, KvT>(),
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(smem2)));
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(DecodeKernel<D, 3, KvT>(),
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(smem3)));
  int n2 = 0, n3 = 0;
  ATTND_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n2, DecodeKernel<D, 2, KvT>(), 32 * kDecodeWarps, smem2));
  ATTND_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n3, DecodeKernel<D, 3, KvT>(), 32 * kDecodeWarps, smem3));
  *blocks_s2 = std::max(1, n2);
  *blocks_s3 = std::max(1, n3);
  return absl::OkStatus();
}

template <int D, int Stages, typename KvT>
absl::Status LaunchDecodeTyped(const CudaKernelPlan& plan, const CudaDecodeParamsOf<KvT>& p,
                               cudaStream_t stream) {
  const DcaGeometry& g = plan.geometry();
  cuda_kernels::DecodeArgsOf<KvT> a = DecodeArgsFor(g, p);
  a.min_split_keys = plan.DecodeMinSplitKeys();
  // One split per row (large batches): each block's merge is its rows' output, stored directly.
  a.direct_out = p.max_splits == 1;
  a.out = p.out;
  a.out_dtype = static_cast<int32_t>(p.out_dtype);
  a.row_outs = p.row_outs;
  const auto kernel = DecodeKernel<D, Stages, KvT>();
  ATTND_CUDA_RETURN_IF_ERROR(
      LaunchAfterPrevious(kernel, dim3(p.max_splits, g.num_kv_heads, p.batch),
                          dim3(32 * kDecodeWarps), DecodeSmemBytes<KvT>(g, Stages), stream, a));
  if (a.direct_out) return absl::OkStatus();
  ATTND_CUDA_RETURN_IF_ERROR(LaunchAfterPrevious(
      cuda_kernels::DcaDecodeReduceKernel<D>, dim3(p.batch, g.num_q_heads),
      dim3(cuda_kernels::kDecodeReduceThreads), 0, stream, static_cast<const float*>(p.partial_out),
      static_cast<const float*>(p.partial_lse), static_cast<const int32_t*>(p.lengths),
      static_cast<int>(p.max_splits), 16 * kDecodeWarps, static_cast<int>(a.min_split_keys), p.out,
      static_cast<int>(p.out_dtype), static_cast<const DecodeRowOut*>(p.row_outs)));
  return absl::OkStatus();
}

}  // namespace

namespace cuda_families {

absl::Status PrepareDecodeKernels(const DcaGeometry& g, DType kv_dtype, int32_t* blocks_s2,
                                  int32_t* blocks_s3) {
  return WithHeadDim(g.head_dim, [&](auto dim) -> absl::Status {
    constexpr int D = decltype(dim)::value;
    // Every kernel is prepared (any may be launched on this plan's geometry); the plan's dtype
    // gives the occupancy.
    int32_t int8_s2 = 1, int8_s3 = 1, fp8_s2 = 1, fp8_s3 = 1;
    ATTND_RETURN_IF_ERROR((PrepareDecodeKernelsFor<D, Int8Kv>(g, &int8_s2, &int8_s3)));
    ATTND_RETURN_IF_ERROR((PrepareDecodeKernelsFor<D, Fp8E4m3>(g, &fp8_s2, &fp8_s3)));
    ATTND_RETURN_IF_ERROR((PrepareDecodeKernelsFor<D, Bf16>(g, blocks_s2, blocks_s3)));
    if (kv_dtype == DType::kInt8) {
      *blocks_s2 = int8_s2;
      *blocks_s3 = int8_s3;
    } else if (kv_dtype == DType::kFp8E4m3) {
      *blocks_s2 = fp8_s2;
      *blocks_s3 = fp8_s3;
    }
    return absl::OkStatus();
  });
}

}  // namespace cuda_families

namespace {

template <typename KvT>
absl::Status LaunchDcaDecodeOf(const CudaKernelPlan& plan, const CudaDecodeParamsOf<KvT>& p,
                               cudaStream_t stream) {
  const DcaGeometry& g = plan.geometry();
  ATTND_RETURN_IF_ERROR(CheckDecode(g, p));
  if (p.max_splits < 1 || p.max_splits > cuda_kernels::kDecodeReduceMaxSplits ||
      p.partial_out == nullptr || p.partial_lse == nullptr) {
    return absl::InvalidArgumentError("decode: bad max_splits or null workspace");
  }
  const bool three = plan.DecodeStages(p.planned_batch > 0 ? p.planned_batch : p.batch) == 3;
  return WithHeadDim(g.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    return three ? LaunchDecodeTyped<D, 3>(plan, p, stream)
                 : LaunchDecodeTyped<D, 2>(plan, p, stream);
  });
}

}  // namespace

absl::Status LaunchDcaDecode(const CudaKernelPlan& plan, const CudaDecodeParams& p,
                             cudaStream_t stream) {
  return LaunchDcaDecodeOf(plan, p, stream);
}

absl::Status LaunchDcaDecode(const CudaKernelPlan& plan, const CudaDecodeParamsOf<Int8Kv>& p,
                             cudaStream_t stream) {
  return LaunchDcaDecodeOf(plan, p, stream);
}

absl::Status LaunchDcaDecode(const CudaKernelPlan& plan, const CudaDecodeParamsOf<Fp8E4m3>& p,
                             cudaStream_t stream) {
  return LaunchDcaDecodeOf(plan, p, stream);
}

}  // namespace attnd
