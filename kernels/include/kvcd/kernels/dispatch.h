// The dispatch of the kernels' runtime parameters to compile-time ones (FlashInfer style),
// framework-free and shared by the CPU kernels and the CUDA launchers (cuda/dispatch.cuh):
// a kernel instantiated per value gets its value here and nowhere else, and a value outside
// the set goes to the caller's `otherwise` (never a silent default).
#pragma once

#include <type_traits>

namespace kvcd::kernels {

// fn(std::integral_constant<int, V>{}) for the V of kValues equal to `value`, else
// otherwise(); every branch returns the same type.
template <int kFirst, int... kRest, class Fn, class Otherwise>
decltype(auto) DispatchValue(int value, Fn&& fn, Otherwise&& otherwise) {
  if (value == kFirst) return fn(std::integral_constant<int, kFirst>{});
  if constexpr (sizeof...(kRest) > 0) {
    return DispatchValue<kRest...>(value, fn, otherwise);
  } else {
    return otherwise();
  }
}

template <int D>
using HeadDim = std::integral_constant<int, D>;

// The head dims every kernel is instantiated for: fn(HeadDim<D>{}) for head_dim in
// {64, 128, 256}, else otherwise().
template <class Fn, class Otherwise>
decltype(auto) DispatchHeadDim(int head_dim, Fn&& fn, Otherwise&& otherwise) {
  return DispatchValue<64, 128, 256>(head_dim, fn, otherwise);
}

// The GQA group sizes (query heads per KV head) in common use, which the CPU INT2 kernels
// instantiate: fn(std::integral_constant<int, G>{}) for group in {1, 2, 4, 8}, else
// otherwise().
template <class Fn, class Otherwise>
decltype(auto) DispatchGroupSize(int group, Fn&& fn, Otherwise&& otherwise) {
  return DispatchValue<1, 2, 4, 8>(group, fn, otherwise);
}

}  // namespace kvcd::kernels
