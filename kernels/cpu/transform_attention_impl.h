// Shared body of the transform-coded key attention kernel, instantiated once per ISA like
// int2_attention_impl.h; the Ops struct adds UnpackTransform (a row's codes as floats).
// Internal header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "int2_attention_impl.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/transform_attention.h"

namespace kvcd::kernels::internal {

inline constexpr int kTransformMaxD = 256;

// Where each direction's code sits in a row: a little-endian 32-bit load at byte off[i],
// shifted right by shift[i] and masked (0-bit directions: mask 0); half[i] = (2^b_i - 1) / 2
// centres it, so that a row's logit is a dot product with no cancelling offset.
struct TransformDirections {
  alignas(32) int32_t off[kTransformMaxD];
  alignas(32) int32_t shift[kTransformMaxD];
  alignas(32) int32_t mask[kTransformMaxD];
  alignas(32) float half[kTransformMaxD];
  explicit TransformDirections(const TransformKeyCode& key) {
    int pos = 0;
    for (int i = 0; i < key.d; ++i) {
      off[i] = pos >> 3;
      shift[i] = pos & 7;
      mask[i] = (1 << key.bits[i]) - 1;
      half[i] = static_cast<float>(mask[i]) * 0.5f;
      pos += key.bits[i];
    }
  }
};

// The scalar UnpackTransform: codes minus half, as floats.
inline void UnpackTransformScalar(const uint8_t* padded, const TransformDirections& dirs, int d,
                                  float* out) {
  for (int i = 0; i < d; ++i) {
    uint32_t w;
    std::memcpy(&w, padded + dirs.off[i], 4);
    out[i] = static_cast<float>(
                 static_cast<int32_t>((w >> dirs.shift[i]) & static_cast<uint32_t>(dirs.mask[i]))) -
             dirs.half[i];
  }
}

// The query projected into the key basis: a = (D^T q') sigma step (0 for 0-bit
// directions) with q' = q * softmax_scale; returns c_mean = q' . mean.
template <class Ops>
float ProjectTransformQuery(const TransformKeyCode& key, const float* q, float softmax_scale,
                            float* a) {
  const int d = key.d;
  float qs[kTransformMaxD];
  for (int c = 0; c < d; ++c) qs[c] = q[c] * softmax_scale;
  for (int c = 0; c < d; ++c) a[c] = 0.0f;
  for (int j = 0; j < d; ++j) Ops::Axpy(qs[j], key.decode + j * d, a, d);
  for (int c = 0; c < d; ++c) {
    a[c] *= key.bits[c] > 0 ? key.sigma[c] * static_cast<float>(TransformStep(key.bits[c])) : 0.0f;
  }
  return Ops::Dot(qs, key.mean, d);
}

// One inverse value rotation per query head: out_c = (o R_v^T)_c = R_v[c] . o.
template <class Ops>
void UnrotateTransformOutput(const float* r_v, const float* o, int group, int d, float* out) {
  for (int i = 0; i < group; ++i) {
    for (int c = 0; c < d; ++c) out[i * d + c] = Ops::Dot(r_v + c * d, o + i * d, d);
  }
}

// Row codes copied with 8 zero bytes behind them, so every 32-bit load stays inside.
struct PaddedRow {
  alignas(32) uint8_t bytes[kTransformMaxD + 8];
};

template <class Ops>
void AttendTransformPagesImpl(const TransformPageTable& kv, int kv_head,
                              const TransformKeyCode& key, const float* r_v, const float* q,
                              int group, float softmax_scale, int64_t token_begin,
                              int64_t token_end, float* out, float* lse) {
  constexpr int kMaxG = 16, kMaxD = kTransformMaxD, kBlock = 64;
  const TransformPageLayout& layout = kv.layout;
  const int d = layout.head_dim, ps = layout.page_size, cb = layout.code_bytes;
  const TransformDirections dirs(key);
  alignas(64) float a[kMaxG * kMaxD];
  alignas(64) float o[kMaxG * kMaxD];
  alignas(64) float row[kMaxD];
  alignas(64) float s[kMaxG][kBlock];
  float cmean[kMaxG], m[kMaxG], l[kMaxG], lacc[kMaxG];
  float gain[kBlock];
  for (int i = 0; i < group; ++i) {
    cmean[i] = ProjectTransformQuery<Ops>(key, q + i * d, softmax_scale, a + i * d);
    m[i] = kEmptyLse;
    l[i] = 0.0f;
    lacc[i] = 0.0f;
    std::fill(o + i * d, o + (i + 1) * d, 0.0f);
  }
  PaddedRow padded;
  std::memset(padded.bytes, 0, sizeof(padded.bytes));
  for (int64_t t0 = token_begin; t0 < token_end;) {
    const int64_t page = t0 / ps;
    const int off = static_cast<int>(t0 % ps);
    const int n = static_cast<int>(std::min<int64_t>({ps - off, token_end - t0, kBlock}));
    uint8_t* pb = const_cast<uint8_t*>(kv.base) + kv.page_ids[page] * kv.page_stride;
    const uint8_t* kc = pb + layout.KCodes(kv_head) + int64_t{off} * cb;
    const auto* kg = reinterpret_cast<const uint16_t*>(pb + layout.KGains(kv_head)) + off;
    const Int2RowRef vr = layout.V(pb, kv_head);
    // Logits: s = c_mean + g a . (c - half).
    for (int j = 0; j < n; ++j) {
      std::memcpy(padded.bytes, kc + int64_t{j} * cb, static_cast<size_t>(cb));
      Ops::UnpackTransform(padded.bytes, dirs, d, row);
      gain[j] = HalfToFloat(kg[j]);
      for (int i = 0; i < group; ++i) {
        s[i][j] = cmean[i] + gain[j] * Ops::Dot(row, a + i * d, d);
      }
    }
    // Softmax and values (in the rotated space) as the INT2 kernel.
    AttendInt2Block<Ops>(vr, off, n, group, d, s, m, l, lacc, o);
    t0 += n;
  }
  FinishInt2States(group, d, m, l, lacc, o, lse);
  UnrotateTransformOutput<Ops>(r_v, o, group, d, out);
}

}  // namespace kvcd::kernels::internal
