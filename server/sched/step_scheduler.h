// The order of device steps (server/runtime/device_turns.h): decode batches first, prefill steps
// between them, and a guaranteed share of the device for prefill so that a steady decode load
// never starves it.
//
// Two modes, from the engine (Engine::overlaps_prefill_and_decode):
// - alternating (the CPU engine; any engine whose decode and prefill compete for one resource): a
//   prefill step runs only while no decode runs, and starts only when no decode waits, unless
//   prefill is owed its share; a decode starts when no prefill step runs, unless prefill is owed
//   and waiting. Prefill calls are cut into bounded steps below (Engine::StartPrefill), so a
//   decode waits for at most one step, never a whole call.
// - overlapping (the CUDA engine): decode and prefill run on separate streams at once, the decode
//   stream at the higher priority, so the device puts decode first at block granularity and a
//   prefill step (a bounded key-tile window) leaves the machine between its blocks. No turn waits
//   for the other kind; prefill cannot starve because every decode step ends in a host
//   synchronisation that leaves the device to the prefill's blocks.
//
// "Owed": over a sliding window (exponentially weighted, time constant `window`), prefill steps
// held the device for less than `prefill_share` of the time either kind held it.
#ifndef ATTND_SERVER_SCHED_STEP_SCHEDULER_H_
#define ATTND_SERVER_SCHED_STEP_SCHEDULER_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "server/runtime/device_turns.h"

namespace attnd {

struct StepSchedulerOptions {
  bool overlap = false;
  // In [0, 1]: the least share of the device prefill gets while it waits (--prefill-share).
  double prefill_share = 0.25;
  absl::Duration window = absl::Milliseconds(100);
  const Clock* clock = Clock::Real();
};

// The decision alone, over plain state, so that tests can walk it step by step.
struct StepPolicy {
  StepSchedulerOptions options;
  int64_t running_decode = 0, running_prefill = 0;
  int64_t waiting_decode = 0, waiting_prefill = 0;
  // Seconds each kind held the device, weighted exp(-age / window), as of `updated`.
  double decode_busy = 0, prefill_busy = 0;
  absl::Time updated = absl::InfinitePast();

  // Brings the busy times to `now` (each kind counts as busy while any of its steps runs).
  void Advance(absl::Time now);
  bool PrefillOwed() const;
  bool MayStart(DeviceWork work) const;
};

class StepScheduler : public DeviceTurns {
 public:
  explicit StepScheduler(const StepSchedulerOptions& options);

  void Acquire(DeviceWork work) override;
  void Release(DeviceWork work) override;

  struct Stats {
    int64_t decode_steps = 0, prefill_steps = 0;
    // Steps that had to wait for the other kind, and how long all of them waited.
    int64_t decode_waits = 0, prefill_waits = 0;
    absl::Duration decode_wait = absl::ZeroDuration(), prefill_wait = absl::ZeroDuration();
    // Prefill steps admitted ahead of waiting decodes because prefill was owed its share.
    int64_t prefill_owed_turns = 0;
  };
  Stats stats() const;

 private:
  const Clock* const clock_;
  mutable Mutex mu_;
  StepPolicy policy_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnd

#endif  // ATTND_SERVER_SCHED_STEP_SCHEDULER_H_
