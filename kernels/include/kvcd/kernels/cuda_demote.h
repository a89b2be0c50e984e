// CUDA quantize-on-demote (sm_90): rotate, clip, quantize and pack BF16 rows into INT2 rows,
// exactly the function of DemoteRowsToInt2 (int2_codec.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvcd/kernels/error.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd::kernels::cuda {

// kGrouped: a row on head_dim/32 lanes with 16-byte loads, no rotation or the Hadamard by
// butterflies (a dense rotation, or rows not 16-byte aligned, take kWarpPerRow);
// kWarpPerRow: one warp per row (the previous kernel, kept for comparison).
enum class DemoteKernel { kGrouped, kWarpPerRow };

// rows: [n][head_dim] BF16 (device); rotation: [head_dim][head_dim] FP32 (device), null for
// kind kNone; kind: ClassifyRotation of the host copy of the rotation (kHadamard reads only
// c = rotation[0]); out: device pointers and strides of the destination rows (row i written
// at index first_row + i). REQUIRES: head_dim in {64, 128, 256}, 0 < rho <= 1.
Error LaunchDemoteInt2(const uint16_t* rows, int64_t n, int head_dim, const float* rotation,
                       Rotation kind, float rho, const Int2RowRef& out, int64_t first_row,
                       cudaStream_t stream, DemoteKernel kernel = DemoteKernel::kGrouped);

}  // namespace kvcd::kernels::cuda
