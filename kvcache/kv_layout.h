// The byte layout of the KV pool: for each layer, a K region then a V region, each
// [num_pages, page_size, num_kv_heads, head_dim] of the KV element type. Pages are shared by all
// layers: page p of a sequence holds the same positions in every layer.
//
// fp8 E4M3 and int8 (base/fp8.h, base/int8_kv.h) also keep an fp32 scale per token and kv head: a
// scale area before the data holds, for each layer, a K scale region then a V scale region, each
// [num_pages, page_size, num_kv_heads] fp32. Placed first, every scale sits 4-byte aligned whatever
// the geometry (the one-byte data regions need no alignment of their own); for other dtypes the
// area is empty and the data offsets are what they would be without it.
#ifndef ATTND_KVCACHE_KV_LAYOUT_H_
#define ATTND_KVCACHE_KV_LAYOUT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace attnd {

struct KvLayout {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  DType kv_dtype = DType::kFp32;
  int64_t num_pages = 0;

  // Bytes of a scale: fp8 and int8 keep one fp32 per token and kv head, other dtypes none.
  static constexpr int64_t ScaleBytes(DType t) { return HasRowScale(t) ? 4 : 0; }

  // Bytes of one layer's K (or V) data for one page.
  int64_t page_stride_bytes() const {
    return static_cast<int64_t>(page_size) * num_kv_heads * head_dim * ElementSize(kv_dtype);
  }
  // Bytes of one layer's K (or V) scales for one page; 0 unless fp8 or int8.
  int64_t scale_page_stride_bytes() const {
    return static_cast<int64_t>(page_size) * num_kv_heads * ScaleBytes(kv_dtype);
  }
  // Bytes one token takes across all layers, K and V, scales included.
  int64_t bytes_per_token() const {
    return 2 * int64_t{num_layers} * num_kv_heads *
           (int64_t{head_dim} * static_cast<int64_t>(ElementSize(kv_dtype)) + ScaleBytes(kv_dtype));
  }
  // Bytes one page takes across all layers, K and V, scales included.
  int64_t bytes_per_page() const {
    return 2 * num_layers * (page_stride_bytes() + scale_page_stride_bytes());
  }
  int64_t pool_bytes() const { return num_pages * bytes_per_page(); }
  // Bytes of the scale area at the start of the pool (0 unless fp8 or int8).
  int64_t scale_area_bytes() const {
    return 2 * int64_t{num_layers} * num_pages * scale_page_stride_bytes();
  }
  // Offsets of a layer's K and V data regions from the pool base.
  int64_t k_offset(int32_t layer) const {
    return scale_area_bytes() + (2 * layer) * num_pages * page_stride_bytes();
  }
  int64_t v_offset(int32_t layer) const {
    return scale_area_bytes() + (2 * layer + 1) * num_pages * page_stride_bytes();
  }
  // Offsets of a layer's K and V scale regions (fp8 and int8) from the pool base.
  int64_t k_scale_offset(int32_t layer) const {
    return (2 * layer) * num_pages * scale_page_stride_bytes();
  }
  int64_t v_scale_offset(int32_t layer) const {
    return (2 * layer + 1) * num_pages * scale_page_stride_bytes();
  }

  // The layout with as many pages as fit in pool_bytes (bytes_per_page, scales included);
  // INVALID_ARGUMENT when not even one fits or kv_dtype cannot be cached.
  static absl::StatusOr<KvLayout> ForPoolBytes(int32_t num_layers, int32_t num_kv_heads,
                                               int32_t head_dim, int32_t page_size, DType kv_dtype,
                                               int64_t pool_bytes);
};

}  // namespace attnd

#endif  // ATTND_KVCACHE_KV_LAYOUT_H_
