#include <cuda_runtime.h>

#include "kvcd/kernels/cuda_runtime_api.h"

namespace kvcd::kernels::cuda {
namespace {

std::string Text(cudaError_t e) { return e == cudaSuccess ? std::string() : cudaGetErrorString(e); }

}  // namespace

std::string SetDevice(int ordinal) { return Text(cudaSetDevice(ordinal)); }
std::string Malloc(void** ptr, size_t bytes) { return Text(cudaMalloc(ptr, bytes)); }
std::string Free(void* ptr) { return Text(cudaFree(ptr)); }
std::string CopyToDevice(void* dst, const void* src, size_t bytes) {
  return Text(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
std::string CopyToHost(void* dst, const void* src, size_t bytes) {
  return Text(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
std::string Synchronize() { return Text(cudaDeviceSynchronize()); }

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
