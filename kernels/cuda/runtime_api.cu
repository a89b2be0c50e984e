#include <cuda_runtime.h>

#include <cstring>

#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_runtime_api.h"

namespace kvcd::kernels::cuda {
namespace {

std::string Text(cudaError_t e) { return e == cudaSuccess ? std::string() : cudaGetErrorString(e); }

}  // namespace

std::string SetDevice(int ordinal) { return Text(cudaSetDevice(ordinal)); }
std::string Malloc(void** ptr, size_t bytes) { return Text(cudaMalloc(ptr, bytes)); }
std::string Free(void* ptr) { return Text(cudaFree(ptr)); }
std::string CopyToDevice(void* dst, const void* src, size_t bytes) {
  Counts().h2d.fetch_add(1, std::memory_order_relaxed);
  return Text(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
std::string CopyToHost(void* dst, const void* src, size_t bytes) {
  Counts().d2h.fetch_add(1, std::memory_order_relaxed);
  return Text(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
std::string HostAlloc(void** ptr, size_t bytes) { return Text(cudaMallocHost(ptr, bytes)); }
std::string HostAllocMapped(void** host, void** device_view, size_t bytes) {
  void* h = nullptr;
  cudaError_t e = cudaHostAlloc(&h, bytes, cudaHostAllocMapped);
  if (e != cudaSuccess) return Text(e);
  e = cudaHostGetDevicePointer(device_view, h, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(h);
    return Text(e);
  }
  *host = h;
  return std::string();
}
std::string HostFree(void* ptr) { return Text(cudaFreeHost(ptr)); }
std::string CopyToDeviceAsync(void* dst, const void* src, size_t bytes) {
  Counts().h2d.fetch_add(1, std::memory_order_relaxed);
  return Text(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, nullptr));
}
std::string CreateEvent(void** event) {
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (err == cudaSuccess) *event = e;
  return Text(err);
}
std::string EventSynchronize(void* event) {
  Counts().host_syncs.fetch_add(1, std::memory_order_relaxed);
  return Text(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

std::string CopyDeviceToDevice(void* dst, const void* src, size_t bytes) {
  Counts().d2d.fetch_add(1, std::memory_order_relaxed);
  return Text(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr));
}

std::string Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                   size_t rows) {
  Counts().d2d.fetch_add(1, std::memory_order_relaxed);
  return Text(
      cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault, nullptr));
}

std::string IpcOpenMemory(const std::string& handle, void** ptr) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) return "IPC memory handle has the wrong size";
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  return Text(cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess));
}
std::string IpcCloseMemory(void* ptr) { return Text(cudaIpcCloseMemHandle(ptr)); }

std::string IpcCreateEvent(void** event, std::string* handle) {
  cudaEvent_t e = nullptr;
  cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess);
  if (err != cudaSuccess) return Text(err);
  cudaIpcEventHandle_t h;
  err = cudaIpcGetEventHandle(&h, e);
  if (err != cudaSuccess) {
    cudaEventDestroy(e);
    return Text(err);
  }
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  *event = e;
  return std::string();
}
std::string IpcOpenEvent(const std::string& handle, void** event) {
  if (handle.size() != sizeof(cudaIpcEventHandle_t)) return "IPC event handle has the wrong size";
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaIpcOpenEventHandle(&e, h);
  if (err == cudaSuccess) *event = e;
  return Text(err);
}
std::string DestroyEvent(void* event) {
  return Text(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
}
std::string StreamWaitEvent(void* event) {
  Counts().stream_waits.fetch_add(1, std::memory_order_relaxed);
  return Text(cudaStreamWaitEvent(nullptr, static_cast<cudaEvent_t>(event), 0));
}
std::string RecordEvent(void* event) {
  Counts().event_records.fetch_add(1, std::memory_order_relaxed);
  return Text(cudaEventRecord(static_cast<cudaEvent_t>(event), nullptr));
}

std::string CreateTimingEvent(void** event) {
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaEventCreate(&e);
  if (err == cudaSuccess) *event = e;
  return Text(err);
}
std::string RecordTimingEvent(void* event) {
  return Text(cudaEventRecord(static_cast<cudaEvent_t>(event), nullptr));
}
std::string ElapsedIfDone(void* from, void* to, bool* done, float* ms) {
  const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(to));
  *done = q == cudaSuccess;
  if (q == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return std::string();
  }
  if (q != cudaSuccess) return Text(q);
  return Text(
      cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)));
}

std::string Synchronize() {
  Counts().host_syncs.fetch_add(1, std::memory_order_relaxed);
  return Text(cudaDeviceSynchronize());
}

std::string ErrorText(int code) { return Text(static_cast<cudaError_t>(code)); }

int SmCount() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
  return n;
}

bool LastErrorIsSticky() {
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
