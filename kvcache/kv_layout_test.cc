#include "kvcache/kv_layout.h"

#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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

// fp8 and int8 lay their pools out alike: one-byte codes and an fp32 scale per token and kv head.
class ScaledKvLayoutTest : public ::testing::TestWithParam<DType> {};

TEST_P(ScaledKvLayoutTest, ReservesAScalePerTokenAndKvHead) {
  // Tiny model in one-byte codes: one layer's K data for one page = 16 * 2 * 64 * 1 = 2048 B, its
  // scales 16 * 2 * 4 = 128 B; a page = 2 layers x K and V x (2048 + 128) = 8704 B.
  absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(2, 2, 64, 16, GetParam(), 100000);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->page_stride_bytes(), 2048);
  EXPECT_EQ(layout->scale_page_stride_bytes(), 128);
  EXPECT_EQ(layout->bytes_per_page(), 8704);
  EXPECT_EQ(layout->bytes_per_token(), 8704 / 16);
  EXPECT_EQ(layout->num_pages, 11);  // 100000 / 8704, rounded down
  EXPECT_EQ(layout->pool_bytes(), 11 * 8704);
  // Scales first (4 regions of 11 pages x 128 B), then the data (4 regions of 11 x 2048 B).
  EXPECT_EQ(layout->k_scale_offset(0), 0);
  EXPECT_EQ(layout->v_scale_offset(0), 11 * 128);
  EXPECT_EQ(layout->k_scale_offset(1), 2 * 11 * 128);
  EXPECT_EQ(layout->v_scale_offset(1), 3 * 11 * 128);
  EXPECT_EQ(layout->scale_area_bytes(), 4 * 11 * 128);
  EXPECT_EQ(layout->k_offset(0), 4 * 11 * 128);
  EXPECT_EQ(layout->v_offset(0), 4 * 11 * 128 + 11 * 2048);
  EXPECT_EQ(layout->v_offset(1) + 11 * 2048, layout->pool_bytes());  // the last region ends it

  // Other dtypes have no scale area: their offsets are unchanged.
  absl::StatusOr<KvLayout> bf16 = KvLayout::ForPoolBytes(2, 2, 64, 16, DType::kBf16, 100000);
  ASSERT_TRUE(bf16.ok());
  EXPECT_EQ(bf16->scale_page_stride_bytes(), 0);
  EXPECT_EQ(bf16->scale_area_bytes(), 0);
  EXPECT_EQ(bf16->k_offset(0), 0);
  EXPECT_EQ(bf16->bytes_per_token(), 2 * 2 * 2 * 64 * 2);
}

// The capacity case of the one-byte KV dtypes, the 14B-1M geometry (48 layers, 8 kv heads,
// head_dim 128): bf16 is 196,608 B a token; fp8 and int8 are 2 x 48 x 8 x (128 + 4) = 101,376 B,
// so a pool of the same bytes holds 1.94x the tokens (not 2x: the scales are 4 B per 128 codes).
TEST_P(ScaledKvLayoutTest, PoolHoldsAboutTwiceTheTokensOfBf16) {
  const int64_t pool = int64_t{130} << 30;  // about what an H200 pool gets
  absl::StatusOr<KvLayout> bf16 = KvLayout::ForPoolBytes(48, 8, 128, 16, DType::kBf16, pool);
  absl::StatusOr<KvLayout> one_byte = KvLayout::ForPoolBytes(48, 8, 128, 16, GetParam(), pool);
  ASSERT_TRUE(bf16.ok() && one_byte.ok());
  EXPECT_EQ(bf16->bytes_per_token(), 196608);
  EXPECT_EQ(one_byte->bytes_per_token(), 101376);
  const int64_t bf16_tokens = bf16->num_pages * 16, byte_tokens = one_byte->num_pages * 16;
  EXPECT_EQ(bf16_tokens, pool / (16 * 196608) * 16);  // 709,968
  EXPECT_EQ(byte_tokens, pool / (16 * 101376) * 16);  // 1,376,912
  EXPECT_EQ(bf16_tokens, 709968);
  EXPECT_EQ(byte_tokens, 1376912);
  EXPECT_NEAR(static_cast<double>(byte_tokens) / bf16_tokens, 196608.0 / 101376, 1e-4);
  // 1,010,000 tokens (one 1M-token sequence) fit in one-byte codes and do not in bf16.
  EXPECT_GE(byte_tokens, 1010000);
  EXPECT_LT(bf16_tokens, 1010000);
}

// The same walk with scales: the scale area ([layer][K, V][page][slot][head] fp32) then the data;
// every scale is 4-byte aligned even where a page's data is an odd number of bytes.
TEST_P(ScaledKvLayoutTest, OffsetsMatchAnIndependentWalkOfThePool) {
  absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(3, 3, 5, 3, GetParam(), 5000);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const int64_t pages = layout->num_pages;
  ASSERT_GT(pages, 1);
  int64_t running = 0;
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t base = kv == 0 ? layout->k_scale_offset(layer) : layout->v_scale_offset(layer);
      for (int64_t i = 0; i < pages * 3 * 3; ++i) {  // page, slot, head
        ASSERT_EQ(base + i * 4, running) << layer << " " << kv << " " << i;
        ASSERT_EQ(running % 4, 0);
        running += 4;
      }
    }
  }
  for (int32_t layer = 0; layer < 3; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t base = kv == 0 ? layout->k_offset(layer) : layout->v_offset(layer);
      for (int64_t i = 0; i < pages * 3 * 3 * 5; ++i) {  // page, slot, head, dim
        ASSERT_EQ(base + i, running) << layer << " " << kv << " " << i;
        ++running;
      }
    }
  }
  EXPECT_EQ(running, layout->pool_bytes());
  EXPECT_EQ(layout->bytes_per_page(), 2 * 3 * 3 * 3 * (5 + 4));
  EXPECT_LE(layout->pool_bytes(), 5000);
  EXPECT_GT(layout->pool_bytes() + layout->bytes_per_page(), 5000);
}

TEST_P(ScaledKvLayoutTest, PoolSmallerThanOnePageNamesTheScale) {
  absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(2, 2, 64, 16, GetParam(), 8703);
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(layout.status().message(),
            "KV pool of 8703 bytes is smaller than one page (8704 bytes: 16 tokens x 2 layers x "
            "K and V x 2 kv heads x (64 x 1 B + a 4 B scale))");
}

INSTANTIATE_TEST_SUITE_P(Fp8AndInt8, ScaledKvLayoutTest,
                         ::testing::Values(DType::kFp8E4m3, DType::kInt8),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(KvLayoutTest, RequestOnlyAndUnknownDtypesAreNotCached) {
  for (DType t : {DType::kFp16, static_cast<DType>(0), static_cast<DType>(9)}) {
    absl::StatusOr<KvLayout> layout = KvLayout::ForPoolBytes(2, 2, 64, 16, t, 1 << 20);
    ASSERT_FALSE(layout.ok());
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(layout.status().message(),
              absl::StrCat("KV layout: dtype ", DTypeName(t),
                           " cannot be cached; use fp32, bf16, fp8 or int8"));
  }
}

}  // namespace
}  // namespace attnd
