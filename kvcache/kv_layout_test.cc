#include "kvcache/kv_layout.h"

#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(KvLayoutTest, TinyModelArithmetic) {
  // 2 layers, 2 kv heads, head_dim 64, 16-token pages, fp32:
  // one layer's K for one page = 16 * 2 * 64 * 4 = 8192 B; a page across layers, K and V = 32768 B.
  absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(2, 2, 64, 16, DType::kFp32, 100000);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->page_stride_bytes(), 8192);
  EXPECT_EQ(layout->bytes_per_page(), 32768);
  EXPECT_EQ(layout->num_pages, 3);  // 100000 / 32768, rounded down
  EXPECT_EQ(layout->pool_bytes(), 98304);
  EXPECT_EQ(layout->k_offset(0), 0);
  EXPECT_EQ(layout->v_offset(0), 3 * 8192);
  EXPECT_EQ(layout->k_offset(1), 6 * 8192);
  EXPECT_EQ(layout->v_offset(1), 9 * 8192);
  EXPECT_EQ(layout->v_offset(1) + 3 * 8192, layout->pool_bytes());  // the last region ends the pool
}

TEST(KvLayoutTest, QwenSevenBBf16PageSize) {
  // DCA.md: 57,344 B of K/V per token for Qwen2.5-7B in bf16 (2 x 28 x 4 x 128 x 2 B).
  absl::StatusOr<KvLayout> layout =
      KvLayout::ForPoolBytes(28, 4, 128, 16, DType::kBf16, int64_t{1} << 30);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->bytes_per_page(), 16 * 57344);
  EXPECT_EQ(layout->num_pages, (int64_t{1} << 30) / (16 * 57344));
}

// Walks the pool in its documented order (layer, K then V, page, slot, head, dim), numbering
// bytes; every element's running offset must equal the one the accessors give.
TEST(KvLayoutTest, OffsetsMatchAnIndependentWalkOfThePool) {
  absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(3, 2, 4, 5, DType::kBf16, 4000);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const int64_t elem = 2;
  int64_t running = 0;
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t base = kv == 0 ? layout->k_offset(layer) : layout->v_offset(layer);
      for (int64_t page = 0; page < layout->num_pages; ++page) {
        for (int slot = 0; slot < 5; ++slot) {
          for (int head = 0; head < 2; ++head) {
            for (int d = 0; d < 4; ++d) {
              const int64_t formula =
                  base + page * layout->page_stride_bytes() + ((slot * 2 + head) * 4 + d) * elem;
              ASSERT_EQ(formula, running) << layer << " " << kv << " " << page << " " << slot;
              running += elem;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(running, layout->pool_bytes());
  EXPECT_LE(layout->pool_bytes(), 4000);
  EXPECT_GT(layout->pool_bytes() + layout->bytes_per_page(), 4000);  // as many pages as fit
}

TEST(KvLayoutTest, PoolExactlyOnePage) {
  absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(2, 2, 64, 16, DType::kFp32, 32768);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->num_pages, 1);
}

TEST(KvLayoutTest, PoolSmallerThanOnePageIsRejected) {
  absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(2, 2, 64, 16, DType::kFp32, 32767);
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(layout.status().message(),
            "KV pool of 32767 bytes is smaller than one page (32768 bytes: 16 tokens x 2 layers x "
            "K and V x 2 kv heads x 64 x 4 B)");
}

TEST(KvLayoutTest, NonPositiveDimensionsAreRejectedByName) {
  struct Case {
    int32_t layers, heads, dim, page;
    const char* message;
  } cases[] = {
      {0, 2, 64, 16, "KV layout: num_layers must be positive, got 0"},
      {2, -1, 64, 16, "KV layout: num_kv_heads must be positive, got -1"},
      {2, 2, 0, 16, "KV layout: head_dim must be positive, got 0"},
      {2, 2, 64, 0, "KV layout: page_size must be positive, got 0"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<KvLayout> layout =
        KvLayout::ForPoolBytes(c.layers, c.heads, c.dim, c.page, DType::kFp32, int64_t{1} << 30);
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(layout.status().message(), c.message);
  }
}

TEST(KvLayoutTest, PageCountIsCappedAtInt32) {
  // 8 B per page (1 layer x K,V x 1 head x 1 dim x 1 token x fp32): far more pages than int32 ids.
  const int64_t pool = int64_t{8} * (int64_t{1} << 32);
  absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(1, 1, 1, 1, DType::kFp32, pool);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->bytes_per_page(), 8);
  EXPECT_EQ(layout->num_pages, std::numeric_limits<int32_t>::max());
}

TEST(KvLayoutTest, OverflowingPageSizeIsRejected) {
  const int32_t big = std::numeric_limits<int32_t>::max();
  absl::StatusOr<KvLayout> layout =
      KvLayout::ForPoolBytes(big, big, big, big, DType::kFp32, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(layout.status().message(), "KV layout: one page's size overflows 64 bits");
}

}  // namespace
}  // namespace attnd
