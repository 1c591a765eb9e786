// Synthetic attention inputs for sparse_bench.cc, generated on the device (sparse_bench_data.cu).
//   K[pos, h] = noise * N(0,1) + band * B(pos) + (pos < sinks ? sink_key * u_h : 0)
//   Q[pos, variant, hq] = noise * N(0,1) + band * B(pos) + sink_query * u_{kv head of hq}
//   V ~ N(0, 1)
// B(pos): (cos, sin) of pos * 2 pi / T_f in the last 64 dimensions, periods
// T_f = period_min * period_ratio^f (f < 32), so q . k = band^2 * sum_f cos(2 pi dist / T_f) peaks
// at distance 0 and decays with distance (the local band); RoPE-like short periods make it
// ripple (far diagonals score high here and there), long periods make it smooth. u_h is a fixed
// +-1/sqrt(D) direction, so the first `sinks` keys are attention sinks.
#ifndef ATTND_BENCH_GPU_SPARSE_BENCH_DATA_H_
#define ATTND_BENCH_GPU_SPARSE_BENCH_DATA_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnd {
namespace bench {

struct SyntheticShape {
  int hq = 28, hkv = 4, d = 128;
  int sinks = 4;
  float noise = 0.5f;
  float band = 2.4f;
  float sink_key = 42.f;
  float sink_query = 4.f;
  float period_min = 8.f;  // band periods T_f = period_min * period_ratio^f, f < 32
  float period_ratio = 1.25f;
};

// K / V pools [pages, page_size, hkv, d]; token pos lives in page page_table[pos / page_size]
// (device memory), as in kernels/paged_kv.h.
void FillSyntheticKv(__nv_bfloat16* k, __nv_bfloat16* v, const int32_t* page_table,
                     int32_t page_size, int64_t length, const SyntheticShape& s,
                     cudaStream_t stream);
void FillSyntheticQ(__nv_bfloat16* q, int64_t length, const SyntheticShape& s, cudaStream_t stream);
// acc (device, 3 + 2 hq doubles) = {sum (got - want)^2, sum want^2, max |got - want|}, then per
// q head {sum (got - want)^2, sum want^2}, over n values laid out [tokens, hq, d] (hq <= 64).
void RelativeError(const __nv_bfloat16* got, const __nv_bfloat16* want, int64_t n, int hq, int d,
                   double* acc, cudaStream_t stream);

}  // namespace bench
}  // namespace attnd

#endif  // ATTND_BENCH_GPU_SPARSE_BENCH_DATA_H_
