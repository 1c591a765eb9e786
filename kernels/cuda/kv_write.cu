// The KV writes and conversions of dca_cuda.h: prefill and decode appends (bf16, int8 and fp8), the
// decode step's staging and quantisation, the scaled pools' dequantisation and bf16 conversion.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/cuda/dca_cuda_launch.cuh"
#include "kernels/cuda/head_dim.h"
#include "kernels/cuda/kv_write_kernels.cuh"

namespace attnd {

using cuda_launch::kMaxPosition;
using cuda_launch::LaunchAfterPrevious;

absl::Status LaunchAppendKv(const CudaAppendParams& p, cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.page_table == nullptr || p.k == nullptr ||
      p.v == nullptr || !IsKnownDType(p.in_dtype) || p.start < 0 || p.num_tokens < 0 ||
      p.start + p.num_tokens > kMaxPosition) {
    return absl::InvalidArgumentError("append: bad params");
  }
  if (p.num_tokens == 0) return absl::OkStatus();
  const int64_t n = p.num_tokens * p.kv.num_kv_heads * p.kv.head_dim;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 65536);
  cuda_kernels::AppendKvKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      p.kv, p.k, p.v, static_cast<int>(p.in_dtype), static_cast<int32_t>(p.start), n, p.key_scale);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("AppendKvKernel");
  return absl::OkStatus();
}

namespace {

// The name of a scaled code type in launch errors.
template <typename CodeT>
constexpr const char* CodeName() {
  return std::is_same<CodeT, Int8Kv>::value ? "int8" : "fp8";
}

template <typename CodeT>
absl::Status LaunchAppendCodes(const CudaAppendParamsOf<CodeT>& p, cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.k_scale == nullptr ||
      p.kv.v_scale == nullptr || p.kv.page_table == nullptr || p.k == nullptr || p.v == nullptr ||
      !IsKnownDType(p.in_dtype) || HasRowScale(p.in_dtype) || p.start < 0 || p.num_tokens < 0 ||
      p.start + p.num_tokens > kMaxPosition || !SupportedHeadDim(p.kv.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "append (", CodeName<CodeT>(),
        "): bad params (null pointers or scales, input dtype, range, or head_dim not 64 or 128)"));
  }
  if (p.num_tokens == 0) return absl::OkStatus();
  const int64_t rows = p.num_tokens * p.kv.num_kv_heads;  // one warp each, 4 a block
  const int64_t blocks = std::min<int64_t>((rows + 3) / 4, 65536);
  WithHeadDim(p.kv.head_dim, [&](auto dim) {
    cuda_kernels::AppendKvCodesKernel<decltype(dim)::value, CodeT>
        <<<static_cast<unsigned>(blocks), 128, 0, stream>>>(
            p.kv, p.k, p.v, static_cast<int>(p.in_dtype), static_cast<int32_t>(p.start), rows,
            p.key_scale);
  });
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("AppendKvCodesKernel");
  return absl::OkStatus();
}

template <typename CodeT>
absl::Status LaunchDecodeAppendCodes(const CudaDecodeAppendParamsOf<CodeT>& p,
                                     cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.k_scale == nullptr ||
      p.kv.v_scale == nullptr || p.kv.page_tables == nullptr || p.lengths == nullptr ||
      p.k == nullptr || p.v == nullptr || !IsKnownDType(p.in_dtype) || HasRowScale(p.in_dtype) ||
      p.batch < 0 || !SupportedHeadDim(p.kv.head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode append (", CodeName<CodeT>(), "): bad params"));
  }
  if (p.batch == 0) return absl::OkStatus();
  WithHeadDim(p.kv.head_dim, [&](auto dim) {
    cuda_kernels::DecodeAppendKvCodesKernel<decltype(dim)::value, CodeT>
        <<<p.batch, 128, 0, stream>>>(p.kv, p.lengths, p.k, p.v, static_cast<int>(p.in_dtype),
                                      p.original_max_position_embeddings);
  });
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DecodeAppendKvCodesKernel");
  return absl::OkStatus();
}

template <typename CodeT>
absl::Status LaunchDecodeQuantizeRowsOf(const CudaDecodeQuantizeRowsParamsOf<CodeT>& p,
                                        cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.k_scale == nullptr ||
      p.kv.v_scale == nullptr || p.kv.page_tables == nullptr || p.lengths == nullptr ||
      p.kv_rows == nullptr || p.batch < 0 || p.batch > 65535 || !SupportedHeadDim(p.kv.head_dim)) {
    return absl::InvalidArgumentError("decode quantize rows: bad params");
  }
  if (p.batch == 0) return absl::OkStatus();
  ATTND_CUDA_RETURN_IF_ERROR(WithHeadDim(p.kv.head_dim, [&](auto dim) {
    return LaunchAfterPrevious(cuda_kernels::DecodeQuantizeRowsKernel<decltype(dim)::value, CodeT>,
                               dim3(p.batch), dim3(128), 0, stream, p.kv, p.lengths, p.kv_rows);
  }));
  return absl::OkStatus();
}

template <typename CodeT>
absl::Status LaunchDequantizeKvOf(const CudaDequantizeKvParamsOf<CodeT>& p, cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.k_scale == nullptr ||
      p.kv.v_scale == nullptr || p.kv.page_table == nullptr || p.k_out == nullptr ||
      p.v_out == nullptr || p.num_tokens < 0 || p.num_tokens > kMaxPosition ||
      p.kv.head_dim % 8 != 0 || reinterpret_cast<uintptr_t>(p.k_out) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.v_out) % 16 != 0) {
    return absl::InvalidArgumentError(
        "dequantize: bad params (null pointers or scales, 16-byte aligned outputs, head_dim a "
        "multiple of 8)");
  }
  if (p.num_tokens == 0) return absl::OkStatus();
  const int64_t pieces = p.num_tokens * p.kv.num_kv_heads * (p.kv.head_dim / 8);
  const int64_t blocks = std::min<int64_t>((pieces + 255) / 256, 65536);
  cuda_kernels::DequantizeKvKernel<CodeT>
      <<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p.kv, p.k_out, p.v_out, pieces);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DequantizeKvKernel");
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchAppendKv(const CudaAppendParamsOf<Int8Kv>& p, cudaStream_t stream) {
  return LaunchAppendCodes(p, stream);
}
absl::Status LaunchAppendKv(const CudaAppendParamsOf<Fp8E4m3>& p, cudaStream_t stream) {
  return LaunchAppendCodes(p, stream);
}
absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParamsOf<Int8Kv>& p, cudaStream_t stream) {
  return LaunchDecodeAppendCodes(p, stream);
}
absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParamsOf<Fp8E4m3>& p, cudaStream_t stream) {
  return LaunchDecodeAppendCodes(p, stream);
}
absl::Status LaunchDecodeQuantizeRows(const CudaDecodeQuantizeRowsParamsOf<Int8Kv>& p,
                                      cudaStream_t stream) {
  return LaunchDecodeQuantizeRowsOf(p, stream);
}
absl::Status LaunchDecodeQuantizeRows(const CudaDecodeQuantizeRowsParamsOf<Fp8E4m3>& p,
                                      cudaStream_t stream) {
  return LaunchDecodeQuantizeRowsOf(p, stream);
}
absl::Status LaunchDequantizeKv(const CudaDequantizeKvParamsOf<Int8Kv>& p, cudaStream_t stream) {
  return LaunchDequantizeKvOf(p, stream);
}
absl::Status LaunchDequantizeKv(const CudaDequantizeKvParamsOf<Fp8E4m3>& p, cudaStream_t stream) {
  return LaunchDequantizeKvOf(p, stream);
}

absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParams& p, cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.page_tables == nullptr ||
      p.lengths == nullptr || p.k == nullptr || p.v == nullptr || !IsKnownDType(p.in_dtype) ||
      p.batch < 0) {
    return absl::InvalidArgumentError("decode append: bad params");
  }
  if (p.batch == 0) return absl::OkStatus();
  cuda_kernels::DecodeAppendKvKernel<<<p.batch, 128, 0, stream>>>(
      p.kv, p.lengths, p.k, p.v, static_cast<int>(p.in_dtype), p.original_max_position_embeddings);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DecodeAppendKvKernel");
  return absl::OkStatus();
}

absl::Status LaunchDecodeStage(const CudaDecodeStageParams& p, cudaStream_t stream) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool float_rows = p.kv_rows != nullptr;
  const CudaDecodeStageParams::Rotary& rot = p.rotary;
  if (rot.inv_freq != nullptr && (rot.half < 1 || 2 * rot.half > p.kv.head_dim ||
                                  rot.chunk_len < 1 || rot.chunk_size < rot.chunk_len)) {
    return absl::InvalidArgumentError(
        "decode stage: bad rotary (half of rotary_dim in 1..head_dim / 2, 1 <= chunk_len <= "
        "chunk_size)");
  }
  if ((!float_rows && (p.kv.k == nullptr || p.kv.v == nullptr)) || !aligned(p.kv_rows) ||
      p.kv.page_tables == nullptr || p.kv.page_table_stride < 4 ||
      p.kv.page_table_stride % 4 != 0 || p.kv.head_dim % 8 != 0 || p.rows == nullptr ||
      p.host_tables == nullptr || p.host_q == nullptr || p.host_k == nullptr ||
      p.host_v == nullptr || p.lengths == nullptr || p.q == nullptr || !aligned(p.kv.page_tables) ||
      !aligned(p.host_tables) || !aligned(p.host_q) || !aligned(p.host_k) || !aligned(p.host_v) ||
      !aligned(p.q) || p.q_row_bytes % 16 != 0 || p.kv_row_bytes % 16 != 0 || p.num_q_heads < 1 ||
      p.batch < 0 || p.batch > 65535 ||
      p.q_row_bytes < int64_t{3} * p.num_q_heads * p.kv.head_dim * 4 ||
      p.kv_row_bytes < int64_t{p.kv.num_kv_heads} * p.kv.head_dim * 4) {
    return absl::InvalidArgumentError(
        "decode stage: bad params (null or unaligned pointers, a page-table stride that is not a "
        "multiple of 4, or row slots smaller than fp32 rows)");
  }
  if (p.batch == 0) return absl::OkStatus();
  if (float_rows) {
    ATTND_CUDA_RETURN_IF_ERROR(LaunchAfterPrevious(
        cuda_kernels::DecodeStageFloatRowsKernel,
        dim3(cuda_kernels::DecodeStageBlocksPerRow(p.batch), p.batch),
        dim3(cuda_kernels::kDecodeStageThreads), 0, stream, p.kv, p.rows, p.host_tables,
        static_cast<const char*>(p.host_q), static_cast<const char*>(p.host_k),
        static_cast<const char*>(p.host_v), p.q_row_bytes, p.kv_row_bytes, p.lengths, p.q,
        p.row_outs, p.num_q_heads, p.original_max_position_embeddings, p.kv_rows, p.rotary));
    return absl::OkStatus();
  }
  ATTND_CUDA_RETURN_IF_ERROR(LaunchAfterPrevious(
      cuda_kernels::DecodeStageKernel,
      dim3(cuda_kernels::DecodeStageBlocksPerRow(p.batch), p.batch),
      dim3(cuda_kernels::kDecodeStageThreads), 0, stream, p.kv, p.rows, p.host_tables,
      static_cast<const char*>(p.host_q), static_cast<const char*>(p.host_k),
      static_cast<const char*>(p.host_v), p.q_row_bytes, p.kv_row_bytes, p.lengths, p.q, p.row_outs,
      p.num_q_heads, p.original_max_position_embeddings, p.rotary));
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DecodeStageKernel");
  return absl::OkStatus();
}

absl::Status LaunchConvertToBf16(const void* src, DType src_dtype, int64_t n, Bf16* dst,
                                 cudaStream_t stream) {
  if (src == nullptr || dst == nullptr || !IsKnownDType(src_dtype) || n < 0) {
    return absl::InvalidArgumentError("convert: bad params");
  }
  if (n == 0) return absl::OkStatus();
  if (src_dtype == DType::kBf16) {
    ATTND_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, n * sizeof(Bf16), cudaMemcpyDeviceToDevice, stream));
    return absl::OkStatus();
  }
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 65536);
  cuda_kernels::ConvertToBf16Kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      src, static_cast<int>(src_dtype), n, dst);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("ConvertToBf16Kernel");
  return absl::OkStatus();
}

}  // namespace attnd
