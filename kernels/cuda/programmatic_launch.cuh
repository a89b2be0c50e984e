// Programmatic dependent launch (sm_90): a kernel launched as the dependent of the previous
// launch on its stream may start while that grid runs; it waits for it (WaitPrimaryGrid)
// only where it reads that grid's results, and the primary lets its dependents start early
// (LaunchDependents) once its CTAs no longer need their SM slots for long. Used by the decode
// kernels, their query preparation and the split-K merge.
#pragma once

#include <cuda_runtime.h>

#include "kvcd/kernels/call_counts.h"

namespace kvcd::kernels::cuda {

// Waits until the primary grid has completed and its writes are visible (a no-op in a kernel
// not launched as a dependent).
__device__ __forceinline__ void WaitPrimaryGrid() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
// Lets the dependent grid launch before this grid completes.
__device__ __forceinline__ void LaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Launches `kernel` as the programmatic dependent of the previous launch on the stream (if
// `dependent`): it may start while that grid runs and waits for it where it reads its
// results. Where the stream does not take the attribute, the launch is the plain one.
template <class... Args>
cudaError_t LaunchDependent(bool dependent, void (*kernel)(Args...), dim3 grid, dim3 block,
                            size_t smem, cudaStream_t stream, Args... args) {
  CountLaunch();
  if (dependent) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaSuccess;
    (void)cudaGetLastError();
  }
  kernel<<<grid, block, smem, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace kvcd::kernels::cuda
