// Transformer-FSQ history pages (docs/fsq.md, docs/formats.md "fsq"): each token of each layer is
// one code of G coordinates x 4 bits, computed from the attention block's normalized
// residual x_t, shared by all KV heads. Two formats serve an FSQ model:
//
//   fsq       (history)  one layer of one page: codes [page_size][FsqCodeBytes(G)]
//                        (kvcd/kernels/fsq.h); keys and values are rebuilt from the codes
//                        (attention by kernels::AttendFsqPages).
//   bf16+fsq  (windows)  one layer of one page: the BF16 K/V of the bf16 format, then the
//                        same code rows [page_size][FsqCodeBytes(G)].
//
// When codes are computed: when the residuals arrive (Put, Append, fused append:
// WriteCodes), never at demotion. The windows keep each token's code beside its BF16 K/V,
// and Demote copies the codes of a full window page into an fsq page, so a token's code
// is the same whether its page was put straight into the history, demoted early or
// demoted late. The window's code rows are stored bytes, counted in the bf16+fsq page size
// (and so in bytes_per_token and compression_ratio).
#pragma once

#include <memory>

#include "common/fsq_codec.h"
#include "kvcd/kernels/fsq.h"
#include "server/formats/bf16/bf16_format.h"
#include "server/formats/cpu_page_format.h"

namespace kvcd {

// The codec and RoPE of an FSQ model, shared by its two formats.
struct FsqModelCodec {
  FsqCodec codec;
  kernels::RopeSpec rope;
};

// The layouts, host-side checks and reads.
class FsqLayout {
 public:
  FsqLayout(const PageGeometry& g, int latent_width);
  int64_t code_bytes() const { return code_bytes_; }                  // per token per layer
  int64_t codes_bytes() const { return code_bytes_ * g_.page_size; }  // per page per layer
  int64_t window_kv_bytes() const { return window_kv_bytes_; }        // BF16 part of a window page
  int64_t window_page_bytes() const { return window_kv_bytes_ + codes_bytes(); }  // per layer
  // Stored bits per K/V element of a history page (4 bits x G per token, against the
  // 2 * Hkv * d K/V elements of the token) and of a window page (its K/V and codes).
  double history_bits_per_element() const;
  double window_bits_per_element() const;
  // Checks the code rows of num_pages pages stored back to back ([page][layer][layer_bytes],
  // codes at `codes_offset` of each layer page): with an odd G, the unused last high
  // nibble must be 0. INVALID_ARGUMENT naming the page, layer and token.
  absl::Status CheckCodes(const uint8_t* src, int64_t num_pages, int64_t first_index,
                          int64_t layer_bytes, int64_t codes_offset) const;
  // Checks num_pages bf16+fsq window pages stored back to back: finite BF16 K/V, then
  // CheckCodes. INVALID_ARGUMENT naming the page and layer.
  absl::Status CheckWindowPages(const uint8_t* src, int64_t num_pages, int64_t first_index) const;
  // Rebuilds rows [slot, slot + count) of (head, which: 0 = K, 1 = V) of layer `layer` from
  // the code rows at `codes` (one layer page's), the page's slot 0 at absolute position
  // page_first_token (FsqExpandToken).
  void ExpandCodes(const FsqModelCodec& m, const uint8_t* codes, int32_t layer, int32_t head,
                   int which, int64_t page_first_token, int32_t slot, int32_t count,
                   float* out) const;

 private:
  PageGeometry g_;
  int latent_width_;
  int64_t code_bytes_;
  int64_t window_kv_bytes_;
};

// fsq history pages on any backend (codes only, written from residuals: WriteCodes): layout,
// host check, expansion (keys and values rebuilt from the codes).
// REQUIRES: codec matches geometry (layers, heads, head_dim); no rotation for FSQ models.
class FsqPageFormat : public PageFormat {
 public:
  FsqPageFormat(const PageGeometry& g, std::shared_ptr<const FsqModelCodec> m);

  int64_t layer_page_bytes() const override { return layout_.codes_bytes(); }
  double bits_per_element() const override { return layout_.history_bits_per_element(); }
  bool stores_kv() const override { return false; }
  bool needs_residuals() const override { return true; }
  absl::Status WritePages(const RowSource& k, const RowSource& v, int64_t first_token,
                          absl::Span<const int32_t> pages, const PagePool& pool) const override;
  absl::Status CheckPages(const uint8_t* src, int64_t num_pages,
                          int64_t first_index) const override {
    return layout_.CheckCodes(src, num_pages, first_index, layer_page_bytes(), 0);
  }
  void ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head, int which,
                  int64_t page_first_token, int32_t slot, int32_t count,
                  float* out) const override {
    layout_.ExpandCodes(*m_, layer_page, layer, head, which, page_first_token, slot, count, out);
  }

 protected:
  const std::shared_ptr<const FsqModelCodec>& model() const { return m_; }
  const FsqLayout& layout() const { return layout_; }

 private:
  const std::shared_ptr<const FsqModelCodec> m_;
  const FsqLayout layout_;
};

// bf16+fsq window pages on any backend (BF16 K/V as given, then the code rows): layout, host
// check, expansion (the BF16 rows).
class FsqWindowPageFormat : public PageFormat {
 public:
  FsqWindowPageFormat(const PageGeometry& g, std::shared_ptr<const FsqModelCodec> m);

  int64_t layer_page_bytes() const override { return layout_.window_page_bytes(); }
  double bits_per_element() const override { return layout_.window_bits_per_element(); }
  bool needs_residuals() const override { return true; }
  absl::Status CheckPages(const uint8_t* src, int64_t num_pages,
                          int64_t first_index) const override {
    return layout_.CheckWindowPages(src, num_pages, first_index);
  }
  void ExpandRows(const uint8_t* layer_page, int32_t layer, int32_t head, int which,
                  int64_t page_first_token, int32_t slot, int32_t count,
                  float* out) const override {
    kv_.ReadRows(layer_page, head, which, slot, count, out);
  }

 protected:
  const std::shared_ptr<const FsqModelCodec>& model() const { return m_; }
  const FsqLayout& layout() const { return layout_; }

 private:
  const std::shared_ptr<const FsqModelCodec> m_;
  const FsqLayout layout_;
  const Bf16Format kv_;
};

std::unique_ptr<PageFormat> MakeFsqCpuFormat(const PageGeometry& geometry,
                                             std::shared_ptr<const FsqModelCodec> codec);
std::unique_ptr<PageFormat> MakeFsqWindowCpuFormat(const PageGeometry& geometry,
                                                   std::shared_ptr<const FsqModelCodec> codec);

}  // namespace kvcd
