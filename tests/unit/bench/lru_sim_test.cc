#include "bench/replay/lru_sim.h"

#include <gtest/gtest.h>

namespace kvcd::replay {
namespace lru_sim_test {

LruSim Sim(int64_t capacity, double high = 1.0, double low = 1.0) {
  return LruSim({.capacity_pages = capacity, .high_watermark = high, .low_watermark = low});
}

TEST(LruSim, MatchesTheLongestCachedPrefix) {
  LruSim s = Sim(10);
  EXPECT_EQ(s.Match({1, 2, 3}).pages, 0);
  ASSERT_TRUE(s.Put({1, 2, 3}).ok());
  EXPECT_EQ(s.Match({1, 2, 3, 4}).pages, 3);
  EXPECT_EQ(s.Match({1, 2, 9}).pages, 2);
  EXPECT_EQ(s.Match({2, 3}).pages, 0);  // 2 is only cached after 1
  ASSERT_TRUE(s.Put({1, 2, 5}).ok());   // shares 1, 2
  EXPECT_EQ(s.used_pages(), 4);
  EXPECT_EQ(s.counters().inserted_pages, 4);
  // A key names its prefix: 2 cached after 1 cannot be put after 7.
  EXPECT_EQ(s.Put({7, 2}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(s.Contains(7));
  EXPECT_EQ(s.Open({1}), 1);
  EXPECT_EQ(s.Close(/*commit=*/true, {5}).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LruSim, EvictsTheLeastRecentlyUsedPagesOneAtATime) {
  LruSim s = Sim(3);
  ASSERT_TRUE(s.Put({1, 2}).ok());
  ASSERT_TRUE(s.Put({3}).ok());
  EXPECT_EQ(s.Match({1, 2}).pages, 2);  // 1, 2 now more recent than 3
  ASSERT_TRUE(s.Put({4, 5}).ok());      // needs 2: 3, then 2 (the leaf of 1, 2)
  EXPECT_TRUE(s.Contains(1));
  EXPECT_FALSE(s.Contains(2));
  EXPECT_FALSE(s.Contains(3));
  EXPECT_TRUE(s.Contains(4) && s.Contains(5));
  EXPECT_EQ(s.counters().evicted_pages, 2);
  EXPECT_EQ(s.used_pages(), 3);
}

TEST(LruSim, EvictsOnlyLeavesDeepestFirst) {
  LruSim s = Sim(4);
  ASSERT_TRUE(s.Put({1, 2, 3}).ok());  // one stamp for the whole prefix
  ASSERT_TRUE(s.Put({4}).ok());
  ASSERT_TRUE(s.Put({5}).ok());  // needs 1: the oldest leaf is 3, never its parents
  EXPECT_TRUE(s.Contains(1) && s.Contains(2) && s.Contains(4) && s.Contains(5));
  EXPECT_FALSE(s.Contains(3));
}

TEST(LruSim, OpenSequencesPinTheirPrefixAndHoldTheirOwnPages) {
  LruSim s = Sim(5);
  ASSERT_TRUE(s.Put({1, 2}).ok());
  ASSERT_TRUE(s.Put({3}).ok());
  ASSERT_TRUE(s.Put({4}).ok());
  EXPECT_EQ(s.Open({1, 2, 7}), 2);  // pins 1, 2 (the oldest)
  ASSERT_TRUE(s.Append(2).ok());    // 1 free, then 3 goes (4 is newer)
  EXPECT_TRUE(s.Contains(1) && s.Contains(2) && s.Contains(4));
  EXPECT_FALSE(s.Contains(3));
  EXPECT_EQ(s.used_pages(), 5);
  EXPECT_EQ(s.Append(3).code(), absl::StatusCode::kResourceExhausted);  // only 4 is evictable
  EXPECT_EQ(s.used_pages(), 5);  // the refused call changed nothing
  ASSERT_TRUE(s.Close(/*commit=*/false, {}).ok());
  EXPECT_EQ(s.used_pages(), 3);
  EXPECT_EQ(s.Match({1, 2}).pages, 2);
}

TEST(LruSim, PutThatCannotFitChangesNothing) {
  LruSim s = Sim(2);
  ASSERT_TRUE(s.Put({1}).ok());
  EXPECT_EQ(s.Put({1, 2, 3}).code(), absl::StatusCode::kResourceExhausted);  // 1 is pinned
  EXPECT_TRUE(s.Contains(1));
  EXPECT_EQ(s.counters().evicted_pages, 0);
}

TEST(LruSim, CommitInsertsTheSequencesFullPagesAndDeduplicates) {
  LruSim s = Sim(10);
  ASSERT_TRUE(s.Put({1}).ok());
  EXPECT_EQ(s.Open({1}), 1);
  ASSERT_TRUE(s.Append(2).ok());  // one full page (7) and a partial one
  ASSERT_TRUE(s.Close(/*commit=*/true, {7}).ok());
  EXPECT_EQ(s.used_pages(), 2);
  EXPECT_EQ(s.counters().committed_pages, 1);
  const LruSim::MatchResult m = s.Match({1, 7, 8});
  EXPECT_EQ(m.pages, 2);
  EXPECT_EQ(m.committed_pages, 1);
  EXPECT_EQ(s.Open({1}), 1);
  ASSERT_TRUE(s.Append(1).ok());
  ASSERT_TRUE(s.Close(/*commit=*/true, {7}).ok());  // already cached: the sequence's copy is freed
  EXPECT_EQ(s.counters().deduplicated_pages, 1);
  EXPECT_EQ(s.used_pages(), 2);
}

TEST(LruSim, WatermarksEvictDownToTheLowMarkAfterAPut) {
  LruSim s = Sim(10, 0.9, 0.5);
  ASSERT_TRUE(s.Put({1, 2, 3, 4, 5, 6, 7, 8, 9}).ok());  // 9 pages: not above 0.9 * 10
  EXPECT_EQ(s.counters().evicted_pages, 0);
  ASSERT_TRUE(s.Put({20}).ok());  // 10 > 9: down to 5, the new page kept
  EXPECT_EQ(s.used_pages(), 5);
  EXPECT_TRUE(s.Contains(20));
  for (int64_t k : {1, 2, 3, 4}) EXPECT_TRUE(s.Contains(k));
  for (int64_t k : {5, 6, 7, 8, 9}) EXPECT_FALSE(s.Contains(k));
}

TEST(LruSim, WithoutCapacityItNeverEvicts) {
  LruSim s({});
  for (int64_t k = 0; k < 1000; ++k) ASSERT_TRUE(s.Put({k}).ok());
  EXPECT_EQ(s.used_pages(), 1000);
  EXPECT_EQ(s.counters().evicted_pages, 0);
}

}  // namespace lru_sim_test
}  // namespace kvcd::replay
