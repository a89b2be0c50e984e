// Shared body of the INT2 paged decode-attention kernel, instantiated once per ISA
// like bf16_attention_impl.h (the Ops struct adds UnpackInt2). Internal header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/int2_attention.h"

namespace kvcd::kernels::internal {

// Online softmax: when a block raises a head's running max from m to mx, the sums and the
// accumulated output so far are rescaled by exp(m - mx) (0 for the empty state).
template <class Ops>
inline void RaiseInt2Max(float mx, int d, float& m, float& l, float& lacc, float* o) {
  if (mx == m) return;
  const float alpha = m == kEmptyLse ? 0.0f : std::exp(m - mx);
  l *= alpha;
  lacc *= alpha;
  Ops::Scale(alpha, o, d);
  m = mx;
}

// Turns the running (o, m, l, lacc) of `group` query heads into final states: o holds
// sum_j p_j (scale_j * codes_j) and lacc sum_j p_j * min_j (the value minimum folded out
// of the inner loop), so o = (o + lacc) / l and lse = m + log l; no keys -> empty state.
inline void FinishInt2States(int group, int d, const float* m, const float* l, const float* lacc,
                             float* o, float* lse) {
  for (int i = 0; i < group; ++i) {
    if (l[i] > 0.0f) {
      float* oi = o + i * d;
      const float inv = 1.0f / l[i];
      for (int c = 0; c < d; ++c) oi[c] = (oi[c] + lacc[i]) * inv;
      lse[i] = m[i] + std::log(l[i]);
    } else {
      lse[i] = kEmptyLse;
    }
  }
}

// Values of the n rows at slots off.. of `vr` (n <= 64) weighted by the probabilities
// p[i][j] of `group` query heads: o[i] += Σ_j (p_ij scale_j) c_j, lacc[i] += Σ_j p_ij lo_j
// (the minimum folded out; FinishInt2States adds it back).
template <class Ops>
inline void AccumulateInt2Values(const Int2RowRef& vr, int off, int n, int group, int d,
                                 const float (*p)[64], float* o, float* lacc) {
  float vscale[64], vlo[64];
  uint8_t packed[64];
  alignas(64) float row[256];
  for (int j = 0; j < n; ++j) {
    vscale[j] = HalfToFloat(vr.scale[off + j]);
    vlo[j] = HalfToFloat(vr.lo[off + j]);
  }
  for (int j = 0; j < n; ++j) {
    for (int b = 0; b < d / 4; ++b) packed[b] = vr.codes[vr.Offset(off + j, b)];
    Ops::UnpackInt2(packed, d, row);
    for (int i = 0; i < group; ++i) {
      Ops::Axpy(p[i][j] * vscale[j], row, o + i * d, d);
      lacc[i] += p[i][j] * vlo[j];
    }
  }
}

// One block of n logits s[i][j] of `group` query heads over INT2 value rows at slots off..
// of `vr`: the online-softmax update (s becomes the probabilities) and the values.
template <class Ops>
inline void AttendInt2Block(const Int2RowRef& vr, int off, int n, int group, int d, float (*s)[64],
                            float* m, float* l, float* lacc, float* o) {
  for (int i = 0; i < group; ++i) {
    float mx = m[i];
    for (int j = 0; j < n; ++j) mx = std::max(mx, s[i][j]);
    RaiseInt2Max<Ops>(mx, d, m[i], l[i], lacc[i], o + i * d);
    l[i] += Ops::ExpSub(s[i], n, mx);
  }
  AccumulateInt2Values<Ops>(vr, off, n, group, d, s, o, lacc);
}

template <class Ops>
void AttendInt2PagesImpl(const Int2PageTable& kv, int kv_head, const float* q, int group,
                         float softmax_scale, int64_t token_begin, int64_t token_end, float* o,
                         float* lse) {
  constexpr int kMaxG = 16, kMaxD = 256, kBlock = 64;
  const int d = kv.head_dim;
  const int ps = kv.page_size;
  const int q4 = d / 4;
  const Int2PageLayout layout{kv.num_kv_heads, ps, d};
  alignas(64) float qs[kMaxG * kMaxD];
  alignas(64) float row[kMaxD];
  alignas(64) float s[kMaxG][kBlock];
  float qsum[kMaxG], m[kMaxG], l[kMaxG], lacc[kMaxG];
  for (int i = 0; i < group; ++i) {
    qsum[i] = 0.0f;
    for (int c = 0; c < d; ++c) {
      qs[i * d + c] = q[i * d + c] * softmax_scale;
      qsum[i] += qs[i * d + c];
    }
    m[i] = kEmptyLse;
    l[i] = 0.0f;
    lacc[i] = 0.0f;
    std::fill(o + i * d, o + (i + 1) * d, 0.0f);
  }
  for (int64_t t0 = token_begin; t0 < token_end;) {
    const int64_t page = t0 / ps;
    const int off = static_cast<int>(t0 % ps);
    const int n = static_cast<int>(std::min<int64_t>({ps - off, token_end - t0, kBlock}));
    uint8_t* pb = const_cast<uint8_t*>(kv.base) + kv.page_ids[page] * kv.page_stride;
    const Int2RowRef kr = layout.K(pb, kv_head);
    const Int2RowRef vr = layout.V(pb, kv_head);
    uint8_t packed[64];
    // Logits: s = scale_t (q·c_t) + lo_t Σq.
    for (int j = 0; j < n; ++j) {
      for (int b = 0; b < q4; ++b) packed[b] = kr.codes[kr.Offset(off + j, b)];
      Ops::UnpackInt2(packed, d, row);
      const float sc = HalfToFloat(kr.scale[off + j]);
      const float lo = HalfToFloat(kr.lo[off + j]);
      for (int i = 0; i < group; ++i) s[i][j] = sc * Ops::Dot(row, qs + i * d, d) + lo * qsum[i];
    }
    AttendInt2Block<Ops>(vr, off, n, group, d, s, m, l, lacc, o);
    t0 += n;
  }
  FinishInt2States(group, d, m, l, lacc, o, lse);
}

}  // namespace kvcd::kernels::internal
