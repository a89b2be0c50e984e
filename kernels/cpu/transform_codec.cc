// Transform-coded key rows: encoder and decoder in float64 (compiled without FP
// contraction, in the tools' operation order: bit-identical to TransformRoundTrip).
#include "kvcd/kernels/transform_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/fp16_saturate.h"

namespace kvcd::kernels {
namespace {

// GaussianUniformStep(b) of tools/bit_allocation.cc, to the last bit (tested there).
constexpr double kSteps[kMaxTransformBits + 1] = {
    0x0p+0,
    0x1.988453314034ep+0,
    0x1.fdcaa613cbdbp-1,
    0x1.2c0abdfcdcd44p-1,
    0x1.573ed4be65062p-2,
    0x1.814ee8126d77ep-3,
    0x1.aa3df83cd4f1ap-4,
    0x1.d1dc2bec5866p-5,
    0x1.f802c3fbb8f68p-6,
};

constexpr int kMaxD = 256;

}  // namespace

double TransformStep(int bits) { return bits >= 0 && bits <= kMaxTransformBits ? kSteps[bits] : 0; }

void EncodeTransformKeys(const TransformKeyCode& c, const float* rows, int64_t n, uint8_t* codes,
                         int64_t code_stride, uint16_t* gains, int64_t gain_stride) {
  const int d = c.d;
  double z[kMaxD];
  for (int64_t t = 0; t < n; ++t) {
    const float* x = rows + t * d;
    double ss = 0;
    int coded = 0;
    for (int i = 0; i < d; ++i) {
      z[i] = 0.0;
      if (c.bits[i] == 0) continue;
      double s = 0;
      for (int j = 0; j < d; ++j) {
        s += static_cast<double>(c.encode[i * d + j]) *
             (static_cast<double>(x[j]) - static_cast<double>(c.mean[j]));
      }
      z[i] = s / static_cast<double>(c.sigma[i]);
      ss += z[i] * z[i];
      ++coded;
    }
    double gain = 1.0;
    if (coded > 0) {
      double g = std::sqrt(ss / coded);
      for (int i = 0; i < d; ++i) {
        if (c.bits[i] == 0) continue;
        const double half_range = (1 << (c.bits[i] - 1)) * kSteps[c.bits[i]] * 1.0;
        g = std::max(g, std::fabs(z[i]) / (half_range * 1.0));
      }
      // Saturated at FP16's largest finite value (a row far beyond it: codes clip).
      const float h = HalfToFloat(
          FloatToHalf(static_cast<float>(std::min(g * (1 + 1.0 / 1024), double{kFp16Max}))));
      gain = h > 0 && std::isfinite(h) ? h : 1.0;
    }
    gains[t * gain_stride] = FloatToHalf(static_cast<float>(gain));
    uint8_t* row = codes + t * code_stride;
    std::memset(row, 0, static_cast<size_t>(c.code_bytes));
    int pos = 0;
    for (int i = 0; i < d; ++i) {
      const int b = c.bits[i];
      if (b == 0) continue;
      const int levels = 1 << b;
      const double step = kSteps[b] * 1.0 * gain;
      const double k = std::clamp(std::floor(z[i] / step + levels / 2.0), 0.0, levels - 1.0);
      const int code = static_cast<int>(k);
      for (int j = 0; j < b; ++j, ++pos) {
        row[pos >> 3] = static_cast<uint8_t>(row[pos >> 3] | (((code >> j) & 1) << (pos & 7)));
      }
    }
  }
}

void DecodeTransformKeys(const TransformKeyCode& c, const uint8_t* codes, int64_t code_stride,
                         const uint16_t* gains, int64_t gain_stride, int64_t n, float* out) {
  const int d = c.d;
  double y[kMaxD];
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* row = codes + t * code_stride;
    const double gain = HalfToFloat(gains[t * gain_stride]);
    int pos = 0;
    for (int i = 0; i < d; ++i) {
      const int b = c.bits[i];
      y[i] = 0.0;
      if (b == 0) continue;
      const int levels = 1 << b;
      const double step = kSteps[b] * 1.0 * gain;
      const double k = TransformCodeAt(row, pos, b);
      pos += b;
      y[i] = (k - (levels - 1) / 2.0) * step * static_cast<double>(c.sigma[i]);
    }
    for (int j = 0; j < d; ++j) {
      double s = c.mean[j];
      for (int i = 0; i < d; ++i) s += static_cast<double>(c.decode[j * d + i]) * y[i];
      out[t * d + j] = static_cast<float>(s);
    }
  }
}

}  // namespace kvcd::kernels
