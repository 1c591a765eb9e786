#include "kvcache/page_allocator.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/base/internal/raw_logging.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnd {

PageAllocator::PageAllocator(int64_t num_pages)
    : num_total_(num_pages < 0 ? 0 : num_pages), in_use_(num_total_, false) {
  // Filled highest-first so that a fresh pool hands out 0, 1, 2, ...: low pages first keeps a
  // lightly used pool's working set at the start of the allocation.
  free_.reserve(num_total_);
  for (int64_t p = num_total_ - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

absl::StatusOr<std::vector<int32_t>> PageAllocator::Allocate(int64_t n) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate a negative number of pages (", n, ")"));
  }
  MutexLock lock(&mu_);
  const int64_t available = static_cast<int64_t>(free_.size());
  if (n > available) {
    return absl::ResourceExhaustedError(absl::StrCat("out of KV cache pages: ", n, " needed, ",
                                                     available, " free of ", num_total_));
  }
  std::vector<int32_t> pages(free_.end() - n, free_.end());
  free_.resize(available - n);
  // Hand them out in pop order (the most recently freed first).
  std::reverse(pages.begin(), pages.end());
  for (int32_t p : pages) in_use_[p] = true;
  return pages;
}

void PageAllocator::Free(absl::Span<const int32_t> pages) {
  MutexLock lock(&mu_);
  for (int32_t p : pages) {
    // A page freed twice would later be handed to two sequences at once and silently mix their
    // K/V; refuse it loudly instead of corrupting the pool.
    if (p < 0 || p >= num_total_ || !in_use_[p]) {
      ABSL_RAW_LOG(ERROR, "PageAllocator::Free: page %d is not allocated (pool of %lld); ignored",
                   p, static_cast<long long>(num_total_));
      continue;
    }
    in_use_[p] = false;
    free_.push_back(p);
  }
}

int64_t PageAllocator::num_free() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(free_.size());
}

}  // namespace attnd
