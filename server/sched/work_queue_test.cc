#include "server/sched/work_queue.h"

#include <atomic>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "gtest/gtest.h"
#include "server/sched/request_context.h"

namespace attnd {
namespace {

TEST(WorkQueueTest, DefaultWorkersIsTwiceTheCoresAndAtLeastFour) {
  const int32_t cores = static_cast<int32_t>(std::thread::hardware_concurrency());
  EXPECT_EQ(DefaultRequestWorkers(), std::max(4, 2 * cores));
  WorkQueueOptions options;
  WorkQueue queue(options);
  EXPECT_EQ(queue.num_workers(), DefaultRequestWorkers());
}

// One worker makes the order observable: closures must run exactly in submission order.
TEST(WorkQueueTest, RunsInSubmissionOrder) {
  WorkQueueOptions options;
  options.num_workers = 1;
  WorkQueue queue(options);
  Notification started, release;
  Mutex mu;
  std::vector<int> order;
  ASSERT_TRUE(queue
                  .Submit([&] {
                    started.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  started.WaitForNotification();  // the worker is busy: everything below waits in the queue
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(queue
                    .Submit([&, i] {
                      MutexLock lock(&mu);
                      order.push_back(i);
                    })
                    .ok());
  }
  EXPECT_EQ(queue.num_waiting(), 50);
  release.Notify();
  queue.Shutdown();
  std::vector<int> want(50);
  for (int i = 0; i < 50; ++i) want[i] = i;
  EXPECT_EQ(order, want);
}

TEST(WorkQueueTest, FullQueueRejectsWithResourceExhausted) {
  WorkQueueOptions options;
  options.num_workers = 1;
  options.capacity = 2;
  WorkQueue queue(options);
  Notification started, release;
  std::atomic<int> ran{0};
  ASSERT_TRUE(queue
                  .Submit([&] {
                    started.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  started.WaitForNotification();  // the worker holds it: the queue itself is empty again
  ASSERT_TRUE(queue.Submit([&] { ++ran; }).ok());
  ASSERT_TRUE(queue.Submit([&] { ++ran; }).ok());
  const absl::Status full = queue.Submit([&] { ran += 100; });
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.message(), "the request queue is full (2 requests waiting); retry later");
  release.Notify();
  queue.Shutdown();
  EXPECT_EQ(ran.load(), 2);  // the rejected closure never ran
}

TEST(WorkQueueTest, StopAcceptingRejectsButDrainsWhatIsQueued) {
  WorkQueueOptions options;
  options.num_workers = 2;
  WorkQueue queue(options);
  Notification release;
  std::atomic<int> ran{0};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(queue
                    .Submit([&] {
                      release.WaitForNotification();
                      ++ran;
                    })
                    .ok());
  }
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(queue.Submit([&] { ++ran; }).ok());
  queue.StopAccepting();
  const absl::Status rejected = queue.Submit([&] { ran += 100; });
  EXPECT_EQ(rejected.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(rejected.message(), "the server is shutting down");
  release.Notify();
  queue.Shutdown();
  EXPECT_EQ(ran.load(), 7);
  EXPECT_EQ(queue.Submit([] {}).code(), absl::StatusCode::kUnavailable);
}

TEST(WorkQueueTest, ShutdownIsIdempotentAndDestructorJoins) {
  std::atomic<int> ran{0};
  {
    WorkQueueOptions options;
    options.num_workers = 3;
    WorkQueue queue(options);
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(queue.Submit([&] { ++ran; }).ok());
    queue.Shutdown();
    queue.Shutdown();
  }
  EXPECT_EQ(ran.load(), 20);
}

// Records the start the worker reports (RequestObserver).
struct StartRecorder : RequestObserver {
  void OnStarted(absl::Time t) override {
    MutexLock lock(&mu);
    ++starts;
    started = t;
  }
  Mutex mu;
  int starts ABSL_GUARDED_BY(mu) = 0;
  absl::Time started ABSL_GUARDED_BY(mu) = absl::InfinitePast();
};

// A request's context is checked by the worker that dequeues it: one whose deadline passed while
// it waited, or whose client cancelled, is handed DEADLINE_EXCEEDED / CANCELLED (and answers
// without running); the others are admitted. Every one is told its start.
TEST(WorkQueueTest, TheWorkerChecksTheRequestContextWhenItDequeues) {
  WorkQueueOptions options;
  options.num_workers = 1;
  WorkQueue queue(options);
  Notification started, release;
  ASSERT_TRUE(queue
                  .Submit([&] {
                    started.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  started.WaitForNotification();  // the worker is busy: everything below waits in the queue

  StartRecorder expired_observer, cancelled_observer, fine_observer;
  RequestContext expired;
  expired.enqueue_time = absl::Now();
  expired.deadline = absl::Now() + absl::Milliseconds(20);
  expired.observer = &expired_observer;
  std::shared_ptr<std::atomic<bool>> cancel = NewCancelFlag();
  RequestContext cancelled;
  cancelled.cancelled = cancel;
  cancelled.observer = &cancelled_observer;
  RequestContext fine;  // a deadline far off, a flag never set
  fine.deadline = absl::Now() + absl::Hours(1);
  fine.cancelled = NewCancelFlag();
  fine.observer = &fine_observer;

  Mutex mu;
  std::vector<absl::Status> got(3, absl::UnknownError("not run"));
  const RequestContext* contexts[] = {&expired, &cancelled, &fine};
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(queue
                    .Submit(*contexts[i],
                            [&, i](absl::Status admitted) {
                              MutexLock lock(&mu);
                              got[i] = std::move(admitted);
                            })
                    .ok());
  }
  cancel->store(true);                     // cancelled before it is dequeued
  absl::SleepFor(absl::Milliseconds(40));  // past `expired`'s deadline, still queued
  const absl::Time before_release = absl::Now();
  release.Notify();
  queue.Shutdown();

  MutexLock lock(&mu);
  EXPECT_EQ(got[0].code(), absl::StatusCode::kDeadlineExceeded) << got[0];
  EXPECT_TRUE(
      absl::StartsWith(got[0].message(), "the client's deadline passed while the request waited "))
      << got[0];
  EXPECT_TRUE(absl::EndsWith(got[0].message(), " in the queue; nothing was done")) << got[0];
  EXPECT_EQ(got[1].code(), absl::StatusCode::kCancelled) << got[1];
  EXPECT_EQ(got[1].message(), "the call was cancelled before it started; nothing was done");
  EXPECT_TRUE(got[2].ok()) << got[2];
  for (StartRecorder* o : {&expired_observer, &cancelled_observer, &fine_observer}) {
    MutexLock observer_lock(&o->mu);
    EXPECT_EQ(o->starts, 1);
    EXPECT_GE(o->started, before_release);  // when the worker dequeued it, not when queued
  }
}

// The context-taking Submit refuses like the plain one, and its fn never runs then.
TEST(WorkQueueTest, AContextSubmitThatIsRefusedNeverRuns) {
  WorkQueue queue(WorkQueueOptions{});
  queue.StopAccepting();
  bool ran = false;
  EXPECT_EQ(queue.Submit(RequestContext(), [&](absl::Status) { ran = true; }).code(),
            absl::StatusCode::kUnavailable);
  queue.Shutdown();
  EXPECT_FALSE(ran);
}

}  // namespace
}  // namespace attnd
