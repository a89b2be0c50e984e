// Decode attention over OSCAR INT2 pages, computed on the packed codes (DESIGN.md §7).
//
// Layout of one layer of one INT2 page (bytes), rows as in int2_codec.h:
//   K codes  [num_kv_heads][page_size][head_dim/4]
//   V codes  [num_kv_heads][page_size][head_dim/4]
//   K params [num_kv_heads][page_size][2] FP16 (scale, lo)
//   V params [num_kv_heads][page_size][2] FP16 (scale, lo)
// Keys and values are stored rotated (k·R_k, v·R_v); the query must be rotated by the
// caller (q·R_k) and the output is in the rotated value space (multiply by R_v^T).
//
// With k̂_t = c_t·s_t + lo_t: q·k̂_t = s_t (q·c_t) + lo_t Σq, and
// Σ_t p_t v̂_t = Σ_t (p_t s_t) c_t + (Σ_t p_t lo_t)·1, so scale and minimum are folded out
// of the inner loops, which work on the 2-bit codes directly.
#pragma once

#include <cstdint>

#include "kvcd/kernels/cpu_features.h"

namespace kvcd::kernels {

struct Int2PageTable {
  const uint8_t* base = nullptr;      // layer base of the pool
  int64_t page_stride = 0;            // bytes between consecutive pages of the layer
  const int32_t* page_ids = nullptr;  // [num_pages]
  int32_t num_pages = 0;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
};

// Bytes of one layer of one INT2 page.
inline int64_t Int2PageBytes(int32_t num_kv_heads, int32_t page_size, int32_t head_dim) {
  return 2LL * num_kv_heads * page_size * (head_dim / 4 + 4);
}

// Offsets inside a page-layer (bytes) of the K/V codes and params of (head, slot).
struct Int2PageLayout {
  int32_t num_kv_heads, page_size, head_dim;
  int64_t KCodes(int head, int slot) const {
    return (static_cast<int64_t>(head) * page_size + slot) * (head_dim / 4);
  }
  int64_t VCodes(int head, int slot) const {
    return static_cast<int64_t>(num_kv_heads) * page_size * (head_dim / 4) + KCodes(head, slot);
  }
  int64_t KParams(int head, int slot) const {
    return 2LL * num_kv_heads * page_size * (head_dim / 4) +
           (static_cast<int64_t>(head) * page_size + slot) * 4;
  }
  int64_t VParams(int head, int slot) const {
    return KParams(head, slot) + static_cast<int64_t>(num_kv_heads) * page_size * 4;
  }
};

// Attention of the `group` query heads of KV head `kv_head` over tokens
// [token_begin, token_end) (token t in page t/page_size).
//   q_rot: [group][head_dim] rotated query, NOT pre-scaled
//   o_rot: [group][head_dim] output in the rotated value space; lse: [group] natural log
void AttendInt2Pages(const Int2PageTable& kv, int kv_head, const float* q_rot, int group,
                     float softmax_scale, int64_t token_begin, int64_t token_end, float* o_rot,
                     float* lse, CpuIsa isa = ActiveCpuIsa());

// The scalar oracle: dequantizes every row exactly (FP16 params -> float) and computes
// softmax attention in double. Same arguments as AttendInt2Pages.
void AttendInt2PagesReference(const Int2PageTable& kv, int kv_head, const float* q_rot,
                              int group, float softmax_scale, int64_t token_begin,
                              int64_t token_end, float* o_rot, float* lse);

}  // namespace kvcd::kernels
