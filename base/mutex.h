// attnd's mutex, condition variable and notification: thin annotated wrappers over std::mutex and
// std::condition_variable, used instead of absl::Mutex / absl::CondVar / absl::Notification.
//
// Why not abseil's: Debian's abseil is not built with ThreadSanitizer, so TSan cannot see the
// happens-before edges of absl::Mutex (it synchronises through atomics and futexes inside the
// uninstrumented library) and reports every access to data guarded by one as a race. These wrap
// pthread mutexes and condition variables, which TSan intercepts wherever they are called from, so
// the server, batcher and KV cache can run under TSan with nothing of ours suppressed
// (docs/RELIABILITY.md, "Sanitizers").
//
// The API is the subset of absl's that attnd uses, with the same thread-safety annotations, so
// ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED keep working under clang's -Wthread-safety.
// Mutex::Await keeps absl's meaning: the condition is re-checked whenever another thread releases
// the mutex (Unlock, or a wait in Await or CondVar), so nobody has to signal it by hand.
#ifndef ATTND_BASE_MUTEX_H_
#define ATTND_BASE_MUTEX_H_

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"

namespace attnd {

// Not recursive. Unlock must be called by the thread that locked it.
class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  // Wakes the threads in Await (before releasing: the mutex may be destroyed as soon as an
  // awaiting thread sees its condition true, e.g. a destructor waiting for idle).
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    WakeAwaiters();
    mu_.unlock();
  }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  // Documentation for the analysis only (std::mutex cannot tell who holds it).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

  // With the mutex held: returns once cond() is true, releasing the mutex while it waits. cond is
  // evaluated with the mutex held, after each Unlock by another thread.
  template <typename Cond>
  void Await(const Cond& cond) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    // Waiting releases the mutex, and the caller may have changed what others await: wake them
    // once (not on every re-wait, or two awaiters would wake each other forever).
    if (!cond()) {
      WakeAwaiters();
      ++awaiting_;
      do {
        changed_.wait(lock);
      } while (!cond());
      --awaiting_;
    }
    lock.release();  // still held: the caller's MutexLock unlocks it
  }
  // Await for at most `timeout`; returns cond() (false: timed out with cond still false).
  template <typename Cond>
  bool AwaitWithTimeout(const Cond& cond, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const auto deadline = Deadline(timeout);
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    bool ok = cond();
    if (!ok) {
      WakeAwaiters();
      ++awaiting_;
      while (!ok && changed_.wait_until(lock, deadline) == std::cv_status::no_timeout) ok = cond();
      if (!ok) ok = cond();
      --awaiting_;
    }
    lock.release();
    return ok;
  }

 private:
  friend class CondVar;

  // With mu_ held, about to release it: lets the threads in Await re-check their conditions.
  void WakeAwaiters() {
    if (awaiting_ > 0) changed_.notify_all();
  }

  // now + timeout on the steady clock, saturating (InfiniteDuration: a century).
  static std::chrono::steady_clock::time_point Deadline(absl::Duration timeout) {
    const absl::Duration capped = std::min(timeout, absl::Hours(24 * 365 * 100));
    return std::chrono::steady_clock::now() + std::chrono::nanoseconds(absl::ToInt64Nanoseconds(
                                                  std::max(capped, absl::ZeroDuration())));
  }

  std::mutex mu_;
  std::condition_variable changed_;  // notified by Unlock while awaiting_ > 0
  int32_t awaiting_ = 0;             // threads in Await; guarded by mu_
};

// Locks for the scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable for a Mutex, for waits that Await's "any unlock" wake-up does not fit (e.g.
// a timer that sleeps until a target unless signalled).
class CondVar {
 public:
  // mu must be held; it is released while waiting and held again on return. May wake spuriously.
  void Wait(Mutex* mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    mu->WakeAwaiters();  // like Unlock: the mutex is released while this waits
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // Wait for at most `timeout` (InfiniteDuration: no limit). True if it timed out.
  bool WaitWithTimeout(Mutex* mu, absl::Duration timeout) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (timeout == absl::InfiniteDuration()) {
      Wait(mu);
      return false;
    }
    mu->WakeAwaiters();
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool timed_out =
        cv_.wait_until(lock, Mutex::Deadline(timeout)) == std::cv_status::timeout;
    lock.release();
    return timed_out;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

// A one-shot event: Notify once, wait from any thread.
class Notification {
 public:
  Notification() = default;
  Notification(const Notification&) = delete;
  Notification& operator=(const Notification&) = delete;

  void Notify() {
    MutexLock lock(&mu_);
    notified_ = true;
  }
  bool HasBeenNotified() const {
    MutexLock lock(&mu_);
    return notified_;
  }
  void WaitForNotification() const {
    MutexLock lock(&mu_);
    mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return notified_; });
  }
  // True if notified within `timeout`.
  bool WaitForNotificationWithTimeout(absl::Duration timeout) const {
    MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return notified_; },
                                timeout);
  }

 private:
  mutable Mutex mu_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnd

#endif  // ATTND_BASE_MUTEX_H_
