// What the GPU benchmarks share: abort with the file, line and call on a failed CUDA call or a
// non-OK status (a benchmark has nobody to return an error to).
#ifndef ATTND_BENCH_GPU_BENCH_UTIL_H_
#define ATTND_BENCH_GPU_BENCH_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"

#define CHECK_CUDA(expr)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)
#define CHECK_OK(expr)                                                              \
  do {                                                                              \
    const absl::Status s_ = (expr);                                                 \
    if (!s_.ok()) {                                                                 \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

#endif  // ATTND_BENCH_GPU_BENCH_UTIL_H_
