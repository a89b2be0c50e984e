#include <gtest/gtest.h>

#include "absl/container/flat_hash_set.h"
#include "bench/replay/block_tokens.h"
#include "bench/replay/workload.h"

namespace kvcd::replay {
namespace replay_workload_test {

TraceRequest Req(int64_t in, int64_t out, std::vector<int64_t> ids) {
  TraceRequest r;
  r.input_length = in;
  r.output_length = out;
  r.hash_ids = std::move(ids);
  return r;
}

std::vector<int32_t> Page(int64_t key, int32_t n = 16) { return PageTokens(key, n); }

TEST(ReplayBlockTokens, TokensDependOnlyOnTheKey) {
  EXPECT_EQ(PageTokens(42, 16), PageTokens(42, 16));
  EXPECT_NE(PageTokens(42, 16), PageTokens(43, 16));
  // A shorter page is the start of the full one.
  const auto full = PageTokens(7, 16), part = PageTokens(7, 5);
  EXPECT_EQ(part, std::vector<int32_t>(full.begin(), full.begin() + 5));
  for (int64_t key : {int64_t{0}, int64_t{1} << 52, UniqueKey(3, 0)}) {
    for (int32_t t : PageTokens(key, 64)) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, kReplayVocab);
    }
  }
  // No two pages of many keys share their tokens (the radix tree tells pages apart by them).
  absl::flat_hash_set<std::vector<int32_t>> seen;
  for (int64_t key = 0; key < 20000; ++key) EXPECT_TRUE(seen.insert(PageTokens(key, 16)).second);
  for (int64_t i = 0; i < 100; ++i)
    EXPECT_TRUE(seen.insert(PageTokens(UniqueKey(i, 1), 16)).second);
}

TEST(ReplayBlockTokens, UniqueKeysAreNegativeAndDistinct) {
  absl::flat_hash_set<int64_t> keys;
  for (int64_t r : {int64_t{0}, int64_t{1}, (int64_t{1} << 36) - 1}) {
    for (int64_t p : {int64_t{0}, int64_t{1}, (int64_t{1} << 26) - 1}) {
      const int64_t k = UniqueKey(r, p);
      EXPECT_LT(k, 0);
      EXPECT_TRUE(keys.insert(k).second) << r << " " << p;
    }
  }
}

TEST(ReplayBlockTokens, ScaledTokensRoundUp) {
  EXPECT_EQ(ScaledTokens(512, 16), 16);
  EXPECT_EQ(ScaledTokens(0, 16), 0);
  EXPECT_EQ(ScaledTokens(1, 16), 1);
  EXPECT_EQ(ScaledTokens(33, 16), 2);
  EXPECT_EQ(ScaledTokens(69, 16), 3);
  EXPECT_EQ(ScaledTokens(100, 512), 100);
}

TEST(ReplayWorkload, PromptIsFullPagesThenTheScaledTail) {
  // 2 full blocks and 100 tokens (4 scaled); output 40 (2 scaled); nothing continues it.
  auto w = TraceWorkload::Create({Req(1124, 40, {10, 11, 12})}, 16);
  ASSERT_TRUE(w.ok()) << w.status();
  const ReplayRequest& r = w->request(0);
  EXPECT_EQ(r.prompt_pages, (std::vector<int64_t>{10, 11}));
  ASSERT_EQ(r.prompt.size(), 2u * 16 + 4);
  EXPECT_EQ(std::vector<int32_t>(r.prompt.begin(), r.prompt.begin() + 16), Page(10));
  EXPECT_EQ(std::vector<int32_t>(r.prompt.begin() + 16, r.prompt.begin() + 32), Page(11));
  // The tail and the output are the request's own continuation.
  EXPECT_EQ(std::vector<int32_t>(r.prompt.begin() + 32, r.prompt.end()), Page(UniqueKey(0, 0), 4));
  EXPECT_EQ(r.output_tokens, 2);
  EXPECT_EQ(r.append, Page(UniqueKey(0, 0), 6));
  EXPECT_TRUE(r.commit_pages.empty());  // 6 tokens past the full pages: no full page
  EXPECT_EQ(r.continued_by, -1);
  EXPECT_EQ(w->summary().prompt_tokens, 1124);
  EXPECT_EQ(w->summary().full_blocks, 2);
}

TEST(ReplayWorkload, OutputIsTheContinuingRequestsBlocks) {
  // Request 0: blocks 1, 2 and a 480-token tail (15 scaled), output 64 (2 scaled): its
  // sequence runs 17 tokens past its full pages, one full page. Request 1 only shares block 1;
  // request 2 is too short (shorter than 0's prompt + output); request 3 continues it.
  auto w = TraceWorkload::Create({Req(1504, 64, {1, 2, 3}), Req(1024, 1, {1, 9}),
                                  Req(1536, 1, {1, 2, 4}), Req(2048, 7, {1, 2, 5, 6})},
                                 16);
  ASSERT_TRUE(w.ok()) << w.status();
  const ReplayRequest& r = w->request(0);
  EXPECT_EQ(r.continued_by, 3);
  EXPECT_EQ(r.commit_pages, (std::vector<int64_t>{5}));
  std::vector<int32_t> want = Page(5);
  want.push_back(PageToken(6, 0));
  EXPECT_EQ(r.append, want);
  EXPECT_EQ(std::vector<int32_t>(r.prompt.begin() + 32, r.prompt.end()), Page(5, 15));
  // Request 3's prompt holds that committed page where request 0's sequence had it.
  const ReplayRequest& c = w->request(3);
  EXPECT_EQ(std::vector<int32_t>(c.prompt.begin() + 32, c.prompt.begin() + 48), Page(5));
  EXPECT_EQ(w->summary().continued, 1);
  EXPECT_EQ(w->summary().commit_pages_continued, 1);
}

TEST(ReplayWorkload, ContinuationPastTheNextPromptsFullBlocksIsUnique) {
  // Request 0 (one full block, no tail) writes 600 output tokens (19 scaled); request 1
  // continues it but has only 2 full blocks: page 1 of the continuation is request 0's own.
  auto w = TraceWorkload::Create({Req(512, 600, {1}), Req(1400, 1, {1, 2, 3})}, 16);
  ASSERT_TRUE(w.ok()) << w.status();
  const ReplayRequest& r = w->request(0);
  EXPECT_EQ(r.continued_by, 1);
  EXPECT_EQ(r.commit_pages, (std::vector<int64_t>{2}));
  ASSERT_EQ(r.append.size(), 19u);
  EXPECT_EQ(r.append[16], PageToken(UniqueKey(0, 1), 0));
}

TEST(ReplayWorkload, RefusesABadPageSize) {
  EXPECT_FALSE(TraceWorkload::Create({}, 0).ok());
  EXPECT_FALSE(TraceWorkload::Create({}, 513).ok());
}

}  // namespace replay_workload_test
}  // namespace kvcd::replay
