// A per-KV-head transform code for K or V rows with uneven bits across directions (float64
// reference): y = E (x - mean), each y_i divided by its calibration deviation sigma_i and by
// one FP16 gain per row (the row's RMS over the coded directions, raised so that no
// coordinate overloads its quantizer by more than `overload`), quantized by the unit
// Gaussian's optimal uniform quantizer at bits[i] bits (0 bits: y_i = 0), and decoded as
// x = mean + D y. The basis is fitted so that the error that matters is plain squared error
// in y: for keys the logit error e^T Sigma_q e (metric = the query second moment of the KV
// head's query group), for values the output error (metric = identity). Bits go to the
// directions by reverse water-filling on their metric-weighted variances.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcd {

struct TransformCodec {
  int d = 0;
  std::vector<double> encode, decode;  // [d][d]: y = encode (x - mean), x = mean + decode y
  std::vector<double> mean, sigma;     // [d]
  std::vector<int> bits;               // [d], each 0..kMaxDirectionBits
  bool row_gain = true;                // one FP16 gain per row (16 bits of the row's budget)
  double step_scale = 1.0;             // multiplies the Gaussian-optimal steps
  // The gain is at least max_i |z_i| / (overload * half range of direction i's quantizer):
  // 1 never clips a coordinate past its outer cell; larger values allow that much overload.
  double overload = 1.0;

  // Stored bits per row: codes plus the gain.
  int RowBits() const;
};

// Encodes and decodes one row of d values.
void TransformRoundTrip(const TransformCodec& c, const float* x, float* out);

enum class TransformBasis {
  kWhitened,     // eigenvectors of A C A, A = metric^(1/2): the error metric is exact in y
  kDataKlt,      // orthogonal: eigenvectors of C (the rows' covariance)
  kMetricEigen,  // orthogonal: eigenvectors of the metric (the OSCAR U for keys)
};

struct TransformFitOptions {
  TransformBasis basis = TransformBasis::kWhitened;
  int code_bits = 144;  // bits of codes per row (the gain's 16 come on top)
  bool row_gain = true;
  int max_bits = 8;
  double step_scale = 1.0;
  double overload = 1.0;
  double ridge = 1e-4;  // metric + ridge * trace / d * I (keeps A invertible)
};

// Fits the code to n calibration rows [n][d] under the error metric [d][d] (empty:
// identity). `weights` (optional) receives each direction's metric-weighted variance, the
// quantity the bits were allocated on.
TransformCodec FitTransform(const std::vector<double>& rows, int64_t n, int d,
                            const std::vector<double>& metric, const TransformFitOptions& opt,
                            std::vector<double>* weights = nullptr);

}  // namespace kvcd
