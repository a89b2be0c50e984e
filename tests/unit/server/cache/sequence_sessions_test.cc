// ModelCache::Commit and ModelCache::Fork on the CPU backend (docs/sessions.md): a commit
// puts the full pages into the tree (shared pages stay, duplicates are deduplicated, the
// partial page stays private), the tree keeps every position in StoreForPage's store, page
// origins are counted, and a fork shares its source's pages by reference count (freed
// exactly once) and attends exactly as its source until they diverge.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvcd/kernels/bf16.h"
#include "server/cache/model_cache.h"
#include "test_util.h"

namespace kvcd {
namespace sequence_sessions_test {

using testing_util::TinyInt2Spec;
using testing_util::TinySpec;

struct Fixture {
  explicit Fixture(const ModelSpec& spec) : backend(MakeCpuBackend(2)) {
    auto c = ModelCache::Create(spec, backend.get(), 0.95, 0.85, &counters);
    EXPECT_TRUE(c.ok()) << c.status();
    cache = std::move(*c);
  }
  int32_t Used(size_t pool) const {  // 0 for a pool the model does not have
    const ModelSnapshot snap = cache->Snapshot();
    return pool < snap.pools.size() ? snap.pools[pool].pages_used : 0;
  }
  std::unique_ptr<Backend> backend;
  CacheCounters counters;
  std::unique_ptr<ModelCache> cache;
};

std::vector<uint16_t> RandomKv(const ModelSpec& s, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> out(static_cast<size_t>(s.num_layers * n * s.num_kv_heads * s.head_dim));
  for (auto& x : out) x = kernels::FloatToBf16(normal(rng));
  return out;
}

RowSource Rows(const ModelSpec& s, const std::vector<uint16_t>& kv, int64_t n) {
  RowSource r;
  r.data = kv.data();
  r.is_bf16 = true;
  r.token_stride = int64_t{s.num_kv_heads} * s.head_dim;
  r.layer_stride = n * r.token_stride;
  return r;
}

std::vector<int32_t> Tokens(int64_t n, int32_t first = 1) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + static_cast<int32_t>(i);
  return t;
}

// A sequence of `n` tokens appended in one call (K/V from seed).
std::shared_ptr<Sequence> Appended(ModelCache& cache, uint64_t id, const std::string& salt,
                                   int64_t n, uint32_t seed) {
  const ModelSpec& s = cache.spec();
  auto seq = cache.Open(id, salt, {});
  const auto k = RandomKv(s, n, seed), v = RandomKv(s, n, seed + 1);
  EXPECT_TRUE(cache.Append(seq.get(), Tokens(n), Rows(s, k, n), Rows(s, v, n)).ok());
  return seq;
}

std::vector<ModelCache::StoredPageCopy> Stored(ModelCache& cache, Sequence* seq, int64_t n) {
  std::vector<ModelCache::StoredPageCopy> pages;
  EXPECT_TRUE(cache.FetchStored(seq, 0, n, &pages).ok());
  return pages;
}

TEST(SequenceSessionsTest, CommitInsertsTheFullPagesAndKeepsThePartialOnePrivate) {
  const ModelSpec s = TinySpec();
  Fixture f(s);
  const int64_t n = 3 * s.page_size + 2;
  auto seq = Appended(*f.cache, 1, "t", n, 1);
  EXPECT_EQ(f.Used(0), 4);
  auto r = f.cache->Commit(seq.get());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->committed_tokens, 3 * s.page_size);
  EXPECT_EQ(r->inserted_pages, 3);
  EXPECT_EQ(r->deduplicated_pages, 0);
  EXPECT_EQ(r->length, n);
  EXPECT_EQ(f.Used(0), 4);  // BF16 history: the pages moved to the tree, no copy
  int64_t committed = 0;
  EXPECT_EQ(f.cache->Match("t", Tokens(n + 5), &committed), 3 * s.page_size);
  EXPECT_EQ(committed, 3 * s.page_size);
  EXPECT_EQ(f.cache->Match("other", Tokens(n)), 0);  // under its tenant only
  EXPECT_EQ(f.cache->Snapshot().committed_pages, 3);
  // The committed prefix is pinned by the sequence: a second commit changes nothing, and
  // the sequence keeps decoding on it.
  r = f.cache->Commit(seq.get());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->inserted_pages, 0);
  EXPECT_EQ(r->deduplicated_pages, 0);
  EXPECT_EQ(f.cache->Snapshot().pinned_pages, 3);
  const auto k = RandomKv(s, 3, 5), v = RandomKv(s, 3, 6);
  ASSERT_TRUE(f.cache->Append(seq.get(), Tokens(3, 100), Rows(s, k, 3), Rows(s, v, 3)).ok());
  f.cache->Close(seq.get());
  // Closing frees the private pages only (the partial page and the one appended after).
  EXPECT_EQ(f.Used(0), 3);
  EXPECT_EQ(f.cache->Snapshot().pinned_pages, 0);
  EXPECT_EQ(f.cache->Snapshot().cached_tokens, 3 * s.page_size);
  // A closed sequence cannot be committed.
  EXPECT_EQ(f.cache->Commit(seq.get()).status().code(), absl::StatusCode::kNotFound);
}

TEST(SequenceSessionsTest, CommitOfTokensTheTreeHoldsDeduplicatesAndUsesTheTreesPages) {
  const ModelSpec s = TinySpec();
  Fixture f(s);
  const int64_t n = 2 * s.page_size + 1;
  auto a = Appended(*f.cache, 1, "t", n, 1);
  auto b = Appended(*f.cache, 2, "t", n, 7);  // same tokens, other K/V
  ASSERT_TRUE(f.cache->Commit(a.get()).ok());
  EXPECT_EQ(f.Used(0), 6);
  auto r = f.cache->Commit(b.get());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->inserted_pages, 0);
  EXPECT_EQ(r->deduplicated_pages, 2);
  EXPECT_EQ(f.Used(0), 4);  // b's two full pages were freed
  // b switched to the tree's pages (a's bytes) and kept its partial page.
  const auto pa = Stored(*f.cache, a.get(), n), pb = Stored(*f.cache, b.get(), n);
  ASSERT_EQ(pa.size(), 3u);
  EXPECT_EQ(pa[0].data, pb[0].data);
  EXPECT_EQ(pa[1].data, pb[1].data);
  EXPECT_NE(pa[2].data, pb[2].data);
  f.cache->Close(a.get());
  f.cache->Close(b.get());
  EXPECT_EQ(f.Used(0), 2);  // the tree's two pages
  // A sequence opened on Put pages and committing further: its opened pages stay shared.
  const auto k = RandomKv(s, 8, 3), v = RandomKv(s, 8, 4);
  ASSERT_TRUE(f.cache->Put("u", Tokens(8), 0, Rows(s, k, 8), Rows(s, v, 8)).ok());
  auto c = f.cache->Open(3, "u", Tokens(8));
  const auto k2 = RandomKv(s, 4, 5), v2 = RandomKv(s, 4, 6);
  ASSERT_TRUE(f.cache->Append(c.get(), Tokens(4, 9), Rows(s, k2, 4), Rows(s, v2, 4)).ok());
  r = f.cache->Commit(c.get(), /*close=*/true);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->committed_tokens, 12);
  EXPECT_EQ(r->inserted_pages, 1);
  EXPECT_EQ(r->deduplicated_pages, 0);
  int64_t committed = 0;
  EXPECT_EQ(f.cache->Match("u", Tokens(12), &committed), 12);
  EXPECT_EQ(committed, 4);  // only the appended page entered by the commit
  EXPECT_EQ(f.Used(0), 5);
  EXPECT_EQ(f.cache->Snapshot().active_sequences, 0);
}

TEST(SequenceSessionsTest, OriginsAreCountedForHitsAndEvictions) {
  const ModelSpec s = TinySpec();
  Fixture f(s);
  const auto k = RandomKv(s, 8, 3), v = RandomKv(s, 8, 4);
  ASSERT_TRUE(f.cache->Put("t", Tokens(8), 0, Rows(s, k, 8), Rows(s, v, 8)).ok());
  auto a = f.cache->Open(1, "t", Tokens(8));
  const auto k2 = RandomKv(s, 12, 5), v2 = RandomKv(s, 12, 6);
  ASSERT_TRUE(f.cache->Append(a.get(), Tokens(12, 9), Rows(s, k2, 12), Rows(s, v2, 12)).ok());
  ASSERT_TRUE(f.cache->Commit(a.get(), /*close=*/true).ok());
  const uint64_t hits = f.counters.hit_tokens.load();
  auto b = f.cache->Open(2, "t", Tokens(22));
  EXPECT_EQ(f.cache->Length(b.get()), 20);
  EXPECT_EQ(f.counters.hit_tokens.load() - hits, 20u);
  EXPECT_EQ(f.counters.hit_tokens_committed.load(), 12u);
  f.cache->Close(b.get());
  // Fill the pool with another tenant's Puts: LRU evicts everything of "t".
  const int32_t total = f.cache->Snapshot().pools[0].pages_total;
  const int64_t big = (total - 1) * int64_t{s.page_size};
  const auto kb = RandomKv(s, big, 8), vb = RandomKv(s, big, 9);
  ASSERT_TRUE(f.cache->Put("x", Tokens(big, 1000), 0, Rows(s, kb, big), Rows(s, vb, big)).ok());
  EXPECT_EQ(f.cache->Match("t", Tokens(20)), 0);
  EXPECT_EQ(f.counters.evicted_pages_committed.load(), 3u);
  EXPECT_GE(f.counters.evicted_pages.load(), 5u);
  EXPECT_EQ(f.cache->Snapshot().committed_pages, 0);
}

// The tree's invariant after committing a sequence whose history was partly demoted and
// partly still in its BF16 window: every position holds StoreForPage's format, the
// window pages entered as the bytes their demotion gives, the sequence kept its BF16
// window, and a later demotion takes the tree's copies instead of making new ones.
TEST(SequenceSessionsTest, CommitOfADemotedAndWindowSequenceKeepsTheTreesFormats) {
  const ModelSpec s = TinyInt2Spec();  // page 4, sink 4, recent 8
  Fixture f(s);
  const int64_t n = 26;  // pages 0..5 full, 6 partial
  auto seq = Appended(*f.cache, 1, "t", n, 21);
  const auto before = Stored(*f.cache, seq.get(), n);
  std::vector<std::string> formats;
  for (const auto& p : before) formats.push_back(p.format);
  // Sink BF16, pages 1..3 demoted, 4..6 in the window.
  EXPECT_EQ(formats, (std::vector<std::string>{"bf16", "int2-oscar", "int2-oscar", "int2-oscar",
                                               "bf16", "bf16", "bf16"}));
  const int32_t history_used = f.Used(1);
  auto r = f.cache->Commit(seq.get());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->committed_tokens, 24);
  EXPECT_EQ(r->inserted_pages, 6);
  EXPECT_EQ(f.Used(1), history_used + 2);  // history-format copies of pages 4 and 5
  // The sequence still sees its BF16 window, byte for byte.
  const auto after = Stored(*f.cache, seq.get(), n);
  ASSERT_EQ(after.size(), before.size());
  for (size_t p = 0; p < after.size(); ++p) {
    EXPECT_EQ(after[p].format, before[p].format) << p;
    EXPECT_EQ(after[p].data, before[p].data) << p;
  }
  // A turn opened on the committed prefix sees StoreForPage's formats: what a Put stores.
  auto next = f.cache->Open(2, "t", Tokens(n));
  EXPECT_EQ(f.cache->Length(next.get()), 24);
  const auto opened = Stored(*f.cache, next.get(), 24);
  const auto k = RandomKv(s, n, 21), v = RandomKv(s, n, 22);
  ASSERT_TRUE(f.cache->Put("fresh", Tokens(24), 0, Rows(s, k, 24), Rows(s, v, 24)).ok());
  auto fresh = f.cache->Open(3, "fresh", Tokens(24));
  const auto put = Stored(*f.cache, fresh.get(), 24);
  ASSERT_EQ(opened.size(), 6u);
  for (size_t p = 0; p < opened.size(); ++p) {
    EXPECT_EQ(opened[p].format, put[p].format) << p;
    EXPECT_EQ(opened[p].format, p == 0 ? "bf16" : "int2-oscar") << p;
  }
  // Pages 4 and 5 leave the window: the sequence takes the tree's copies (no new page),
  // and they are the bytes its own demotion would have written.
  const int32_t used = f.Used(1);
  const auto k2 = RandomKv(s, 8, 30), v2 = RandomKv(s, 8, 31);
  ASSERT_TRUE(f.cache->Append(seq.get(), Tokens(8, 200), Rows(s, k2, 8), Rows(s, v2, 8)).ok());
  EXPECT_EQ(f.Used(1), used);
  auto control = Appended(*f.cache, 4, "control", n, 21);
  ASSERT_TRUE(f.cache->Append(control.get(), Tokens(8, 200), Rows(s, k2, 8), Rows(s, v2, 8)).ok());
  const auto demoted = Stored(*f.cache, seq.get(), n + 8);
  const auto own = Stored(*f.cache, control.get(), n + 8);
  ASSERT_EQ(demoted.size(), 9u);
  for (size_t p = 0; p < 8; ++p) {  // the full pages (a partial page's free slots are stale)
    EXPECT_EQ(demoted[p].format, own[p].format) << p;
    EXPECT_EQ(demoted[p].data, own[p].data) << p;
    if (p < 6) {
      EXPECT_EQ(demoted[p].data, opened[p].data) << p;
    }
  }
  for (auto* q : {seq.get(), next.get(), fresh.get(), control.get()}) f.cache->Close(q);
  // Everything private went back; the tree keeps its pages.
  EXPECT_EQ(f.Used(1), 5 + 5);  // "t": 5 history pages, "fresh": 5
}

// Attention of one layer for a batch, q the same for every sequence.
void AttendAll(ModelCache& cache, int32_t layer, std::vector<Sequence*> seqs,
               const std::vector<float>& q1, std::vector<float>* o, std::vector<float>* lse) {
  const ModelSpec& s = cache.spec();
  std::vector<float> q;
  for (size_t b = 0; b < seqs.size(); ++b) q.insert(q.end(), q1.begin(), q1.end());
  o->assign(q.size(), 0);
  lse->assign(seqs.size() * static_cast<size_t>(s.num_q_heads), 0);
  std::vector<int64_t> lengths;
  ASSERT_TRUE(cache
                  .Attend(layer, seqs, q.data(), 0.25f, ModelCache::NewTokens{}, o->data(),
                          lse->data(), &lengths)
                  .ok());
}

TEST(SequenceSessionsTest, AForkAttendsExactlyAsItsSourceAndThenDivergesOnItsOwn) {
  for (const ModelSpec& s : {TinySpec(), TinyInt2Spec()}) {
    Fixture f(s);
    const int64_t n = 26;
    auto src = Appended(*f.cache, 1, "t", n, 41);
    const int32_t window_used = f.Used(0);
    auto fork = f.cache->Fork(2, src.get());
    ASSERT_TRUE(fork.ok()) << fork.status();
    EXPECT_EQ(f.Used(0), window_used + 1);  // only the partial page was copied
    EXPECT_EQ(f.cache->Length(fork->get()), n);
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(s.num_q_heads * s.head_dim));
    for (int32_t l = 0; l < s.num_layers; ++l) {
      for (auto& x : q) x = normal(rng);
      std::vector<float> o_src, lse_src, o_fork, lse_fork;
      AttendAll(*f.cache, l, {src.get()}, q, &o_src, &lse_src);
      AttendAll(*f.cache, l, {fork->get()}, q, &o_fork, &lse_fork);
      ASSERT_EQ(0, std::memcmp(o_src.data(), o_fork.data(), o_src.size() * sizeof(float)))
          << s.name << " layer " << l;
      ASSERT_EQ(0, std::memcmp(lse_src.data(), lse_fork.data(), lse_src.size() * sizeof(float)));
    }
    // Each appends its own tokens (crossing pages and demotions): each sees only its own.
    const int64_t m = 9;
    const auto ka = RandomKv(s, m, 50), va = RandomKv(s, m, 51);
    const auto kb = RandomKv(s, m, 52), vb = RandomKv(s, m, 53);
    ASSERT_TRUE(f.cache->Append(src.get(), Tokens(m, 300), Rows(s, ka, m), Rows(s, va, m)).ok());
    ASSERT_TRUE(f.cache->Append(fork->get(), Tokens(m, 400), Rows(s, kb, m), Rows(s, vb, m)).ok());
    // Controls: each history appended in one sequence of its own.
    auto ctl_a = Appended(*f.cache, 3, "c", n, 41);
    ASSERT_TRUE(f.cache->Append(ctl_a.get(), Tokens(m, 300), Rows(s, ka, m), Rows(s, va, m)).ok());
    auto ctl_b = Appended(*f.cache, 4, "c", n, 41);
    ASSERT_TRUE(f.cache->Append(ctl_b.get(), Tokens(m, 400), Rows(s, kb, m), Rows(s, vb, m)).ok());
    for (int32_t l = 0; l < s.num_layers; ++l) {
      for (auto& x : q) x = normal(rng);
      std::vector<float> o1, l1, o2, l2, c1, cl1, c2, cl2;
      AttendAll(*f.cache, l, {src.get(), fork->get()}, q, &o1, &l1);
      AttendAll(*f.cache, l, {ctl_a.get(), ctl_b.get()}, q, &c1, &cl1);
      ASSERT_EQ(0, std::memcmp(o1.data(), c1.data(), o1.size() * sizeof(float))) << s.name;
      ASSERT_EQ(0, std::memcmp(l1.data(), cl1.data(), l1.size() * sizeof(float))) << s.name;
      const size_t half = o1.size() / 2;
      EXPECT_NE(0, std::memcmp(o1.data(), o1.data() + half, half * sizeof(float)));
    }
    for (auto* q2 : {ctl_a.get(), ctl_b.get()}) f.cache->Close(q2);
    // Shared pages are freed exactly once, by whichever of the two closes last.
    const int32_t w = f.Used(0), h = f.Used(1);
    f.cache->Close(src.get());
    EXPECT_GT(f.Used(0) + f.Used(1), 0);
    EXPECT_LT(f.Used(0) + f.Used(1), w + h);
    f.cache->Close(fork->get());
    EXPECT_EQ(f.Used(0), 0) << s.name;
    EXPECT_EQ(f.Used(1), 0) << s.name;
    EXPECT_TRUE(f.cache->Snapshot().tenants.empty());  // tenant page counts back to zero
  }
}

TEST(SequenceSessionsTest, ForkSharesCommittedPagesAndRefCountsSurviveCommitAndEviction) {
  const ModelSpec s = TinySpec();
  Fixture f(s);
  const int64_t n = 10;  // pages 0, 1 full, 2 partial
  auto src = Appended(*f.cache, 1, "t", n, 61);
  auto fork = f.cache->Fork(2, src.get());
  ASSERT_TRUE(fork.ok());
  EXPECT_EQ(f.Used(0), 4);
  // The source commits its pages (shared with the fork): the tree takes them over.
  auto r = f.cache->Commit(src.get(), /*close=*/true);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->inserted_pages, 2);
  EXPECT_EQ(f.Used(0), 3);  // the source's partial page went
  // The fork commits the same tokens: deduplicated onto the very same pages.
  r = f.cache->Commit(fork->get());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->deduplicated_pages, 2);
  EXPECT_EQ(f.Used(0), 3);
  f.cache->Close(fork->get());
  EXPECT_EQ(f.Used(0), 2);  // the tree's
  // A fork that outlives the tree's copy: eviction lets go of the tree's reference only.
  auto a = Appended(*f.cache, 3, "u", 8, 62);
  auto b = f.cache->Fork(4, a.get());
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(f.cache->Commit(a.get(), /*close=*/true).ok());
  EXPECT_EQ(f.cache->Match("u", Tokens(8)), 8);
  const int32_t total = f.cache->Snapshot().pools[0].pages_total;
  const int64_t big = (total - 1) * int64_t{s.page_size};
  const auto kb = RandomKv(s, big, 8), vb = RandomKv(s, big, 9);
  // Only "t"'s two pages are evictable and free: u's are held by b as well, so a Put that
  // would need them is refused before anything is evicted.
  const auto refused = f.cache->Put("x", Tokens(big, 1000), 0, Rows(s, kb, big), Rows(s, vb, big));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(f.cache->Match("t", Tokens(8)), 8);
  const int64_t fits = (total - 4) * int64_t{s.page_size};
  ASSERT_TRUE(f.cache->Put("x", Tokens(fits, 1000), 0, Rows(s, kb, fits), Rows(s, vb, fits)).ok());
  EXPECT_EQ(f.cache->Match("u", Tokens(8)), 0);         // evicted from the tree ...
  EXPECT_EQ(Stored(*f.cache, b->get(), 8).size(), 2u);  // ... but b still reads them
  f.cache->Close(b->get());
  EXPECT_EQ(f.Used(0), total - 4);
}

TEST(SequenceSessionsTest, CommitAndForkRefuseAPartlyAppendedTokenAndChangeNothing) {
  const ModelSpec s = TinySpec();
  Fixture f(s);
  auto seq = Appended(*f.cache, 1, "t", 6, 71);
  const int64_t row = int64_t{s.num_kv_heads} * s.head_dim;
  std::vector<uint16_t> k1(static_cast<size_t>(row), kernels::FloatToBf16(0.5f)), v1 = k1;
  std::vector<float> q(static_cast<size_t>(s.num_q_heads * s.head_dim), 0.1f), o(q.size()),
      lse(static_cast<size_t>(s.num_q_heads));
  const std::vector<int32_t> token = {9};
  ModelCache::NewTokens nt;
  nt.tokens = token;
  nt.k = Rows(s, k1, 1);
  nt.v = Rows(s, v1, 1);
  Sequence* batch[] = {seq.get()};
  std::vector<int64_t> lengths;
  ASSERT_TRUE(f.cache->Attend(0, batch, q.data(), 0.25f, nt, o.data(), lse.data(), &lengths).ok());
  const int32_t used = f.Used(0);
  for (bool close : {false, true}) {
    auto r = f.cache->Commit(seq.get(), close);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(r.status().message().find("layer 1"), std::string::npos) << r.status();
  }
  auto fork = f.cache->Fork(2, seq.get());
  EXPECT_EQ(fork.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.Used(0), used);
  EXPECT_EQ(f.cache->Snapshot().cached_tokens, 0);
  EXPECT_EQ(f.cache->Snapshot().active_sequences, 1);
  // The last layer completes the token; then both work.
  ASSERT_TRUE(f.cache->Attend(1, batch, q.data(), 0.25f, nt, o.data(), lse.data(), &lengths).ok());
  EXPECT_TRUE(f.cache->Commit(seq.get()).ok());
  f.cache->Close(seq.get());
}

TEST(SequenceSessionsTest, ACommitOrForkThatDoesNotFitChangesNothing) {
  ModelSpec s = TinyInt2Spec();
  s.memory_bytes = 64 * 1024;
  Fixture f(s);
  // Fill the history pool with a pinned prefix of another tenant.
  const int32_t history_total = f.cache->Snapshot().pools[1].pages_total;
  const int64_t put = (history_total + 1) * int64_t{s.page_size};
  const auto k = RandomKv(s, put, 1), v = RandomKv(s, put, 2);
  ASSERT_TRUE(f.cache->Put("x", Tokens(put, 500), 0, Rows(s, k, put), Rows(s, v, put)).ok());
  auto holder = f.cache->Open(9, "x", Tokens(put, 500));
  EXPECT_EQ(f.Used(1), history_total);
  // 20 tokens: page 0 sink, 1..2 demoted would need history pages (none free: they stay in
  // the window), 3 and 4 in the window.
  auto seq = Appended(*f.cache, 1, "t", 18, 3);
  const auto before = Stored(*f.cache, seq.get(), 18);
  const int32_t w = f.Used(0);
  auto r = f.cache->Commit(seq.get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(f.Used(0), w);
  EXPECT_EQ(f.cache->Match("t", Tokens(18)), 0);
  const auto after = Stored(*f.cache, seq.get(), 18);
  ASSERT_EQ(after.size(), before.size());
  for (size_t p = 0; p < after.size(); ++p) EXPECT_EQ(after[p].data, before[p].data);
  f.cache->Close(holder.get());
  f.cache->Close(seq.get());
}

// A commit racing the sequence's close (a lease expiry) either completes or changes
// nothing: the pool ends with exactly the tree's pages either way.
TEST(SequenceSessionsTest, ACommitRacingCloseCompletesOrChangesNothing) {
  const ModelSpec s = TinyInt2Spec();
  Fixture f(s);
  for (int round = 0; round < 40; ++round) {
    const std::string salt = "r" + std::to_string(round);
    auto seq = Appended(*f.cache, 1, salt, 26, 80);
    std::atomic<bool> go{false};
    absl::StatusOr<ModelCache::CommitResult> r;
    std::thread committer([&] {
      while (!go.load()) {
      }
      r = f.cache->Commit(seq.get());
    });
    std::thread closer([&] {
      while (!go.load()) {
      }
      f.cache->Close(seq.get());
    });
    go.store(true);
    committer.join();
    closer.join();
    if (r.ok()) {
      EXPECT_EQ(f.cache->Match(salt, Tokens(26)), 24);
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
      EXPECT_EQ(f.cache->Match(salt, Tokens(26)), 0);
    }
    // Private pages all went back: the pools hold only what the tree holds.
    const ModelSnapshot snap = f.cache->Snapshot();
    int64_t held = 0;
    for (const auto& t : snap.tenants) {
      for (int64_t p : t.pages) held += p;
    }
    EXPECT_EQ(held, snap.cached_tokens / s.page_size);
    EXPECT_EQ(snap.active_sequences, 0);
  }
}

}  // namespace sequence_sessions_test
}  // namespace kvcd
