// Launch side of lab_kernels.h: one template per configuration index, instantiated from the
// constexpr tables (no positional dispatch to keep in step with them).
#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "bench/gpu/lab/decode_split_lab.cuh"
#include "bench/gpu/lab/lab_kernels.h"
#include "bench/gpu/lab/prefill_wgmma_lab.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dca_cuda_kernels.cuh"
#include "kernels/cuda/dca_cuda_launch.cuh"
#include "kernels/cuda/head_dim.h"

namespace attnd {
namespace lab {
namespace {

namespace ck = cuda_kernels;
namespace wg = cuda_kernels::wgmma;

bool DeviceIsSm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}

template <int D, int W, int S, int MT, int BN>
absl::Status LaunchMma(const DcaGeometry& g, const CudaPrefillParams& p, cudaStream_t stream) {
  ck::PrefillArgs a;
  int64_t tiles = 0;
  ATTND_RETURN_IF_ERROR(cuda_launch::PlanPrefill(g, p, 16 * MT * W, &a, &tiles));
  constexpr size_t smem = (2 * S * BN + (MT > 1 ? 16 * MT * W : 0)) * (D + 8) * sizeof(Bf16);
  const auto kernel = ck::DcaPrefillKernel<D, W, S, MT, BN>;
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(static_cast<unsigned>(tiles), g.num_kv_heads), 32 * W, smem, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaPrefillKernel");
  return absl::OkStatus();
}

template <int D, int BN, int S, bool Overlap, bool Ws, int Opt>
absl::Status LaunchWgmma(const DcaGeometry& g, const CudaPrefillParams& p, cudaStream_t stream) {
  if (!DeviceIsSm90()) {
    return absl::FailedPreconditionError("lab: wgmma configurations need compute capability 9.0");
  }
  ck::PrefillArgs a;
  int64_t tiles = 0;
  ATTND_RETURN_IF_ERROR(cuda_launch::PlanPrefill(g, p, wg::kBlockM, &a, &tiles));
  constexpr size_t smem = (2 * S * BN + wg::kBlockM) * D * sizeof(Bf16) + 1024;
  static_assert(smem <= 227 * 1024, "wgmma prefill: shared memory");
  const auto kernel = wg::lab::DcaPrefillWgmmaLabKernel<D, BN, S, Overlap, Ws, Opt>;
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(static_cast<unsigned>(tiles), g.num_kv_heads), wg::lab::BlockThreads<Ws>(), smem,
           stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaPrefillWgmmaLabKernel");
  return absl::OkStatus();
}

template <int D, int I>
absl::Status LaunchPrefillConfig(const DcaGeometry& g, const CudaPrefillParams& p,
                                 cudaStream_t stream) {
  constexpr PrefillKernelConfig c = kPrefillConfigs[I];
  if constexpr (c.family == kMmaSync) {
    return LaunchMma<D, c.warps, c.stages, c.m_tiles, c.block_n>(g, p, stream);
  } else {
    static_assert(c.m_tiles == 1 && (c.warps == 8 || c.warps == 12), "wgmma configuration");
    constexpr bool ws = c.warps == 12;
    constexpr bool overlap = c.family != kWgmma && c.family != kWgmmaAsync;
    constexpr int opt =
        (c.family >= kWgmmaAsync ? wg::lab::kOptAsyncProducer : 0) |
        (c.family == kWgmmaAsyncOverlap || c.family == kWgmmaAsyncLate ? wg::lab::kOptNoPingPong
                                                                       : 0) |
        (c.family == kWgmmaAsyncLate ? wg::lab::kOptLateRescale : 0);
    return LaunchWgmma<D, c.block_n, c.stages, overlap, ws, opt>(g, p, stream);
  }
}

// Runs configuration I when it is `config` (the fold in DispatchPrefill tries each in turn).
template <int D, int I>
bool TryPrefill(int config, const DcaGeometry& g, const CudaPrefillParams& p, cudaStream_t stream,
                absl::Status* status) {
  if (config != I) return false;
  absl::Status launched = LaunchPrefillConfig<D, I>(g, p, stream);
  swap(*status, launched);  // not operator=: nvcc warns on its discarded [[nodiscard]] result
  return true;
}

template <int D, int... I>
absl::Status DispatchPrefill(const DcaGeometry& g, const CudaPrefillParams& p, int config,
                             cudaStream_t stream, std::integer_sequence<int, I...>) {
  absl::Status status = absl::InvalidArgumentError(
      absl::StrCat("lab: prefill configuration ", config, " not in [0, ", kNumPrefillConfigs, ")"));
  (void)(TryPrefill<D, I>(config, g, p, stream, &status) || ...);
  return status;
}

// A decode configuration's kernel, block size, shared memory and the reduction's split tile.
template <int D, int I>
struct DecodeConfigKernel {
  static constexpr DecodeKernelConfig c = kDecodeConfigs[I];
  static constexpr int kThreads = c.family == kDecodeSplit ? ck::kThreads : 32 * c.warps;
  static constexpr int kSplitTile = c.family == kDecodeSplit ? ck::kBlockN : 16 * c.warps;
  static auto Kernel() {
    if constexpr (c.family == kDecodeSplit) {
      static_assert(c.warps == 4, "the split kernel has 4 warps");
      return ck::lab::DcaDecodeSplitKernel<D, c.stages>;
    } else {
      return ck::DcaDecodePipeKernel<D, c.warps, c.stages>;
    }
  }
  static size_t Smem(const DcaGeometry& g) {
    if constexpr (c.family == kDecodeSplit) {
      return ck::lab::DecodeSplitSmemBytes<D, c.stages>();
    } else {
      return ck::DecodePipeSmemBytes(D, c.warps, c.stages, g.group_size());
    }
  }
};

template <int D, int I>
int32_t BlocksPerSm(const DcaGeometry& g) {
  using K = DecodeConfigKernel<D, I>;
  const size_t smem = K::Smem(g);
  int n = 0;
  if (cudaFuncSetAttribute(K::Kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, K::Kernel(), K::kThreads, smem) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return std::max(1, n);
}

template <int D, int I>
absl::Status LaunchDecodeConfig(const DcaGeometry& g, const CudaDecodeParams& p,
                                cudaStream_t stream) {
  using K = DecodeConfigKernel<D, I>;
  const ck::DecodeArgs a = cuda_launch::DecodeArgsFor(g, p);
  const size_t smem = K::Smem(g);
  const auto kernel = K::Kernel();
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(p.max_splits, g.num_kv_heads, p.batch), K::kThreads, smem, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("lab decode kernel");
  ck::DcaDecodeReduceKernel<D>
      <<<dim3(p.batch, g.num_q_heads), ck::kDecodeReduceThreads, 0, stream>>>(
          p.partial_out, p.partial_lse, p.lengths, p.max_splits, K::kSplitTile, a.min_split_keys,
          p.out, static_cast<int>(p.out_dtype), p.row_outs);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaDecodeReduceKernel");
  return absl::OkStatus();
}

template <int D, int I>
bool TryDecode(int config, const DcaGeometry& g, const CudaDecodeParams& p, cudaStream_t stream,
               absl::Status* status) {
  if (config != I) return false;
  absl::Status launched = LaunchDecodeConfig<D, I>(g, p, stream);
  swap(*status, launched);  // not operator=: nvcc warns on its discarded [[nodiscard]] result
  return true;
}

template <int D, int... I>
absl::Status DispatchDecode(const DcaGeometry& g, const CudaDecodeParams& p, int config,
                            cudaStream_t stream, std::integer_sequence<int, I...>) {
  absl::Status status = absl::InvalidArgumentError(
      absl::StrCat("lab: decode configuration ", config, " not in [0, ", kNumDecodeConfigs, ")"));
  (void)(TryDecode<D, I>(config, g, p, stream, &status) || ...);
  return status;
}

template <int D, int... I>
int32_t DispatchBlocksPerSm(const DcaGeometry& g, int config, std::integer_sequence<int, I...>) {
  int32_t n = 0;
  (void)((config == I ? (n = BlocksPerSm<D, I>(g), true) : false) || ...);
  return n;
}

}  // namespace

std::string PrefillConfigLabel(int config) {
  if (config < 0 || config >= kNumPrefillConfigs) return "?";
  static const char* const kFamily[] = {"mma",          "wg",          "wg-ovl",       "wg-async",
                                        "wg-async-ovl", "wg-async-pp", "wg-async-late"};
  const PrefillKernelConfig& c = kPrefillConfigs[config];
  char label[64];
  std::snprintf(label, sizeof(label), "w%ds%dm%dn%d %s", c.warps, c.stages, c.m_tiles, c.block_n,
                kFamily[c.family]);
  return label;
}

std::string DecodeConfigLabel(int config) {
  if (config < 0 || config >= kNumDecodeConfigs) return "?";
  const DecodeKernelConfig& c = kDecodeConfigs[config];
  char label[40];
  std::snprintf(label, sizeof(label), "c%d w%ds%d %s", config, c.warps, c.stages,
                c.family == kDecodeSplit ? "split" : "pipe");
  return label;
}

absl::Status LaunchLabPrefill(const DcaGeometry& g, const CudaPrefillParams& p, int config,
                              cudaStream_t stream) {
  ATTND_RETURN_IF_ERROR(cuda_launch::CheckPrefill(g, p));
  constexpr auto kAll = std::make_integer_sequence<int, kNumPrefillConfigs>();
  return WithHeadDim(g.head_dim, [&](auto dim) {
    return DispatchPrefill<decltype(dim)::value>(g, p, config, stream, kAll);
  });
}

int32_t LabDecodeSplits(const DcaGeometry& g, int32_t batch, int64_t max_length, int config) {
  if (config < 0 || config >= kNumDecodeConfigs || CheckCudaGeometry(g).ok() == false) return 0;
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  constexpr auto kAll = std::make_integer_sequence<int, kNumDecodeConfigs>();
  const int32_t per_sm = WithHeadDim(g.head_dim, [&](auto dim) {
    return DispatchBlocksPerSm<decltype(dim)::value>(g, config, kAll);
  });
  if (per_sm < 1) return 0;
  return DecodeSplitsFor(g, sms, per_sm, batch, max_length);
}

absl::Status LaunchLabDecode(const DcaGeometry& g, const CudaDecodeParams& p, int config,
                             cudaStream_t stream) {
  ATTND_RETURN_IF_ERROR(cuda_launch::CheckDecode(g, p));
  if (p.max_splits < 1 || p.max_splits > ck::kDecodeReduceMaxSplits || p.partial_out == nullptr ||
      p.partial_lse == nullptr) {
    return absl::InvalidArgumentError("lab decode: bad max_splits or null workspace");
  }
  constexpr auto kAll = std::make_integer_sequence<int, kNumDecodeConfigs>();
  return WithHeadDim(g.head_dim, [&](auto dim) {
    return DispatchDecode<decltype(dim)::value>(g, p, config, stream, kAll);
  });
}

namespace {

// Clock cycles of each phase of a warp, added into the global counters by its lane 0 at the end.
struct ClockDecodeProbe {
  unsigned long long* cycles;
  uint32_t last = 0, tiles = 0;
  uint32_t acc[ck::kNumProbePhases] = {};
  __device__ __forceinline__ void Start() { last = static_cast<uint32_t>(clock()); }
  __device__ __forceinline__ void Mark(int phase) {
    const uint32_t now = static_cast<uint32_t>(clock());
    acc[phase] += now - last;
    last = now;
    if (phase == ck::kProbePv) ++tiles;
  }
  __device__ __forceinline__ void Flush() {
    if (threadIdx.x % 32 != 0) return;
#pragma unroll
    for (int p = 0; p < ck::kNumProbePhases; ++p) atomicAdd(cycles + p, acc[p]);
    atomicAdd(cycles + ck::kNumProbePhases, tiles);
  }
};
static_assert(kDecodeProbeTiles == ck::kNumProbePhases, "one counter per phase, then the tiles");

constexpr int kProductDecodeWarps = 4;

template <int D, int Stages, typename KvT, bool VRegs>
__global__ void __launch_bounds__(kProductDecodeWarps * 32)
    ProbedDecodeKernel(const ck::DecodeArgsOf<KvT> a, unsigned long long* cycles) {
  ClockDecodeProbe probe{cycles};
  probe.Start();
  ck::DcaDecodePipeBody<D, kProductDecodeWarps, Stages, KvT, ClockDecodeProbe, VRegs>(a, probe);
  probe.Flush();
}

template <int D, int Stages, typename KvT>
__global__ void __launch_bounds__(kProductDecodeWarps * 32)
    VRegsDecodeKernel(const ck::DecodeArgsOf<KvT> a) {
  ck::NoDecodeProbe probe;
  ck::DcaDecodePipeBody<D, kProductDecodeWarps, Stages, KvT, ck::NoDecodeProbe, true>(a, probe);
}

// Shared memory of the product's body for KvT (VRegs: without the fp16 V tile).
template <int D, int Stages, typename KvT, bool VRegs>
size_t BodySmemBytes(const DcaGeometry& g) {
  if constexpr (kScaledKv<KvT>) {
    return ck::DecodePipeCodesSmemBytes(D, kProductDecodeWarps, Stages, g.group_size()) -
           (VRegs ? size_t{16} * kProductDecodeWarps * D * sizeof(uint16_t) : 0);
  }
  return ck::DecodePipeSmemBytes(D, kProductDecodeWarps, Stages, g.group_size());
}

template <int D, int Stages, typename KvT, bool VRegs>
absl::Status LaunchProbed(const DcaGeometry& g, const CudaDecodeParamsOf<KvT>& p,
                          unsigned long long* cycles, cudaStream_t stream) {
  const size_t smem = BodySmemBytes<D, Stages, KvT, VRegs>(g);
  const auto kernel = ProbedDecodeKernel<D, Stages, KvT, VRegs>;
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(p.max_splits, g.num_kv_heads, p.batch), kProductDecodeWarps * 32, smem, stream>>>(
      cuda_launch::DecodeArgsFor(g, p), cycles);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("ProbedDecodeKernel");
  return absl::OkStatus();
}

template <int D, int Stages, typename KvT>
absl::Status LaunchVRegs(const DcaGeometry& g, const CudaDecodeParamsOf<KvT>& p,
                         cudaStream_t stream) {
  const size_t smem = BodySmemBytes<D, Stages, KvT, true>(g);
  const auto kernel = VRegsDecodeKernel<D, Stages, KvT>;
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(p.max_splits, g.num_kv_heads, p.batch), kProductDecodeWarps * 32, smem, stream>>>(
      cuda_launch::DecodeArgsFor(g, p));
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("VRegsDecodeKernel");
  ck::DcaDecodeReduceKernel<D>
      <<<dim3(p.batch, g.num_q_heads), ck::kDecodeReduceThreads, 0, stream>>>(
          p.partial_out, p.partial_lse, p.lengths, p.max_splits, 16 * kProductDecodeWarps,
          kMinSplitKeys, p.out, static_cast<int>(p.out_dtype), p.row_outs);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaDecodeReduceKernel");
  return absl::OkStatus();
}

template <typename KvT>
absl::Status CheckProbedParams(const DcaGeometry& g, const CudaDecodeParamsOf<KvT>& p) {
  ATTND_RETURN_IF_ERROR(cuda_launch::CheckDecode(g, p));
  if (p.max_splits < 1 || p.max_splits > ck::kDecodeReduceMaxSplits || p.partial_out == nullptr ||
      p.partial_lse == nullptr) {
    return absl::InvalidArgumentError("lab decode: bad max_splits or null workspace");
  }
  return absl::OkStatus();
}

}  // namespace

const char* DecodeProbePhaseName(int phase) {
  static constexpr const char* kNames[] = {"prologue", "wait", "convert", "qk",
                                           "softmax",  "pv",   "merge"};
  return phase >= 0 && phase < ck::kNumProbePhases ? kNames[phase] : "?";
}

template <typename KvT>
absl::Status LaunchProbedDecode(const CudaKernelPlan& plan, const CudaDecodeParamsOf<KvT>& p,
                                unsigned long long* cycles, cudaStream_t stream,
                                bool v_in_registers) {
  const DcaGeometry& g = plan.geometry();
  ATTND_RETURN_IF_ERROR(CheckProbedParams(g, p));
  if (cycles == nullptr || (v_in_registers && !kScaledKv<KvT>)) {
    return absl::InvalidArgumentError(
        "probed decode: null counters, or P V from registers over a pool that is not one-byte");
  }
  const bool three = plan.DecodeStages(p.batch) == 3;
  return WithHeadDim(g.head_dim, [&](auto dim) -> absl::Status {
    constexpr int D = decltype(dim)::value;
    if constexpr (kScaledKv<KvT>) {
      if (v_in_registers) {
        return three ? LaunchProbed<D, 3, KvT, true>(g, p, cycles, stream)
                     : LaunchProbed<D, 2, KvT, true>(g, p, cycles, stream);
      }
    }
    return three ? LaunchProbed<D, 3, KvT, false>(g, p, cycles, stream)
                 : LaunchProbed<D, 2, KvT, false>(g, p, cycles, stream);
  });
}
template absl::Status LaunchProbedDecode(const CudaKernelPlan&, const CudaDecodeParamsOf<Bf16>&,
                                         unsigned long long*, cudaStream_t, bool);
template absl::Status LaunchProbedDecode(const CudaKernelPlan&, const CudaDecodeParamsOf<Int8Kv>&,
                                         unsigned long long*, cudaStream_t, bool);
template absl::Status LaunchProbedDecode(const CudaKernelPlan&, const CudaDecodeParamsOf<Fp8E4m3>&,
                                         unsigned long long*, cudaStream_t, bool);

template <typename KvT>
absl::Status LaunchVRegsDecode(const CudaKernelPlan& plan, const CudaDecodeParamsOf<KvT>& p,
                               cudaStream_t stream) {
  const DcaGeometry& g = plan.geometry();
  ATTND_RETURN_IF_ERROR(CheckProbedParams(g, p));
  const bool three = plan.DecodeStages(p.batch) == 3;
  return WithHeadDim(g.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    return three ? LaunchVRegs<D, 3>(g, p, stream) : LaunchVRegs<D, 2>(g, p, stream);
  });
}
template absl::Status LaunchVRegsDecode(const CudaKernelPlan&, const CudaDecodeParamsOf<Int8Kv>&,
                                        cudaStream_t);
template absl::Status LaunchVRegsDecode(const CudaKernelPlan&, const CudaDecodeParamsOf<Fp8E4m3>&,
                                        cudaStream_t);

template <typename KvT>
int32_t VRegsDecodeSplits(const CudaKernelPlan& plan, int32_t batch, int64_t max_length) {
  const DcaGeometry& g = plan.geometry();
  const bool three = plan.DecodeStages(batch) == 3;
  int blocks = 0;
  const cudaError_t err = WithHeadDim(g.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    auto occupancy = [&](auto kernel, size_t smem) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      if (e != cudaSuccess) return e;
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel,
                                                           kProductDecodeWarps * 32, smem);
    };
    return three ? occupancy(VRegsDecodeKernel<D, 3, KvT>, BodySmemBytes<D, 3, KvT, true>(g))
                 : occupancy(VRegsDecodeKernel<D, 2, KvT>, BodySmemBytes<D, 2, KvT, true>(g));
  });
  if (err != cudaSuccess || blocks < 1) {
    cudaGetLastError();
    return 0;
  }
  return DecodeSplitsFor(g, plan.num_sms(), blocks, batch, max_length);
}
template int32_t VRegsDecodeSplits<Int8Kv>(const CudaKernelPlan&, int32_t, int64_t);
template int32_t VRegsDecodeSplits<Fp8E4m3>(const CudaKernelPlan&, int32_t, int64_t);

}  // namespace lab
}  // namespace attnd
