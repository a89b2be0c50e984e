// FSQ encode (residual -> packed 4-bit code), unpack and expand (docs/fsq.md). The encoder is
// the one definition of a code: float64 sums over c in order, tanh/atanh in float64, round
// half to even. Built with -ffp-contract=off so no ISA or compiler fuses its arithmetic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fsq_encode.h"
#include "fsq_math.h"
#include "kvcd/kernels/fsq.h"
#include "kvcd/kernels/isa_dispatch.h"

namespace kvcd::kernels {
namespace internal {
namespace {

// Round half to even of a finite double, exact (v - floor(v) is exact below 2^52).
double RoundHalfEven(double v) {
  const double f = std::floor(v);
  const double frac = v - f;
  if (frac > 0.5) return f + 1.0;
  if (frac < 0.5) return f;
  return std::fmod(f, 2.0) == 0.0 ? f : f + 1.0;
}

// u[t][r] = sum_c E[g0+r][c] x[t][c] in order of c, for kT tokens and kR rows at once
// (kT*kR independent chains; each chain keeps the order of the definition).
template <int kT, int kR>
void DotBlock(const float* e, int64_t C, const float* x, double (&u)[kT][kR]) {
  double acc[kT][kR] = {};
  for (int64_t c = 0; c < C; ++c) {
    for (int t = 0; t < kT; ++t) {
      const double xv = x[t * C + c];
      for (int r = 0; r < kR; ++r) acc[t][r] += static_cast<double>(e[r * C + c]) * xv;
    }
  }
  for (int t = 0; t < kT; ++t)
    for (int r = 0; r < kR; ++r) u[t][r] = acc[t][r];
}

template <int kT, int kR>
void EncodeBlock(const FsqLayerCodec& codec, const float* x, int g0, uint8_t* codes) {
  const int64_t C = codec.residual_width;
  const int64_t cb = FsqCodeBytes(codec.latent_width);
  double u[kT][kR];
  DotBlock<kT, kR>(codec.encoder + g0 * C, C, x, u);
  for (int t = 0; t < kT; ++t) {
    for (int r = 0; r < kR; ++r) {
      FsqPutNibble(codes + t * cb, g0 + r, FsqQuantizeLatent(u[t][r], codec.encoder_bias[g0 + r]));
    }
  }
}

}  // namespace

int FsqQuantizeLatent(double sum, float bias) {
  static const double kShift = std::atanh(kFsqDelta / kFsqH);
  const double u = sum + static_cast<double>(bias);
  const double ut = kFsqH * std::tanh(u + kShift) - kFsqDelta;
  if (std::isnan(ut)) return 0;
  return static_cast<int>(RoundHalfEven(std::clamp(ut, -8.0, 7.0)));
}

void FsqEncodeRowsScalar(const FsqLayerCodec& codec, const float* x, int64_t tokens, int g_begin,
                         int g_end, uint8_t* codes) {
  constexpr int kT = 4, kR = 2;
  const int64_t C = codec.residual_width;
  const int64_t cb = FsqCodeBytes(codec.latent_width);
  int64_t t = 0;
  for (; t + kT <= tokens; t += kT) {
    int g = g_begin;
    for (; g + kR <= g_end; g += kR) EncodeBlock<kT, kR>(codec, x + t * C, g, codes + t * cb);
    for (; g < g_end; ++g) EncodeBlock<kT, 1>(codec, x + t * C, g, codes + t * cb);
  }
  for (; t < tokens; ++t) {
    int g = g_begin;
    for (; g + kR <= g_end; g += kR) EncodeBlock<1, kR>(codec, x + t * C, g, codes + t * cb);
    for (; g < g_end; ++g) EncodeBlock<1, 1>(codec, x + t * C, g, codes + t * cb);
  }
}

}  // namespace internal

namespace {

void FsqEncodeAllRowsScalar(const FsqLayerCodec& codec, const float* x, int64_t tokens,
                            uint8_t* codes) {
  internal::FsqEncodeRowsScalar(codec, x, tokens, 0, codec.latent_width, codes);
}

}  // namespace

void FsqEncodeRows(const FsqLayerCodec& codec, const float* x, int64_t tokens, uint8_t* codes,
                   CpuIsa isa) {
  const int G = codec.latent_width;
  std::fill(codes, codes + tokens * FsqCodeBytes(G), uint8_t{0});  // odd G: last high nibble 0
  // The AVX2 encoder serves AVX-512 CPUs too.
  ForIsa(isa, FsqEncodeAllRowsScalar, internal::FsqEncodeRowsAvx2, internal::FsqEncodeRowsAvx2)(
      codec, x, tokens, codes);
}

namespace {

// Doubles in order as int64 keys (negative values mirrored) and back.
int64_t OrderedKey(double v) {
  int64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b < 0 ? std::numeric_limits<int64_t>::min() - b : b;
}
double FromOrderedKey(int64_t k) {
  const int64_t b = k < 0 ? std::numeric_limits<int64_t>::min() - k : k;
  double v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

}  // namespace

void FsqLatentThresholds(double thresholds[kFsqThresholds]) {
  // Q(u) saturates far inside [-64, 64] (|h tanh| <= h): search the ordered doubles there
  // for the smallest u with Q(u) >= -7 + k.
  for (int k = 0; k < kFsqThresholds; ++k) {
    int64_t lo = OrderedKey(-64.0), hi = OrderedKey(64.0);  // Q(lo) < level <= Q(hi)
    const int level = -7 + k;
    while (static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) > 1) {
      const int64_t mid =
          lo + static_cast<int64_t>((static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo)) / 2);
      if (internal::FsqQuantizeLatent(FromOrderedKey(mid), 0.0f) >= level) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    thresholds[k] = FromOrderedKey(hi);
  }
}

void FsqUnpackCode(const uint8_t* code, int latent_width, int8_t* z) {
  for (int g = 0; g < latent_width; ++g) {
    const int nib = g % 2 == 0 ? code[g / 2] & 0x0F : code[g / 2] >> 4;
    z[g] = static_cast<int8_t>(nib - 8);
  }
}

void FsqExpandToken(const FsqLayerCodec& codec, const RopeSpec& rope, const uint8_t* code,
                    int64_t position, float* k, float* v) {
  const int d = codec.head_dim, G = codec.latent_width;
  std::vector<int8_t> z(static_cast<size_t>(G));
  FsqUnpackCode(code, G, z.data());
  std::vector<double> row(static_cast<size_t>(d));
  for (int h = 0; h < codec.num_kv_heads; ++h) {
    internal::FsqRebuildKeyDouble(codec, rope, h, z.data(), position, row.data());
    for (int i = 0; i < d; ++i) k[h * d + i] = static_cast<float>(row[i]);
    internal::FsqDecodeHeadDouble(codec.decoder_v, codec.bias_v, h, d, G, z.data(), row.data());
    for (int i = 0; i < d; ++i) v[h * d + i] = static_cast<float>(row[i]);
  }
}

}  // namespace kvcd::kernels
