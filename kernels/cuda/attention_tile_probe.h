// A test probe of attention_tile.cuh (the shared online softmax and mask policies): one warp runs
// SoftmaxState, RangeMask / TwoBoundMask / GatherMask, RescaleRows, PackProbs and MergeStats over
// tiles of given scores, so attention_tile_test can check them against a double-precision softmax
// without a whole attention kernel around them. Test-only; not linked by the daemon.
#ifndef ATTND_KERNELS_CUDA_ATTENTION_TILE_PROBE_H_
#define ATTND_KERNELS_CUDA_ATTENTION_TILE_PROBE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace attnd {

constexpr int kProbeRows = 16;  // one mma.sync m-tile: the warp's rows
constexpr int kProbeCols = 64;  // keys per tile

struct SoftmaxProbeInput {
  int tiles = 1;
  std::vector<float> scores;  // [tiles][kProbeRows][kProbeCols], raw Q K^T
  std::vector<float> values;  // [tiles][kProbeCols]: a scalar "V" per key
  float scale = 1.f;          // multiplies the scores in the exponent (base 2)
  bool sum_tile = false;      // SoftmaxState::Update<true>
  // Mask per tile: gather == false: RangeMask(k0 = 64 t, k_hi, causal, pos[row]), or with
  // two_bound the same keys through TwoBoundMask; gather == true: GatherMask over keys[t][col]
  // (-1 = empty), causal, pos[row].
  bool gather = false;
  bool two_bound = false;
  int32_t k_hi = 0;
  bool causal = false;
  std::vector<int32_t> pos;   // [kProbeRows]
  std::vector<int32_t> keys;  // [tiles][kProbeCols] when gather
};

struct SoftmaxProbeOutput {
  std::vector<float> out;     // [kProbeRows]: sum p v / sum p, 0 for a row that sees no key
  std::vector<float> max;     // [kProbeRows]: the running max m (score domain)
  std::vector<float> sum;     // [kProbeRows]: l after ReduceQuad
  std::vector<float> merged;  // [kProbeRows]: sum from MergeStats of the two halves' (m, l)
  std::vector<float> packed;  // [kProbeRows][kProbeCols]: last tile's PackProbs, unpacked
  std::vector<float> probs;   // [kProbeRows][kProbeCols]: last tile's p in fp32
};

// Runs the probe on the current CUDA device (synchronously).
absl::Status RunSoftmaxProbe(const SoftmaxProbeInput& in, SoftmaxProbeOutput* out);

}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_ATTENTION_TILE_PROBE_H_
