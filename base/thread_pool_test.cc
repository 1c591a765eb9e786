#include "base/thread_pool.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(ThreadPoolTest, CallsEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      for (auto& h : hits) h = 0;
      pool.ParallelFor(n, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << i;
    }
  }
}

TEST(ThreadPoolTest, DefaultUsesHardwareConcurrency) {
  ThreadPool pool(0);
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(pool.num_threads(), hw > 0 ? hw : 1);
}

TEST(ThreadPoolTest, UsesSeveralThreads) {
  ThreadPool pool(3);
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::atomic<int> arrived{0};
  // Each call waits (bounded) until three calls are in flight: only possible if the workers and
  // the caller run concurrently.
  pool.ParallelFor(3, [&](int64_t) {
    arrived.fetch_add(1);
    for (int spin = 0; spin < 2000000 && arrived.load() < 3; ++spin) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(arrived.load(), 3);
  EXPECT_EQ(ids.size(), 3u);
}

TEST(ThreadPoolTest, ConcurrentAndNestedCalls) {
  ThreadPool pool(4);
  std::atomic<int64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&] {
      pool.ParallelFor(20, [&](int64_t i) {
        // Nested: the inner call must not deadlock even when every worker is busy.
        pool.ParallelFor(10, [&](int64_t j) { sum.fetch_add(i * 10 + j); });
      });
    });
  }
  for (auto& t : callers) t.join();
  // 3 callers x sum of 0..199.
  EXPECT_EQ(sum.load(), 3 * (199 * 200 / 2));
}

}  // namespace
}  // namespace attnd
