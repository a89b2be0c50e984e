// The OSCAR INT2 quantizer and packing (docs/formats.md "int2-oscar"), hand-computed cases.
#include "kvcd/kernels/int2_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/rotation.h"
#include "kvcd/kernels/fp16.h"

namespace kvcd::kernels {
namespace int2_codec_test {

TEST(Fp16Test, RoundTripAndRounding) {
  for (float f :
       {0.0f, 1.0f, -2.5f, 0.333251953125f, 65504.0f, 6.103515625e-05f, 5.9604644775390625e-08f}) {
    EXPECT_EQ(HalfToFloat(FloatToHalf(f)), f) << f;
  }
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 2048)), 1.0f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(1e6f))));
}

TEST(Int2CodecTest, ClipThresholdIsTheQuantileOfAbsoluteValues) {
  // d = 8, rho = 0.96: floor(7.68) = 7 -> the largest |x|; rho = 0.5 -> sort(|x|)[4].
  const float x[8] = {-8, 1, -2, 3, 0.5f, -6, 7, 4};
  EXPECT_EQ(Int2ClipThreshold(x, 8, 0.96f), 8.0f);
  EXPECT_EQ(Int2ClipThreshold(x, 8, 0.5f), 4.0f);  // |x| sorted: .5 1 2 3 4 6 7 8
  EXPECT_EQ(Int2ClipThreshold(x, 8, 1.0f), 8.0f);  // index clamped to d-1
  EXPECT_EQ(Int2ClipThreshold(x, 8, 0.125f), 1.0f);
}

TEST(Int2CodecTest, HandComputedRow) {
  // d = 8, identity rotation, rho = 0.625: tau = sort(|x|)[floor(5)] = 6.
  // clipped: [-6, 1, -2, 3, 0.5, -6, 6, 4]; lo = -6, hi = 6, scale = 4, zero = 1.5.
  // q = floor(x/4 + 1.5 + 0.5) clamped: -6->0, 1->2, -2->1, 3->2, 0.5->2, -6->0, 6->3, 4->3.
  const float x[8] = {-8, 1, -2, 3, 0.5f, -6, 7, 4};
  uint8_t codes[2];
  uint16_t params[2];
  const Int2RowRef ref = Int2RowRef::RowMajor(codes, 2, &params[0], &params[1], 2);
  DemoteRowsToInt2(x, 1, 8, nullptr, 0.625f, ref);
  EXPECT_EQ(HalfToFloat(params[0]), 4.0f);
  EXPECT_EQ(HalfToFloat(params[1]), -6.0f);
  // byte j holds elements j, j+2, j+4, j+6 in bits [1:0], [3:2], [5:4], [7:6]:
  // byte 0 = q0 | q2<<2 | q4<<4 | q6<<6 = 0 | 1<<2 | 2<<4 | 3<<6 = 0xE4
  // byte 1 = q1 | q3<<2 | q5<<4 | q7<<6 = 2 | 2<<2 | 0<<4 | 3<<6 = 0xCA
  EXPECT_EQ(codes[0], 0xE4);
  EXPECT_EQ(codes[1], 0xCA);
  float back[8];
  ExpandInt2Rows(ref, 1, 8, nullptr, back);
  const float expect[8] = {-6, 2, -2, 2, 2, -6, 6, 6};  // q*4 - 6
  for (int i = 0; i < 8; ++i) EXPECT_EQ(back[i], expect[i]) << i;
}

TEST(Int2CodecTest, ConstantRowUsesTheScaleFloor) {
  const float x[8] = {2, 2, 2, 2, 2, 2, 2, 2};
  uint8_t codes[2];
  uint16_t params[2];
  const Int2RowRef ref = Int2RowRef::RowMajor(codes, 2, &params[0], &params[1], 2);
  DemoteRowsToInt2(x, 1, 8, nullptr, 0.96f, ref);
  float back[8];
  ExpandInt2Rows(ref, 1, 8, nullptr, back);
  for (float v : back) EXPECT_NEAR(v, 2.0f, 1e-3);
}

TEST(Int2CodecTest, RotatedRoundTripErrorIsBoundedByHalfAStep) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int d : {64, 128, 256}) {
    const std::vector<float> r = HadamardMatrix(d);
    const int n = 7;
    std::vector<float> x(n * d), back(n * d), rot(n * d);
    for (auto& v : x) v = normal(rng);
    std::vector<uint8_t> codes(n * d / 4);
    std::vector<uint16_t> params(2 * n);
    // Codes interleaved as K pages store them: groups of 4 bytes per row.
    Int2RowRef ref = Int2RowRef::RowMajor(codes.data(), 4, params.data(), params.data() + n, 1);
    ref.bytes_per_group = 4;
    ref.byte_group_stride = 4 * n;
    DemoteRowsToInt2(x.data(), n, d, r.data(), 1.0f, ref);
    // rho = 1 clips nothing: every rotated element is within scale/2 (+ FP16 rounding).
    ExpandInt2Rows(ref, n, d, nullptr, back.data());
    RotateRows(x.data(), n, d, r.data(), rot.data());
    for (int t = 0; t < n; ++t) {
      const float scale = HalfToFloat(params[t]);
      for (int i = 0; i < d; ++i) {
        EXPECT_LE(std::fabs(back[t * d + i] - rot[t * d + i]), 0.5f * scale + 0.01f) << d;
      }
    }
    // Un-rotating the expansion returns to the original space.
    std::vector<float> plain(n * d);
    ExpandInt2Rows(ref, n, d, r.data(), plain.data());
    std::vector<float> again(n * d);
    RotateRows(plain.data(), n, d, r.data(), again.data());
    for (int i = 0; i < n * d; ++i) EXPECT_NEAR(again[i], back[i], 1e-4);
  }
}

// Issue #35.2: finite rows beyond FP16's range (N(0,1)·1e6; rows near FLT_MAX, whose
// rotation overflows FP32 to Inf and NaN) saturate at +-65504: the FP16 scale and offset stay
// finite, and so does every expanded value.
TEST(Int2CodecTest, RowsBeyondFp16RangeSaturate) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (int d : {8, 128, 256}) {
    const std::vector<float> h = HadamardMatrix(d);
    std::vector<float> dense(d * d);
    for (auto& v : dense) v = normal(rng);  // not orthogonal: its products overflow sooner
    for (const float* r :
         {static_cast<const float*>(nullptr), h.data(), static_cast<const float*>(dense.data())}) {
      const int n = 4;
      std::vector<float> x(n * d), back(n * d);
      for (int i = 0; i < d; ++i) {
        x[i] = 1e6f * normal(rng);                  // beyond FP16, within FP32
        x[d + i] = 3.3e38f;                         // the rotation's sums overflow to +Inf
        x[2 * d + i] = i % 2 ? 3.3e38f : -3.3e38f;  // ... and Inf - Inf = NaN
        x[3 * d + i] = 1e6f;
      }
      std::vector<uint8_t> codes(n * d / 4);
      std::vector<uint16_t> params(2 * n);
      const Int2RowRef ref =
          Int2RowRef::RowMajor(codes.data(), d / 4, params.data(), params.data() + 1, 2);
      DemoteRowsToInt2(x.data(), n, d, r, 0.96f, ref);
      for (int t = 0; t < n; ++t) {
        const float scale = HalfToFloat(params[2 * t]), lo = HalfToFloat(params[2 * t + 1]);
        EXPECT_TRUE(std::isfinite(scale) && std::isfinite(lo))
            << "d=" << d << " row " << t << ": scale " << scale << " lo " << lo;
        EXPECT_GE(lo, -65504.0f);
      }
      ExpandInt2Rows(ref, n, d, r, back.data());
      for (int i = 0; i < n * d; ++i) ASSERT_TRUE(std::isfinite(back[i])) << "d=" << d << " " << i;
    }
  }
  // Within FP16's range nothing changes: a row at +-60000 keeps its exact extremes.
  float x[8] = {-60000, 60000, 0, 0, 0, 0, 0, 0};
  uint8_t codes[2];
  uint16_t params[2];
  const Int2RowRef ref = Int2RowRef::RowMajor(codes, 2, &params[0], &params[1], 2);
  DemoteRowsToInt2(x, 1, 8, nullptr, 1.0f, ref);
  EXPECT_EQ(HalfToFloat(params[1]), -60000.0f);
  EXPECT_EQ(HalfToFloat(params[0]), 40000.0f);
}

TEST(Int2CodecTest, BitsPerElementIs2Point25AtHeadDim128) {
  EXPECT_EQ((Int2CodeBytes(128) + kInt2ParamBytes) * 8.0 / 128, 2.25);
}

}  // namespace int2_codec_test
}  // namespace kvcd::kernels

namespace kvcd::kernels {
namespace int2_codec_test {

// The optimized rotation is bit-identical to the scalar loop, so demotion (clip index,
// codes, scales) never depends on the CPU it ran on.
TEST(Int2CodecTest, RotationIsBitIdenticalAcrossIsas) {
  if (DetectCpuIsa() != CpuIsa::kAvx512) GTEST_SKIP() << "no AVX-512 on this CPU";
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int d : {16, 64, 128, 256}) {
    const int n = 9;
    std::vector<float> x(n * d), r(d * d), a(n * d), b(n * d);
    for (auto& v : x) v = normal(rng);
    for (auto& v : r) v = normal(rng);
    RotateRows(x.data(), n, d, r.data(), a.data(), CpuIsa::kScalar);
    RotateRows(x.data(), n, d, r.data(), b.data(), CpuIsa::kAvx512);
    for (int i = 0; i < n * d; ++i) ASSERT_EQ(a[i], b[i]) << "d=" << d << " i=" << i;
  }
}

}  // namespace int2_codec_test
}  // namespace kvcd::kernels

namespace kvcd::kernels {
namespace int2_codec_test {

// The daemon's Hadamard (common/rotation.h) is recognised at every head size; anything else
// (a changed entry, the identity, a negative scale) is applied densely.
TEST(Int2CodecTest, ClassifyRotationFindsExactlyTheScaledHadamard) {
  EXPECT_EQ(ClassifyRotation(nullptr, 64), Rotation::kNone);
  for (int d = 8; d <= 256; d *= 2) {
    std::vector<float> h = HadamardMatrix(d);
    ASSERT_EQ(ClassifyRotation(h.data(), d), Rotation::kHadamard) << d;
    h[static_cast<size_t>(d) * (d - 1) + 3] = -h[static_cast<size_t>(d) * (d - 1) + 3];
    EXPECT_EQ(ClassifyRotation(h.data(), d), Rotation::kDense) << d;
    const std::vector<float> id = IdentityMatrix(d);
    EXPECT_EQ(ClassifyRotation(id.data(), d), Rotation::kDense) << d;
    std::vector<float> neg = HadamardMatrix(d);
    for (auto& v : neg) v = -v;
    EXPECT_EQ(ClassifyRotation(neg.data(), d), Rotation::kDense) << d;
  }
}

// The butterflies compute x · (c·H): exactly on small integers (every sum exact, so each
// output is c times the exact integer product), within rounding of the dense product on
// random rows; and DemoteRowsToInt2 with the Hadamard quantizes exactly their output.
TEST(Int2CodecTest, HadamardButterfliesAreTheHadamardProduct) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> small(-20, 20);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int d = 8; d <= 256; d *= 2) {
    const std::vector<float> h = HadamardMatrix(d);
    const float c = h[0];
    std::vector<float> x(d), y(d), dense(d);
    for (auto& v : x) v = static_cast<float>(small(rng));
    HadamardRotateRow(x.data(), d, c, y.data());
    for (int j = 0; j < d; ++j) {
      int64_t exact = 0;
      for (int i = 0; i < d; ++i) {
        exact += (__builtin_popcount(i & j) % 2 ? -1 : 1) * static_cast<int64_t>(x[i]);
      }
      ASSERT_EQ(y[j], static_cast<float>(exact) * c) << "d=" << d << " j=" << j;
    }
    for (int rep = 0; rep < 20; ++rep) {
      double norm = 0.0;
      for (auto& v : x) {
        v = normal(rng);
        norm += std::fabs(v);
      }
      HadamardRotateRow(x.data(), d, c, y.data());
      RotateRows(x.data(), 1, d, h.data(), dense.data(), CpuIsa::kScalar);
      for (int j = 0; j < d; ++j) {
        ASSERT_NEAR(y[j], dense[j], 4.0 * d * 6e-8 * norm * c) << "d=" << d << " j=" << j;
      }
      std::vector<uint8_t> a(d / 4), b(d / 4);
      uint16_t pa[2], pb[2];
      DemoteRowsToInt2(x.data(), 1, d, h.data(), 0.92f,
                       Int2RowRef::RowMajor(a.data(), d / 4, pa, pa + 1, 2));
      DemoteRowsToInt2(y.data(), 1, d, nullptr, 0.92f,
                       Int2RowRef::RowMajor(b.data(), d / 4, pb, pb + 1, 2));
      ASSERT_EQ(a, b) << d;
      ASSERT_EQ(pa[0], pb[0]) << d;
      ASSERT_EQ(pa[1], pb[1]) << d;
    }
  }
}

}  // namespace int2_codec_test
}  // namespace kvcd::kernels
