// The int2-transform format on the CPU backend: pages written from request rows hold the
// daemon's key encoder and per-head INT2 values in the page layout, demotion from a BF16
// window page equals writing its rows, attention on the codes matches exact attention over
// the expanded rows, and the host check names the bad page and layer.
#include "server/formats/int2_transform/int2_transform_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "format_test_util.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/reference_attention.h"
#include "kvcd/kernels/transform_attention.h"
#include "server/formats/bf16/bf16_format.h"

namespace kvcd {
namespace int2_transform_format_test {

using format_test::Bf16Rows;
using format_test::KvRow;
using format_test::RandomBf16;
using format_test::TestPool;

constexpr PageGeometry kGeo{2, 3, 32, 8};  // layers, kv heads, head_dim, page size

std::shared_ptr<const KeyTransformProfile> Profile() {
  auto heads =
      KeyTransformProfile::SyntheticHeads(kGeo.num_layers, kGeo.num_kv_heads, kGeo.head_dim, 5);
  auto file =
      SafetensorsFile::Parse(KeyTransformProfile::ToSafetensors(
                                 heads, kGeo.num_layers, kGeo.num_kv_heads, kGeo.head_dim, "test")
                                 .Serialize());
  EXPECT_TRUE(file.ok());
  auto p = KeyTransformProfile::FromSafetensors(*file, kGeo.num_layers, kGeo.num_kv_heads,
                                                kGeo.head_dim);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::make_shared<const KeyTransformProfile>(std::move(*p));
}

TEST(Int2TransformFormatTest, WritePagesIsTheCodecInThePageLayout) {
  auto profile = Profile();
  auto f = MakeInt2TransformCpuFormat(kGeo, profile);
  EXPECT_EQ(f->id(), FormatId::kInt2Transform);
  EXPECT_STREQ(f->name(), "int2-transform");
  // 80 key code bits + 16 gain bits and INT2's 64 + 32 per pair of 32-value rows: INT2's.
  EXPECT_DOUBLE_EQ(f->bits_per_element(), 2.0 + 32.0 / kGeo.head_dim);
  EXPECT_EQ(f->rotation(), nullptr);  // the window keeps rows as given
  const int64_t tokens = 2 * kGeo.page_size + 3;
  const auto k = RandomBf16(kGeo.num_layers * tokens * KvRow(kGeo), 1, 1.0f, 2.0f),
             v = RandomBf16(kGeo.num_layers * tokens * KvRow(kGeo), 2, 1.0f, 2.0f);
  TestPool p(kGeo, f->layer_page_bytes(), 4, 0xA5);
  const std::vector<int32_t> pages = {2, 0};
  ASSERT_TRUE(f->WritePages(Bf16Rows(k, tokens, KvRow(kGeo)), Bf16Rows(v, tokens, KvRow(kGeo)), 3,
                            pages, p.pool)
                  .ok());
  std::vector<uint8_t> want = p.mem;
  const kernels::TransformPageLayout layout{kGeo.num_kv_heads, kGeo.page_size, kGeo.head_dim,
                                            profile->key_code_bits() / 8};
  const int d = kGeo.head_dim, ps = kGeo.page_size;
  std::vector<float> rows(static_cast<size_t>(ps * d)), got(rows.size()), dec(rows.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    for (int32_t l = 0; l < kGeo.num_layers; ++l) {
      uint8_t* page = want.data() + (p.pool.PagePtr(l, pages[i]) - p.mem.data());
      for (int32_t h = 0; h < kGeo.num_kv_heads; ++h) {
        for (int which = 0; which < 2; ++which) {
          const auto& src = which == 0 ? k : v;
          for (int32_t t = 0; t < ps; ++t) {
            const int64_t tok = 3 + static_cast<int64_t>(i) * ps + t;
            for (int c = 0; c < d; ++c) {
              rows[t * d + c] =
                  kernels::Bf16ToFloat(src[((l * tokens + tok) * kGeo.num_kv_heads + h) * d + c]);
            }
          }
          if (which == 0) {
            kernels::EncodeTransformKeys(profile->KeyCode(l, h), rows.data(), ps,
                                         page + layout.KCodes(h), layout.code_bytes,
                                         reinterpret_cast<uint16_t*>(page + layout.KGains(h)));
            kernels::DecodeTransformKeys(
                profile->KeyCode(l, h), page + layout.KCodes(h), layout.code_bytes,
                reinterpret_cast<uint16_t*>(page + layout.KGains(h)), 1, ps, dec.data());
          } else {
            const auto& x = profile->head(l, h);
            kernels::DemoteRowsToInt2(rows.data(), ps, d, x.r_v.data(), x.rho_v, layout.V(page, h));
            kernels::ExpandInt2Rows(layout.V(page, h), ps, d, x.r_v.data(), dec.data());
          }
          // Expansion decodes keys and un-rotates values.
          f->ExpandRows(p.pool.PagePtr(l, pages[i]), l, h, which, 0, 0, ps, got.data());
          EXPECT_EQ(got, dec) << "layer " << l << " head " << h << " which " << which;
        }
      }
    }
  }
  EXPECT_EQ(p.mem, want);
}

TEST(Int2TransformFormatTest, DemoteEncodesTheWindowRowsAsStored) {
  auto profile = Profile();
  auto f = MakeInt2TransformCpuFormat(kGeo, profile);
  auto window = MakeBf16CpuFormat(kGeo, nullptr);
  const int64_t tokens = kGeo.page_size;
  const auto k = RandomBf16(kGeo.num_layers * tokens * KvRow(kGeo), 3, 1.0f, 2.0f),
             v = RandomBf16(kGeo.num_layers * tokens * KvRow(kGeo), 4, 1.0f, 2.0f);
  TestPool wp(kGeo, window->layer_page_bytes(), 2, 0xA5), hp(kGeo, f->layer_page_bytes(), 2, 0xA5),
      direct(kGeo, f->layer_page_bytes(), 2, 0xA5);
  ASSERT_TRUE(window
                  ->WritePages(Bf16Rows(k, tokens, KvRow(kGeo)), Bf16Rows(v, tokens, KvRow(kGeo)),
                               0, {1}, wp.pool)
                  .ok());
  ASSERT_TRUE(f->Demote(wp.pool, {1}, hp.pool, {0}).ok());
  ASSERT_TRUE(f->WritePages(Bf16Rows(k, tokens, KvRow(kGeo)), Bf16Rows(v, tokens, KvRow(kGeo)), 0,
                            {0}, direct.pool)
                  .ok());
  for (int32_t l = 0; l < kGeo.num_layers; ++l) {
    EXPECT_EQ(std::memcmp(hp.pool.PagePtr(l, 0), direct.pool.PagePtr(l, 0),
                          static_cast<size_t>(f->layer_page_bytes())),
              0)
        << "layer " << l;
  }
}

TEST(Int2TransformFormatTest, AttendOnTheCodesMatchesAttentionOverTheExpandedRows) {
  auto profile = Profile();
  auto f = MakeInt2TransformCpuFormat(kGeo, profile);
  const int d = kGeo.head_dim, ps = kGeo.page_size, hkv = kGeo.num_kv_heads, group = 3;
  const int64_t tokens = 3 * ps;
  const auto k = RandomBf16(kGeo.num_layers * tokens * KvRow(kGeo), 5, 1.0f, 2.0f),
             v = RandomBf16(kGeo.num_layers * tokens * KvRow(kGeo), 6, 1.0f, 2.0f);
  TestPool p(kGeo, f->layer_page_bytes(), 5, 0xA5);
  const std::vector<int32_t> pages = {4, 1, 3};
  ASSERT_TRUE(f->WritePages(Bf16Rows(k, tokens, KvRow(kGeo)), Bf16Rows(v, tokens, KvRow(kGeo)), 0,
                            pages, p.pool)
                  .ok());
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<float> q(static_cast<size_t>(group * d));
  for (auto& x : q) x = normal(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int32_t l = 1;
  for (int32_t h = 0; h < hkv; ++h) {
    // The rows as the format expands them, as one KV head of a dense layer.
    std::vector<float> kr(static_cast<size_t>(tokens * d)), vr(kr.size());
    for (size_t i = 0; i < pages.size(); ++i) {
      f->ExpandRows(p.pool.PagePtr(l, pages[i]), l, h, 0, 0, 0, ps, kr.data() + i * ps * d);
      f->ExpandRows(p.pool.PagePtr(l, pages[i]), l, h, 1, 0, 0, ps, vr.data() + i * ps * d);
    }
    std::vector<double> ro(q.size()), rl(group);
    kernels::ReferenceAttention(q.data(), kr.data(), vr.data(), tokens, group, 1, d, scale,
                                ro.data(), rl.data());
    std::vector<float> o(q.size()), lse(group);
    f->cpu()->Attend(p.pool, l, pages, 0, h, q.data(), group, scale, 0, tokens, o.data(),
                     lse.data());
    for (size_t i = 0; i < o.size(); ++i)
      EXPECT_NEAR(o[i], ro[i], 1e-4) << "head " << h << " " << i;
    for (int i = 0; i < group; ++i) EXPECT_NEAR(lse[i], rl[i], 1e-4) << "head " << h;
  }
}

TEST(Int2TransformFormatTest, CheckPagesNamesTheBadPageAndLayer) {
  auto profile = Profile();
  auto f = MakeInt2TransformCpuFormat(kGeo, profile);
  const int64_t tokens = 2 * kGeo.page_size;
  const auto k = RandomBf16(kGeo.num_layers * tokens * KvRow(kGeo), 8, 1.0f, 2.0f),
             v = RandomBf16(kGeo.num_layers * tokens * KvRow(kGeo), 9, 1.0f, 2.0f);
  TestPool p(kGeo, f->layer_page_bytes(), 2, 0xA5);
  ASSERT_TRUE(f->WritePages(Bf16Rows(k, tokens, KvRow(kGeo)), Bf16Rows(v, tokens, KvRow(kGeo)), 0,
                            {0, 1}, p.pool)
                  .ok());
  // Pages travel as [page][layer][layer_page_bytes].
  std::vector<uint8_t> run;
  for (int32_t i = 0; i < 2; ++i)
    for (int32_t l = 0; l < kGeo.num_layers; ++l)
      run.insert(run.end(), p.pool.PagePtr(l, i), p.pool.PagePtr(l, i) + f->layer_page_bytes());
  ASSERT_TRUE(f->CheckPages(run.data(), 2, 10).ok());
  const kernels::TransformPageLayout layout{kGeo.num_kv_heads, kGeo.page_size, kGeo.head_dim,
                                            profile->key_code_bits() / 8};
  std::vector<uint8_t> bad = run;
  const int64_t at = (1 * kGeo.num_layers + 1) * f->layer_page_bytes();    // page 1, layer 1
  bad[at + layout.KGains(2) + 2] = 0, bad[at + layout.KGains(2) + 3] = 0;  // a zero key gain
  auto s = f->CheckPages(bad.data(), 2, 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("page 11 layer 1"), std::string::npos) << s;
  bad = run;
  bad[at + layout.VParams(0) + 1] = 0x7c;  // an infinite value scale
  s = f->CheckPages(bad.data(), 2, 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("page 11 layer 1"), std::string::npos) << s;
}

}  // namespace int2_transform_format_test
}  // namespace kvcd
