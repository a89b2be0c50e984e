// The few CUDA runtime services the daemon needs, behind a framework-free host API so that
// server/ never includes CUDA headers (STYLE.md house rule 1). Only built with KVCD_CUDA.
// Every call returns an Error (error.h): ok() on success, else the CUDA error and its text.
//
// The process's device: SetDevice(n) makes device n current on the calling thread and on
// every other thread at its next call into the kernels' host API (this header, the
// launchers, cuda_nccl.h, cuda_stream_memops.h), so memory, streams, events, IPC mappings,
// NCCL communicators and launches of any thread are all on device n. Until SetDevice is
// called nothing is bound (a process that calls cudaSetDevice itself keeps its choice); after
// it, a thread must not change its device except through SetDevice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvcd/kernels/error.h"

namespace kvcd::kernels::cuda {

Error SetDevice(int ordinal);
// The calling thread's current device (the process's device once SetDevice was called).
Error GetDevice(int* ordinal);
// The device whose memory holds `ptr` (cudaPointerGetAttributes): its ordinal, or -1 for
// host memory (pinned, or never seen by CUDA).
Error PointerDevice(const void* ptr, int* ordinal);
Error Malloc(void** ptr, size_t bytes);
Error Free(void* ptr);
Error CopyToDevice(void* dst, const void* src, size_t bytes);
Error CopyToHost(void* dst, const void* src, size_t bytes);
// Pinned host memory, and an asynchronous host -> device copy from it on the daemon's
// stream (the source must stay untouched until an event recorded after it completes).
Error HostAlloc(void** ptr, size_t bytes);
Error HostFree(void* ptr);
Error CopyToDeviceAsync(void* dst, const void* pinned_src, size_t bytes);
// Pinned host memory mapped into the device's address space: *host for the host,
// *device_view for kernels (free with HostFree(*host)). Kernel writes to it reach the host
// without a copy.
Error HostAllocMapped(void** host, void** device_view, size_t bytes);
// A plain event (timing disabled) and a host wait for it.
Error CreateEvent(void** event);
Error EventSynchronize(void* event);

// Device -> device on the daemon's stream (the legacy default stream), asynchronous.
Error CopyDeviceToDevice(void* dst, const void* src, size_t bytes);
// Zeroes device bytes on the daemon's stream, asynchronously.
Error ZeroAsync(void* dst, size_t bytes);
// `rows` rows of `width` bytes, src_pitch / dst_pitch bytes apart, between any memories
// (host or device, cudaMemcpyDefault) on the daemon's stream: asynchronous between device
// buffers; into pageable host memory it returns once the bytes are there.
Error Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
             size_t rows);

// CUDA IPC (same node). Handles are the raw bytes of cudaIpcMemHandle_t /
// cudaIpcEventHandle_t (64 bytes each).
constexpr size_t kIpcHandleBytes = 64;
Error IpcOpenMemory(const std::string& handle, void** ptr);
Error IpcCloseMemory(void* ptr);
// The handle another process opens with IpcOpenMemory, of an allocation of Malloc here.
Error IpcExportMemory(void* ptr, std::string* handle);
// An interprocess event (timing disabled) and its handle for another process.
Error IpcCreateEvent(void** event, std::string* handle);
Error IpcOpenEvent(const std::string& handle, void** event);
Error DestroyEvent(void* event);
// Later work of the daemon's stream waits for `event` / `event` completes after the
// work queued so far.
Error StreamWaitEvent(void* event);
Error RecordEvent(void* event);

// A second stream for the daemon (non-blocking: no implicit ordering with the daemon's
// legacy stream) and the two directions of a fork/join through plain events: ForkTo records
// `event` on the daemon's stream and makes `stream` wait for it; JoinFrom records `event` on
// `stream` and makes the daemon's stream wait for it.
Error CreateSideStream(void** stream);
Error ForkTo(void* stream, void* event);
Error JoinFrom(void* stream, void* event);

// Timing events (for the GPU timeline of PhaseTimes, issue #19): recorded on the daemon's
// stream, not counted as event records. ElapsedIfDone sets *done = false while `to` has not
// completed, else *done = true and *ms = GPU time from `from` to `to`.
Error CreateTimingEvent(void** event);
Error RecordTimingEvent(void* event);
Error ElapsedIfDone(void* from, void* to, bool* done, float* ms);

// Waits for all work of the device; returns the first error, sticky or not.
Error Synchronize();
// Multiprocessors of the current device (0 if unknown).
int SmCount();
// True when the last error leaves the context unusable (illegal address, launch failure,
// ECC, ...): the process must exit.
bool LastErrorIsSticky();

}  // namespace kvcd::kernels::cuda
