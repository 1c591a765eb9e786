// Hopper (sm_90a) fused DCA prefill on wgmma, the default prefill kernel: the same contract and
// grid as DcaPrefillKernel in dca_cuda_kernels.cuh (one launch covers every piece and the three
// stages, one online softmax per row, K/V read through the page table, each K/V tile serves the
// whole GQA group). Included by dca_prefill.cu only. How it was chosen over the alternatives, and
// the alternatives themselves, are in the tuning lab (bench/gpu/lab/, bench/gpu/NOTES.md).
//
// Block: three warpgroups. Warpgroups 0 and 1 consume: 128 query rows = (token, q head of the kv
// head's group) pairs, warpgroup w owns rows [64w, 64w + 64). Per K/V tile of kBlockN keys:
//   S = Q K^T   wgmma.m64nBNk16, A = this stage's query variant in shared memory, B = K tile;
//   online softmax in registers (scale folded into one FFMA before ex2);
//   O += P V    wgmma.m64nDk16, A = P from registers, B = V tile (the descriptor's transpose bit).
// Warpgroup 2 produces: it issues the kStages-deep ring of K/V tiles (LoadKvTileRows: all
// page-table reads of a tile up front) and publishes each tile with cp.async.mbarrier.arrive as its
// copies land, so it never waits for its own copies; the consumers return a slot through an
// mbarrier after the last wgmma that read it. Inside a consumer, the S wgmma of tile j is issued
// beside the P V wgmma of tile j-1 (the softmax overlaps the tensor cores), and the two consumers
// take turns issuing their wgmmas (FA3's ping-pong), so one's softmax runs under the other's
// wgmmas.
//
// Windowed (kWindowed): a launch processes only its window of each block's key tiles (KeyWindowOf)
// and keeps the block's softmax state (O, m, l: each consumer thread's registers) in a device
// workspace between launches, so a long call can be cut into launches of bounded duration. Every
// tile is processed as in the whole launch; what changes at a window's edges is only where the
// state lives: the last P V of a window completes before its state is saved (in the whole launch
// it runs beside the next tile's S), and the next window's first tile rescales the loaded O as
// the whole launch rescales the O that P V left. The output is the whole launch's bit for bit.
#ifndef ATTND_KERNELS_CUDA_PREFILL_WGMMA_CUH_
#define ATTND_KERNELS_CUDA_PREFILL_WGMMA_CUH_

#include <cuda_bf16.h>
#include <math_constants.h>

#include <cstdint>

#include "kernels/cuda/dca_cuda_kernels.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace attnd {
namespace cuda_kernels {
namespace wgmma {

using cuda_common::ApplyMask;
using cuda_common::MbarArrive;
using cuda_common::MbarInit;
using cuda_common::MbarWait;
using cuda_common::PackProbs;
using cuda_common::RescaleRows;
using cuda_common::SoftmaxState;
using cuda_common::TwoBoundMask;

constexpr int kPrefillBlockN = 128;  // keys per K/V tile
constexpr int kPrefillStages = 3;    // K/V ring depth (the overlap frees a slot one tile late)
constexpr int kPrefillThreads = kThreads + 128;  // two consumer warpgroups and the producer
// setmaxnreg split: 128 x 56 + 256 x 224 = 64512 registers, nothing spills.
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
// Dynamic shared memory: the K and V rings, the block's queries, and 1 KB to align the tiles.
template <int D>
constexpr size_t PrefillSmemBytes() {
  return (2 * kPrefillStages * kPrefillBlockN + kBlockM) * D * sizeof(Bf16) + 1024;
}

// The saved state of one consumer thread: its O fragment, then m and l of its two rows.
template <int D>
constexpr int kPrefillStateFields = D / 2 + 4;

// grid (query tiles over all pieces, num_kv_heads), block kPrefillThreads; see the top of this
// file. Tile order, pieces and key ranges are those of DcaPrefillKernel.
template <int D, bool kWindowed = false>
__global__ void __launch_bounds__(kPrefillThreads, 1) DcaPrefillWgmmaKernel(const PrefillArgs a) {
#if ATTND_WGMMA_ENABLED
  constexpr int BN = kPrefillBlockN;
  constexpr int Stages = kPrefillStages;
  static_assert(D == 64 || D == 128, "head_dim");
  __shared__ __align__(8) uint64_t full_bar[Stages], empty_bar[Stages];
  constexpr int kTileBytes = BN * D * 2;
  constexpr int kKSteps = D / 16;   // k-steps of S = Q K^T
  constexpr int kPSteps = BN / 16;  // k-steps of O += P V
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle is a function of address bits 4-9: tiles must start on 1024-byte boundaries.
  const uint32_t smem_unaligned = SmemAddr(smem_raw);
  const uint32_t smem = (smem_unaligned + 1023u) & ~1023u;
  const uint32_t ks = smem;                      // [Stages][D/64][BN][128 B]
  const uint32_t vs = ks + Stages * kTileBytes;  // [Stages][D/64][BN][128 B]
  const uint32_t qs = vs + Stages * kTileBytes;  // [D/64][kBlockM][128 B]
  unsigned char* qs_ptr = smem_raw + (smem - smem_unaligned) + 2 * Stages * kTileBytes;

  const int kv_head = blockIdx.y;
  const PrefillTile pt = PrefillTileOfBlock(a);
  const int32_t piece_begin = pt.piece_begin, piece_end = pt.piece_end, prev = pt.prev;
  const int32_t cl = a.chunk_len;
  const int32_t piece_tokens = piece_end - piece_begin;
  const int64_t piece_rows = static_cast<int64_t>(piece_tokens) * a.group;
  const int64_t row_base = static_cast<int64_t>(pt.local) * kBlockM;
  if (row_base >= piece_rows) return;  // past a short last piece (whole block: no barrier issue)
  const int32_t max_q_pos =
      piece_begin + static_cast<int32_t>(min(piece_rows - 1, row_base + kBlockM - 1) / a.group);

  if (threadIdx.x == 0) {
    for (int i = 0; i < Stages; ++i) {
      MbarInit(SmemAddr(&full_bar[i]), 128);  // one (cp.async-triggered) arrival per producer
      MbarInit(SmemAddr(&empty_bar[i]), kThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the only block-wide barrier: roles split below
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
  // This launch's tiles [first, end); ring slots and barrier phases count from `first`.
  const KeyWindow win = KeyWindowOf<kWindowed>(a, n_tiles);
  if (kWindowed && win.begin >= n_tiles) return;  // the whole block: no barrier is pending
  const int first = kWindowed ? win.begin : 0;    // a constant 0 in the whole launch
  const int end = win.end;
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

  if (wg == 2) {  // the producer: tile t into slot t % Stages once tile t - Stages is done
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    const PageIndexer pages(a.kv.page_size);
    const int page_shift = pages.pow2 ? static_cast<int>(pages.shift) : -1;
    for (int t = 0; t < end - first; ++t) {
      const int slot = t % Stages;
      if (t >= Stages) MbarWait(SmemAddr(&empty_bar[slot]), ((t / Stages) - 1) & 1);
      int st;
      int32_t k0, khi;
      tile_range(first + t, st, k0, khi);
      LoadKvTileRows<D, BN>(a.kv, kv_head, k0, khi, ks + slot * kTileBytes, vs + slot * kTileBytes,
                            wtid, page_shift);
      CpAsyncMbarArrive(SmemAddr(&full_bar[slot]));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));

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
  SoftmaxState state;  // over raw scores
  state.Init();
  // The state a previous window saved: m and l here, O once the first tile's scores are done
  // (loaded earlier, O would be live beside S and spill).
  const WindowState<kPrefillStateFields<D>, kThreads> saved(a.window_state, threadIdx.x);
  if constexpr (kWindowed) {
    if (first > 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        state.m[r] = saved[D / 2 + r];
        state.l[r] = saved[D / 2 + 2 + r];
      }
    }
  }
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
  // Mask (only tiles that cross the range's end or the causal diagonal need it), then the online
  // softmax: p in place of s, alpha the rescale factors of the old O.
  auto softmax = [&](int stage, int32_t k0, int32_t khi, float(&alpha)[2]) {
    const bool need_mask = k0 + BN > khi || (stage == kIntra && k0 + BN - 1 > min_q_pos);
    if (need_mask) ApplyMask(s, tig, TwoBoundMask{k0, khi, stage == kIntra, q_pos[0], q_pos[1]});
    state.Update<true>(s, a.scale_log2, alpha);
  };
  // O of the tiles so far rescaled, and P packed as the A operand of the next P V.
  auto rescale_and_pack = [&](const float(&alpha)[2]) {
    RescaleRows(o, alpha);
    PackProbs(s, pa);
  };
  // Waits for tile j and publishes this stage's queries. Returns tile j's stage and key range.
  auto begin_tile = [&](int j, int& stage, int32_t& k0, int32_t& khi) {
    tile_range(j, stage, k0, khi);
    if (stage != q_stage) {
      q_stage = stage;
      WarpgroupBarrier(wg);  // every warp of the warpgroup is past its last S wgmma
      load_q(stage);
      FenceProxyAsync();
      WarpgroupBarrier(wg);
    }
    MbarWait(SmemAddr(&full_bar[(j - first) % Stages]), ((j - first) / Stages) & 1);
    // The copies were made visible to this thread by the barrier; order them before this
    // thread's wgmma (async proxy) reads of the slot.
    FenceProxyAsync();
  };
  // The slot of tile t may be refilled (this thread's wgmmas that read it have completed).
  auto release = [&](int t) { MbarArrive(SmemAddr(&empty_bar[(t - first) % Stages])); };

  // FA3's ping-pong: the warpgroups take turns issuing their wgmmas (named barriers 3 and 4, 256
  // threads: one warpgroup syncs, the other arrives). Warpgroup 1 opens the first turn for
  // warpgroup 0 and skips its last hand-back, so no arrival is left pending at exit.
  auto turn_wait = [&]() { asm volatile("bar.sync %0, 256;\n" ::"r"(3 + wg) : "memory"); };
  auto turn_pass = [&](int j) {
    if (!(wg == 1 && j == end - 1)) {
      asm volatile("bar.arrive %0, 256;\n" ::"r"(3 + (1 - wg)) : "memory");
    }
  };
  if (wg == 1) asm volatile("bar.arrive 3, 256;\n" ::: "memory");

  // n_tiles >= 1: the intra range always holds the piece's first key. The window's first tile
  // has no P V beside it (the one before it, if any, completed in the previous launch).
  {
    int stage;
    int32_t k0, khi;
    begin_tile(first, stage, k0, khi);
    float alpha[2];
    turn_wait();
    Fence();
    issue_s(0);
    Commit();
    turn_pass(first);
    Wait<0>();
    FenceRegs(s);
    softmax(stage, k0, khi, alpha);
    if constexpr (kWindowed) {
      if (first > 0) {
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = saved[i];
      }
    }
    rescale_and_pack(alpha);
  }
  for (int j = first + 1; j < end; ++j) {
    int stage;
    int32_t k0, khi;
    begin_tile(j, stage, k0, khi);
    float alpha[2];
    FenceRegs(o);
    FenceRegs(pa);
    turn_wait();
    Fence();
    issue_s((j - first) % Stages);
    Commit();
    issue_pv((j - 1 - first) % Stages);
    Commit();
    turn_pass(j);
    Wait<1>();  // S of tile j done; P V of tile j-1 may still run
    FenceRegs(s);
    softmax(stage, k0, khi, alpha);
    Wait<0>();
    FenceRegs(o);
    FenceRegs(pa);
    release(j - 1);
    rescale_and_pack(alpha);
  }
  FenceRegs(o);
  FenceRegs(pa);
  Fence();
  issue_pv((end - 1 - first) % Stages);
  Commit();
  Wait<0>();
  FenceRegs(o);
  if constexpr (kWindowed) {
    if (end < n_tiles) {  // more tiles to come: save the state, write nothing
#pragma unroll
      for (int i = 0; i < D / 2; ++i) saved[i] = o[i];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        saved[D / 2 + r] = state.m[r];
        saved[D / 2 + 2 + r] = state.l[r];
      }
      return;
    }
  }

  state.ReduceQuad();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row_valid[r]) continue;
    const float inv = state.InvSum(r);
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
