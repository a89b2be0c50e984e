// Attention quality of the INT2 codecs on the synthetic activation generator: the
// Hadamard and the calibrated OSCAR rotations must reduce the attention-output error of
// naive INT2 (margins measured, stated below).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/rotation.h"
#include "kvcd/kernels/int2_codec.h"
#include "kvcd/kernels/reference_attention.h"
#include "testing/synthetic_activations.h"

namespace kvcd {
namespace codec_quality_test {

constexpr int kHq = 8, kHkv = 2, kD = 128;

constexpr int64_t kSink = 64, kRecent = 64;

// Mean relative error ||o_hat - o|| / ||o|| of the last `queries` positions attending
// causally over all earlier tokens, with the K/V rows between the sink window (first
// kSink tokens) and the recent window (last kRecent tokens) stored through the INT2 codec,
// as the daemon stores them.
double AttentionError(const LayerActivations& a, int64_t n, const std::vector<float>& rk,
                      const std::vector<float>& rv) {
  std::vector<float> k_hat(a.k), v_hat(a.v);
  std::vector<uint8_t> codes(kD / 4);
  uint16_t params[2];
  for (int64_t row = kSink * kHkv; row < (n - kRecent) * kHkv; ++row) {
    for (int which = 0; which < 2; ++which) {
      const float* src = (which == 0 ? a.k : a.v).data() + row * kD;
      float* dst = (which == 0 ? k_hat : v_hat).data() + row * kD;
      const auto& r = which == 0 ? rk : rv;
      const auto ref =
          kernels::Int2RowRef::RowMajor(codes.data(), kD / 4, &params[0], &params[1], 2);
      kernels::DemoteRowsToInt2(src, 1, kD, r.data(), which == 0 ? 0.96f : 0.92f, ref);
      kernels::ExpandInt2Rows(ref, 1, kD, r.data(), dst);
    }
  }
  double total = 0;
  const int queries = 32;
  std::vector<double> o(kHq * kD), oh(kHq * kD), l(kHq);
  for (int64_t t = n - queries; t < n; ++t) {
    const float* q = a.q.data() + t * kHq * kD;
    const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
    kernels::ReferenceAttention(q, a.k.data(), a.v.data(), t + 1, kHq, kHkv, kD, scale, o.data(),
                                l.data());
    kernels::ReferenceAttention(q, k_hat.data(), v_hat.data(), t + 1, kHq, kHkv, kD, scale,
                                oh.data(), l.data());
    for (int h = 0; h < kHq; ++h) {
      double err = 0, norm = 0;
      for (int c = 0; c < kD; ++c) {
        err += (oh[h * kD + c] - o[h * kD + c]) * (oh[h * kD + c] - o[h * kD + c]);
        norm += o[h * kD + c] * o[h * kD + c];
      }
      total += std::sqrt(err / norm);
    }
  }
  return total / (queries * kHq);
}

TEST(CodecQualityTest, RotationsReduceAttentionErrorOfNaiveInt2) {
  ActivationSpec spec;
  spec.num_q_heads = kHq;
  spec.num_kv_heads = kHkv;
  spec.head_dim = kD;
  spec.tokens = 512;
  spec.seed = 11;
  const LayerActivations eval = GenerateActivations(spec)[0];
  spec.tokens = 384;  // calibrate on a shorter run of the same activations
  const LayerActivations calib = GenerateActivations(spec)[0];

  const auto identity = IdentityMatrix(kD);
  const auto hadamard = HadamardMatrix(kD);
  const auto rk = OscarRotation(KeyCovariance(calib, spec.tokens, kHq, kHkv, kD), kD);
  const auto rv = OscarRotation(ValueCovariance(calib, spec.tokens, kHq, kHkv, kD), kD);
  ASSERT_LT(OrthogonalityError(rk, kD), 1e-5);
  ASSERT_LT(OrthogonalityError(rv, kD), 1e-5);

  const double naive = AttentionError(eval, 512, identity, identity);
  const double had = AttentionError(eval, 512, hadamard, hadamard);
  const double oscar = AttentionError(eval, 512, rk, rv);
  std::printf("attention-output relative error: naive %.4f, hadamard %.4f, oscar %.4f\n", naive,
              had, oscar);

  // Measured on this generator (seed 11, 512 tokens, d = 128, windows 64 + 64):
  // naive 0.457, hadamard 0.356 (x0.78), oscar 0.379 (x0.83). With one quantization group
  // per row (docs/formats.md "int2-oscar") the bit-reversal permutation cannot rebalance groups,
  // and on this data the calibrated rotation is not better than Hadamard; docs/performance.md.
  EXPECT_LT(had, 0.85 * naive);
  EXPECT_LT(oscar, 0.9 * naive);
}

}  // namespace codec_quality_test
}  // namespace kvcd
