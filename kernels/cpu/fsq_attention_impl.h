// Shared body of the FSQ paged decode-attention kernel (docs/fsq.md), instantiated once per
// ISA. The Ops struct supplies RebuildKeys, the only part whose cost grows with d*G per
// token: kb[j][i] = b_k[i] + sum_g W_k^T[g][i] z_j[g] for Ops::kTokens tokens at once.
// Everything else (key norm, RoPE, logits, online softmax, weighted codes) is O(d + G) per
// token and head and written as plain loops the compiler vectorizes. Internal header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fsq_math.h"
#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels::internal {

// Dot product with 8 partial sums (vectorizable without reassociation flags).
inline float FsqDot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
  return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// Unpacks one packed code to G floats z in -8..7.
inline void FsqUnpackToFloat(const uint8_t* code, int latent, float* z) {
  int g = 0;
  for (; g + 2 <= latent; g += 2) {
    z[g] = static_cast<float>((code[g / 2] & 0x0F) - 8);
    z[g + 1] = static_cast<float>((code[g / 2] >> 4) - 8);
  }
  if (g < latent) z[g] = static_cast<float>((code[g / 2] & 0x0F) - 8);
}

// cos/sin of p*f_i for consecutive positions: exact every kSync tokens, in between a float64
// rotation by the per-token step (error ~kSync ulps of double, far below the float output).
class FsqRopeAngles {
 public:
  static constexpr int kSync = 64;
  FsqRopeAngles(const RopeSpec& rope, int64_t first_position)
      : rope_(rope),
        next_(first_position),
        half_(rope.rotary_dims / 2),
        freq_(half_),
        step_c_(half_),
        step_s_(half_),
        c_(half_),
        s_(half_),
        cf_(half_),
        sf_(half_) {
    for (int i = 0; i < half_; ++i) {
      freq_[i] = FsqRopeFrequency(rope, i);
      step_c_[i] = std::cos(freq_[i] / rope.scaling);
      step_s_[i] = std::sin(freq_[i] / rope.scaling);
    }
  }
  // Advances to the next position and returns its float cos/sin tables.
  void Next() {
    if (count_++ % kSync == 0) {
      const double p = static_cast<double>(next_) / rope_.scaling;
      for (int i = 0; i < half_; ++i) {
        c_[i] = std::cos(p * freq_[i]);
        s_[i] = std::sin(p * freq_[i]);
      }
    }
    for (int i = 0; i < half_; ++i) {
      cf_[i] = static_cast<float>(c_[i]);
      sf_[i] = static_cast<float>(s_[i]);
      const double c = c_[i] * step_c_[i] - s_[i] * step_s_[i];
      s_[i] = s_[i] * step_c_[i] + c_[i] * step_s_[i];
      c_[i] = c;
    }
    ++next_;
  }
  // Rotates the first rotary_dims dims of k by the current angles.
  void Apply(float* k) const {
    const float* cf = cf_.data();
    const float* sf = sf_.data();
    if (rope_.pairing == RopePairing::kInterleaved) {
      for (int i = 0; i < half_; ++i) {
        const float a = k[2 * i], b = k[2 * i + 1];
        k[2 * i] = a * cf[i] - b * sf[i];
        k[2 * i + 1] = a * sf[i] + b * cf[i];
      }
    } else {
      float* lo = k;
      float* hi = k + half_;
      for (int i = 0; i < half_; ++i) {
        const float a = lo[i], b = hi[i];
        lo[i] = a * cf[i] - b * sf[i];
        hi[i] = a * sf[i] + b * cf[i];
      }
    }
  }

 private:
  RopeSpec rope_;
  int64_t next_;
  int64_t count_ = 0;
  int half_;
  std::vector<double> freq_, step_c_, step_s_, c_, s_;
  std::vector<float> cf_, sf_;
};

template <class Ops>
void AttendFsqPagesImpl(const FsqPageTable& pages, const FsqLayerCodec& codec, const RopeSpec& rope,
                        int kv_head, const float* q, int group, float softmax_scale,
                        int64_t token_begin, int64_t token_end, float* o, float* lse) {
  constexpr int T = Ops::kTokens;
  const int d = codec.head_dim, G = codec.latent_width, ps = pages.page_size;
  const int64_t cb = FsqCodeBytes(G);
  if (token_end <= token_begin) {
    std::fill(o, o + int64_t{group} * d, 0.0f);
    std::fill(lse, lse + group, kEmptyLse);
    return;
  }
  // Per-call scratch, sized by G, d and group (never by tokens).
  std::vector<float> scratch(static_cast<size_t>(G) * d + T * G + group * G + T * d + group * d +
                             group * T + 64);
  float* wt = scratch.data();       // [G][d] W_k^T of this KV head
  float* zf = wt + int64_t{G} * d;  // [T][G] codes of the token block as floats
  float* zacc = zf + T * G;         // [group][G] sum_t p_t z_t
  float* kb = zacc + group * G;     // [T][d] rebuilt keys of the block
  float* qs = kb + T * d;           // [group][d] q * softmax_scale
  float* sc = qs + group * d;       // [group][T] logits, then weights
  std::vector<float> m(group, kEmptyLse), l(group, 0.0f);
  const float* wk = codec.decoder_k + int64_t{kv_head} * d * G;
  for (int i = 0; i < d; ++i)
    for (int g = 0; g < G; ++g) wt[int64_t{g} * d + i] = wk[int64_t{i} * G + g];
  const float* bk = codec.bias_k + int64_t{kv_head} * d;
  for (int i = 0; i < group * d; ++i) qs[i] = q[i] * softmax_scale;
  std::fill(zacc, zacc + group * G, 0.0f);
  const float* knorm = codec.key_norm;
  const float eps = codec.key_norm_eps;
  FsqRopeAngles angles(rope, pages.first_position + token_begin);

  for (int64_t t0 = token_begin; t0 < token_end; t0 += T) {
    const int n = static_cast<int>(std::min<int64_t>(T, token_end - t0));
    for (int j = 0; j < T; ++j) {
      float* zj = zf + j * G;
      if (j < n) {
        const int64_t t = t0 + j;
        FsqUnpackToFloat(pages.base + pages.page_ids[t / ps] * pages.page_stride + (t % ps) * cb, G,
                         zj);
      } else {
        std::fill(zj, zj + G, 0.0f);
      }
    }
    Ops::RebuildKeys(wt, bk, zf, G, d, kb);
    for (int j = 0; j < n; ++j) {
      float* k = kb + j * d;
      if (knorm != nullptr) {
        const float inv = 1.0f / std::sqrt(FsqDot(k, k, d) / static_cast<float>(d) + eps);
        for (int i = 0; i < d; ++i) k[i] = k[i] * inv * knorm[i];
      }
      angles.Next();
      angles.Apply(k);
      for (int g = 0; g < group; ++g) sc[g * T + j] = FsqDot(qs + g * d, k, d);
    }
    // Online softmax per query head; the weights multiply the codes, not the values.
    for (int g = 0; g < group; ++g) {
      float* s = sc + g * T;
      float mx = m[g];
      for (int j = 0; j < n; ++j) mx = std::max(mx, s[j]);
      float* acc = zacc + int64_t{g} * G;
      if (mx > m[g]) {
        const float alpha = m[g] == kEmptyLse ? 0.0f : std::exp(m[g] - mx);
        l[g] *= alpha;
        for (int c = 0; c < G; ++c) acc[c] *= alpha;
        m[g] = mx;
      }
      for (int j = 0; j < n; ++j) {
        const float p = std::exp(s[j] - mx);
        l[g] += p;
        const float* zj = zf + j * G;
        for (int c = 0; c < G; ++c) acc[c] += p * zj[c];
      }
    }
  }
  // o = W_v (sum_t a_t z_t) + b_v, once per query head.
  const float* wv = codec.decoder_v + int64_t{kv_head} * d * G;
  const float* bv = codec.bias_v + int64_t{kv_head} * d;
  for (int g = 0; g < group; ++g) {
    float* acc = zacc + int64_t{g} * G;
    const float inv = 1.0f / l[g];
    for (int c = 0; c < G; ++c) acc[c] *= inv;
    for (int i = 0; i < d; ++i) o[g * d + i] = bv[i] + FsqDot(wv + int64_t{i} * G, acc, G);
    lse[g] = m[g] + std::log(l[g]);
  }
}

// Portable RebuildKeys (also the reference shape of the SIMD versions).
struct FsqScalarOps {
  static constexpr int kTokens = 4;
  static void RebuildKeys(const float* wt, const float* bias, const float* zf, int G, int d,
                          float* kb) {
    for (int j = 0; j < kTokens; ++j) {
      float* k = kb + j * d;
      for (int i = 0; i < d; ++i) k[i] = bias[i];
      const float* z = zf + j * G;
      for (int g = 0; g < G; ++g) {
        const float zg = z[g];
        const float* w = wt + int64_t{g} * d;
        for (int i = 0; i < d; ++i) k[i] += w[i] * zg;
      }
    }
  }
};

}  // namespace kvcd::kernels::internal
