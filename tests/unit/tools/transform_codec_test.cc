#include "tools/transform_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kvcd/kernels/transform_codec.h"
#include "tools/bit_allocation.h"

namespace kvcd {
namespace transform_codec_test {

// A random orthogonal d x d matrix (Gram-Schmidt of Gaussian columns), row-major.
std::vector<double> RandomOrthogonal(int d, std::mt19937_64& rng) {
  std::normal_distribution<double> g;
  std::vector<double> q(static_cast<size_t>(d) * d);
  for (double& x : q) x = g(rng);
  for (int i = 0; i < d; ++i) {  // rows
    for (int j = 0; j < i; ++j) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += q[i * d + c] * q[j * d + c];
      for (int c = 0; c < d; ++c) q[i * d + c] -= dot * q[j * d + c];
    }
    double nrm = 0;
    for (int c = 0; c < d; ++c) nrm += q[i * d + c] * q[i * d + c];
    for (int c = 0; c < d; ++c) q[i * d + c] /= std::sqrt(nrm);
  }
  return q;
}

// n rows x = mean + sum_i sqrt(var_i) z_i basis_row_i.
std::vector<double> GaussianRows(int64_t n, int d, const std::vector<double>& var,
                                 const std::vector<double>& basis, double mean,
                                 std::mt19937_64& rng) {
  std::normal_distribution<double> g;
  std::vector<double> rows(static_cast<size_t>(n) * d, mean);
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      const double z = g(rng) * std::sqrt(var[i]);
      for (int c = 0; c < d; ++c) rows[t * d + c] += z * basis[i * d + c];
    }
  return rows;
}

TEST(TransformCodec, RowOnTheQuantizerLevelsRoundTripsExactly) {
  const int d = 4;
  TransformCodec c;
  c.d = d;
  c.encode = c.decode = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1};
  c.mean = {1, 2, 3, 4};
  c.sigma = {2, 1, 1, 1};
  c.bits = {3, 2, 1, 0};
  c.row_gain = false;
  const double s3 = GaussianUniformStep(3), s2 = GaussianUniformStep(2),
               s1 = GaussianUniformStep(1);
  const float x[4] = {static_cast<float>(1 + 2 * 2.5 * s3), static_cast<float>(2 - 1.5 * s2),
                      static_cast<float>(3 + 0.5 * s1), 17.0f};
  float out[4];
  TransformRoundTrip(c, x, out);
  EXPECT_NEAR(out[0], x[0], 1e-5);
  EXPECT_NEAR(out[1], x[1], 1e-5);
  EXPECT_NEAR(out[2], x[2], 1e-5);
  EXPECT_FLOAT_EQ(out[3], 4.0f);  // 0 bits: the mean
  EXPECT_EQ(c.RowBits(), 6);
}

TEST(TransformCodec, KltRecoversTheSpectrumAndMeetsTheModelDistortion) {
  std::mt19937_64 rng(11);
  const int d = 16;
  const int64_t n = 20000;
  std::vector<double> var(d);
  for (int i = 0; i < d; ++i) var[i] = std::pow(0.6, i) * 10;  // descending
  const auto basis = RandomOrthogonal(d, rng);
  const auto rows = GaussianRows(n, d, var, basis, 0.5, rng);
  TransformFitOptions opt;
  opt.basis = TransformBasis::kDataKlt;
  opt.code_bits = 2 * d;
  opt.row_gain = false;
  std::vector<double> w;
  const TransformCodec c = FitTransform(rows, n, d, {}, opt, &w);
  for (int i = 0; i < d; ++i) EXPECT_NEAR(w[i] / var[i], 1.0, 0.05) << i;
  EXPECT_EQ(c.bits, AllocateBits(var, 2 * d, 8, GaussianUniformMseTable()));
  EXPECT_GT(c.bits.front(), 2);
  EXPECT_EQ(c.bits.back(), 0);
  // Measured MSE on fresh rows against sum_i var_i mse[bits_i].
  const auto test = GaussianRows(4000, d, var, basis, 0.5, rng);
  double se = 0, model = 0;
  std::vector<float> x(d), out(d);
  for (int64_t t = 0; t < 4000; ++t) {
    for (int j = 0; j < d; ++j) x[j] = static_cast<float>(test[t * d + j]);
    TransformRoundTrip(c, x.data(), out.data());
    for (int j = 0; j < d; ++j) se += (out[j] - x[j]) * (out[j] - x[j]) / 4000.0;
  }
  for (int i = 0; i < d; ++i) model += var[i] * GaussianUniformMseTable()[c.bits[i]];
  EXPECT_NEAR(se / model, 1.0, 0.08);
  // Uneven bits beat 2 bits everywhere by the spectral prediction's margin.
  double uniform = 0;
  for (int i = 0; i < d; ++i) uniform += var[i] * GaussianUniformMseTable()[2];
  EXPECT_LT(se, 0.5 * uniform);
}

TEST(TransformCodec, WhitenedBasisMakesTheLogitErrorPlainSquaredError) {
  // White data (C = I) and an anisotropic query metric W = diag(m): the whitened weights are
  // m; the logit error E[(q . e)^2] over queries q ~ N(0, W) matches sum_i m_i mse[b_i].
  std::mt19937_64 rng(5);
  const int d = 8;
  const int64_t n = 20000;
  std::vector<double> m = {40, 20, 8, 4, 1, 0.5, 0.1, 0.05};
  std::vector<double> metric(static_cast<size_t>(d) * d, 0.0), eye(metric.size(), 0.0);
  for (int i = 0; i < d; ++i) metric[i * d + i] = m[i], eye[i * d + i] = 1;
  const auto rows = GaussianRows(n, d, std::vector<double>(d, 1.0), eye, 0.0, rng);
  TransformFitOptions opt;
  opt.code_bits = 16;
  opt.row_gain = false;
  opt.ridge = 0;
  std::vector<double> w;
  const TransformCodec c = FitTransform(rows, n, d, metric, opt, &w);
  for (int i = 0; i < d; ++i) EXPECT_NEAR(w[i] / m[i], 1.0, 0.06) << i;
  std::normal_distribution<double> g;
  double le = 0, model = 0;
  std::vector<float> x(d), out(d);
  const int trials = 20000;
  for (int t = 0; t < trials; ++t) {
    for (int j = 0; j < d; ++j) x[j] = static_cast<float>(g(rng));
    TransformRoundTrip(c, x.data(), out.data());
    double logit = 0;
    for (int j = 0; j < d; ++j) logit += g(rng) * std::sqrt(m[j]) * (out[j] - x[j]);
    le += logit * logit / trials;
  }
  for (int i = 0; i < d; ++i) model += w[i] * GaussianUniformMseTable()[c.bits[i]];
  EXPECT_NEAR(le / model, 1.0, 0.1);
}

TEST(TransformCodec, RowGainScalesWithTheRow) {
  std::mt19937_64 rng(9);
  const int d = 8;
  std::vector<double> eye(static_cast<size_t>(d) * d, 0.0);
  for (int i = 0; i < d; ++i) eye[i * d + i] = 1;
  const auto rows = GaussianRows(5000, d, std::vector<double>(d, 1.0), eye, 0.0, rng);
  TransformFitOptions opt;
  opt.basis = TransformBasis::kDataKlt;
  opt.code_bits = 24;
  const TransformCodec c = FitTransform(rows, 5000, d, {}, opt);
  EXPECT_EQ(c.RowBits(), 24 + 16);
  // A row 1000x the calibration scale keeps its relative error with the gain.
  std::vector<float> x(d), out(d);
  std::normal_distribution<double> g;
  double rel = 0;
  for (int t = 0; t < 200; ++t) {
    double e = 0, nn = 0;
    for (int j = 0; j < d; ++j) x[j] = static_cast<float>(1000 * g(rng));
    TransformRoundTrip(c, x.data(), out.data());
    for (int j = 0; j < d; ++j) e += (out[j] - x[j]) * (out[j] - x[j]), nn += x[j] * x[j];
    rel += std::sqrt(e / nn) / 200;
  }
  EXPECT_LT(rel, 0.3);
  // A row concentrated in one direction (RMS over the coded ones far below its peak) is not
  // clipped: the gain rises until the peak fits its quantizer.
  for (int j = 0; j < d; ++j) x[j] = 0.0f;
  x[3] = 50.0f;
  TransformRoundTrip(c, x.data(), out.data());
  double e = 0;
  for (int j = 0; j < d; ++j) e += (out[j] - x[j]) * (out[j] - x[j]);
  EXPECT_LT(std::sqrt(e) / 50.0, 0.15);
}

TEST(TransformCodec, DaemonStepTableIsTheToolsSteps) {
  for (int b = 0; b <= kMaxDirectionBits; ++b) {
    EXPECT_EQ(kernels::TransformStep(b), b == 0 ? 0.0 : GaussianUniformStep(b)) << b;
  }
}

// The daemon's key encoder (kernels/transform_codec.h, what int2-transform pages store on
// Put and demotion) against TransformRoundTrip on a codec as a version-3 file holds it
// (FP32 tensors): decoding the daemon's codes and gain gives the tools' row to the last
// bit, for in-distribution rows, rows 1000x larger, spikes, zeros and the mean itself.
TEST(TransformCodec, DaemonEncoderIsBitIdenticalToTheTools) {
  std::mt19937_64 rng(21);
  const int d = 64;
  const int64_t n = 3000;
  std::vector<double> var(d);
  for (int i = 0; i < d; ++i) var[i] = 30.0 * std::pow(0.85, i);
  const auto basis = RandomOrthogonal(d, rng);
  const auto rows = GaussianRows(n, d, var, basis, 0.3, rng);
  std::vector<double> metric(static_cast<size_t>(d) * d, 0.0);
  for (int i = 0; i < d; ++i) metric[i * d + i] = 1.0 + 5.0 * (i % 7);
  const TransformCodec fitted = FitTransform(rows, n, d, metric, TransformFitOptions{});
  ASSERT_EQ(fitted.RowBits(), 144 + 16);
  // FP32 copies, as stored in the codec file, and the tools' codec read back from them.
  std::vector<float> enc(fitted.encode.begin(), fitted.encode.end());
  std::vector<float> dec(fitted.decode.begin(), fitted.decode.end());
  std::vector<float> mean(fitted.mean.begin(), fitted.mean.end());
  std::vector<float> sigma(fitted.sigma.begin(), fitted.sigma.end());
  TransformCodec tools = fitted;
  tools.encode.assign(enc.begin(), enc.end());
  tools.decode.assign(dec.begin(), dec.end());
  tools.mean.assign(mean.begin(), mean.end());
  tools.sigma.assign(sigma.begin(), sigma.end());
  kernels::TransformKeyCode daemon;
  daemon.d = d;
  daemon.encode = enc.data();
  daemon.decode = dec.data();
  daemon.mean = mean.data();
  daemon.sigma = sigma.data();
  daemon.bits = tools.bits.data();
  daemon.code_bytes = 144 / 8;
  std::normal_distribution<double> g;
  std::vector<float> x(d), want(d), got(d);
  std::vector<uint8_t> codes(daemon.code_bytes);
  uint16_t gain = 0;
  int checked = 0;
  for (int t = 0; t < 2000; ++t) {
    const int kind = t % 6;
    for (int j = 0; j < d; ++j) {
      const double base = rows[(t % n) * d + j];
      x[j] = static_cast<float>(kind == 0   ? base
                                : kind == 1 ? 1000 * base
                                : kind == 2 ? (j == t % d ? 40.0 * g(rng) : 0.0)
                                : kind == 3 ? 0.0
                                : kind == 4 ? mean[j]
                                            : 1e30 * base);  // gain saturates at 65504
    }
    TransformRoundTrip(tools, x.data(), want.data());
    kernels::EncodeTransformKeys(daemon, x.data(), 1, codes.data(), daemon.code_bytes, &gain);
    kernels::DecodeTransformKeys(daemon, codes.data(), daemon.code_bytes, &gain, 1, 1, got.data());
    for (int j = 0; j < d; ++j) {
      ASSERT_EQ(std::memcmp(&want[j], &got[j], 4), 0)
          << "row " << t << " kind " << kind << " element " << j << ": " << want[j] << " vs "
          << got[j];
    }
    ++checked;
  }
  EXPECT_EQ(checked, 2000);
}

}  // namespace transform_codec_test
}  // namespace kvcd
