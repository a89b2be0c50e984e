// Decode attention over BF16 paged K/V (CPU). Framework-free.
//
// Page layout (one layer of one page): K [num_kv_heads][page_size][head_dim] followed
// by V [num_kv_heads][page_size][head_dim], BF16. Page p of the layer starts at
// base + p * page_stride (elements).
#pragma once

#include <cstdint>

#include "kvcd/kernels/cpu_features.h"

namespace kvcd::kernels {

struct Bf16PageTable {
  const uint16_t* base = nullptr;     // layer base of the pool
  int64_t page_stride = 0;            // elements between consecutive pages of the layer
  const int32_t* page_ids = nullptr;  // [num_pages] pool indices
  int32_t num_pages = 0;
  int32_t page_size = 0;  // tokens per page
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
};

// Elements of one layer of one BF16 page.
inline int64_t Bf16PageElems(int32_t num_kv_heads, int32_t page_size, int32_t head_dim) {
  return 2LL * num_kv_heads * page_size * head_dim;
}

// Attention of the `group` query heads that share KV head `kv_head` over tokens
// [token_begin, token_end) of the paged sequence (token t lives in page t/page_size).
//   q:   [group][head_dim] float, NOT pre-scaled
//   o:   [group][head_dim] float (output, overwritten)
//   lse: [group] float natural log (output; -inf when the range is empty)
// REQUIRES: group <= 16, head_dim in {8,16,32,64,128,256}, token_end <= num_pages*page_size.
void AttendBf16Pages(const Bf16PageTable& kv, int kv_head, const float* q, int group,
                     float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                     float* lse, CpuIsa isa = ActiveCpuIsa());

}  // namespace kvcd::kernels
