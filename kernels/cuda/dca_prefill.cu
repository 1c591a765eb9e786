// The prefill launchers of dca_cuda.h: the wgmma kernel (Hopper) and the mma.sync fallback, their
// key-tile windows and shared-memory limits.
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
#include "kernels/cuda/prefill_wgmma.cuh"

namespace attnd {
namespace {

using cuda_launch::CheckPrefill;
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

// Sets the prefill kernels' dynamic shared-memory limits on the current device.
template <int D>
absl::Status PreparePrefillKernelsFor(bool wgmma) {
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
  return absl::OkStatus();
}

}  // namespace

namespace cuda_families {

absl::Status PreparePrefillKernels(const DcaGeometry& g, bool wgmma) {
  return WithHeadDim(
      g.head_dim, [&](auto dim) { return PreparePrefillKernelsFor<decltype(dim)::value>(wgmma); });
}

}  // namespace cuda_families

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

}  // namespace attnd
