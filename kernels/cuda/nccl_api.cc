#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "kvcd/kernels/cuda_nccl.h"

namespace kvcd::kernels::cuda {
namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "ncclUniqueId size");

struct Nccl {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  std::string load_error;
};

const Nccl& Lib() {
  static const Nccl lib = [] {
    Nccl n;
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      n.load_error = std::string("cannot load libnccl.so.2 (") + (e ? e : "?") +
                     "); put NCCL's lib directory on LD_LIBRARY_PATH";
      return n;
    }
    auto sym = [&](const char* name) {
      void* p = dlsym(h, name);
      if (p == nullptr && n.load_error.empty())
        n.load_error = std::string("libnccl.so.2 lacks ") + name;
      return p;
    };
    n.get_unique_id = reinterpret_cast<decltype(n.get_unique_id)>(sym("ncclGetUniqueId"));
    n.init_rank_config =
        reinterpret_cast<decltype(n.init_rank_config)>(sym("ncclCommInitRankConfig"));
    n.get_async_error = reinterpret_cast<decltype(n.get_async_error)>(sym("ncclCommGetAsyncError"));
    n.send = reinterpret_cast<decltype(n.send)>(sym("ncclSend"));
    n.recv = reinterpret_cast<decltype(n.recv)>(sym("ncclRecv"));
    n.abort = reinterpret_cast<decltype(n.abort)>(sym("ncclCommAbort"));
    n.destroy = reinterpret_cast<decltype(n.destroy)>(sym("ncclCommDestroy"));
    n.error_string = reinterpret_cast<decltype(n.error_string)>(sym("ncclGetErrorString"));
    return n;
  }();
  return lib;
}

std::string Text(ncclResult_t r) {
  if (r == ncclSuccess) return std::string();
  return std::string("NCCL: ") + Lib().error_string(r);
}
std::string CudaText(cudaError_t e) {
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

// Polls the communicator until it leaves ncclInProgress (and, with a stream, until the
// stream's work is done) or the deadline passes; aborts it then.
std::string Poll(ncclComm_t comm, cudaStream_t stream, int timeout_ms, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = Lib().get_async_error(comm, &async);
    if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      Lib().abort(comm);
      return std::string(what) + " failed: " + Text(r != ncclSuccess ? r : async);
    }
    if (async == ncclSuccess) {
      if (stream == nullptr) return std::string();
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return std::string();
      if (q != cudaErrorNotReady) {
        Lib().abort(comm);
        return std::string(what) + " failed: " + CudaText(q);
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      Lib().abort(comm);
      return std::string(what) + " timed out after " + std::to_string(timeout_ms) +
             " ms (the peer did not post its side); the communicator was aborted";
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Empty text: success; else a kNccl error with it.
Error NcclError(std::string text) {
  if (text.empty()) return Error();
  return Error(ErrorCode::kNccl, std::move(text));
}

}  // namespace

Error NcclLoad() { return NcclError(Lib().load_error); }

Error NcclGetUniqueId(std::string* id) {
  KVCD_CUDA_BIND_THREAD();
  if (Error e = NcclLoad(); !e.ok()) return e;
  ncclUniqueId u;
  const std::string e = Text(Lib().get_unique_id(&u));
  if (e.empty()) id->assign(reinterpret_cast<const char*>(&u), sizeof(u));
  return NcclError(e);
}

Error NcclInit(const std::string& id, int nranks, int rank, int timeout_ms, void** comm) {
  KVCD_CUDA_BIND_THREAD();
  if (Error e = NcclLoad(); !e.ok()) return e;
  if (id.size() != sizeof(ncclUniqueId)) return NcclError("ncclUniqueId has the wrong size");
  ncclUniqueId u;
  std::memcpy(&u, id.data(), sizeof(u));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t c = nullptr;
  const ncclResult_t r = Lib().init_rank_config(&c, nranks, u, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress)
    return NcclError("ncclCommInitRankConfig: " + Text(r));
  const std::string e = Poll(c, nullptr, timeout_ms, "NCCL communicator init");
  if (!e.empty()) return NcclError(e);
  *comm = c;
  return Error();
}

Error NcclSend(void* comm, const void* buf, size_t bytes, int peer, void* stream) {
  KVCD_CUDA_BIND_THREAD();
  const ncclResult_t r = Lib().send(buf, bytes, ncclUint8, peer, static_cast<ncclComm_t>(comm),
                                    static_cast<cudaStream_t>(stream));
  return r == ncclInProgress ? Error() : NcclError(Text(r));
}

Error NcclRecv(void* comm, void* buf, size_t bytes, int peer, void* stream) {
  KVCD_CUDA_BIND_THREAD();
  const ncclResult_t r = Lib().recv(buf, bytes, ncclUint8, peer, static_cast<ncclComm_t>(comm),
                                    static_cast<cudaStream_t>(stream));
  return r == ncclInProgress ? Error() : NcclError(Text(r));
}

Error NcclWait(void* comm, void* stream, int timeout_ms) {
  KVCD_CUDA_BIND_THREAD();
  return NcclError(Poll(static_cast<ncclComm_t>(comm), static_cast<cudaStream_t>(stream),
                        timeout_ms, "NCCL transfer"));
}

Error NcclDestroy(void* comm) {
  KVCD_CUDA_BIND_THREAD();
  return NcclError(Text(Lib().destroy(static_cast<ncclComm_t>(comm))));
}

Error CreateStream(void** stream) {
  KVCD_CUDA_BIND_THREAD();
  cudaStream_t s = nullptr;
  const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e == cudaSuccess) *stream = s;
  return ToError(e);
}
Error DestroyStream(void* stream) {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
}
Error SynchronizeDefaultStream() {
  KVCD_CUDA_BIND_THREAD();
  return ToError(cudaStreamSynchronize(nullptr));
}

}  // namespace kvcd::kernels::cuda
