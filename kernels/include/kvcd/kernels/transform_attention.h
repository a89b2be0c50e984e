// Decode attention over transform-coded key pages (codec file version 3), computed on the
// codes: keys as in transform_codec.h, values as OSCAR INT2 rows rotated by the KV head's
// value rotation R_v (int2_codec.h).
//
// Layout of one layer of one page (bytes; cb = code bytes per key row, Q = head_dim / 4,
// P4 = ceil(page_size / 4); every region starts at a multiple of 4):
//   K codes  [num_kv_heads][page_size][cb]    one row's bit stream after another
//   K gains  [num_kv_heads][page_size]        FP16
//   V codes  [num_kv_heads][P4][Q][4]         as int2_attention.h
//   V params [num_kv_heads][2][page_size]     FP16 scales, then FP16 minimums
// At head_dim 64 and 144 code bits a token-head takes 18 + 2 (K) + 16 + 4 (V) bytes, INT2's.
//
// The keys are never decoded: once per call each query q (times the softmax scale) is
// projected into the key basis, a_i = (D^T q)_i sigma_i step(b_i) (one d x d product per
// query head), with c_mean = q . mean and c_off = -sum_i a_i (2^b_i - 1) / 2, and each
// history row's logit is c_mean + g (c_off + sum_i a_i c_i): d multiply-adds on its codes.
// Values accumulate in the rotated value space; the output is rotated back once (x R_v^T).
#pragma once

#include <cstdint>

#include "kvcd/kernels/cpu_features.h"
#include "kvcd/kernels/int2_codec.h"
#include "kvcd/kernels/transform_codec.h"

namespace kvcd::kernels {

struct TransformPageLayout {
  int32_t num_kv_heads, page_size, head_dim, code_bytes;
  static int64_t Round4(int64_t x) { return (x + 3) & ~int64_t{3}; }
  int64_t Q() const { return head_dim / 4; }
  int64_t P4() const { return (page_size + 3) / 4; }
  int64_t KCodes(int head) const { return int64_t{head} * page_size * code_bytes; }
  int64_t KGains(int head) const {
    return Round4(int64_t{num_kv_heads} * page_size * code_bytes) + int64_t{head} * page_size * 2;
  }
  int64_t VCodes(int head) const {
    return KGains(0) + Round4(int64_t{num_kv_heads} * page_size * 2) +
           int64_t{head} * P4() * 4 * Q();
  }
  int64_t VParams(int head) const {
    return VCodes(0) + int64_t{num_kv_heads} * P4() * 4 * Q() + int64_t{head} * 4 * page_size;
  }
  int64_t Bytes() const { return VParams(num_kv_heads); }
  // The value rows of one head (INT2, int2_codec.h).
  Int2RowRef V(uint8_t* base, int head) const {
    Int2RowRef r;
    r.codes = base + VCodes(head);
    r.rows_per_group = 4;
    r.row_group_stride = 4 * Q();
    r.row_stride = 1;
    r.byte_stride = 4;
    r.scale = reinterpret_cast<uint16_t*>(base + VParams(head));
    r.lo = r.scale + page_size;
    return r;
  }
};

struct TransformPageTable {
  const uint8_t* base = nullptr;      // layer base of the pool
  int64_t page_stride = 0;            // bytes between consecutive pages of the layer
  const int32_t* page_ids = nullptr;  // [num_pages]
  int32_t num_pages = 0;
  TransformPageLayout layout{};
};

// Attention of the `group` query heads of KV head `kv_head` over tokens
// [token_begin, token_end) (token t in page t / page_size).
//   key: that head's key code; r_v: its value rotation [d][d]
//   q: [group][head_dim] queries as given (not pre-scaled, not rotated)
//   o: [group][head_dim] output in the original value space; lse: [group] natural log
// REQUIRES: group <= 16, head_dim <= 256.
void AttendTransformPages(const TransformPageTable& kv, int kv_head, const TransformKeyCode& key,
                          const float* r_v, const float* q, int group, float softmax_scale,
                          int64_t token_begin, int64_t token_end, float* o, float* lse,
                          CpuIsa isa = ActiveCpuIsa());

// The scalar oracle: decodes every key (DecodeTransformKeys) and value (ExpandInt2Rows with
// R_v) and computes softmax attention in double. Same arguments.
void AttendTransformPagesReference(const TransformPageTable& kv, int kv_head,
                                   const TransformKeyCode& key, const float* r_v, const float* q,
                                   int group, float softmax_scale, int64_t token_begin,
                                   int64_t token_end, float* o, float* lse);

}  // namespace kvcd::kernels
