// ModelCache on the CPU backend: Put / PushPages / Fetch round trips per format, the
// all-or-nothing rules (a refused call changes nothing stored), demotion of a sequence's
// window pages into the history format, and attention against the float64 oracle over the
// K/V the cache holds.
#include "server/cache/model_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/fsq_codec.h"
#include "common/key_transform_profile.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/fsq.h"
#include "kvcd/kernels/reference_attention.h"
#include "server/backends/fault_injector.h"
#include "test_util.h"

namespace kvcd {
namespace model_cache_test {

using testing_util::TinyInt2Spec;
using testing_util::TinySpec;

struct Fixture {
  explicit Fixture(const ModelSpec& spec, const std::string& codec_blob = "")
      : backend(MakeCpuBackend(2)) {
    auto c = ModelCache::Create(spec, backend.get(), 0.95, 0.85, &counters, codec_blob);
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

// A version-3 codec file (transform-coded keys) of the given shape, synthetic heads.
std::string TransformBlob(int layers, int hkv, int d) {
  return KeyTransformProfile::ToSafetensors(KeyTransformProfile::SyntheticHeads(layers, hkv, d, 3),
                                            layers, hkv, d, "test")
      .Serialize();
}

ModelSpec TinyTransformSpec() {
  ModelSpec s = TinyInt2Spec();
  s.name = "tiny-int2-transform";
  s.codec = "";
  return s;
}

TEST(ModelCacheTest, AttentionWithFusedAppendMatchesTheOracleOverTheStoredKv) {
  const ModelSpec tf = TinyTransformSpec();
  const std::pair<ModelSpec, std::string> cases[] = {
      {TinySpec(), ""},
      {TinyInt2Spec(), ""},
      {tf, TransformBlob(tf.num_layers, tf.num_kv_heads, tf.head_dim)}};
  for (const auto& [s, blob] : cases) {
    Fixture f(s, blob);
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

// ---------------------------------------------------------------------------------------
// FSQ history: codes computed from the residuals when they arrive.

constexpr int kFsqC = 24;

ModelSpec TinyFsqSpec() {
  ModelSpec s = TinySpec();
  s.name = "tiny-fsq";
  s.history_format = FormatId::kFsq;
  s.fsq_residual_width = kFsqC;
  s.fsq_latent_width = 9;
  s.key_norm = true;
  s.rope_rotary_dims = 8;
  s.rope_interleaved = true;
  return s;
}

FsqCodecShape FsqShape(const ModelSpec& s) {
  FsqCodecShape c;
  c.num_layers = s.num_layers;
  c.residual_width = s.fsq_residual_width;
  c.latent_width = s.fsq_latent_width;
  c.num_kv_heads = s.num_kv_heads;
  c.head_dim = s.head_dim;
  c.key_norm = s.key_norm;
  c.key_norm_eps = s.key_norm_eps;
  return c;
}

std::string FsqBlob(const ModelSpec& s) {
  return FsqCodec::Synthetic(FsqShape(s), 21).ToSafetensors().Serialize();
}

// F32 residuals of n tokens, [layers][n][C].
std::vector<float> RandomX(const ModelSpec& s, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(s.num_layers * n * s.fsq_residual_width));
  for (auto& v : x) v = normal(rng);
  return x;
}

RowSource XRows(const ModelSpec& s, const std::vector<float>& x, int64_t n) {
  RowSource r;
  r.data = x.data();
  r.is_bf16 = false;
  r.token_stride = s.fsq_residual_width;
  r.layer_stride = n * r.token_stride;
  return r;
}

// The pages of tokens [0, n) of a sequence as stored: formats and bytes.
std::vector<ModelCache::StoredPageCopy> Stored(ModelCache& c, Sequence* seq, int64_t n) {
  std::vector<ModelCache::StoredPageCopy> pages;
  EXPECT_TRUE(c.FetchStored(seq, 0, n, &pages).ok());
  return pages;
}

TEST(ModelCacheTest, FsqPutKeepsSinkKvWithCodesAndOnlyCodesInTheHistory) {
  const ModelSpec s = TinyFsqSpec();
  Fixture f(s, FsqBlob(s));
  ASSERT_NE(f.cache, nullptr);
  const FsqCodec codec = FsqCodec::Synthetic(FsqShape(s), 21);
  const int64_t n = 4 * s.page_size;
  const auto k = RandomKv(s, n, 1), v = RandomKv(s, n, 2);
  const auto x = RandomX(s, n, 3);
  // K/V without residuals: refused, nothing stored.
  auto bad = f.cache->Put("t", Tokens(n), 0, Rows(s, k, n), Rows(s, v, n));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("residuals"), std::string::npos);
  EXPECT_EQ(f.cache->Match("t", Tokens(n)), 0);
  EXPECT_EQ(f.cache->Snapshot().pools[0].pages_used, 0);
  EXPECT_EQ(f.cache->Snapshot().pools[1].pages_used, 0);

  const RowSource xr = XRows(s, x, n);
  auto put = f.cache->Put("t", Tokens(n), 0, Rows(s, k, n), Rows(s, v, n), &xr);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->inserted_tokens, n);
  const ModelSnapshot snap = f.cache->Snapshot();
  ASSERT_EQ(snap.pools.size(), 2u);
  EXPECT_EQ(snap.pools[0].format, "bf16+fsq");
  EXPECT_EQ(snap.pools[1].format, "fsq");
  const int64_t code = kernels::FsqCodeBytes(s.fsq_latent_width);
  EXPECT_EQ(snap.pools[1].page_bytes, s.num_layers * s.page_size * code);
  EXPECT_DOUBLE_EQ(snap.history_bytes_per_token, double(s.num_layers * code));
  // The window keeps the codes beside the BF16 K/V, and says so.
  EXPECT_DOUBLE_EQ(snap.bf16_bytes_per_token,
                   double(s.num_layers * (4 * s.num_kv_heads * s.head_dim + code)));
  // Dense BF16 over what is stored: 4 pages, one of them a window page with codes.
  const double dense = 4.0 * s.page_size * 2 * 2 * s.num_layers * s.num_kv_heads * s.head_dim;
  EXPECT_DOUBLE_EQ(snap.compression_ratio,
                   dense / (snap.pools[0].page_bytes + 3.0 * snap.pools[1].page_bytes));
  EXPECT_NE(snap.codec.find("fsq G=9"), std::string::npos) << snap.codec;

  auto seq = f.cache->Open(1, "t", Tokens(n));
  const auto pages = Stored(*f.cache, seq.get(), n);
  ASSERT_EQ(pages.size(), 4u);
  EXPECT_EQ(pages[0].format, "bf16+fsq");
  const int64_t row = int64_t{s.num_kv_heads} * s.head_dim;
  const int64_t kv_bytes = 2 * 2 * s.page_size * row;
  std::vector<uint8_t> want(static_cast<size_t>(code));
  for (size_t p = 0; p < pages.size(); ++p) {
    EXPECT_EQ(pages[p].format, p == 0 ? "bf16+fsq" : "fsq");
    const int64_t layer_bytes = pages[p].bytes / s.num_layers;
    const int64_t codes_at = p == 0 ? kv_bytes : 0;
    for (int32_t l = 0; l < s.num_layers; ++l) {
      for (int32_t t = 0; t < s.page_size; ++t) {
        const int64_t tok = static_cast<int64_t>(p) * s.page_size + t;
        kernels::FsqEncodeRows(codec.Layer(l), x.data() + (l * n + tok) * kFsqC, 1, want.data());
        EXPECT_EQ(0, std::memcmp(pages[p].data.data() + l * layer_bytes + codes_at + t * code,
                                 want.data(), static_cast<size_t>(code)))
            << "page " << p << " layer " << l << " slot " << t;
      }
    }
  }
  // Expanded: the sink is the BF16 K/V as sent; the history is rebuilt from the codes at
  // each token's position.
  std::vector<uint16_t> k_out(k.size()), v_out(v.size());
  std::vector<std::string> formats;
  ASSERT_TRUE(f.cache->Fetch(seq.get(), 0, n, k_out.data(), v_out.data(), &formats).ok());
  const int64_t sink = s.sink_tokens;
  kernels::RopeSpec rope;
  rope.theta = s.rope_theta;
  rope.rotary_dims = s.rope_rotary_dims;
  rope.pairing = kernels::RopePairing::kInterleaved;
  std::vector<float> kt(static_cast<size_t>(row)), vt(kt.size());
  for (int32_t l = 0; l < s.num_layers; ++l) {
    for (int64_t t = 0; t < n; ++t) {
      const size_t at = static_cast<size_t>((l * n + t) * row);
      if (t < sink) {
        EXPECT_TRUE(std::equal(k.begin() + at, k.begin() + at + row, k_out.begin() + at));
        continue;
      }
      const size_t page = static_cast<size_t>(t / s.page_size);
      const auto* c = reinterpret_cast<const uint8_t*>(pages[page].data.data()) +
                      l * (pages[page].bytes / s.num_layers) + (t % s.page_size) * code;
      kernels::FsqExpandToken(codec.Layer(l), rope, c, t, kt.data(), vt.data());
      for (int64_t i = 0; i < row; ++i) {
        EXPECT_EQ(k_out[at + i], kernels::FloatToBf16(kt[static_cast<size_t>(i)]));
        EXPECT_EQ(v_out[at + i], kernels::FloatToBf16(vt[static_cast<size_t>(i)]));
      }
    }
  }
  f.cache->Close(seq.get());
}

TEST(ModelCacheTest, FsqCodesDoNotDependOnWhenAPageIsDemoted) {
  const ModelSpec s = TinyFsqSpec();
  Fixture f(s, FsqBlob(s));
  ASSERT_NE(f.cache, nullptr);
  const int64_t n = s.sink_tokens + s.recent_tokens + 3 * s.page_size;
  const auto k = RandomKv(s, n, 4), v = RandomKv(s, n, 5);
  const auto x = RandomX(s, n, 6);
  const RowSource xr = XRows(s, x, n);
  // Put straight into the history.
  const int64_t put_pages = n / s.page_size;
  ASSERT_TRUE(f.cache->Put("put", Tokens(n), 0, Rows(s, k, n), Rows(s, v, n), &xr).ok());
  auto a = f.cache->Open(1, "put", Tokens(n));
  // Demoted late: one Append of everything.
  auto b = f.cache->Open(2, "late", {});
  ASSERT_TRUE(f.cache->Append(b.get(), Tokens(n), Rows(s, k, n), Rows(s, v, n), &xr).ok());
  // Demoted early: token by token, each page as soon as it leaves the recent window.
  auto c = f.cache->Open(3, "early", {});
  const int64_t row = int64_t{s.num_kv_heads} * s.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    std::vector<uint16_t> k1(static_cast<size_t>(s.num_layers * row)), v1(k1.size());
    std::vector<float> x1(static_cast<size_t>(s.num_layers * kFsqC));
    for (int32_t l = 0; l < s.num_layers; ++l) {
      std::copy_n(k.begin() + (l * n + t) * row, row, k1.begin() + l * row);
      std::copy_n(v.begin() + (l * n + t) * row, row, v1.begin() + l * row);
      std::copy_n(x.begin() + (l * n + t) * kFsqC, kFsqC, x1.begin() + l * kFsqC);
    }
    const RowSource x1r = XRows(s, x1, 1);
    ASSERT_TRUE(f.cache
                    ->Append(c.get(), Tokens(1, 1 + static_cast<int32_t>(t)), Rows(s, k1, 1),
                             Rows(s, v1, 1), &x1r)
                    .ok());
  }
  // Without residuals an FSQ append is refused and the sequence is unchanged.
  EXPECT_EQ(f.cache->Append(c.get(), Tokens(1), Rows(s, k, 1), Rows(s, v, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.cache->Length(c.get()), n);
  const auto pa = Stored(*f.cache, a.get(), put_pages * s.page_size);
  const auto pb = Stored(*f.cache, b.get(), n);
  const auto pc = Stored(*f.cache, c.get(), n);
  ASSERT_EQ(pb.size(), pc.size());
  int history = 0;
  for (size_t p = 0; p < pb.size(); ++p) {
    EXPECT_EQ(pb[p].format, pc[p].format);
    EXPECT_EQ(pb[p].data, pc[p].data) << "page " << p;
    if (pb[p].format == "fsq") {
      ++history;
      EXPECT_EQ(pb[p].data, pa[p].data) << "page " << p;  // the Put path's codes
    }
  }
  EXPECT_EQ(history, 3);
  for (auto* seq : {a.get(), b.get(), c.get()}) f.cache->Close(seq);
}

TEST(ModelCacheTest, FsqAttentionWithFusedAppendMatchesTheOracleOverRebuiltKv) {
  const ModelSpec s = TinyFsqSpec();
  Fixture f(s, FsqBlob(s));
  ASSERT_NE(f.cache, nullptr);
  const FsqCodec codec = FsqCodec::Synthetic(FsqShape(s), 21);
  kernels::RopeSpec rope;
  rope.theta = s.rope_theta;
  rope.rotary_dims = s.rope_rotary_dims;
  rope.pairing = kernels::RopePairing::kInterleaved;
  const int64_t n = s.sink_tokens + s.recent_tokens + 3 * s.page_size + 1;
  const auto k = RandomKv(s, n, 7), v = RandomKv(s, n, 8);
  const auto x = RandomX(s, n, 9);
  const RowSource xr = XRows(s, x, n);
  auto seq = f.cache->Open(1, "", {});
  ASSERT_TRUE(f.cache->Append(seq.get(), Tokens(n), Rows(s, k, n), Rows(s, v, n), &xr).ok());
  const int64_t row = int64_t{s.num_kv_heads} * s.head_dim;
  std::mt19937 rng(10);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(s.num_q_heads * s.head_dim));
  std::vector<float> o(q.size()), lse(static_cast<size_t>(s.num_q_heads));
  std::vector<uint16_t> k_new(static_cast<size_t>(row)), v_new(k_new.size());
  std::vector<float> x_new(kFsqC);
  const std::vector<int32_t> token = {77};
  Sequence* batch[] = {seq.get()};
  for (int32_t l = 0; l < s.num_layers; ++l) {
    for (auto& e : k_new) e = kernels::FloatToBf16(normal(rng));
    for (auto& e : v_new) e = kernels::FloatToBf16(normal(rng));
    for (auto& e : x_new) e = normal(rng);
    for (auto& e : q) e = normal(rng);
    ModelCache::NewTokens nt;
    nt.tokens = token;
    nt.k = Rows(s, k_new, 1);
    nt.v = Rows(s, v_new, 1);
    // Without x_new: refused, nothing appended.
    std::vector<int64_t> lengths;
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    EXPECT_EQ(f.cache->Attend(l, batch, q.data(), scale, nt, o.data(), lse.data(), &lengths).code(),
              absl::StatusCode::kInvalidArgument);
    const RowSource xnr = XRows(s, x_new, 1);
    nt.x = &xnr;
    ASSERT_TRUE(
        f.cache->Attend(l, batch, q.data(), scale, nt, o.data(), lse.data(), &lengths).ok());
    ASSERT_EQ(lengths, std::vector<int64_t>{n + 1});
    // The oracle: window tokens as sent, history tokens rebuilt from their codes (float).
    const auto pages = Stored(*f.cache, seq.get(), l + 1 == s.num_layers ? n + 1 : n);
    std::vector<float> kl(static_cast<size_t>((n + 1) * row)), vl(kl.size());
    std::vector<float> kt(static_cast<size_t>(row)), vt(kt.size());
    int history = 0;
    for (int64_t t = 0; t <= n; ++t) {
      const auto& page = pages[static_cast<size_t>(t / s.page_size)];
      if (page.format == "fsq") {
        ++history;
        const auto* c = reinterpret_cast<const uint8_t*>(page.data.data()) +
                        l * (page.bytes / s.num_layers) +
                        (t % s.page_size) * kernels::FsqCodeBytes(s.fsq_latent_width);
        kernels::FsqExpandToken(codec.Layer(l), rope, c, t, kt.data(), vt.data());
        std::copy(kt.begin(), kt.end(), kl.begin() + t * row);
        std::copy(vt.begin(), vt.end(), vl.begin() + t * row);
      } else {
        for (int64_t i = 0; i < row; ++i) {
          const bool fresh = t == n;
          kl[static_cast<size_t>(t * row + i)] =
              kernels::Bf16ToFloat(fresh ? k_new[static_cast<size_t>(i)]
                                         : k[static_cast<size_t>((l * n + t) * row + i)]);
          vl[static_cast<size_t>(t * row + i)] =
              kernels::Bf16ToFloat(fresh ? v_new[static_cast<size_t>(i)]
                                         : v[static_cast<size_t>((l * n + t) * row + i)]);
        }
      }
    }
    EXPECT_EQ(history, 3 * s.page_size);
    std::vector<double> ro(o.size()), rl(lse.size());
    kernels::ReferenceAttention(q.data(), kl.data(), vl.data(), n + 1, s.num_q_heads,
                                s.num_kv_heads, s.head_dim, scale, ro.data(), rl.data());
    for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], ro[i], 2e-3) << l << " " << i;
    for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], rl[i], 2e-3) << l;
  }
  f.cache->Close(seq.get());
}

// Issue #21: a fused AttentionDecode whose attention launch fails keeps nothing of its
// append: the length, the pages (a page the append took is returned) and the stored bytes
// are as before, and the same call succeeds when retried. A failure on the last layer
// does not commit the token either.
TEST(ModelCacheTest, FusedAppendIsTakenBackWhenTheAttentionLaunchFails) {
  const ModelSpec s = TinySpec();
  auto injector = FaultInjector::Parse("attend:1,attend:3");
  ASSERT_TRUE(injector.ok()) << injector.status();
  std::shared_ptr<FaultInjector> faults = std::move(*injector);
  auto backend = WithFaultInjection(MakeCpuBackend(1), faults);
  CacheCounters counters;
  auto created = ModelCache::Create(s, backend.get(), 0.95, 0.85, &counters);
  ASSERT_TRUE(created.ok()) << created.status();
  ModelCache& cache = **created;
  const int64_t n = 2 * s.page_size;  // full pages: the new token needs a fresh page
  const auto k = RandomKv(s, n, 1), v = RandomKv(s, n, 2);
  auto seq = cache.Open(1, "t", {});
  ASSERT_TRUE(cache.Append(seq.get(), Tokens(n), Rows(s, k, n), Rows(s, v, n)).ok());
  const int32_t used = cache.Snapshot().pools[0].pages_used;
  std::vector<ModelCache::StoredPageCopy> before;
  ASSERT_TRUE(cache.FetchStored(seq.get(), 0, n, &before).ok());

  const int64_t row = int64_t{s.num_kv_heads} * s.head_dim;
  const auto k_new = RandomKv(s, 1, 3), v_new = RandomKv(s, 1, 4);  // [layers][1][kv][d]
  std::vector<float> q(static_cast<size_t>(s.num_q_heads * s.head_dim), 0.5f);
  std::vector<float> o(q.size()), lse(static_cast<size_t>(s.num_q_heads));
  const std::vector<int32_t> token = {4242};
  Sequence* batch[] = {seq.get()};
  auto attend = [&](int32_t layer, std::vector<int64_t>* lengths) {
    ModelCache::NewTokens nt;
    nt.tokens = token;
    RowSource kr = Rows(s, k_new, 1), vr = Rows(s, v_new, 1);
    kr.data = k_new.data() + layer * row;
    vr.data = v_new.data() + layer * row;
    nt.k = kr;
    nt.v = vr;
    return cache.Attend(layer, batch, q.data(), 0.25f, nt, o.data(), lse.data(), lengths);
  };
  auto unchanged = [&](const char* when) {
    EXPECT_EQ(cache.Length(seq.get()), n) << when;
    EXPECT_EQ(cache.Snapshot().pools[0].pages_used, used) << when;
    std::vector<ModelCache::StoredPageCopy> now;
    ASSERT_TRUE(cache.FetchStored(seq.get(), 0, n, &now).ok()) << when;
    ASSERT_EQ(now.size(), before.size()) << when;
    for (size_t i = 0; i < now.size(); ++i) EXPECT_EQ(now[i].data, before[i].data) << when << i;
  };
  std::vector<int64_t> lengths;
  // Layer 0, first try: the launch fails (INTERNAL), nothing is kept.
  EXPECT_EQ(attend(0, &lengths).code(), absl::StatusCode::kInternal);
  unchanged("after the failed first layer");
  // Retried, layer 0 takes the token (the layer is not left "already holding" it).
  ASSERT_TRUE(attend(0, &lengths).ok());
  EXPECT_EQ(lengths, std::vector<int64_t>{n + 1});
  EXPECT_EQ(cache.Snapshot().pools[0].pages_used, used + 1);
  // The last layer fails: the token stays pending at layer 0 and is not committed.
  EXPECT_EQ(attend(1, &lengths).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(cache.Length(seq.get()), n);
  EXPECT_EQ(cache.Snapshot().pools[0].pages_used, used + 1);  // layer 0's row keeps its page
  ASSERT_TRUE(attend(1, &lengths).ok());
  EXPECT_EQ(lengths, std::vector<int64_t>{n + 1});
  EXPECT_EQ(cache.Length(seq.get()), n + 1);
  EXPECT_EQ(faults->fired(), 2);
  {
    std::lock_guard<std::mutex> lock(seq->mu);
    ASSERT_EQ(seq->tokens.size(), static_cast<size_t>(n + 1));
    EXPECT_EQ(seq->tokens.back(), 4242);
  }
  // The stored token is the one sent, once, at every layer.
  std::vector<uint16_t> k_out(static_cast<size_t>(s.num_layers * (n + 1) * row)),
      v_out(k_out.size());
  std::vector<std::string> formats;
  ASSERT_TRUE(cache.Fetch(seq.get(), 0, n + 1, k_out.data(), v_out.data(), &formats).ok());
  for (int32_t l = 0; l < s.num_layers; ++l) {
    for (int64_t i = 0; i < row; ++i) {
      const size_t at = static_cast<size_t>((l * (n + 1) + n) * row + i);
      ASSERT_EQ(k_out[at], k_new[static_cast<size_t>(l * row + i)]) << l << " " << i;
      ASSERT_EQ(v_out[at], v_new[static_cast<size_t>(l * row + i)]) << l << " " << i;
    }
  }
  cache.Close(seq.get());
}

// The same with a demotion: the fused token that completes at the last layer commits and
// demotes a page that left the recent window before attending; when that launch fails, the
// page is BF16 again (its history copy freed), the token is not committed, and both pools
// are as before.
TEST(ModelCacheTest, FailedFusedAttentionTakesBackTheDemotionItCaused) {
  const ModelSpec s = TinyInt2Spec();  // page 4, sink 4, recent 8
  auto injector = FaultInjector::Parse("attend:2");
  ASSERT_TRUE(injector.ok()) << injector.status();
  auto backend = WithFaultInjection(MakeCpuBackend(1), std::move(*injector));
  CacheCounters counters;
  auto created = ModelCache::Create(s, backend.get(), 0.95, 0.85, &counters);
  ASSERT_TRUE(created.ok()) << created.status();
  ModelCache& cache = **created;
  const int64_t n = 19;  // token 19 completes page 2's exit from the recent window
  const auto k = RandomKv(s, n, 1), v = RandomKv(s, n, 2);
  auto seq = cache.Open(1, "t", {});
  ASSERT_TRUE(cache.Append(seq.get(), Tokens(n), Rows(s, k, n), Rows(s, v, n)).ok());
  const int64_t row = int64_t{s.num_kv_heads} * s.head_dim;
  const auto k_new = RandomKv(s, 1, 3), v_new = RandomKv(s, 1, 4);
  std::vector<float> q(static_cast<size_t>(s.num_q_heads * s.head_dim), 0.5f);
  std::vector<float> o(q.size()), lse(static_cast<size_t>(s.num_q_heads));
  const std::vector<int32_t> token = {4242};
  Sequence* batch[] = {seq.get()};
  auto attend = [&](int32_t layer) {
    ModelCache::NewTokens nt;
    nt.tokens = token;
    RowSource kr = Rows(s, k_new, 1), vr = Rows(s, v_new, 1);
    kr.data = k_new.data() + layer * row;
    vr.data = v_new.data() + layer * row;
    nt.k = kr;
    nt.v = vr;
    std::vector<int64_t> lengths;
    return cache.Attend(layer, batch, q.data(), 0.25f, nt, o.data(), lse.data(), &lengths);
  };
  ASSERT_TRUE(attend(0).ok());
  auto pools = [&] {
    std::vector<int32_t> used;
    for (const auto& p : cache.Snapshot().pools) used.push_back(p.pages_used);
    return used;
  };
  const std::vector<int32_t> used = pools();
  std::vector<ModelCache::StoredPageCopy> before;
  ASSERT_TRUE(cache.FetchStored(seq.get(), 0, n, &before).ok());
  ASSERT_EQ(before.size(), 5u);
  EXPECT_EQ(before[2].format, "bf16");
  // The tokens as the sequence holds them (the partial last page's slots past the length
  // hold whatever was written there last; only its tokens count).
  auto tokens_kv = [&] {
    std::vector<uint16_t> ko(static_cast<size_t>(s.num_layers * n * row)), vo(ko.size());
    std::vector<std::string> formats;
    EXPECT_TRUE(cache.Fetch(seq.get(), 0, n, ko.data(), vo.data(), &formats).ok());
    return std::make_pair(ko, vo);
  };
  const auto kv_before = tokens_kv();
  const uint64_t demoted = counters.demoted_pages.load();
  EXPECT_EQ(attend(1).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(cache.Length(seq.get()), n);
  EXPECT_EQ(pools(), used);
  EXPECT_EQ(counters.demoted_pages.load(), demoted);
  std::vector<ModelCache::StoredPageCopy> after;
  ASSERT_TRUE(cache.FetchStored(seq.get(), 0, n, &after).ok());
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].format, before[i].format) << i;
    if (i + 1 < after.size()) {  // full pages
      EXPECT_EQ(after[i].data, before[i].data) << i;
    }
  }
  EXPECT_TRUE(tokens_kv() == kv_before);
  // Retried, the token commits and page 2 is demoted for good.
  ASSERT_TRUE(attend(1).ok());
  EXPECT_EQ(cache.Length(seq.get()), n + 1);
  EXPECT_EQ(counters.demoted_pages.load(), demoted + 1);
  EXPECT_EQ(pools(), (std::vector<int32_t>{used[0] - 1, used[1] + 1}));
  std::vector<ModelCache::StoredPageCopy> done;
  ASSERT_TRUE(cache.FetchStored(seq.get(), 0, n + 1, &done).ok());
  EXPECT_EQ(done[2].format, "int2-oscar");
  {
    std::lock_guard<std::mutex> lock(seq->mu);
    EXPECT_EQ(seq->tokens.back(), 4242);
    EXPECT_EQ(seq->tokens.size(), static_cast<size_t>(n + 1));
  }
  cache.Close(seq.get());
}

// Memory shares (issue #21, fair sharing): a tenant may hold floor(share * pages) of each
// pool. Past its share it evicts only its own unpinned pages, and fails RESOURCE_EXHAUSTED
// (naming tenant, share and usage, evicting nothing) when those are too few; another
// tenant's pages survive byte-identical and still match. Below its share a tenant evicts
// by plain LRU, so the greedy tenant's pages cannot keep the pool from the others.
struct ShareFixture {
  // 16 pages of 4 tokens; `greedy` may hold half of them. high_watermark 1: no watermark
  // eviction, only what allocation needs.
  explicit ShareFixture(double high = 1.0, double low = 0.9) : backend(MakeCpuBackend(1)) {
    spec = TinySpec(16 * 1024);
    auto c = ModelCache::Create(spec, backend.get(), high, low, &counters);
    EXPECT_TRUE(c.ok()) << c.status();
    cache = std::move(*c);
    cache->set_memory_shares([](const std::string& t) { return t == "greedy" ? 0.5 : 1.0; });
  }
  // Puts n tokens starting at token id `first` for `tenant`; K/V kept for comparison.
  absl::Status Put(const std::string& tenant, int32_t first, int64_t n) {
    k[first] = RandomKv(spec, n, static_cast<uint32_t>(first));
    v[first] = RandomKv(spec, n, static_cast<uint32_t>(first) + 7777);
    return cache->Put(tenant, Tokens(n, first), 0, Rows(spec, k[first], n), Rows(spec, v[first], n))
        .status();
  }
  int64_t Match(const std::string& tenant, int32_t first, int64_t n) {
    return cache->Match(tenant, Tokens(n, first));
  }
  std::map<std::string, int64_t> Held() {
    std::map<std::string, int64_t> held;
    for (const auto& t : cache->Snapshot().tenants) held[t.tenant] = t.pages[0];
    return held;
  }
  // The prompt opens on its whole cached prefix and fetches back exactly the K/V put.
  void ExpectIntact(const std::string& tenant, int32_t first, int64_t n) {
    auto seq = cache->Open(static_cast<uint64_t>(first), tenant, Tokens(n, first));
    ASSERT_EQ(cache->Length(seq.get()), n) << tenant << " " << first;
    std::vector<uint16_t> ko(k[first].size()), vo(v[first].size());
    std::vector<std::string> formats;
    ASSERT_TRUE(cache->Fetch(seq.get(), 0, n, ko.data(), vo.data(), &formats).ok());
    EXPECT_EQ(ko, k[first]) << tenant << " " << first;
    EXPECT_EQ(vo, v[first]) << tenant << " " << first;
    cache->Close(seq.get());
  }
  ModelSpec spec;
  std::unique_ptr<Backend> backend;
  CacheCounters counters;
  std::unique_ptr<ModelCache> cache;
  std::map<int32_t, std::vector<uint16_t>> k, v;
};

TEST(ModelCacheShareTest, AGreedyTenantPastItsShareEvictsOnlyItsOwnPages) {
  ShareFixture f;
  // polite: 8 pages (prompts at token ids 1000, 2000, 3000, 4000); greedy: 8 (its share).
  ASSERT_TRUE(f.Put("polite", 1000, 8).ok());
  ASSERT_TRUE(f.Put("polite", 2000, 8).ok());
  ASSERT_TRUE(f.Put("polite", 3000, 12).ok());
  ASSERT_TRUE(f.Put("polite", 4000, 4).ok());
  for (int32_t g = 1; g <= 4; ++g) ASSERT_TRUE(f.Put("greedy", 100 * g, 8).ok()) << g;
  EXPECT_EQ(f.Held(), (std::map<std::string, int64_t>{{"greedy", 8}, {"polite", 8}}));
  const ModelSnapshot snap = f.cache->Snapshot();
  ASSERT_EQ(snap.tenants.size(), 2u);
  EXPECT_EQ(snap.tenants[0].tenant, "greedy");
  EXPECT_EQ(snap.tenants[0].limit, std::vector<int64_t>{8});
  EXPECT_EQ(snap.tenants[1].limit, std::vector<int64_t>{INT64_MAX});
  EXPECT_EQ(snap.pools[0].pages_used, 16);

  // The pool is full; greedy's next prompt evicts greedy's least recently used one, though
  // polite's pages are older.
  ASSERT_TRUE(f.Put("greedy", 500, 8).ok());
  EXPECT_EQ(f.counters.evicted_pages.load(), 2u);
  EXPECT_EQ(f.Match("greedy", 100, 8), 0);
  for (int32_t g = 2; g <= 5; ++g) EXPECT_EQ(f.Match("greedy", 100 * g, 8), 8) << g;
  EXPECT_EQ(f.Held(), (std::map<std::string, int64_t>{{"greedy", 8}, {"polite", 8}}));

  // More than its whole share in one call: refused before anything is evicted.
  absl::Status s = f.Put("greedy", 600, 40);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("more than its whole share"), std::string::npos) << s;
  EXPECT_EQ(f.counters.evicted_pages.load(), 2u);

  // With greedy's pages pinned by its sequences, greedy cannot get a page: not by evicting
  // polite's, and not from the pool.
  std::vector<std::shared_ptr<Sequence>> pins;
  for (int32_t g = 2; g <= 5; ++g) pins.push_back(f.cache->Open(g, "greedy", Tokens(8, 100 * g)));
  s = f.Put("greedy", 700, 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("tenant 'greedy' (cache_salt) holds 8 of the 16 pages of the bf16 "
                             "pool, and its max_memory_share 0.5 lets it hold 8"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("nothing was evicted"), std::string::npos) << s;
  const auto k1 = RandomKv(f.spec, 1, 9), v1 = RandomKv(f.spec, 1, 10);
  auto appended =
      f.cache->Append(pins[0].get(), Tokens(1, 9000), Rows(f.spec, k1, 1), Rows(f.spec, v1, 1));
  EXPECT_EQ(appended.status().code(), absl::StatusCode::kResourceExhausted) << appended.status();
  EXPECT_EQ(f.cache->Length(pins[0].get()), 8);
  EXPECT_EQ(f.counters.evicted_pages.load(), 2u);
  EXPECT_EQ(f.Held(), (std::map<std::string, int64_t>{{"greedy", 8}, {"polite", 8}}));
  // polite's prompts all survive, byte for byte.
  f.ExpectIntact("polite", 1000, 8);
  f.ExpectIntact("polite", 2000, 8);
  f.ExpectIntact("polite", 3000, 12);
  f.ExpectIntact("polite", 4000, 4);
  for (auto& seq : pins) f.cache->Close(seq.get());

  // Below its share a tenant evicts by LRU over everyone: polite's new prompt takes the
  // least recently used pages, greedy's.
  for (int32_t p : {1000, 2000, 3000, 4000}) f.Match("polite", p, 12);  // refresh polite's
  ASSERT_TRUE(f.Put("polite", 5000, 8).ok());
  EXPECT_EQ(f.Match("greedy", 200, 8), 0);
  EXPECT_EQ(f.Held(), (std::map<std::string, int64_t>{{"greedy", 6}, {"polite", 10}}));
  // Closing and evicting return every page to its owner's count.
  f.cache.reset();
}

TEST(ModelCacheShareTest, AWatermarkEvictionCausedByATenantAtItsShareTakesOnlyItsPages) {
  ShareFixture f(0.95, 0.85);  // over 15.2 pages used: evict down to 13.6
  ASSERT_TRUE(f.Put("polite", 1000, 8).ok());
  ASSERT_TRUE(f.Put("polite", 2000, 8).ok());
  ASSERT_TRUE(f.Put("polite", 3000, 12).ok());
  ASSERT_TRUE(f.Put("polite", 4000, 4).ok());
  for (int32_t g = 1; g <= 3; ++g) ASSERT_TRUE(f.Put("greedy", 100 * g, 8).ok()) << g;
  EXPECT_EQ(f.counters.evicted_pages.load(), 0u);
  // This Put fills the pool and puts greedy at its share: greedy's oldest two prompts go.
  ASSERT_TRUE(f.Put("greedy", 400, 8).ok());
  EXPECT_EQ(f.counters.evicted_pages.load(), 4u);
  EXPECT_EQ(f.Match("greedy", 100, 8), 0);
  EXPECT_EQ(f.Match("greedy", 200, 8), 0);
  EXPECT_EQ(f.Match("greedy", 400, 8), 8);
  EXPECT_EQ(f.Held(), (std::map<std::string, int64_t>{{"greedy", 4}, {"polite", 8}}));
  f.ExpectIntact("polite", 1000, 8);
  f.ExpectIntact("polite", 3000, 12);
}

// A fused decode batch of two tenants: the one past its share evicts only its own pages,
// and a batch that cannot be served changes nothing.
TEST(ModelCacheShareTest, AMixedTenantDecodeBatchHonoursEachShare) {
  ShareFixture f;
  // greedy holds 8 (its share) in 2 sequences of 4 pages each... and one cached prompt.
  ASSERT_TRUE(f.Put("greedy", 100, 8).ok());  // 2 cached pages, unpinned
  std::vector<std::shared_ptr<Sequence>> seqs;
  const int64_t n = 12;
  const auto k = RandomKv(f.spec, n, 1), v = RandomKv(f.spec, n, 2);
  seqs.push_back(f.cache->Open(1, "greedy", {}));
  ASSERT_TRUE(
      f.cache->Append(seqs[0].get(), Tokens(n), Rows(f.spec, k, n), Rows(f.spec, v, n)).ok());
  seqs.push_back(f.cache->Open(2, "polite", {}));
  ASSERT_TRUE(
      f.cache->Append(seqs[1].get(), Tokens(n), Rows(f.spec, k, n), Rows(f.spec, v, n)).ok());
  ASSERT_TRUE(f.Put("greedy", 200, 12).ok());  // greedy: 2 + 3 + 3 = 8
  ASSERT_TRUE(f.Put("polite", 1000, 8).ok());  // polite: 3 + 2
  EXPECT_EQ(f.Held(), (std::map<std::string, int64_t>{{"greedy", 8}, {"polite", 5}}));
  const int64_t row = int64_t{f.spec.num_kv_heads} * f.spec.head_dim;
  std::vector<uint16_t> k_new(static_cast<size_t>(2 * row)), v_new(k_new.size());
  for (size_t i = 0; i < k_new.size(); ++i) k_new[i] = v_new[i] = kernels::FloatToBf16(0.25f);
  std::vector<float> q(static_cast<size_t>(2 * f.spec.num_q_heads * f.spec.head_dim), 0.5f);
  std::vector<float> o(q.size()), lse(static_cast<size_t>(2 * f.spec.num_q_heads));
  const std::vector<int32_t> tokens = {5, 6};
  ModelCache::NewTokens nt;
  nt.tokens = tokens;
  nt.k = Rows(f.spec, k_new, 2);
  nt.v = Rows(f.spec, v_new, 2);
  nt.k.layer_stride = nt.v.layer_stride = 0;
  Sequence* batch[] = {seqs[0].get(), seqs[1].get()};
  std::vector<int64_t> lengths;
  // Both need a page; greedy is at its share and evicts its least recently used prompt.
  ASSERT_TRUE(f.cache->Attend(0, batch, q.data(), 0.25f, nt, o.data(), lse.data(), &lengths).ok());
  EXPECT_EQ(lengths, (std::vector<int64_t>{n + 1, n + 1}));
  EXPECT_EQ(f.Match("greedy", 100, 8), 0);
  EXPECT_EQ(f.Match("greedy", 200, 12), 12);
  EXPECT_EQ(f.Held(), (std::map<std::string, int64_t>{{"greedy", 7}, {"polite", 6}}));
  for (auto& seq : seqs) f.cache->Close(seq.get());
  EXPECT_EQ(f.Held(), (std::map<std::string, int64_t>{{"greedy", 3}, {"polite", 2}}));
}

TEST(ModelCacheTest, FsqNeedsAMatchingCodec) {
  const ModelSpec s = TinyFsqSpec();
  auto backend = MakeCpuBackend(1);
  CacheCounters counters;
  auto none = ModelCache::Create(s, backend.get(), 0.95, 0.85, &counters);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(none.status().message()).find("needs its codec"), std::string::npos);
  FsqCodecShape other = FsqShape(s);
  other.latent_width = 8;  // G of the codec != the profile's
  auto wrong = ModelCache::Create(s, backend.get(), 0.95, 0.85, &counters,
                                  FsqCodec::Synthetic(other, 1).ToSafetensors().Serialize());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(
      std::string(wrong.status().message()).find("metadata 'latent_width' is '8', expected 9"),
      std::string::npos)
      << wrong.status();
}

TEST(ModelCacheTest, VersionThreeCodecSelectsInt2TransformAndBadFilesRegisterNothing) {
  const ModelSpec s = TinyTransformSpec();
  auto backend = MakeCpuBackend(1);
  CacheCounters counters;
  auto ok = ModelCache::Create(s, backend.get(), 0.95, 0.85, &counters,
                               TransformBlob(s.num_layers, s.num_kv_heads, s.head_dim));
  ASSERT_TRUE(ok.ok()) << ok.status();
  const ModelSnapshot snap = (*ok)->Snapshot();
  ASSERT_EQ(snap.pools.size(), 2u);
  EXPECT_EQ(snap.pools[1].format, "int2-transform");
  EXPECT_NE(snap.codec.find("int2-transform"), std::string::npos) << snap.codec;
  const struct {
    std::string blob;
    const char* says;
  } bad[] = {
      {TransformBlob(s.num_layers + 1, s.num_kv_heads, s.head_dim), "more layers than the model"},
      {TransformBlob(s.num_layers, s.num_kv_heads, 2 * s.head_dim),
       "k_encode must be F32 [2, 16, 16]"},
      {TransformBlob(s.num_layers, 1, s.head_dim), "k_encode must be F32 [2, 16, 16]"},
      {TransformBlob(s.num_layers, s.num_kv_heads, s.head_dim).substr(0, 100), "codec_blob: "},
  };
  for (const auto& b : bad) {
    auto r = ModelCache::Create(s, backend.get(), 0.95, 0.85, &counters, b.blob);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.says;
    EXPECT_NE(std::string(r.status().message()).find(b.says), std::string::npos) << r.status();
    EXPECT_NE(std::string(r.status().message()).find("tiny-int2-transform"), std::string::npos)
        << r.status();
  }
}

}  // namespace model_cache_test
}  // namespace kvcd
