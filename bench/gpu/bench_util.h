// What the GPU benchmarks share: abort with the file, line and call on a failed CUDA call or a
// non-OK status (a benchmark has nobody to return an error to), and Emit for their result lines.
#ifndef ATTND_BENCH_GPU_BENCH_UTIL_H_
#define ATTND_BENCH_GPU_BENCH_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define CHECK_CUDA(expr)                                                                         \
  do {                                                                                           \
    const cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)
#define CHECK_OK(expr)                                                               \
  do {                                                                               \
    const absl::Status s_ = (expr);                                                  \
    if (!s_.ok()) {                                                                  \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace attnd {

// The value of an absl::StatusOr, or the status on stderr and exit(1).
template <typename T>
T ValueOrDie(absl::StatusOr<T> v, const char* what, const char* file, int line) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s:%d %s: %s\n", file, line, what, v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}
#define CHECK_OK_VALUE(expr) ::attnd::ValueOrDie((expr), #expr, __FILE__, __LINE__)

// Where Emit also writes its lines (a benchmark's --out file), or null.
inline FILE* g_out = nullptr;

// printf to stdout, flushed, and the same line to g_out when set.
void Emit(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void Emit(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char buf[2048];
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fputs(buf, stdout);
  std::fflush(stdout);
  if (g_out) {
    std::fputs(buf, g_out);
    std::fflush(g_out);
  }
}

}  // namespace attnd

#endif  // ATTND_BENCH_GPU_BENCH_UTIL_H_
