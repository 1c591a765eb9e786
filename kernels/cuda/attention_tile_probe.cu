#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/attention_tile.cuh"
#include "kernels/cuda/attention_tile_probe.h"
#include "kernels/cuda/cuda_status.h"

namespace attnd {
namespace {

using cuda_common::FragCol;
using cuda_common::FragRow;

struct ProbeArgs {
  int tiles;
  const float* scores;  // [tiles][16][64]
  const float* values;  // [tiles][64]
  float scale;
  bool gather;
  bool two_bound;
  int32_t k_hi;
  bool causal;
  const int32_t* pos;   // [16]
  const int32_t* keys;  // [tiles][64]
  float* out;           // [16]
  float* max;           // [16]
  float* sum;           // [16]
  float* merged_lse;    // [16]
  float* packed;        // [16][64]
  float* probs;         // [16][64]
};

template <bool kSumTile, class Mask>
__device__ void Step(const ProbeArgs& a, int t, const Mask& mask, cuda_common::SoftmaxState& st,
                     float (&o)[4], float (&p)[kProbeCols / 2], bool accumulate) {
  const int lane = threadIdx.x, gid = lane / 4, tig = lane % 4;
#pragma unroll
  for (int i = 0; i < kProbeCols / 2; ++i) {
    const int row = gid + 8 * FragRow(i), col = FragCol(i, tig);
    p[i] = a.scores[(t * kProbeRows + row) * kProbeCols + col];
  }
  float alpha[2];
  cuda_common::ApplyMask(p, tig, mask);
  st.Update<kSumTile>(p, a.scale, alpha);
  if (!accumulate) return;
  cuda_common::RescaleRows(o, alpha);
#pragma unroll
  for (int i = 0; i < kProbeCols / 2; ++i) {
    o[2 * FragRow(i)] += p[i] * a.values[t * kProbeCols + FragCol(i, tig)];
  }
}

// One warp. state: all tiles (the output); half_a / half_b: tiles [0, tiles/2) and the rest, merged
// with MergeStats at the end.
template <bool kSumTile>
__global__ void SoftmaxProbeKernel(const ProbeArgs a) {
  const int lane = threadIdx.x, gid = lane / 4, tig = lane % 4;
  const int32_t pos0 = a.pos[gid], pos1 = a.pos[gid + 8];
  cuda_common::SoftmaxState state, half_a, half_b;
  state.Init();
  half_a.Init();
  half_b.Init();
  float o[4] = {0.f, 0.f, 0.f, 0.f}, unused[4] = {0.f, 0.f, 0.f, 0.f};
  float p[kProbeCols / 2];
  for (int t = 0; t < a.tiles; ++t) {
    cuda_common::SoftmaxState& half = t < a.tiles / 2 ? half_a : half_b;
    if (a.gather) {
      const cuda_common::GatherMask mask(a.keys + t * kProbeCols, a.causal, pos0, pos1);
      Step<kSumTile>(a, t, mask, half, unused, p, false);
      Step<kSumTile>(a, t, mask, state, o, p, true);
    } else if (a.two_bound) {
      const cuda_common::TwoBoundMask mask{t * kProbeCols, a.k_hi, a.causal, pos0, pos1};
      Step<kSumTile>(a, t, mask, half, unused, p, false);
      Step<kSumTile>(a, t, mask, state, o, p, true);
    } else {
      const cuda_common::RangeMask mask(t * kProbeCols, a.k_hi, a.causal, pos0, pos1);
      Step<kSumTile>(a, t, mask, half, unused, p, false);
      Step<kSumTile>(a, t, mask, state, o, p, true);
    }
  }
  // p holds the last tile's probabilities of `state`.
  uint32_t pa[kProbeCols / 16][4];
  cuda_common::PackProbs(p, pa);
#pragma unroll
  for (int i = 0; i < kProbeCols / 2; ++i) {
    const int row = gid + 8 * FragRow(i), col = FragCol(i, tig);
    const uint32_t word = pa[i / 8][(i % 8) / 2];
    const uint32_t bits = (i & 1) ? word >> 16 : word & 0xffffu;
    a.packed[row * kProbeCols + col] = __uint_as_float(bits << 16);
    a.probs[row * kProbeCols + col] = p[i];
  }
  state.ReduceQuad();
  half_a.ReduceQuad();
  half_b.ReduceQuad();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float acc = o[2 * r];
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    float m = -CUDART_INF_F, l = 0.f;  // log2 domain: the halves' maxima times the scale
    cuda_common::MergeStats(m, l, half_a.m[r] * a.scale, half_a.l[r]);
    cuda_common::MergeStats(m, l, half_b.m[r] * a.scale, half_b.l[r]);
    if (tig == 0) {
      const int row = gid + 8 * r;
      a.out[row] = acc * state.InvSum(r);
      a.max[row] = state.m[r];
      a.sum[row] = state.l[r];
      a.merged_lse[row] = l > 0.f ? m + log2f(l) : -CUDART_INF_F;
    }
  }
}

template <class T>
absl::Status Upload(const std::vector<T>& host, size_t expect, T** dev) {
  if (host.size() != expect) {
    return absl::InvalidArgumentError(
        absl::StrCat("probe input has ", host.size(), " elements, expected ", expect));
  }
  ATTND_CUDA_RETURN_IF_ERROR(cudaMalloc(dev, sizeof(T) * (expect > 0 ? expect : 1)));
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(*dev, host.data(), sizeof(T) * expect, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSoftmaxProbe(const SoftmaxProbeInput& in, SoftmaxProbeOutput* out) {
  if (in.tiles < 1) return absl::InvalidArgumentError("probe needs at least one tile");
  const size_t t = in.tiles;
  struct Buffers {  // freed on every return
    float *scores = nullptr, *values = nullptr, *res = nullptr;
    int32_t *pos = nullptr, *keys = nullptr;
    ~Buffers() {
      (void)cudaFree(scores);
      (void)cudaFree(values);
      (void)cudaFree(res);
      (void)cudaFree(pos);
      (void)cudaFree(keys);
    }
  } b;
  const std::vector<int32_t> no_keys(t * kProbeCols, -1);
  ATTND_RETURN_IF_ERROR(Upload(in.scores, t * kProbeRows * kProbeCols, &b.scores));
  ATTND_RETURN_IF_ERROR(Upload(in.values, t * kProbeCols, &b.values));
  ATTND_RETURN_IF_ERROR(Upload(in.pos, static_cast<size_t>(kProbeRows), &b.pos));
  ATTND_RETURN_IF_ERROR(Upload(in.gather ? in.keys : no_keys, t * kProbeCols, &b.keys));
  constexpr size_t kTile = kProbeRows * kProbeCols;
  const size_t res_floats = 4 * kProbeRows + 2 * kTile;
  ATTND_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.res, res_floats * sizeof(float)));
  float* res = b.res;
  const ProbeArgs a{in.tiles, b.scores,  b.values, in.scale,        in.gather, in.two_bound,
                    in.k_hi,  in.causal, b.pos,    b.keys,          res,       res + 16,
                    res + 32, res + 48,  res + 64, res + 64 + kTile};
  if (in.sum_tile) {
    SoftmaxProbeKernel<true><<<1, 32>>>(a);
  } else {
    SoftmaxProbeKernel<false><<<1, 32>>>(a);
  }
  ATTND_CUDA_RETURN_IF_LAUNCH_ERROR("SoftmaxProbeKernel");
  std::vector<float> host(res_floats);
  ATTND_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host.data(), res, res_floats * sizeof(float), cudaMemcpyDeviceToHost));
  out->out.assign(host.begin(), host.begin() + 16);
  out->max.assign(host.begin() + 16, host.begin() + 32);
  out->sum.assign(host.begin() + 32, host.begin() + 48);
  out->merged.assign(host.begin() + 48, host.begin() + 64);
  out->packed.assign(host.begin() + 64, host.begin() + 64 + kTile);
  out->probs.assign(host.begin() + 64 + kTile, host.end());
  return absl::OkStatus();
}

}  // namespace attnd
