// Launch functions for dca_cuda.h: size checks, the head_dim dispatch and grid planning.
#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/cuda/dca_cuda_kernels.cuh"
#include "kernels/cuda/prefill_wgmma.cuh"

namespace attnd {
namespace {

using cuda_kernels::kBlockN;
using cuda_kernels::kLog2e;
using cuda_kernels::kThreads;

constexpr int64_t kMaxPosition = (int64_t{1} << 31) - 1;

template <int D, int Warps, int Stages, int MT, int BN>
constexpr size_t PrefillSmemBytes() {
  return (2 * Stages * BN + (MT > 1 ? 16 * MT * Warps : 0)) * (D + 8) * sizeof(Bf16);
}
template <int D, int Stages>
constexpr size_t DecodeSmemBytes() {
  return (2 * Stages * kBlockN + 3 * 16) * (D + 8) * sizeof(Bf16);
}
// Resident decode blocks per multiprocessor (228 KB shared memory, 1 KB reserved per block).
int DecodeBlocksPerSm(int head_dim, int stages) {
  const size_t smem = (2 * stages * kBlockN + 3 * 16) * (head_dim + 8) * sizeof(Bf16) + 1024;
  return std::max<int>(1, static_cast<int>((228 * 1024) / smem));
}

bool ValidDType(DType t) { return t == DType::kBf16 || t == DType::kFp16 || t == DType::kFp32; }

absl::Status CheckKv(const DcaGeometry& g, const PagedKv<Bf16>& kv) {
  if (kv.k == nullptr || kv.v == nullptr || kv.page_table == nullptr || kv.page_size <= 0) {
    return absl::InvalidArgumentError("PagedKv: null pointer or page_size <= 0");
  }
  if (kv.num_kv_heads != g.num_kv_heads || kv.head_dim != g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("PagedKv: ", kv.num_kv_heads, " kv heads x ",
                                                   kv.head_dim, " does not match the geometry"));
  }
  return absl::OkStatus();
}

// Kernel arguments and the number of query tiles (blocks along x) for blocks of block_m rows.
absl::Status PlanPrefill(const DcaGeometry& g, const CudaPrefillParams& p, int block_m,
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
  a->scale_log2 = p.softmax_scale * kLog2e;
  // Pieces: the first runs from start to the end of its chunk; the rest are whole chunks.
  const int64_t cl = g.chunk_len;
  const int64_t lk = p.start + p.num_tokens;
  const int64_t prev0 = (p.start / cl) * cl;
  const int64_t end0 = std::min(prev0 + cl, lk);
  const int64_t rows_first = (end0 - p.start) * a->group;
  const int64_t tiles_first = (rows_first + block_m - 1) / block_m;
  const int64_t tiles_full = (cl * a->group + block_m - 1) / block_m;
  const int64_t more_pieces = (lk - end0 + cl - 1) / cl;
  *tiles = tiles_first + more_pieces * tiles_full;
  if (tiles_full > INT32_MAX || *tiles > INT32_MAX) {
    return absl::InvalidArgumentError("prefill: too many query tiles");
  }
  a->tiles_first = static_cast<int32_t>(tiles_first);
  a->tiles_full = static_cast<int32_t>(tiles_full);
  return absl::OkStatus();
}

template <int D, int Warps, int Stages, int MT, int BN>
absl::Status LaunchPrefillTyped(const DcaGeometry& g, const CudaPrefillParams& p,
                                cudaStream_t stream) {
  cuda_kernels::PrefillArgs a;
  int64_t tiles = 0;
  if (absl::Status s = PlanPrefill(g, p, 16 * MT * Warps, &a, &tiles); !s.ok()) return s;
  constexpr size_t smem = PrefillSmemBytes<D, Warps, Stages, MT, BN>();
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(cuda_kernels::DcaPrefillKernel<D, Warps, Stages, MT, BN>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cuda_kernels::DcaPrefillKernel<D, Warps, Stages, MT, BN>
      <<<dim3(static_cast<unsigned>(tiles), g.num_kv_heads), 32 * Warps, smem, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaPrefillKernel");
  return absl::OkStatus();
}

// True when the current device runs sm_90a machine code (compute capability 9.0).
bool DeviceIsSm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error behind; the caller falls back
    return false;
  }
  return major == 9 && minor == 0;
}

template <int D, int BN, int Stages, bool Overlap, bool Ws, int Opt = 0>
absl::Status LaunchPrefillWgmmaTyped(const DcaGeometry& g, const CudaPrefillParams& p,
                                     cudaStream_t stream) {
  namespace wg = cuda_kernels::wgmma;
  cuda_kernels::PrefillArgs a;
  int64_t tiles = 0;
  if (absl::Status s = PlanPrefill(g, p, wg::kBlockM, &a, &tiles); !s.ok()) return s;
  // K and V rings, the block's queries, and 1 KB to align the swizzled tiles.
  constexpr size_t smem = (2 * Stages * BN + wg::kBlockM) * D * sizeof(Bf16) + 1024;
  static_assert(smem <= 227 * 1024, "wgmma prefill: shared memory");
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(wg::DcaPrefillWgmmaKernel<D, BN, Stages, Overlap, Ws, Opt>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  wg::DcaPrefillWgmmaKernel<D, BN, Stages, Overlap, Ws, Opt>
      <<<dim3(static_cast<unsigned>(tiles), g.num_kv_heads), wg::BlockThreads<Ws>(), smem,
         stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaPrefillWgmmaKernel");
  return absl::OkStatus();
}

absl::Status CheckPrefill(const DcaGeometry& g, const CudaPrefillParams& p) {
  if (absl::Status s = CheckCudaGeometry(g); !s.ok()) return s;
  if (absl::Status s = CheckKv(g, p.kv); !s.ok()) return s;
  if (p.q == nullptr || p.out == nullptr || !ValidDType(p.out_dtype)) {
    return absl::InvalidArgumentError("prefill: null q/out or bad out_dtype");
  }
  if (p.start < 0 || p.num_tokens < 1 || p.start + p.num_tokens > kMaxPosition) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill: bad token range start=", p.start, " num_tokens=", p.num_tokens));
  }
  return absl::OkStatus();
}

// The split kernels' arguments (both decode kernel families take the same).
cuda_kernels::DecodeArgs DecodeArgsFor(const DcaGeometry& g, const CudaDecodeParams& p) {
  cuda_kernels::DecodeArgs a;
  a.kv = p.kv;
  a.lengths = p.lengths;
  a.q = p.q;
  a.chunk_len = static_cast<int32_t>(g.chunk_len);
  a.num_q_heads = g.num_q_heads;
  a.group = g.group_size();
  a.max_splits = p.max_splits;
  a.orig = g.original_max_position_embeddings;
  a.scale_log2 = g.softmax_scale * kLog2e;
  a.partial_out = p.partial_out;
  a.partial_lse = p.partial_lse;
  return a;
}

template <int D, int Stages>
absl::Status LaunchDecodeTyped(const DcaGeometry& g, const CudaDecodeParams& p,
                               cudaStream_t stream) {
  const cuda_kernels::DecodeArgs a = DecodeArgsFor(g, p);
  constexpr size_t smem = DecodeSmemBytes<D, Stages>();
  ATTND_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(cuda_kernels::DcaDecodeSplitKernel<D, Stages>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  smem));
  cuda_kernels::DcaDecodeSplitKernel<D, Stages>
      <<<dim3(p.max_splits, g.num_kv_heads, p.batch), kThreads, smem, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaDecodeSplitKernel");
  cuda_kernels::DcaDecodeReduceKernel<D><<<dim3(p.batch, g.num_q_heads), D, 0, stream>>>(
      p.partial_out, p.partial_lse, p.lengths, p.max_splits, cuda_kernels::kBlockN, p.out,
      static_cast<int>(p.out_dtype));
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaDecodeReduceKernel");
  return absl::OkStatus();
}

// The pipelined/bulk decode kernel (kDecodePipelined, kDecodeBulk), then the same reduction.
template <int D, int Warps, int Stages, bool Bulk>
absl::Status LaunchDecodePipeTyped(const DcaGeometry& g, const CudaDecodeParams& p,
                                   cudaStream_t stream) {
  const cuda_kernels::DecodeArgs a = DecodeArgsFor(g, p);
  const size_t smem = cuda_kernels::DecodePipeSmemBytes(D, Warps, Stages, Bulk, g.group_size());
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(cuda_kernels::DcaDecodePipeKernel<D, Warps, Stages, Bulk>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cuda_kernels::DcaDecodePipeKernel<D, Warps, Stages, Bulk>
      <<<dim3(p.max_splits, g.num_kv_heads, p.batch), Warps * 32, smem, stream>>>(a);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaDecodePipeKernel");
  cuda_kernels::DcaDecodeReduceKernel<D><<<dim3(p.batch, g.num_q_heads), D, 0, stream>>>(
      p.partial_out, p.partial_lse, p.lengths, p.max_splits, 16 * Warps, p.out,
      static_cast<int>(p.out_dtype));
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaDecodeReduceKernel");
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchDecodeVariant(const DcaGeometry& g, const CudaDecodeParams& p, int variant,
                                 cudaStream_t stream) {
  switch (variant) {  // kDecodeVariants
    case 0:
      return LaunchDecodeTyped<D, 2>(g, p, stream);
    case 1:
      return LaunchDecodeTyped<D, 4>(g, p, stream);
    case 2:
      return LaunchDecodePipeTyped<D, 4, 2, false>(g, p, stream);
    case 3:
      return LaunchDecodePipeTyped<D, 4, 3, false>(g, p, stream);
    case 4:
      return LaunchDecodePipeTyped<D, 4, 4, false>(g, p, stream);
    case 5:
      return LaunchDecodePipeTyped<D, 8, 2, false>(g, p, stream);
    case 6:
      return LaunchDecodePipeTyped<D, 4, 3, true>(g, p, stream);
    case 7:
      return LaunchDecodePipeTyped<D, 8, 2, true>(g, p, stream);
    default:
      return absl::InvalidArgumentError(absl::StrCat("decode: variant ", variant, " unsupported"));
  }
}
static_assert(kNumDecodeKernelVariants == 8,
              "LaunchDecodeVariant covers every kDecodeVariants entry");

// Resident blocks per multiprocessor of decode variant v (228 KB of shared memory with 1 KB
// reserved per block, 2048 threads, 64K registers at the -Xptxas -v counts rounded up: <= 160 per
// thread at head_dim 128, <= 120 at 64).
int DecodeVariantBlocksPerSm(const DcaGeometry& g, int v) {
  const DecodeVariant& dv = kDecodeVariants[v];
  const int d = g.head_dim == 64 ? 64 : 128;
  if (dv.kernel == kDecodeSplit) return DecodeBlocksPerSm(d, dv.stages);
  const size_t smem =
      cuda_kernels::DecodePipeSmemBytes(d, dv.warps, dv.stages, dv.kernel == kDecodeBulk,
                                        std::max(1, g.group_size())) +
      1024;
  const int by_smem = static_cast<int>((228 * 1024) / smem);
  const int by_threads = 2048 / (dv.warps * 32);
  const int by_regs = 65536 / (dv.warps * 32 * (d == 128 ? 160 : 120));
  return std::max(1, std::min({by_smem, by_threads, by_regs}));
}

absl::Status CheckDecode(const DcaGeometry& g, const CudaDecodeParams& p) {
  if (absl::Status s = CheckCudaGeometry(g); !s.ok()) return s;
  if (absl::Status s = CheckKv(g, p.kv.Seq(0)); !s.ok()) return s;
  if (p.lengths == nullptr || p.q == nullptr || p.out == nullptr || !ValidDType(p.out_dtype)) {
    return absl::InvalidArgumentError("decode: null lengths/q/out or bad out_dtype");
  }
  if (p.batch < 1 || p.batch > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("decode: batch ", p.batch, " not in 1..65535"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCudaGeometry(const DcaGeometry& g) {
  if (g.head_dim != 64 && g.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda: head_dim ", g.head_dim, " unsupported (supported: 64, 128)"));
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
      p.v == nullptr || !ValidDType(p.in_dtype) || p.start < 0 || p.num_tokens < 0 ||
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

absl::Status LaunchDecodeAppendKv(const CudaDecodeAppendParams& p, cudaStream_t stream) {
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.page_tables == nullptr ||
      p.lengths == nullptr || p.k == nullptr || p.v == nullptr || !ValidDType(p.in_dtype) ||
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
  if (p.kv.k == nullptr || p.kv.v == nullptr || p.kv.page_tables == nullptr ||
      p.kv.page_table_stride < 4 || p.kv.page_table_stride % 4 != 0 || p.kv.head_dim % 8 != 0 ||
      p.rows == nullptr || p.host_tables == nullptr || p.host_q == nullptr || p.host_k == nullptr ||
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
  cuda_kernels::DecodeStageKernel<<<dim3(cuda_kernels::kDecodeStageBlocks, p.batch),
                                    cuda_kernels::kDecodeStageThreads, 0, stream>>>(
      p.kv, p.rows, p.host_tables, static_cast<const char*>(p.host_q),
      static_cast<const char*>(p.host_k), static_cast<const char*>(p.host_v), p.q_row_bytes,
      p.kv_row_bytes, p.lengths, p.q, p.num_q_heads, p.original_max_position_embeddings);
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DecodeStageKernel");
  return absl::OkStatus();
}

absl::Status LaunchConvertToBf16(const void* src, DType src_dtype, int64_t n, Bf16* dst,
                                 cudaStream_t stream) {
  if (src == nullptr || dst == nullptr || !ValidDType(src_dtype) || n < 0) {
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

absl::Status LaunchDcaPrefill(const DcaGeometry& g, const CudaPrefillParams& p,
                              cudaStream_t stream) {
  if (absl::Status s = CheckPrefill(g, p); !s.ok()) return s;
  int variant = p.variant < 0 ? kDefaultPrefillVariant : p.variant;
  if (variant < kNumPrefillVariants && kPrefillVariants[variant].kernel != kPrefillMmaSync &&
      !DeviceIsSm90()) {
    variant = kFallbackPrefillVariant;
  }
  const bool d128 = g.head_dim == 128;
  switch (variant) {  // the supported set: kPrefillVariants (same order)
#define ATTND_PREFILL_CASE(i, W, S, MT, BN)                                                     \
  case i:                                                                                       \
    static_assert(kPrefillVariants[i].warps == W && kPrefillVariants[i].stages == S &&          \
                      kPrefillVariants[i].m_tiles == MT && kPrefillVariants[i].block_n == BN && \
                      kPrefillVariants[i].kernel == kPrefillMmaSync,                            \
                  "kPrefillVariants order");                                                    \
    return d128 ? LaunchPrefillTyped<128, W, S, MT, BN>(g, p, stream)                           \
                : LaunchPrefillTyped<64, W, S, MT, BN>(g, p, stream);
#define ATTND_PREFILL_WGMMA_CASE(i, W, S, BN, K)                                                  \
  case i:                                                                                         \
    static_assert(kPrefillVariants[i].warps == W && kPrefillVariants[i].stages == S &&            \
                      kPrefillVariants[i].m_tiles == 1 && kPrefillVariants[i].block_n == BN &&    \
                      kPrefillVariants[i].kernel == K,                                            \
                  "kPrefillVariants order");                                                      \
    return d128 ? LaunchPrefillWgmmaTyped<128, BN, S, K == kPrefillWgmmaOverlap, W == 12>(g, p,   \
                                                                                          stream) \
                : LaunchPrefillWgmmaTyped<64, BN, S, K == kPrefillWgmmaOverlap, W == 12>(g, p,    \
                                                                                         stream);
    ATTND_PREFILL_CASE(0, 4, 2, 1, 64)
    ATTND_PREFILL_CASE(1, 8, 2, 1, 64)
    ATTND_PREFILL_CASE(2, 8, 3, 1, 64)
    ATTND_PREFILL_CASE(3, 4, 2, 2, 32)
    ATTND_PREFILL_CASE(4, 4, 3, 2, 32)
    ATTND_PREFILL_CASE(5, 4, 2, 2, 64)
    ATTND_PREFILL_WGMMA_CASE(6, 8, 2, 128, kPrefillWgmma)
    ATTND_PREFILL_WGMMA_CASE(7, 8, 3, 128, kPrefillWgmmaOverlap)
    ATTND_PREFILL_WGMMA_CASE(8, 8, 4, 64, kPrefillWgmmaOverlap)
    ATTND_PREFILL_WGMMA_CASE(9, 12, 3, 128, kPrefillWgmma)
    ATTND_PREFILL_WGMMA_CASE(10, 12, 3, 128, kPrefillWgmmaOverlap)
// Warp-specialised (12 warps) kernels with Opt bits (prefill_wgmma.cuh).
#define ATTND_PREFILL_WGMMA_OPT_CASE(i, S, BN, K, OVERLAP, OPT)                                \
  case i:                                                                                      \
    static_assert(kPrefillVariants[i].warps == 12 && kPrefillVariants[i].stages == S &&        \
                      kPrefillVariants[i].m_tiles == 1 && kPrefillVariants[i].block_n == BN && \
                      kPrefillVariants[i].kernel == K,                                         \
                  "kPrefillVariants order");                                                   \
    return d128 ? LaunchPrefillWgmmaTyped<128, BN, S, OVERLAP, true, OPT>(g, p, stream)        \
                : LaunchPrefillWgmmaTyped<64, BN, S, OVERLAP, true, OPT>(g, p, stream);
    ATTND_PREFILL_WGMMA_OPT_CASE(11, 3, 128, kPrefillWgmmaAsync, false,
                                 cuda_kernels::wgmma::kOptAsyncProducer)
    ATTND_PREFILL_WGMMA_OPT_CASE(
        12, 3, 128, kPrefillWgmmaAsyncOverlap, true,
        cuda_kernels::wgmma::kOptAsyncProducer | cuda_kernels::wgmma::kOptNoPingPong)
    ATTND_PREFILL_WGMMA_OPT_CASE(13, 3, 128, kPrefillWgmmaAsyncPingPong, true,
                                 cuda_kernels::wgmma::kOptAsyncProducer)
    ATTND_PREFILL_WGMMA_OPT_CASE(14, 3, 128, kPrefillWgmmaAsyncLate, true,
                                 cuda_kernels::wgmma::kOptAsyncProducer |
                                     cuda_kernels::wgmma::kOptNoPingPong |
                                     cuda_kernels::wgmma::kOptLateRescale)
#undef ATTND_PREFILL_CASE
#undef ATTND_PREFILL_WGMMA_CASE
#undef ATTND_PREFILL_WGMMA_OPT_CASE
    default:
      return absl::InvalidArgumentError(absl::StrCat("prefill: no variant ", p.variant));
  }
}

absl::Status LaunchDcaPrefillReference(const DcaGeometry& g, const CudaPrefillParams& p,
                                       cudaStream_t stream) {
  if (absl::Status s = CheckPrefill(g, p); !s.ok()) return s;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), g.num_q_heads);
  const int out = static_cast<int>(p.out_dtype);
  const auto start = static_cast<int32_t>(p.start);
  const auto cl = static_cast<int32_t>(g.chunk_len);
  if (g.head_dim == 128) {
    cuda_kernels::DcaPrefillReferenceKernel<128><<<grid, 32, 0, stream>>>(
        p.kv, p.q, p.out, out, start, cl, g.num_q_heads, g.group_size(), p.softmax_scale);
  } else {
    cuda_kernels::DcaPrefillReferenceKernel<64><<<grid, 32, 0, stream>>>(
        p.kv, p.q, p.out, out, start, cl, g.num_q_heads, g.group_size(), p.softmax_scale);
  }
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaPrefillReferenceKernel");
  return absl::OkStatus();
}

int32_t ResolveDecodeVariant(int32_t kv_stages, int32_t variant) {
  if (variant >= 0) return variant < kNumDecodeKernelVariants ? variant : -1;
  if (variant != -1) return -1;
  switch (kv_stages) {
    case 0:
      return kDefaultDecodeVariant;
    case 2:
      return 0;
    case 4:
      return 1;
    default:
      return -1;
  }
}

int32_t DefaultDecodeVariant(const DcaGeometry& g, int32_t batch, int32_t num_sms) {
  const int64_t blocks = int64_t{std::max(1, batch)} * std::max(1, g.num_kv_heads);
  const int64_t one_wave =
      int64_t{std::max(1, num_sms)} * DecodeVariantBlocksPerSm(g, kDefaultDecodeVariant);
  return blocks > one_wave ? kDefaultLargeBatchDecodeVariant : kDefaultDecodeVariant;
}

int32_t PlanDecodeSplits(const DcaGeometry& g, int32_t batch, int64_t max_length, int32_t num_sms,
                         int32_t kv_stages, int32_t variant) {
  int v = kv_stages == 0 && variant == -1 ? DefaultDecodeVariant(g, batch, num_sms)
                                          : ResolveDecodeVariant(kv_stages, variant);
  if (v < 0) v = kDefaultDecodeVariant;
  const int64_t resident = int64_t{std::max(1, num_sms)} * DecodeVariantBlocksPerSm(g, v);
  const int64_t blocks = std::max<int64_t>(1, int64_t{batch} * std::max(1, g.num_kv_heads));
  const int64_t want = resident / blocks;  // splits that still fit in one wave
  const int64_t cap = std::max<int64_t>(1, (max_length + 255) / 256);
  return static_cast<int32_t>(std::clamp<int64_t>(want, 1, std::min<int64_t>(cap, 1024)));
}

size_t DecodeWorkspaceFloats(const DcaGeometry& g, int32_t batch, int32_t max_splits) {
  const size_t slots = static_cast<size_t>(batch) * g.num_q_heads * max_splits;
  return slots * g.head_dim + slots;
}

absl::Status LaunchDcaDecode(const DcaGeometry& g, const CudaDecodeParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckDecode(g, p); !s.ok()) return s;
  if (p.max_splits < 1 || p.max_splits > 65535 || p.partial_out == nullptr ||
      p.partial_lse == nullptr) {
    return absl::InvalidArgumentError("decode: bad max_splits or null workspace");
  }
  int v = ResolveDecodeVariant(p.kv_stages, p.variant);
  if (p.kv_stages == 0 && p.variant == -1) {  // the batch-aware default, as PlanDecodeSplits chose
    int device = 0, num_sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError("decode: cannot read the device's multiprocessor count");
    }
    v = DefaultDecodeVariant(g, p.batch, num_sms);
  }
  if (v < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: kv_stages ", p.kv_stages, " / variant ", p.variant,
        " unsupported (kv_stages 0, 2, 4; variant -1.. ", kNumDecodeKernelVariants - 1, ")"));
  }
  return g.head_dim == 128 ? LaunchDecodeVariant<128>(g, p, v, stream)
                           : LaunchDecodeVariant<64>(g, p, v, stream);
}

absl::Status LaunchDcaDecodeReference(const DcaGeometry& g, const CudaDecodeParams& p,
                                      cudaStream_t stream) {
  if (absl::Status s = CheckDecode(g, p); !s.ok()) return s;
  const dim3 grid(p.batch, g.num_q_heads);
  const int out = static_cast<int>(p.out_dtype);
  const auto cl = static_cast<int32_t>(g.chunk_len);
  if (g.head_dim == 128) {
    cuda_kernels::DcaDecodeReferenceKernel<128><<<grid, 32, 0, stream>>>(
        p.kv, p.lengths, p.q, p.out, out, cl, g.num_q_heads, g.group_size(), g.softmax_scale,
        g.original_max_position_embeddings);
  } else {
    cuda_kernels::DcaDecodeReferenceKernel<64><<<grid, 32, 0, stream>>>(
        p.kv, p.lengths, p.q, p.out, out, cl, g.num_q_heads, g.group_size(), g.softmax_scale,
        g.original_max_position_embeddings);
  }
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("DcaDecodeReferenceKernel");
  return absl::OkStatus();
}

}  // namespace attnd
