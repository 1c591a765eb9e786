// Device helpers of sparse_bench.cc: synthetic q / K / V with attention sinks and a local band,
// written straight into device memory (a 1M-token q is 36 GB), and an error reduction.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "bench/gpu/sparse_bench_data.h"

namespace attnd {
namespace bench {
namespace {

__device__ __forceinline__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
// Standard normal from two hashed uniforms (Box-Muller).
__device__ __forceinline__ float Normal(uint64_t key) {
  const float u1 = (Hash(key * 2 + 1) + 1.0f) * 2.3283064e-10f;
  const float u2 = Hash(key * 2 + 2) * 2.3283064e-10f;
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}
// Unit-ish sink direction of kv head h, dimension e (fixed pseudo-random signs / sqrt(D)).
__device__ __forceinline__ float SinkDir(int h, int e, int d) {
  return ((Hash(0x51c0000ull + h * 4096 + e) & 1) ? 1.f : -1.f) * rsqrtf(static_cast<float>(d));
}
// The band features: dimensions [d - 2F, d) hold (cos, sin) of pos * omega_f, periods 8 .. ~8000.
constexpr int kBandPairs = 32;
__device__ __forceinline__ float BandFeature(int64_t pos, int e, int d, float t0, float ratio) {
  const int first = d - 2 * kBandPairs;
  if (e < first) return 0.f;
  const int f = (e - first) / 2;
  const double period = static_cast<double>(t0) * pow(static_cast<double>(ratio), f);
  const double phase = fmod(static_cast<double>(pos), period) / period;
  return (e - first) % 2 == 0 ? static_cast<float>(cospi(2.0 * phase))
                              : static_cast<float>(sinpi(2.0 * phase));
}

__global__ void FillKvKernel(__nv_bfloat16* kp, __nv_bfloat16* vp, const int32_t* table,
                             int32_t page_size, int64_t length, SyntheticShape s) {
  const int64_t total = length * s.hkv * s.d;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(i % s.d);
    const int h = static_cast<int>((i / s.d) % s.hkv);
    const int64_t pos = i / (static_cast<int64_t>(s.d) * s.hkv);
    float k = s.noise * Normal(i * 3 + 0x1000000000ull) +
              s.band * BandFeature(pos, e, s.d, s.period_min, s.period_ratio);
    if (pos < s.sinks) k += s.sink_key * SinkDir(h, e, s.d);
    const float v = Normal(i * 3 + 0x2000000000ull);
    const int64_t off =
        ((static_cast<int64_t>(table[pos / page_size]) * page_size + pos % page_size) * s.hkv + h) *
            s.d +
        e;
    kp[off] = __float2bfloat16_rn(k);
    vp[off] = __float2bfloat16_rn(v);
  }
}

__global__ void FillQKernel(__nv_bfloat16* q, int64_t length, SyntheticShape s) {
  const int64_t total = length * 5 * s.hq * s.d;
  const int group = s.hq / s.hkv;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(i % s.d);
    const int h = static_cast<int>((i / s.d) % s.hq);
    const int64_t pos = i / (static_cast<int64_t>(s.d) * s.hq * 5);
    const float x = s.noise * Normal(i + 0x3000000000ull) +
                    s.band * BandFeature(pos, e, s.d, s.period_min, s.period_ratio) +
                    s.sink_query * SinkDir(h / group, e, s.d);
    q[i] = __float2bfloat16_rn(x);
  }
}

__global__ void ErrorKernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, int hq,
                            int d, double* acc) {
  __shared__ double per_head[2 * 64];
  for (int i = threadIdx.x; i < 2 * hq; i += blockDim.x) per_head[i] = 0;
  __syncthreads();
  double num = 0, den = 0, worst = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    double e2 = (x - y) * (x - y);
    if (!isfinite(x)) e2 += 1e30;
    num += e2;
    den += y * y;
    worst = fmax(worst, fabs(x - y));
    const int h = static_cast<int>((i / d) % hq);
    atomicAdd(&per_head[2 * h], e2);
    atomicAdd(&per_head[2 * h + 1], y * y);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * hq; i += blockDim.x) atomicAdd(&acc[3 + i], per_head[i]);
  for (int o = 16; o > 0; o /= 2) {
    num += __shfl_xor_sync(0xffffffffu, num, o);
    den += __shfl_xor_sync(0xffffffffu, den, o);
    worst = fmax(worst, __shfl_xor_sync(0xffffffffu, worst, o));
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&acc[0], num);
    atomicAdd(&acc[1], den);
    // max of non-negative doubles via their bit patterns
    atomicMax(reinterpret_cast<unsigned long long*>(&acc[2]), __double_as_longlong(worst));
  }
}

}  // namespace

void FillSyntheticKv(__nv_bfloat16* k, __nv_bfloat16* v, const int32_t* page_table,
                     int32_t page_size, int64_t length, const SyntheticShape& s,
                     cudaStream_t stream) {
  FillKvKernel<<<4096, 256, 0, stream>>>(k, v, page_table, page_size, length, s);
}
void FillSyntheticQ(__nv_bfloat16* q, int64_t length, const SyntheticShape& s,
                    cudaStream_t stream) {
  FillQKernel<<<8192, 256, 0, stream>>>(q, length, s);
}
void RelativeError(const __nv_bfloat16* got, const __nv_bfloat16* want, int64_t n, int hq, int d,
                   double* acc, cudaStream_t stream) {
  cudaMemsetAsync(acc, 0, (3 + 2 * hq) * sizeof(double), stream);
  ErrorKernel<<<2048, 256, 0, stream>>>(got, want, n, hq, d, acc);
}

}  // namespace bench
}  // namespace attnd
