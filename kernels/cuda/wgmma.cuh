// Hopper (sm_90a) device layer of the wgmma kernels: shared-memory matrix descriptors over the
// 128-byte swizzle, the wgmma wrappers (S = Q K^T from shared memory, O += P V with P in
// registers), register fences, the asynchronous K/V tile loader of a producer warpgroup, and the
// warpgroup barrier. Device code only; used by prefill_wgmma.cuh (the product kernel) and by the
// tuning lab (bench/gpu/lab/prefill_wgmma_lab.cuh).
//
// Shared tiles use the 128-byte swizzle: a tile of R rows x D bf16 is stored as D/64 column blocks
// of R rows x 128 bytes, 16-byte chunk c of row r at chunk position c ^ (r % 8); 8-row groups are
// 1024 bytes apart (the descriptors' stride byte offset). K and Q are K-major operands; V is the
// same bytes read as an MN-major B operand (leading byte offset = one column block).
// NOTE the asm wrappers below spell out all N/2 accumulator operands of one wgmma.
#ifndef ATTND_KERNELS_CUDA_WGMMA_CUH_
#define ATTND_KERNELS_CUDA_WGMMA_CUH_

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/dca_cuda_kernels.cuh"

namespace attnd {
namespace cuda_kernels {
namespace wgmma {

// True in the device pass that may use wgmma (sm_90a); the other passes (the compute_90 PTX
// target) compile the kernel to a trap, and the launcher only picks it on compute capability 9.0.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTND_WGMMA_ENABLED 1
#else
#define ATTND_WGMMA_ENABLED 0
#endif

constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kBlockM = 64 * kWarpgroups;

// Shared-memory matrix descriptor, 128-byte swizzle. Byte offsets are encoded in 16-byte units.
__device__ __forceinline__ uint64_t Desc(uint32_t smem_addr, uint32_t lbo_bytes,
                                         uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

// Byte offset of 16-byte chunk `chunk` (0 .. D/8-1) of row `row` in a swizzled tile of `rows` rows.
__device__ __forceinline__ uint32_t SwizzledOffset(int rows, int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * rows * 128 + row * 128 +
                               (((chunk & 7) ^ (row & 7)) << 4));
}

__device__ __forceinline__ void Fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void Commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void Wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (cp.async, st.shared) become visible to wgmma reads.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accumulator reads/writes across wgmma issue/wait points.
template <int N>
__device__ __forceinline__ void FenceRegs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void FenceRegs(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// d (64 x N fp32, this thread's N/2) = (scale_d ? d : 0) + A (smem, 64 x 16) * B (smem, 16 x N).
template <int N>
__device__ __forceinline__ void WgmmaSS(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d);
// d += A (registers, 64 x 16 bf16) * B (smem, MN-major, 16 x N).
template <int N>
__device__ __forceinline__ void WgmmaRS(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db);

template <>
__device__ __forceinline__ void WgmmaSS<64>(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18,"
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void WgmmaRS<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18,"
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

template <>
__device__ __forceinline__ void WgmmaSS<128>(float (&d)[64], uint64_t da, uint64_t db,
                                             int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18,"
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35,"
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52,"
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void WgmmaRS<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18,"
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35,"
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52,"
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

// The async producer's loader (Opt & kOptAsyncProducer): 128 threads, thread tid copies 16-byte
// chunk tid % (D/8) of R = BN * D / 8 / 128 consecutive rows (16 at D = 128, 8 at D = 64), so a
// warp still writes whole 256-byte rows per instruction but a thread's rows touch one or two pages.
// All page-table reads of the tile are independent loads issued before the copies (the mma.sync
// loader's walk makes one dependent load, and an integer division, per page crossed). Power-of-two
// page sizes of at least R rows (the deployed 16, 32, 64, ...) use shifts and masks and two table
// entries per thread; any other page size takes the generic per-row path (a division per row).
// Rows at or past k_hi are zero-filled and never read from global memory or the page table.
template <int D, int BN>
__device__ __forceinline__ void LoadKvTileRows(const PagedKv<Bf16>& kv, int32_t kv_head, int32_t k0,
                                               int32_t k_hi, uint32_t ks, uint32_t vs, int tid,
                                               int page_shift) {
  constexpr int kChunks = D / 8;
  constexpr int kRows = BN * kChunks / 128;  // rows per thread
  static_assert(128 % kChunks == 0 && kRows * (128 / kChunks) == BN, "loader mapping");
  const int chunk = tid % kChunks;
  const int row0 = (tid / kChunks) * kRows;
  const int32_t ps = kv.page_size;
  const int64_t row_stride = static_cast<int64_t>(kv.num_kv_heads) * D;
  const int64_t head_off = static_cast<int64_t>(kv_head) * D + chunk * 8;
  const int32_t pos0 = k0 + row0;
  if (page_shift >= 0 && ps >= kRows) {  // rows [pos0, pos0 + kRows) span at most two pages
    const int32_t mask = ps - 1;
    const int32_t p0 = pos0 >> page_shift;
    const int64_t p1_pos = static_cast<int64_t>(p0 + 1) << page_shift;  // next page's first row
    const int64_t e0 = pos0 < k_hi ? kv.page_table[p0] : 0;
    const int64_t e1 =
        p1_pos < k_hi && p1_pos < static_cast<int64_t>(pos0) + kRows ? kv.page_table[p0 + 1] : 0;
    const int64_t b0 = (e0 << page_shift) * row_stride + head_off;
    const int64_t b1 = (e1 << page_shift) * row_stride + head_off;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int32_t pos = pos0 + i;
      const int64_t off = (pos < p1_pos ? b0 : b1) + (pos & mask) * row_stride;
      const int src_size = pos < k_hi ? 16 : 0;
      const uint32_t dst = SwizzledOffset(BN, row0 + i, chunk);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ks + dst),
                   "l"(kv.k + off), "r"(src_size));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(vs + dst),
                   "l"(kv.v + off), "r"(src_size));
    }
  } else {  // any page size: one table entry and one division per row, all independent
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int32_t pos = pos0 + i;
      const bool valid = pos < k_hi;
      const int32_t pidx = pos / ps;
      const int64_t e = valid ? kv.page_table[pidx] : 0;
      const int64_t off = PagedTokenIndex(e, pos - pidx * ps, ps) * row_stride + head_off;
      const uint32_t dst = SwizzledOffset(BN, row0 + i, chunk);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ks + dst),
                   "l"(kv.k + off), "r"(valid ? 16 : 0));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(vs + dst),
                   "l"(kv.v + off), "r"(valid ? 16 : 0));
    }
  }
}

// Arrives (without incrementing the pending count) on the mbarrier once every cp.async this thread
// issued so far has landed: the producer publishes a tile without waiting for it.
__device__ __forceinline__ void CpAsyncMbarArrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Barrier of one consumer warpgroup (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void WarpgroupBarrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

}  // namespace wgmma
}  // namespace cuda_kernels
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_WGMMA_CUH_
