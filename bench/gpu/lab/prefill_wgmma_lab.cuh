// The tuning lab's wgmma prefill kernel (bench/gpu/lab/README.md): every configuration measured
// on the way to the product kernel (kernels/cuda/prefill_wgmma.cuh), selected by template bits.
// Same contract and grid as the product's kernels. Not linked into the daemon.
//
// Block: two consumer warpgroups (256 threads), 128 query rows; per K/V tile of BN keys S = Q K^T
// and O += P V on wgmma (kernels/cuda/wgmma.cuh). Without Ws, K/V tiles arrive through a
// Stages-deep cp.async ring issued by all 256 threads; one __syncthreads per tile publishes a tile
// and retires the slot the next load reuses. With Overlap, the S wgmma of tile j is issued together
// with the P V wgmma of tile j-1, so the softmax of tile j runs while the tensor cores do P V
// (FA3's intra-warpgroup pipelining); a slot is then free one tile later, hence Stages >= 3. With
// Ws (warp-specialised) a third warpgroup issues the ring instead and hands tiles over through
// mbarriers. The Opt bits are described below.
#ifndef ATTND_BENCH_GPU_LAB_PREFILL_WGMMA_LAB_CUH_
#define ATTND_BENCH_GPU_LAB_PREFILL_WGMMA_LAB_CUH_

#include <cuda_bf16.h>
#include <math_constants.h>

#include <cstdint>

#include "kernels/cuda/wgmma.cuh"

namespace attnd {
namespace cuda_kernels {
namespace wgmma {
namespace lab {

using cuda_common::MbarArrive;
using cuda_common::MbarInit;
using cuda_common::MbarWait;
using cuda_common::PackProbs;
using cuda_common::RescaleRows;
using cuda_common::SoftmaxState;

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
    DcaPrefillWgmmaLabKernel(const PrefillArgs a) {
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
  SoftmaxState state;  // over raw scores
  state.Init();
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
  // The product's step (prefill_wgmma.cuh): mask the tiles that need it, online softmax.
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
    state.Update<true>(s, a.scale_log2, alpha);
  };
  auto rescale = [&](const float(&alpha)[2]) { RescaleRows(o, alpha); };
  auto pack = [&]() { PackProbs(s, pa); };
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
        const PageIndexer pages(a.kv.page_size);
        const int page_shift = pages.pow2 ? static_cast<int>(pages.shift) : -1;
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

}  // namespace lab
}  // namespace wgmma
}  // namespace cuda_kernels
}  // namespace attnd

#endif  // ATTND_BENCH_GPU_LAB_PREFILL_WGMMA_LAB_CUH_
