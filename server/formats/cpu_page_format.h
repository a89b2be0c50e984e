// CpuPageFormat: what a format adds to run on the CPU backend (pools in host memory): its
// attention kernel. The CPU backend creates only CpuPageFormats, so its attention can call
// them for the segments of their pages.
#pragma once

#include "server/formats/page_format.h"

namespace kvcd {

class CpuPageFormat : public PageFormat {
 public:
  using PageFormat::PageFormat;

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
