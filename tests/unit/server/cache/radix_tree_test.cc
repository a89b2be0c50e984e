#include "server/cache/radix_tree.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace kvcd {
namespace radix_tree_test {

std::vector<int32_t> Seq(int32_t begin, int32_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), begin);
  return v;
}

std::vector<PageRef> Pages(int32_t first_id, int32_t n) {
  std::vector<PageRef> p;
  for (int32_t i = 0; i < n; ++i) p.push_back(PageRef{0, first_id + i});
  return p;
}

TEST(RadixTreeTest, InsertAndMatchArePageAligned) {
  RadixTree tree(4);
  const auto tokens = Seq(0, 12);
  auto ins = tree.Insert("", tokens, Pages(100, 3));
  EXPECT_EQ(ins.new_pages, 3);
  EXPECT_TRUE(ins.duplicates.empty());
  EXPECT_EQ(tree.cached_pages(), 3);

  auto m = tree.Match("", Seq(0, 11));  // 2 full pages + a partial one
  EXPECT_EQ(m.tokens, 8);
  ASSERT_EQ(m.pages.size(), 2u);
  EXPECT_EQ(m.pages[0].page, 100);
  EXPECT_EQ(m.pages[1].page, 101);

  auto none = tree.Match("", Seq(1, 12));
  EXPECT_EQ(none.tokens, 0);
  EXPECT_EQ(tree.Match("", Seq(0, 3)).tokens, 0);  // shorter than a page
}

TEST(RadixTreeTest, DivergingInsertSplitsTheEdge) {
  RadixTree tree(2);
  tree.Insert("", Seq(0, 8), Pages(0, 4));  // [0..7]
  auto b = Seq(0, 8);
  b[5] = 99;  // diverges in the third page
  auto ins = tree.Insert("", b, Pages(10, 4));
  EXPECT_EQ(ins.new_pages, 2);
  ASSERT_EQ(ins.duplicates.size(), 2u);  // the caller's copies of the shared 2 pages
  EXPECT_EQ(ins.duplicates[0].page, 10);
  EXPECT_EQ(ins.duplicates[1].page, 11);
  EXPECT_EQ(tree.cached_pages(), 6);
  auto m = tree.Match("", b);
  EXPECT_EQ(m.tokens, 8);
  ASSERT_EQ(m.pages.size(), 4u);
  EXPECT_EQ(m.pages[0].page, 0);  // shared prefix pages come from the first insert
  EXPECT_EQ(m.pages[2].page, 12);
  EXPECT_EQ(tree.Match("", Seq(0, 8)).pages[3].page, 3);
}

TEST(RadixTreeTest, ReinsertIsIdempotent) {
  RadixTree tree(4);
  tree.Insert("", Seq(0, 8), Pages(0, 2));
  auto again = tree.Insert("", Seq(0, 8), Pages(0, 2));
  EXPECT_EQ(again.new_pages, 0);
  EXPECT_EQ(tree.cached_pages(), 2);
  auto longer = tree.Insert("", Seq(0, 12), Pages(5, 3));
  EXPECT_EQ(longer.new_pages, 1);
  EXPECT_EQ(tree.Match("", Seq(0, 12)).pages[2].page, 7);
}

TEST(RadixTreeTest, TenantsNeverMatchEachOther) {
  RadixTree tree(4);
  tree.Insert("tenant-a", Seq(0, 8), Pages(0, 2));
  EXPECT_EQ(tree.Match("tenant-a", Seq(0, 8)).tokens, 8);
  EXPECT_EQ(tree.Match("tenant-b", Seq(0, 8)).tokens, 0);
  EXPECT_EQ(tree.Match("", Seq(0, 8)).tokens, 0);
  tree.Insert("tenant-b", Seq(0, 8), Pages(2, 2));
  EXPECT_EQ(tree.Match("tenant-b", Seq(0, 8)).pages[0].page, 2);
  EXPECT_EQ(tree.Match("tenant-a", Seq(0, 8)).pages[0].page, 0);
}

TEST(RadixTreeTest, PinnedPathsSurviveEvictionAndLruLeavesGoFirst) {
  RadixTree tree(2);
  tree.Insert("", Seq(0, 4), Pages(0, 2));       // A: [0..3]
  tree.Insert("", Seq(100, 4), Pages(10, 2));    // B
  tree.Insert("", Seq(200, 4), Pages(20, 2));    // C
  tree.Match("", Seq(0, 4));                     // A is now the most recently used
  auto pin = tree.MatchAndPin("", Seq(100, 4));  // pin B (also the newest)
  ASSERT_NE(pin.node, nullptr);
  EXPECT_EQ(tree.PinnedPages(), 2);

  std::vector<PageRef> freed;
  int64_t n =
      tree.Evict([&] { return freed.size() < 2; }, [&](const PageRef& p) { freed.push_back(p); });
  EXPECT_EQ(n, 2);
  ASSERT_EQ(freed.size(), 2u);
  EXPECT_EQ(freed[0].page, 20);  // C was the least recently used unpinned leaf
  EXPECT_EQ(tree.Match("", Seq(200, 4)).tokens, 0);

  // Evict everything evictable: A goes, pinned B stays.
  tree.Evict([] { return true; }, [&](const PageRef& p) { freed.push_back(p); });
  EXPECT_EQ(tree.Match("", Seq(0, 4)).tokens, 0);
  EXPECT_EQ(tree.Match("", Seq(100, 4)).tokens, 4);
  tree.Unpin(pin.node);
  EXPECT_EQ(tree.PinnedPages(), 0);
  tree.Evict([] { return true; }, [&](const PageRef& p) { freed.push_back(p); });
  EXPECT_EQ(tree.cached_pages(), 0);
  EXPECT_EQ(freed.size(), 6u);
}

TEST(RadixTreeTest, PinInsideAnEdgeSplitsAndProtectsOnlyThePrefix) {
  RadixTree tree(2);
  tree.Insert("", Seq(0, 8), Pages(0, 4));
  auto pin = tree.MatchAndPin("", Seq(0, 4));  // the first half of the edge
  EXPECT_EQ(pin.tokens, 4);
  EXPECT_EQ(tree.PinnedPages(), 2);
  std::vector<PageRef> freed;
  tree.Evict([] { return true; }, [&](const PageRef& p) { freed.push_back(p); });
  ASSERT_EQ(freed.size(), 2u);  // the unpinned tail [4..7]
  EXPECT_EQ(freed[0].page, 2);
  EXPECT_EQ(tree.Match("", Seq(0, 8)).tokens, 4);
  tree.Unpin(pin.node);
}

TEST(RadixTreeTest, EvictionLimitedToOneNamespaceLeavesTheOthers) {
  RadixTree tree(4);
  tree.Insert("a", Seq(0, 8), Pages(0, 2));     // oldest
  tree.Insert("b", Seq(0, 12), Pages(10, 3));   // b's pages, more recent than a's
  tree.Insert("b", Seq(100, 4), Pages(20, 1));  // newest
  const std::string b = "b";
  EXPECT_EQ(tree.EvictablePages(0), 6);
  EXPECT_EQ(tree.EvictablePages(0, &b), 4);
  EXPECT_EQ(tree.EvictablePages(1, &b), 0);  // another pool
  std::vector<int32_t> freed;
  const int64_t n = tree.Evict([&] { return freed.size() < 3; },
                               [&](const PageRef& r) { freed.push_back(r.page); }, &b);
  EXPECT_EQ(n, 3);  // b's least recently used leaf, though a's pages are older
  EXPECT_EQ(freed, (std::vector<int32_t>{10, 11, 12}));
  EXPECT_EQ(tree.Match("a", Seq(0, 8)).tokens, 8);
  EXPECT_EQ(tree.Match("b", Seq(100, 4)).tokens, 4);
  // Asking for more than the namespace holds stops at its last page.
  freed.clear();
  tree.Evict([] { return true; }, [&](const PageRef& r) { freed.push_back(r.page); }, &b);
  EXPECT_EQ(freed, (std::vector<int32_t>{20}));
  EXPECT_EQ(tree.EvictablePages(0, &b), 0);
  EXPECT_EQ(tree.Match("a", Seq(0, 8)).tokens, 8);
  EXPECT_EQ(tree.cached_pages(), 2);
}

TEST(RadixTreeTest, EvictingAChildExposesItsParentAsALeaf) {
  RadixTree tree(1);
  tree.Insert("", Seq(0, 3), Pages(0, 3));
  auto b = Seq(0, 3);
  b[2] = 50;
  tree.Insert("", b, Pages(3, 3));  // splits into [0,1] -> {[2], [50]}
  EXPECT_EQ(tree.num_nodes(), 3);
  std::vector<PageRef> freed;
  tree.Evict([] { return true; }, [&](const PageRef& p) { freed.push_back(p); });
  EXPECT_EQ(freed.size(), 4u);  // 2 leaves of 1 page + the parent of 2 pages
  EXPECT_EQ(tree.cached_pages(), 0);
  EXPECT_EQ(tree.num_nodes(), 0);
}

// Origins: a node keeps the origin it entered with (a split keeps it on both halves), Match
// counts committed tokens, eviction keeps committed_pages() right.
TEST(RadixTreeTest, OriginsAreKeptThroughSplitsAndCountedByMatchAndEviction) {
  RadixTree tree(2);
  tree.Insert("t", Seq(0, 4), Pages(0, 2));  // put [0..3]
  auto ins = tree.Insert("t", Seq(0, 10), Pages(10, 5), RadixTree::Origin::kCommit);
  EXPECT_EQ(ins.new_pages, 3);  // [4..9] committed
  EXPECT_EQ(ins.duplicates.size(), 2u);
  EXPECT_EQ(tree.committed_pages(), 3);
  auto m = tree.Match("t", Seq(0, 10));
  EXPECT_EQ(m.tokens, 10);
  EXPECT_EQ(m.committed_tokens, 6);
  // A put of the committed tokens does not change their origin; a split keeps it.
  tree.Insert("t", Seq(0, 6), Pages(20, 3));
  auto pinned = tree.MatchAndPin("t", Seq(0, 8));  // splits [4..9] at 8
  EXPECT_EQ(pinned.committed_tokens, 4);
  EXPECT_EQ(tree.committed_pages(), 3);
  EXPECT_EQ(tree.Match("t", Seq(0, 10)).committed_tokens, 6);
  // A second pin of the same node (a fork) keeps it until both are released.
  tree.Pin(pinned.node);
  tree.Unpin(pinned.node);
  std::vector<PageRef> freed;
  tree.Evict([] { return true; }, [&](const PageRef& p) { freed.push_back(p); });
  EXPECT_EQ(freed.size(), 1u);  // only the unpinned committed leaf [8..9]
  EXPECT_EQ(tree.committed_pages(), 2);
  tree.Unpin(pinned.node);
  tree.Evict([] { return true; }, [&](const PageRef& p) { freed.push_back(p); });
  EXPECT_EQ(tree.committed_pages(), 0);
  EXPECT_EQ(tree.cached_pages(), 0);
}

TEST(RadixTreeTest, EvictablePagesCountsOnlyThePagesEvictionFrees) {
  RadixTree tree(1);
  tree.Insert("", Seq(0, 4), Pages(0, 4));
  EXPECT_EQ(tree.EvictablePages(0), 4);
  EXPECT_EQ(tree.EvictablePages(0, nullptr, [](const PageRef& r) { return r.page % 2 == 0; }), 2);
}

}  // namespace radix_tree_test
}  // namespace kvcd

namespace kvcd {
namespace radix_tree_test {

// What a listener heard: (ns, path, first_page, entered) per call.
struct Heard final : RadixTree::Listener {
  struct Call {
    std::string ns;
    std::vector<int32_t> path;
    int64_t first_page;
    bool entered;
  };
  std::vector<Call> calls;
  void PagesChanged(const std::string& ns, absl::Span<const int32_t> path, int64_t first_page,
                    bool entered) override {
    calls.push_back({ns, std::vector<int32_t>(path.begin(), path.end()), first_page, entered});
  }
};

TEST(RadixTreeTest, ListenerHearsPagesEnterAndLeaveWithTheirPath) {
  RadixTree tree(4);
  Heard heard;
  tree.set_listener(&heard);
  tree.Insert("t", Seq(0, 12), Pages(100, 3));
  ASSERT_EQ(heard.calls.size(), 1u);
  EXPECT_EQ(heard.calls[0].ns, "t");
  EXPECT_EQ(heard.calls[0].path, Seq(0, 12));
  EXPECT_EQ(heard.calls[0].first_page, 0);
  EXPECT_TRUE(heard.calls[0].entered);

  // A longer prompt sharing 2 pages: only its new pages are told, with the whole path.
  std::vector<int32_t> branch = Seq(0, 8);
  for (int32_t t : Seq(50, 8)) branch.push_back(t);
  const auto ins = tree.Insert("t", branch, Pages(200, 4));
  EXPECT_EQ(ins.new_pages, 2);
  ASSERT_EQ(heard.calls.size(), 2u);
  EXPECT_EQ(heard.calls[1].path, branch);
  EXPECT_EQ(heard.calls[1].first_page, 2);
  // Inserting what is there tells nothing.
  tree.Insert("t", Seq(0, 12), Pages(300, 3));
  EXPECT_EQ(heard.calls.size(), 2u);

  // Replay: every node, parents first, each with its whole path.
  Heard replay;
  tree.ReplayTo(&replay);
  int64_t pages = 0;
  for (const auto& c : replay.calls) {
    EXPECT_TRUE(c.entered);
    pages += static_cast<int64_t>(c.path.size()) / 4 - c.first_page;
  }
  EXPECT_EQ(pages, tree.cached_pages());
  ASSERT_FALSE(replay.calls.empty());
  EXPECT_EQ(replay.calls[0].first_page, 0);

  // Evict everything: each leaf leaves with its path from the root.
  int64_t freed_told = 0;
  tree.Evict([] { return true; }, [](const PageRef&) {});
  for (size_t i = 2; i < heard.calls.size(); ++i) {
    const auto& c = heard.calls[i];
    EXPECT_FALSE(c.entered);
    EXPECT_EQ(c.ns, "t");
    EXPECT_EQ(c.path.size() % 4, 0u);
    freed_told += static_cast<int64_t>(c.path.size()) / 4 - c.first_page;
  }
  EXPECT_EQ(freed_told, pages);
  EXPECT_EQ(tree.cached_pages(), 0);
}

}  // namespace radix_tree_test
}  // namespace kvcd
