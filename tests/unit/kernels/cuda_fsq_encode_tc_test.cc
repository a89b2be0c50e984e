// The tensor-core FSQ encoder (cuda_fsq_encode_tc.h) against the float64 oracle
// (FsqEncodeRows's sum and rounding), on the device (skipped without a GPU): every code lies
// between the oracle's codes of u - bound and u + bound (FsqEncodeTcBound), on random
// geometries (odd C and G, several 128-token and 128-latent blocks, BF16 and F32 residuals,
// every operand kind, scattered slots at an offset, bytes outside the codes untouched); the
// codes match the scalar reference (fsq_tc.h) but for the order of the FP32 sums; the
// fraction of codes that differ from the oracle stays small; the non-finite check zeroes
// and reports rows as the float64 encoder's does; bad arguments are refused.
#include "kvcd/kernels/cuda_fsq_encode_tc.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "cuda_test_fixture.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels {
namespace cuda_fsq_encode_tc_test {

class CudaFsqEncodeTcTest : public CudaTestFixture {
 protected:
  // The codec's prepared encoders for `layers` layers of E [layers][G][C] (device).
  void* Prepare(const float* d_e, int layers, int C, int G, FsqTcOperands ops) {
    const size_t bytes = cuda::FsqEncoderTcBytes(C, G, ops);
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes * layers), cudaSuccess);
    owned_.push_back(p);
    for (int l = 0; l < layers; ++l) {
      EXPECT_EQ(cuda::LaunchFsqPrepareEncoderTc(d_e + int64_t{l} * G * C, C, G, ops,
                                                static_cast<uint8_t*>(p) + l * bytes, nullptr)
                    .device_code(),
                cudaSuccess);
    }
    return p;
  }
};

// -8 + #{k : u >= thr[k]}, NaN -> 0 (FsqLatentThresholds' definition).
int CodeOf(double u, const double* thr) {
  if (std::isnan(u)) return 0;
  int z = -8;
  for (int k = 0; k < kFsqThresholds; ++k) z += u >= thr[k] ? 1 : 0;
  return z;
}

TEST_F(CudaFsqEncodeTcTest, CodesLieWithinTheBoundOfTheOracle) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double thr[kFsqThresholds];
  FsqLatentThresholds(thr);
  struct Case {
    int C, G, tokens;
  };
  // KVCD_FSQ_TEST_SMALL=1 (the compute-sanitizer runs): the small cases only.
  std::vector<Case> cases = {Case{37, 85, 131}, Case{64, 1, 5}};
  if (std::getenv("KVCD_FSQ_TEST_SMALL") == nullptr) {
    cases.push_back(Case{300, 256, 300});
    cases.push_back(Case{4096, 300, 140});
  }
  for (const Case k : cases) {
    for (const bool bf16 : {false, true}) {
      for (const FsqTcOperands ops :
           {FsqTcOperands::kBf16, FsqTcOperands::kBf16Split, FsqTcOperands::kFp16}) {
        const int C = k.C, G = k.G, tokens = k.tokens, layers = 2, ps = 16;
        const int pages = (tokens + ps - 1) / ps + 2;
        const int64_t cb = FsqCodeBytes(G), offset = 24, page_bytes = offset + ps * cb + 8;
        // The synthetic codec's scales (FsqCodec::Synthetic): E ~ N(0, 4/C), e ~ N(0, 0.01);
        // residuals with a few large channels.
        std::vector<float> e(int64_t{layers} * G * C), eb(layers * G),
            x(int64_t{layers} * tokens * C);
        for (auto& v : e) v = normal(rng_) * 2.0f / std::sqrt(static_cast<float>(C));
        for (auto& v : eb) v = 0.1f * normal(rng_);
        for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) {
          x[i] = normal(rng_) * ((i % C) % 61 == 3 ? 8.0f : 1.0f);
        }
        std::vector<uint16_t> xb(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          xb[i] = FloatToBf16(x[i]);
          if (bf16) x[i] = Bf16ToFloat(xb[i]);  // the oracle sees the widened BF16
        }
        std::vector<int64_t> slots(pages * ps);
        for (int i = 0; i < pages * ps; ++i) slots[i] = i;
        std::shuffle(slots.begin(), slots.end(), rng_);
        slots.resize(tokens);

        float* d_e = Up(e);
        std::vector<FsqLayerCodec> codecs(layers);
        float* d_eb = Up(eb);
        for (int l = 0; l < layers; ++l) {
          codecs[l].residual_width = C;
          codecs[l].latent_width = G;
          codecs[l].encoder_bias = d_eb + l * G;
        }
        const void* prepared = Prepare(d_e, layers, C, G, ops);
        cuda::RowBlock rb;
        rb.data = bf16 ? static_cast<const void*>(Up(xb)) : static_cast<const void*>(Up(x));
        rb.bf16 = bf16;
        rb.layer_stride = int64_t{tokens} * C;
        rb.token_stride = C;
        cuda::PagedRows dst;
        dst.num_layers = layers;
        dst.num_tokens = tokens;
        dst.page_size = ps;
        const std::vector<uint8_t> init(int64_t{layers} * pages * page_bytes, 0xAB);
        dst.base = Up(init);
        dst.layer_stride = pages * page_bytes;
        dst.page_bytes = page_bytes;
        dst.slots = Up(slots);
        ASSERT_EQ(
            cuda::LaunchFsqEncodeRowsTc(rb, dst, offset, Up(codecs), prepared, C, G, ops, nullptr)
                .device_code(),
            cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<uint8_t> got = Down(dst.base, init.size());

        int64_t differ = 0, outside = 0, unlike_reference = 0;
        std::vector<int8_t> z(G), zr(G);
        std::vector<uint8_t> ref(tokens * cb);
        for (int l = 0; l < layers; ++l) {
          // The scalar reference (fsq_tc.h): the same operands, FP32 sums in order of c.
          FsqLayerCodec hc{};
          hc.residual_width = C;
          hc.latent_width = G;
          hc.encoder = e.data() + int64_t{l} * G * C;
          hc.encoder_bias = eb.data() + l * G;
          FsqEncodeRowsTcReference(hc, x.data() + int64_t{l} * tokens * C, tokens, ops, ref.data());
          for (int t = 0; t < tokens; ++t) {
            uint8_t* code = got.data() + l * pages * page_bytes + (slots[t] / ps) * page_bytes +
                            offset + (slots[t] % ps) * cb;
            FsqUnpackCode(ref.data() + t * cb, G, zr.data());
            if (G % 2 == 1) {
              EXPECT_EQ(code[cb - 1] >> 4, 0) << "odd G: high nibble 0";
            }
            FsqUnpackCode(code, G, z.data());
            const float* xr = x.data() + (int64_t{l} * tokens + t) * C;
            FsqTcBoundTerms terms;
            for (int c = 0; c < C; ++c) terms.abs_x += std::fabs(xr[c]);
            for (int g = 0; g < G; ++g) {
              const float* er = e.data() + (int64_t{l} * G + g) * C;
              double u = 0;
              terms.abs_sum = terms.abs_e = 0;
              for (int c = 0; c < C; ++c) {
                const double p = static_cast<double>(er[c]) * xr[c];
                u += p;
                terms.abs_sum += std::fabs(p);
                terms.abs_e += std::fabs(er[c]);
              }
              const double b = static_cast<double>(eb[l * G + g]);
              const double bound = FsqEncodeTcBound(terms, C, ops, bf16);
              const int lo = CodeOf(u + b - bound, thr), hi = CodeOf(u + b + bound, thr);
              const int want = CodeOf(u + b, thr);
              differ += z[g] != want;
              if (z[g] < lo || z[g] > hi) {
                if (++outside <= 5) {
                  ADD_FAILURE() << "layer " << l << " token " << t << " latent " << g << ": code "
                                << int{z[g]} << ", oracle " << want << ", allowed " << lo << ".."
                                << hi << " (u " << u + b << ", bound " << bound << ")";
                }
              }
            }
            for (int g = 0; g < G; ++g) unlike_reference += z[g] != zr[g];
            std::fill(code, code + cb, 0xAB);  // what remains must be untouched
          }
        }
        EXPECT_EQ(outside, 0);
        // Against the reference only the order of the FP32 sums differs (~2^-23 sqrt(C) of
        // abs_sum, ~1e-5 of the codes): more than 0.05% means an operand or index is wrong.
        EXPECT_LE(unlike_reference, int64_t{layers} * tokens * G / 2000 + 1)
            << unlike_reference << " codes differ from the scalar reference's";
        EXPECT_EQ(std::count(got.begin(), got.end(), 0xAB), static_cast<int64_t>(got.size()))
            << "bytes outside the code rows changed";
        const double fraction = static_cast<double>(differ) / (int64_t{layers} * tokens * G);
        const char* name = ops == FsqTcOperands::kBf16        ? "BF16 E "
                           : ops == FsqTcOperands::kBf16Split ? "split E"
                                                              : "FP16   ";
        std::printf("C %4d G %3d %s x, %s: %.4f%% of codes differ from the oracle\n", C, G,
                    bf16 ? "BF16" : "F32 ", name, 100.0 * fraction);
        // By count (bench/results/2026-12-05-h200-fsq-enc.md): ~1% for BF16 operands at these
        // scales, ~1/8 of that for FP16, ~2^-8 of it for the split E with BF16 x.
        // A fraction of a few codes says little (the case of 10 codes saw 1 differ on the
        // H100): the count may pass the expected one by three standard deviations and one.
        const double ceiling = ops == FsqTcOperands::kFp16                ? 0.006
                               : ops == FsqTcOperands::kBf16Split && bf16 ? 0.002
                                                                          : 0.04;
        const double codes = static_cast<double>(int64_t{layers} * tokens * G);
        EXPECT_LE(static_cast<double>(differ),
                  ceiling * codes + 3.0 * std::sqrt(ceiling * codes) + 1.0)
            << name << ": " << differ << " of " << codes << " codes";
      }
    }
  }
}

TEST_F(CudaFsqEncodeTcTest, CheckZeroesAndReportsNonFiniteRows) {
  const int C = 40, G = 9, tokens = 5, ps = 16;
  const int64_t cb = FsqCodeBytes(G);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> e(G * C), eb(G), x(tokens * C);
  for (auto& v : e) v = normal(rng_);
  for (auto& v : x) v = normal(rng_);
  x[2 * C + 7] = std::numeric_limits<float>::quiet_NaN();
  x[2 * C + 9] = std::numeric_limits<float>::infinity();
  x[4 * C + 0] = -std::numeric_limits<float>::infinity();
  for (const bool bf16 : {false, true}) {
    for (const FsqTcOperands ops : {FsqTcOperands::kBf16, FsqTcOperands::kFp16}) {
      FsqLayerCodec codec{};
      codec.residual_width = C;
      codec.latent_width = G;
      codec.encoder_bias = Up(eb);
      const void* prepared = Prepare(Up(e), 1, C, G, ops);
      std::vector<uint16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) xb[i] = FloatToBf16(x[i]);
      cuda::RowBlock rb;
      rb.data = bf16 ? static_cast<const void*>(Up(xb)) : static_cast<const void*>(Up(x));
      rb.bf16 = bf16;
      rb.layer_stride = int64_t{tokens} * C;
      rb.token_stride = C;
      cuda::PagedRows dst;
      dst.num_layers = 1;
      dst.num_tokens = tokens;
      dst.page_size = ps;
      dst.base = Up(std::vector<uint8_t>(ps * cb, 0xAB));
      dst.layer_stride = ps * cb;
      dst.page_bytes = ps * cb;
      for (int t = 0; t < tokens; ++t) dst.inline_slots[t] = t;
      auto* counters = Up(std::vector<unsigned long long>{0, ~0ull});
      cuda::StoreCheck check;
      check.count = counters;
      check.first_row = counters + 1;
      ASSERT_EQ(cuda::LaunchFsqEncodeRowsTc(rb, dst, 0, Up(std::vector<FsqLayerCodec>{codec}),
                                            prepared, C, G, ops, nullptr, &check)
                    .device_code(),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto got = Down(dst.base, ps * cb);
      const auto cnt = Down(counters, 2);
      EXPECT_EQ(cnt[0], 3u);
      EXPECT_EQ(cnt[1], 2u);
      for (int t : {2, 4}) {
        for (int i = 0; i < cb; ++i) {
          EXPECT_EQ(got[t * cb + i], i == cb - 1 ? 0x08 : 0x88) << "t=" << t;  // z = 0, odd G
        }
      }
      for (int t : {0, 1, 3}) {  // finite rows are encoded (not all zero codes)
        EXPECT_FALSE(std::all_of(got.begin() + t * cb, got.begin() + t * cb + cb - 1,
                                 [](uint8_t b) { return b == 0x88; }))
            << "t=" << t;
      }
      for (int i = tokens * static_cast<int>(cb); i < ps * cb; ++i) EXPECT_EQ(got[i], 0xAB);
    }
  }
}

TEST_F(CudaFsqEncodeTcTest, RejectsBadArguments) {
  const int C = 32, G = 8;
  std::vector<float> e(G * C, 0.5f);
  float* d_e = Up(e);
  void* prepared = Prepare(d_e, 1, C, G, FsqTcOperands::kBf16);
  EXPECT_EQ(
      cuda::LaunchFsqPrepareEncoderTc(d_e, C, G, static_cast<FsqTcOperands>(0), prepared, nullptr)
          .device_code(),
      cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchFsqPrepareEncoderTc(d_e, C, G, FsqTcOperands::kBf16,
                                            static_cast<uint8_t*>(prepared) + 2, nullptr)
                .device_code(),
            cudaErrorInvalidValue);
  cuda::RowBlock rb;
  rb.data = Up(std::vector<float>(C, 1.0f));
  rb.bf16 = false;
  rb.token_stride = C;
  cuda::PagedRows dst;
  dst.num_layers = 1;
  dst.num_tokens = 1;
  dst.page_size = 16;
  dst.base = Up(std::vector<uint8_t>(64));
  dst.page_bytes = 64;
  dst.layer_stride = 64;
  const FsqLayerCodec* codecs = Up(std::vector<FsqLayerCodec>(1));
  EXPECT_EQ(cuda::LaunchFsqEncodeRowsTc(rb, dst, 0, codecs, static_cast<uint8_t*>(prepared) + 8, C,
                                        G, FsqTcOperands::kBf16, nullptr)
                .device_code(),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchFsqEncodeRowsTc(rb, dst, 0, codecs, prepared, C, kFsqMaxLatent + 1,
                                        FsqTcOperands::kBf16, nullptr)
                .device_code(),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::LaunchFsqEncodeRowsTc(rb, dst, 0, codecs, nullptr, C, G, FsqTcOperands::kBf16, nullptr)
          .device_code(),
      cudaErrorInvalidValue);
}

}  // namespace cuda_fsq_encode_tc_test
}  // namespace kvcd::kernels
