// RaiseDynamicSmem: a kernel's dynamic shared memory limit, written only when a launch needs
// more than every launch before it on the device. cudaFuncSetAttribute is not a free host
// call: the runtime makes it wait for work in flight (copies at least; in kvcd's pipelined
// decode loop an FSQ call that wrote the attribute on every launch answered only after about
// its layer's GPU time, session 29, bench/results/2026-12-06-h200-merge-dependent.md), so a
// launch path writes it once per (kernel, device, larger size) and never lowers it (a lower
// value written between another thread's check and launch would fail that launch).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <mutex>

namespace kvcd::kernels::cuda {

// Makes sure kKernel (a __global__ function) may be launched with `smem` bytes of dynamic
// shared memory on the current device. Launches of at most 48 KB need nothing.
template <auto kKernel>
cudaError_t RaiseDynamicSmem(size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  constexpr int kDevices = 64;
  static std::atomic<size_t> raised[kDevices];  // bytes written so far, per device
  static std::mutex mu;
  int dev = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev < 0 || dev >= kDevices) {
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(smem));
  }
  if (raised[dev].load(std::memory_order_acquire) >= smem) return cudaSuccess;
  std::lock_guard<std::mutex> lock(mu);
  if (raised[dev].load(std::memory_order_relaxed) >= smem) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
  if (e == cudaSuccess) raised[dev].store(smem, std::memory_order_release);
  return e;
}

}  // namespace kvcd::kernels::cuda
