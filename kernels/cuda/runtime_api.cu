#include <cuda_runtime.h>

#include <cstring>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_runtime_api.h"

namespace kvcd::kernels::cuda {
Error Malloc(void** ptr, size_t bytes) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaMalloc(ptr, bytes));
}
Error Free(void* ptr) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaFree(ptr));
}
Error CopyToDevice(void* dst, const void* src, size_t bytes) {
  KVCD_CUDA_BIND_THREAD();
  Counts().h2d.fetch_add(1, std::memory_order_relaxed);
  return ToError(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
Error CopyToHost(void* dst, const void* src, size_t bytes) {
  KVCD_CUDA_BIND_THREAD();
  Counts().d2h.fetch_add(1, std::memory_order_relaxed);
  return ToError(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
Error HostAlloc(void** ptr, size_t bytes) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaMallocHost(ptr, bytes));
}
Error HostAllocMapped(void** host, void** device_view, size_t bytes) {
  KVCD_CUDA_BIND_THREAD();
  void* h = nullptr;
  cudaError_t e = cudaHostAlloc(&h, bytes, cudaHostAllocMapped);
  if (e != cudaSuccess) return ToError(e);
  e = cudaHostGetDevicePointer(device_view, h, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(h);
    return ToError(e);
  }
  *host = h;
  return Error();
}
Error HostFree(void* ptr) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaFreeHost(ptr));
}
Error CopyToDeviceAsync(void* dst, const void* src, size_t bytes) {
  KVCD_CUDA_BIND_THREAD();
  Counts().h2d.fetch_add(1, std::memory_order_relaxed);
  return ToError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, nullptr));
}
Error ZeroAsync(void* dst, size_t bytes) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaMemsetAsync(dst, 0, bytes, nullptr));
}
Error CreateEvent(void** event) {
  KVCD_CUDA_BIND_THREAD();
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (err == cudaSuccess) *event = e;
  return ToError(err);
}
Error EventSynchronize(void* event) {
  KVCD_CUDA_BIND_THREAD();
  Counts().host_syncs.fetch_add(1, std::memory_order_relaxed);
  return ToError(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

Error CopyDeviceToDevice(void* dst, const void* src, size_t bytes) {
  KVCD_CUDA_BIND_THREAD();
  Counts().d2d.fetch_add(1, std::memory_order_relaxed);
  return ToError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr));
}

Error Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
             size_t rows) {
  KVCD_CUDA_BIND_THREAD();
  Counts().d2d.fetch_add(1, std::memory_order_relaxed);
  return ToError(
      cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault, nullptr));
}

Error IpcOpenMemory(const std::string& handle, void** ptr) {
  KVCD_CUDA_BIND_THREAD();
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    return Error(ErrorCode::kCuda, "IPC memory handle has the wrong size", cudaErrorInvalidValue);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  return ToError(cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess));
}
Error IpcCloseMemory(void* ptr) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaIpcCloseMemHandle(ptr));
}
Error IpcExportMemory(void* ptr, std::string* handle) {
  KVCD_CUDA_BIND_THREAD();
  cudaIpcMemHandle_t h;
  const cudaError_t err = cudaIpcGetMemHandle(&h, ptr);
  if (err != cudaSuccess) return ToError(err);
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return Error();
}

Error IpcCreateEvent(void** event, std::string* handle) {
  KVCD_CUDA_BIND_THREAD();
  cudaEvent_t e = nullptr;
  cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess);
  if (err != cudaSuccess) return ToError(err);
  cudaIpcEventHandle_t h;
  err = cudaIpcGetEventHandle(&h, e);
  if (err != cudaSuccess) {
    cudaEventDestroy(e);
    return ToError(err);
  }
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  *event = e;
  return Error();
}
Error IpcOpenEvent(const std::string& handle, void** event) {
  KVCD_CUDA_BIND_THREAD();
  if (handle.size() != sizeof(cudaIpcEventHandle_t))
    return Error(ErrorCode::kCuda, "IPC event handle has the wrong size", cudaErrorInvalidValue);
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaIpcOpenEventHandle(&e, h);
  if (err == cudaSuccess) *event = e;
  return ToError(err);
}
Error DestroyEvent(void* event) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
}
Error StreamWaitEvent(void* event) {
  KVCD_CUDA_BIND_THREAD();
  Counts().stream_waits.fetch_add(1, std::memory_order_relaxed);
  return ToError(cudaStreamWaitEvent(nullptr, static_cast<cudaEvent_t>(event), 0));
}
Error RecordEvent(void* event) {
  KVCD_CUDA_BIND_THREAD();
  Counts().event_records.fetch_add(1, std::memory_order_relaxed);
  return ToError(cudaEventRecord(static_cast<cudaEvent_t>(event), nullptr));
}

Error CreateSideStream(void** stream) {
  KVCD_CUDA_BIND_THREAD();
  cudaStream_t s = nullptr;
  const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err == cudaSuccess) *stream = s;
  return ToError(err);
}
Error ForkTo(void* stream, void* event) {
  KVCD_CUDA_BIND_THREAD();
  Counts().event_records.fetch_add(1, std::memory_order_relaxed);
  Counts().stream_waits.fetch_add(1, std::memory_order_relaxed);
  cudaError_t err = cudaEventRecord(static_cast<cudaEvent_t>(event), nullptr);
  if (err == cudaSuccess) {
    err =
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0);
  }
  return ToError(err);
}
Error JoinFrom(void* stream, void* event) {
  KVCD_CUDA_BIND_THREAD();
  Counts().event_records.fetch_add(1, std::memory_order_relaxed);
  Counts().stream_waits.fetch_add(1, std::memory_order_relaxed);
  cudaError_t err =
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream));
  if (err == cudaSuccess) err = cudaStreamWaitEvent(nullptr, static_cast<cudaEvent_t>(event), 0);
  return ToError(err);
}

Error CreateTimingEvent(void** event) {
  KVCD_CUDA_BIND_THREAD();
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaEventCreate(&e);
  if (err == cudaSuccess) *event = e;
  return ToError(err);
}
Error RecordTimingEvent(void* event) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaEventRecord(static_cast<cudaEvent_t>(event), nullptr));
}
Error ElapsedIfDone(void* from, void* to, bool* done, float* ms) {
  KVCD_CUDA_BIND_THREAD();
  const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(to));
  *done = q == cudaSuccess;
  if (q == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return Error();
  }
  if (q != cudaSuccess) return ToError(q);
  return ToError(
      cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)));
}

Error Synchronize() {
  KVCD_CUDA_BIND_THREAD();
  Counts().host_syncs.fetch_add(1, std::memory_order_relaxed);
  return ToError(cudaDeviceSynchronize());
}

Error PointerDevice(const void* ptr, int* ordinal) {
  KVCD_CUDA_BIND_THREAD();
  cudaPointerAttributes a{};
  if (const cudaError_t e = cudaPointerGetAttributes(&a, ptr); e != cudaSuccess) return ToError(e);
  *ordinal = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
  return Error();
}

Error ErrorToError(int code) { return ToError(static_cast<cudaError_t>(code)); }

int SmCount() {
  if (!BindThread().ok()) return 0;
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
  return n;
}

bool LastErrorIsSticky() {
  (void)BindThread();  // the error of the process device's context
  const cudaError_t e = cudaPeekAtLastError();
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorECCUncorrectable:
    case cudaErrorAssert:
      return true;
    default:
      return false;
  }
}

}  // namespace kvcd::kernels::cuda
static_assert(sizeof(cudaIpcMemHandle_t) == kvcd::kernels::cuda::kIpcHandleBytes &&
                  sizeof(cudaIpcEventHandle_t) == kvcd::kernels::cuda::kIpcHandleBytes,
              "IPC handle size");
