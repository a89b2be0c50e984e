// kvcd-calibrate / kvcd-eval defects of issue #22: clip search scored as kvcd stores (BF16
// windows, whole held-out fraction, grid below 0.88), refusal of dumps shorter than the
// windows and of codec files with more layers, singular covariances, per-head codec files
// (version 2), and the progress bar off terminals.
#include "tools/calibration.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "common/codec_profile.h"
#include "kvcd/kernels/bf16.h"
#include "testing/synthetic_activations.h"
#include "tools/eval.h"
#include "tools/progress.h"

namespace kvcd {
namespace calibration_test {

ActivationDump Synthetic(int layers, int64_t tokens, int d, uint64_t seed) {
  ActivationSpec spec;
  spec.num_layers = layers;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = d;
  spec.tokens = tokens;
  spec.seed = seed;
  return ActivationDump{layers, 4, 2, d, tokens, "synthetic", GenerateActivations(spec)};
}

std::vector<float> Bf16(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = kernels::Bf16ToFloat(kernels::FloatToBf16(x[i]));
  return y;
}

TEST(CalibrationTest, HeldOutQueriesCoverTheWholeHeldOutFraction) {
  auto all = HeldOutQueries(80, 100, 64);  // 20 held out: all of them
  ASSERT_EQ(all.size(), 20u);
  EXPECT_EQ(all.front(), 80);
  EXPECT_EQ(all.back(), 99);
  auto sub = HeldOutQueries(400, 1000, 64);  // 600 held out: 64 evenly spaced
  ASSERT_EQ(sub.size(), 64u);
  EXPECT_EQ(sub.front(), 400);
  EXPECT_EQ(sub.back(), 999);
  for (size_t i = 1; i < sub.size(); ++i) {
    EXPECT_GE(sub[i] - sub[i - 1], 9);
    EXPECT_LE(sub[i] - sub[i - 1], 10);
  }
}

TEST(CalibrationTest, StoredAttentionErrorKeepsTheWindowsBf16) {
  const int d = 32;
  ActivationDump dump = Synthetic(1, 128, d, 3);
  const LayerActivations& a = dump.layers[0];
  const auto kb = Bf16(a.k), vb = Bf16(a.v);
  const std::vector<float> zeros(a.k.size(), 0.0f);  // a codec that loses everything
  const std::vector<int64_t> queries = {100, 127};
  // Windows that cover every row: the codec's rows are never used, only BF16 rounding.
  StoredWindows all_bf16{200, 0};
  const double bf16 = StoredAttentionError(a, 4, 2, d, kb, vb, zeros, zeros, all_bf16, queries, -1);
  EXPECT_LT(bf16, 0.01);
  // Sink 8 + recent 16: rows [8, t - 15) come from the codec (zeros): a large error.
  const double hist =
      StoredAttentionError(a, 4, 2, d, kb, vb, zeros, zeros, StoredWindows{8, 16}, queries, -1);
  EXPECT_GT(hist, 0.1);
  // Only the first kv head's query heads: the second head's codec rows do not matter.
  std::vector<float> half = kb;
  for (int64_t t = 0; t < 128; ++t)
    for (int c = 0; c < d; ++c) half[(t * 2 + 0) * d + c] = 0.0f;  // kill kv head 0 only
  const double h1 =
      StoredAttentionError(a, 4, 2, d, kb, vb, half, vb, StoredWindows{8, 16}, queries, 1);
  EXPECT_LT(h1, 0.01);
  const double h0 =
      StoredAttentionError(a, 4, 2, d, kb, vb, half, vb, StoredWindows{8, 16}, queries, 0);
  EXPECT_GT(h0, 0.05);
}

TEST(CalibrationTest, ClipSearchScoresStoredHistoryOverAGridBelow088) {
  const std::vector<float> grid = ClipGrid();
  EXPECT_LE(grid.front(), 0.6f + 1e-6f);
  EXPECT_EQ(grid.back(), 1.0f);
  const int d = 32;
  ActivationDump dump = Synthetic(1, 320, d, 5);
  CalibrationOptions opt;
  opt.search_clip = true;
  opt.holdout = 0.25;  // queries 240..319
  opt.windows = {16, 32};
  opt.max_queries = 80;  // all of the held-out fraction
  CalibrationReport report;
  auto cal = Calibrate(dump, opt, &report);
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_TRUE(report.warnings.empty());
  const LayerCalibration& c = (*cal)[0];
  // The reported error is the stored-windows error of all 80 held-out queries.
  const LayerActivations& a = dump.layers[0];
  const auto kb = Bf16(a.k), vb = Bf16(a.v);
  std::vector<float> kh(a.k.size()), vh(a.v.size());
  auto error_with = [&](float rho_k, float rho_v) {
    Int2Layer l = c.codec;
    l.rho_k = {rho_k};
    l.rho_v = {rho_v};
    Int2RoundTrip(a.k, 320, 2, d, l, 0, -1, &kh);
    Int2RoundTrip(a.v, 320, 2, d, l, 1, -1, &vh);
    return StoredAttentionError(a, 4, 2, d, kb, vb, kh, vh, opt.windows,
                                HeldOutQueries(240, 320, 1000), -1);
  };
  EXPECT_NEAR(c.heldout_error, error_with(c.codec.rho_k[0], c.codec.rho_v[0]), 1e-12);
  // Coordinate descent: the value quantile is the best on the grid for the chosen key one,
  // and the result is no worse than the defaults.
  for (float r : grid) EXPECT_LE(c.heldout_error, error_with(c.codec.rho_k[0], r) + 1e-12);
  EXPECT_LE(c.heldout_error, error_with(0.96f, 0.92f) + 1e-12);
}

TEST(CalibrationTest, JointClipSearchBelowTheOldFloorIsCoordinatewiseOptimal) {
  const std::vector<float> grid = ClipGrid(0.30f);
  EXPECT_FLOAT_EQ(grid.front(), 0.30f);
  EXPECT_EQ(grid.size(), 36u);  // 0.30, 0.32, ..., 1.00
  EXPECT_EQ(grid.back(), 1.0f);
  const int d = 32;
  ActivationDump dump = Synthetic(1, 320, d, 9);
  CalibrationOptions opt;
  opt.search_clip = true;
  opt.joint_clip = true;
  opt.clip_floor = 0.30f;
  opt.hadamard = true;
  opt.holdout = 0.25;
  opt.windows = {16, 32};
  opt.max_queries = 80;
  auto cal = Calibrate(dump, opt);
  ASSERT_TRUE(cal.ok()) << cal.status();
  const LayerCalibration& c = (*cal)[0];
  const LayerActivations& a = dump.layers[0];
  const auto kb = Bf16(a.k), vb = Bf16(a.v);
  std::vector<float> kh(a.k.size()), vh(a.v.size());
  auto error_with = [&](float rho_k, float rho_v) {
    Int2Layer l = c.codec;
    l.rho_k = {rho_k};
    l.rho_v = {rho_v};
    Int2RoundTrip(a.k, 320, 2, d, l, 0, -1, &kh);
    Int2RoundTrip(a.v, 320, 2, d, l, 1, -1, &vh);
    return StoredAttentionError(a, 4, 2, d, kb, vb, kh, vh, opt.windows,
                                HeldOutQueries(240, 320, 1000), -1);
  };
  // Each quantile is the best on the grid given the other (a coordinate-wise optimum).
  for (float r : grid) {
    EXPECT_LE(c.heldout_error, error_with(c.codec.rho_k[0], r) + 1e-12) << r;
    EXPECT_LE(c.heldout_error, error_with(r, c.codec.rho_v[0]) + 1e-12) << r;
  }
}

TEST(CalibrationTest, ShortDumpsWarnAndSingularCovariancesReportInfinity) {
  EXPECT_TRUE(std::isinf(EigenSpread({0.0, 1.0, 2.0})));
  EXPECT_TRUE(std::isinf(EigenSpread({-1e-17, 1.0})));
  EXPECT_DOUBLE_EQ(EigenSpread({0.5, 1.0, 2.0}), 4.0);
  // 6 training tokens: 24 query rows, 12 value rows < head_dim 32.
  ActivationDump dump = Synthetic(1, 8, 32, 7);
  CalibrationReport report;
  auto cal = Calibrate(dump, CalibrationOptions{}, &report);
  ASSERT_TRUE(cal.ok()) << cal.status();
  EXPECT_TRUE(std::isinf((*cal)[0].spread_k));
  EXPECT_TRUE(std::isinf((*cal)[0].spread_v));
  ASSERT_EQ(report.warnings.size(), 2u);  // no INT2 history; singular covariances
  EXPECT_NE(report.warnings[0].find("INT2 history"), std::string::npos);
  EXPECT_NE(report.warnings[1].find("singular covariances on 1 of 1"), std::string::npos);
}

TEST(CalibrationTest, EvalRefusesADumpShorterThanTheWindows) {
  ActivationDump dump = Synthetic(1, 300, 32, 9);
  EvalOptions opt;  // sink 64 + recent 256 > 300 tokens
  auto r = Evaluate(dump, StandardCodecs(1, 32), opt);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("windows"), std::string::npos) << r.status();
  opt.sink = 16;
  opt.recent = 64;
  auto ok = Evaluate(dump, StandardCodecs(1, 32), opt);
  ASSERT_TRUE(ok.ok()) << ok.status();
  for (const auto& c : *ok) EXPECT_TRUE(c.warning.empty()) << c.name;
  // KIVI-2 with fewer tokens than its FP16 window + a group: a warning, not silence.
  ActivationDump short_dump = Synthetic(1, 120, 32, 9);
  opt.sink = 4;
  opt.recent = 8;
  auto warned = Evaluate(short_dump, StandardCodecs(1, 32), opt);
  ASSERT_TRUE(warned.ok()) << warned.status();
  EXPECT_EQ((*warned)[3].name, "kivi2");
  EXPECT_NE((*warned)[3].warning.find("quantizes nothing"), std::string::npos);
  EXPECT_TRUE((*warned)[2].warning.empty());
}

TEST(CalibrationTest, CodecFilesMustMatchTheDumpAndPerHeadFilesAreVersion2) {
  const int d = 32;
  ActivationDump three = Synthetic(3, 200, d, 13);
  ActivationDump two = Synthetic(2, 200, d, 13);
  auto cal = Calibrate(three, CalibrationOptions{});
  ASSERT_TRUE(cal.ok()) << cal.status();
  auto v1 = SafetensorsFile::Parse(CodecFile(*cal, d, "three").Serialize());
  ASSERT_TRUE(v1.ok());
  EXPECT_TRUE(LoadInt2Codec(*v1, three, "v1").ok());
  auto extra = LoadInt2Codec(*v1, two, "v1");
  ASSERT_EQ(extra.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(extra.status().message().find("more layers"), std::string::npos) << extra.status();

  CalibrationOptions per_head;
  per_head.per_head = true;
  auto cal2 = Calibrate(two, per_head);
  ASSERT_TRUE(cal2.ok()) << cal2.status();
  ASSERT_EQ((*cal2)[1].codec.groups, 2);
  // Head 1's rotation comes from head 1's own statistics: not head 0's.
  EXPECT_NE(std::vector<float>((*cal2)[1].codec.r_k.begin(), (*cal2)[1].codec.r_k.begin() + d * d),
            std::vector<float>((*cal2)[1].codec.r_k.begin() + d * d, (*cal2)[1].codec.r_k.end()));
  auto v2 = SafetensorsFile::Parse(CodecFile(*cal2, d, "two").Serialize());
  ASSERT_TRUE(v2.ok());
  auto loaded = LoadInt2Codec(*v2, two, "v2");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->int2.size(), 2u);
  EXPECT_EQ(loaded->int2[1].groups, 2);
  EXPECT_EQ(loaded->int2[1].r_v, (*cal2)[1].codec.r_v);
  EXPECT_EQ(loaded->int2[0].rho_k, (*cal2)[0].codec.rho_k);
  // The daemon's reader (version 1 only) refuses it by its version, not by a shape.
  auto daemon = CodecProfile::FromSafetensors(*v2, 2, d, "v2");
  ASSERT_EQ(daemon.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(daemon.status().message().find("version '2'"), std::string::npos) << daemon.status();
  // Per-head codecs evaluate.
  EvalOptions eo;
  eo.sink = 8;
  eo.recent = 16;
  auto codecs = StandardCodecs(2, d);
  codecs.push_back(*loaded);
  auto r = Evaluate(two, codecs, eo);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(r->back().overall.out_err, (*r)[1].overall.out_err);  // better than naive INT2
  EXPECT_DOUBLE_EQ(r->back().fixed_bytes, 2.0 * 2 * 2 * d * d * 4);
}

TEST(CalibrationTest, ProgressBarDrawsOnlyOnTerminals) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  auto off = LayerProgress(file);  // a file is not a terminal
  off(0, 2);
  off(2, 2);
  EXPECT_EQ(std::ftell(file), 0);
  auto on = LayerProgress(file, /*terminal=*/true);
  on(1, 2);
  on(2, 2);
  std::rewind(file);
  std::string text(256, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), file));
  std::fclose(file);
  EXPECT_NE(text.find('\r'), std::string::npos);
  EXPECT_NE(text.find("layer 2/2\n"), std::string::npos);
}

}  // namespace calibration_test
}  // namespace kvcd
