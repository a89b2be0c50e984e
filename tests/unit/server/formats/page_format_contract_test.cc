// The PageFormat contract, for every format of the registry (each history format's model,
// built by its factory for the CPU backend: its window format and its history format):
// layout sizes agree with bits_per_element, stored rows expand back within the format's
// bound, demotion keeps them there, checks refuse bad rows and bad pages, and expanding a
// slot range reads exactly those rows.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/fsq_codec.h"
#include "common/key_transform_profile.h"
#include "format_test_util.h"
#include "server/formats/format_registry.h"

namespace kvcd {
namespace page_format_contract_test {

using format_test::F32Rows;
using format_test::KvRow;
using format_test::RandomFloats;
using format_test::TestPool;

constexpr int kResidual = 24;  // C of the fsq model
constexpr int kLatent = 9;     // G of the fsq model (odd: a spare nibble per token)

// A model of each history format the registry builds, with its codec and how close its
// pages' rows come back (RMS error over RMS value) when stored from float rows.
struct ContractModel {
  ModelSpec spec;
  std::string codec_blob;
  double history_bound;
};

ModelSpec BaseSpec(const std::string& name) {
  ModelSpec s = *BuiltinModelSpec("tiny");  // 2 layers, 2 KV heads, head_dim 16, page 4
  s.name = name;
  return s;
}

std::map<FormatId, ContractModel> ContractModels() {
  std::map<FormatId, ContractModel> m;
  m[FormatId::kBf16] = {BaseSpec("bf16"), "", 1.0 / 128};
  ModelSpec int2 = BaseSpec("int2-oscar");
  int2.history_format = FormatId::kInt2Oscar;
  int2.codec = "hadamard";
  m[FormatId::kInt2Oscar] = {int2, "", 0.5};
  ModelSpec tf = BaseSpec("int2-transform");
  tf.history_format = FormatId::kInt2Oscar;  // a version-3 codec file selects int2-transform
  m[FormatId::kInt2Transform] = {
      tf,
      KeyTransformProfile::ToSafetensors(
          KeyTransformProfile::SyntheticHeads(tf.num_layers, tf.num_kv_heads, tf.head_dim, 3),
          tf.num_layers, tf.num_kv_heads, tf.head_dim, "contract")
          .Serialize(),
      // The synthetic heads give some key directions 0 bits (read back as the mean), which
      // isotropic test rows do not fit as calibrated keys would.
      0.75};
  ModelSpec fsq = BaseSpec("fsq");
  fsq.history_format = FormatId::kFsq;
  fsq.fsq_residual_width = kResidual;
  fsq.fsq_latent_width = kLatent;
  FsqCodecShape shape;
  shape.num_layers = fsq.num_layers;
  shape.residual_width = kResidual;
  shape.latent_width = kLatent;
  shape.num_kv_heads = fsq.num_kv_heads;
  shape.head_dim = fsq.head_dim;
  // Codes only: its rows are rebuilt from codes, so they come back exactly as written
  // (compared after demotion: the codes computed at arrival).
  m[FormatId::kFsq] = {fsq, FsqCodec::Synthetic(shape, 5).ToSafetensors().Serialize(), 0};
  return m;
}

// One format under test: the index-th format (0: window) of the model of `history`.
struct ContractCase {
  FormatId history;
  size_t index;
};

void PrintTo(const ContractCase& c, std::ostream* os) {
  *os << FormatName(c.history) << (c.index == 0 ? " window" : " history");
}

std::vector<ContractCase> AllFormats() {
  std::vector<ContractCase> cases;
  for (const FormatEntry& e : FormatRegistry()) {
    if (e.factory.load == nullptr) continue;  // window formats: built by their history's
    cases.push_back({e.id, 0});
    if (e.id != FormatId::kBf16) cases.push_back({e.id, 1});
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<ContractCase>& info) {
  return absl::StrReplaceAll(
      absl::StrCat(FormatName(info.param.history), info.param.index == 0 ? "_window" : "_history"),
      {{"-", "_"}, {"+", "_"}});
}

class PageFormatContract : public ::testing::TestWithParam<ContractCase> {
 protected:
  static constexpr int32_t kPages = 2;

  void SetUp() override {
    const auto models = ContractModels();
    auto it = models.find(GetParam().history);
    ASSERT_NE(it, models.end()) << "no contract model for " << FormatName(GetParam().history);
    model_ = it->second;
    auto codec = LoadModelCodec(model_.spec, model_.codec_blob);
    ASSERT_TRUE(codec.ok()) << codec.status();
    ASSERT_EQ((*codec)->history(), GetParam().history);
    const ModelSpec& s = model_.spec;
    g_ = PageGeometry{s.num_layers, s.num_kv_heads, s.head_dim, s.page_size};
    auto formats = (*codec)->CreateFormats(g_, BackendKind::kCpu);
    ASSERT_TRUE(formats.ok()) << formats.status();
    ASSERT_GT(formats->size(), GetParam().index);
    formats_ = std::move(*formats);
    tokens_ = int64_t{kPages} * g_.page_size;
    k_ = RandomFloats(g_.num_layers * tokens_ * KvRow(g_), 1, 0.5f, 1.5f);
    v_ = RandomFloats(g_.num_layers * tokens_ * KvRow(g_), 2);
    x_ = RandomFloats(g_.num_layers * tokens_ * kResidual, 3);
  }

  const PageFormat& format() const { return *formats_[GetParam().index]; }
  const PageFormat& window() const { return *formats_[0]; }
  double bound() const { return GetParam().index == 0 ? 1.0 / 128 : model_.history_bound; }

  // Writes tokens [0, kPages * page_size) into pages 0.. of `pool` as the cache does: K/V
  // (formats that store them) and the residuals' codes (formats that need them).
  absl::Status Store(const PageFormat& f, const PagePool& pool, const std::vector<float>& k) const {
    const std::vector<int32_t> pages = {0, 1};
    if (f.stores_kv()) {
      RowSource kr = F32Rows(k, tokens_, KvRow(g_)), vr = F32Rows(v_, tokens_, KvRow(g_));
      kr.check_finite = vr.check_finite = true;
      kr.name = "k";
      vr.name = "v";
      if (absl::Status s = f.WritePages(kr, vr, 0, pages, pool); !s.ok()) return s;
    }
    if (f.needs_residuals()) {
      RowSource xr = F32Rows(x_, tokens_, kResidual);
      xr.check_finite = true;
      xr.name = "x";
      const std::vector<RowSlot> rows = PageRowSlots(0, pages, g_.page_size);
      if (absl::Status s = f.WriteCodes(xr, rows, -1, pool); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Every row of the pool's pages 0.., expanded: [layer][page][which][head][slot][d].
  std::vector<float> ExpandAll(const PageFormat& f, const PagePool& pool) const {
    std::vector<float> out;
    std::vector<float> rows(static_cast<size_t>(g_.page_size) * g_.head_dim);
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      for (int32_t p = 0; p < kPages; ++p) {
        for (int which = 0; which < 2; ++which) {
          for (int32_t h = 0; h < g_.num_kv_heads; ++h) {
            f.ExpandRows(pool.PagePtr(l, p), l, h, which, int64_t{p} * g_.page_size, 0,
                         g_.page_size, rows.data());
            out.insert(out.end(), rows.begin(), rows.end());
          }
        }
      }
    }
    return out;
  }

  // The input rows in ExpandAll's order.
  std::vector<float> InputAll() const {
    std::vector<float> out;
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      for (int32_t p = 0; p < kPages; ++p) {
        for (int which = 0; which < 2; ++which) {
          const std::vector<float>& src = which == 0 ? k_ : v_;
          for (int32_t h = 0; h < g_.num_kv_heads; ++h) {
            for (int32_t t = 0; t < g_.page_size; ++t) {
              const int64_t token = int64_t{p} * g_.page_size + t;
              const float* row =
                  src.data() + (l * tokens_ + token) * KvRow(g_) + int64_t{h} * g_.head_dim;
              out.insert(out.end(), row, row + g_.head_dim);
            }
          }
        }
      }
    }
    return out;
  }

  static double RelativeRms(const std::vector<float>& got, const std::vector<float>& want) {
    EXPECT_EQ(got.size(), want.size());
    double err = 0, ref = 0;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
      if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
      err += (got[i] - want[i]) * double{got[i] - want[i]};
      ref += want[i] * double{want[i]};
    }
    return ref > 0 ? std::sqrt(err / ref) : std::sqrt(err);
  }

  ContractModel model_;
  PageGeometry g_;
  std::vector<std::unique_ptr<PageFormat>> formats_;
  int64_t tokens_ = 0;
  std::vector<float> k_, v_, x_;
};

TEST_P(PageFormatContract, LayoutSizesCountEveryStoredBit) {
  const PageFormat& f = format();
  EXPECT_EQ(f.page_bytes(), f.layer_page_bytes() * g_.num_layers);
  EXPECT_GT(f.layer_page_bytes(), 0);
  const double elements = 2.0 * g_.num_kv_heads * g_.head_dim * g_.page_size;
  EXPECT_NEAR(f.bits_per_element() * elements, 8.0 * f.layer_page_bytes(),
              1e-9 * f.layer_page_bytes());
  EXPECT_STREQ(f.name(), FormatName(f.id()));
  EXPECT_EQ(f.geometry().page_size, g_.page_size);
  EXPECT_NE(f.cpu(), nullptr);  // built for the CPU backend
  EXPECT_EQ(f.cuda(), nullptr);
}

TEST_P(PageFormatContract, StoredRowsExpandWithinTheFormatsBound) {
  const PageFormat& f = format();
  if (!f.stores_kv()) GTEST_SKIP() << f.name() << " stores codes only (see Demote below)";
  TestPool p(f, kPages);
  ASSERT_TRUE(Store(f, p.pool, k_).ok());
  const double err = RelativeRms(ExpandAll(f, p.pool), InputAll());
  EXPECT_LE(err, bound()) << f.name();
}

TEST_P(PageFormatContract, DemotedPagesExpandAsPagesWrittenDirectly) {
  if (GetParam().index == 0) GTEST_SKIP() << "window formats are not demoted into";
  const PageFormat& f = format();
  TestPool win(window(), kPages), direct(f, kPages), demoted(f, kPages);
  ASSERT_TRUE(Store(window(), win.pool, k_).ok());
  ASSERT_TRUE(Store(f, direct.pool, k_).ok());
  ASSERT_TRUE(f.Demote(win.pool, {0, 1}, demoted.pool, {0, 1}).ok());
  const std::vector<float> from_demotion = ExpandAll(f, demoted.pool);
  EXPECT_LE(RelativeRms(from_demotion, ExpandAll(f, direct.pool)), bound()) << f.name();
  if (f.stores_kv()) {
    EXPECT_LE(RelativeRms(from_demotion, InputAll()), bound()) << f.name();
  }
}

TEST_P(PageFormatContract, ChecksRefuseBadRowsAndBadPages) {
  const PageFormat& f = format();
  TestPool p(f, kPages);
  // A NaN in the rows the format reads: refused, naming the tensor and the flat index.
  std::vector<float> bad_k = k_;
  bad_k[static_cast<size_t>(KvRow(g_) + 3)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> bad_x = x_;
  bad_x[static_cast<size_t>(kResidual + 3)] = std::numeric_limits<float>::quiet_NaN();
  if (f.stores_kv()) {
    const absl::Status s = Store(f, p.pool, bad_k);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(absl::StrCat("k[", KvRow(g_) + 3, "]")), std::string::npos) << s;
  }
  if (f.needs_residuals()) {
    std::swap(x_, bad_x);
    const std::vector<int32_t> pages = {0, 1};
    RowSource xr = F32Rows(x_, tokens_, kResidual);
    xr.check_finite = true;
    xr.name = "x";
    const absl::Status s = f.WriteCodes(xr, PageRowSlots(0, pages, g_.page_size), -1, p.pool);
    std::swap(x_, bad_x);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(absl::StrCat("x[", kResidual + 3, "]")), std::string::npos) << s;
  }
  // Pages as they travel ([page][layer][layer bytes]): the format's own pass, all-ones bytes
  // (NaN values, NaN parameters, set spare nibbles) are refused naming the page.
  TestPool good(f, kPages);
  ASSERT_TRUE(Store(f, good.pool, k_).ok());
  std::vector<uint8_t> run(static_cast<size_t>(f.page_bytes() * kPages));
  for (int32_t page = 0; page < kPages; ++page) {
    for (int32_t l = 0; l < g_.num_layers; ++l) {
      const uint8_t* src = good.pool.PagePtr(l, page);
      std::copy(src, src + f.layer_page_bytes(),
                run.begin() + (int64_t{page} * g_.num_layers + l) * f.layer_page_bytes());
    }
  }
  EXPECT_TRUE(f.CheckPages(run.data(), kPages, 0).ok()) << f.CheckPages(run.data(), kPages, 0);
  std::fill(run.begin() + f.page_bytes(), run.end(), 0xff);
  const absl::Status s = f.CheckPages(run.data(), kPages, 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("page 8 layer 0"), std::string::npos) << s;
}

TEST_P(PageFormatContract, ExpandingASlotRangeReadsThoseRows) {
  const PageFormat& f = format();
  TestPool p(f, kPages);
  ASSERT_TRUE(Store(f, p.pool, k_).ok());
  const int32_t ps = g_.page_size, d = g_.head_dim;
  std::vector<float> all(static_cast<size_t>(ps) * d), part(static_cast<size_t>(ps) * d);
  for (int32_t l = 0; l < g_.num_layers; ++l) {
    for (int which = 0; which < 2; ++which) {
      const int32_t h = g_.num_kv_heads - 1;
      f.ExpandRows(p.pool.PagePtr(l, 1), l, h, which, ps, 0, ps, all.data());
      f.ExpandRows(p.pool.PagePtr(l, 1), l, h, which, ps, 1, ps - 2, part.data());
      for (int64_t i = 0; i < int64_t{ps - 2} * d; ++i) {
        ASSERT_EQ(part[static_cast<size_t>(i)], all[static_cast<size_t>(d + i)])
            << f.name() << " layer " << l << " which " << which << " value " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, PageFormatContract, ::testing::ValuesIn(AllFormats()), CaseName);

// Every format with a factory has a contract model above (a new format gets one too).
TEST(PageFormatContractTest, EveryRegisteredFormatIsCovered) {
  const auto models = ContractModels();
  for (const FormatEntry& e : FormatRegistry()) {
    if (e.factory.load != nullptr) {
      EXPECT_EQ(models.count(e.id), 1u) << e.name;
    }
  }
}

}  // namespace page_format_contract_test
}  // namespace kvcd
