// Host side of the DCA kernel launches that the product (dca_*.cu, kv_write.cu) and the tuning lab
// (bench/gpu/lab/) share: parameter checks and the kernels' argument structs. Included by .cu files
// only, after dca_cuda_kernels.cuh.
#ifndef ATTND_KERNELS_CUDA_DCA_CUDA_LAUNCH_CUH_
#define ATTND_KERNELS_CUDA_DCA_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/cuda/dca_cuda_kernels.cuh"

namespace attnd {
namespace cuda_launch {

inline constexpr int64_t kMaxPosition = (int64_t{1} << 31) - 1;

template <typename KvT>
inline absl::Status CheckKv(const DcaGeometry& g, const PagedKv<KvT>& kv) {
  if (kv.k == nullptr || kv.v == nullptr || kv.page_table == nullptr || kv.page_size <= 0) {
    return absl::InvalidArgumentError("PagedKv: null pointer or page_size <= 0");
  }
  if (kScaledKv<KvT> && (kv.k_scale == nullptr || kv.v_scale == nullptr)) {
    return absl::InvalidArgumentError("PagedKv: an int8 or fp8 pool needs k_scale and v_scale");
  }
  if (kv.num_kv_heads != g.num_kv_heads || kv.head_dim != g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("PagedKv: ", kv.num_kv_heads, " kv heads x ",
                                                   kv.head_dim, " does not match the geometry"));
  }
  return absl::OkStatus();
}

// Kernel arguments and the number of query tiles (blocks along x) for blocks of block_m rows.
inline absl::Status PlanPrefill(const DcaGeometry& g, const CudaPrefillParams& p, int block_m,
                                cuda_kernels::PrefillArgs* a, int64_t* tiles) {
  a->kv = p.kv;
  a->q = p.q;
  a->out = p.out;
  a->out_dtype = static_cast<int>(p.out_dtype);
  a->start = static_cast<int32_t>(p.start);
  a->num_tokens = static_cast<int32_t>(p.num_tokens);
  a->chunk_len = static_cast<int32_t>(g.chunk_len);
  a->num_q_heads = g.num_q_heads;
  a->group = g.group_size();
  a->scale_log2 = p.softmax_scale * cuda_kernels::kLog2e;
  a->key_tile_begin = p.key_tile_begin;
  a->key_tile_end = p.key_tile_end;
  a->window_state = static_cast<float*>(p.window_state);
  // Pieces: the first runs from start to the end of its chunk; the rest are whole chunks but the
  // last, whose tiles past its end would have no rows: the grid stops at its last tile (a call
  // that crosses into a long chunk would otherwise launch a whole chunk's tiles, and windowed
  // calls would need their state).
  const int64_t cl = g.chunk_len;
  const int64_t lk = p.start + p.num_tokens;
  const int64_t prev0 = (p.start / cl) * cl;
  const int64_t end0 = std::min(prev0 + cl, lk);
  const int64_t rows_first = (end0 - p.start) * a->group;
  const int64_t tiles_first = (rows_first + block_m - 1) / block_m;
  const int64_t tiles_full = (cl * a->group + block_m - 1) / block_m;
  const int64_t more_pieces = (lk - end0 + cl - 1) / cl;
  *tiles = tiles_first;
  if (more_pieces > 0) {
    const int64_t last_rows = (lk - end0 - (more_pieces - 1) * cl) * a->group;
    *tiles += (more_pieces - 1) * tiles_full + (last_rows + block_m - 1) / block_m;
  }
  if (tiles_full > INT32_MAX || *tiles > INT32_MAX) {
    return absl::InvalidArgumentError("prefill: too many query tiles");
  }
  a->tiles_first = static_cast<int32_t>(tiles_first);
  a->tiles_full = static_cast<int32_t>(tiles_full);
  return absl::OkStatus();
}

inline absl::Status CheckPrefill(const DcaGeometry& g, const CudaPrefillParams& p) {
  if (absl::Status s = CheckCudaGeometry(g); !s.ok()) return s;
  if (absl::Status s = CheckKv(g, p.kv); !s.ok()) return s;
  if (p.q == nullptr || p.out == nullptr || !IsKnownDType(p.out_dtype)) {
    return absl::InvalidArgumentError("prefill: null q/out or bad out_dtype");
  }
  if (p.start < 0 || p.num_tokens < 1 || p.start + p.num_tokens > kMaxPosition) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill: bad token range start=", p.start, " num_tokens=", p.num_tokens));
  }
  return absl::OkStatus();
}

// The split kernels' arguments (both decode kernel families take the same).
template <typename KvT>
inline cuda_kernels::DecodeArgsOf<KvT> DecodeArgsFor(const DcaGeometry& g,
                                                     const CudaDecodeParamsOf<KvT>& p) {
  cuda_kernels::DecodeArgsOf<KvT> a;
  a.kv = p.kv;
  a.lengths = p.lengths;
  a.q = p.q;
  a.chunk_len = static_cast<int32_t>(g.chunk_len);
  a.num_q_heads = g.num_q_heads;
  a.group = g.group_size();
  a.max_splits = p.max_splits;
  a.orig = g.original_max_position_embeddings;
  a.scale_log2 = g.softmax_scale * cuda_kernels::kLog2e;
  a.partial_out = p.partial_out;
  a.partial_lse = p.partial_lse;
  return a;
}

template <typename KvT>
inline absl::Status CheckDecode(const DcaGeometry& g, const CudaDecodeParamsOf<KvT>& p) {
  if (absl::Status s = CheckCudaGeometry(g); !s.ok()) return s;
  if (absl::Status s = CheckKv(g, p.kv.Seq(0)); !s.ok()) return s;
  if (p.lengths == nullptr || p.q == nullptr || p.out == nullptr || !IsKnownDType(p.out_dtype)) {
    return absl::InvalidArgumentError("decode: null lengths/q/out or bad out_dtype");
  }
  if (p.batch < 1 || p.batch > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("decode: batch ", p.batch, " not in 1..65535"));
  }
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

}  // namespace cuda_launch
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_DCA_CUDA_LAUNCH_CUH_
