#include "server/formats/page_pool.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

namespace kvcd {
namespace page_pool_test {

TEST(PagePoolTest, AllocationIsAllOrNothingAndIdsAreUnique) {
  std::vector<uint8_t> mem(3 * 5 * 32);
  PagePool pool("bf16", mem.data(), 3, 32, 5);
  EXPECT_EQ(pool.page_bytes(), 96);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.Allocate(3, &a));
  EXPECT_EQ(pool.used_pages(), 3);
  std::vector<int32_t> b;
  EXPECT_FALSE(pool.Allocate(3, &b));  // only 2 left: nothing allocated
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(pool.free_pages(), 2);
  ASSERT_TRUE(pool.Allocate(2, &b));
  std::set<int32_t> ids(a.begin(), a.end());
  ids.insert(b.begin(), b.end());
  EXPECT_EQ(ids.size(), 5u);
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 5);
  }
  pool.Free(a);
  EXPECT_EQ(pool.free_pages(), 3);
}

TEST(PagePoolTest, LayersAreContiguousPerLayer) {
  std::vector<uint8_t> mem(2 * 4 * 16);
  PagePool pool("bf16", mem.data(), 2, 16, 4);
  EXPECT_EQ(pool.LayerBase(0), mem.data());
  EXPECT_EQ(pool.LayerBase(1), mem.data() + 4 * 16);
  EXPECT_EQ(pool.PagePtr(1, 3), mem.data() + 4 * 16 + 3 * 16);
}

}  // namespace page_pool_test
}  // namespace kvcd
