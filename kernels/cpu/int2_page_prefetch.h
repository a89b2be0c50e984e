// Software prefetch of one KV head's rows in the next INT2 page, spread over the current
// block (int2_attention_avx2.cc, int2_attention_avx512.cc). Internal header.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvcd/kernels/int2_attention.h"

namespace kvcd::kernels::internal {

// The cache lines of the rows of `kv_head` in one page (K codes, V codes, both parameter
// runs), fetched a slice at a time while the block before it computes: issued all at once
// (72 lines at page 64, head_dim 128) they fill the core's miss buffers and stall the
// block's own loads (measured on Zen 4: 24 instead of 14 ns per token and KV head when the
// pages come from DRAM).
class Int2PagePrefetch {
 public:
  Int2PagePrefetch(const Int2PageTable& kv, int kv_head)
      : kv_(kv),
        layout_{kv.num_kv_heads, kv.page_size, kv.head_dim},
        head_(kv_head),
        code_lines_((int64_t{kv.page_size} * (kv.head_dim / 4) + 63) / 64),
        param_lines_((int64_t{kv.page_size} * 4 + 63) / 64) {}
  // Starts on page slot `page_index` of the table; Clear() when there is no next page.
  void Target(int64_t page_index) {
    const uint8_t* b = kv_.base + kv_.page_ids[page_index] * kv_.page_stride;
    region_[0] = b + layout_.KHead(head_);
    region_[1] = b + layout_.VHead(head_);
    region_[2] = b + 2 * layout_.KScale(head_);
    region_[3] = b + 2 * layout_.VScale(head_);
    on_ = true;
    next_ = 0;
  }
  void Clear() { on_ = false; }
  // Fetches the lines up to slice `part` of `parts` (those of earlier slices not fetched
  // yet included): K codes, V codes, then both parameter runs.
  void Slice(int part, int parts) {
    if (!on_) return;
    const int64_t end = 2 * (code_lines_ + param_lines_) * (part + 1) / parts;
    const int64_t lines[4] = {code_lines_, code_lines_, param_lines_, param_lines_};
    for (int64_t r = 0, first = 0; r < 4; first += lines[r], ++r) {
      for (; next_ < std::min(end, first + lines[r]); ++next_) {
        __builtin_prefetch(region_[r] + 64 * (next_ - first), 0, 3);
      }
    }
  }

 private:
  const Int2PageTable& kv_;
  const Int2PageLayout layout_;
  const int head_;
  const int64_t code_lines_, param_lines_;
  const uint8_t* region_[4] = {nullptr, nullptr, nullptr, nullptr};
  bool on_ = false;
  int64_t next_ = 0;
};

}  // namespace kvcd::kernels::internal
