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
