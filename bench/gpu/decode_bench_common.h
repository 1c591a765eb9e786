// What the decode benchmarks share (no CUDA types): the Qwen2.5-7B-1M attention geometry they
// time, and their --batches list.
#ifndef ATTND_BENCH_GPU_DECODE_BENCH_COMMON_H_
#define ATTND_BENCH_GPU_DECODE_BENCH_COMMON_H_

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "kernels/dca.h"

namespace attnd {

inline constexpr int kBenchHq = 28, kBenchHkv = 4, kBenchD = 128, kBenchPage = 16;

// Qwen2.5-7B-Instruct-1M: 28 q heads, 4 kv heads, head_dim 128, its DCA chunk and length scaling.
inline DcaGeometry Qwen7bGeometry() {
  DcaGeometry g;
  g.num_q_heads = kBenchHq;
  g.num_kv_heads = kBenchHkv;
  g.head_dim = kBenchD;
  g.chunk_len = 253952;
  g.original_max_position_embeddings = 262144;
  g.softmax_scale = 1.f / std::sqrt(static_cast<float>(kBenchD));
  return g;
}

// "1,8,32" -> {1, 8, 32}; nullopt if an item is not an integer in [1, 256].
inline std::optional<std::vector<int32_t>> ParseBatchList(absl::string_view list) {
  std::vector<int32_t> batches;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    int32_t b = 0;
    if (!absl::SimpleAtoi(item, &b) || b < 1 || b > 256) return std::nullopt;
    batches.push_back(b);
  }
  return batches;
}

}  // namespace attnd

#endif  // ATTND_BENCH_GPU_DECODE_BENCH_COMMON_H_
