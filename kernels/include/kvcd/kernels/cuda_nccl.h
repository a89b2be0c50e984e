// NCCL point-to-point transfers for the data plane, loaded at run time (libnccl.so.2 on
// the library path) so the daemon starts and serves everything else without NCCL.
// Communicators are non-blocking: every wait has a deadline, and a communicator that
// misses it or reports an asynchronous error is aborted. Every call returns an Error
// (error.h): ok() on success, else kNccl (or kCuda) with what went wrong. NVLink multicast stays
// off: NCCL_NVLS_ENABLE=0 is set (unless already set) before NCCL is loaded.
#pragma once

#include <cstddef>
#include <string>

#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

constexpr size_t kNcclUniqueIdBytes = 128;

// "" when NCCL could be loaded, else why not.
Error NcclLoad();
Error NcclGetUniqueId(std::string* id);
// Joins a communicator of `nranks` as `rank` on the current device and waits (up to
// timeout_ms) for every rank to join.
Error NcclInit(const std::string& id, int nranks, int rank, int timeout_ms, void** comm);
// Queue a send / receive of `bytes` on `stream` (a stream of CreateStream).
Error NcclSend(void* comm, const void* buf, size_t bytes, int peer, void* stream);
Error NcclRecv(void* comm, void* buf, size_t bytes, int peer, void* stream);
// Waits up to timeout_ms for the work of `stream`; aborts `comm` on timeout or error.
Error NcclWait(void* comm, void* stream, int timeout_ms);
Error NcclDestroy(void* comm);

// A non-blocking stream for transfers, and its disposal.
Error CreateStream(void** stream);
Error DestroyStream(void* stream);
// Waits for the daemon's default stream (work queued before a send).
Error SynchronizeDefaultStream();

}  // namespace kvcd::kernels::cuda
