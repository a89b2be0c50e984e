// OSCAR INT2 history pages (docs/formats.md "int2-oscar"): rows rotated by the codec, clipped,
// quantized to 2 bits with an FP16 scale and minimum per row; layout of one layer of one
// page in kvcd/kernels/int2_attention.h, row codec in kvcd/kernels/int2_codec.h.
// Written whole (Put: quantize-on-put) or re-encoded from full BF16 window pages (Demote).
#pragma once

#include <memory>

#include "server/formats/cpu_page_format.h"

namespace kvcd {

// The layout and host-side checks and reads.
class Int2OscarFormat {
 public:
  explicit Int2OscarFormat(const PageGeometry& g) : g_(g) {}
  int64_t layer_page_bytes() const;
  // 2 code bits plus 32 parameter bits per row of head_dim values.
  double bits_per_element() const { return 2.0 + 32.0 / g_.head_dim; }
  // Codes may be any bytes; the FP16 scales (>= 0) and minimums must be finite.
  absl::Status CheckPages(const uint8_t* src, int64_t num_pages, int64_t first_index) const;
  // Rows as stored (rotated), dequantized.
  void ReadRows(const uint8_t* layer_page, int32_t head, int which, int32_t slot, int32_t count,
                float* out) const;
  // Byte offset and count of a layer page's FP16 parameters (scales and minimums of K and V):
  // in blocks of page_size values alternating scales and minimums.
  int64_t ParamsOffset() const;
  int64_t ParamsCount() const;

 private:
  PageGeometry g_;
};

// INT2 pages on any backend: layout, host check, expansion (dequantized, un-rotated). A codec
// profile (rotations, clip ratios) is required.
class Int2OscarPageFormat : public PageFormat {
 public:
  Int2OscarPageFormat(const PageGeometry& g, std::shared_ptr<const CodecProfile> codec)
      : PageFormat(FormatId::kInt2Oscar, g, std::move(codec)), layout_(g) {}

  int64_t layer_page_bytes() const override { return layout_.layer_page_bytes(); }
  double bits_per_element() const override { return layout_.bits_per_element(); }
  absl::Status CheckPages(const uint8_t* src, int64_t num_pages,
                          int64_t first_index) const override {
    return layout_.CheckPages(src, num_pages, first_index);
  }
  void ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head, int which,
                  int64_t /*page_first_token*/, int32_t slot, int32_t count,
                  float* out) const override {
    layout_.ReadRows(layer_page, head, which, slot, count, out);
    Unrotate(layer, which, count, out);
  }

 protected:
  const Int2OscarFormat& layout() const { return layout_; }

 private:
  const Int2OscarFormat layout_;
};

std::unique_ptr<PageFormat> MakeInt2OscarCpuFormat(const PageGeometry& geometry,
                                                   std::shared_ptr<const CodecProfile> codec);

}  // namespace kvcd
