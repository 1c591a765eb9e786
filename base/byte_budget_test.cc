#include "base/byte_budget.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(ByteBudgetTest, TakesWhatFitsAndGivesBack) {
  ByteBudget budget(100);
  EXPECT_TRUE(budget.TryTake(60, false));
  EXPECT_FALSE(budget.TryTake(41, false));
  EXPECT_FALSE(budget.TryTake(41, true));  // something else is held: no exception
  EXPECT_TRUE(budget.TryTake(40, false));
  EXPECT_EQ(budget.used(), 100);
  budget.Give(100);
  EXPECT_EQ(budget.used(), 0);
  EXPECT_FALSE(budget.TryTake(-1, true));
}

TEST(ByteBudgetTest, OneMessageAloneMayPassTheLimitButNoCopy) {
  ByteBudget budget(100);
  EXPECT_FALSE(budget.TryTake(150, false));
  EXPECT_TRUE(budget.TryTake(150, true));
  EXPECT_FALSE(budget.TryTake(1, true));
  budget.Give(150);
}

TEST(ByteBudgetTest, UnlimitedTakesAnything) {
  ByteBudget budget(0);
  EXPECT_TRUE(budget.TryTake(int64_t{1} << 50, false));
  EXPECT_EQ(budget.used(), int64_t{1} << 50);
}

TEST(ByteBudgetTest, LeaseGivesBackOnceWhenMovedAndDestroyed) {
  ByteBudget budget(100);
  ASSERT_TRUE(budget.TryTake(30, false));
  {
    ByteLease a(&budget, 30);
    ByteLease b(std::move(a));
    ByteLease c;
    c = std::move(b);
    EXPECT_EQ(budget.used(), 30);
  }
  EXPECT_EQ(budget.used(), 0);
}

TEST(ByteBudgetTest, ConcurrentTakersNeverPassTheLimit) {
  ByteBudget budget(1000);
  std::atomic<int64_t> max_seen{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        if (!budget.TryTake(7, false)) continue;
        int64_t used = budget.used();
        int64_t seen = max_seen.load();
        while (used > seen && !max_seen.compare_exchange_weak(seen, used)) {
        }
        budget.Give(7);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(max_seen.load(), 1000);
  EXPECT_EQ(budget.used(), 0);
}

}  // namespace
}  // namespace attnd
