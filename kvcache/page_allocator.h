// Hands out fixed-size KV pages from one pool. Pages are small integers (indices into the pool);
// what a page holds is the backend's business (kvcache/kv_layout.h describes the bytes).
#ifndef ATTND_KVCACHE_PAGE_ALLOCATOR_H_
#define ATTND_KVCACHE_PAGE_ALLOCATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/mutex.h"

namespace attnd {

// Thread-safe.
class PageAllocator {
 public:
  // Page ids are int32_t, so num_pages must not exceed INT32_MAX (KvLayout::ForPoolBytes caps it).
  explicit PageAllocator(int64_t num_pages);

  // n pages (the most recently freed first), or RESOURCE_EXHAUSTED (and nothing allocated) when
  // fewer than n are free.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t n);
  // Returns pages to the pool. Each must have come from Allocate and not been freed since; a page
  // that is not currently allocated (double free, out of range) is logged and ignored.
  void Free(absl::Span<const int32_t> pages);

  int64_t num_total() const { return num_total_; }
  int64_t num_free() const;

 private:
  const int64_t num_total_;
  mutable Mutex mu_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);  // LIFO: recently freed pages are reused first
  std::vector<bool> in_use_ ABSL_GUARDED_BY(mu_);   // [num_total_] handed out and not yet freed
};

}  // namespace attnd

#endif  // ATTND_KVCACHE_PAGE_ALLOCATOR_H_
