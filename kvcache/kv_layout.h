// The byte layout of the KV pool: for each layer, a K region then a V region, each
// [num_pages, page_size, num_kv_heads, head_dim] of the KV element type. Pages are shared by all
// layers: page p of a sequence holds the same positions in every layer.
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

  // Bytes of one layer's K (or V) for one page.
  int64_t page_stride_bytes() const {
    return static_cast<int64_t>(page_size) * num_kv_heads * head_dim * ElementSize(kv_dtype);
  }
  // Bytes one page takes across all layers, K and V.
  int64_t bytes_per_page() const { return 2 * num_layers * page_stride_bytes(); }
  int64_t pool_bytes() const { return num_pages * bytes_per_page(); }
  // Offsets of a layer's K and V regions from the pool base.
  int64_t k_offset(int32_t layer) const { return (2 * layer) * num_pages * page_stride_bytes(); }
  int64_t v_offset(int32_t layer) const {
    return (2 * layer + 1) * num_pages * page_stride_bytes();
  }

  // The layout with as many pages as fit in pool_bytes; INVALID_ARGUMENT when not even one fits.
  static absl::StatusOr<KvLayout> ForPoolBytes(int32_t num_layers, int32_t num_kv_heads,
                                               int32_t head_dim, int32_t page_size, DType kv_dtype,
                                               int64_t pool_bytes);
};

}  // namespace attnd

#endif  // ATTND_KVCACHE_KV_LAYOUT_H_
