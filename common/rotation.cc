#include "rotation.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace kvcd {

std::vector<float> HadamardMatrix(int d) {
  std::vector<double> h(1, 1.0);
  for (int n = 1; n < d; n *= 2) {
    std::vector<double> next(static_cast<size_t>(4 * n * n));
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const double v = h[i * n + j] / std::sqrt(2.0);
        next[i * 2 * n + j] = v;
        next[i * 2 * n + j + n] = v;
        next[(i + n) * 2 * n + j] = v;
        next[(i + n) * 2 * n + j + n] = -v;
      }
    }
    h.swap(next);
  }
  return std::vector<float>(h.begin(), h.end());
}

std::vector<float> IdentityMatrix(int d) {
  std::vector<float> r(static_cast<size_t>(d) * d, 0.0f);
  for (int i = 0; i < d; ++i) r[static_cast<size_t>(i) * d + i] = 1.0f;
  return r;
}

int BitReverse(int i, int bits) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((i >> b) & 1) << (bits - 1 - b);
  return r;
}

std::vector<int> EigenBitReversalPermutation(const std::vector<double>& eigenvalues) {
  const int d = static_cast<int>(eigenvalues.size());
  int bits = 0;
  while ((1 << bits) < d) ++bits;
  std::vector<int> s(static_cast<size_t>(d));
  std::iota(s.begin(), s.end(), 0);
  std::stable_sort(s.begin(), s.end(),
                   [&](int a, int b) { return eigenvalues[a] > eigenvalues[b]; });
  std::vector<int> perm(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) perm[BitReverse(i, bits)] = s[i];
  return perm;
}

std::vector<float> OscarRotation(const std::vector<double>& cov, int d,
                                 std::vector<double>* eigenvalues_out) {
  Eigen::MatrixXd c(d, d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) c(i, j) = 0.5 * (cov[i * d + j] + cov[j * d + i]);
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(c);
  Eigen::MatrixXd u = eig.eigenvectors();
  for (int col = 0; col < d; ++col) {
    int best = 0;
    for (int row = 1; row < d; ++row) {
      if (std::fabs(u(row, col)) > std::fabs(u(best, col))) best = row;
    }
    if (u(best, col) < 0) u.col(col) *= -1.0;
  }
  std::vector<double> ev(eig.eigenvalues().data(), eig.eigenvalues().data() + d);
  if (eigenvalues_out != nullptr) *eigenvalues_out = ev;
  const std::vector<float> hf = HadamardMatrix(d);
  Eigen::MatrixXd h(d, d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) h(i, j) = hf[i * d + j];
  const Eigen::MatrixXd uh = u * h;
  const std::vector<int> perm = EigenBitReversalPermutation(ev);
  std::vector<float> r(static_cast<size_t>(d) * d);
  for (int i = 0; i < d; ++i)
    for (int k = 0; k < d; ++k)
      r[i * d + k] = static_cast<float>(uh(i, perm[k]));  // (UH) I[:, perm]
  return r;
}

std::vector<float> RandomOrthogonal(int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> g;
  std::vector<double> q(static_cast<size_t>(d) * d);
  for (double& x : q) x = g(rng);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < i; ++j) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += q[i * d + c] * q[j * d + c];
      for (int c = 0; c < d; ++c) q[i * d + c] -= dot * q[j * d + c];
    }
    double nrm = 0;
    for (int c = 0; c < d; ++c) nrm += q[i * d + c] * q[i * d + c];
    for (int c = 0; c < d; ++c) q[i * d + c] /= std::sqrt(nrm);
  }
  return std::vector<float>(q.begin(), q.end());
}

double OrthogonalityError(const std::vector<float>& r, int d) {
  // NaN would vanish in std::max below (every comparison with it is false): a matrix with a
  // non-finite element is as far from orthogonal as it gets.
  for (float x : r) {
    if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
  }
  double worst = 0;
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      double dot = 0;
      for (int k = 0; k < d; ++k) dot += static_cast<double>(r[i * d + k]) * r[j * d + k];
      worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

}  // namespace kvcd
