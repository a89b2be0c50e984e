#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_stream_memops.h"

namespace kvcd::kernels::cuda {
namespace {

using ValueFn = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct Memops {
  ValueFn wait = nullptr;
  ValueFn write = nullptr;
  cudaStream_t release = nullptr;  // non-blocking, for ReleaseValue32
};

void* EntryPoint(const char* name) {
  cudaDriverEntryPointQueryResult found{};
  void* fn = nullptr;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}

const Memops& Get() {
  static Memops m;
  static std::once_flag once;
  std::call_once(once, [] {
    m.wait = reinterpret_cast<ValueFn>(EntryPoint("cuStreamWaitValue32"));
    m.write = reinterpret_cast<ValueFn>(EntryPoint("cuStreamWriteValue32"));
    if (m.wait != nullptr && m.write != nullptr &&
        cudaStreamCreateWithFlags(&m.release, cudaStreamNonBlocking) != cudaSuccess) {
      (void)cudaGetLastError();
      m.release = nullptr;
    }
  });
  return m;
}

Error FromDriver(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return Error();
  return Error(ErrorCode::kCuda,
               std::string(what) + " failed with CUresult " + std::to_string(static_cast<int>(r)),
               r == CUDA_ERROR_NOT_SUPPORTED ? cudaErrorNotSupported : cudaErrorInvalidValue);
}

}  // namespace

bool StreamMemopsAvailable() {
  if (!BindThread().ok()) return false;  // Get() may create its stream on first use
  const Memops& m = Get();
  return m.wait != nullptr && m.write != nullptr && m.release != nullptr;
}

Error StreamWaitValue32(void* stream, const uint32_t* word, uint32_t value) {
  KVCD_CUDA_BIND_THREAD();
  const Memops& m = Get();
  if (m.wait == nullptr) return ToError(cudaErrorNotSupported);
  Counts().stream_waits.fetch_add(1, std::memory_order_relaxed);
  return FromDriver(m.wait(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word),
                           value, CU_STREAM_WAIT_VALUE_GEQ),
                    "cuStreamWaitValue32");
}

Error StreamWriteValue32(void* stream, uint32_t* word, uint32_t value) {
  KVCD_CUDA_BIND_THREAD();
  const Memops& m = Get();
  if (m.write == nullptr) return ToError(cudaErrorNotSupported);
  Counts().event_records.fetch_add(1, std::memory_order_relaxed);
  return FromDriver(m.write(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word),
                            value, CU_STREAM_WRITE_VALUE_DEFAULT),
                    "cuStreamWriteValue32");
}

Error ReleaseValue32(uint32_t* word, uint32_t value) {
  KVCD_CUDA_BIND_THREAD();
  const Memops& m = Get();
  if (m.write == nullptr || m.release == nullptr) return ToError(cudaErrorNotSupported);
  return FromDriver(m.write(static_cast<CUstream>(m.release), reinterpret_cast<CUdeviceptr>(word),
                            value, CU_STREAM_WRITE_VALUE_DEFAULT),
                    "cuStreamWriteValue32 (release)");
}

}  // namespace kvcd::kernels::cuda
