// The tensor-core FSQ encoder's bound and scalar reference (fsq_tc.h).
#include "kvcd/kernels/fsq_tc.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "fsq_encode.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/fp16.h"

namespace kvcd::kernels {
namespace {

int Planes(FsqTcOperands ops) { return ops == FsqTcOperands::kBf16Split ? 2 : 1; }

float RoundFp16(float v) { return HalfToFloat(FloatToHalf(v)); }

// x as the kernel stores it in shared memory (fsq_encode_tc.cu StoreX).
float XOperand(float v, FsqTcOperands ops) {
  if (ops != FsqTcOperands::kFp16) return RoundBf16(v);
  constexpr float kMax = 65504.0f;
  if (std::isfinite(v) && std::fabs(v) > kMax) v = std::copysign(kMax, v);
  return RoundFp16(v);
}

// The power of two 2^k of an FP16 row (PrepareEncoderKernel): max |E_g| 2^k in
// [2^14, 2^15), k within [-126, 126]; 0 for a zero row.
int Fp16RowExponent(const float* e, int32_t c) {
  float m = 0.0f;
  for (int32_t i = 0; i < c; ++i) m = std::max(m, std::fabs(e[i]));
  if (m == 0.0f) return 0;
  int ex = 0;
  (void)std::frexp(m, &ex);
  return std::clamp(15 - ex, -126, 126);
}

}  // namespace

double FsqEncodeTcBound(const FsqTcBoundTerms& t, int32_t residual_width, FsqTcOperands ops,
                        bool x_bf16) {
  const bool fp16 = ops == FsqTcOperands::kFp16;
  // Unit roundoffs: BF16 2^-8, FP16 2^-11 (normal range); the split E to 2^-16.
  const double ulp_e = fp16 ? 0x1p-11 : ops == FsqTcOperands::kBf16 ? 0x1p-8 : 0x1p-16;
  // x: BF16 -> BF16 exact, BF16 -> FP16 exact in FP16's normal range, F32 rounded.
  const double ulp_x = x_bf16 ? 0.0 : (fp16 ? 0x1p-11 : 0x1p-8);
  const double products = ulp_e + ulp_x + ulp_e * ulp_x;
  const double terms = static_cast<double>(Planes(ops)) * residual_width + 16.0;
  const double accumulate = terms * 0x1p-22 * (1.0 + products);
  const double oracle = (residual_width + 1.0) * 0x1p-53;
  // Below the normal range rounding is absolute: x under 2^-14 in FP16 by <= 2^-25; E's
  // rows are scaled to max |E_g| >= 2^14 for FP16, so a weight loses <= 2^-25 2^-14 max|E_g|
  // <= 2^-39 sum |E_g|; BF16 (E, or F32 x) by <= 2^-134.
  const double tiny = fp16 ? 0x1p-25 * t.abs_e * 1.001 + 0x1p-39 * t.abs_e * t.abs_x
                           : 0x1p-133 * (t.abs_e + t.abs_x);
  return t.abs_sum * (products + accumulate + oracle) + tiny;
}

void FsqEncodeRowsTcReference(const FsqLayerCodec& codec, const float* x, int64_t tokens,
                              FsqTcOperands ops, uint8_t* codes) {
  const int32_t C = codec.residual_width, G = codec.latent_width;
  const int64_t cb = FsqCodeBytes(G);
  double thr[kFsqThresholds];
  FsqLatentThresholds(thr);
  // E as prepared: the planes' values (as floats) and each row's scale back.
  std::vector<float> hi(static_cast<size_t>(G) * C), lo;
  std::vector<double> back(static_cast<size_t>(G), 1.0);
  if (ops == FsqTcOperands::kBf16Split) lo.resize(hi.size());
  for (int32_t g = 0; g < G; ++g) {
    const float* e = codec.encoder + int64_t{g} * C;
    const int k = ops == FsqTcOperands::kFp16 ? Fp16RowExponent(e, C) : 0;
    back[static_cast<size_t>(g)] = std::ldexp(1.0, -k);
    for (int32_t c = 0; c < C; ++c) {
      const size_t i = static_cast<size_t>(g) * C + c;
      if (ops == FsqTcOperands::kFp16) {
        hi[i] = RoundFp16(std::ldexp(e[c], k));
      } else {
        hi[i] = RoundBf16(e[c]);
        if (!lo.empty()) lo[i] = RoundBf16(e[c] - hi[i]);
      }
    }
  }
  std::fill(codes, codes + tokens * cb, uint8_t{0});
  std::vector<float> xo(static_cast<size_t>(C));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int32_t c = 0; c < C; ++c) xo[static_cast<size_t>(c)] = XOperand(x[t * C + c], ops);
    for (int32_t g = 0; g < G; ++g) {
      // Products of two 16-bit operands are exact in FP32; the sum is FP32.
      const float* h = hi.data() + static_cast<size_t>(g) * C;
      float sum = 0.0f;
      for (int32_t c = 0; c < C; ++c) sum += h[c] * xo[static_cast<size_t>(c)];
      if (!lo.empty()) {
        const float* l = lo.data() + static_cast<size_t>(g) * C;
        for (int32_t c = 0; c < C; ++c) sum += l[c] * xo[static_cast<size_t>(c)];
      }
      const double u = static_cast<double>(sum) * back[static_cast<size_t>(g)] +
                       static_cast<double>(codec.encoder_bias[g]);
      int z = 0;
      if (!std::isnan(u)) {
        z = -8;
        for (int k = 0; k < kFsqThresholds; ++k) z += u >= thr[k] ? 1 : 0;
      }
      internal::FsqPutNibble(codes + t * cb, g, z);
    }
  }
}

}  // namespace kvcd::kernels
