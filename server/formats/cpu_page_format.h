// CpuPageFormat: what a format adds to run on the CPU backend (pools in host memory): its
// attention kernel. A format's CPU implementation is CpuFormat<its base class>: the base
// (layout, checks, row expansion) plus this; the CPU backend reaches it as
// PageFormat::cpu().
#pragma once

#include <functional>

#include "server/formats/page_format.h"

namespace kvcd {

class CpuPageFormat {
 public:
  virtual ~CpuPageFormat() = default;

  // Attention of the `group` rotated queries of KV head kv_head over tokens [begin, end)
  // of the pages (token t in page_ids[t / page_size], at absolute position
  // first_position + t) at layer `layer`: o in the rotated value space, lse the natural log
  // (-inf for an empty range).
  virtual void Attend(const PagePool& pool, int32_t layer, absl::Span<const int32_t> page_ids,
                      int64_t first_position, int32_t kv_head, const float* q_rot, int group,
                      float softmax_scale, int64_t begin, int64_t end, float* o,
                      float* lse) const = 0;
};

// The CPU implementation of the format whose backend-independent base class is `Base`.
template <class Base>
class CpuFormat : public Base, public CpuPageFormat {
 public:
  using Base::Base;
  const CpuPageFormat* cpu() const final { return this; }
};

// Stores one page's page_size rows [page_size][head_dim] of (layer, KV head, K or V) into
// the layer page `page` (what a quantizing history format does per row block).
using EncodeRows =
    std::function<void(int32_t layer, uint8_t* page, int32_t head, int which, float* rows)>;
// WritePages of a quantizing history format on the CPU: every (page, layer, head, K/V)
// block of request rows as float (checked as RowSource says), then `encode`.
absl::Status EncodeRequestPages(const PageGeometry& g, const RowSource& k, const RowSource& v,
                                int64_t first_token, absl::Span<const int32_t> pages,
                                const PagePool& pool, const EncodeRows& encode);
// Demote of a quantizing history format on the CPU: the BF16 window pages' rows (as the
// window stores them) as float, then `encode`.
void EncodeWindowPages(const PageGeometry& g, const PagePool& window_pool,
                       absl::Span<const int32_t> src_pages, const PagePool& pool,
                       absl::Span<const int32_t> dst_pages, const EncodeRows& encode);

}  // namespace kvcd
