// The few CUDA runtime services the daemon needs, behind a framework-free host API so that
// server/ never includes CUDA headers (STYLE.md house rule 1). Only built with KVCD_CUDA.
// Every call returns an empty string on success, else the CUDA error text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvcd::kernels::cuda {

std::string SetDevice(int ordinal);
std::string Malloc(void** ptr, size_t bytes);
std::string Free(void* ptr);
std::string CopyToDevice(void* dst, const void* src, size_t bytes);
std::string CopyToHost(void* dst, const void* src, size_t bytes);
// Pinned host memory, and an asynchronous host -> device copy from it on the daemon's
// stream (the source must stay untouched until an event recorded after it completes).
std::string HostAlloc(void** ptr, size_t bytes);
std::string HostFree(void* ptr);
std::string CopyToDeviceAsync(void* dst, const void* pinned_src, size_t bytes);
// Pinned host memory mapped into the device's address space: *host for the host,
// *device_view for kernels (free with HostFree(*host)). Kernel writes to it reach the host
// without a copy.
std::string HostAllocMapped(void** host, void** device_view, size_t bytes);
// A plain event (timing disabled) and a host wait for it.
std::string CreateEvent(void** event);
std::string EventSynchronize(void* event);

// Device -> device on the daemon's stream (the legacy default stream), asynchronous.
std::string CopyDeviceToDevice(void* dst, const void* src, size_t bytes);
// `rows` rows of `width` bytes, src_pitch / dst_pitch bytes apart, between any memories
// (host or device, cudaMemcpyDefault) on the daemon's stream: asynchronous between device
// buffers; into pageable host memory it returns once the bytes are there.
std::string Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                   size_t rows);

// CUDA IPC (same node). Handles are the raw bytes of cudaIpcMemHandle_t /
// cudaIpcEventHandle_t (64 bytes each).
constexpr size_t kIpcHandleBytes = 64;
std::string IpcOpenMemory(const std::string& handle, void** ptr);
std::string IpcCloseMemory(void* ptr);
// An interprocess event (timing disabled) and its handle for another process.
std::string IpcCreateEvent(void** event, std::string* handle);
std::string IpcOpenEvent(const std::string& handle, void** event);
std::string DestroyEvent(void* event);
// Later work of the daemon's stream waits for `event` / `event` completes after the
// work queued so far.
std::string StreamWaitEvent(void* event);
std::string RecordEvent(void* event);

// Timing events (for the GPU timeline of PhaseTimes, issue #19): recorded on the daemon's
// stream, not counted as event records. ElapsedIfDone sets *done = false while `to` has not
// completed, else *done = true and *ms = GPU time from `from` to `to`.
std::string CreateTimingEvent(void** event);
std::string RecordTimingEvent(void* event);
std::string ElapsedIfDone(void* from, void* to, bool* done, float* ms);

// Waits for all work of the device; returns the first error, sticky or not.
std::string Synchronize();
// The text of a cudaError_t value returned by a launcher ("" for success).
std::string ErrorText(int code);
// Multiprocessors of the current device (0 if unknown).
int SmCount();
// True when the last error leaves the context unusable (illegal address, launch failure,
// ECC, ...): the process must exit.
bool LastErrorIsSticky();

}  // namespace kvcd::kernels::cuda
