// NCCL point-to-point transfers for the data plane, loaded at run time (libnccl.so.2 on
// the library path) so the daemon starts and serves everything else without NCCL.
// Communicators are non-blocking: every wait has a deadline, and a communicator that
// misses it or reports an asynchronous error is aborted. Every call returns an empty
// string on success, else what went wrong. NVLink multicast stays off: NCCL_NVLS_ENABLE=0
// is set (unless already set) before NCCL is loaded.
#pragma once

#include <cstddef>
#include <string>

namespace kvcd::kernels::cuda {

constexpr size_t kNcclUniqueIdBytes = 128;

// "" when NCCL could be loaded, else why not.
std::string NcclLoad();
std::string NcclGetUniqueId(std::string* id);
// Joins a communicator of `nranks` as `rank` on the current device and waits (up to
// timeout_ms) for every rank to join.
std::string NcclInit(const std::string& id, int nranks, int rank, int timeout_ms, void** comm);
// Queue a send / receive of `bytes` on `stream` (a stream of CreateStream).
std::string NcclSend(void* comm, const void* buf, size_t bytes, int peer, void* stream);
std::string NcclRecv(void* comm, void* buf, size_t bytes, int peer, void* stream);
// Waits up to timeout_ms for the work of `stream`; aborts `comm` on timeout or error.
std::string NcclWait(void* comm, void* stream, int timeout_ms);
std::string NcclDestroy(void* comm);

// A non-blocking stream for transfers, and its disposal.
std::string CreateStream(void** stream);
std::string DestroyStream(void* stream);
// Waits for the daemon's default stream (work queued before a send).
std::string SynchronizeDefaultStream();

}  // namespace kvcd::kernels::cuda
