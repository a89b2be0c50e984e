// Shared body of the BF16 paged decode-attention kernel. Included by one translation
// unit per ISA (scalar / AVX2 / AVX-512), each compiled with its own target flags and
// providing an `Ops` struct with the vector primitives:
//   static void Widen(const uint16_t* bf16, float* out, int d);   // bf16 row -> float
//   static float Dot(const float* a, const float* b, int d);
//   static void Axpy(float a, const float* x, float* y, int d);    // y += a x
//   static void Scale(float a, float* y, int d);                    // y *= a
//   static float ExpSub(float* x, int n, float m);                  // x = exp(x - m), sum
// Internal header: not part of the kernels API.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/bf16_attention.h"

namespace kvcd::kernels::internal {

inline constexpr int kMaxGroup = 16;
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kTokenBlock = 64;

// Online softmax (flash-decoding) over page-sized token blocks: per block, all
// logits of the group are computed from one widened K row each, the running max and
// sum are rescaled once, then each widened V row is accumulated into the group.
template <class Ops>
void AttendBf16PagesImpl(const Bf16PageTable& kv, int kv_head, const float* q, int group,
                         float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                         float* lse) {
  const int d = kv.head_dim;
  const int ps = kv.page_size;
  alignas(64) float qs[kMaxGroup * kMaxHeadDim];
  alignas(64) float row[kMaxHeadDim];
  alignas(64) float s[kMaxGroup][kTokenBlock];
  float m[kMaxGroup];
  float l[kMaxGroup];
  for (int i = 0; i < group; ++i) {
    for (int c = 0; c < d; ++c) qs[i * d + c] = q[i * d + c] * softmax_scale;
    m[i] = kEmptyLse;
    l[i] = 0.0f;
    std::fill(o + i * d, o + (i + 1) * d, 0.0f);
  }
  const int64_t kv_elems = static_cast<int64_t>(kv.num_kv_heads) * ps * d;
  for (int64_t t0 = token_begin; t0 < token_end;) {
    const int64_t page = t0 / ps;
    const int off = static_cast<int>(t0 % ps);
    const int n = static_cast<int>(std::min<int64_t>({ps - off, token_end - t0, kTokenBlock}));
    const uint16_t* page_base = kv.base + kv.page_ids[page] * kv.page_stride;
    const uint16_t* kp = page_base + (static_cast<int64_t>(kv_head) * ps + off) * d;
    const uint16_t* vp = page_base + kv_elems + (static_cast<int64_t>(kv_head) * ps + off) * d;
    for (int j = 0; j < n; ++j) {
      Ops::Widen(kp + static_cast<int64_t>(j) * d, row, d);
      for (int i = 0; i < group; ++i) s[i][j] = Ops::Dot(row, qs + i * d, d);
    }
    for (int i = 0; i < group; ++i) {
      float mx = m[i];
      for (int j = 0; j < n; ++j) mx = std::max(mx, s[i][j]);
      if (mx != m[i]) {
        const float alpha = m[i] == kEmptyLse ? 0.0f : std::exp(m[i] - mx);
        l[i] *= alpha;
        Ops::Scale(alpha, o + i * d, d);
        m[i] = mx;
      }
      l[i] += Ops::ExpSub(s[i], n, mx);
    }
    for (int j = 0; j < n; ++j) {
      Ops::Widen(vp + static_cast<int64_t>(j) * d, row, d);
      for (int i = 0; i < group; ++i) Ops::Axpy(s[i][j], row, o + i * d, d);
    }
    t0 += n;
  }
  for (int i = 0; i < group; ++i) {
    if (l[i] > 0.0f) {
      Ops::Scale(1.0f / l[i], o + i * d, d);
      lse[i] = m[i] + std::log(l[i]);
    } else {
      lse[i] = kEmptyLse;
    }
  }
}

}  // namespace kvcd::kernels::internal
