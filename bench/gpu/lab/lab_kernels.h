// The tuning lab's kernel configurations (bench/gpu/lab/README.md): every prefill and decode kernel
// configuration measured on the way to the product's kernels (kernels/cuda/dca_cuda.h), launched by
// index so that tests and benchmarks can sweep them. Never linked into the daemon: the product's
// plan (CudaKernelPlan) knows only its own kernels.
//
// A kernel configuration ("variant" in the tuning history of bench/gpu/NOTES.md) is one
// instantiation of a kernel family's template. Same parameter structs, semantics and results
// (within the bf16 bars) as the product's launches.
#ifndef ATTND_BENCH_GPU_LAB_LAB_KERNELS_H_
#define ATTND_BENCH_GPU_LAB_LAB_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/cuda/dca_cuda.h"

namespace attnd {
namespace lab {

// Prefill kernel families:
//   kMmaSync             mma.sync m16n8k16: query rows per block = 16 * m_tiles * warps, K/V tiles
//                        of block_n keys in a `stages`-deep cp.async ring (the product's fallback
//                        is {4, 2, 2, 64});
//   kWgmma               Hopper wgmma, 128 rows; warps 8: all threads issue the ring, one
//                        __syncthreads per tile; warps 12: a producer warpgroup and mbarriers;
//   kWgmmaOverlap        the S wgmma of tile j beside the P V wgmma of tile j-1 (stages >= 3);
//                        with warps 12 the consumer warpgroups also take turns (ping-pong);
//   kWgmmaAsync          warps 12 with the asynchronous producer (all page-table reads of a tile
//                        up front, tiles published by cp.async.mbarrier.arrive);
//   kWgmmaAsyncOverlap   the same plus the overlap, without ping-pong;
//   kWgmmaAsyncPingPong  the same plus the overlap and the ping-pong: the product's kWgmma;
//   kWgmmaAsyncLate      kWgmmaAsyncOverlap with FA3's order inside an iteration (O rescaled
//                        after the next S wgmma is issued).
enum PrefillFamily : int32_t {
  kMmaSync = 0,
  kWgmma = 1,
  kWgmmaOverlap = 2,
  kWgmmaAsync = 3,
  kWgmmaAsyncOverlap = 4,
  kWgmmaAsyncPingPong = 5,
  kWgmmaAsyncLate = 6,
};
struct PrefillKernelConfig {
  int32_t warps;
  int32_t stages;
  int32_t m_tiles;
  int32_t block_n;
  PrefillFamily family = kMmaSync;
};
inline constexpr PrefillKernelConfig kPrefillConfigs[] = {
    {4, 2, 1, 64},
    {8, 2, 1, 64},
    {8, 3, 1, 64},
    {4, 2, 2, 32},
    {4, 3, 2, 32},
    {4, 2, 2, 64},  // the product's kMmaSync
    {8, 2, 1, 128, kWgmma},
    {8, 3, 1, 128, kWgmmaOverlap},
    {8, 4, 1, 64, kWgmmaOverlap},
    {12, 3, 1, 128, kWgmma},
    {12, 3, 1, 128, kWgmmaOverlap},
    {12, 3, 1, 128, kWgmmaAsync},
    {12, 3, 1, 128, kWgmmaAsyncOverlap},
    {12, 3, 1, 128, kWgmmaAsyncPingPong},  // the product's kWgmma
    {12, 3, 1, 128, kWgmmaAsyncLate},
};
inline constexpr int kNumPrefillConfigs = sizeof(kPrefillConfigs) / sizeof(kPrefillConfigs[0]);
inline constexpr int kProductMmaSyncConfig = 5;
inline constexpr int kProductWgmmaConfig = 13;
// "w12s3m1n128 wg-async-pp": a configuration's shape and family.
std::string PrefillConfigLabel(int config);
// FAILED_PRECONDITION for a wgmma configuration on a GPU other than compute capability 9.0,
// INVALID_ARGUMENT for an index outside kPrefillConfigs.
absl::Status LaunchLabPrefill(const DcaGeometry& geometry, const CudaPrefillParams& params,
                              int config, cudaStream_t stream);

// Decode kernel families:
//   kDecodeSplit      the first split kernel: 64-key tiles in padded rows, one page-table lookup
//                     per row right before its copies, two barriers per tile;
//   kDecodePipelined  the product's kernel: 16 * warps keys per tile in XOR-swizzled rows, page
//                     indices loaded one tile ahead, one barrier per tile.
// (Row-wise cp.async.bulk copies were measured too and were slower everywhere but batch 1; they
// are gone: bench/gpu/NOTES.md, "Decode variants".)
enum DecodeFamily : int32_t { kDecodeSplit = 0, kDecodePipelined = 1 };
struct DecodeKernelConfig {
  int32_t warps;   // keys per tile = 16 * warps
  int32_t stages;  // ring depth
  DecodeFamily family;
};
inline constexpr DecodeKernelConfig kDecodeConfigs[] = {
    {4, 2, kDecodeSplit},     {4, 4, kDecodeSplit},     {4, 2, kDecodePipelined},
    {4, 3, kDecodePipelined}, {4, 4, kDecodePipelined}, {8, 2, kDecodePipelined}};
inline constexpr int kNumDecodeConfigs = sizeof(kDecodeConfigs) / sizeof(kDecodeConfigs[0]);
// The product's kernel at ring depth 2 and 3.
inline constexpr int kProductDecodeConfig2 = 2;
inline constexpr int kProductDecodeConfig3 = 3;
std::string DecodeConfigLabel(int config);
// Split-K plan of configuration `config` on the current device, by the product's rule
// (CudaKernelPlan::DecodeSplits) at that configuration's occupancy; 0 when the index is bad or
// the device cannot be read.
int32_t LabDecodeSplits(const DcaGeometry& geometry, int32_t batch, int64_t max_length, int config);
absl::Status LaunchLabDecode(const DcaGeometry& geometry, const CudaDecodeParams& params,
                             int config, cudaStream_t stream);

// The product's split-K decode kernel (as plan launches it for params.batch) with a clock probe
// at each phase's end (cuda_kernels::DecodeProbePhase): each warp adds its cycles of phase p to
// cycles[p] and the tiles it computed to cycles[kDecodeProbeTiles]; cycles must hold
// kDecodeProbeSlots zeroed counters. No reduction: the partials are the only output. For finding
// where a tile's time goes; the probes themselves cost a few cycles each.
inline constexpr int kDecodeProbeTiles = 7;  // cuda_kernels::kNumProbePhases
inline constexpr int kDecodeProbeSlots = kDecodeProbeTiles + 1;
const char* DecodeProbePhaseName(int phase);
// v_in_registers (one-byte pools): the LaunchVRegsDecode kernel's body instead of the product's.
template <typename KvT>
absl::Status LaunchProbedDecode(const CudaKernelPlan& plan, const CudaDecodeParamsOf<KvT>& params,
                                unsigned long long* cycles, cudaStream_t stream,
                                bool v_in_registers = false);

// The product's decode over a one-byte pool (split kernel and reduction, as plan launches them)
// with P V read from the code ring straight into mma registers (cuda_kernels::PvFromCodes): no
// fp16 V tile in shared memory (16 KB less a block), no __syncwarp, no ldmatrix. KvT = Int8Kv or
// Fp8E4m3; the same results as LaunchDcaDecode up to the order of fp32 sums.
template <typename KvT>
absl::Status LaunchVRegsDecode(const CudaKernelPlan& plan, const CudaDecodeParamsOf<KvT>& params,
                               cudaStream_t stream);
// Its split-K plan for `batch` rows: the product's rule at its own occupancy (the smaller shared
// memory fits more blocks) and the plan's ring depth; 0 when the device cannot be read.
template <typename KvT>
int32_t VRegsDecodeSplits(const CudaKernelPlan& plan, int32_t batch, int64_t max_length);

}  // namespace lab
}  // namespace attnd

#endif  // ATTND_BENCH_GPU_LAB_LAB_KERNELS_H_
