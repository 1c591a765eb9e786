#include "kvcache/kv_layout.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnd {

absl::StatusOr<KvLayout> KvLayout::ForPoolBytes(int32_t num_layers, int32_t num_kv_heads,
                                                int32_t head_dim, int32_t page_size, DType kv_dtype,
                                                int64_t pool_bytes) {
  const struct {
    const char* name;
    int32_t value;
  } dims[] = {{"num_layers", num_layers},
              {"num_kv_heads", num_kv_heads},
              {"head_dim", head_dim},
              {"page_size", page_size}};
  for (const auto& d : dims) {
    if (d.value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV layout: ", d.name, " must be positive, got ", d.value));
    }
  }
  if (!IsKvDType(kv_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV layout: dtype ", DTypeName(kv_dtype),
                     " cannot be cached; use fp32, bf16, fp8 or int8"));
  }
  KvLayout layout;
  layout.num_layers = num_layers;
  layout.num_kv_heads = num_kv_heads;
  layout.head_dim = head_dim;
  layout.page_size = page_size;
  layout.kv_dtype = kv_dtype;
  // Four int32 factors can overflow int64: a pathological geometry must not wrap to a small page.
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t scale = KvLayout::ScaleBytes(kv_dtype);
  if (int64_t{head_dim} > (kMax - scale) / static_cast<int64_t>(ElementSize(kv_dtype))) {
    return absl::InvalidArgumentError("KV layout: one page's size overflows 64 bits");
  }
  // Bytes of one token's one kv head: its head_dim elements and its scale.
  int64_t bytes = int64_t{head_dim} * static_cast<int64_t>(ElementSize(kv_dtype)) + scale;
  for (int64_t f : {int64_t{page_size}, int64_t{num_kv_heads}, int64_t{2} * num_layers}) {
    if (bytes > kMax / f) {
      return absl::InvalidArgumentError("KV layout: one page's size overflows 64 bits");
    }
    bytes *= f;
  }
  const int64_t bytes_per_page = layout.bytes_per_page();
  if (pool_bytes < bytes_per_page) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV pool of ", pool_bytes, " bytes is smaller than one page (", bytes_per_page, " bytes: ",
        page_size, " tokens x ", num_layers, " layers x K and V x ", num_kv_heads, " kv heads x ",
        scale > 0 ? absl::StrCat("(", head_dim, " x ", ElementSize(kv_dtype), " B + a ", scale,
                                 " B scale)")
                  : absl::StrCat(head_dim, " x ", ElementSize(kv_dtype), " B"),
        ")"));
  }
  // Page ids are int32_t (page tables, PagedKv): cap the count rather than wrap.
  layout.num_pages =
      std::min<int64_t>(pool_bytes / bytes_per_page, std::numeric_limits<int32_t>::max());
  return layout;
}

}  // namespace attnd
