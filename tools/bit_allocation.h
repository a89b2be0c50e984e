// Transform coding's bit budget (float64): the uniform scalar quantizer of a unit Gaussian at
// b bits (its optimal step and mean squared error, in closed form), the integer bit
// allocation that minimizes a weighted sum of per-direction distortions (greedy marginal
// returns: discrete reverse water-filling), and the Gaussian rate-distortion bound at a
// given rate (continuous reverse water-filling), the floor no scalar code can beat.
#pragma once

#include <vector>

namespace kvcd {

inline constexpr int kMaxDirectionBits = 8;

// MSE of the midrise uniform quantizer with 2^bits levels, spaced `step` apart and centred
// on 0, of a unit-variance Gaussian (outer cells unbounded). bits = 0: the constant 0 (1.0).
double GaussianUniformMse(int bits, double step);

// The step minimizing GaussianUniformMse(bits, .) (golden-section search; 0 for bits = 0).
double GaussianUniformStep(int bits);

// mse[b] = GaussianUniformMse(b, GaussianUniformStep(b)) for b = 0..kMaxDirectionBits.
const std::vector<double>& GaussianUniformMseTable();

// Integer bits per direction, each in [0, max_bits], summing to total_bits (or to
// max_bits * size when that is less), minimizing sum_i weights[i] * mse[bits[i]] for a
// convex decreasing mse table: one bit at a time to the largest decrease, ties to the lower
// index. weights[i] is the (metric-weighted) variance of direction i.
std::vector<int> AllocateBits(const std::vector<double>& weights, int total_bits, int max_bits,
                              const std::vector<double>& mse);

// The Gaussian rate-distortion function of independent components with these variances at
// total_bits bits: D = sum_i min(theta, v_i) with sum_i max(0, log2(v_i / theta) / 2) =
// total_bits. Returns D (and theta).
double ReverseWaterFilling(const std::vector<double>& variances, double total_bits,
                           double* theta = nullptr);

}  // namespace kvcd
