// Orthogonal rotations for the OSCAR INT2 codec (docs/formats.md "int2-oscar"). Matrices are d x d,
// row-major; rows are row vectors, so a row x is rotated as x · R.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcd {

// Normalized Sylvester Hadamard matrix: H_1 = [1], H_2n = [[H, H], [H, -H]] / sqrt(2).
// REQUIRES: d a power of two.
std::vector<float> HadamardMatrix(int d);

std::vector<float> IdentityMatrix(int d);

// Bit reversal of i on `bits` bits.
int BitReverse(int i, int bits);

// perm with perm[br(i)] = s[i], s = indices of `eigenvalues` sorted descending (stable).
std::vector<int> EigenBitReversalPermutation(const std::vector<double>& eigenvalues);

// R = U · H · P for a (not necessarily symmetric) covariance `cov` [d][d] (FP64): cov is
// symmetrized, eigendecomposed (U's columns in ascending eigenvalue order, each column's
// sign fixed so that its largest-magnitude entry is positive, the first such on ties),
// H is the normalized Hadamard, P = I[:, perm] with EigenBitReversalPermutation.
// eigenvalues_out (optional) receives the eigenvalues in ascending order.
std::vector<float> OscarRotation(const std::vector<double>& cov, int d,
                                 std::vector<double>* eigenvalues_out = nullptr);

// A random orthogonal matrix (Gram-Schmidt of Gaussian rows drawn from `seed`), for tests
// and synthetic codecs.
std::vector<float> RandomOrthogonal(int d, uint32_t seed);

// max |R R^T - I| (orthogonality error); +Inf when R holds a NaN or +-Inf.
double OrthogonalityError(const std::vector<float>& r, int d);

}  // namespace kvcd
