#include "tools/transform_codec.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <numeric>

#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/fp16_saturate.h"
#include "tools/bit_allocation.h"

namespace kvcd {

int TransformCodec::RowBits() const {
  return std::accumulate(bits.begin(), bits.end(), 0) + (row_gain ? 16 : 0);
}

void TransformRoundTrip(const TransformCodec& c, const float* x, float* out) {
  const int d = c.d;
  std::vector<double> z(static_cast<size_t>(d), 0.0), y(static_cast<size_t>(d), 0.0);
  double ss = 0;
  int coded = 0;
  for (int i = 0; i < d; ++i) {
    if (c.bits[i] == 0) continue;
    double s = 0;
    for (int j = 0; j < d; ++j) s += c.encode[i * d + j] * (x[j] - c.mean[j]);
    z[i] = s / c.sigma[i];
    ss += z[i] * z[i];
    ++coded;
  }
  static const std::vector<double> steps = [] {
    std::vector<double> s;
    for (int b = 0; b <= kMaxDirectionBits; ++b) s.push_back(GaussianUniformStep(b));
    return s;
  }();
  double gain = 1.0;
  if (c.row_gain && coded > 0) {
    // The row's RMS, raised where a coordinate would overload its quantizer (|z| past the
    // outer level plus half a step): a row concentrated in few directions is not clipped.
    double g = std::sqrt(ss / coded);
    for (int i = 0; i < d; ++i) {
      if (c.bits[i] == 0) continue;
      const double half_range = (1 << (c.bits[i] - 1)) * steps[c.bits[i]] * c.step_scale;
      g = std::max(g, std::fabs(z[i]) / (half_range * c.overload));
    }
    // FP16 of g (1 + 2^-10): at least g after round-to-nearest (10 mantissa bits).
    // Saturated at FP16's largest finite value (a row far beyond it: its codes clip).
    const float h = kernels::HalfToFloat(kernels::FloatToHalf(
        static_cast<float>(std::min(g * (1 + 1.0 / 1024), double{kernels::kFp16Max}))));
    gain = h > 0 && std::isfinite(h) ? h : 1.0;
  }
  for (int i = 0; i < d; ++i) {
    const int b = c.bits[i];
    if (b == 0) continue;
    const int levels = 1 << b;
    const double step = steps[b] * c.step_scale * gain;
    const double k = std::clamp(std::floor(z[i] / step + levels / 2.0), 0.0, levels - 1.0);
    y[i] = (k - (levels - 1) / 2.0) * step * c.sigma[i];
  }
  for (int j = 0; j < d; ++j) {
    double s = c.mean[j];
    for (int i = 0; i < d; ++i) s += c.decode[j * d + i] * y[i];
    out[j] = static_cast<float>(s);
  }
}

TransformCodec FitTransform(const std::vector<double>& rows, int64_t n, int d,
                            const std::vector<double>& metric, const TransformFitOptions& opt,
                            std::vector<double>* weights_out) {
  using Mat = Eigen::MatrixXd;
  TransformCodec c;
  c.d = d;
  c.row_gain = opt.row_gain;
  c.step_scale = opt.step_scale;
  c.overload = opt.overload;
  Eigen::VectorXd mean = Eigen::VectorXd::Zero(d);
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < d; ++j) mean[j] += rows[t * d + j] / static_cast<double>(n);
  Mat cov = Mat::Zero(d, d);
  for (int64_t t = 0; t < n; ++t) {
    Eigen::VectorXd r(d);
    for (int j = 0; j < d; ++j) r[j] = rows[t * d + j] - mean[j];
    cov.noalias() += r * r.transpose() / static_cast<double>(n);
  }
  Mat w = Mat::Identity(d, d);
  if (!metric.empty()) {
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) w(i, j) = metric[i * d + j];
    w = (w + w.transpose()) / 2;
    w += opt.ridge * w.trace() / d * Mat::Identity(d, d);
  }
  Mat enc(d, d), dec(d, d);  // enc rows: directions; dec columns: their images
  Eigen::VectorXd weight(d);
  if (opt.basis == TransformBasis::kWhitened) {
    Eigen::SelfAdjointEigenSolver<Mat> ws(w);
    const Eigen::VectorXd ev = ws.eigenvalues().cwiseMax(0.0);
    const Mat a = ws.eigenvectors() * ev.cwiseSqrt().asDiagonal() * ws.eigenvectors().transpose();
    const Mat a_inv = ws.eigenvectors() * ev.cwiseSqrt().cwiseInverse().asDiagonal() *
                      ws.eigenvectors().transpose();
    Eigen::SelfAdjointEigenSolver<Mat> ms(a * cov * a);
    const Mat v = ms.eigenvectors().rowwise().reverse();  // descending
    enc = v.transpose() * a;
    dec = a_inv * v;
    weight = ms.eigenvalues().reverse().cwiseMax(0.0);
  } else {
    Eigen::SelfAdjointEigenSolver<Mat> s(opt.basis == TransformBasis::kDataKlt ? cov : w);
    const Mat u = s.eigenvectors().rowwise().reverse();
    enc = u.transpose();
    dec = u;
    for (int i = 0; i < d; ++i) {
      const Eigen::VectorXd ui = u.col(i);
      weight[i] = std::max(0.0, ui.dot(w * ui)) * std::max(0.0, ui.dot(cov * ui));
    }
  }
  c.encode.resize(static_cast<size_t>(d) * d);
  c.decode.resize(c.encode.size());
  c.mean.resize(static_cast<size_t>(d));
  c.sigma.resize(static_cast<size_t>(d));
  std::vector<double> wv(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      c.encode[i * d + j] = enc(i, j);
      c.decode[i * d + j] = dec(i, j);
    }
    c.mean[i] = mean[i];
    const Eigen::VectorXd e = enc.row(i).transpose();
    c.sigma[i] = std::sqrt(std::max(0.0, e.dot(cov * e)));
    wv[i] = weight[i];
  }
  c.bits = AllocateBits(wv, opt.code_bits, opt.max_bits, GaussianUniformMseTable());
  for (int i = 0; i < d; ++i)
    if (!(c.sigma[i] > 0)) c.bits[i] = 0;
  if (weights_out != nullptr) *weights_out = wv;
  return c;
}

}  // namespace kvcd
