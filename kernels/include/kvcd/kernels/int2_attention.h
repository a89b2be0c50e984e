// Decode attention over OSCAR INT2 pages, on the packed codes (docs/formats.md "Attention").
//
// Layout of one layer of one INT2 page (bytes); a row is one token of one KV head, packed
// as in int2_codec.h (Q = head_dim/4 bytes, G = min(4, Q), P4 = ceil(page_size/4)):
//   K codes  [num_kv_heads][Q/G][page_size][G]   G consecutive bytes of one token, so a
//                                               32-bit lane holds one token's 4 bytes
//   V codes  [num_kv_heads][P4][Q][4]           byte j of 4 consecutive tokens together, so
//                                               a 32-bit lane holds 4 tokens' byte j
//                                               (slots past page_size are padding)
//   K params [num_kv_heads][2][page_size]       FP16 scales, then FP16 minimums
//   V params [num_kv_heads][2][page_size]
// Both code layouts feed 8-bit dot-product instructions (VNNI / DP4A) without shuffles.
// Keys and values are stored rotated (k·R_k, v·R_v); the query must be rotated by the
// caller (q·R_k) and the output is in the rotated value space (multiply by R_v^T).
//
// With k̂_t = c_t·s_t + lo_t: q·k̂_t = s_t (q·c_t) + lo_t Σq, and
// Σ_t p_t v̂_t = Σ_t (p_t s_t) c_t + (Σ_t p_t lo_t)·1, so scale and minimum are folded out
// of the inner loops, which work on the 2-bit codes directly.
#pragma once

#include <cstdint>

#include "kvcd/kernels/cpu_features.h"
#include "kvcd/kernels/host_device.h"
#include "kvcd/kernels/int2_codec.h"

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
  const int64_t q = head_dim / 4, p4 = (page_size + 3) / 4;
  return int64_t{num_kv_heads} * (page_size * q + p4 * 4 * q + 8LL * page_size);
}

// Where rows of K and V live inside one page-layer at `base` (row index = slot).
struct Int2PageLayout {
  int32_t num_kv_heads, page_size, head_dim;
  KVCD_HOST_DEVICE int64_t Q() const { return head_dim / 4; }
  KVCD_HOST_DEVICE int64_t G() const { return Q() < 4 ? Q() : 4; }
  KVCD_HOST_DEVICE int64_t P4() const { return (page_size + 3) / 4; }
  KVCD_HOST_DEVICE int64_t KHead(int head) const { return int64_t{head} * page_size * Q(); }
  KVCD_HOST_DEVICE int64_t VHead(int head) const {
    return int64_t{num_kv_heads} * page_size * Q() + int64_t{head} * P4() * 4 * Q();
  }
  // FP16 index (uint16 units from base) of the scale of (head, slot 0); minimums follow
  // page_size entries later.
  KVCD_HOST_DEVICE int64_t KScale(int head) const {
    return (int64_t{num_kv_heads} * (page_size * Q() + P4() * 4 * Q())) / 2 +
           int64_t{head} * 2 * page_size;
  }
  KVCD_HOST_DEVICE int64_t VScale(int head) const {
    return KScale(head) + int64_t{num_kv_heads} * 2 * page_size;
  }
  Int2RowRef K(uint8_t* base, int head) const {
    uint16_t* p = reinterpret_cast<uint16_t*>(base);
    Int2RowRef r;
    r.codes = base + KHead(head);
    r.row_stride = G();
    r.bytes_per_group = G();
    r.byte_group_stride = int64_t{page_size} * G();
    r.scale = p + KScale(head);
    r.lo = p + KScale(head) + page_size;
    return r;
  }
  Int2RowRef V(uint8_t* base, int head) const {
    uint16_t* p = reinterpret_cast<uint16_t*>(base);
    Int2RowRef r;
    r.codes = base + VHead(head);
    r.rows_per_group = 4;
    r.row_group_stride = 4 * Q();
    r.row_stride = 1;
    r.byte_stride = 4;
    r.scale = p + VScale(head);
    r.lo = p + VScale(head) + page_size;
    return r;
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
void AttendInt2PagesReference(const Int2PageTable& kv, int kv_head, const float* q_rot, int group,
                              float softmax_scale, int64_t token_begin, int64_t token_end,
                              float* o_rot, float* lse);

}  // namespace kvcd::kernels
