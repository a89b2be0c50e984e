// Transform-coded INT2 history pages (codec file version 3, common/key_transform_profile.h):
// keys as a per-KV-head transform code with uneven bits across the eigen-directions of a
// query-whitened basis, values as OSCAR INT2 with one rotation and clip per KV head; layout
// of one layer of one page in kvcd/kernels/transform_attention.h, key codec in
// kvcd/kernels/transform_codec.h. Written whole (Put: quantize-on-put) or re-encoded from
// full BF16 window pages (Demote). The model's window stores rows as given (no shared
// rotation): this format applies its per-head value rotations itself and attends on the
// codes (queries projected once per call, one inverse value rotation per head).
#pragma once

#include <memory>

#include "common/key_transform_profile.h"
#include "kvcd/kernels/transform_attention.h"
#include "server/formats/cpu_page_format.h"

namespace kvcd {

// The layout, host-side checks, reads and the reference (CPU) encoder.
class Int2TransformLayout {
 public:
  // The profile must match the geometry (KeyTransformProfile::FromSafetensors checked it).
  Int2TransformLayout(const PageGeometry& g, std::shared_ptr<const KeyTransformProfile> p);

  const KeyTransformProfile& profile() const { return *profile_; }
  const kernels::TransformPageLayout& layout() const { return layout_; }
  int64_t layer_page_bytes() const { return layout_.Bytes(); }
  // Key codes and FP16 gain, INT2 value codes and FP16 scale and minimum, per row.
  double bits_per_element() const;

  // Codes may be any bytes; the FP16 key gains (> 0), value scales (>= 0) and minimums
  // must be finite. INVALID_ARGUMENT naming page (first_index + p) and layer otherwise.
  absl::Status CheckPages(const uint8_t* src, int64_t num_pages, int64_t first_index) const;
  // The key gains alone: `gains` holds num_pages * num_layers blocks of num_kv_heads *
  // page_size FP16 values (a layer page's gain region each), pages in order.
  absl::Status CheckKeyGains(const uint16_t* gains, int64_t num_pages, int64_t first_index) const;
  // A key gain a page may hold: a positive finite FP16 value.
  static bool ValidKeyGain(uint16_t h) {
    return (h & 0x7c00u) != 0x7c00u && (h & 0x8000u) == 0 && h != 0;
  }

  // Rows back to floats in the original space (keys decoded, values un-rotated).
  void ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head, int which, int32_t slot,
                  int32_t count, float* out) const;
  // A page's rows [page_size][d] of (head, K or V) of one layer, as given, encoded (CPU).
  void Encode(const float* rows, int32_t layer, int32_t head, int which, uint8_t* page) const;

 private:
  PageGeometry g_;
  std::shared_ptr<const KeyTransformProfile> profile_;
  kernels::TransformPageLayout layout_;
};

// int2-transform pages on any backend: layout, host check, expansion (keys decoded, values
// un-rotated). The profile must match the geometry (KeyTransformProfile::FromSafetensors
// checked it).
class Int2TransformPageFormat : public PageFormat {
 public:
  Int2TransformPageFormat(const PageGeometry& g, std::shared_ptr<const KeyTransformProfile> p)
      : PageFormat(FormatId::kInt2Transform, g, nullptr), x_(g, std::move(p)) {}

  int64_t layer_page_bytes() const override { return x_.layer_page_bytes(); }
  double bits_per_element() const override { return x_.bits_per_element(); }
  absl::Status CheckPages(const uint8_t* src, int64_t num_pages,
                          int64_t first_index) const override {
    return x_.CheckPages(src, num_pages, first_index);
  }
  void ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head, int which,
                  int64_t /*page_first_token*/, int32_t slot, int32_t count,
                  float* out) const override {
    x_.ExpandRows(layer_page, layer, head, which, slot, count, out);
  }

 protected:
  const Int2TransformLayout& transform() const { return x_; }

 private:
  const Int2TransformLayout x_;
};

std::unique_ptr<PageFormat> MakeInt2TransformCpuFormat(
    const PageGeometry& geometry, std::shared_ptr<const KeyTransformProfile> profile);

}  // namespace kvcd
