#include "server/sched/work_queue.h"

#include <atomic>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "gtest/gtest.h"

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

}  // namespace
}  // namespace attnd
