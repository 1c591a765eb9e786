#include "kvcache/page_allocator.h"

#include <cstdint>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(PageAllocatorTest, HandsOutEveryPageOnceThenRunsOut) {
  PageAllocator alloc(5);
  EXPECT_EQ(alloc.num_total(), 5);
  EXPECT_EQ(alloc.num_free(), 5);

  absl::StatusOr<std::vector<int32_t>> a = alloc.Allocate(3);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::vector<int32_t>> b = alloc.Allocate(2);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(alloc.num_free(), 0);

  std::set<int32_t> seen(a->begin(), a->end());
  seen.insert(b->begin(), b->end());
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1, 2, 3, 4}));  // distinct, all in range
}

TEST(PageAllocatorTest, FreshPoolStartsAtPageZero) {
  PageAllocator alloc(4);
  absl::StatusOr<std::vector<int32_t>> a = alloc.Allocate(4);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(*a, ElementsAre(0, 1, 2, 3));
}

TEST(PageAllocatorTest, ExhaustionAllocatesNothingAndLeavesCountsUnchanged) {
  PageAllocator alloc(5);
  ASSERT_TRUE(alloc.Allocate(3).ok());
  absl::StatusOr<std::vector<int32_t>> too_many = alloc.Allocate(3);
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(too_many.status().message(), "out of KV cache pages: 3 needed, 2 free of 5");
  EXPECT_EQ(alloc.num_free(), 2);
  // The two that are left are still all there.
  absl::StatusOr<std::vector<int32_t>> rest = alloc.Allocate(2);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(rest->size(), 2u);
  EXPECT_EQ(alloc.num_free(), 0);
}

TEST(PageAllocatorTest, FreedPagesAreReusedMostRecentFirst) {
  PageAllocator alloc(6);
  absl::StatusOr<std::vector<int32_t>> all = alloc.Allocate(6);
  ASSERT_TRUE(all.ok());
  alloc.Free({(*all)[1], (*all)[4]});
  EXPECT_EQ(alloc.num_free(), 2);
  absl::StatusOr<std::vector<int32_t>> again = alloc.Allocate(2);
  ASSERT_TRUE(again.ok()) << again.status();
  // LIFO: the page freed last comes back first (it is the warmest in cache).
  EXPECT_THAT(*again, ElementsAre((*all)[4], (*all)[1]));
  EXPECT_EQ(alloc.num_free(), 0);
}

TEST(PageAllocatorTest, ZeroPagesIsFineNegativeIsNot) {
  PageAllocator alloc(2);
  absl::StatusOr<std::vector<int32_t>> none = alloc.Allocate(0);
  ASSERT_TRUE(none.ok());
  EXPECT_THAT(*none, IsEmpty());
  EXPECT_EQ(alloc.num_free(), 2);

  absl::StatusOr<std::vector<int32_t>> negative = alloc.Allocate(-1);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(negative.status().message(), "cannot allocate a negative number of pages (-1)");
  EXPECT_EQ(alloc.num_free(), 2);
}

TEST(PageAllocatorTest, EmptyPoolIsExhaustedAtOnce) {
  PageAllocator alloc(0);
  EXPECT_EQ(alloc.num_free(), 0);
  EXPECT_EQ(alloc.Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PageAllocatorTest, DoubleAndForeignFreesAreIgnored) {
  PageAllocator alloc(3);
  absl::StatusOr<std::vector<int32_t>> a = alloc.Allocate(2);
  ASSERT_TRUE(a.ok());
  alloc.Free(*a);
  EXPECT_EQ(alloc.num_free(), 3);
  alloc.Free(*a);            // again: must not put the pages in the free list twice
  alloc.Free({-1, 3, 100});  // never in the pool
  EXPECT_EQ(alloc.num_free(), 3);
  // If a duplicate had slipped in, four allocations of one page would succeed.
  absl::StatusOr<std::vector<int32_t>> all = alloc.Allocate(3);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(std::set<int32_t>(all->begin(), all->end()).size(), 3u);
  EXPECT_EQ(alloc.Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace attnd
