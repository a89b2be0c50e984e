#include "tools/bit_allocation.h"

#include <algorithm>
#include <cmath>

namespace kvcd {
namespace {

constexpr double kPi = 3.14159265358979323846;

double Pdf(double x) { return std::isinf(x) ? 0.0 : std::exp(-0.5 * x * x) / std::sqrt(2 * kPi); }
double Cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

// Integral over [a, b] of (x - c)^2 phi(x) dx.
double CellMse(double a, double b, double c) {
  const double mass = Cdf(b) - Cdf(a);
  const double apa = std::isinf(a) ? 0.0 : a * Pdf(a), bpb = std::isinf(b) ? 0.0 : b * Pdf(b);
  return mass * (1 + c * c) + apa - bpb - 2 * c * (Pdf(a) - Pdf(b));
}

}  // namespace

double GaussianUniformMse(int bits, double step) {
  if (bits <= 0) return 1.0;
  const int levels = 1 << bits;
  double mse = 0;
  for (int k = 0; k < levels; ++k) {
    const double c = (k - (levels - 1) / 2.0) * step;
    const double a = k == 0 ? -INFINITY : c - step / 2,
                 b = k == levels - 1 ? INFINITY : c + step / 2;
    mse += CellMse(a, b, c);
  }
  return mse;
}

double GaussianUniformStep(int bits) {
  if (bits <= 0) return 0.0;
  double lo = 1e-4, hi = 8.0 / (1 << bits) + 2.0;
  const double phi = (std::sqrt(5.0) - 1) / 2;
  for (int i = 0; i < 200; ++i) {
    const double m1 = hi - phi * (hi - lo), m2 = lo + phi * (hi - lo);
    if (GaussianUniformMse(bits, m1) < GaussianUniformMse(bits, m2)) {
      hi = m2;
    } else {
      lo = m1;
    }
  }
  return (lo + hi) / 2;
}

const std::vector<double>& GaussianUniformMseTable() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (int b = 0; b <= kMaxDirectionBits; ++b)
      t.push_back(GaussianUniformMse(b, GaussianUniformStep(b)));
    return t;
  }();
  return table;
}

std::vector<int> AllocateBits(const std::vector<double>& w, int total_bits, int max_bits,
                              const std::vector<double>& mse) {
  const int n = static_cast<int>(w.size());
  max_bits = std::min<int>(max_bits, static_cast<int>(mse.size()) - 1);
  std::vector<int> bits(static_cast<size_t>(n), 0);
  for (int spent = 0; spent < total_bits; ++spent) {
    int best = -1;
    double gain = -1;
    for (int i = 0; i < n; ++i) {
      if (bits[i] >= max_bits) continue;
      const double g = w[i] * (mse[bits[i]] - mse[bits[i] + 1]);
      if (g > gain) gain = g, best = i;
    }
    if (best < 0) break;
    ++bits[best];
  }
  return bits;
}

double ReverseWaterFilling(const std::vector<double>& v, double total_bits, double* theta_out) {
  auto rate = [&](double theta) {
    double r = 0;
    for (double x : v)
      if (x > theta) r += 0.5 * std::log2(x / theta);
    return r;
  };
  double hi = 0;
  for (double x : v) hi = std::max(hi, x);
  if (!(hi > 0)) {
    if (theta_out != nullptr) *theta_out = 0;
    return 0;
  }
  double lo = hi * 1e-30;
  for (int i = 0; i < 200; ++i) {  // bisection on log(theta): rate is decreasing in theta
    const double mid = std::sqrt(lo * hi);
    if (rate(mid) > total_bits) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const double theta = std::sqrt(lo * hi);
  double d = 0;
  for (double x : v) d += std::min(theta, x);
  if (theta_out != nullptr) *theta_out = theta;
  return d;
}

}  // namespace kvcd
