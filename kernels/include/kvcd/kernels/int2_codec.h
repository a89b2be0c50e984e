// OSCAR INT2 codec (docs/formats.md "int2-oscar"): rotate, clip, quantize and pack rows, and the
// inverse. Framework-free.
//
// A row is one token of one KV head: d values (d a power of two, >= 8).
//   rotate:   x_rot = x · R            (R: [d][d] float, row-major; null = identity); when
//             R is c·H (ClassifyRotation: kHadamard) by the fast Walsh-Hadamard transform
//             (HadamardRotateRow), else as RotateRows
//   clip:     tau = sort(|x_rot|)[min(floor(rho*d), d-1)], x_c = clamp(x_rot, -tau, tau)
//   quantize: lo = min x_c, hi = max x_c, scale = max(hi-lo, 1e-8)/3, zero = -lo/scale,
//             q = clamp(floor(x_c/scale + zero + 0.5), 0, 3)
//   store:    FP16 scale and FP16 lo; dequantize x_hat = q*scale + lo
//   pack:     byte j (0 <= j < d/4) holds elements j, j+d/4, j+d/2, j+3d/4 in bits
//             [1:0], [3:2], [5:4], [7:6].
// Bits per element: 2 + 32/d (2.25 at d = 128).
#pragma once

#include <cstdint>

#include "kvcd/kernels/cpu_features.h"

namespace kvcd::kernels {

inline constexpr float kDefaultRhoK = 0.96f;
inline constexpr float kDefaultRhoV = 0.92f;

// Bytes of the packed codes of one row, and of its (scale, lo) pair.
inline int Int2CodeBytes(int head_dim) { return head_dim / 4; }
inline constexpr int kInt2ParamBytes = 4;

// Clip threshold of one row of d values (the |x| quantile above; d-element scratch
// is on the stack for d <= 256).
float Int2ClipThreshold(const float* x, int d, float rho);

// Where packed rows live. Byte j (0 <= j < d/4) of row t is at codes + Offset(t, j):
//   (t / rows_per_group) * row_group_stride + (t % rows_per_group) * row_stride
//   + (j / bytes_per_group) * byte_group_stride + (j % bytes_per_group) * byte_stride
// which covers plain row-major rows and the interleaved page layouts of int2_attention.h.
// Row t's FP16 scale and minimum are scale[t * param_stride] and lo[t * param_stride].
struct Int2RowRef {
  uint8_t* codes = nullptr;
  int64_t row_stride = 0;
  int64_t rows_per_group = int64_t{1} << 40;
  int64_t row_group_stride = 0;
  int64_t bytes_per_group = int64_t{1} << 40;
  int64_t byte_group_stride = 0;
  int64_t byte_stride = 1;
  uint16_t* scale = nullptr;
  uint16_t* lo = nullptr;
  int64_t param_stride = 1;

  int64_t Offset(int64_t t, int64_t j) const {
    return (t / rows_per_group) * row_group_stride + (t % rows_per_group) * row_stride +
           (j / bytes_per_group) * byte_group_stride + (j % bytes_per_group) * byte_stride;
  }
  // Rows of d/4 contiguous bytes, row t at codes + t * row_bytes.
  static Int2RowRef RowMajor(uint8_t* codes, int64_t row_bytes, uint16_t* scale, uint16_t* lo,
                             int64_t param_stride) {
    Int2RowRef r;
    r.codes = codes;
    r.row_stride = row_bytes;
    r.scale = scale;
    r.lo = lo;
    r.param_stride = param_stride;
    return r;
  }
};

// How a rotation is applied. kHadamard: R[i][j] = c·(-1)^popcount(i & j) for one c > 0
// (the normalized Sylvester Hadamard matrix, c = R[0][0]), applied in d log d operations.
enum class Rotation : uint8_t { kNone, kDense, kHadamard };
// kNone for null, kHadamard when r (host, [d][d]) is exactly c·H, else kDense.
Rotation ClassifyRotation(const float* r, int d);

// out = x · (c·H) for one row of d values (d a power of two): the unnormalized transform in
// a fixed order — for b = 0 .. log2(d)-1, every pair (i, i + 2^b) with bit b of i clear
// becomes (v[i] + v[i+2^b], v[i] - v[i+2^b]), each sum separately rounded — then each
// value times c. The CUDA kernels apply the same operations, so codes are bit-identical.
void HadamardRotateRow(const float* x, int d, float c, float* out);

// Rotates, clips, quantizes and packs n rows (rows: [n][d] float; rotation: [d][d] or
// null). REQUIRES: d in {8, 16, ..., 256}, 0 < rho <= 1.
// Rows are written to row indices first_row .. first_row + n - 1 of `out`.
void DemoteRowsToInt2(const float* rows, int64_t n, int d, const float* rotation, float rho,
                      const Int2RowRef& out, int64_t first_row = 0);
// The same with the rotation's kind given (ClassifyRotation(rotation, d), which scans the d×d
// matrix: callers that encode many calls with one rotation classify it once).
void DemoteRowsToInt2(const float* rows, int64_t n, int d, const float* rotation, Rotation kind,
                      float rho, const Int2RowRef& out, int64_t first_row = 0);

// Unpacks and dequantizes n rows, then un-rotates them (x = x_hat · R^T; null = identity).
void ExpandInt2Rows(const Int2RowRef& in, int64_t n, int d, const float* rotation, float* out,
                    int64_t first_row = 0);

// x_rot = x · R for n rows (FP32). out may not alias x. Every ISA computes each output
// as the same sequence of separately rounded products and sums (no FMA contraction), so
// results are bit-identical across ISAs and demotion never depends on the CPU.
void RotateRows(const float* x, int64_t n, int d, const float* rotation, float* out,
                CpuIsa isa = ActiveCpuIsa());
// x = y · R^T for n rows (FP32). out may not alias y.
void UnrotateRows(const float* y, int64_t n, int d, const float* rotation, float* out);

}  // namespace kvcd::kernels
