// The dispatches of the kernels' runtime parameters to compile-time ones (FlashInfer style),
// framework-free and shared by the CPU kernels and the CUDA launchers (cuda/dispatch.cuh):
// a kernel instantiated per value gets its value here and nowhere else, and a value outside
// the set goes to the caller's `otherwise` (never a silent default).
#pragma once

#include <type_traits>

namespace kvcd::kernels {

template <int D>
using HeadDim = std::integral_constant<int, D>;

// fn(HeadDim<D>{}) for head_dim in {64, 128, 256}, else otherwise().
template <class Fn, class Otherwise>
decltype(auto) DispatchHeadDim(int head_dim, Fn&& fn, Otherwise&& otherwise) {
  switch (head_dim) {
    case 64:
      return fn(HeadDim<64>{});
    case 128:
      return fn(HeadDim<128>{});
    case 256:
      return fn(HeadDim<256>{});
    default:
      return otherwise();
  }
}

template <int G>
using GroupSize = std::integral_constant<int, G>;

// The GQA group sizes (query heads per KV head) in common use, which the CPU INT2 kernels
// instantiate: fn(GroupSize<G>{}) for group in {1, 2, 4, 8}, else otherwise().
template <class Fn, class Otherwise>
decltype(auto) DispatchGroupSize(int group, Fn&& fn, Otherwise&& otherwise) {
  switch (group) {
    case 1:
      return fn(GroupSize<1>{});
    case 2:
      return fn(GroupSize<2>{});
    case 4:
      return fn(GroupSize<4>{});
    case 8:
      return fn(GroupSize<8>{});
    default:
      return otherwise();
  }
}

}  // namespace kvcd::kernels
