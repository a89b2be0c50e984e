// Device helper: rows of shared memory times a D x D matrix in L2, one column per thread
// (the queries' rotation by R_k in decode_parts.cuh, R_v^T in the folded merge).
#pragma once

namespace kvcd::kernels::cuda {

// acc[h] += sum_i x[h][i] * m[i][j] for the first `rows` (<= 8) rows of x: column j of m
// (D x D, from L2) is loaded 32 elements at a time, so a column costs D/32 memory round
// trips, not D/4.
template <int D>
__device__ __forceinline__ void ColumnTimesRows(const float* m, int j, const float (*x)[D],
                                                float (&acc)[8], int rows = 8) {
  for (int i0 = 0; i0 < D; i0 += 32) {
    float r[32];
#pragma unroll
    for (int u = 0; u < 32; ++u) r[u] = __ldg(m + (i0 + u) * D + j);
#pragma unroll
    for (int u = 0; u < 32; ++u)
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        if (h < rows) acc[h] = fmaf(x[h][i0 + u], r[u], acc[h]);
      }
  }
}

}  // namespace kvcd::kernels::cuda
