// What every split-K decode kernel of cuda_decode_attention.h shares (the INT2 kernels of
// int2_decode_v1.cu and int2_decode_v2.cu, the BF16 warp kernel of bf16_warp_attention.cu):
// the launch arguments (PartArgs), the query loading, the per-CTA merge of the warps into one
// part (WritePart), and the merge of the parts
// (merge_splits.cu).
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "column_times_rows.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "merge_fold.cuh"
#include "programmatic_launch.cuh"
#include "query_input.cuh"

namespace kvcd::kernels::cuda {

constexpr int kWarps = 4;
constexpr int kTile = 32;  // tokens per warp step

// What QueryFragments leaves for the v2 decode kernel, per (b, kv head): the B fragments of
// the logit MMAs in lane order (kFragWords words) and unit[8], qsum[8] (log2 units).
constexpr int kFragWords = 4 * 2 * 2 * 32;  // KB (<= 4) x NT (<= 2) x 2 registers x 32 lanes
constexpr int kScalFloats = 16;
struct Int2State {
  uint32_t* frags;
  float* scal;
};

struct PartArgs {
  PagedList list;
  DecodeGeometry geo;
  const float* q;    // [batch][num_q_heads][D] queries (raw, or already rotated if r_k null)
  const float* r_k;  // [D][D] or null
  float scale;       // multiplies the (rotated) query
  int tokens_per_split;
  float* part_o;
  float* part_lse;
  int part_base;
  // Kernel v2 only: query fragments prepared by QueryFragments.
  Int2State state;
  // RawQueries: when q_raw is set, queries are read from it (BF16 or F32, checked) instead
  // of q.
  const void* q_raw = nullptr;
  bool q_bf16 = false;
  const DeviceFault* q_faults = nullptr;
  unsigned long long q_fault_bits = 0;
  // Set (fold.counters): the merge folded into the launch (merge_fold.cuh).
  FoldArgs fold;
};

// Element i of the queries [batch][num_q_heads][head_dim]: a.q[i], or the raw query read
// with the fused non-finite check (query_input.cuh), the same value LaunchQueriesToFloat
// gives.
__device__ __forceinline__ float QueryValue(const PartArgs& a, int64_t i) {
  if (a.q_raw == nullptr) return a.q[i];
  return ReadQuery(a.q_raw, a.q_bf16, i, a.q_faults,
                   static_cast<int64_t>(a.geo.num_q_heads) * a.geo.head_dim, a.q_fault_bits);
}

// Fills s_q[h] (h < 8) with the group's queries rotated by R_k and scaled (zero rows past
// the group); `raw` is 8 x D floats of shared scratch. Ends with a barrier.
template <int D>
__device__ void LoadQueries(const PartArgs& a, int b, int kvh, int G, float (*s_q)[D],
                            float (*raw)[D]) {
  for (int i = threadIdx.x; i < 8 * D; i += blockDim.x) {
    const int h = i / D;
    raw[h][i % D] =
        h < G
            ? QueryValue(a, (static_cast<int64_t>(b) * a.geo.num_q_heads + kvh * G + h) * D + i % D)
            : 0.0f;
  }
  __syncthreads();
  // Thread j computes column j of every row: 8 independent sums, R read once, coalesced.
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    float acc[8];
#pragma unroll
    for (int h = 0; h < 8; ++h) acc[h] = 0.0f;
    if (a.r_k == nullptr) {
#pragma unroll
      for (int h = 0; h < 8; ++h) acc[h] = raw[h][j];
    } else {
      ColumnTimesRows<D>(a.r_k, j, raw, acc);
    }
#pragma unroll
    for (int h = 0; h < 8; ++h) s_q[h][j] = h < G ? acc[h] * a.scale : 0.0f;
  }
  __syncthreads();
}

// Per row h < rows of s_q: the int8 step (max |x| / 127), its inverse if s_inv is not null,
// and the sum; one warp per row. Ends with a barrier.
template <int D>
__device__ void RowSteps(const float (*s_q)[D], int rows, float* s_step, float* s_inv,
                         float* s_qsum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int h = warp; h < rows; h += blockDim.x / 32) {
    float mx = 0.0f, sum = 0.0f;
    for (int e = lane; e < D; e += 32) {
      mx = fmaxf(mx, fabsf(s_q[h][e]));
      sum += s_q[h][e];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }
    if (lane == 0) {
      s_step[h] = mx > 0.0f ? mx / 127.0f : 1.0f;
      if (s_inv != nullptr) s_inv[h] = mx > 0.0f ? 127.0f / mx : 1.0f;
      s_qsum[h] = sum;
    }
  }
  __syncthreads();
}

// Merges the CTA's warps (state per warp and head: max m, sum l, o accumulated without the
// 1/l, and lacc added to every element) and writes part (part_base + split).
template <int D, int H>
__device__ void WritePart(const PartArgs& a, int split, int b, int kvh, int G,
                          const float (&s_m)[kWarps][8], const float (&s_l)[kWarps][8],
                          const float (&s_lacc)[kWarps][8], const float (&s_o)[kWarps][H][D]) {
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int h = i / D, e = i % D;
    float M = -FLT_MAX;
    for (int w2 = 0; w2 < kWarps; ++w2) M = fmaxf(M, s_m[w2][h]);
    float num = 0.0f, den = 0.0f;
    if (M > -FLT_MAX) {
      for (int w2 = 0; w2 < kWarps; ++w2) {
        if (s_l[w2][h] <= 0.0f) continue;
        const float f = __expf(s_m[w2][h] - M);
        num += f * (s_o[w2][h][e] + s_lacc[w2][h]);
        den += f * s_l[w2][h];
      }
    }
    const int64_t row =
        (static_cast<int64_t>(a.part_base + split) * a.geo.batch + b) * a.geo.num_q_heads +
        kvh * G + h;
    a.part_o[row * D + e] = den > 0.0f ? num / den : 0.0f;
    if (e == 0) a.part_lse[row] = den > 0.0f ? M + __logf(den) : -INFINITY;
  }
}

// After WritePart: where the call folds the merge into its launches, the group's last CTA
// merges it (merge_fold.cuh). `smem`: the CTA's s_o, kWarps x (>= G) x D floats.
template <int D>
__device__ __forceinline__ void FoldAfterPart(const PartArgs& a, int b, int kvh, float* smem) {
  if (a.fold.counters == nullptr) return;
  FoldMerge<D>(a.fold, a.part_o, a.part_lse, a.geo.batch, a.geo.num_q_heads, a.geo.num_kv_heads, b,
               kvh, a.q_raw, a.q_bf16, smem);
}

// ---------------------------------------------------------------------------------------
// Host side.

inline bool SupportedGeometry(const DecodeGeometry& g) {
  const int d = g.head_dim;
  return (d == 64 || d == 128 || d == 256) && g.num_kv_heads > 0 && g.batch > 0 &&
         g.num_q_heads % g.num_kv_heads == 0 && g.num_q_heads / g.num_kv_heads <= 8 &&
         g.page_size > 0;
}

// The launch reads `raw` (if set) instead of its F32 queries.
inline void SetRawQueries(const RawQueries* raw, PartArgs* a) {
  if (raw == nullptr || raw->q == nullptr) return;
  a->q_raw = raw->q;
  a->q_bf16 = raw->bf16;
  a->q_faults = raw->faults;
  a->q_fault_bits = FaultTag(0, raw->fault_layer);
}

// Tokens per split, a multiple of `granule`: kTile for the kernels whose warps take tiles in
// turn, kWarps * 2 * kTile for v2 (a whole number of tile pairs per warp, so with pages of
// 64 tokens each warp starts on a page).
inline int TokensPerSplit(int max_tokens, int splits, int granule) {
  const int per = (max_tokens + splits - 1) / splits;
  return (per + granule - 1) / granule * granule;
}

// The merge kernel for the head_dim (merge_splits.cu), launched plainly or as a programmatic
// dependent of the decode kernel before it.
cudaError_t LaunchMerge(const float* part_o, const float* part_lse, int parts, int rows,
                        int head_dim, const float* r_v_t, float* o, float* lse, cudaStream_t stream,
                        bool dependent, const DeviceFault* faults, int rows_per_entry,
                        const uint32_t* wait_word, uint32_t wait_value);

}  // namespace kvcd::kernels::cuda
