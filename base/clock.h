// An injectable source of "now", so time-driven server logic (the decode batcher's queue delay,
// per-call deadlines) can be driven by a fake clock in unit tests instead of by sleeps.
#ifndef ATTND_BASE_CLOCK_H_
#define ATTND_BASE_CLOCK_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/mutex.h"

namespace attnd {

// Thread-safe: any thread may call Now().
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;

  // The process-wide wall clock (absl::Now()); never destroyed.
  static const Clock* Real();
};

// A clock that moves only when told to. Thread-safe. For tests.
class ManualClock : public Clock {
 public:
  explicit ManualClock(absl::Time start = absl::UnixEpoch() + absl::Hours(1)) : now_(start) {}
  absl::Time Now() const override {
    MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

inline const Clock* Clock::Real() {
  class RealClock : public Clock {
   public:
    absl::Time Now() const override { return absl::Now(); }
  };
  static const Clock* clock = new RealClock();
  return clock;
}

}  // namespace attnd

#endif  // ATTND_BASE_CLOCK_H_
