// BF16 pages (the window format of every model, and the history of BF16 models).
// Layout of one layer of one page: K [num_kv_heads][page_size][head_dim] then V, BF16
// (kvcd/kernels/bf16_attention.h). Rows are stored rotated when the model has a rotation.
#pragma once

#include <memory>

#include "server/formats/cpu_page_format.h"

namespace kvcd {

// The layout and host-side checks and reads, shared by the backends' implementations.
class Bf16Format {
 public:
  explicit Bf16Format(const PageGeometry& g) : g_(g) {}
  int64_t layer_page_bytes() const;
  // Byte offset of (which, head, slot) in a layer page.
  int64_t RowOffset(int which, int32_t head, int32_t slot) const;
  absl::Status CheckPages(const uint8_t* src, int64_t num_pages, int64_t first_index) const;
  // Rows as stored (rotated), as float.
  void ReadRows(const uint8_t* layer_page, int32_t head, int which, int32_t slot, int32_t count,
                float* out) const;

 private:
  PageGeometry g_;
};

std::unique_ptr<CpuPageFormat> MakeBf16CpuFormat(const PageGeometry& geometry,
                                                 std::shared_ptr<const CodecProfile> rotation);

}  // namespace kvcd
