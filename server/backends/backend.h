// Backend: where pool memory lives and where kernels run. The server core is
// backend-agnostic; it describes work (page tables, token ranges) and the backend
// executes it: `cpu` with the SIMD kernels of kernels/cpu, `cuda` with kernels/cuda.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/formats/page_pool.h"

namespace kvcd {

enum class PageFormat { kBf16 = 0, kInt2Oscar = 1 };

// A run of pages of one format holding tokens [0, num_tokens) of the run (token t is in
// page_ids[t / page_size]); the attention range is [token_begin, token_end).
struct AttentionSegment {
  PageFormat format = PageFormat::kBf16;
  const PagePool* pool = nullptr;
  std::vector<int32_t> page_ids;
  int64_t token_begin = 0;
  int64_t token_end = 0;
};

// Attention of one sequence at one layer.
struct AttentionJob {
  std::vector<AttentionSegment> segments;
  const float* q = nullptr;  // [num_q_heads][head_dim], raw post-RoPE
  float* o = nullptr;        // [num_q_heads][head_dim]
  float* lse = nullptr;      // [num_q_heads]
};

struct AttentionBatch {
  int32_t layer = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  float softmax_scale = 0;
  // Rotations of the layer ([head_dim][head_dim], null = none): the backend attends with
  // q·R_k over rotated pages and returns o_rot·R_v^T (given as r_v_t).
  const float* r_k = nullptr;
  const float* r_v_t = nullptr;  // R_v^T
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

// One span of a batched device copy (Backend::CopySpans).
struct DeviceSpan {
  enum Check : uint32_t { kNone = 0, kBf16Finite = 1, kFp16ScaleMin = 2 };
  const void* src = nullptr;
  void* dst = nullptr;  // null: check only
  uint64_t bytes = 0;
  uint32_t check = kNone;
  uint32_t check_block = 0;  // kFp16ScaleMin: values per scale / minimum block
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // Pool memory, allocated once per model at registration. RESOURCE_EXHAUSTED when the
  // backend cannot provide it.
  virtual absl::StatusOr<uint8_t*> AllocatePoolMemory(uint64_t bytes) = 0;
  virtual void FreePoolMemory(uint8_t* p, uint64_t bytes) = 0;

  // Host <-> pool copies (plain memcpy on the CPU backend).
  virtual void CopyToPool(uint8_t* pool_dst, const void* host_src, size_t bytes) = 0;
  virtual void CopyFromPool(void* host_dst, const uint8_t* pool_src, size_t bytes) = 0;

  // Runs the batch; jobs[i].o / lse receive the merged state of all segments.
  virtual absl::Status Attend(const AttentionBatch& batch) = 0;

  // False once the device hit an unrecoverable (sticky) error: the daemon reports
  // NOT_SERVING and exits non-zero.
  virtual bool Healthy() const { return true; }

  // Quantize-on-demote of one page on the device, for backends whose pools are not host
  // memory: every layer of BF16 page `src` (rows already rotated) is clipped, quantized and
  // packed into INT2 page `dst`. Backends that return false from DemotesOnDevice() are
  // served by the host path of ModelCache.
  virtual bool DemotesOnDevice() const { return false; }
  struct DemoteJob {
    const PagePool* src_pool = nullptr;
    int32_t src_page = 0;
    const PagePool* dst_pool = nullptr;
    int32_t dst_page = 0;
    int32_t num_layers = 0, num_kv_heads = 0, page_size = 0, head_dim = 0;
    const float* rho_k = nullptr;  // [num_layers]
    const float* rho_v = nullptr;  // [num_layers]
  };
  virtual absl::Status DemotePage(const DemoteJob& job) {
    return absl::UnimplementedError("this backend demotes on the host");
  }

  // Device data plane (CUDA IPC and NCCL). The CPU backend answers FAILED_PRECONDITION.
  // All device work of the daemon is ordered on one stream: a copy or kernel queued after
  // another runs after it.
  virtual absl::Status DataPlaneAvailable() const;
  virtual absl::StatusOr<void*> OpenIpcBuffer(const std::string& handle);
  virtual void CloseIpcBuffer(void* ptr);
  virtual absl::StatusOr<void*> OpenIpcEvent(const std::string& handle);
  // An interprocess event of the daemon; *handle receives its IPC handle.
  virtual absl::StatusOr<void*> CreateIpcEvent(std::string* handle);
  virtual void DestroyEvent(void* event);
  // Later device work waits for `event`; `event` completes after the work queued so far.
  virtual absl::Status WaitEvent(void* event);
  virtual absl::Status RecordEvent(void* event);
  // Synchronous copies between host memory and device memory (IPC mappings included).
  virtual absl::Status CopyDeviceToHost(void* host, const void* device, size_t bytes);
  virtual absl::Status CopyHostToDevice(void* device, const void* host, size_t bytes);
  // Copies (and checks) the spans in one launch, asynchronously; with `bad_values` set,
  // waits and stores the number of values that failed their span's check.
  virtual absl::Status CopySpans(const std::vector<DeviceSpan>& spans, uint64_t* bad_values);
  // Stores new tokens' K/V rows from device memory into BF16 page slots, rotating each by
  // its (host) rotation matrix when set, asynchronously; the stored BF16 rows are
  // bit-identical to the host path's (RotateRows + FloatToBf16).
  struct RowStoreJob {
    const void* src = nullptr;        // [head_dim] BF16 or F32, device
    uint8_t* dst = nullptr;           // [head_dim] BF16 inside a pool page
    const float* rotation = nullptr;  // host [head_dim][head_dim] or null
  };
  virtual absl::Status StoreRows(const std::vector<RowStoreJob>& rows, int head_dim,
                                 bool src_bf16);
  // Waits for all queued device work.
  virtual absl::Status Synchronize();
};

// The CPU backend; `compute_threads` = 0 uses every CPU.
std::unique_ptr<Backend> MakeCpuBackend(int compute_threads);

// The CUDA backend on device `device` (only in builds with KVCD_CUDA; UNAVAILABLE without
// a usable device).
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

}  // namespace kvcd
