#include "kvcd/kernels/int2_codec.h"

#include <algorithm>
#include <cmath>

#include "kvcd/kernels/fp16.h"

namespace kvcd::kernels {

float Int2ClipThreshold(const float* x, int d, float rho) {
  float a[256];
  for (int i = 0; i < d; ++i) a[i] = std::fabs(x[i]);
  const int k = std::min(static_cast<int>(std::floor(rho * static_cast<float>(d))), d - 1);
  std::nth_element(a, a + k, a + d);  // the k-th smallest |x|: sort(|x|)[k]
  return a[k];
}

void RotateRows(const float* x, int64_t n, int d, const float* r, float* out) {
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
                      uint8_t* codes, int64_t code_stride, uint16_t* params,
                      int64_t param_stride) {
  float rot[256];
  const int quarter = d / 4;
  for (int64_t t = 0; t < n; ++t) {
    const float* x = rows + t * d;
    if (rotation != nullptr) {
      RotateRows(x, 1, d, rotation, rot);
    } else {
      std::copy(x, x + d, rot);
    }
    const float tau = Int2ClipThreshold(rot, d, rho);
    float lo = tau, hi = -tau;
    for (int i = 0; i < d; ++i) {
      rot[i] = std::min(std::max(rot[i], -tau), tau);
      lo = std::min(lo, rot[i]);
      hi = std::max(hi, rot[i]);
    }
    const float scale = std::max(hi - lo, 1e-8f) / 3.0f;
    const float zero = -lo / scale;
    uint8_t* c = codes + t * code_stride;
    std::fill(c, c + quarter, 0);
    for (int i = 0; i < d; ++i) {
      const float qf = std::floor(rot[i] / scale + zero + 0.5f);
      const int q = static_cast<int>(std::min(std::max(qf, 0.0f), 3.0f));
      c[i % quarter] = static_cast<uint8_t>(c[i % quarter] | (q << (2 * (i / quarter))));
    }
    uint16_t* p = params + t * param_stride;
    p[0] = FloatToHalf(scale);
    p[1] = FloatToHalf(lo);
  }
}

void ExpandInt2Rows(const uint8_t* codes, int64_t code_stride, const uint16_t* params,
                    int64_t param_stride, int64_t n, int d, const float* rotation, float* out) {
  float xh[256];
  const int quarter = d / 4;
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* c = codes + t * code_stride;
    const uint16_t* p = params + t * param_stride;
    const float scale = HalfToFloat(p[0]);
    const float lo = HalfToFloat(p[1]);
    for (int i = 0; i < d; ++i) {
      const int q = (c[i % quarter] >> (2 * (i / quarter))) & 3;
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
