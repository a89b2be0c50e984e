// The process's device and its binding on every host thread (device_binding.cuh).
//
// Why the binding lives here and not at the daemon's thread entries: the CUDA runtime's
// current device is per host thread, and the daemon reaches CUDA from many threads it does
// not all start itself — gRPC's callback threads (no start hook), the request executor, the
// decode channels, NCCL link joiners, the lease reaper, cluster pulls, and destructors on
// whichever thread drops the last reference — and through more than the backend (the
// formats' row stores and codec uploads, device page pulls, NCCL links, the fault board).
// Every one of those paths goes through this host API (server/ never includes a CUDA
// header), so an entry point that binds before its first CUDA call covers every thread, new
// ones included, for one thread-local compare per call once the thread is bound.
#include <cuda_runtime.h>

#include <atomic>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "kvcd/kernels/cuda_runtime_api.h"

namespace kvcd::kernels::cuda {
namespace {

// SetDevice's ordinal; -1 until it is called.
std::atomic<int> process_device{-1};
// The ordinal this thread made current through BindThread / SetDevice (-1: none).
thread_local int bound_device = -1;

Error Bind(int device) {
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return ToError(e);
  bound_device = device;
  return Error();
}

}  // namespace

Error BindThread() {
  const int device = process_device.load(std::memory_order_relaxed);
  if (bound_device == device) return Error();  // bound, or no process device (both -1)
  return Bind(device);
}

Error SetDevice(int ordinal) {
  if (Error e = Bind(ordinal); !e.ok()) return e;
  process_device.store(ordinal, std::memory_order_relaxed);
  return Error();
}

Error GetDevice(int* ordinal) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaGetDevice(ordinal));
}

}  // namespace kvcd::kernels::cuda
