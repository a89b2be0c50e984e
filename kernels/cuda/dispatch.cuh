// The one dispatch of a runtime head_dim to a compile-time one (FlashInfer style): every
// launcher instantiates its kernel for 64, 128 and 256 through this helper, and any other
// value is cudaErrorInvalidValue (never a silent default).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

namespace kvcd::kernels::cuda {

template <int D>
using HeadDim = std::integral_constant<int, D>;

// Calls fn(HeadDim<D>{}) for head_dim in {64, 128, 256} and returns its cudaError_t;
// cudaErrorInvalidValue for any other head_dim.
template <class Fn>
cudaError_t DispatchHeadDim(int head_dim, Fn&& fn) {
  switch (head_dim) {
    case 64:
      return fn(HeadDim<64>{});
    case 128:
      return fn(HeadDim<128>{});
    case 256:
      return fn(HeadDim<256>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace kvcd::kernels::cuda
