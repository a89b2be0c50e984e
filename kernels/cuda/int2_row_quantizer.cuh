// The OSCAR INT2 quantizer of one row on a group of L lanes (device code shared by every
// kernel that writes INT2 rows). A row's D values are spread over L aligned lanes of a warp
// (GroupOf<L>), D / L per lane; the lane order of the values does not matter to the
// quantizer, only to the Hadamard rotation (its layout J) and the packing. Every step uses the CPU
// codec's FP32 operations in the same order without contraction (dense rotation: x[i] *
// R[i][j] summed over i in order; Hadamard: the butterflies of HadamardRotateRow; quantizer:
// ((x / scale) + zero) + 0.5, or a cheaper form where it provably has the same floor), so
// codes and FP16 parameters are bit-identical to
// DemoteRowsToInt2 (int2_codec.h). The clip threshold sort(|x|)[floor(rho*d)] comes from
// the distinct values in descending order (few elements above it; ties: a binary search
// over them) or a radix select over the bit patterns of |x|. Every lane of the warp must call these
// functions together (full-mask shuffles).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kvcd/kernels/fp16_saturate.h"

namespace kvcd::kernels::cuda {

// The lanes of a warp that hold one row: L in {2, 4, ..., 32}, aligned.
template <int L>
struct GroupOf {
  static_assert(L >= 2 && L <= 32 && (L & (L - 1)) == 0, "L: a power of two in [2, 32]");
  int g;          // index in the group
  unsigned base;  // first lane of the group
  __device__ explicit GroupOf(int lane)
      : g(lane & (L - 1)), base(static_cast<unsigned>(lane & ~(L - 1))) {}
  // The group's lanes whose p holds, as bits 0..L-1.
  __device__ __forceinline__ uint32_t Ballot(bool p) const {
    const uint32_t b = __ballot_sync(0xffffffffu, p);
    if constexpr (L == 32) {
      return b;
    } else {
      return (b >> base) & ((1u << L) - 1u);
    }
  }
  // op over the group's values (butterfly: every lane gets the result).
  template <class T, class Op>
  __device__ __forceinline__ T Fold(T v, Op op) const {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
  }
  __device__ __forceinline__ uint32_t MinU(uint32_t v) const {
    if constexpr (L == 32) {
      return __reduce_min_sync(0xffffffffu, v);
    } else {
      return Fold(v, [](uint32_t a, uint32_t b) { return min(a, b); });
    }
  }
  __device__ __forceinline__ int Sum(int v) const {
    if constexpr (L == 32) {
      return __reduce_add_sync(0xffffffffu, v);
    } else {
      return Fold(v, [](int a, int b) { return a + b; });
    }
  }
  __device__ __forceinline__ float Max(float v) const {
    return Fold(v, [](float a, float b) { return fmaxf(a, b); });
  }
  __device__ __forceinline__ float Min(float v) const {
    return Fold(v, [](float a, float b) { return fminf(a, b); });
  }
};

// x <- x · R (R: [D][D] FP32, row-major) for the warp's row in the warp-per-row layout, each
// output the sum over i in order of separately rounded products x[i] * R[i][j], as RotateRows
// (int2_codec.h) does.
template <int D>
__device__ __forceinline__ void RotateRowWarp(float (&x)[D / 32], const float* rot, int lane) {
  constexpr int E = D / 32;
  float y[E];
#pragma unroll
  for (int k = 0; k < E; ++k) y[k] = 0.0f;
#pragma unroll
  for (int k = 0; k < E; ++k) {
#pragma unroll 8
    for (int src = 0; src < 32; ++src) {
      const float xi = __shfl_sync(0xffffffffu, x[k], src);
      const float* ri = rot + static_cast<int64_t>(k * 32 + src) * D + lane;
#pragma unroll
      for (int m = 0; m < E; ++m) y[m] = __fadd_rn(y[m], __fmul_rn(xi, __ldg(ri + 32 * m)));
    }
  }
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = y[k];
}

// x <- x · (c·H) for the group's row laid out as: slot s = j + J*i (j < J) of group lane g
// holds element j + J*(g + L*i) (J = 1, L = 32: lane l holds l + 32k, the warp-per-row
// layout). HadamardRotateRow's butterflies
// (bit b = 0, 1, ... of the element index; pair (i, i + 2^b) -> (sum, difference)), then
// each value times c. Bits below J pair values of one lane, the next log2(L) bits pair
// lanes (shuffles), the rest pair values of one lane again.
template <int D, int L, int J>
__device__ __forceinline__ void HadamardRowGroup(float (&x)[D / L], const GroupOf<L>& grp,
                                                 float c) {
  constexpr int E = D / L;
#pragma unroll
  for (int h = 1; h < D; h *= 2) {
    if (h < J || h >= J * L) {  // within the lane: slots s and s + m
      const int m = h < J ? h : h / L;
#pragma unroll
      for (int s = 0; s < E; ++s) {
        if ((s & m) != 0) continue;
        const float a = x[s], b = x[s + m];
        x[s] = __fadd_rn(a, b);
        x[s + m] = __fsub_rn(a, b);
      }
    } else {  // across lanes g and g ^ (h / J): the lower one keeps the sum
      const int lm = h / J;
      const bool upper = (grp.g & lm) != 0;
#pragma unroll
      for (int s = 0; s < E; ++s) {
        const float p = __shfl_xor_sync(0xffffffffu, x[s], lm);
        x[s] = upper ? __fsub_rn(p, x[s]) : __fadd_rn(x[s], p);
      }
    }
  }
#pragma unroll
  for (int s = 0; s < E; ++s) x[s] = __fmul_rn(x[s], c);
}

// Clips and quantizes the group's (rotated) row x; q receives the lane's codes (0..3),
// *scale and *lo the FP32 parameters (identical on every lane of the group).
template <int D, int L>
__device__ __forceinline__ void QuantizeRowInt2(float (&x)[D / L], float rho, const GroupOf<L>& grp,
                                                int (&q)[D / L], float* scale_out, float* lo_out) {
  constexpr int E = D / L;
  // Saturated into FP16's range first, as DemoteRowsToInt2 does (fp16_saturate.h): the
  // row's FP16 scale and offset stay finite, and no NaN reaches the selection below.
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = SaturateToFp16Range(x[k]);
  // Clip threshold: the element of rank kk = floor(rho * d) of the sorted |x|, compared as
  // bit patterns (non-negative floats order as their bits). Clipping keeps the top d - kk
  // - 1 elements out. For a small count the distinct values are taken in descending order,
  // each round the largest below the last one: for a ceiling c, max{b < c} = (c - 1) -
  // min over b of the unsigned (c - 1) - b (values at or above c wrap round to large
  // numbers), two operations per value. Without ties among the top values the last of them
  // is the threshold: exactly above + 1 elements are at or above it. Many elements above:
  // a radix select, the largest v with #{|x| < v} <= kk (31 rounds of E ballots).
  const int kk = min(static_cast<int>(floorf(rho * static_cast<float>(D))), D - 1);
  const int above = D - 1 - kk;  // elements ranked above the threshold
  uint32_t bits[E];
#pragma unroll
  for (int k = 0; k < E; ++k) bits[k] = __float_as_uint(x[k]) & 0x7fffffffu;
  uint32_t v = 0;
  if (above <= 16) {
    uint32_t top[17];              // the distinct values, descending (the last repeated)
    uint32_t ceil1 = 0x7fffffffu;  // ceiling - 1: every bit pattern is below 2^31
#pragma unroll 1
    for (int r = 0; r <= above; ++r) {
      uint32_t u = ceil1 - bits[0];
#pragma unroll
      for (int k = 1; k < E; ++k) u = min(u, ceil1 - bits[k]);
      const uint32_t m = grp.MinU(u);
      if (m <= ceil1 && ceil1 < 0x80000000u) {  // else no value is left below the ceiling
        v = ceil1 - m;
        ceil1 = v - 1u;
      }
      top[r] = v;
    }
    int at_or_above = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) at_or_above += bits[k] >= v ? 1 : 0;
    // Ties among the top values (in any row of the warp: the group shuffles below need the
    // whole warp): the threshold is the first top[r] with at least above + 1 values at or
    // above it. That count grows with r and holds at r = above (above + 1 distinct values
    // at or above top[above], or all of them once the distinct values ran out), so a binary
    // search over r finds it (5 steps cover 17); rows without ties end at r = above.
    if (__any_sync(0xffffffffu, grp.Sum(at_or_above) != above + 1)) {
      int lo = 0, hi = above;
#pragma unroll 1
      for (int it = 0; it < 5; ++it) {
        const int mid = (lo + hi) >> 1;
        const uint32_t c = top[mid];
        int n = 0;
#pragma unroll
        for (int k = 0; k < E; ++k) n += bits[k] >= c ? 1 : 0;
        if (grp.Sum(n) >= above + 1) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      v = top[lo];
    }
  } else {
#pragma unroll 1
    for (int b = 30; b >= 0; --b) {
      const uint32_t cand = v | (1u << b);
      int below = 0;
#pragma unroll
      for (int k = 0; k < E; ++k) below += __popc(grp.Ballot(bits[k] < cand));
      if (below <= kk) v = cand;
    }
  }
  const float tau = __uint_as_float(v);
  float lo = tau, hi = -tau;
#pragma unroll
  for (int k = 0; k < E; ++k) {
    x[k] = fminf(fmaxf(x[k], -tau), tau);
    lo = fminf(lo, x[k]);
    hi = fmaxf(hi, x[k]);
  }
  // + 0: the CPU's std::min never yields -0 here (it keeps +tau unless a value is strictly
  // below), while fminf/fmaxf may pick -0 from a row clipped to tau = 0 (a row saturated to
  // NaN -> 0 by a rotation that overflowed); -0 + 0 = +0 keeps the stored offset's bits equal.
  lo = __fadd_rn(grp.Min(lo), 0.0f);
  hi = grp.Max(hi);
  const float scale = __fdiv_rn(fmaxf(__fsub_rn(hi, lo), 1e-8f), 3.0f);
  const float zero = __fdiv_rn(-lo, scale);
  // The code is floor(F), F = ((x / scale) + zero) + 0.5 in FP32. p = x * (1/scale) + (zero
  // + 0.5) with one FMA differs from F by at most 2^-21 (|x|/scale + |zero| + 1) (a few
  // roundings of relative 2^-24 each), so where p is farther than `slack` (four times that)
  // from every integer floor(p) = floor(F); elsewhere (and for any non-finite value) F is
  // computed as the CPU does.
  const float inv = __frcp_rn(scale);
  const float half_up = __fadd_rn(zero, 0.5f);
  const float slack = (fmaxf(fabsf(lo), fabsf(hi)) * inv + fabsf(zero) + 4.0f) * 0x1p-19f;
#pragma unroll
  for (int k = 0; k < E; ++k) {
    const float p = fmaf(x[k], inv, half_up);
    float qf = floorf(p);
    if (!(fabsf(__fsub_rn(__fsub_rn(p, qf), 0.5f)) < 0.5f - slack)) {
      qf = floorf(__fadd_rn(__fadd_rn(__fdiv_rn(x[k], scale), zero), 0.5f));
    }
    q[k] = static_cast<int>(fminf(fmaxf(qf, 0.0f), 3.0f));
  }
  *scale_out = scale;
  *lo_out = lo;
}

// Packs the warp's codes (warp-per-row layout): calls put(j, byte) for each byte j < D/4 of
// the row (byte j holds elements j, j+Q, j+2Q, j+3Q in bits [1:0], [3:2], [5:4], [7:6]);
// each j is put by one lane.
template <int D, class Put>
__device__ __forceinline__ void PackRowInt2(const int (&q)[D / 32], int lane, Put put) {
  constexpr int Q = D / 4;
  // Byte j holds elements j, j+Q, j+2Q, j+3Q.
  if constexpr (Q >= 32) {
#pragma unroll
    for (int r = 0; r < Q / 32; ++r) {
      int byte = 0;
#pragma unroll
      for (int m = 0; m < 4; ++m) byte |= q[r + m * (Q / 32)] << (2 * m);
      put(lane + 32 * r, static_cast<uint8_t>(byte));
    }
  } else {  // Q = 16: element j + 16m lives in lane (j + 16m) % 32, slot m / 2
    const int j = lane % Q;
    int byte = 0;
#pragma unroll
    for (int m = 0; m < 4; ++m)
      byte |= __shfl_sync(0xffffffffu, q[m / 2], j + 16 * (m % 2)) << (2 * m);
    if (lane < Q) put(j, static_cast<uint8_t>(byte));
  }
}

}  // namespace kvcd::kernels::cuda
