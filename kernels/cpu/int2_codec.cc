#include "kvcd/kernels/int2_codec.h"

#include <algorithm>
#include <cmath>

#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/fp16_saturate.h"
#include "kvcd/kernels/isa_dispatch.h"

namespace kvcd::kernels {

float Int2ClipThreshold(const float* x, int d, float rho) {
  float a[256];
  for (int i = 0; i < d; ++i) a[i] = std::fabs(x[i]);
  const int k = std::min(static_cast<int>(std::floor(rho * static_cast<float>(d))), d - 1);
  std::nth_element(a, a + k, a + d);  // the k-th smallest |x|: sort(|x|)[k]
  return a[k];
}

namespace internal {
void RotateRowsAvx512(const float* x, int64_t n, int d, const float* r, float* out);
}  // namespace internal

namespace {

void RotateRowsScalar(const float* x, int64_t n, int d, const float* r, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    const float* xr = x + t * d;
    float* o = out + t * d;
    std::fill(o, o + d, 0.0f);
    for (int i = 0; i < d; ++i) {
      const float xi = xr[i];
      const float* ri = r + static_cast<int64_t>(i) * d;
      for (int j = 0; j < d; ++j) o[j] += xi * ri[j];
    }
  }
}

}  // namespace

void RotateRows(const float* x, int64_t n, int d, const float* r, float* out, CpuIsa isa) {
  // No AVX2 version: the scalar loop stands in for it.
  ForIsa(UsableIsa(isa, d, 16, 1), RotateRowsScalar, RotateRowsScalar, internal::RotateRowsAvx512)(
      x, n, d, r, out);
}

Rotation ClassifyRotation(const float* r, int d) {
  if (r == nullptr) return Rotation::kNone;
  const float c = r[0];
  if (!(c > 0.0f)) return Rotation::kDense;
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      const float want = (__builtin_popcount(static_cast<unsigned>(i & j)) & 1) != 0 ? -c : c;
      if (r[static_cast<int64_t>(i) * d + j] != want) return Rotation::kDense;
    }
  }
  return Rotation::kHadamard;
}

void HadamardRotateRow(const float* x, int d, float c, float* out) {
  std::copy(x, x + d, out);
  for (int h = 1; h < d; h *= 2) {
    for (int i = 0; i < d; ++i) {
      if ((i & h) != 0) continue;
      const float a = out[i], b = out[i + h];
      out[i] = a + b;
      out[i + h] = a - b;
    }
  }
  for (int i = 0; i < d; ++i) out[i] *= c;
}

void UnrotateRows(const float* y, int64_t n, int d, const float* r, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    const float* yr = y + t * d;
    float* o = out + t * d;
    for (int i = 0; i < d; ++i) {
      const float* ri = r + static_cast<int64_t>(i) * d;
      float acc = 0.0f;
      for (int j = 0; j < d; ++j) acc += yr[j] * ri[j];
      o[i] = acc;
    }
  }
}

void DemoteRowsToInt2(const float* rows, int64_t n, int d, const float* rotation, float rho,
                      const Int2RowRef& out, int64_t first_row) {
  DemoteRowsToInt2(rows, n, d, rotation, ClassifyRotation(rotation, d), rho, out, first_row);
}

void DemoteRowsToInt2(const float* rows, int64_t n, int d, const float* rotation, Rotation kind,
                      float rho, const Int2RowRef& out, int64_t first_row) {
  float rot[256];
  const int quarter = d / 4;
  for (int64_t t = 0; t < n; ++t) {
    const float* x = rows + t * d;
    if (kind == Rotation::kHadamard) {
      HadamardRotateRow(x, d, rotation[0], rot);
    } else if (kind == Rotation::kDense) {
      RotateRows(x, 1, d, rotation, rot);
    } else {
      std::copy(x, x + d, rot);
    }
    // Beyond +-65504 the row's FP16 scale or offset would overflow: saturate first.
    for (int i = 0; i < d; ++i) rot[i] = SaturateToFp16Range(rot[i]);
    const float tau = Int2ClipThreshold(rot, d, rho);
    float lo = tau, hi = -tau;
    for (int i = 0; i < d; ++i) {
      rot[i] = std::min(std::max(rot[i], -tau), tau);
      lo = std::min(lo, rot[i]);
      hi = std::max(hi, rot[i]);
    }
    const float scale = std::max(hi - lo, 1e-8f) / 3.0f;
    const float zero = -lo / scale;
    uint8_t packed[64] = {};
    for (int i = 0; i < d; ++i) {
      const float qf = std::floor(rot[i] / scale + zero + 0.5f);
      // Clamp to 0..3 without casting an out-of-range float (a NaN row would make the cast,
      // and the shift of its negative result, undefined); NaN maps to 0.
      const unsigned q = qf >= 3.0f ? 3u : qf > 0.0f ? static_cast<unsigned>(qf) : 0u;
      packed[i % quarter] = static_cast<uint8_t>(packed[i % quarter] | (q << (2 * (i / quarter))));
    }
    const int64_t row = first_row + t;
    for (int j = 0; j < quarter; ++j) out.codes[out.Offset(row, j)] = packed[j];
    out.scale[row * out.param_stride] = FloatToHalf(scale);
    out.lo[row * out.param_stride] = FloatToHalf(lo);
  }
}

void ExpandInt2Rows(const Int2RowRef& in, int64_t n, int d, const float* rotation, float* out,
                    int64_t first_row) {
  float xh[256];
  const int quarter = d / 4;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = first_row + t;
    const float scale = HalfToFloat(in.scale[row * in.param_stride]);
    const float lo = HalfToFloat(in.lo[row * in.param_stride]);
    for (int i = 0; i < d; ++i) {
      const int q = (in.codes[in.Offset(row, i % quarter)] >> (2 * (i / quarter))) & 3;
      xh[i] = static_cast<float>(q) * scale + lo;
    }
    if (rotation != nullptr) {
      UnrotateRows(xh, 1, d, rotation, out + t * d);
    } else {
      std::copy(xh, xh + d, out + t * d);
    }
  }
}

}  // namespace kvcd::kernels
