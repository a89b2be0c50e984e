// OSCAR INT2 codec (DESIGN.md §5): rotate, clip, quantize and pack rows, and the
// inverse. Framework-free.
//
// A row is one token of one KV head: d values (d a power of two, >= 8).
//   rotate:   x_rot = x · R            (R: [d][d] float, row-major; null = identity)
//   clip:     tau = sort(|x_rot|)[min(floor(rho*d), d-1)], x_c = clamp(x_rot, -tau, tau)
//   quantize: lo = min x_c, hi = max x_c, scale = max(hi-lo, 1e-8)/3, zero = -lo/scale,
//             q = clamp(floor(x_c/scale + zero + 0.5), 0, 3)
//   store:    FP16 scale and FP16 lo; dequantize x_hat = q*scale + lo
//   pack:     byte j (0 <= j < d/4) holds elements j, j+d/4, j+d/2, j+3d/4 in bits
//             [1:0], [3:2], [5:4], [7:6].
// Bits per element: 2 + 32/d (2.25 at d = 128).
#pragma once

#include <cstdint>

namespace kvcd::kernels {

inline constexpr float kDefaultRhoK = 0.96f;
inline constexpr float kDefaultRhoV = 0.92f;

// Bytes of the packed codes of one row, and of its (scale, lo) pair.
inline int Int2CodeBytes(int head_dim) { return head_dim / 4; }
inline constexpr int kInt2ParamBytes = 4;

// Clip threshold of one row of d values (the |x| quantile above; d-element scratch
// is on the stack for d <= 256).
float Int2ClipThreshold(const float* x, int d, float rho);

// Rotates, clips, quantizes and packs n rows. rows: [n][d] float; rotation: [d][d] or
// null; codes of row i at codes + i*code_stride (d/4 bytes); its FP16 (scale, lo) pair
// at params + i*param_stride (uint16 elements).
// REQUIRES: d in {8, 16, ..., 256}, 0 < rho <= 1.
void DemoteRowsToInt2(const float* rows, int64_t n, int d, const float* rotation, float rho,
                      uint8_t* codes, int64_t code_stride, uint16_t* params,
                      int64_t param_stride);

// Unpacks and dequantizes n rows, then un-rotates them (x = x_hat · R^T; null = identity).
void ExpandInt2Rows(const uint8_t* codes, int64_t code_stride, const uint16_t* params,
                    int64_t param_stride, int64_t n, int d, const float* rotation, float* out);

// x_rot = x · R for n rows (FP32). out may not alias x.
void RotateRows(const float* x, int64_t n, int d, const float* rotation, float* out);
// x = y · R^T for n rows (FP32). out may not alias y.
void UnrotateRows(const float* y, int64_t n, int d, const float* rotation, float* out);

}  // namespace kvcd::kernels
