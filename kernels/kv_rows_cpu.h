// How the CPU kernels write and read one stored K/V row (head_dim values of one token and kv head)
// for every KV element type: fp32 as is, bf16 rounded to nearest even, fp8 E4M3 and int8 quantised
// with a scale per row (base/fp8.h, base/int8_kv.h) and dequantised on load. One place, so append,
// dense prefill, decode, sparse estimation and sparse attention store and read the cache the same
// way.
#ifndef ATTND_KERNELS_KV_ROWS_CPU_H_
#define ATTND_KERNELS_KV_ROWS_CPU_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include "base/dtype.h"
#include "base/fp8.h"
#include "base/int8_kv.h"
#include "kernels/paged_kv.h"

namespace attnd {
namespace kv_rows {

// The 256 E4M3 values, Fp8E4m3ToFloat's, as a table: one load per element on the CPU, the same
// fp32 values (so table[code] * scale is Fp8DequantizeRow's result bit for bit).
inline const float* Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = Fp8E4m3ToFloat(static_cast<uint8_t>(c));
    return t;
  }();
  return table.data();
}

// Whether rows of KvT carry a scale (fp8, int8): the pool's k_scale / v_scale hold one per token
// and kv head.
template <typename KvT>
inline constexpr bool kScaledRows =
    std::is_same<KvT, Fp8E4m3>::value || std::is_same<KvT, Int8Kv>::value;

// n stored elements to fp32; `scale` is the row's (fp8 and int8 only).
inline void ToFloat(const float* src, float /*scale*/, int n, float* dst) {
  std::copy(src, src + n, dst);
}
inline void ToFloat(const uint16_t* src, float /*scale*/, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}
inline void ToFloat(const Fp8E4m3* src, float scale, int n, float* dst) {
  const float* table = Fp8Table();
  for (int i = 0; i < n; ++i) dst[i] = table[src[i].bits] * scale;
}
// Int8DequantizeRow's arithmetic, in a loop the compiler vectorises.
inline void ToFloat(const Int8Kv* src, float scale, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i].code) * scale;
}

// The scale of a stored key / value row: 1 for the dtypes without one.
template <typename KvT>
float KeyScale(const PagedKv<KvT>& kv, int64_t pos, int32_t kv_head) {
  if constexpr (kScaledRows<KvT>) {
    return *kv.KeyScale(pos, kv_head);
  } else {
    return 1.f;
  }
}
template <typename KvT>
float ValueScale(const PagedKv<KvT>& kv, int64_t pos, int32_t kv_head) {
  if constexpr (kScaledRows<KvT>) {
    return *kv.ValueScale(pos, kv_head);
  } else {
    return 1.f;
  }
}

// The fp32 key / value row of token `pos`, kv head `kv_head`, into dst[0, head_dim).
template <typename KvT>
void LoadKey(const PagedKv<KvT>& kv, int64_t pos, int32_t kv_head, float* dst) {
  ToFloat(kv.Key(pos, kv_head), KeyScale(kv, pos, kv_head), kv.head_dim, dst);
}
template <typename KvT>
void LoadValue(const PagedKv<KvT>& kv, int64_t pos, int32_t kv_head, float* dst) {
  ToFloat(kv.Value(pos, kv_head), ValueScale(kv, pos, kv_head), kv.head_dim, dst);
}

// Stores one token at `pos`: k and v are [num_kv_heads, head_dim] fp32; the key is stored as
// k * key_scale (s(L), DCA.md "Length scaling"), rounded once to the KV dtype.
inline void StoreToken(const PagedKv<float>& kv, int64_t pos, const float* k, const float* v,
                       float key_scale) {
  const int n = kv.num_kv_heads * kv.head_dim;  // a token's heads are contiguous in its slot
  float* kd = kv.Key(pos, 0);
  float* vd = kv.Value(pos, 0);
  for (int i = 0; i < n; ++i) kd[i] = k[i] * key_scale;
  std::copy(v, v + n, vd);
}
inline void StoreToken(const PagedKv<uint16_t>& kv, int64_t pos, const float* k, const float* v,
                       float key_scale) {
  const int n = kv.num_kv_heads * kv.head_dim;
  uint16_t* kd = kv.Key(pos, 0);
  uint16_t* vd = kv.Value(pos, 0);
  for (int i = 0; i < n; ++i) kd[i] = FloatToBf16(k[i] * key_scale);
  for (int i = 0; i < n; ++i) vd[i] = FloatToBf16(v[i]);
}
// One row's codes and its scale, in the dtype's format.
inline float QuantizeRow(const float* src, float multiplier, int n, Fp8E4m3* codes) {
  return Fp8QuantizeRow(src, multiplier, n, codes);
}
inline float QuantizeRow(const float* src, float multiplier, int n, Int8Kv* codes) {
  return Int8QuantizeRow(src, multiplier, n, codes);
}
// fp8 and int8: each kv head's row gets its own scale (max |row| / 448 or / 127), so a token never
// changes another token's scale and appending never requantises what is cached.
template <typename KvT, typename = std::enable_if_t<kScaledRows<KvT>>>
void StoreToken(const PagedKv<KvT>& kv, int64_t pos, const float* k, const float* v,
                float key_scale) {
  const int d = kv.head_dim;
  for (int32_t h = 0; h < kv.num_kv_heads; ++h) {
    *kv.KeyScale(pos, h) = QuantizeRow(k + h * d, key_scale, d, kv.Key(pos, h));
    *kv.ValueScale(pos, h) = QuantizeRow(v + h * d, 1.f, d, kv.Value(pos, h));
  }
}

}  // namespace kv_rows
}  // namespace attnd

#endif  // ATTND_KERNELS_KV_ROWS_CPU_H_
