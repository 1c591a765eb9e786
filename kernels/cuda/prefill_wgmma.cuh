// Hopper (sm_90a) fused DCA prefill on wgmma: the same contract and grid as DcaPrefillKernel in
// dca_cuda_kernels.cuh (one launch covers every piece and the three stages, one online softmax per
// row, K/V read through the page table, each K/V tile serves the whole GQA group). Included by
// dca_cuda.cu only, after dca_cuda_kernels.cuh (it reuses PrefillArgs and the small helpers).
//
// Block: two consumer warpgroups (256 threads), 128 query rows = (token, q head of the kv head's
// group) pairs; warpgroup w owns rows [64w, 64w + 64). Per K/V tile of BN keys:
//   S = Q K^T   wgmma.m64nBNk16, A = this stage's query variant in shared memory, B = K tile;
//   online softmax in registers (scale folded into one FFMA before ex2);
//   O += P V    wgmma.m64nDk16, A = P from registers (the accumulator layout of S is the A-fragment
//               layout, as for mma.sync), B = V tile read through the descriptor's transpose bit.
// Shared tiles use the 128-byte swizzle: a tile of R rows x D bf16 is stored as D/64 column blocks
// of R rows x 128 bytes, 16-byte chunk c of row r at chunk position c ^ (r % 8); 8-row groups are
// 1024 bytes apart (the descriptors' stride byte offset). K and Q are K-major operands; V is the
// same bytes read as an MN-major B operand (leading byte offset = one column block).
// K/V tiles arrive through a Stages-deep cp.async ring issued by all 256 threads (16 bytes each,
// zero-filled past the key range); one __syncthreads per tile publishes a tile and retires the
// slot the next load reuses. With Overlap, the S wgmma of tile j is issued together with the P V
// wgmma of tile j-1, so the softmax of tile j runs while the tensor cores do P V (FA3's
// intra-warpgroup pipelining); a slot is then free one tile later, hence Stages >= 3.
// With Ws (warp-specialised, the default variant) a third warpgroup issues the ring instead and
// hands tiles over through mbarriers; see DcaPrefillWgmmaKernel.
// NOTE the asm wrappers below spell out all N/2 accumulator operands of one wgmma.
#ifndef ATTND_KERNELS_CUDA_PREFILL_WGMMA_CUH_
#define ATTND_KERNELS_CUDA_PREFILL_WGMMA_CUH_

#include <cuda_bf16.h>
#include <math_constants.h>

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

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// cp.async.wait_group with a run-time count (0..3).
__device__ __forceinline__ void CpAsyncWaitN(int n) {
  switch (n) {
    case 0:
      CpAsyncWait<0>();
      break;
    case 1:
      CpAsyncWait<1>();
      break;
    case 2:
      CpAsyncWait<2>();
      break;
    default:
      CpAsyncWait<3>();
      break;
  }
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

// K and V rows [k0, k0 + BN) of kv_head into swizzled tiles, by NThreads threads (tid = this
// thread's index among them); rows at or past k_hi are zero-filled and never read from global
// memory. Each thread walks its rows page by page: the page table is read once per page crossed.
template <int D, int BN, int NThreads>
__device__ __forceinline__ void LoadKvTileSwizzled(const PagedKv<Bf16>& kv, int32_t kv_head,
                                                   int32_t k0, int32_t k_hi, uint32_t ks,
                                                   uint32_t vs, int tid) {
  constexpr int kChunks = D / 8;
  constexpr int kRowsPerPass = NThreads / kChunks;
  static_assert(NThreads % kChunks == 0 && BN % kRowsPerPass == 0, "loader mapping");
  const int chunk = tid % kChunks;
  const int row0 = tid / kChunks;
  const int32_t ps = kv.page_size;
  const int32_t row_stride = kv.num_kv_heads * D;  // elements between two slots of a page
  int32_t pos = k0 + row0;
  int32_t pidx = pos / ps;
  int32_t slot = pos - pidx * ps;
  auto page_base = [&]() -> int64_t {
    return pos < k_hi ? static_cast<int64_t>(kv.page_table[pidx]) * ps * row_stride + kv_head * D +
                            chunk * 8
                      : 0;
  };
  int64_t base = page_base();
#pragma unroll
  for (int i = 0; i < BN / kRowsPerPass; ++i) {
    const int row = row0 + i * kRowsPerPass;
    const bool valid = pos < k_hi;
    const int64_t off = base + slot * row_stride;
    const uint32_t dst = SwizzledOffset(BN, row, chunk);
    const int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ks + dst), "l"(kv.k + off),
                 "r"(src_size));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(vs + dst), "l"(kv.v + off),
                 "r"(src_size));
    pos += kRowsPerPass;
    slot += kRowsPerPass;
    if (slot >= ps) {
      const int32_t adv = slot / ps;
      pidx += adv;
      slot -= adv * ps;
      base = page_base();
    }
  }
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
      const int64_t off = (e * ps + (pos - pidx * ps)) * row_stride + head_off;
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

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// Barrier of one consumer warpgroup (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void WarpgroupBarrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

// Threads of a block: two consumer warpgroups, plus a producer warpgroup when warp-specialised
// (registers are allocated per warpgroup on sm_90, so a lone producer warp would cost as much).
template <bool Ws>
constexpr int BlockThreads() {
  return Ws ? kThreads + 128 : kThreads;
}
// Ws register split (setmaxnreg): 128 x 40 + 256 x 232 <= 64K.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// Opt bits of DcaPrefillWgmmaKernel (0 = the variants 6-10 as first measured).
//   kOptAsyncProducer (Ws only): LoadKvTileRows, and each producer thread publishes a tile with
//     cp.async.mbarrier.arrive.noinc right after issuing it (the tile's full barrier completes when
//     the copies land; the consumers fence for the async proxy after their wait), so the producer
//     never waits for its own copies and can run a whole ring ahead; registers 56 / 224 (no
//     spills).
//   kOptNoPingPong (Ws && Overlap): the intra-warpgroup overlap without the ping-pong turns.
//   kOptLateRescale (Overlap): FA3's order inside an iteration: P of tile j-1 is packed right after
//     its softmax, and O is rescaled for tile j-1 only after the S wgmma of tile j is issued (the
//     tensor cores start S(j) before the 64 multiplies, instead of after them).
constexpr int kOptAsyncProducer = 1;
constexpr int kOptNoPingPong = 2;
constexpr int kOptLateRescale = 4;
constexpr int kAsyncProducerRegs = 56;  // 128 x 56 + 256 x 224 = 64512 = 384 x 168
constexpr int kAsyncConsumerRegs = 224;

// grid (query tiles over all pieces, num_kv_heads), block BlockThreads<Ws>(); see the top of this
// file. Tile order, pieces and key ranges are those of DcaPrefillKernel.
// Ws (warp-specialised): warpgroup 2 alone issues the K/V cp.async ring and hands tiles over
// through mbarriers (full: 128 producer arrivals after their copies landed and were fenced for the
// async proxy; empty: 256 consumer arrivals after the last wgmma that read the slot), so the two
// consumer warpgroups never wait for each other and drift into overlapping softmax and wgmma.
template <int D, int BN, int Stages, bool Overlap, bool Ws, int Opt = 0>
__global__ void __launch_bounds__(BlockThreads<Ws>(), 1)
    DcaPrefillWgmmaKernel(const PrefillArgs a) {
#if ATTND_WGMMA_ENABLED
  constexpr bool kAsync = Ws && (Opt & kOptAsyncProducer) != 0;
  static_assert(Ws || Opt == 0, "Opt bits need the warp-specialised kernel");
  constexpr bool kLateRescale = Overlap && (Opt & kOptLateRescale) != 0;
  static_assert(D == 64 || D == 128, "head_dim");
  static_assert(BN == 64 || BN == 128, "block_n");
  static_assert(Stages >= (Overlap && !Ws ? 3 : 2) && Stages <= 4, "stages");
  __shared__ __align__(8) uint64_t full_bar[Stages], empty_bar[Stages];
  constexpr int kTileBytes = BN * D * 2;
  constexpr int kKSteps = D / 16;        // k-steps of S = Q K^T
  constexpr int kPSteps = BN / 16;       // k-steps of O += P V
  constexpr int kLag = Overlap ? 2 : 1;  // a tile's slot is free kLag iterations after its own
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle is a function of address bits 4-9: tiles must start on 1024-byte boundaries
  // (the launcher adds 1024 bytes of slack).
  const uint32_t smem_unaligned = SmemAddr(smem_raw);
  const uint32_t smem = (smem_unaligned + 1023u) & ~1023u;
  const uint32_t ks = smem;                      // [Stages][D/64][BN][128 B]
  const uint32_t vs = ks + Stages * kTileBytes;  // [Stages][D/64][BN][128 B]
  const uint32_t qs = vs + Stages * kTileBytes;  // [D/64][kBlockM][128 B]
  unsigned char* qs_ptr = smem_raw + (smem - smem_unaligned) + 2 * Stages * kTileBytes;

  const int kv_head = blockIdx.y;
  const int32_t cl = a.chunk_len;
  const PrefillTile pt = PrefillTileOfBlock(a);
  const int32_t piece_begin = pt.piece_begin, piece_end = pt.piece_end, prev = pt.prev;
  const int32_t local = pt.local;
  const int32_t piece_tokens = piece_end - piece_begin;
  const int64_t piece_rows = static_cast<int64_t>(piece_tokens) * a.group;
  const int64_t row_base = static_cast<int64_t>(local) * kBlockM;
  if (row_base >= piece_rows) return;  // past a short last piece (whole block: no barrier issue)
  const int32_t max_q_pos =
      piece_begin + static_cast<int32_t>(min(piece_rows - 1, row_base + kBlockM - 1) / a.group);

  if constexpr (Ws) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < Stages; ++i) {
        MbarInit(SmemAddr(&full_bar[i]), 128);  // one (cp.async-triggered) arrival per producer
        MbarInit(SmemAddr(&empty_bar[i]), kThreads);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // the only block-wide barrier: roles split below
  }
  const int wg = threadIdx.x / 128;
  const int wtid = threadIdx.x % 128;
  const int warp = wtid / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, tig = lane % 4;
  // This thread's two accumulator rows: 64 wg + 16 warp + gid (+ 8).
  int32_t q_pos[2];
  int64_t q_row[2];  // token * Hq + head, token relative to start
  bool row_valid[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t flat = row_base + 64 * wg + 16 * warp + gid + 8 * i;
    const int32_t tok = static_cast<int32_t>(flat / a.group);
    const int32_t head = kv_head * a.group + static_cast<int32_t>(flat % a.group);
    row_valid[i] = tok < piece_tokens;
    q_pos[i] = row_valid[i] ? piece_begin + tok : max_q_pos;
    q_row[i] =
        row_valid[i] ? static_cast<int64_t>(piece_begin + tok - a.start) * a.num_q_heads + head : 0;
  }
  const int32_t min_q_pos = min(q_pos[0], q_pos[1]);

  // Key tiles: inter [0, prev-cl), succ [prev-cl, prev), intra [prev, max_q_pos].
  const int32_t inter_hi = prev >= 2 * cl ? prev - cl : 0;
  const int32_t succ_lo = prev >= cl ? prev - cl : prev;
  const int n_inter = (inter_hi + BN - 1) / BN;
  const int n_succ = (prev - succ_lo + BN - 1) / BN;
  const int n_intra = (max_q_pos + 1 - prev + BN - 1) / BN;
  const int n_tiles = n_inter + n_succ + n_intra;
  auto tile_range = [&](int j, int& stage, int32_t& k0, int32_t& khi) {
    if (j < n_inter) {
      stage = kInter;
      k0 = j * BN;
      khi = inter_hi;
    } else if (j < n_inter + n_succ) {
      stage = kSucc;
      k0 = succ_lo + (j - n_inter) * BN;
      khi = prev;
    } else {
      stage = kIntra;
      k0 = prev + (j - n_inter - n_succ) * BN;
      khi = max_q_pos + 1;
    }
  };
  auto load_tile = [&](int t) {
    if (t < n_tiles) {
      int st;
      int32_t k0, khi;
      tile_range(t, st, k0, khi);
      const int slot = t % Stages;
      LoadKvTileSwizzled<D, BN, Ws ? 128 : kThreads>(a.kv, kv_head, k0, khi, ks + slot * kTileBytes,
                                                     vs + slot * kTileBytes,
                                                     Ws ? wtid : static_cast<int>(threadIdx.x));
    }
    CpAsyncCommit();
  };
  // This warpgroup's 64 query rows of variant `stage` into qs (plain loads; rows past the piece
  // are zero).
  auto load_q = [&](int stage) {
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int c = wtid; c < 64 * kChunks; c += 128) {
      const int r = c / kChunks, chunk = c % kChunks;
      const int64_t flat = row_base + 64 * wg + r;
      const int32_t tok = static_cast<int32_t>(flat / a.group);
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (tok < piece_tokens) {
        const int32_t head = kv_head * a.group + static_cast<int32_t>(flat % a.group);
        const int64_t t_idx = piece_begin + tok - a.start;
        val = *reinterpret_cast<const uint4*>(
            a.q + ((t_idx * kNumQueryVariants + stage) * a.num_q_heads + head) * D + chunk * 8);
      }
      *reinterpret_cast<uint4*>(qs_ptr + SwizzledOffset(kBlockM, 64 * wg + r, chunk)) = val;
    }
  };

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float s[BN / 2];
  uint32_t pa[kPSteps][4];
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F};  // running max of raw scores
  float l[2] = {0.f, 0.f};                      // this thread's partial row sums
  int q_stage = -1;

  const uint32_t q_wg = qs + 64 * wg * 128;
  auto issue_s = [&](int slot) {
    const uint32_t kt = ks + slot * kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const uint32_t col = (kk % 4) * 32;  // 16 bf16 = 32 bytes along the swizzled row
      const uint64_t da = Desc(q_wg + (kk / 4) * (kBlockM * 128) + col, 16, 1024);
      const uint64_t db = Desc(kt + (kk / 4) * (BN * 128) + col, 16, 1024);
      WgmmaSS<BN>(s, da, db, kk > 0 ? 1 : 0);
    }
  };
  auto issue_pv = [&](int slot) {
    const uint32_t vt = vs + slot * kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      WgmmaRS<D>(o, pa[kk], Desc(vt + kk * 16 * 128, BN * 128, 1024));
    }
  };
  // Mask, new running max, p = 2^(x * scale_log2 - m * scale_log2) in place; returns the rescale
  // factors of the old O and l.
  auto softmax = [&](int stage, int32_t k0, int32_t khi, float(&alpha)[2]) {
    const bool need_mask = k0 + BN > khi || (stage == kIntra && k0 + BN - 1 > min_q_pos);
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        const int32_t key = k0 + 8 * (i / 4) + 2 * tig + (i & 1);
        const int r = (i >> 1) & 1;
        const bool visible = key < khi && (stage != kIntra || key <= q_pos[r]);
        if (!visible) s[i] = -CUDART_INF_F;
      }
    }
    // NOTE: four independent partial maxima/sums per row (shorter dependency chains) measured
    // the same as these running values (NOTES.md), so the simple form stays.
    float tile_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], s[i]);
    float neg_m[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float m_new = fmaxf(m[r], tile_max[r]);
      const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
      alpha[r] = Ex2((m[r] - m_use) * a.scale_log2);
      m[r] = m_new;
      neg_m[r] = -m_use * a.scale_log2;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int r = (i >> 1) & 1;
      s[i] = Ex2(fmaf(s[i], a.scale_log2, neg_m[r]));
      sum[r] += s[i];
    }
    l[0] = l[0] * alpha[0] + sum[0];
    l[1] = l[1] * alpha[1] + sum[1];
  };
  auto rescale = [&](const float(&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
  };
  auto pack = [&]() {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      pa[kk][0] = PackBf16(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = PackBf16(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = PackBf16(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = PackBf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto rescale_and_pack = [&](const float(&alpha)[2]) {
    rescale(alpha);
    pack();
  };
  // kLateRescale: the factors of the tile whose P V is issued next (applied to O just before).
  float alpha_prev[2] = {1.f, 1.f};

  if constexpr (Ws) {
    if constexpr (kAsync) {
      if (wg == 2) {  // tile t into slot t % Stages once tile t - Stages is done
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kAsyncProducerRegs));
        const int32_t ps = a.kv.page_size;
        const int page_shift = (ps & (ps - 1)) == 0 ? __ffs(ps) - 1 : -1;
        for (int t = 0; t < n_tiles; ++t) {
          const int slot = t % Stages;
          if (t >= Stages) MbarWait(SmemAddr(&empty_bar[slot]), ((t / Stages) - 1) & 1);
          int st;
          int32_t k0, khi;
          tile_range(t, st, k0, khi);
          LoadKvTileRows<D, BN>(a.kv, kv_head, k0, khi, ks + slot * kTileBytes,
                                vs + slot * kTileBytes, wtid, page_shift);
          CpAsyncMbarArrive(SmemAddr(&full_bar[slot]));
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
        return;
      }
    } else if (wg == 2) {  // the producer: tile t into slot t % Stages once tile t - Stages is done
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
      for (int t = 0; t < n_tiles; ++t) {
        const int slot = t % Stages;
        if (t >= Stages) MbarWait(SmemAddr(&empty_bar[slot]), ((t / Stages) - 1) & 1);
        load_tile(t);
        if (t >= 1) {  // tile t-1 has landed: publish it (tile t stays in flight)
          CpAsyncWait<1>();
          FenceProxyAsync();
          MbarArrive(SmemAddr(&full_bar[(t - 1) % Stages]));
        }
      }
      CpAsyncWait<0>();
      FenceProxyAsync();
      MbarArrive(SmemAddr(&full_bar[(n_tiles - 1) % Stages]));
      return;
    }
    if constexpr (kAsync) {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kAsyncConsumerRegs));
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    }
  } else {
    for (int t = 0; t < Stages; ++t) load_tile(t);  // prologue: every slot; tile t is group t
  }

  // Waits for tile j, publishes it and this stage's queries, and (not Ws) refills the slot freed
  // kLag tiles ago. Returns tile j's stage and key range.
  auto begin_tile = [&](int j, int& stage, int32_t& k0, int32_t& khi) {
    tile_range(j, stage, k0, khi);
    if (stage != q_stage) {
      q_stage = stage;
      WarpgroupBarrier(wg);  // every warp of the warpgroup is past its last S wgmma
      load_q(stage);
      if constexpr (Ws) {
        FenceProxyAsync();
        WarpgroupBarrier(wg);
      }
    }
    if constexpr (Ws) {
      MbarWait(SmemAddr(&full_bar[j % Stages]), (j / Stages) & 1);
      // kAsync: the copies were made visible to this thread by the barrier; order them before
      // this thread's wgmma (async proxy) reads of the slot.
      if constexpr (kAsync) FenceProxyAsync();
    } else {
      // NOTE: tile t is cp.async group t (the prologue commits Stages groups, iteration i >= kLag
      // one, for tile i + Stages - kLag), so Stages + max(0, j - kLag) groups exist here and all
      // but the newest Stages - 1 - min(j, kLag) must have landed.
      CpAsyncWaitN(j < kLag ? Stages - 1 - j : Stages - 1 - kLag);
      FenceProxyAsync();
      __syncthreads();  // tile j (and the new Q) visible; every thread is past tile j-kLag's wgmmas
      if (j >= kLag) load_tile(j + Stages - kLag);  // into the slot of tile j - kLag
    }
  };
  // Ws: the slot of tile t may be refilled (this thread's wgmmas that read it have completed).
  auto release = [&](int t) {
    if constexpr (Ws) MbarArrive(SmemAddr(&empty_bar[t % Stages]));
  };

  // Ws && Overlap: FA3's ping-pong. The warpgroups take turns issuing their wgmmas (named
  // barriers 3 and 4, 256 threads: one warpgroup syncs, the other arrives), so one warpgroup's
  // softmax runs while the other's wgmmas hold the tensor cores. Warpgroup 1 opens the first turn
  // for warpgroup 0 and skips its last hand-back, so no arrival is left pending at exit.
  constexpr bool kPingPong = Ws && Overlap && (Opt & kOptNoPingPong) == 0;
  auto turn_wait = [&]() {
    if constexpr (kPingPong) asm volatile("bar.sync %0, 256;\n" ::"r"(3 + wg) : "memory");
  };
  auto turn_pass = [&](int j) {
    if constexpr (kPingPong) {
      if (!(wg == 1 && j == n_tiles - 1)) {
        asm volatile("bar.arrive %0, 256;\n" ::"r"(3 + (1 - wg)) : "memory");
      }
    }
  };
  if constexpr (kPingPong) {
    if (wg == 1) asm volatile("bar.arrive 3, 256;\n" ::: "memory");
  }

  // n_tiles >= 1: the intra range always holds the piece's first key.
  if constexpr (!Overlap) {
    for (int j = 0; j < n_tiles; ++j) {
      int stage;
      int32_t k0, khi;
      begin_tile(j, stage, k0, khi);
      float alpha[2];
      Fence();
      issue_s(j % Stages);
      Commit();
      Wait<0>();
      FenceRegs(s);
      softmax(stage, k0, khi, alpha);
      rescale_and_pack(alpha);
      FenceRegs(o);
      FenceRegs(pa);
      Fence();
      issue_pv(j % Stages);
      Commit();
      Wait<0>();
      FenceRegs(o);
      release(j);
    }
  } else {
    {
      int stage;
      int32_t k0, khi;
      begin_tile(0, stage, k0, khi);
      float alpha[2];
      turn_wait();
      Fence();
      issue_s(0);
      Commit();
      turn_pass(0);
      Wait<0>();
      FenceRegs(s);
      softmax(stage, k0, khi, alpha);
      if constexpr (kLateRescale) {
        pack();
        alpha_prev[0] = alpha[0];
        alpha_prev[1] = alpha[1];
      } else {
        rescale_and_pack(alpha);
      }
    }
    for (int j = 1; j < n_tiles; ++j) {
      int stage;
      int32_t k0, khi;
      begin_tile(j, stage, k0, khi);
      float alpha[2];
      FenceRegs(o);
      FenceRegs(pa);
      turn_wait();
      Fence();
      issue_s(j % Stages);
      Commit();
      if constexpr (kLateRescale) {  // O is no operand of the S wgmma in flight
        rescale(alpha_prev);
        FenceRegs(o);
        Fence();
      }
      issue_pv((j - 1) % Stages);
      Commit();
      turn_pass(j);
      Wait<1>();  // S of tile j done; P V of tile j-1 may still run
      FenceRegs(s);
      softmax(stage, k0, khi, alpha);
      Wait<0>();
      FenceRegs(o);
      FenceRegs(pa);
      release(j - 1);
      if constexpr (kLateRescale) {
        pack();
        alpha_prev[0] = alpha[0];
        alpha_prev[1] = alpha[1];
      } else {
        rescale_and_pack(alpha);
      }
    }
    if constexpr (kLateRescale) rescale(alpha_prev);
    FenceRegs(o);
    FenceRegs(pa);
    Fence();
    issue_pv((n_tiles - 1) % Stages);
    Commit();
    Wait<0>();
    FenceRegs(o);
  }
  if constexpr (!Ws) CpAsyncWait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    if (!row_valid[r]) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const int64_t base = q_row[r] * D;
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) {
      StorePair(a.out, a.out_dtype, base + nb * 8 + tig * 2, o[4 * nb + 2 * r] * inv,
                o[4 * nb + 2 * r + 1] * inv);
    }
  }
#else
  __trap();  // not an sm_90a device pass: the launcher never selects this kernel here
#endif
}

}  // namespace wgmma
}  // namespace cuda_kernels
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_PREFILL_WGMMA_CUH_
