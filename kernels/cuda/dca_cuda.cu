// Launch functions for dca_cuda.h: the plan (device properties, occupancy, kernel attributes, all
// read once), size checks, the head_dim dispatch and the grids.
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
#include "kernels/cuda/head_dim.h"
#include "kernels/cuda/kv_write_kernels.cuh"
#include "kernels/cuda/prefill_wgmma.cuh"

namespace attnd {
namespace {

using cuda_launch::CheckDecode;
using cuda_launch::CheckPrefill;
using cuda_launch::DecodeArgsFor;
using cuda_launch::kMaxPosition;
using cuda_launch::PlanPrefill;

// The mma.sync fallback: 4 warps of two 16-row m-tiles (128 query rows), 64-key K/V tiles in a
// 2-deep cp.async ring.
constexpr int kMmaWarps = 4, kMmaStages = 2, kMmaTiles = 2, kMmaBlockN = 64;
template <int D>
constexpr size_t MmaPrefillSmemBytes() {
  return (2 * kMmaStages * kMmaBlockN + 16 * kMmaTiles * kMmaWarps) * (D + 8) * sizeof(Bf16);
}
template <int D, bool kWindowed = false>
constexpr auto MmaPrefillKernel() {
  return cuda_kernels::DcaPrefillKernel<D, kMmaWarps, kMmaStages, kMmaTiles, kMmaBlockN, kWindowed>;
}
// Bytes of window state per prefill block of the plan's kernel.
size_t PrefillStateBlockBytes(const CudaKernelPlan& plan, int d) {
  namespace wg = cuda_kernels::wgmma;
  if (plan.prefill_kernel() == PrefillKernel::kWgmma) {
    return sizeof(float) * wg::kThreads *
           WithHeadDim(d, [](auto dim) { return wg::kPrefillStateFields<decltype(dim)::value>; });
  }
  return sizeof(float) * 32 * kMmaWarps * cuda_kernels::PrefillStateFields(d, kMmaTiles);
}
// Query rows per prefill block (both kernels: 128).
constexpr int kMmaBlockM = 16 * kMmaTiles * kMmaWarps;
static_assert(kMmaBlockM == cuda_kernels::wgmma::kBlockM, "PrefillWindowStateBytes: block rows");

// INVALID_ARGUMENT unless a windowed launch of `tiles` query tiles has its state workspace.
absl::Status CheckWindowState(const CudaKernelPlan& plan, const CudaPrefillParams& p,
                              int64_t tiles) {
  const size_t need = static_cast<size_t>(tiles) * plan.geometry().num_kv_heads *
                      PrefillStateBlockBytes(plan, plan.geometry().head_dim);
  if (p.window_state == nullptr || reinterpret_cast<uintptr_t>(p.window_state) % 4 != 0 ||
      p.window_state_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill: key tile window [", p.key_tile_begin, ", ", p.key_tile_end,
        ") needs window_state, 4-byte aligned, of at least ", need,
        " bytes (PrefillWindowStateBytes); got ", p.window_state == nullptr ? "null" : "a pointer",
        " of ", p.window_state_bytes, " bytes"));
  }
  return absl::OkStatus();
}
// The decode kernel: 4 warps, 64-key tiles, a ring of Stages (2 or 3).
constexpr int kDecodeWarps = 4;
template <int D, int Stages, typename KvT = Bf16>
constexpr auto DecodeKernel() {
  return cuda_kernels::DcaDecodePipeKernel<D, kDecodeWarps, Stages, KvT>;
}
template <typename KvT = Bf16>
size_t DecodeSmemBytes(const DcaGeometry& g, int stages) {
  if constexpr (std::is_same<KvT, Int8Kv>::value) {
    return cuda_kernels::DecodePipeInt8SmemBytes(g.head_dim, kDecodeWarps, stages, g.group_size());
  }
  return cuda_kernels::DecodePipeSmemBytes(g.head_dim, kDecodeWarps, stages, g.group_size());
}

// The decode kernels' shared-memory limits for KvT, and their occupancy at this geometry (blocks
// per multiprocessor, ring depth 2 and 3).
template <int D, typename KvT>
absl::Status PrepareDecodeKernels(const DcaGeometry& g, int32_t* blocks_s2, int32_t* blocks_s3) {
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

// Sets the kernels' dynamic shared-memory limits on the current device (both decode kernels, so
// either may be launched) and reads the occupancy of the decode kernel for kv_dtype.
template <int D>
absl::Status PrepareKernels(const DcaGeometry& g, bool wgmma, DType kv_dtype, int32_t* blocks_s2,
                            int32_t* blocks_s3) {
  if (wgmma) {
    constexpr size_t smem = cuda_kernels::wgmma::PrefillSmemBytes<D>();
    static_assert(smem <= 227 * 1024, "wgmma prefill: shared memory");
    ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(cuda_kernels::wgmma::DcaPrefillWgmmaKernel<D>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(smem)));
  }
  if (wgmma) {
    ATTND_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(cuda_kernels::wgmma::DcaPrefillWgmmaKernel<D, true>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(cuda_kernels::wgmma::PrefillSmemBytes<D>())));
  }
  for (const auto kernel : {MmaPrefillKernel<D>(), MmaPrefillKernel<D, true>()}) {
    ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(MmaPrefillSmemBytes<D>())));
  }
  int32_t int8_s2 = 1, int8_s3 = 1;
  ATTND_RETURN_IF_ERROR((PrepareDecodeKernels<D, Int8Kv>(g, &int8_s2, &int8_s3)));
  ATTND_RETURN_IF_ERROR((PrepareDecodeKernels<D, Bf16>(g, blocks_s2, blocks_s3)));
  if (kv_dtype == DType::kInt8) {
    *blocks_s2 = int8_s2;
    *blocks_s3 = int8_s3;
  }
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchMmaPrefill(const CudaKernelPlan& plan, const CudaPrefillParams& p, bool windowed,
                              cudaStream_t stream) {
  const DcaGeometry& g = plan.geometry();
  cuda_kernels::PrefillArgs a;
  int64_t tiles = 0;
  ATTND_RETURN_IF_ERROR(PlanPrefill(g, p, kMmaBlockM, &a, &tiles));
  if (windowed) ATTND_RETURN_IF_ERROR(CheckWindowState(plan, p, tiles));
  const auto kernel = windowed ? MmaPrefillKernel<D, true>() : MmaPrefillKernel<D>();
  kernel<<<dim3(static_cast<unsigned>(tiles), g.num_kv_heads), 32 * kMmaWarps,
           MmaPrefillSmemBytes<D>(), stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaPrefillKernel");
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchWgmmaPrefill(const CudaKernelPlan& plan, const CudaPrefillParams& p,
                                bool windowed, cudaStream_t stream) {
  namespace wg = cuda_kernels::wgmma;
  const DcaGeometry& g = plan.geometry();
  cuda_kernels::PrefillArgs a;
  int64_t tiles = 0;
  ATTND_RETURN_IF_ERROR(PlanPrefill(g, p, wg::kBlockM, &a, &tiles));
  if (windowed) ATTND_RETURN_IF_ERROR(CheckWindowState(plan, p, tiles));
  const auto kernel = windowed ? wg::DcaPrefillWgmmaKernel<D, true> : wg::DcaPrefillWgmmaKernel<D>;
  kernel<<<dim3(static_cast<unsigned>(tiles), g.num_kv_heads), wg::kPrefillThreads,
           wg::PrefillSmemBytes<D>(), stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaPrefillWgmmaKernel");
  return absl::OkStatus();
}

// Launches a kernel of a decode step after the step's previous kernel on `stream`, with
// programmatic dependent launch on sm_90+ (the kernel starts with StepKernelEntry): its blocks are
// queued while the previous kernel runs, at the stream's priority, so a lower-priority stream's
// blocks cannot take the multiprocessors in between. Elsewhere a plain launch.
template <typename... Params, typename... Args>
cudaError_t LaunchAfterPrevious(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, Args&&... args) {
  thread_local int last_device = -1, last_major = 0;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess && device != last_device) {
    last_major = 0;
    cudaDeviceGetAttribute(&last_major, cudaDevAttrComputeCapabilityMajor, device);
    last_device = device;
  }
  if (last_major < 9) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <int D, int Stages, typename KvT>
absl::Status LaunchDecodeTyped(const DcaGeometry& g, const CudaDecodeParamsOf<KvT>& p,
                               cudaStream_t stream) {
  const cuda_kernels::DecodeArgsOf<KvT> a = DecodeArgsFor(g, p);
  const auto kernel = DecodeKernel<D, Stages, KvT>();
  ATTND_CUDA_RETURN_IF_ERROR(
      LaunchAfterPrevious(kernel, dim3(p.max_splits, g.num_kv_heads, p.batch),
                          dim3(32 * kDecodeWarps), DecodeSmemBytes<KvT>(g, Stages), stream, a));
  ATTND_CUDA_RETURN_IF_ERROR(LaunchAfterPrevious(
      cuda_kernels::DcaDecodeReduceKernel<D>, dim3(p.batch, g.num_q_heads), dim3(D), 0, stream,
      static_cast<const float*>(p.partial_out), static_cast<const float*>(p.partial_lse),
      static_cast<const int32_t*>(p.lengths), static_cast<int>(p.max_splits), 16 * kDecodeWarps,
      p.out, static_cast<int>(p.out_dtype), static_cast<const DecodeRowOut*>(p.row_outs)));
  return absl::OkStatus();
}

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
  if (options.kv_dtype != DType::kBf16 && options.kv_dtype != DType::kInt8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kernel plan: KV dtype ", DTypeName(options.kv_dtype), " unsupported (bf16 or int8)"));
  }
  CudaKernelPlan plan;
  plan.geometry_ = g;
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
  ATTND_RETURN_IF_ERROR(WithHeadDim(g.head_dim, [&](auto dim) {
    return PrepareKernels<decltype(dim)::value>(g, wgmma, plan.kv_dtype_, &plan.blocks_s2_,
                                                &plan.blocks_s3_);
  }));
  return plan;
}

int32_t CudaKernelPlan::DecodeStages(int32_t batch) const {
  if (decode_stages_ != 0) return decode_stages_;
  const int64_t blocks = int64_t{std::max(1, batch)} * std::max(1, geometry_.num_kv_heads);
  return blocks > int64_t{std::max(1, num_sms_)} * blocks_s2_ ? 3 : 2;
}

int32_t DecodeSplitsFor(const DcaGeometry& g, int32_t num_sms, int32_t blocks_per_sm, int32_t batch,
                        int64_t max_length) {
  const int64_t resident = int64_t{std::max(1, num_sms)} * std::max(1, blocks_per_sm);
  const int64_t blocks = std::max<int64_t>(1, int64_t{batch} * std::max(1, g.num_kv_heads));
  const int64_t want = resident / blocks;  // splits that still fit in one wave
  // At least the kernel's minimum keys per split (DecodeSplitLen) in every split.
  constexpr int64_t kMinKeys = cuda_kernels::kMinSplitKeys;
  const int64_t cap = std::max<int64_t>(1, (max_length + kMinKeys - 1) / kMinKeys);
  return static_cast<int32_t>(std::clamp<int64_t>(want, 1, std::min<int64_t>(cap, 1024)));
}

int32_t CudaKernelPlan::DecodeSplits(int32_t batch, int64_t max_length) const {
  return DecodeSplitsFor(geometry_, num_sms_, DecodeBlocksPerSm(DecodeStages(batch)), batch,
                         max_length);
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

absl::Status LaunchAppendKv(const CudaAppendParamsOf<Int8Kv>& p, cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.k_scale == nullptr ||
      p.kv.v_scale == nullptr || p.kv.page_table == nullptr || p.k == nullptr || p.v == nullptr ||
      !IsKnownDType(p.in_dtype) || HasRowScale(p.in_dtype) || p.start < 0 || p.num_tokens < 0 ||
      p.start + p.num_tokens > kMaxPosition || !SupportedHeadDim(p.kv.head_dim)) {
    return absl::InvalidArgumentError(
        "append (int8): bad params (null pointers or scales, input dtype, range, or head_dim not "
        "64 or 128)");
  }
  if (p.num_tokens == 0) return absl::OkStatus();
  const int64_t rows = p.num_tokens * p.kv.num_kv_heads;  // one warp each, 4 a block
  const int64_t blocks = std::min<int64_t>((rows + 3) / 4, 65536);
  WithHeadDim(p.kv.head_dim, [&](auto dim) {
    cuda_kernels::AppendKvInt8Kernel<decltype(dim)::value>
        <<<static_cast<unsigned>(blocks), 128, 0, stream>>>(
            p.kv, p.k, p.v, static_cast<int>(p.in_dtype), static_cast<int32_t>(p.start), rows,
            p.key_scale);
  });
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("AppendKvInt8Kernel");
  return absl::OkStatus();
}

absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParamsOf<Int8Kv>& p, cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.k_scale == nullptr ||
      p.kv.v_scale == nullptr || p.kv.page_tables == nullptr || p.lengths == nullptr ||
      p.k == nullptr || p.v == nullptr || !IsKnownDType(p.in_dtype) || HasRowScale(p.in_dtype) ||
      p.batch < 0 || !SupportedHeadDim(p.kv.head_dim)) {
    return absl::InvalidArgumentError("decode append (int8): bad params");
  }
  if (p.batch == 0) return absl::OkStatus();
  WithHeadDim(p.kv.head_dim, [&](auto dim) {
    cuda_kernels::DecodeAppendKvInt8Kernel<decltype(dim)::value>
        <<<p.batch, 128, 0, stream>>>(p.kv, p.lengths, p.k, p.v, static_cast<int>(p.in_dtype),
                                      p.original_max_position_embeddings);
  });
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DecodeAppendKvInt8Kernel");
  return absl::OkStatus();
}

absl::Status LaunchDecodeQuantizeRows(const CudaDecodeQuantizeRowsParams& p, cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.k_scale == nullptr ||
      p.kv.v_scale == nullptr || p.kv.page_tables == nullptr || p.lengths == nullptr ||
      p.kv_rows == nullptr || p.batch < 0 || p.batch > 65535 || !SupportedHeadDim(p.kv.head_dim)) {
    return absl::InvalidArgumentError("decode quantize rows: bad params");
  }
  if (p.batch == 0) return absl::OkStatus();
  ATTND_CUDA_RETURN_IF_ERROR(WithHeadDim(p.kv.head_dim, [&](auto dim) {
    return LaunchAfterPrevious(cuda_kernels::DecodeQuantizeRowsKernel<decltype(dim)::value>,
                               dim3(p.batch), dim3(128), 0, stream, p.kv, p.lengths, p.kv_rows);
  }));
  return absl::OkStatus();
}

absl::Status LaunchDequantizeKv(const CudaDequantizeKvParams& p, cudaStream_t stream) {
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
  cuda_kernels::DequantizeKvKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      p.kv, p.k_out, p.v_out, pieces);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DequantizeKvKernel");
  return absl::OkStatus();
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
        cuda_kernels::DecodeStageFloatRowsKernel, dim3(cuda_kernels::kDecodeStageBlocks, p.batch),
        dim3(cuda_kernels::kDecodeStageThreads), 0, stream, p.kv, p.rows, p.host_tables,
        static_cast<const char*>(p.host_q), static_cast<const char*>(p.host_k),
        static_cast<const char*>(p.host_v), p.q_row_bytes, p.kv_row_bytes, p.lengths, p.q,
        p.row_outs, p.num_q_heads, p.original_max_position_embeddings, p.kv_rows));
    return absl::OkStatus();
  }
  ATTND_CUDA_RETURN_IF_ERROR(LaunchAfterPrevious(
      cuda_kernels::DecodeStageKernel, dim3(cuda_kernels::kDecodeStageBlocks, p.batch),
      dim3(cuda_kernels::kDecodeStageThreads), 0, stream, p.kv, p.rows, p.host_tables,
      static_cast<const char*>(p.host_q), static_cast<const char*>(p.host_k),
      static_cast<const char*>(p.host_v), p.q_row_bytes, p.kv_row_bytes, p.lengths, p.q, p.row_outs,
      p.num_q_heads, p.original_max_position_embeddings));
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

bool PrefillTakesWindows(const CudaKernelPlan& plan) {
  return plan.prefill_kernel() == PrefillKernel::kWgmma ||
         plan.prefill_kernel() == PrefillKernel::kMmaSync;
}

int32_t PrefillKeyTileKeys(const CudaKernelPlan& plan) {
  return plan.prefill_kernel() == PrefillKernel::kWgmma ? cuda_kernels::wgmma::kPrefillBlockN
                                                        : kMmaBlockN;
}

int64_t PrefillKeyTiles(const CudaKernelPlan& plan, const DcaGeometry& g, int64_t start,
                        int64_t num_tokens) {
  if (start < 0 || num_tokens < 1 || start + num_tokens > kMaxPosition || g.chunk_len < 1) {
    return 0;
  }
  const int bn = PrefillKeyTileKeys(plan);
  // The last query tile of a piece sees the most keys of that piece; full pieces see more the
  // later they come, so the first, the last and the one before the last hold the maximum.
  const int64_t cl = g.chunk_len, lk = start + num_tokens;
  auto last_tile = [&](int64_t prev, int64_t piece_end) -> int64_t {
    return cuda_kernels::KeyTiles(static_cast<int32_t>(prev), static_cast<int32_t>(cl),
                                  static_cast<int32_t>(piece_end - 1), bn)
        .total();
  };
  const int64_t prev0 = (start / cl) * cl, end0 = std::min(prev0 + cl, lk);
  int64_t most = last_tile(prev0, end0);
  if (lk > end0) {
    const int64_t last_prev = ((lk - 1) / cl) * cl;
    most = std::max(most, last_tile(last_prev, lk));
    if (last_prev - cl >= end0) most = std::max(most, last_tile(last_prev - cl, last_prev));
  }
  return most;
}

size_t PrefillWindowStateBytes(const CudaKernelPlan& plan, const DcaGeometry& g,
                               int64_t num_tokens) {
  if (!PrefillTakesWindows(plan) || num_tokens < 1 || g.chunk_len < 1) return 0;
  // PlanPrefill's grid: each piece's rows in whole tiles, the pieces' rows adding up to the call's.
  // Rounding adds at most one tile a piece, and a call of n tokens has at most ceil(n / cl) + 1
  // pieces.
  const int64_t n = num_tokens, cl = g.chunk_len, group = g.group_size();
  const int64_t most = (n * group + kMmaBlockM - 1) / kMmaBlockM + (n + cl - 1) / cl + 1;
  return static_cast<size_t>(most) * g.num_kv_heads * PrefillStateBlockBytes(plan, g.head_dim);
}

absl::Status LaunchDcaPrefill(const CudaKernelPlan& plan, const CudaPrefillParams& p,
                              cudaStream_t stream) {
  const DcaGeometry& g = plan.geometry();
  ATTND_RETURN_IF_ERROR(CheckPrefill(g, p));
  const int32_t b = p.key_tile_begin, e = p.key_tile_end;
  if (b < 0 || e < 0 || (e != 0 && b >= e)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill: key tile window [", b, ", ", e,
        ") invalid (expected 0 <= key_tile_begin < key_tile_end, or key_tile_end 0: to the end)"));
  }
  const bool windowed =
      !(b == 0 && (e == 0 || e >= PrefillKeyTiles(plan, g, p.start, p.num_tokens)));
  if (windowed && !PrefillTakesWindows(plan)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill: the ", PrefillKernelName(plan.prefill_kernel()),
        " kernel takes no key tile window (expected key_tile_begin 0 and key_tile_end 0)"));
  }
  return WithHeadDim(g.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    return plan.prefill_kernel() == PrefillKernel::kWgmma
               ? LaunchWgmmaPrefill<D>(plan, p, windowed, stream)
               : LaunchMmaPrefill<D>(plan, p, windowed, stream);
  });
}

namespace {

template <typename KvT>
absl::Status LaunchDcaDecodeOf(const CudaKernelPlan& plan, const CudaDecodeParamsOf<KvT>& p,
                               cudaStream_t stream) {
  const DcaGeometry& g = plan.geometry();
  ATTND_RETURN_IF_ERROR(CheckDecode(g, p));
  if (p.max_splits < 1 || p.max_splits > 65535 || p.partial_out == nullptr ||
      p.partial_lse == nullptr) {
    return absl::InvalidArgumentError("decode: bad max_splits or null workspace");
  }
  const bool three = plan.DecodeStages(p.planned_batch > 0 ? p.planned_batch : p.batch) == 3;
  return WithHeadDim(g.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    return three ? LaunchDecodeTyped<D, 3>(g, p, stream) : LaunchDecodeTyped<D, 2>(g, p, stream);
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

}  // namespace attnd
