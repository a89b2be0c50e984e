// The OSCAR rotation R = U·H·P of docs/formats.md "int2-oscar", pinned by hand-checked cases.
#include "common/rotation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace kvcd {
namespace rotation_test {

TEST(RotationTest, HadamardIsOrthonormalSylvester) {
  const auto h2 = HadamardMatrix(2);
  const float s = 1.0f / std::sqrt(2.0f);
  EXPECT_FLOAT_EQ(h2[0], s);
  EXPECT_FLOAT_EQ(h2[1], s);
  EXPECT_FLOAT_EQ(h2[2], s);
  EXPECT_FLOAT_EQ(h2[3], -s);
  for (int d : {1, 2, 4, 8, 64, 128, 256})
    EXPECT_LT(OrthogonalityError(HadamardMatrix(d), d), 1e-6) << d;
}

// Issue #35.1: std::max dropped NaN, so a NaN matrix measured as orthogonal (error 0).
TEST(RotationTest, NonFiniteMatrixIsNotOrthogonal) {
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    std::vector<float> r(16, bad);
    EXPECT_FALSE(OrthogonalityError(r, 4) <= 1e-3) << bad;
    r = HadamardMatrix(4);
    r[5] = bad;
    EXPECT_FALSE(OrthogonalityError(r, 4) <= 1e-3) << bad;
  }
}

TEST(RotationTest, BitReversalPermutationByHand) {
  EXPECT_EQ(BitReverse(1, 3), 4);
  EXPECT_EQ(BitReverse(3, 3), 6);
  EXPECT_EQ(BitReverse(6, 3), 3);
  // eigenvalues -> indices sorted descending s = [4, 6, 7, 2, 0, 5, 3, 1];
  // perm[br(i)] = s[i] with br = [0, 4, 2, 6, 1, 5, 3, 7] on 3 bits.
  const std::vector<double> ev = {3, 1, 4, 1.5, 9, 2, 6, 5};
  EXPECT_EQ(EigenBitReversalPermutation(ev), (std::vector<int>{4, 0, 7, 3, 6, 5, 2, 1}));
}

TEST(RotationTest, CompositionOrderByHand) {
  // C = diag(4, 1, 3, 2): eigenvectors are unit vectors; ascending eigenvalues 1,2,3,4 come
  // from e1, e3, e2, e0, so U = [e1 e3 e2 e0]. s (descending, indices into U's columns) =
  // [3, 2, 1, 0]; br on 2 bits = [0, 2, 1, 3] -> perm = [3, 1, 2, 0].
  // R[:, k] = (U H)[:, perm[k]], and (U H)[row of e_m's position] = H[m]:
  // (UH)[1] = H[0], (UH)[3] = H[1], (UH)[2] = H[2], (UH)[0] = H[3].
  const std::vector<double> c = {4, 0, 0, 0, 0, 1, 0, 0, 0, 0, 3, 0, 0, 0, 0, 2};
  std::vector<double> ev;
  const auto r = OscarRotation(c, 4, &ev);
  EXPECT_EQ(ev, (std::vector<double>{1, 2, 3, 4}));
  const double h[4][4] = {{1, 1, 1, 1}, {1, -1, 1, -1}, {1, 1, -1, -1}, {1, -1, -1, 1}};
  const int uh_row_from_h[4] = {3, 0, 2, 1};  // (UH)[i] = H[uh_row_from_h[i]] / 2
  const int perm[4] = {3, 1, 2, 0};
  for (int i = 0; i < 4; ++i) {
    for (int k = 0; k < 4; ++k) {
      EXPECT_NEAR(r[i * 4 + k], h[uh_row_from_h[i]][perm[k]] / 2.0, 1e-6) << i << "," << k;
    }
  }
}

TEST(RotationTest, RecoversAKnownEigenbasisWithTheSignConvention) {
  // C = V diag(lambda) V^T with V a random orthonormal basis (Gram-Schmidt, FP64).
  const int d = 8;
  const auto h = HadamardMatrix(d);
  std::mt19937 rng(42);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> v(d * d);
  for (auto& x : v) x = normal(rng);
  for (int j = 0; j < d; ++j) {  // orthonormalize the columns
    for (int p = 0; p < j; ++p) {
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += v[i * d + j] * v[i * d + p];
      for (int i = 0; i < d; ++i) v[i * d + j] -= dot * v[i * d + p];
    }
    double norm = 0;
    for (int i = 0; i < d; ++i) norm += v[i * d + j] * v[i * d + j];
    for (int i = 0; i < d; ++i) v[i * d + j] /= std::sqrt(norm);
  }
  const std::vector<double> lambda = {8, 7, 6, 5, 4, 3, 2, 1};
  std::vector<double> c(d * d, 0.0);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      for (int m = 0; m < d; ++m) c[i * d + j] += v[i * d + m] * lambda[m] * v[j * d + m];
  std::vector<double> ev;
  const auto r = OscarRotation(c, d, &ev);
  for (int m = 0; m < d; ++m) EXPECT_NEAR(ev[m], m + 1, 1e-9);  // ascending, exact in FP64
  // Each column of U is +-(a column of V) with its largest-magnitude entry positive: R's
  // first factor U·H·P, checked through R = U H P <=> U = R P^T H^T.
  EXPECT_LT(OrthogonalityError(r, d), 1e-6);
  // Same activations -> same matrix: the construction is deterministic (sign convention).
  EXPECT_EQ(OscarRotation(c, d), r);
  const auto perm = EigenBitReversalPermutation(ev);
  for (int m = 0; m < d; ++m) {  // column m of U (ascending eigenvalue m + 1 = lambda index 7 - m)
    std::vector<double> u(d, 0.0);
    for (int i = 0; i < d; ++i)
      for (int k = 0; k < d; ++k)
        if (perm[k] >= 0) {
          // (U H)[i][perm[k]] = R[i][k]  ->  U[i][m] = sum_c (UH)[i][c] H[m][c]
          u[i] += r[i * d + k] * h[m * d + perm[k]];
        }
    int best = 0;
    for (int i = 1; i < d; ++i)
      if (std::fabs(u[i]) > std::fabs(u[best])) best = i;
    EXPECT_GT(u[best], 0) << "column " << m;
    // u is +-V[:, 7 - m]
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += u[i] * v[i * d + (7 - m)];
    EXPECT_NEAR(std::fabs(dot), 1.0, 1e-5) << "column " << m;
  }
}

}  // namespace rotation_test
}  // namespace kvcd
