// The INT2 format on the CPU backend against the codec reference: pages written from
// request rows hold exactly what DemoteRowsToInt2 makes of them in the page layout,
// demotion from a BF16 window page equals quantizing its (rotated) rows, the host check
// names the bad page and layer, and expansion un-rotates.
#include "server/formats/int2_oscar/int2_oscar_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "format_test_util.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/int2_codec.h"
#include "server/formats/bf16/bf16_format.h"

namespace kvcd {
namespace int2_oscar_format_test {

using format_test::F32Rows;
using format_test::KvRow;
using format_test::RandomFloats;
using format_test::TestPool;

constexpr PageGeometry kGeo{2, 3, 32, 8};  // layers, kv heads, head_dim, page size

std::shared_ptr<const CodecProfile> Hadamard() {
  return std::make_shared<const CodecProfile>(
      CodecProfile::Hadamard(kGeo.num_layers, kGeo.head_dim));
}

TEST(Int2OscarFormatTest, WritePagesIsTheCodecInThePageLayout) {
  auto codec = Hadamard();
  auto f = MakeInt2OscarCpuFormat(kGeo, codec);
  EXPECT_EQ(f->id(), FormatId::kInt2Oscar);
  EXPECT_STREQ(f->name(), "int2-oscar");
  EXPECT_DOUBLE_EQ(f->bits_per_element(), 2.0 + 32.0 / kGeo.head_dim);
  const int64_t tokens = 2 * kGeo.page_size + 3;
  const int64_t row = int64_t{kGeo.num_kv_heads} * kGeo.head_dim;
  const auto k = RandomFloats(kGeo.num_layers * tokens * row, 1);
  const auto v = RandomFloats(kGeo.num_layers * tokens * row, 2);
  TestPool p(kGeo, f->layer_page_bytes(), 4, 0xA5);
  // Source tokens 3.. fill pages 2 and 0 (in that order).
  const std::vector<int32_t> pages = {2, 0};
  ASSERT_TRUE(f->WritePages(F32Rows(k, tokens, KvRow(kGeo)), F32Rows(v, tokens, KvRow(kGeo)), 3,
                            pages, p.pool)
                  .ok());
  std::vector<uint8_t> want = p.mem;
  const kernels::Int2PageLayout layout{kGeo.num_kv_heads, kGeo.page_size, kGeo.head_dim};
  std::vector<float> rows(static_cast<size_t>(kGeo.page_size * kGeo.head_dim));
  for (size_t i = 0; i < pages.size(); ++i) {
    for (int32_t l = 0; l < kGeo.num_layers; ++l) {
      uint8_t* page = want.data() + (p.pool.PagePtr(l, pages[i]) - p.mem.data());
      for (int32_t h = 0; h < kGeo.num_kv_heads; ++h) {
        for (int which = 0; which < 2; ++which) {
          const auto& src = which == 0 ? k : v;
          for (int32_t t = 0; t < kGeo.page_size; ++t) {
            const int64_t tok = 3 + static_cast<int64_t>(i) * kGeo.page_size + t;
            std::copy_n(src.begin() + (l * tokens + tok) * row + h * kGeo.head_dim, kGeo.head_dim,
                        rows.begin() + t * kGeo.head_dim);
          }
          kernels::DemoteRowsToInt2(rows.data(), kGeo.page_size, kGeo.head_dim,
                                    which == 0 ? codec->RK(l) : codec->RV(l),
                                    which == 0 ? codec->RhoK(l) : codec->RhoV(l),
                                    which == 0 ? layout.K(page, h) : layout.V(page, h));
        }
      }
    }
  }
  EXPECT_TRUE(p.mem == want);
  // The rows are not written one at a time.
  EXPECT_EQ(f->WriteRows(F32Rows(k, tokens, KvRow(kGeo)), F32Rows(v, tokens, KvRow(kGeo)),
                         {{0, 1, 0}}, -1, p.pool)
                .code(),
            absl::StatusCode::kUnimplemented);
}

TEST(Int2OscarFormatTest, DemoteQuantizesTheWindowRowsAsStored) {
  auto codec = Hadamard();
  auto window = MakeBf16CpuFormat(kGeo, codec);
  auto f = MakeInt2OscarCpuFormat(kGeo, codec);
  const int64_t tokens = kGeo.page_size;
  const int64_t row = int64_t{kGeo.num_kv_heads} * kGeo.head_dim;
  const auto k = RandomFloats(kGeo.num_layers * tokens * row, 3);
  const auto v = RandomFloats(kGeo.num_layers * tokens * row, 4);
  TestPool wp(kGeo, window->layer_page_bytes(), 2, 0xA5), hp(kGeo, f->layer_page_bytes(), 2, 0xA5);
  ASSERT_TRUE(window
                  ->WritePages(F32Rows(k, tokens, KvRow(kGeo)), F32Rows(v, tokens, KvRow(kGeo)), 0,
                               {1}, wp.pool)
                  .ok());
  ASSERT_TRUE(f->Demote(wp.pool, {1}, hp.pool, {0}).ok());
  // Reference: the window's BF16 (rotated) rows through the codec without rotation.
  const kernels::Int2PageLayout layout{kGeo.num_kv_heads, kGeo.page_size, kGeo.head_dim};
  std::vector<uint8_t> want(static_cast<size_t>(f->layer_page_bytes()));
  std::vector<float> rows(static_cast<size_t>(kGeo.page_size * kGeo.head_dim));
  for (int32_t l = 0; l < kGeo.num_layers; ++l) {
    const auto* w = reinterpret_cast<const uint16_t*>(wp.pool.PagePtr(l, 1));
    std::fill(want.begin(), want.end(), 0xA5);
    for (int32_t h = 0; h < kGeo.num_kv_heads; ++h) {
      for (int which = 0; which < 2; ++which) {
        kernels::Bf16ToFloatN(
            w + (int64_t{which} * kGeo.num_kv_heads + h) * kGeo.page_size * kGeo.head_dim,
            rows.data(), kGeo.page_size * kGeo.head_dim);
        kernels::DemoteRowsToInt2(rows.data(), kGeo.page_size, kGeo.head_dim, nullptr,
                                  which == 0 ? codec->RhoK(l) : codec->RhoV(l),
                                  which == 0 ? layout.K(want.data(), h) : layout.V(want.data(), h));
      }
    }
    EXPECT_TRUE(std::equal(want.begin(), want.end(), hp.pool.PagePtr(l, 0))) << "layer " << l;
  }
}

TEST(Int2OscarFormatTest, CheckPagesNamesTheBadPageAndLayer) {
  auto f = MakeInt2OscarCpuFormat(kGeo, Hadamard());
  const Int2OscarFormat layout(kGeo);
  std::vector<uint8_t> pages(static_cast<size_t>(3 * f->page_bytes()), 0x11);  // codes: any
  // Valid parameters everywhere: FP16 0x3c00 (1.0).
  for (int64_t p = 0; p < 3 * kGeo.num_layers; ++p) {
    for (int64_t i = 0; i < layout.ParamsCount(); ++i) {
      uint8_t* h = pages.data() + p * f->layer_page_bytes() + layout.ParamsOffset() + 2 * i;
      h[0] = 0x00;
      h[1] = 0x3c;
    }
  }
  EXPECT_TRUE(f->CheckPages(pages.data(), 3, 10).ok());
  // A negative scale (first block of page 2, layer 1).
  uint8_t* scale =
      pages.data() + (2 * kGeo.num_layers + 1) * f->layer_page_bytes() + layout.ParamsOffset();
  scale[1] = 0xbc;  // -1.0
  absl::Status s = f->CheckPages(pages.data(), 3, 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("page 12 layer 1"), absl::string_view::npos) << s;
  scale[1] = 0x3c;
  // A negative minimum is fine; an infinite one is not.
  uint8_t* lo = scale + 2 * kGeo.page_size;
  lo[1] = 0xbc;
  EXPECT_TRUE(f->CheckPages(pages.data(), 3, 10).ok());
  lo[1] = 0x7c;  // +inf
  EXPECT_EQ(f->CheckPages(pages.data(), 3, 10).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Int2OscarFormatTest, ExpandRowsUnrotatesTheDequantizedRows) {
  auto codec = Hadamard();
  auto f = MakeInt2OscarCpuFormat(kGeo, codec);
  const int64_t tokens = kGeo.page_size;
  const int64_t row = int64_t{kGeo.num_kv_heads} * kGeo.head_dim;
  const auto k = RandomFloats(kGeo.num_layers * tokens * row, 5);
  TestPool p(kGeo, f->layer_page_bytes(), 1, 0xA5);
  ASSERT_TRUE(f->WritePages(F32Rows(k, tokens, KvRow(kGeo)), F32Rows(k, tokens, KvRow(kGeo)), 0,
                            {0}, p.pool)
                  .ok());
  std::vector<float> got(static_cast<size_t>(3 * kGeo.head_dim));
  f->ExpandRows(p.pool.PagePtr(1, 0), 1, 2, 0, 0, 4, 3, got.data());
  // Reference: dequantize in the rotated space, then x = y · R^T.
  const kernels::Int2PageLayout layout{kGeo.num_kv_heads, kGeo.page_size, kGeo.head_dim};
  std::vector<float> want(got.size());
  kernels::ExpandInt2Rows(layout.K(p.pool.PagePtr(1, 0), 2), 3, kGeo.head_dim, codec->RK(1),
                          want.data(), 4);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5);
  // And it is near the input (2-bit codes of unit-variance rows).
  double err = 0, norm = 0;
  for (int t = 0; t < 3; ++t) {
    for (int j = 0; j < kGeo.head_dim; ++j) {
      const double x = k[static_cast<size_t>((1 * tokens + 4 + t) * row + 2 * kGeo.head_dim + j)];
      err += (got[t * kGeo.head_dim + j] - x) * (got[t * kGeo.head_dim + j] - x);
      norm += x * x;
    }
  }
  EXPECT_LT(std::sqrt(err / norm), 0.6);
}

}  // namespace int2_oscar_format_test
}  // namespace kvcd

namespace kvcd {
namespace int2_oscar_format_test {

// Issue #21.3, fused: a checked INT2 write refuses a NaN/Inf row before it reaches the
// quantizer (whose integer codes are undefined for them), naming the tensor and flat
// index; all-finite checked writes equal unchecked ones byte for byte.
TEST(Int2OscarFormatTest, CheckedWritePagesRefusesNonFiniteRowsByFlatIndex) {
  auto f = MakeInt2OscarCpuFormat(kGeo, Hadamard());
  const int64_t tokens = 2 * kGeo.page_size;
  const int64_t n = kGeo.num_layers * tokens * kGeo.num_kv_heads * kGeo.head_dim;
  auto k = RandomFloats(n, 21), v = RandomFloats(n, 22);
  auto rows = [&](const std::vector<float>& x, bool check, const char* name) {
    RowSource r = F32Rows(x, tokens, KvRow(kGeo));
    r.check_finite = check;
    r.name = name;
    return r;
  };
  TestPool plain(kGeo, f->layer_page_bytes(), 2, 0xA5),
      checked(kGeo, f->layer_page_bytes(), 2, 0xA5);
  ASSERT_TRUE(f->WritePages(rows(k, false, "k"), rows(v, false, "v"), 0, {0, 1}, plain.pool).ok());
  ASSERT_TRUE(f->WritePages(rows(k, true, "k"), rows(v, true, "v"), 0, {0, 1}, checked.pool).ok());
  EXPECT_EQ(plain.mem, checked.mem);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    auto& x = trial % 2 == 0 ? k : v;
    const int64_t i = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
    const float keep = x[static_cast<size_t>(i)];
    x[static_cast<size_t>(i)] =
        trial % 3 == 0 ? std::nanf("") : std::numeric_limits<float>::infinity();
    absl::Status s =
        f->WritePages(rows(k, true, "k_new"), rows(v, true, "v_new"), 0, {0, 1}, checked.pool);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    const std::string want = absl::StrCat(trial % 2 == 0 ? "k_new" : "v_new", "[", i, "]");
    EXPECT_NE(s.message().find(want), absl::string_view::npos) << s << " want " << want;
    x[static_cast<size_t>(i)] = keep;
  }
}

}  // namespace int2_oscar_format_test
}  // namespace kvcd
