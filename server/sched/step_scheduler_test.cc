#include "server/sched/step_scheduler.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/mutex.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

StepSchedulerOptions Alternating(const Clock* clock, double share = 0.25) {
  StepSchedulerOptions o;
  o.overlap = false;
  o.prefill_share = share;
  o.window = absl::Milliseconds(100);
  o.clock = clock;
  return o;
}

// The policy walked by hand: a steady decode load with one prefill call waiting. The share the
// prefill gets is computed here from the step times, independently of the policy's own weights.
TEST(StepPolicyTest, DecodeFirstThenPrefillGetsItsShareUnderASteadyDecodeLoad) {
  ManualClock clock;
  StepPolicy p;
  p.options = Alternating(&clock, 0.25);
  p.waiting_prefill = 1;
  p.waiting_decode = 1;  // a decode always waits: the load never lets up
  double decode_time = 0, prefill_time = 0;
  int prefill_steps = 0;
  for (int i = 0; i < 2000; ++i) {
    p.Advance(clock.Now());
    const bool decode = p.MayStart(DeviceWork::kDecode);
    const bool prefill = p.MayStart(DeviceWork::kPrefill);
    ASSERT_NE(decode, prefill) << "exactly one kind may start when both wait, step " << i;
    if (i == 0) {
      EXPECT_TRUE(decode) << "decode comes first";
    }
    const absl::Duration step = decode ? absl::Microseconds(200) : absl::Microseconds(500);
    ++(decode ? p.running_decode : p.running_prefill);
    clock.Advance(step);
    p.Advance(clock.Now());
    --(decode ? p.running_decode : p.running_prefill);
    (decode ? decode_time : prefill_time) += absl::ToDoubleSeconds(step);
    if (!decode) ++prefill_steps;
  }
  ASSERT_GT(prefill_steps, 0) << "prefill starved";
  const double share = prefill_time / (prefill_time + decode_time);
  EXPECT_GT(share, 0.22);
  EXPECT_LT(share, 0.32);  // and no more than about its share while decodes wait
}

TEST(StepPolicyTest, AStepOfOneKindExcludesTheOtherWhenAlternating) {
  ManualClock clock;
  StepPolicy p;
  p.options = Alternating(&clock);
  p.running_prefill = 1;
  EXPECT_FALSE(p.MayStart(DeviceWork::kDecode));
  EXPECT_TRUE(p.MayStart(DeviceWork::kPrefill));  // prefill steps of other calls may run beside
  p.running_prefill = 0;
  p.running_decode = 2;
  EXPECT_FALSE(p.MayStart(DeviceWork::kPrefill));
  EXPECT_TRUE(p.MayStart(DeviceWork::kDecode));
}

TEST(StepPolicyTest, PrefillAloneRunsAtOnceAndDecodeIsNeverHeldWithoutAWaitingPrefill) {
  ManualClock clock;
  StepPolicy p;
  p.options = Alternating(&clock, 1.0);  // even a share of 100% does not hold decode for nothing
  EXPECT_TRUE(p.MayStart(DeviceWork::kPrefill));
  EXPECT_TRUE(p.MayStart(DeviceWork::kDecode));
}

TEST(StepPolicyTest, ZeroShareLetsDecodeGoFirstForever) {
  ManualClock clock;
  StepPolicy p;
  p.options = Alternating(&clock, 0.0);
  p.waiting_prefill = p.waiting_decode = 1;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(p.MayStart(DeviceWork::kDecode));
    ASSERT_FALSE(p.MayStart(DeviceWork::kPrefill));
    ++p.running_decode;
    clock.Advance(absl::Milliseconds(1));
    p.Advance(clock.Now());
    --p.running_decode;
  }
}

TEST(StepPolicyTest, OverlapNeverHoldsEitherKind) {
  ManualClock clock;
  StepPolicy p;
  p.options = Alternating(&clock);
  p.options.overlap = true;
  p.running_prefill = p.running_decode = p.waiting_prefill = p.waiting_decode = 3;
  EXPECT_TRUE(p.MayStart(DeviceWork::kDecode));
  EXPECT_TRUE(p.MayStart(DeviceWork::kPrefill));
}

TEST(StepPolicyTest, BusyTimesDecayWithTheWindow) {
  ManualClock clock;
  StepPolicy p;
  p.options = Alternating(&clock);
  p.Advance(clock.Now());
  p.running_decode = 1;
  clock.Advance(absl::Milliseconds(100));
  p.Advance(clock.Now());
  // The integral of e^(-age/w) over 100 ms of busy time, w = 100 ms: w (1 - 1/e).
  EXPECT_NEAR(p.decode_busy, 0.1 * (1 - std::exp(-1.0)), 1e-9);
  p.running_decode = 0;
  clock.Advance(absl::Milliseconds(100));
  p.Advance(clock.Now());
  EXPECT_NEAR(p.decode_busy, 0.1 * (1 - std::exp(-1.0)) * std::exp(-1.0), 1e-9);
  EXPECT_EQ(p.prefill_busy, 0.0);
}

// Threads: a prefill step holds the device; a decode that arrives meanwhile runs as soon as the
// step ends, before the prefill's next step, which waits for it.
TEST(StepSchedulerTest, ADecodeArrivingDuringAPrefillStepRunsBeforeTheNextStep) {
  StepScheduler sched(Alternating(Clock::Real()));
  Mutex mu;
  std::vector<std::string> order;
  const auto log = [&](const std::string& what) {
    MutexLock lock(&mu);
    order.push_back(what);
  };
  sched.Acquire(DeviceWork::kPrefill);  // step 1 of the prefill
  log("prefill 1");
  std::atomic<bool> decode_started{false};
  std::thread decoder([&] {
    DeviceTurn turn(&sched, DeviceWork::kDecode);
    decode_started = true;
    log("decode");
    absl::SleepFor(absl::Milliseconds(20));  // the decode step; the prefill's next step waits
    log("decode done");
  });
  // The decode waits for step 1: it is not admitted while the step runs.
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(decode_started.load());
  sched.Release(DeviceWork::kPrefill);
  // Step 2 asks only after the decode has been admitted (it was waiting first).
  while (!decode_started.load()) absl::SleepFor(absl::Milliseconds(1));
  sched.Acquire(DeviceWork::kPrefill);
  log("prefill 2");
  sched.Release(DeviceWork::kPrefill);
  decoder.join();
  ASSERT_EQ(order.size(), 4u);
  EXPECT_EQ(order[0], "prefill 1");
  EXPECT_EQ(order[1], "decode");
  EXPECT_EQ(order[2], "decode done");
  EXPECT_EQ(order[3], "prefill 2");
  const StepScheduler::Stats stats = sched.stats();
  EXPECT_EQ(stats.decode_steps, 1);
  EXPECT_EQ(stats.prefill_steps, 2);
  EXPECT_EQ(stats.decode_waits, 1);
  EXPECT_EQ(stats.prefill_waits, 1);
  EXPECT_GE(stats.decode_wait, absl::Milliseconds(40));
}

// Threads: four decoders keep the device busy without a break; a prefill call of 20 steps still
// finishes, with about its share of the device.
TEST(StepSchedulerTest, PrefillIsNotStarvedByContinuousDecodes) {
  StepSchedulerOptions o = Alternating(Clock::Real(), 0.25);
  o.window = absl::Milliseconds(20);
  StepScheduler sched(o);
  std::atomic<bool> stop{false};
  std::vector<std::thread> decoders;
  for (int i = 0; i < 4; ++i) {
    decoders.emplace_back([&] {
      while (!stop.load()) {
        DeviceTurn turn(&sched, DeviceWork::kDecode);
        absl::SleepFor(absl::Microseconds(500));
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(20));
  const absl::Time t0 = absl::Now();
  for (int step = 0; step < 20; ++step) {
    DeviceTurn turn(&sched, DeviceWork::kPrefill);
    absl::SleepFor(absl::Microseconds(500));
  }
  const absl::Duration took = absl::Now() - t0;
  stop = true;
  for (std::thread& t : decoders) t.join();
  // 20 steps of 0.5 ms at a 25% share take about 40 ms; starvation would take forever. Generous
  // bound for a loaded CI machine.
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_GT(sched.stats().prefill_owed_turns, 0);
}

TEST(StepSchedulerTest, OverlapAdmitsBothKindsAtOnce) {
  StepSchedulerOptions o = Alternating(Clock::Real());
  o.overlap = true;
  StepScheduler sched(o);
  sched.Acquire(DeviceWork::kPrefill);
  absl::Notification decoded;
  std::thread decoder([&] {
    DeviceTurn turn(&sched, DeviceWork::kDecode);
    decoded.Notify();
  });
  EXPECT_TRUE(decoded.WaitForNotificationWithTimeout(absl::Seconds(10)));
  decoder.join();
  sched.Release(DeviceWork::kPrefill);
  EXPECT_EQ(sched.stats().decode_waits, 0);
}

}  // namespace
}  // namespace attnd
