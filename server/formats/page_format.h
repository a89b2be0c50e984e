// PageFormat: one way of storing K/V in pages — its layout and every operation the cache
// core needs on it. Each format (formats/<format>/) has one backend-independent base class
// derived from PageFormat (layout, host checks, row expansion) and one subclass per backend
// (CpuFormat<Base> / CudaFormat<Base>: its writes and attention kernels). The core
// (cache/model_cache) never asks which format a page has: it holds one PageFormat per pool
// and calls it.
//
// A model has a window format (BF16: the sink and recent windows, which take rows one token
// at a time) and, when its history is stored differently, a history format whose pages are
// written whole (Put) or re-encoded from full window pages (Demote). All formats of a
// model share one rotation: rows are stored as x·R (R = null: as given), queries are
// rotated once and outputs un-rotated once per attention call.
//
// Data stays where it is: a RowSource in device memory (CUDA IPC) is read on the device;
// host rows on a device backend go up once per call.
//
// Thread safety: all methods are const and thread-safe; callers own the pages they write.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/codec_profile.h"
#include "kvcd/kernels/device_fault.h"
#include "server/formats/format_id.h"
#include "server/formats/page_pool.h"

namespace kvcd {

class CpuPageFormat;
class CudaPageFormat;

struct PageGeometry {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
};

// Where a pipelined call's device row store may run beside the attention of the tokens before
// it (the CUDA backend's side stream; KVCD_ROW_STREAM=main: none): Fork() returns a stream ordered
// after everything queued so far on the daemon's stream; the backend orders its attention
// launches that read the rows after it.
class RowStream {
 public:
  virtual ~RowStream() = default;
  virtual absl::StatusOr<void*> Fork() = 0;
};

// K or V rows of a request. Row (layer, token, head) starts at element
// layer * layer_stride + token * token_stride + head * head_dim, BF16 or F32, in host memory
// or (on_device) in device memory.
struct RowSource {
  const void* data = nullptr;
  bool is_bf16 = true;
  bool on_device = false;
  int64_t layer_stride = 0;
  int64_t token_stride = 0;
  // Host rows only: when set, the rows have not been checked for NaN/Inf yet and the
  // format's write path checks each row as it reads it (one pass over the client's memory
  // instead of two); `name` is the request field the rows came from, for the error.
  //
  // Device rows (on_device) with check_finite: the store kernel checks every value it reads
  // (kernels/cuda cuda_store_rows.h StoreCheck) and stores a bad row as zeros. Without
  // device_faults the write is synchronous: the format waits for its store and answers
  // INVALID_ARGUMENT naming `name` and the first bad (layer, token, head); the caller frees
  // the pages written. With device_faults (one per source token: pipelined decode) it does
  // not wait: a bad row of token t sets device_faults[t] (kernels/device_fault.h).
  bool check_finite = false;
  absl::string_view name = "rows";
  const kernels::DeviceFault* device_faults = nullptr;
  // Device rows with device_faults: a format may launch its store on row_stream->Fork()
  // instead of the daemon's stream (null: the daemon's stream).
  RowStream* row_stream = nullptr;

  // Host rows only: one row as float / as BF16 bits. With check_finite, OK or
  // INVALID_ARGUMENT naming the first NaN/Inf of the row by its flat index in the tensor
  // (`out` is then partly written and must not be published); without it, always OK.
  absl::Status RowAsFloat(int64_t layer, int64_t token, int32_t head, int32_t head_dim,
                          float* out) const;
  absl::Status RowAsBf16(int64_t layer, int64_t token, int32_t head, int32_t head_dim,
                         uint16_t* out) const;

 private:
  absl::Status CheckRow(const void* row, int64_t offset, int32_t head_dim) const;
};

// Token src_token of a RowSource goes to slot `slot` of page `page`.
struct RowSlot {
  int64_t src_token = 0;
  int32_t page = 0;
  int32_t slot = 0;
};

// The slots of whole pages: source token first_token + i * page_size + t goes to slot t of
// pages[i] (what WritePages writes).
std::vector<RowSlot> PageRowSlots(int64_t first_token, absl::Span<const int32_t> pages,
                                  int32_t page_size);

class PageFormat {
 public:
  PageFormat(FormatId id, const PageGeometry& geometry,
             std::shared_ptr<const CodecProfile> rotation)
      : id_(id), geometry_(geometry), rotation_(std::move(rotation)) {}
  virtual ~PageFormat() = default;
  PageFormat(const PageFormat&) = delete;
  PageFormat& operator=(const PageFormat&) = delete;

  FormatId id() const { return id_; }
  const char* name() const { return FormatName(id_); }
  const PageGeometry& geometry() const { return geometry_; }
  // Rows are stored as x·R_k / x·R_v of this profile; null = as given.
  const CodecProfile* rotation() const { return rotation_.get(); }

  // Bytes of one page of one layer, and of all layers.
  virtual int64_t layer_page_bytes() const = 0;
  int64_t page_bytes() const { return layer_page_bytes() * geometry_.num_layers; }
  // Stored bits per K/V element (codes and parameters).
  virtual double bits_per_element() const = 0;
  // False when the pages hold no K/V rows (fsq history: codes only, filled by WriteCodes;
  // WritePages / WriteRows are not called).
  virtual bool stores_kv() const { return true; }
  // True when the format stores codes computed from the tokens' residuals (WriteCodes):
  // every write of its pages carries them.
  virtual bool needs_residuals() const { return false; }

  // Fills pages[i] (every layer) with tokens first_token + i * page_size ... of k and v.
  virtual absl::Status WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                                  absl::Span<const int32_t> pages, const PagePool& pool) const = 0;

  // Writes single tokens' rows into page slots: every layer (layer < 0; the source holds all
  // layers) or one layer (the source holds that layer only, layer_stride unused). Window
  // formats only; others answer UNIMPLEMENTED.
  virtual absl::Status WriteRows(const RowSource& k, const RowSource& v,
                                 absl::Span<const RowSlot> rows, int32_t layer,
                                 const PagePool& pool) const;

  // Computes and stores the codes of single tokens from their residuals x (rows of
  // residual_width values; head 0, head_dim = residual_width), every layer (layer < 0) or
  // one layer, like WriteRows. Formats with needs_residuals() only; others answer
  // UNIMPLEMENTED.
  virtual absl::Status WriteCodes(const RowSource& x, absl::Span<const RowSlot> rows, int32_t layer,
                                  const PagePool& pool) const;

  // Re-encodes full pages of the model's window pool (rows stored rotated as the window
  // holds them) into pages of this format: src_pages[i] -> dst_pages[i], every layer.
  // History formats only; others answer UNIMPLEMENTED.
  virtual absl::Status Demote(const PagePool& window_pool, absl::Span<const int32_t> src_pages,
                              const PagePool& pool, absl::Span<const int32_t> dst_pages) const;

  // Checks num_pages pages stored back to back (every layer each) before they are stored:
  // INVALID_ARGUMENT naming the page (first_index + i) and layer whose values are not valid
  // for the format (non-finite values, negative scales). CheckPages reads host memory;
  // CheckDevicePages device memory (FAILED_PRECONDITION on backends without a device).
  virtual absl::Status CheckPages(const uint8_t* src, int64_t num_pages,
                                  int64_t first_index) const = 0;
  virtual absl::Status CheckDevicePages(const uint8_t* src, int64_t num_pages,
                                        int64_t first_index) const;

  // Rows [slot, slot + count) of (head, which: 0 = K, 1 = V) from the host bytes of one page
  // of layer `layer`, as float in the original (un-rotated) space. page_first_token: the
  // absolute position of the page's slot 0 (formats that rebuild post-RoPE keys need it).
  virtual void ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head, int which,
                          int64_t page_first_token, int32_t slot, int32_t count,
                          float* out) const = 0;

  // The backend part of a format built for that backend (its attention kernels); null on
  // the others (cpu_page_format.h, cuda_page_format.h).
  virtual const CpuPageFormat* cpu() const { return nullptr; }
  virtual const CudaPageFormat* cuda() const { return nullptr; }

 protected:
  // Un-rotates rows in place (x = y · R^T) when the format has a rotation.
  void Unrotate(int32_t layer, int which, int32_t count, float* rows) const;

 private:
  const FormatId id_;
  const PageGeometry geometry_;
  const std::shared_ptr<const CodecProfile> rotation_;
};

}  // namespace kvcd
