// ModelCache on the CPU backend: Put / PushPages / Fetch round trips per format, the
// all-or-nothing rules (a refused call changes nothing stored), demotion of a sequence's
// window pages into the history format, and attention against the float64 oracle over the
// K/V the cache holds.
#include "server/cache/model_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/reference_attention.h"
#include "test_util.h"

namespace kvcd {
namespace {

using testing_util::TinyInt2Spec;
using testing_util::TinySpec;

struct Fixture {
  explicit Fixture(const ModelSpec& spec) : backend(MakeCpuBackend(2)) {
    auto c = ModelCache::Create(spec, backend.get(), 0.95, 0.85, &counters);
    EXPECT_TRUE(c.ok()) << c.status();
    cache = std::move(*c);
  }
  std::unique_ptr<Backend> backend;
  CacheCounters counters;
  std::unique_ptr<ModelCache> cache;
};

// BF16 K or V of n tokens, [layers][n][kv][d], random values.
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

double MaxAbsDiff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(
        m, std::abs(static_cast<double>(kernels::Bf16ToFloat(a[i])) - kernels::Bf16ToFloat(b[i])));
  }
  return m;
}

TEST(ModelCacheTest, Bf16PutFetchIsExactAndIgnoresThePartialPage) {
  const ModelSpec s = TinySpec();
  Fixture f(s);
  const int64_t n = 3 * s.page_size + 2;
  const auto k = RandomKv(s, n, 1), v = RandomKv(s, n, 2);
  auto put = f.cache->Put("t", Tokens(n), 0, Rows(s, k, n), Rows(s, v, n));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->inserted_tokens, 3 * s.page_size);
  EXPECT_EQ(put->ignored_tokens, 2);
  EXPECT_EQ(f.cache->Match("t", Tokens(n)), 3 * s.page_size);
  EXPECT_EQ(f.cache->Match("other", Tokens(n)), 0);  // tenants do not share prefixes

  auto seq = f.cache->Open(1, "t", Tokens(n));
  const int64_t m = 3 * s.page_size;
  std::vector<uint16_t> k_out(static_cast<size_t>(s.num_layers * m * s.num_kv_heads * s.head_dim));
  std::vector<uint16_t> v_out(k_out.size());
  std::vector<std::string> formats;
  ASSERT_TRUE(f.cache->Fetch(seq.get(), 0, m, k_out.data(), v_out.data(), &formats).ok());
  EXPECT_EQ(formats, std::vector<std::string>(3, "bf16"));
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const size_t row = static_cast<size_t>(m * s.num_kv_heads * s.head_dim);
    const size_t src = static_cast<size_t>(l * n * s.num_kv_heads * s.head_dim);
    for (size_t i = 0; i < row; ++i) {
      ASSERT_EQ(k_out[l * row + i], k[src + i]);
      ASSERT_EQ(v_out[l * row + i], v[src + i]);
    }
  }
  f.cache->Close(seq.get());
}

TEST(ModelCacheTest, Int2PutStoresSinkInBf16AndHistoryInInt2) {
  const ModelSpec s = TinyInt2Spec();
  Fixture f(s);
  const int64_t n = 6 * s.page_size;
  const auto k = RandomKv(s, n, 3), v = RandomKv(s, n, 4);
  ASSERT_TRUE(f.cache->Put("", Tokens(n), 0, Rows(s, k, n), Rows(s, v, n)).ok());
  const ModelSnapshot snap = f.cache->Snapshot();
  ASSERT_EQ(snap.pools.size(), 2u);
  EXPECT_EQ(snap.pools[0].format, "bf16");
  EXPECT_EQ(snap.pools[0].pages_used, s.sink_pages());
  EXPECT_EQ(snap.pools[1].format, "int2-oscar");
  EXPECT_EQ(snap.pools[1].pages_used, 6 - s.sink_pages());
  EXPECT_DOUBLE_EQ(snap.history_bits_per_element, 2.0 + 32.0 / s.head_dim);

  auto seq = f.cache->Open(1, "", Tokens(n));
  std::vector<uint16_t> k_out(k.size()), v_out(v.size());
  std::vector<std::string> formats;
  ASSERT_TRUE(f.cache->Fetch(seq.get(), 0, n, k_out.data(), v_out.data(), &formats).ok());
  EXPECT_EQ(formats.front(), "bf16");
  EXPECT_EQ(formats.back(), "int2-oscar");
  // Sink rows were rotated and rounded to BF16, then un-rotated: close to the input.
  const size_t sink = static_cast<size_t>(s.sink_tokens * s.num_kv_heads * s.head_dim);
  std::vector<uint16_t> a(k.begin(), k.begin() + sink), b(k_out.begin(), k_out.begin() + sink);
  EXPECT_LT(MaxAbsDiff(a, b), 0.05);
  // History rows are 2-bit codes: bounded, not exact.
  EXPECT_GT(MaxAbsDiff(k, k_out), 0.0);
  EXPECT_LT(MaxAbsDiff(k, k_out), 4.0);
  f.cache->Close(seq.get());
}

TEST(ModelCacheTest, PushedPagesAreStoredByteForByteAndBadPagesStoreNothing) {
  for (const ModelSpec& s : {TinySpec(), TinyInt2Spec()}) {
    Fixture f(s);
    const int64_t n = 4 * s.page_size;
    const auto k = RandomKv(s, n, 5), v = RandomKv(s, n, 6);
    ASSERT_TRUE(f.cache->Put("a", Tokens(n), 0, Rows(s, k, n), Rows(s, v, n)).ok());
    auto seq = f.cache->Open(1, "a", Tokens(n));
    std::vector<ModelCache::StoredPageCopy> pages;
    ASSERT_TRUE(f.cache->FetchStored(seq.get(), 0, n, &pages).ok());
    ASSERT_EQ(pages.size(), 4u);
    f.cache->Close(seq.get());

    std::vector<ModelCache::StoredPageIn> in;
    for (const auto& p : pages) in.push_back({p.format, p.data});
    // A wrong format, a short page and a non-finite value are refused, naming the page.
    auto bad_format = in;
    bad_format[1].format = bad_format[1].format == "bf16" ? "int2-oscar" : "bf16";
    std::string short_page = pages[2].data.substr(1);
    auto bad_size = in;
    bad_size[2].data = short_page;
    std::string nan_page = pages[0].data;
    nan_page[0] = '\xff';  // BF16 0x7fff / 0xffff: NaN
    nan_page[1] = '\x7f';
    auto bad_value = in;
    bad_value[0].data = nan_page;
    for (const auto& bad : {bad_format, bad_size, bad_value}) {
      auto r = f.cache->PushPages("b", Tokens(n), 0, bad);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      EXPECT_EQ(f.cache->Match("b", Tokens(n)), 0);
    }
    auto ok = f.cache->PushPages("b", Tokens(n), 0, in);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(ok->inserted_tokens, n);
    auto copy = f.cache->Open(2, "b", Tokens(n));
    std::vector<ModelCache::StoredPageCopy> again;
    ASSERT_TRUE(f.cache->FetchStored(copy.get(), 0, n, &again).ok());
    for (size_t i = 0; i < pages.size(); ++i) {
      EXPECT_EQ(again[i].format, pages[i].format);
      EXPECT_EQ(again[i].data, pages[i].data) << "page " << i;
    }
    f.cache->Close(copy.get());
  }
}

TEST(ModelCacheTest, RefusedPutsChangeNothing) {
  ModelSpec small = TinySpec();
  int64_t page_bytes = 0;
  {
    Fixture probe(small);
    page_bytes = probe.cache->MaxPageBytes();
  }
  small.memory_bytes = static_cast<uint64_t>(4 * page_bytes);  // room for exactly 4 pages
  Fixture f(small);
  const int64_t n = 3 * small.page_size;
  const auto k = RandomKv(small, 8 * small.page_size, 7),
             v = RandomKv(small, 8 * small.page_size, 8);
  ASSERT_TRUE(f.cache->Put("t", Tokens(n), 0, Rows(small, k, n), Rows(small, v, n)).ok());
  auto seq = f.cache->Open(1, "t", Tokens(n));  // pins the 3 pages
  // Needs 8 pages with 1 free and 3 pinned: RESOURCE_EXHAUSTED, the cached prefix stays.
  const int64_t big = 8 * small.page_size;
  auto r = f.cache->Put("t2", Tokens(big, 100), 0, Rows(small, k, big), Rows(small, v, big));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(f.cache->Match("t", Tokens(n)), n);
  EXPECT_EQ(f.cache->Match("t2", Tokens(big, 100)), 0);
  // A chunk whose prefix is not cached: FAILED_PRECONDITION, nothing stored.
  auto chunk = f.cache->Put("t3", Tokens(n), small.page_size, Rows(small, k, n - small.page_size),
                            Rows(small, v, n - small.page_size));
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.cache->Match("t3", Tokens(n)), 0);
  f.cache->Close(seq.get());
}

TEST(ModelCacheTest, AppendDemotesWindowPagesThatLeftTheRecentWindow) {
  const ModelSpec s = TinyInt2Spec();
  Fixture f(s);
  auto seq = f.cache->Open(1, "", {});
  const int64_t n = s.sink_tokens + s.recent_tokens + 3 * s.page_size;
  const auto k = RandomKv(s, n, 9), v = RandomKv(s, n, 10);
  auto len = f.cache->Append(seq.get(), Tokens(n), Rows(s, k, n), Rows(s, v, n));
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, n);
  const ModelSnapshot snap = f.cache->Snapshot();
  EXPECT_EQ(snap.demoted_pages, 3u);
  EXPECT_EQ(snap.pools[1].pages_used, 3);
  std::vector<uint16_t> k_out(k.size()), v_out(v.size());
  std::vector<std::string> formats;
  ASSERT_TRUE(f.cache->Fetch(seq.get(), 0, n, k_out.data(), v_out.data(), &formats).ok());
  std::vector<std::string> want;
  for (int64_t p = 0; p < n / s.page_size; ++p) {
    const bool history = p >= s.sink_pages() && p < s.sink_pages() + 3;
    want.push_back(history ? "int2-oscar" : "bf16");
  }
  EXPECT_EQ(formats, want);
  f.cache->Close(seq.get());
  EXPECT_EQ(f.cache->Snapshot().pools[1].pages_used, 0);  // private pages go back on close
}

TEST(ModelCacheTest, AttentionWithFusedAppendMatchesTheOracleOverTheStoredKv) {
  for (const ModelSpec& s : {TinySpec(), TinyInt2Spec()}) {
    Fixture f(s);
    const int64_t n = 5 * s.page_size + 1;
    auto seq = f.cache->Open(1, "", {});
    const auto k = RandomKv(s, n, 11), v = RandomKv(s, n, 12);
    ASSERT_TRUE(f.cache->Append(seq.get(), Tokens(n), Rows(s, k, n), Rows(s, v, n)).ok());
    // One new token, layer by layer: the token is committed after the last layer.
    const int64_t row = int64_t{s.num_kv_heads} * s.head_dim;
    std::mt19937 rng(13);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(s.num_q_heads * s.head_dim));
    std::vector<float> o(q.size()), lse(static_cast<size_t>(s.num_q_heads));
    std::vector<uint16_t> k_new(static_cast<size_t>(row)), v_new(k_new.size());
    const std::vector<int32_t> token = {77};
    Sequence* batch[] = {seq.get()};
    for (int32_t l = 0; l < s.num_layers; ++l) {
      for (auto& x : k_new) x = kernels::FloatToBf16(normal(rng));
      for (auto& x : v_new) x = kernels::FloatToBf16(normal(rng));
      for (auto& x : q) x = normal(rng);
      ModelCache::NewTokens nt;
      nt.tokens = token;
      nt.k = Rows(s, k_new, 1);
      nt.v = Rows(s, v_new, 1);
      std::vector<int64_t> lengths;
      const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
      ASSERT_TRUE(
          f.cache->Attend(l, batch, q.data(), scale, nt, o.data(), lse.data(), &lengths).ok());
      ASSERT_EQ(lengths, std::vector<int64_t>{n + 1});
      EXPECT_EQ(f.cache->Length(seq.get()), l + 1 == s.num_layers ? n + 1 : n);
      // The oracle over what the cache holds at this layer (fetched after the call).
      if (l + 1 != s.num_layers) continue;
      std::vector<uint16_t> kf(static_cast<size_t>(s.num_layers * (n + 1) * row)), vf(kf.size());
      std::vector<std::string> formats;
      ASSERT_TRUE(f.cache->Fetch(seq.get(), 0, n + 1, kf.data(), vf.data(), &formats).ok());
      std::vector<float> kl(static_cast<size_t>((n + 1) * row)), vl(kl.size());
      for (size_t i = 0; i < kl.size(); ++i) {
        kl[i] = kernels::Bf16ToFloat(kf[static_cast<size_t>(l * (n + 1) * row) + i]);
        vl[i] = kernels::Bf16ToFloat(vf[static_cast<size_t>(l * (n + 1) * row) + i]);
      }
      std::vector<double> ro(o.size()), rl(lse.size());
      kernels::ReferenceAttention(q.data(), kl.data(), vl.data(), n + 1, s.num_q_heads,
                                  s.num_kv_heads, s.head_dim, scale, ro.data(), rl.data());
      // The fetched K/V went through BF16 once more (expansion): INT2 pages are compared
      // against their own dequantized values, so the bound covers rounding only.
      for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], ro[i], 0.03) << s.name << " " << i;
      for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], rl[i], 0.03) << s.name;
    }
    f.cache->Close(seq.get());
  }
}

}  // namespace
}  // namespace kvcd
