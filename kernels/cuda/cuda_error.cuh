// A cudaError_t as the kernels' Error (kvcd/kernels/error.h): what every launcher and the
// runtime host API return, with the CUDA runtime's text.
#pragma once

#include <cuda_runtime.h>

#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

inline Error ToError(cudaError_t e) {
  if (e == cudaSuccess) return Error();
  return Error(ErrorCode::kCuda, cudaGetErrorString(e), static_cast<int>(e));
}

}  // namespace kvcd::kernels::cuda
