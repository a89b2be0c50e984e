// BF16 pages (the window format of every model, and the history of BF16 models).
// Layout of one layer of one page: K [num_kv_heads][page_size][head_dim] then V, BF16
// (kvcd/kernels/bf16_attention.h). Rows are stored rotated when the model has a rotation.
#pragma once

#include <memory>

#include "server/formats/cpu_page_format.h"

namespace kvcd {

// The layout and host-side checks and reads (also of the K/V part of bf16+fsq pages).
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

// BF16 pages on any backend: layout, host check, expansion (un-rotated); whole pages are
// written as single rows (WriteRows, the backend's).
class Bf16PageFormat : public PageFormat {
 public:
  Bf16PageFormat(const PageGeometry& g, std::shared_ptr<const CodecProfile> rotation)
      : PageFormat(FormatId::kBf16, g, std::move(rotation)), layout_(g) {}

  int64_t layer_page_bytes() const override { return layout_.layer_page_bytes(); }
  double bits_per_element() const override { return 16.0; }
  absl::Status WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                          absl::Span<const int32_t> pages, const PagePool& pool) const override;
  absl::Status CheckPages(const uint8_t* src, int64_t num_pages,
                          int64_t first_index) const override {
    return layout_.CheckPages(src, num_pages, first_index);
  }
  void ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head, int which,
                  int64_t page_first_token, int32_t slot, int32_t count, float* out) const override;

 protected:
  const Bf16Format& layout() const { return layout_; }

 private:
  const Bf16Format layout_;
};

std::unique_ptr<PageFormat> MakeBf16CpuFormat(const PageGeometry& geometry,
                                              std::shared_ptr<const CodecProfile> rotation);

}  // namespace kvcd
