// The FSQ formats on the CPU backend against the kernels' definitions: codes written from
// residuals are FsqEncodeRows in the page layout (history and window pages alike), demotion
// copies a window page's codes so a token's code does not depend on when it is demoted,
// expansion is FsqExpandToken at the token's absolute position, attention is the kernel
// oracle with the segment's first position, and the host checks name the bad page.
#include "server/formats/fsq/fsq_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "format_test_util.h"
#include "kvcd/kernels/bf16.h"
#include "server/formats/bf16/bf16_format.h"

namespace kvcd {
namespace fsq_format_test {

using format_test::F32Rows;
using format_test::RandomFloats;
using format_test::TestPool;

constexpr PageGeometry kGeo{2, 2, 16, 4};  // layers, kv heads, head_dim, page size
constexpr int kC = 24;                     // residual width
constexpr int kG = 7;                      // latent width (odd: a spare nibble per token)

std::shared_ptr<const FsqModelCodec> Codec(bool key_norm, bool interleaved) {
  FsqCodecShape s;
  s.num_layers = kGeo.num_layers;
  s.residual_width = kC;
  s.latent_width = kG;
  s.num_kv_heads = kGeo.num_kv_heads;
  s.head_dim = kGeo.head_dim;
  s.key_norm = key_norm;
  auto m = std::make_shared<FsqModelCodec>();
  m->codec = FsqCodec::Synthetic(s, 11);
  m->rope.theta = 10000.0;
  m->rope.rotary_dims = 12;  // partial RoPE: dims 12..15 pass through
  m->rope.pairing = interleaved ? kernels::RopePairing::kInterleaved : kernels::RopePairing::kHalf;
  return m;
}

// The code of residual row `x` at layer l, as the kernels define it.
std::vector<uint8_t> Encode(const FsqModelCodec& m, int l, const float* x) {
  std::vector<uint8_t> code(static_cast<size_t>(kernels::FsqCodeBytes(kG)));
  const kernels::FsqLayerCodec c = m.codec.Layer(l);
  kernels::FsqEncodeRows(c, x, 1, code.data());
  return code;
}

TEST(FsqFormatTest, SizesCountEveryStoredByte) {
  auto m = Codec(false, false);
  auto hist = MakeFsqCpuFormat(kGeo, m);
  auto window = MakeFsqWindowCpuFormat(kGeo, m);
  EXPECT_EQ(hist->id(), FormatId::kFsq);
  EXPECT_STREQ(hist->name(), "fsq");
  EXPECT_STREQ(window->name(), "bf16+fsq");
  const int64_t code = 4;  // ceil(7 / 2)
  EXPECT_EQ(hist->layer_page_bytes(), kGeo.page_size * code);
  const int64_t bf16 = Bf16Format(kGeo).layer_page_bytes();
  EXPECT_EQ(window->layer_page_bytes(), bf16 + kGeo.page_size * code);
  EXPECT_DOUBLE_EQ(hist->bits_per_element(), 8.0 * code / (2.0 * 2 * 16));
  EXPECT_DOUBLE_EQ(window->bits_per_element(),
                   8.0 * (bf16 + kGeo.page_size * code) / (2.0 * 2 * 16 * kGeo.page_size));
  EXPECT_FALSE(hist->stores_kv());
  EXPECT_TRUE(hist->needs_residuals());
  EXPECT_TRUE(window->stores_kv());
  EXPECT_TRUE(window->needs_residuals());
}

TEST(FsqFormatTest, WriteCodesIsTheEncoderInThePageLayout) {
  auto m = Codec(false, false);
  auto hist = MakeFsqCpuFormat(kGeo, m);
  const int64_t tokens = 2 * kGeo.page_size + 3;
  const auto x = RandomFloats(kGeo.num_layers * tokens * kC, 1);
  TestPool p(kGeo, hist->layer_page_bytes(), 4);
  const std::vector<int32_t> pages = {2, 0};
  const auto slots = PageRowSlots(3, pages, kGeo.page_size);
  ASSERT_TRUE(hist->WriteCodes(F32Rows(x, tokens, kC), slots, -1, p.pool).ok());
  int nonzero = 0;
  for (size_t i = 0; i < pages.size(); ++i) {
    for (int32_t l = 0; l < kGeo.num_layers; ++l) {
      for (int32_t t = 0; t < kGeo.page_size; ++t) {
        const int64_t tok = 3 + static_cast<int64_t>(i) * kGeo.page_size + t;
        const auto want = Encode(*m, l, x.data() + (l * tokens + tok) * kC);
        const uint8_t* got = p.pool.PagePtr(l, pages[i]) + t * 4;
        EXPECT_EQ(std::vector<uint8_t>(got, got + 4), want) << "page " << i << " l " << l;
        for (uint8_t b : want) nonzero += b != 0x88;
        EXPECT_EQ(want[3] & 0xf0, 0);  // odd G: the spare nibble is 0
      }
    }
  }
  EXPECT_GT(nonzero, 0);  // the codes are not all z = 0
  // Untouched pages stay zero; one layer at a time writes only that layer.
  EXPECT_EQ(p.pool.PagePtr(0, 1)[0], 0);
  TestPool one(kGeo, hist->layer_page_bytes(), 1);
  const auto x1 = RandomFloats(kC, 9);
  ASSERT_TRUE(hist->WriteCodes(F32Rows(x1, 1, kC), {{0, 0, 2}}, 1, one.pool).ok());
  EXPECT_EQ(std::vector<uint8_t>(one.pool.PagePtr(1, 0) + 8, one.pool.PagePtr(1, 0) + 12),
            Encode(*m, 1, x1.data()));
  EXPECT_EQ(one.pool.PagePtr(0, 0)[8], 0);
  // K/V never go to history pages.
  EXPECT_EQ(hist->WritePages(F32Rows(x, 1, kC), F32Rows(x, 1, kC), 0, {0}, one.pool).code(),
            absl::StatusCode::kUnimplemented);
}

// A token's code is the same whether its page is put straight into the history or demoted
// from the window (early or late): the window keeps codes written at arrival.
TEST(FsqFormatTest, DemotionCopiesTheCodesWrittenAtArrival) {
  auto m = Codec(true, false);
  auto hist = MakeFsqCpuFormat(kGeo, m);
  auto window = MakeFsqWindowCpuFormat(kGeo, m);
  const int64_t tokens = kGeo.page_size;
  const int64_t row = int64_t{kGeo.num_kv_heads} * kGeo.head_dim;
  const auto x = RandomFloats(kGeo.num_layers * tokens * kC, 3);
  const auto k = RandomFloats(kGeo.num_layers * tokens * row, 4);
  const auto v = RandomFloats(kGeo.num_layers * tokens * row, 5);
  // Put path: codes straight into an fsq page.
  TestPool direct(kGeo, hist->layer_page_bytes(), 2);
  ASSERT_TRUE(hist->WriteCodes(F32Rows(x, tokens, kC), PageRowSlots(0, {1}, kGeo.page_size), -1,
                               direct.pool)
                  .ok());
  // Append path: token by token into a window page, then demoted.
  TestPool win(kGeo, window->layer_page_bytes(), 1);
  for (int64_t t = 0; t < tokens; ++t) {
    const std::vector<RowSlot> slot = {{t, 0, static_cast<int32_t>(t)}};
    ASSERT_TRUE(
        window->WriteRows(F32Rows(k, tokens, row), F32Rows(v, tokens, row), slot, -1, win.pool)
            .ok());
    ASSERT_TRUE(window->WriteCodes(F32Rows(x, tokens, kC), slot, -1, win.pool).ok());
  }
  TestPool demoted(kGeo, hist->layer_page_bytes(), 2);
  ASSERT_TRUE(hist->Demote(win.pool, {0}, demoted.pool, {1}).ok());
  for (int32_t l = 0; l < kGeo.num_layers; ++l) {
    EXPECT_EQ(0, std::memcmp(demoted.pool.PagePtr(l, 1), direct.pool.PagePtr(l, 1),
                             static_cast<size_t>(hist->layer_page_bytes())));
  }
  // The window page's K/V part is the bf16 format's, and reads back as BF16 K/V.
  auto bf16 = MakeBf16CpuFormat(kGeo, nullptr);
  std::vector<float> got(static_cast<size_t>(kGeo.head_dim)), want(got.size());
  window->ExpandRows(win.pool.PagePtr(1, 0), 1, 1, 1, 0, 2, 1, got.data());
  for (int i = 0; i < kGeo.head_dim; ++i) {
    want[static_cast<size_t>(i)] = kernels::Bf16ToFloat(
        kernels::FloatToBf16(v[static_cast<size_t>((1 * tokens + 2) * row + kGeo.head_dim + i)]));
  }
  EXPECT_EQ(got, want);
}

TEST(FsqFormatTest, ExpandRowsRebuildsAtTheAbsolutePosition) {
  for (bool interleaved : {false, true}) {
    auto m = Codec(true, interleaved);
    auto hist = MakeFsqCpuFormat(kGeo, m);
    const auto x = RandomFloats(kGeo.num_layers * kGeo.page_size * kC, 6);
    TestPool p(kGeo, hist->layer_page_bytes(), 1);
    ASSERT_TRUE(hist->WriteCodes(F32Rows(x, kGeo.page_size, kC),
                                 PageRowSlots(0, {0}, kGeo.page_size), -1, p.pool)
                    .ok());
    const int64_t page_first = 40;
    const int64_t kv = int64_t{kGeo.num_kv_heads} * kGeo.head_dim;
    std::vector<float> k(static_cast<size_t>(kv)), v(k.size());
    std::vector<float> got(static_cast<size_t>(2 * kGeo.head_dim));
    for (int which = 0; which < 2; ++which) {
      hist->ExpandRows(p.pool.PagePtr(1, 0), 1, 1, which, page_first, 1, 2, got.data());
      for (int t = 0; t < 2; ++t) {
        kernels::FsqExpandToken(m->codec.Layer(1), m->rope, p.pool.PagePtr(1, 0) + (1 + t) * 4,
                                page_first + 1 + t, k.data(), v.data());
        for (int i = 0; i < kGeo.head_dim; ++i) {
          EXPECT_EQ(got[static_cast<size_t>(t * kGeo.head_dim + i)],
                    (which == 0 ? k : v)[static_cast<size_t>(kGeo.head_dim + i)]);
        }
      }
    }
    // Keys depend on the position (RoPE), values do not.
    std::vector<float> k0(static_cast<size_t>(kGeo.head_dim)), k1(k0.size());
    hist->ExpandRows(p.pool.PagePtr(0, 0), 0, 0, 0, 0, 0, 1, k0.data());
    hist->ExpandRows(p.pool.PagePtr(0, 0), 0, 0, 0, 7, 0, 1, k1.data());
    EXPECT_NE(k0, k1);
    hist->ExpandRows(p.pool.PagePtr(0, 0), 0, 0, 1, 0, 0, 1, k0.data());
    hist->ExpandRows(p.pool.PagePtr(0, 0), 0, 0, 1, 7, 0, 1, k1.data());
    EXPECT_EQ(k0, k1);
  }
}

TEST(FsqFormatTest, AttendIsTheOracleAtTheSegmentPosition) {
  for (bool key_norm : {false, true}) {
    auto m = Codec(key_norm, !key_norm);
    auto hist = MakeFsqCpuFormat(kGeo, m);
    const int32_t num_pages = 3;
    const int64_t tokens = num_pages * kGeo.page_size;
    const auto x = RandomFloats(kGeo.num_layers * tokens * kC, 7);
    TestPool p(kGeo, hist->layer_page_bytes(), 5);
    const std::vector<int32_t> ids = {4, 1, 3};
    ASSERT_TRUE(
        hist->WriteCodes(F32Rows(x, tokens, kC), PageRowSlots(0, ids, kGeo.page_size), -1, p.pool)
            .ok());
    const int group = 2;
    const auto q = RandomFloats(group * kGeo.head_dim, 8);
    const float scale = 1.0f / std::sqrt(static_cast<float>(kGeo.head_dim));
    std::vector<float> o(static_cast<size_t>(group * kGeo.head_dim)), lse(group);
    std::vector<float> o_ref(o.size()), lse_ref(lse.size());
    const int64_t first_position = 8;
    hist->cpu()->Attend(p.pool, 1, ids, first_position, 1, q.data(), group, scale, 2, tokens - 1,
                        o.data(), lse.data());
    kernels::FsqPageTable t;
    t.base = p.pool.LayerBase(1);
    t.page_stride = p.pool.layer_page_bytes();
    t.page_ids = ids.data();
    t.num_pages = num_pages;
    t.page_size = kGeo.page_size;
    t.first_position = first_position;
    kernels::AttendFsqPagesReference(t, m->codec.Layer(1), m->rope, 1, q.data(), group, scale, 2,
                                     tokens - 1, o_ref.data(), lse_ref.data());
    for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(o[i], o_ref[i], 1e-4f) << i;
    for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], lse_ref[i], 1e-4f) << i;
    // Another position gives another answer (keys carry RoPE).
    std::vector<float> o_other(o.size()), lse_other(lse.size());
    hist->cpu()->Attend(p.pool, 1, ids, 0, 1, q.data(), group, scale, 2, tokens - 1, o_other.data(),
                        lse_other.data());
    EXPECT_NE(lse_other, lse);
  }
}

TEST(FsqFormatTest, ChecksNameThePage) {
  auto m = Codec(false, false);
  auto hist = MakeFsqCpuFormat(kGeo, m);
  auto window = MakeFsqWindowCpuFormat(kGeo, m);
  const int64_t hb = hist->page_bytes();
  std::vector<uint8_t> pages(static_cast<size_t>(2 * hb), 0x88);
  for (int64_t i = 3; i < 2 * hb; i += 4) pages[static_cast<size_t>(i)] = 0x08;  // spare = 0
  EXPECT_TRUE(hist->CheckPages(pages.data(), 2, 5).ok());
  // Page 1, layer 1, token 2: the spare nibble is set.
  pages[static_cast<size_t>(hb + hist->layer_page_bytes() + 2 * 4 + 3)] = 0x18;
  const absl::Status s = hist->CheckPages(pages.data(), 2, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("page 6 layer 1 token 2"), std::string::npos) << s;

  const int64_t wb = window->page_bytes();
  std::vector<uint8_t> wpages(static_cast<size_t>(wb), 0);
  EXPECT_TRUE(window->CheckPages(wpages.data(), 1, 0).ok());
  const uint16_t nan = 0x7fc0;
  std::memcpy(wpages.data() + window->layer_page_bytes() + 6, &nan, 2);  // layer 1
  const absl::Status w = window->CheckPages(wpages.data(), 1, 3);
  EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(w.message()).find("page 3 layer 1"), std::string::npos) << w;
  std::memcpy(wpages.data() + window->layer_page_bytes() + 6, "\0\0", 2);
  wpages[static_cast<size_t>(window->layer_page_bytes() - 1)] = 0xf0;  // layer 0, last token
  EXPECT_NE(std::string(window->CheckPages(wpages.data(), 1, 0).message()).find("layer 0 token 3"),
            std::string::npos);
}

}  // namespace fsq_format_test
}  // namespace kvcd
