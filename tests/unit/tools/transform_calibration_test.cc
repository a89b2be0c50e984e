#include "tools/transform_calibration.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <numeric>
#include <string>

#include "common/rotation.h"
#include "kvcd/kernels/int2_codec.h"
#include "testing/synthetic_activations.h"

namespace kvcd {
namespace transform_calibration_test {

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

TEST(TransformCalibrationTest, RejectsTooFewRows) {
  const ActivationDump dump = Synthetic(1, 100, 32, 1);
  TransformCalibrationOptions opt;
  opt.first_row = 64;  // 36 rows < 2 * 32
  auto cal = CalibrateTransforms(dump, opt);
  ASSERT_FALSE(cal.ok());
  EXPECT_EQ(cal.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cal.status().message().find("fewer than 2 * head_dim = 64"), std::string::npos);
}

TEST(TransformCalibrationTest, BudgetAndPredictionsAreConsistent) {
  const int d = 32;
  const ActivationDump dump = Synthetic(2, 400, d, 3);
  TransformCalibrationOptions opt;
  opt.first_row = 16;
  opt.k.code_bits = opt.v.code_bits = 2 * d + 16;  // + the gain: INT2's 2d + 32 bits
  auto cal = CalibrateTransforms(dump, opt);
  ASSERT_TRUE(cal.ok()) << cal.status();
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) {
      for (const auto* c : {&cal->k[l][h], &cal->v[l][h]}) {
        EXPECT_EQ(c->RowBits(), 2 * d + 32);
        for (int i = 1; i < d; ++i) EXPECT_LE(c->bits[i], c->bits[i - 1]);
      }
      for (const auto* p : {&cal->pred_k[l][h], &cal->pred_v[l][h]}) {
        // The greedy allocation is optimal for its model, so it beats even bits in the same
        // basis, and the rate-distortion bound lies below both.
        EXPECT_LE(p->allocated, p->uniform * (1 + 1e-12));
        EXPECT_LT(p->rd_floor, p->allocated);
        EXPECT_GT(p->hadamard, 0);
      }
    }
}

TEST(TransformCalibrationTest, Version3FileScoresAsTheInMemoryHybrid) {
  const int d = 32, hkv = 2;
  const ActivationDump dump = Synthetic(2, 400, d, 5);
  TransformCalibrationOptions opt;
  opt.first_row = 16;
  opt.k.code_bits = 2 * d + 16;
  auto cal = CalibrateTransforms(dump, opt);
  ASSERT_TRUE(cal.ok()) << cal.status();
  auto shared = std::make_shared<const TransformCalibration>(std::move(*cal));
  std::vector<Int2Layer> values(2);
  for (auto& v : values) {
    v.r_k = v.r_v = HadamardMatrix(d);
    v.rho_k = {1.0f};
    v.rho_v = {kernels::kDefaultRhoV};
  }
  const std::string path = ::testing::TempDir() + "/transform_calibration_v3.st";
  ASSERT_TRUE(
      KeyTransformProfile::ToSafetensors(KeyTransformHeads(*shared, values), 2, hkv, d, "test")
          .WriteFile(path)
          .ok());
  auto file = SafetensorsFile::Load(path);
  ASSERT_TRUE(file.ok());
  auto from_file = LoadInt2Codec(*file, dump, "v3");
  std::remove(path.c_str());
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->kind, EvalCodec::Kind::kRows);
  EXPECT_EQ(from_file->row_bits_k, 2 * d + 32);
  EXPECT_EQ(from_file->row_bits_v, 2 * d + 32);
  // In memory: keys through the transform code, values through Hadamard INT2.
  EvalCodec mem = TransformEvalCodec(shared, "mem", hkv);
  const auto keys = mem.round_trip;
  mem.round_trip = [keys, values](int l, int which, const std::vector<float>& rows, int64_t n,
                                  std::vector<float>* o) {
    if (which == 0) return keys(l, which, rows, n, o);
    Int2RoundTrip(rows, n, hkv, d, values[l], which, -1, o);
  };
  EvalOptions eo;
  eo.sink = 16;
  eo.recent = 32;
  eo.positions = 8;
  auto res = Evaluate(dump, {*from_file, mem, StandardCodecs(2, d)[2]}, eo);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_NEAR((*res)[0].overall.out_err, (*res)[1].overall.out_err,
              1e-3 * (*res)[1].overall.out_err);
  EXPECT_GT((*res)[0].overall.out_err, 0.0);
  // Same bytes as INT2 (2 + 32 / d bits per element) for the history rows.
  EXPECT_NEAR((*res)[0].bits_per_element, (*res)[2].bits_per_element, 1e-9);
}

}  // namespace transform_calibration_test
}  // namespace kvcd
