// The BF16 format on the CPU backend: rows land in the page layout (rotated when the model
// has a rotation, bit-identical to RotateRows + FloatToBf16), single rows go to one layer
// or all, the host check names the page and layer, expansion un-rotates.
#include "server/formats/bf16/bf16_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "format_test_util.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/finite_check.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd {
namespace bf16_format_test {

using format_test::Bf16Rows;
using format_test::KvRow;
using format_test::RandomBf16;

constexpr PageGeometry kGeo{3, 2, 16, 4};  // layers, kv heads, head_dim, page size

const uint16_t* Row(const PagePool& pool, int32_t layer, int32_t page, int which, int32_t head,
                    int32_t slot) {
  return reinterpret_cast<const uint16_t*>(pool.PagePtr(layer, page)) +
         ((int64_t{which} * kGeo.num_kv_heads + head) * kGeo.page_size + slot) * kGeo.head_dim;
}

TEST(Bf16FormatTest, WritePagesAndRowsPlaceRowsInTheLayout) {
  for (bool rotate : {false, true}) {
    auto rot = rotate ? std::make_shared<const CodecProfile>(
                            CodecProfile::Hadamard(kGeo.num_layers, kGeo.head_dim))
                      : nullptr;
    auto f = MakeBf16CpuFormat(kGeo, rot);
    EXPECT_STREQ(f->name(), "bf16");
    const int64_t tokens = 2 * kGeo.page_size;
    const int64_t row = int64_t{kGeo.num_kv_heads} * kGeo.head_dim;
    const auto k = RandomBf16(kGeo.num_layers * tokens * row, 1);
    const auto v = RandomBf16(kGeo.num_layers * tokens * row, 2);
    std::vector<uint8_t> mem(static_cast<size_t>(f->page_bytes() * 3));
    PagePool pool("bf16", mem.data(), kGeo.num_layers, f->layer_page_bytes(), 3);
    ASSERT_TRUE(f->WritePages(Bf16Rows(k, tokens, KvRow(kGeo)), Bf16Rows(v, tokens, KvRow(kGeo)), 0,
                              {2, 1}, pool)
                    .ok());
    std::vector<float> x(kGeo.head_dim), y(kGeo.head_dim);
    std::vector<uint16_t> want(kGeo.head_dim);
    for (int32_t l = 0; l < kGeo.num_layers; ++l) {
      for (int64_t t = 0; t < tokens; ++t) {
        for (int which = 0; which < 2; ++which) {
          for (int32_t h = 0; h < kGeo.num_kv_heads; ++h) {
            const uint16_t* src =
                (which == 0 ? k : v).data() + (l * tokens + t) * row + h * kGeo.head_dim;
            if (rotate) {
              kernels::Bf16ToFloatN(src, x.data(), kGeo.head_dim);
              kernels::RotateRows(x.data(), 1, kGeo.head_dim, which == 0 ? rot->RK(l) : rot->RV(l),
                                  y.data());
              kernels::FloatToBf16N(y.data(), want.data(), kGeo.head_dim);
            } else {
              std::copy_n(src, kGeo.head_dim, want.begin());
            }
            const int32_t page = t < kGeo.page_size ? 2 : 1;
            const uint16_t* got =
                Row(pool, l, page, which, h, static_cast<int32_t>(t % kGeo.page_size));
            ASSERT_TRUE(std::equal(want.begin(), want.end(), got))
                << "rotate " << rotate << " layer " << l << " token " << t;
          }
        }
      }
    }
    // One token's rows at layer 1 only (a one-layer source), into page 0 slot 3.
    const auto k1 = RandomBf16(row, 3), v1 = RandomBf16(row, 4);
    std::vector<uint8_t> before = mem;
    ASSERT_TRUE(f->WriteRows(Bf16Rows(k1, 1, KvRow(kGeo)), Bf16Rows(v1, 1, KvRow(kGeo)),
                             {{0, 0, 3}}, 1, pool)
                    .ok());
    int64_t changed_other_layers = 0;
    for (int32_t l : {0, 2}) {
      const uint8_t* a = pool.PagePtr(l, 0);
      changed_other_layers +=
          !std::equal(a, a + f->layer_page_bytes(), before.data() + (a - mem.data()));
    }
    EXPECT_EQ(changed_other_layers, 0);
    // Expansion of that row un-rotates it back to (about) the input.
    std::vector<float> got(kGeo.head_dim);
    f->ExpandRows(pool.PagePtr(1, 0), 1, 1, 1, 0, 3, 1, got.data());
    for (int32_t j = 0; j < kGeo.head_dim; ++j) {
      EXPECT_NEAR(got[j], kernels::Bf16ToFloat(v1[kGeo.head_dim + j]), rotate ? 0.05 : 0.0);
    }
  }
}

TEST(Bf16FormatTest, CheckPagesNamesTheNonFiniteValue) {
  auto f = MakeBf16CpuFormat(kGeo, nullptr);
  std::vector<uint16_t> pages(static_cast<size_t>(2 * f->page_bytes() / 2), 0x3f80);  // 1.0
  EXPECT_TRUE(f->CheckPages(reinterpret_cast<const uint8_t*>(pages.data()), 2, 0).ok());
  // +Inf in page 1, layer 2.
  pages[static_cast<size_t>((1 * kGeo.num_layers + 2) * f->layer_page_bytes() / 2 + 5)] = 0x7f80;
  absl::Status s = f->CheckPages(reinterpret_cast<const uint8_t*>(pages.data()), 2, 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("page 8 layer 2"), absl::string_view::npos) << s;
  // Device pages on a backend without a device.
  EXPECT_EQ(f->CheckDevicePages(nullptr, 1, 0).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(Bf16FormatTest, FormatNamesRoundTrip) {
  for (FormatId id : {FormatId::kBf16, FormatId::kInt2Oscar, FormatId::kFsq}) {
    FormatId parsed = FormatId::kBf16;
    ASSERT_TRUE(ParseFormatName(FormatName(id), "history_format", &parsed).ok());
    EXPECT_EQ(parsed, id);
  }
  FormatId out;
  absl::Status s = ParseFormatName("int4", "history_format", &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("history_format is 'int4'"), absl::string_view::npos);
  // The window format of FSQ models is not a history format a config may name.
  s = ParseFormatName("bf16+fsq", "history_format", &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expected 'bf16', 'int2-oscar' or 'fsq'"), absl::string_view::npos);
}

}  // namespace bf16_format_test
}  // namespace kvcd

namespace kvcd {
namespace bf16_format_test {

// Issue #21.3, fused: with check_finite the write path refuses the first NaN/Inf it reads,
// naming the tensor and the value's flat index (the same index the whole-tensor scan
// kernels::FirstNonFiniteReference gives for a single bad value), for BF16 and F32 rows,
// rotated or not, whole pages and single rows; without it, or with every value finite,
// the pages are bit-identical to an unchecked write.
TEST(Bf16FormatTest, CheckedWritesRefuseNonFiniteValuesByFlatIndex) {
  const int64_t tokens = 2 * kGeo.page_size;
  const int64_t row = int64_t{kGeo.num_kv_heads} * kGeo.head_dim;
  const int64_t n = kGeo.num_layers * tokens * row;
  std::mt19937 rng(7);
  for (bool rotate : {false, true}) {
    auto rot = rotate ? std::make_shared<const CodecProfile>(
                            CodecProfile::Hadamard(kGeo.num_layers, kGeo.head_dim))
                      : nullptr;
    auto f = MakeBf16CpuFormat(kGeo, rot);
    for (bool bf16 : {true, false}) {
      auto k16 = RandomBf16(n, 11), v16 = RandomBf16(n, 12);
      std::vector<float> k32(static_cast<size_t>(n)), v32(static_cast<size_t>(n));
      kernels::Bf16ToFloatN(k16.data(), k32.data(), n);
      kernels::Bf16ToFloatN(v16.data(), v32.data(), n);
      auto rows = [&](bool is_k, bool check) {
        RowSource r = Bf16Rows(k16, tokens, KvRow(kGeo));
        r.data = bf16 ? static_cast<const void*>((is_k ? k16 : v16).data())
                      : static_cast<const void*>((is_k ? k32 : v32).data());
        r.is_bf16 = bf16;
        r.check_finite = check;
        r.name = is_k ? "k" : "v";
        return r;
      };
      std::vector<uint8_t> plain(static_cast<size_t>(f->page_bytes() * 2));
      std::vector<uint8_t> checked(plain.size());
      PagePool plain_pool("bf16", plain.data(), kGeo.num_layers, f->layer_page_bytes(), 2);
      PagePool checked_pool("bf16", checked.data(), kGeo.num_layers, f->layer_page_bytes(), 2);
      ASSERT_TRUE(f->WritePages(rows(true, false), rows(false, false), 0, {0, 1}, plain_pool).ok());
      ASSERT_TRUE(f->WritePages(rows(true, true), rows(false, true), 0, {0, 1}, checked_pool).ok());
      EXPECT_EQ(plain, checked) << "rotate " << rotate << " bf16 " << bf16;

      for (int trial = 0; trial < 20; ++trial) {
        const bool in_k = trial % 2 == 0;
        const int64_t i = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
        const int kind = trial % 3;  // NaN, +Inf, -Inf
        const float bad = kind == 0   ? std::nanf("")
                          : kind == 1 ? std::numeric_limits<float>::infinity()
                                      : -std::numeric_limits<float>::infinity();
        auto& t16 = in_k ? k16 : v16;
        auto& t32 = in_k ? k32 : v32;
        const uint16_t keep16 = t16[static_cast<size_t>(i)];
        const float keep32 = t32[static_cast<size_t>(i)];
        t16[static_cast<size_t>(i)] = kernels::FloatToBf16(bad);
        t32[static_cast<size_t>(i)] = bad;
        const void* data = bf16 ? static_cast<const void*>(t16.data()) : t32.data();
        ASSERT_EQ(kernels::FirstNonFiniteReference(data, n, bf16), i);
        const std::string want = absl::StrCat(in_k ? "k" : "v", "[", i, "]");
        const char* what = kind == 0 ? "NaN" : (kind == 1 ? "+Inf" : "-Inf");
        absl::Status s =
            f->WritePages(rows(true, true), rows(false, true), 0, {0, 1}, checked_pool);
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
        EXPECT_NE(s.message().find(want), absl::string_view::npos) << s << " want " << want;
        EXPECT_NE(s.message().find(what), absl::string_view::npos) << s;
        // Single rows, every layer: token t of the source to slot t of page 0.
        std::vector<RowSlot> slots;
        for (int32_t t = 0; t < kGeo.page_size; ++t) slots.push_back({t, 0, t});
        const int64_t token = (i / row) % tokens;
        s = f->WriteRows(rows(true, true), rows(false, true), slots, -1, checked_pool);
        if (token < kGeo.page_size) {
          EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
          EXPECT_NE(s.message().find(want), absl::string_view::npos) << s << " want " << want;
        } else {
          EXPECT_TRUE(s.ok()) << "token " << token << " is not written: " << s;
        }
        // Unchecked, the same rows are written without complaint (the engine checks first).
        EXPECT_TRUE(
            f->WritePages(rows(true, false), rows(false, false), 0, {0, 1}, plain_pool).ok());
        t16[static_cast<size_t>(i)] = keep16;
        t32[static_cast<size_t>(i)] = keep32;
      }
    }
  }
}

}  // namespace bf16_format_test
}  // namespace kvcd
