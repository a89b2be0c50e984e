// The tensor-core FSQ encoder's arithmetic on the CPU (fsq_tc.h): its scalar reference
// against the float64 encoder (FsqEncodeRows, the oracle). Every code lies within
// FsqEncodeTcBound of the oracle's, on random geometries (odd C and G, F32 and BF16
// residuals, every operand kind). At the synthetic codec's scales (C 4096, G 256) the
// fraction of codes that differ stays under each kind's ceiling. The bound matches a hand
// count. About 1 s of CPU in all.
#include "kvcd/kernels/fsq_tc.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels {
namespace fsq_tc_test {

// -8 + #{k : u >= thr[k]}, NaN -> 0 (FsqLatentThresholds' definition).
int CodeOf(double u, const double* thr) {
  if (std::isnan(u)) return 0;
  int z = -8;
  for (int k = 0; k < kFsqThresholds; ++k) z += u >= thr[k] ? 1 : 0;
  return z;
}

struct Outcome {
  int64_t codes = 0, differ = 0, outside = 0;
};

// The reference's codes of `tokens` rows against the oracle's: how many differ, and how many
// lie outside [code(u - bound), code(u + bound)] (must be none).
Outcome Compare(const FsqLayerCodec& codec, const std::vector<float>& x, int tokens,
                FsqTcOperands ops, bool x_bf16) {
  const int C = codec.residual_width, G = codec.latent_width;
  const int64_t cb = FsqCodeBytes(G);
  double thr[kFsqThresholds];
  FsqLatentThresholds(thr);
  std::vector<uint8_t> got(tokens * cb), want(tokens * cb);
  FsqEncodeRowsTcReference(codec, x.data(), tokens, ops, got.data());
  FsqEncodeRows(codec, x.data(), tokens, want.data());
  Outcome o;
  std::vector<int8_t> zg(G), zw(G);
  for (int t = 0; t < tokens; ++t) {
    FsqUnpackCode(got.data() + t * cb, G, zg.data());
    FsqUnpackCode(want.data() + t * cb, G, zw.data());
    if (G % 2 == 1) {
      EXPECT_EQ(got[t * cb + cb - 1] >> 4, 0) << "odd G: high nibble 0";
    }
    const float* xr = x.data() + int64_t{t} * C;
    FsqTcBoundTerms terms;
    for (int c = 0; c < C; ++c) terms.abs_x += std::fabs(xr[c]);
    for (int g = 0; g < G; ++g) {
      const float* er = codec.encoder + int64_t{g} * C;
      double u = 0;
      terms.abs_sum = terms.abs_e = 0;
      for (int c = 0; c < C; ++c) {
        const double p = static_cast<double>(er[c]) * xr[c];
        u += p;
        terms.abs_sum += std::fabs(p);
        terms.abs_e += std::fabs(er[c]);
      }
      u += static_cast<double>(codec.encoder_bias[g]);
      const double bound = FsqEncodeTcBound(terms, C, ops, x_bf16);
      EXPECT_EQ(zw[g], CodeOf(u, thr));  // the oracle is the threshold form of FsqEncodeRows
      ++o.codes;
      o.differ += zg[g] != zw[g];
      if (zg[g] < CodeOf(u - bound, thr) || zg[g] > CodeOf(u + bound, thr)) {
        if (++o.outside <= 5) {
          ADD_FAILURE() << "token " << t << " latent " << g << ": code " << int{zg[g]}
                        << ", oracle " << int{zw[g]} << " (u " << u << ", bound " << bound << ")";
        }
      }
    }
  }
  return o;
}

// The synthetic codec's scales (FsqCodec::Synthetic): E ~ N(0, 4/C), e ~ N(0, 0.01);
// residuals N(0, 1) with every 61st channel at 8x, as BF16 when x_bf16.
struct Synthetic {
  std::vector<float> e, eb, x;
  FsqLayerCodec codec{};
  Synthetic(int C, int G, int tokens, bool x_bf16, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    e.resize(static_cast<size_t>(G) * C);
    eb.resize(G);
    x.resize(static_cast<size_t>(tokens) * C);
    for (auto& v : e) v = normal(rng) * 2.0f / std::sqrt(static_cast<float>(C));
    for (auto& v : eb) v = 0.1f * normal(rng);
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = normal(rng) * ((i % C) % 61 == 3 ? 8.0f : 1.0f);
      if (x_bf16) x[i] = Bf16ToFloat(FloatToBf16(x[i]));
    }
    codec.residual_width = C;
    codec.latent_width = G;
    codec.encoder = e.data();
    codec.encoder_bias = eb.data();
  }
};

constexpr FsqTcOperands kAllOps[] = {FsqTcOperands::kBf16, FsqTcOperands::kFp16,
                                     FsqTcOperands::kBf16Split};

TEST(FsqTcTest, ReferenceCodesLieWithinTheBoundOfTheOracle) {
  std::mt19937 rng(std::random_device{}());
  for (const int C : {37, 300}) {
    for (const int G : {1, 85}) {
      for (const bool x_bf16 : {false, true}) {
        Synthetic s(C, G, 9, x_bf16, rng);
        for (const FsqTcOperands ops : kAllOps) {
          const Outcome o = Compare(s.codec, s.x, 9, ops, x_bf16);
          EXPECT_EQ(o.outside, 0) << "C " << C << " G " << G << " ops " << static_cast<int>(ops);
        }
      }
    }
  }
}

// By count (bench/results/2026-12-05-h200-fsq-enc.md): ~1% of the codes differ with BF16
// operands, ~1/8 of that with FP16, ~2^-8 of it with the split E.
TEST(FsqTcTest, DifferingCodesAtTheSyntheticCodecsScales) {
  std::mt19937 rng(7);
  Synthetic s(4096, 256, 48, true, rng);
  for (const FsqTcOperands ops : kAllOps) {
    const Outcome o = Compare(s.codec, s.x, 48, ops, true);
    const double fraction = static_cast<double>(o.differ) / o.codes;
    std::printf("operands %d: %lld of %lld codes (%.3f%%) differ from the float64 encoder's\n",
                static_cast<int>(ops), static_cast<long long>(o.differ),
                static_cast<long long>(o.codes), 100.0 * fraction);
    EXPECT_EQ(o.outside, 0);
    switch (ops) {
      case FsqTcOperands::kBf16:  // measured here, so not vacuous: 0.3% .. 3%
        EXPECT_GE(fraction, 0.003);
        EXPECT_LE(fraction, 0.03);
        break;
      case FsqTcOperands::kFp16:
        EXPECT_LE(fraction, 0.004);
        break;
      case FsqTcOperands::kBf16Split:
        EXPECT_LE(fraction, 0.0005);
        break;
    }
  }
}

TEST(FsqTcTest, BoundIsTheHandCount) {
  FsqTcBoundTerms t;
  t.abs_sum = 2.0;
  // BF16 operands, BF16 x: 2 (2^-8 + (4096 + 16) 2^-22 (1 + 2^-8) + 4097 2^-53) + tiny.
  const double want = 2.0 * (0x1p-8 + 4112 * 0x1p-22 * (1 + 0x1p-8) + 4097 * 0x1p-53);
  EXPECT_NEAR(FsqEncodeTcBound(t, 4096, FsqTcOperands::kBf16, true), want, 1e-15);
  // The split E: 2^-16 and twice the products; F32 x adds 2^-8 (and the cross term).
  const double split = 2.0 * ((0x1p-16 + 0x1p-8 + 0x1p-24) +
                              8208 * 0x1p-22 * (1 + 0x1p-16 + 0x1p-8 + 0x1p-24) + 4097 * 0x1p-53);
  EXPECT_NEAR(FsqEncodeTcBound(t, 4096, FsqTcOperands::kBf16Split, false), split, 1e-15);
  // FP16 with subnormal terms: 2^-25 abs_e (x below 2^-14) and 2^-39 abs_e abs_x.
  t.abs_e = 4.0;
  t.abs_x = 1000.0;
  const double fp16 = 2.0 * (0x1p-11 + 4112 * 0x1p-22 * (1 + 0x1p-11) + 4097 * 0x1p-53) +
                      0x1p-25 * 4.0 * 1.001 + 0x1p-39 * 4000.0;
  EXPECT_NEAR(FsqEncodeTcBound(t, 4096, FsqTcOperands::kFp16, true), fp16, 1e-15);
}

}  // namespace fsq_tc_test
}  // namespace kvcd::kernels
