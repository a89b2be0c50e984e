// CUDA quantize-on-demote (sm_90): rotate, clip, quantize and pack BF16 rows into INT2 rows,
// exactly the function of DemoteRowsToInt2 (int2_codec.h), one warp per row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvcd/kernels/int2_codec.h"

namespace kvcd::kernels::cuda {

// rows: [n][head_dim] BF16 (device); rotation: [head_dim][head_dim] FP32 (device) or null;
// out: device pointers and strides of the destination rows (row i written at index
// first_row + i). REQUIRES: head_dim in {64, 128, 256}, 0 < rho <= 1.
cudaError_t LaunchDemoteInt2(const uint16_t* rows, int64_t n, int head_dim, const float* rotation,
                             float rho, const Int2RowRef& out, int64_t first_row,
                             cudaStream_t stream);

}  // namespace kvcd::kernels::cuda
