// The CUDA launchers' dispatches (kvcd/kernels/dispatch.h, with cudaErrorInvalidValue for a
// value outside the set): every launcher instantiates its kernel for head_dim 64, 128 and 256
// through DispatchHeadDim, and the INT2 v2 kernel for its n-tiles of query heads through
// DispatchHeadTiles.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "kvcd/kernels/dispatch.h"

namespace kvcd::kernels::cuda {

using kernels::HeadDim;

// Calls fn(HeadDim<D>{}) for head_dim in {64, 128, 256} and returns its cudaError_t;
// cudaErrorInvalidValue for any other head_dim.
template <class Fn>
cudaError_t DispatchHeadDim(int head_dim, Fn&& fn) {
  return kernels::DispatchHeadDim(head_dim, fn, [] { return cudaErrorInvalidValue; });
}

template <int NT>
using HeadTiles = std::integral_constant<int, NT>;

// The GQA tile count: the MMA n-tiles of 4 query heads a CTA holds per KV head (groups of up
// to 4 or 8 heads). Calls fn(HeadTiles<NT>{}) for head_tiles in {1, 2} and returns its
// cudaError_t; cudaErrorInvalidValue for any other count.
template <class Fn>
cudaError_t DispatchHeadTiles(int head_tiles, Fn&& fn) {
  return kernels::DispatchValue<1, 2>(head_tiles, fn, [] { return cudaErrorInvalidValue; });
}

}  // namespace kvcd::kernels::cuda
