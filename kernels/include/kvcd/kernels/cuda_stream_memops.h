// Stream memory operations on 32-bit words of device memory (CUDA IPC mappings included):
// the decode channel's cross-process dependency without IPC events (issue #36; the H200
// measured ~3 µs per hop against 5-6 for an IPC event, bench/cuda_doorbell_bench.cu).
// The driver's cuStreamWaitValue32 / cuStreamWriteValue32, reached through the runtime's
// driver entry points (no libcuda link). Only built with KVCD_CUDA.
//
// The protocol (client/workers/ipc_buffer.h, server/dataplane/buffer_registry.h): the
// writer of a dependency writes a rising value into a word after its work; the reader's
// stream waits until the word has reached that value, compared cyclically
// ((int32_t)(word - value) >= 0), so values may wrap.
#pragma once

#include <cstdint>

#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

// Whether the driver offers both operations on the current device (looked up once).
bool StreamMemopsAvailable();
// Later work of `stream` (a cudaStream_t; null: the legacy default stream, the daemon's)
// waits until (int32_t)(*word - value) >= 0. cudaErrorNotSupported without the operations.
Error StreamWaitValue32(void* stream, const uint32_t* word, uint32_t value);
// Writes `value` into *word once the work queued on `stream` so far is done (its writes
// visible first).
Error StreamWriteValue32(void* stream, uint32_t* word, uint32_t value);
// Writes `value` into *word now, on a non-blocking stream of its own, whatever the daemon's
// stream is waiting for: releases a wait whose writer will never write (a worker that
// died), so that the stream does not stay blocked. Returns once the write is queued.
Error ReleaseValue32(uint32_t* word, uint32_t value);

}  // namespace kvcd::kernels::cuda
