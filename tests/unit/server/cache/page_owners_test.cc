#include "server/cache/page_owners.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvcd {
namespace page_owners_test {

TEST(PageOwnersTest, ClaimCountsPagesPerTenantAndStore) {
  PageOwners owners({8, 4});
  owners.Claim(0, {0, 1, 2}, "a");
  owners.Claim(1, {3}, "a");
  owners.Claim(0, {5}, "b");
  EXPECT_EQ(owners.Held("a", 0), 3);
  EXPECT_EQ(owners.Held("a", 1), 1);
  EXPECT_EQ(owners.Held("b", 0), 1);
  EXPECT_EQ(owners.Held("b", 1), 0);
  EXPECT_EQ(owners.Held("nobody", 0), 0);
  EXPECT_EQ(owners.holders(PageRef{0, 1}), 1);
  EXPECT_EQ(owners.holders(PageRef{0, 4}), 0);
}

TEST(PageOwnersTest, ASharedPageIsFreedOnlyByItsLastHolder) {
  PageOwners owners({4});
  owners.Claim(0, {2}, "a");
  owners.Share(PageRef{0, 2});
  owners.Share(PageRef{0, 2});
  EXPECT_EQ(owners.holders(PageRef{0, 2}), 3);
  EXPECT_FALSE(owners.Release(PageRef{0, 2}));
  EXPECT_FALSE(owners.Release(PageRef{0, 2}));
  EXPECT_EQ(owners.Held("a", 0), 1);  // still owned while anyone holds it
  EXPECT_TRUE(owners.Release(PageRef{0, 2}));
  EXPECT_EQ(owners.holders(PageRef{0, 2}), 0);
  EXPECT_EQ(owners.Held("a", 0), 0);
  EXPECT_TRUE(owners.Tenants().empty());
}

TEST(PageOwnersTest, ATenantThatOwnsNothingLeavesTheListAndItsSlotIsReused) {
  PageOwners owners({4});
  owners.Claim(0, {0}, "a");
  EXPECT_TRUE(owners.Release(PageRef{0, 0}));
  owners.Claim(0, {1}, "b");
  const auto tenants = owners.Tenants();
  ASSERT_EQ(tenants.size(), 1u);
  EXPECT_EQ(tenants[0].tenant, "b");
  EXPECT_EQ(tenants[0].pages, (std::vector<int64_t>{1}));
  EXPECT_EQ(owners.Held("a", 0), 0);
}

// Random claims, shares and releases against a plain model of the same bookkeeping.
TEST(PageOwnersTest, MatchesASimpleModelUnderRandomOperations) {
  const std::vector<int32_t> sizes = {16, 9};
  PageOwners owners(sizes);
  std::vector<std::vector<int>> holders(2), owner(2);
  for (int s = 0; s < 2; ++s) {
    holders[s].assign(static_cast<size_t>(sizes[s]), 0);
    owner[s].assign(static_cast<size_t>(sizes[s]), -1);
  }
  const std::vector<std::string> names = {"t0", "t1", "t2"};
  std::mt19937 rng(7);
  for (int step = 0; step < 4000; ++step) {
    const int s = static_cast<int>(rng() % 2);
    const int p = static_cast<int>(rng() % static_cast<uint32_t>(sizes[s]));
    const PageRef ref{s, p};
    if (holders[s][p] == 0) {
      const int t = static_cast<int>(rng() % names.size());
      owners.Claim(s, {p}, names[t]);
      holders[s][p] = 1;
      owner[s][p] = t;
    } else if (rng() % 3 == 0) {
      owners.Share(ref);
      ++holders[s][p];
    } else {
      const bool last = holders[s][p] == 1;
      ASSERT_EQ(owners.Release(ref), last) << "step " << step;
      if (--holders[s][p] == 0) owner[s][p] = -1;
    }
    ASSERT_EQ(owners.holders(ref), holders[s][p]);
    for (int t = 0; t < static_cast<int>(names.size()); ++t) {
      for (int st = 0; st < 2; ++st) {
        const int64_t want = std::count(owner[st].begin(), owner[st].end(), t);
        ASSERT_EQ(owners.Held(names[t], st), want) << "step " << step;
      }
    }
  }
}

}  // namespace page_owners_test
}  // namespace kvcd
