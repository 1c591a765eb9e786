// One budget of bytes that requests hold in attnd's memory while they are served: message bytes,
// private copies of shared-memory tensors, ring requests copied out of their ring. Whoever holds
// bytes of a request takes them here first, so that what a client names or sends stays within
// --max-inflight-request-bytes. Thread-safe, lock-free.
#ifndef ATTND_BASE_BYTE_BUDGET_H_
#define ATTND_BASE_BYTE_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <utility>

namespace attnd {

class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit) : limit_(limit) {}  // limit <= 0: unlimited
  ByteBudget(const ByteBudget&) = delete;
  ByteBudget& operator=(const ByteBudget&) = delete;

  // Takes `bytes` if they fit, and says whether it did. `alone_may_exceed`: a taker may also pass
  // the limit when nothing else is held (a message gRPC already received, which the flags
  // guarantee fits the budget on its own); copies a request only names are never taken past it.
  bool TryTake(int64_t bytes, bool alone_may_exceed) {
    if (bytes < 0) return false;
    int64_t used = used_.load(std::memory_order_relaxed);
    do {
      const bool fits = limit_ <= 0 || used + bytes <= limit_;
      if (!fits && !(alone_may_exceed && used == 0)) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  void Give(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// Bytes taken from a ByteBudget, given back when the lease ends. Movable.
class ByteLease {
 public:
  ByteLease() = default;
  ByteLease(ByteBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
  ByteLease(ByteLease&& other) noexcept
      : budget_(std::exchange(other.budget_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  ByteLease& operator=(ByteLease&& other) noexcept {
    if (this != &other) {
      Reset();
      budget_ = std::exchange(other.budget_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~ByteLease() { Reset(); }
  void Reset() {
    if (budget_ != nullptr && bytes_ != 0) budget_->Give(bytes_);
    budget_ = nullptr;
    bytes_ = 0;
  }
  int64_t bytes() const { return bytes_; }

 private:
  ByteBudget* budget_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace attnd

#endif  // ATTND_BASE_BYTE_BUDGET_H_
