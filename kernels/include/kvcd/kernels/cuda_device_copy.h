// The BF16/F32 -> F32 conversion of worker queries on the device (sm_90). Pages move with
// cuda_page_copy.h, rows of new tokens with cuda_store_rows.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvcd::kernels::cuda {

// dst[i] = float(src[i]) for i < n; src is BF16 (bf16 = true) or F32.
cudaError_t LaunchToFloat(const void* src, bool bf16, int64_t n, float* dst, cudaStream_t stream);

}  // namespace kvcd::kernels::cuda
