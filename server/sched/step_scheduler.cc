#include "server/sched/step_scheduler.h"

#include <algorithm>
#include <cmath>

namespace attnd {

void StepPolicy::Advance(absl::Time now) {
  if (updated == absl::InfinitePast() || now <= updated) {
    updated = std::max(updated, now);
    return;
  }
  const double dt = absl::ToDoubleSeconds(now - updated);
  const double w = std::max(1e-9, absl::ToDoubleSeconds(options.window));
  // A kind busy for the whole interval gains its integral of the weight: w (1 - e^(-dt/w)).
  const double keep = std::exp(-dt / w), gain = w * (1.0 - keep);
  decode_busy = decode_busy * keep + (running_decode > 0 ? gain : 0.0);
  prefill_busy = prefill_busy * keep + (running_prefill > 0 ? gain : 0.0);
  updated = now;
}

bool StepPolicy::PrefillOwed() const {
  return prefill_busy < options.prefill_share * (prefill_busy + decode_busy);
}

bool StepPolicy::MayStart(DeviceWork work) const {
  if (options.overlap) return true;
  if (work == DeviceWork::kDecode) {
    return running_prefill == 0 && !(waiting_prefill > 0 && PrefillOwed());
  }
  return running_decode == 0 && (waiting_decode == 0 || PrefillOwed());
}

StepScheduler::StepScheduler(const StepSchedulerOptions& options)
    : clock_(options.clock != nullptr ? options.clock : Clock::Real()) {
  MutexLock lock(&mu_);
  policy_.options = options;
  policy_.options.prefill_share = std::clamp(options.prefill_share, 0.0, 1.0);
}

void StepScheduler::Acquire(DeviceWork work) {
  const bool decode = work == DeviceWork::kDecode;
  MutexLock lock(&mu_);
  const absl::Time asked = clock_->Now();
  policy_.Advance(asked);
  if (!policy_.MayStart(work)) {
    ++(decode ? policy_.waiting_decode : policy_.waiting_prefill);
    mu_.Await([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      policy_.Advance(clock_->Now());
      return policy_.MayStart(work);
    });
    --(decode ? policy_.waiting_decode : policy_.waiting_prefill);
    const absl::Duration waited = clock_->Now() - asked;
    ++(decode ? stats_.decode_waits : stats_.prefill_waits);
    (decode ? stats_.decode_wait : stats_.prefill_wait) += waited;
  }
  if (!decode && policy_.waiting_decode > 0) ++stats_.prefill_owed_turns;
  ++(decode ? policy_.running_decode : policy_.running_prefill);
  ++(decode ? stats_.decode_steps : stats_.prefill_steps);
}

void StepScheduler::Release(DeviceWork work) {
  MutexLock lock(&mu_);
  policy_.Advance(clock_->Now());
  --(work == DeviceWork::kDecode ? policy_.running_decode : policy_.running_prefill);
}

StepScheduler::Stats StepScheduler::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace attnd
