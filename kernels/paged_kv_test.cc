// PageIndexer and PagedKv::Offset against plain division, for power-of-two and other page sizes.
#include "kernels/paged_kv.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(PageIndexerTest, MatchesDivisionForEveryPageSize) {
  for (int32_t ps : {1, 2, 3, 7, 16, 17, 64, 100, 256, 4096}) {
    const PageIndexer pages(ps);
    EXPECT_EQ(pages.pow2, (ps & (ps - 1)) == 0) << ps;
    for (uint32_t pos : {0u, 1u, 15u, 16u, 17u, 255u, 256u, 1000003u, 2147483647u}) {
      EXPECT_EQ(pages.Page(pos), pos / static_cast<uint32_t>(ps)) << ps << " " << pos;
      EXPECT_EQ(pages.Slot(pos), pos % static_cast<uint32_t>(ps)) << ps << " " << pos;
    }
  }
}

TEST(PagedKvTest, OffsetFollowsThePageTable) {
  const std::vector<int32_t> table = {5, 2, 9};
  PagedKv<float> kv;
  kv.page_table = table.data();
  kv.page_size = 4;
  kv.num_kv_heads = 3;
  kv.head_dim = 8;
  // Token 6 is slot 2 of the sequence's page 1, pool page 2.
  EXPECT_EQ(kv.Offset(6, 1), ((2 * 4 + 2) * 3 + 1) * 8);
  EXPECT_EQ(kv.Offset(0, 0), (5 * 4 * 3) * 8);
  EXPECT_EQ(kv.Offset(11, 2), ((9 * 4 + 3) * 3 + 2) * 8);
  for (int32_t pos = 0; pos < 12; ++pos) {
    for (int32_t h = 0; h < 3; ++h) EXPECT_EQ(kv.Offset32(pos, h), kv.Offset(pos, h)) << pos;
  }
}

TEST(PagedKvTest, ScalesFollowThePageTableOnePerTokenAndHead) {
  const std::vector<int32_t> table = {5, 2, 9};
  std::vector<float> k_scale(10 * 4 * 3), v_scale(k_scale.size());
  PagedKv<uint8_t> kv;
  kv.page_table = table.data();
  kv.page_size = 4;
  kv.num_kv_heads = 3;
  kv.head_dim = 8;
  kv.k_scale = k_scale.data();
  kv.v_scale = v_scale.data();
  // Token 6 is slot 2 of the sequence's page 1, pool page 2: scale index (2 * 4 + 2) * 3 + h.
  EXPECT_EQ(kv.ScaleOffset(6, 1), (2 * 4 + 2) * 3 + 1);
  EXPECT_EQ(kv.KeyScale(6, 1), k_scale.data() + (2 * 4 + 2) * 3 + 1);
  EXPECT_EQ(kv.ValueScale(11, 2), v_scale.data() + (9 * 4 + 3) * 3 + 2);
  for (int32_t pos = 0; pos < 12; ++pos) {
    for (int32_t h = 0; h < 3; ++h) {
      EXPECT_EQ(kv.ScaleOffset(pos, h) * kv.head_dim, kv.Offset(pos, h)) << pos << " " << h;
    }
  }
}

}  // namespace
}  // namespace attnd
