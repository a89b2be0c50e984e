// CUDA backend: page pools in device memory (cudaMalloc once per model), attention through
// kernels/cuda. Only built with KVCD_CUDA; reaches CUDA only through kernels' host APIs.
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_demote.h"
#include "kvcd/kernels/cuda_device_copy.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "kvcd/kernels/int2_attention.h"
#include "server/backends/backend.h"

namespace kvcd {
namespace {

namespace kc = kernels::cuda;

#define RETURN_IF_CUDA(expr)                          \
  do {                                                \
    const std::string kvcd_err_ = (expr);             \
    if (!kvcd_err_.empty()) return Failed(kvcd_err_); \
  } while (0)
#define RETURN_IF_CUDA_ERR(expr)                                   \
  do {                                                             \
    const int kvcd_code_ = static_cast<int>(expr);                 \
    if (kvcd_code_ != 0) return Failed(kc::ErrorText(kvcd_code_)); \
  } while (0)

// Device scratch that only grows (allocated on the first call that needs more).
class DeviceBuffer {
 public:
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)kc::Free(ptr_);
  }
  absl::StatusOr<void*> Reserve(size_t bytes) {
    if (bytes <= size_) return ptr_;
    if (ptr_ != nullptr) (void)kc::Free(ptr_);
    ptr_ = nullptr;
    size_ = 0;
    const size_t want = std::max(bytes, size_ * 2);
    std::string err = kc::Malloc(&ptr_, want);
    if (!err.empty()) return absl::ResourceExhaustedError("device scratch: " + err);
    size_ = want;
    return ptr_;
  }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device), sms_(std::max(1, kc::SmCount())) {}
  const char* name() const override { return "cuda"; }

  absl::StatusOr<uint8_t*> AllocatePoolMemory(uint64_t bytes) override {
    void* p = nullptr;
    const std::string err = kc::Malloc(&p, bytes);
    if (!err.empty()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", bytes, " bytes of device memory for a page pool: ", err));
    }
    return static_cast<uint8_t*>(p);
  }
  void FreePoolMemory(uint8_t* p, uint64_t) override { (void)kc::Free(p); }

  void CopyToPool(uint8_t* dst, const void* src, size_t bytes) override {
    Note(kc::CopyToDevice(dst, src, bytes));
  }
  void CopyFromPool(void* dst, const uint8_t* src, size_t bytes) override {
    Note(kc::CopyToHost(dst, src, bytes));
  }

  bool Healthy() const override { return !sticky_.load(); }

  absl::Status DataPlaneAvailable() const override { return absl::OkStatus(); }
  absl::StatusOr<void*> OpenIpcBuffer(const std::string& handle) override {
    void* p = nullptr;
    const std::string err = kc::IpcOpenMemory(handle, &p);
    if (!err.empty()) return absl::InvalidArgumentError(err);
    return p;
  }
  void CloseIpcBuffer(void* p) override { Note(kc::IpcCloseMemory(p)); }
  absl::StatusOr<void*> OpenIpcEvent(const std::string& handle) override {
    void* e = nullptr;
    const std::string err = kc::IpcOpenEvent(handle, &e);
    if (!err.empty()) return absl::InvalidArgumentError(err);
    return e;
  }
  absl::StatusOr<void*> CreateIpcEvent(std::string* handle) override {
    void* e = nullptr;
    RETURN_IF_CUDA(kc::IpcCreateEvent(&e, handle));
    return e;
  }
  void DestroyEvent(void* e) override { Note(kc::DestroyEvent(e)); }
  absl::Status WaitEvent(void* e) override {
    RETURN_IF_CUDA(kc::StreamWaitEvent(e));
    return absl::OkStatus();
  }
  absl::Status RecordEvent(void* e) override {
    RETURN_IF_CUDA(kc::RecordEvent(e));
    return absl::OkStatus();
  }
  absl::Status CopyDeviceToHost(void* host, const void* dev, size_t bytes) override {
    RETURN_IF_CUDA(kc::CopyToHost(host, dev, bytes));
    return absl::OkStatus();
  }
  absl::Status CopyHostToDevice(void* dev, const void* host, size_t bytes) override {
    RETURN_IF_CUDA(kc::CopyToDevice(dev, host, bytes));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    RETURN_IF_CUDA(kc::Synchronize());
    return absl::OkStatus();
  }

  absl::Status StoreRows(const std::vector<RowStoreJob>& rows, int head_dim,
                         bool src_bf16) override {
    std::lock_guard<std::mutex> lock(mu_);
    kc::RowStoreBatch batch;
    for (size_t i = 0; i < rows.size(); ++i) {
      auto rot = Resident(rows[i].rotation, head_dim);
      if (!rot.ok()) return rot.status();
      batch.rows[batch.count++] =
          kc::RowStore{rows[i].src, reinterpret_cast<uint16_t*>(rows[i].dst), *rot};
      if (batch.count == kc::kMaxRowStoresPerLaunch || i + 1 == rows.size()) {
        RETURN_IF_CUDA_ERR(kc::LaunchStoreRows(batch, head_dim, src_bf16, nullptr));
        batch.count = 0;
      }
    }
    return absl::OkStatus();
  }

  // Span descriptors and the failure counter go up in one copy; the kernel walks them all.
  absl::Status CopySpans(const std::vector<DeviceSpan>& spans, uint64_t* bad_values) override {
    if (spans.empty()) {
      if (bad_values != nullptr) *bad_values = 0;
      return absl::OkStatus();
    }
    std::lock_guard<std::mutex> lock(mu_);
    static_assert(sizeof(kc::CopySpan) % 8 == 0, "span layout");
    std::vector<kc::CopySpan> host(spans.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      host[i] = kc::CopySpan{spans[i].src, spans[i].dst, spans[i].bytes, spans[i].check,
                             spans[i].check_block};
    }
    const size_t desc_bytes = sizeof(kc::CopySpan) * host.size();
    auto scratch = span_scratch_.Reserve(desc_bytes + 256);
    if (!scratch.ok()) return scratch.status();
    auto* d_bad = reinterpret_cast<unsigned long long*>(static_cast<uint8_t*>(*scratch));
    auto* d_spans = reinterpret_cast<kc::CopySpan*>(static_cast<uint8_t*>(*scratch) + 256);
    const unsigned long long zero = 0;
    RETURN_IF_CUDA(kc::CopyToDevice(d_bad, &zero, sizeof(zero)));
    RETURN_IF_CUDA(kc::CopyToDevice(d_spans, host.data(), desc_bytes));
    RETURN_IF_CUDA_ERR(kc::LaunchCopySpans(d_spans, static_cast<int>(host.size()), d_bad, nullptr));
    if (bad_values != nullptr) {
      unsigned long long bad = 0;
      RETURN_IF_CUDA(kc::CopyToHost(&bad, d_bad, sizeof(bad)));
      *bad_values = bad;
    } else {
      // The descriptors live in reused scratch: the launch must have read them before the
      // next call overwrites them.
      RETURN_IF_CUDA(kc::Synchronize());
    }
    return absl::OkStatus();
  }

  bool DemotesOnDevice() const override { return true; }

  // One launch per (layer, head, K/V): the rows of a head are contiguous in the BF16 page
  // ([head][slot][d]) and the INT2 row reference maps them to the page layout.
  absl::Status DemotePage(const DemoteJob& j) override {
    std::lock_guard<std::mutex> lock(mu_);
    const kernels::Int2PageLayout layout{j.num_kv_heads, j.page_size, j.head_dim};
    const int64_t head_elems = static_cast<int64_t>(j.page_size) * j.head_dim;
    for (int32_t l = 0; l < j.num_layers; ++l) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(j.src_pool->PagePtr(l, j.src_page));
      uint8_t* dst = j.dst_pool->PagePtr(l, j.dst_page);
      for (int32_t h = 0; h < j.num_kv_heads; ++h) {
        RETURN_IF_CUDA_ERR(kc::LaunchDemoteInt2(src + h * head_elems, j.page_size, j.head_dim,
                                                nullptr, j.rho_k[l], layout.K(dst, h), 0, nullptr));
        RETURN_IF_CUDA_ERR(kc::LaunchDemoteInt2(
            src + (static_cast<int64_t>(j.num_kv_heads) + h) * head_elems, j.page_size, j.head_dim,
            nullptr, j.rho_v[l], layout.V(dst, h), 0, nullptr));
      }
    }
    RETURN_IF_CUDA(kc::Synchronize());
    return absl::OkStatus();
  }

  absl::Status Attend(const AttentionBatch& b) override {
    std::lock_guard<std::mutex> lock(mu_);
    const int batch = static_cast<int>(b.jobs.size());
    const int d = b.head_dim, hq = b.num_q_heads;
    const int rows = batch * hq;
    // Per sequence: its INT2 pages and its BF16 pages (token order does not matter, and
    // only the sequence's last page can be partial, so each list is a valid page list).
    std::vector<int32_t> lens[2];
    std::vector<std::vector<int32_t>> pages[2];
    const PagePool* pool[2] = {nullptr, nullptr};
    int max_pages[2] = {1, 1}, max_len[2] = {0, 0};
    for (int f = 0; f < 2; ++f) {
      lens[f].assign(batch, 0);
      pages[f].resize(batch);
    }
    for (int j = 0; j < batch; ++j) {
      for (const AttentionSegment& seg : b.jobs[j].segments) {
        const int f = seg.format == PageFormat::kInt2Oscar ? 1 : 0;
        pool[f] = seg.pool;
        pages[f][j].insert(pages[f][j].end(), seg.page_ids.begin(), seg.page_ids.end());
        lens[f][j] += static_cast<int32_t>(seg.token_end - seg.token_begin);
      }
      for (int f = 0; f < 2; ++f) {
        max_pages[f] = std::max(max_pages[f], static_cast<int>(pages[f][j].size()));
        max_len[f] = std::max(max_len[f], lens[f][j]);
      }
    }
    const int sms = sms_;
    int splits[2];
    splits[0] = max_len[0] > 0 ? kc::Int2DecodeSplits(batch, b.num_kv_heads, max_len[0], sms) : 0;
    splits[1] = max_len[1] > 0 ? kc::Int2DecodeSplits(batch, b.num_kv_heads, max_len[1], sms,
                                                      kc::Int2CtasPerSm(hq, b.num_kv_heads, d))
                               : 0;
    const int parts = std::max(1, splits[0] + splits[1]);
    // Host staging: q, page tables, lengths; device: the same plus parts, o, lse. The layer's
    // rotations stay resident on the device after their first use.
    auto d_rk = Resident(b.r_k, d);
    if (!d_rk.ok()) return d_rk.status();
    auto d_rvt = Resident(b.r_v_t, d);
    if (!d_rvt.ok()) return d_rvt.status();
    std::vector<int32_t> host_i32;
    size_t table_off[2], len_off[2];
    for (int f = 0; f < 2; ++f) {
      table_off[f] = host_i32.size();
      for (int j = 0; j < batch; ++j) {
        std::vector<int32_t> row = pages[f][j];
        row.resize(max_pages[f], 0);
        host_i32.insert(host_i32.end(), row.begin(), row.end());
      }
      len_off[f] = host_i32.size();
      host_i32.insert(host_i32.end(), lens[f].begin(), lens[f].end());
    }
    const size_t q_bytes = sizeof(float) * rows * d;
    const size_t i32_bytes = sizeof(int32_t) * host_i32.size();
    const size_t part_o_bytes = sizeof(float) * static_cast<size_t>(parts) * rows * d;
    const size_t part_lse_bytes = sizeof(float) * static_cast<size_t>(parts) * rows;
    const size_t state_bytes = kc::Int2StateBytes(batch, b.num_kv_heads);
    const size_t total = 2 * q_bytes + i32_bytes + part_o_bytes + part_lse_bytes + q_bytes +
                         sizeof(float) * rows + state_bytes + 64 * 8;
    auto scratch = scratch_.Reserve(total);
    if (!scratch.ok()) return scratch.status();
    auto carve = [p = static_cast<uint8_t*>(*scratch)](size_t bytes) mutable {
      uint8_t* r = p;
      p += (bytes + 255) / 256 * 256;
      return r;
    };
    float* d_q = reinterpret_cast<float*>(carve(q_bytes));
    int32_t* d_i32 = reinterpret_cast<int32_t*>(carve(i32_bytes));
    float* d_part_o = reinterpret_cast<float*>(carve(part_o_bytes));
    float* d_part_lse = reinterpret_cast<float*>(carve(part_lse_bytes));
    float* d_o = reinterpret_cast<float*>(carve(q_bytes));
    float* d_lse = reinterpret_cast<float*>(carve(sizeof(float) * rows));
    void* d_state = carve(state_bytes);
    if (b.device_q != nullptr) {
      RETURN_IF_CUDA_ERR(kc::LaunchToFloat(b.device_q, b.device_q_bf16,
                                           static_cast<int64_t>(rows) * d, d_q, nullptr));
    } else {
      std::vector<float> q(static_cast<size_t>(rows) * d);
      for (int j = 0; j < batch; ++j)
        std::copy(b.jobs[j].q, b.jobs[j].q + hq * d, q.begin() + j * hq * d);
      RETURN_IF_CUDA(kc::CopyToDevice(d_q, q.data(), q_bytes));
    }
    // Page tables and lengths go up from pinned staging without waiting for the device:
    // a call whose queries and results live on the device (CUDA IPC) never blocks here.
    auto staged = Pinned(i32_bytes);
    if (!staged.ok()) return staged.status();
    std::memcpy((*staged)->host, host_i32.data(), i32_bytes);
    RETURN_IF_CUDA(kc::CopyToDeviceAsync(d_i32, (*staged)->host, i32_bytes));
    RETURN_IF_CUDA(kc::RecordEvent((*staged)->event));
    const kc::DecodeGeometry geo{batch, hq, b.num_kv_heads, d, b.page_size};
    // Results go into the worker's buffer (CUDA IPC; the caller records its event) or into
    // device scratch copied back below. The BF16 windows go first, so that the INT2 launch,
    // the last, can follow itself with the merge of every part.
    const kc::MergeTarget merge{parts, *d_rvt, b.device_o != nullptr ? b.device_o : d_o,
                                b.device_o != nullptr ? b.device_lse : d_lse};
    if (splits[0] > 0) {
      const kc::PagedList list{pool[0]->LayerBase(b.layer), pool[0]->layer_page_bytes(),
                               d_i32 + table_off[0], max_pages[0], d_i32 + len_off[0]};
      RETURN_IF_CUDA_ERR(kc::LaunchBf16DecodeParts(list, geo, d_q, *d_rk, b.softmax_scale,
                                                   splits[0], max_len[0], d_part_o, d_part_lse, 0,
                                                   nullptr));
    }
    if (splits[1] > 0) {
      const kc::PagedList list{pool[1]->LayerBase(b.layer), pool[1]->layer_page_bytes(),
                               d_i32 + table_off[1], max_pages[1], d_i32 + len_off[1]};
      kc::Int2PartsOptions opt;
      opt.state = d_state;
      opt.merge = &merge;
      RETURN_IF_CUDA_ERR(kc::LaunchInt2DecodeParts(list, geo, d_q, *d_rk, b.softmax_scale,
                                                   splits[1], max_len[1], d_part_o, d_part_lse,
                                                   splits[0], nullptr, opt));
    } else {
      if (splits[0] == 0) {  // nothing to attend: every row is the empty state
        std::vector<float> neg(static_cast<size_t>(rows), -INFINITY);
        RETURN_IF_CUDA(kc::CopyToDevice(d_part_lse, neg.data(), sizeof(float) * rows));
      }
      RETURN_IF_CUDA_ERR(kc::LaunchMergeParts(d_part_o, d_part_lse, parts, rows, d, merge.r_v_t,
                                              merge.o, merge.lse, nullptr));
    }
    if (b.device_o != nullptr) return absl::OkStatus();
    std::vector<float> o(static_cast<size_t>(rows) * d), lse(rows);
    RETURN_IF_CUDA(kc::CopyToHost(o.data(), d_o, q_bytes));
    RETURN_IF_CUDA(kc::CopyToHost(lse.data(), d_lse, sizeof(float) * rows));
    for (int j = 0; j < batch; ++j) {
      std::copy(o.begin() + j * hq * d, o.begin() + (j + 1) * hq * d, b.jobs[j].o);
      std::copy(lse.begin() + j * hq, lse.begin() + (j + 1) * hq, b.jobs[j].lse);
    }
    return absl::OkStatus();
  }

 private:
  // A ring of pinned host buffers; a slot is reused once the copy that read it is done.
  struct PinnedSlot {
    void* host = nullptr;
    size_t bytes = 0;
    void* event = nullptr;
    bool used = false;
  };
  absl::StatusOr<PinnedSlot*> Pinned(size_t bytes) {
    PinnedSlot& slot = pinned_[next_pinned_];
    next_pinned_ = (next_pinned_ + 1) % pinned_.size();
    if (slot.used) RETURN_IF_CUDA(kc::EventSynchronize(slot.event));
    if (slot.event == nullptr) RETURN_IF_CUDA(kc::CreateEvent(&slot.event));
    if (slot.bytes < bytes) {
      if (slot.host != nullptr) RETURN_IF_CUDA(kc::HostFree(slot.host));
      slot.host = nullptr;
      slot.bytes = 0;
      RETURN_IF_CUDA(kc::HostAlloc(&slot.host, std::max<size_t>(bytes, 64 << 10)));
      slot.bytes = std::max<size_t>(bytes, 64 << 10);
    }
    slot.used = true;
    return &slot;
  }

  // A device copy of a host rotation matrix (codec profiles live as long as their model).
  absl::StatusOr<const float*> Resident(const float* host, int d) {
    if (host == nullptr) return static_cast<const float*>(nullptr);
    auto it = resident_.find(host);
    if (it != resident_.end()) return static_cast<const float*>(it->second);
    void* p = nullptr;
    const size_t bytes = sizeof(float) * d * d;
    std::string err = kc::Malloc(&p, bytes);
    if (err.empty()) err = kc::CopyToDevice(p, host, bytes);
    if (!err.empty()) return Failed(err);
    resident_.emplace(host, p);
    return static_cast<const float*>(p);
  }
  // Records a failed copy; a sticky error makes the backend unhealthy for good.
  void Note(const std::string& err) {
    if (err.empty()) return;
    std::fprintf(stderr, "kvcd: CUDA error: %s\n", err.c_str());
    if (kc::LastErrorIsSticky()) sticky_.store(true);
  }
  absl::Status Failed(const std::string& err) {
    Note(err);
    return absl::InternalError("CUDA: " + err);
  }

  const int device_;
  const int sms_;
  std::mutex mu_;
  DeviceBuffer scratch_;
  DeviceBuffer span_scratch_;
  std::array<PinnedSlot, 8> pinned_;
  size_t next_pinned_ = 0;
  std::unordered_map<const float*, void*> resident_;  // host rotation -> device copy
  std::atomic<bool> sticky_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  const std::string err = kc::SetDevice(device);
  if (!err.empty()) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", device, " unavailable: ", err));
  }
  return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(device));
}

}  // namespace kvcd
