// Backend: where pool memory lives and where the formats' kernels run — `cpu` (host memory,
// the SIMD kernels of kernels/cpu) or `cuda` (device memory, kernels/cuda). The cache core
// describes work (formats, page tables, copy spans) and the backend carries it out.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcd/kernels/device_fault.h"
#include "server/formats/format_registry.h"
#include "server/formats/page_format.h"
#include "server/formats/page_pool.h"

namespace kvcd {

class DeviceRuntime;

// A run of pages of one format holding tokens [0, num_tokens) of the run (token t is in
// page_ids[t / page_size]); the attention range is [token_begin, token_end).
struct AttentionSegment {
  const PageFormat* format = nullptr;  // created by this backend
  const PagePool* pool = nullptr;
  std::vector<int32_t> page_ids;
  int64_t first_position = 0;  // absolute position in the sequence of the run's token 0
  int64_t token_begin = 0;
  int64_t token_end = 0;
};

// Attention of one sequence at one layer.
struct AttentionJob {
  std::vector<AttentionSegment> segments;
  const float* q = nullptr;  // [num_q_heads][head_dim], raw post-RoPE
  float* o = nullptr;        // [num_q_heads][head_dim]
  float* lse = nullptr;      // [num_q_heads]
  // Backends with a device: the sequence's fault target at this layer (tag 0 = none). A
  // NaN/±Inf in its device queries sets it, and a set one makes its outputs NaN.
  kernels::DeviceFault fault;
};

struct AttentionBatch {
  int32_t layer = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  float softmax_scale = 0;
  // The model's window format: its rotation (shared by every format of the model) rotates
  // the queries (q·R_k) and un-rotates the output (o·R_v^T).
  const PageFormat* model_format = nullptr;
  std::vector<AttentionJob> jobs;
  // Device data plane (CUDA IPC): when set, the queries are read from device memory
  // ([B][num_q_heads][head_dim], BF16 or F32) instead of jobs[i].q, and the results are
  // written to device memory ([B][num_q_heads][head_dim] and [B][num_q_heads] F32)
  // instead of jobs[i].o / lse, without waiting for the device.
  const void* device_q = nullptr;
  bool device_q_bf16 = false;
  float* device_o = nullptr;
  float* device_lse = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // False once the device hit an unrecoverable (sticky) error: the daemon reports
  // NOT_SERVING and exits non-zero.
  virtual bool Healthy() const { return true; }

  // Pool memory, allocated once per model at registration. RESOURCE_EXHAUSTED when the
  // backend cannot provide it.
  virtual absl::StatusOr<uint8_t*> AllocatePoolMemory(uint64_t bytes) = 0;
  virtual void FreePoolMemory(uint8_t* p, uint64_t bytes) = 0;
  // What AllocatePoolMemory(bytes) really takes: the request rounded up to 2 MiB (the
  // CPU backend's huge-page alignment; the CUDA allocator's granularity for pools).
  // The memory budget counts this, not the requested bytes.
  virtual uint64_t PoolAllocationBytes(uint64_t bytes) const {
    constexpr uint64_t kGranularity = uint64_t{2} << 20;
    return (bytes + kGranularity - 1) / kGranularity * kGranularity;
  }

  // Where the formats of the models this backend serves run (what a format factory builds
  // for it: format_registry.h).
  virtual BackendKind kind() const = 0;

  // Whole pages between a pool and a run of pages stored back to back ([page][layer]
  // [layer_page_bytes], the form pages travel in) in host or device memory: WritePages
  // copies run page i into pool page ids[i] (every layer), ReadPages the other way. Device
  // work is ordered on the daemon's one stream; ReadPages into host memory returns once the
  // bytes are there.
  virtual absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> ids,
                                  const uint8_t* run, bool run_on_device) = 0;
  virtual absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> ids, uint8_t* run,
                                 bool run_on_device) = 0;

  // Runs the batch; jobs[i].o / lse receive the merged state of all segments.
  virtual absl::Status Attend(const AttentionBatch& batch) = 0;

  // The device runtime of the data plane (CUDA IPC, events); null without a device.
  virtual DeviceRuntime* device() { return nullptr; }
  // Where pipelined calls' row stores may run (RowStream in page_format.h); null: in order.
  virtual RowStream* row_stream() { return nullptr; }
};

// The CPU backend; `compute_threads` = 0 uses every CPU.
std::unique_ptr<Backend> MakeCpuBackend(int compute_threads);

// The CUDA backend on device `device` (only in builds with KVCD_CUDA; UNAVAILABLE without
// a usable device).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

}  // namespace kvcd
