// CpuPageFormat: what a format adds to run on the CPU backend (pools in host memory): its
// attention kernel. The CPU backend creates only CpuPageFormats, so its attention can call
// them for the segments of their pages.
#pragma once

#include <functional>

#include "server/formats/page_format.h"

namespace kvcd {

class CpuPageFormat : public PageFormat {
 public:
  using PageFormat::PageFormat;

  // Stores one page's page_size rows [page_size][head_dim] of (layer, KV head, K or V) into
  // the layer page `page` (what a quantizing history format does per row block).
  using EncodeRows =
      std::function<void(int32_t layer, uint8_t* page, int32_t head, int which, float* rows)>;
  // WritePages of a quantizing history format: every (page, layer, head, K/V) block of
  // request rows as float (checked as RowSource says), then `encode`.
  absl::Status EncodeRequestPages(const RowSource& k, const RowSource& v, int64_t first_token,
                                  absl::Span<const int32_t> pages, const PagePool& pool,
                                  const EncodeRows& encode) const;
  // Demote of a quantizing history format: the BF16 window pages' rows (as the window
  // stores them) as float, then `encode`.
  void EncodeWindowPages(const PagePool& window_pool, absl::Span<const int32_t> src_pages,
                         const PagePool& pool, absl::Span<const int32_t> dst_pages,
                         const EncodeRows& encode) const;

  // Attention of the `group` rotated queries of KV head kv_head over tokens [begin, end)
  // of the pages (token t in page_ids[t / page_size], at absolute position
  // first_position + t) at layer `layer`: o in the rotated value space, lse the natural log
  // (-inf for an empty range).
  virtual void Attend(const PagePool& pool, int32_t layer, absl::Span<const int32_t> page_ids,
                      int64_t first_position, int32_t kv_head, const float* q_rot, int group,
                      float softmax_scale, int64_t begin, int64_t end, float* o,
                      float* lse) const = 0;
};

}  // namespace kvcd
