// Exact dense dual chunk attention on the CPU: KV append, prefill and decode over a paged KV pool.
// fp32 arithmetic throughout; K/V stored as fp32 (float), bf16 (uint16_t), fp8 E4M3 (Fp8E4m3) or
// int8 (Int8Kv), the last two with a scale per token and kv head (base/fp8.h, base/int8_kv.h),
// quantised on append and dequantised on load
// (kernels/kv_rows_cpu.h). Uses every thread of the given pool. Semantics: docs/DCA.md ("Dense
// prefill", "Decode", "Length scaling").
#ifndef ATTND_KERNELS_DCA_CPU_H_
#define ATTND_KERNELS_DCA_CPU_H_

#include <cstdint>

#include "absl/types/span.h"
#include "base/fp8.h"
#include "base/int8_kv.h"
#include "base/thread_pool.h"
#include "kernels/dca.h"
#include "kernels/paged_kv.h"

namespace attnd {

// Writes new tokens' K/V into their pages; keys are multiplied by key_scale (s(L)) before storing
// (and, in fp8 and int8, before quantising: the row scales are those of the stored, scaled keys).
struct CpuAppendParams {
  const float* k = nullptr;  // [num_tokens, num_kv_heads, head_dim], unscaled
  const float* v = nullptr;  // [num_tokens, num_kv_heads, head_dim]
  int64_t start = 0;         // position of the first new token
  int64_t num_tokens = 0;
  float key_scale = 1.f;
};

// Prefill attention for num_tokens new tokens at positions start .. start+num_tokens-1, whose K/V
// are already appended (keys [0, start + num_tokens) are valid).
struct CpuPrefillParams {
  const float* q = nullptr;  // [num_tokens, 5, num_q_heads, head_dim]
  float* out = nullptr;      // [num_tokens, num_q_heads, head_dim]
  int64_t start = 0;
  int64_t num_tokens = 0;
  float softmax_scale = 0.f;  // geometry scale * s(prompt_len)
};

// One sequence's new token in a decode batch; its K/V is already appended.
template <typename KvT>
struct CpuDecodeItem {
  PagedKv<KvT> kv;
  const float* q = nullptr;  // [3, num_q_heads, head_dim]: intra, succ, inter; not yet scaled
  float* out = nullptr;      // [num_q_heads, head_dim]
  int64_t length = 0;        // sequence length including the new token (L)
  float q_scale = 1.f;       // s(L); the softmax scale is the geometry's
};

// The SIMD width of the CPU kernels. Binaries target baseline x86-64 (SSE2); kAuto, the default,
// uses AVX2+FMA when the CPU has it (checked at run time) and head_dim % 16 == 0, else SSE2.
enum class CpuSimd { kAuto, kSse2, kAvx2 };
// Process-wide, for tests and benchmarks that compare the paths; takes effect for kernel calls
// that start afterwards. kAvx2 behaves as kAuto. Returns false, changing nothing, when kAvx2 is
// asked for on a CPU without AVX2+FMA.
bool SetCpuSimd(CpuSimd simd);
// "avx2" or "sse2": the path a kernel call with this head_dim takes now (for logs).
const char* CpuSimdName(int head_dim);

template <typename KvT>
void AppendKvCpu(const PagedKv<KvT>& kv, const CpuAppendParams& params, ThreadPool* pool);

template <typename KvT>
void DcaPrefillCpu(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                   const CpuPrefillParams& params, ThreadPool* pool);

template <typename KvT>
void DcaDecodeCpu(const DcaGeometry& geometry, absl::Span<const CpuDecodeItem<KvT>> items,
                  ThreadPool* pool);

}  // namespace attnd

#endif  // ATTND_KERNELS_DCA_CPU_H_
