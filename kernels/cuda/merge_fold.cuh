// The merge folded into the decode launches (MergeTarget::fold_counters in
// cuda_decode_attention.h): every CTA of a split-K decode grid, after writing its part of the
// G rows of one (sequence, KV head) group, counts itself on that group's counter; the CTA that
// brings the count to `parts` (the last of every launch of the call to write a part of the
// group) merges the group's parts into o / lse, as merge_splits.cu's kernel does for one row,
// and sets the counter back to zero for the next call. No merge launch, and no wait for the
// slowest grid of the call before the first group's merge starts.
//
// Visibility: a writer's part stores are fenced (__threadfence) before its count, and the
// last CTA fences again before reading the parts through L2 (ld.global.cg): the pattern of
// the CUDA programming guide's threadfence reduction and of cooperative groups' grid sync.
//
// NaN poison (device_fault.h): merge_splits.cu reads a sequence's fault word after every
// kernel that may set it has finished. Here a query of the sequence read by a CTA of another
// group (a BF16 window CTA on the side stream) may not have been read yet when this group
// merges, so the merging CTA also reads the sequence's raw queries itself: a non-finite one
// poisons as the word would. Row stores and the query conversion set their words before the
// decode launches start (stream order), so the word covers them.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "column_times_rows.cuh"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/device_fault.h"

namespace kvcd::kernels::cuda {

// What a launch carries to fold the merge (a copy of the caller's MergeTarget).
struct FoldArgs {
  unsigned int* counters = nullptr;  // [batch][num_kv_heads], zero between calls; null: no fold
  int parts = 0;                     // parts per row over every launch of the call
  const float* r_v_t = nullptr;
  float* o = nullptr;
  float* lse = nullptr;
  const DeviceFault* faults = nullptr;  // [batch] (rows_per_entry == num_q_heads) or null
};

// Shared floats the merging CTA needs: the weights of every part of the group's rows, the
// rows before R_v^T, and the rows' maxima and denominators.
__host__ __device__ constexpr int FoldSmemFloats(int parts, int group, int head_dim) {
  return group * parts + group * head_dim + 16;
}

__device__ __forceinline__ bool NonFinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// Called by every thread of the CTA that wrote part `split` of group (b, kvh), after its part
// stores. `smem`: at least FoldSmemFloats(parts, G, D) floats of shared memory the CTA no
// longer needs (its own part is written). q_raw: the call's raw queries [batch][num_q_heads]
// [D] (BF16 if q_bf16) when the launches read them in place, else null.
template <int D>
__device__ void FoldMerge(const FoldArgs& f, const float* part_o, const float* part_lse, int batch,
                          int num_q_heads, int num_kv_heads, int b, int kvh, const void* q_raw,
                          bool q_bf16, float* smem) {
  const int tid = threadIdx.x, nthreads = blockDim.x;
  // The grid-barrier pattern (as cooperative groups' grid sync): every thread's part stores
  // fenced, the CTA's barrier, then one thread fences, counts and, if last, fences again
  // before the barrier that lets the CTA read the other CTAs' parts.
  __threadfence();
  __syncthreads();  // every thread's stores and fence, and the end of the CTA's own smem use
  int last = 0;
  if (tid == 0) {
    unsigned int* counter = f.counters + static_cast<int64_t>(b) * num_kv_heads + kvh;
    __threadfence();
    last = atomicAdd(counter, 1u) == static_cast<unsigned int>(f.parts - 1);
    if (last) __threadfence();
  }
  if (__syncthreads_or(last) == 0) return;
  __threadfence();
  const int G = num_q_heads / num_kv_heads, parts = f.parts;
  const int rows = batch * num_q_heads, row0 = b * num_q_heads + kvh * G;
  float* wts = smem;           // [G][parts]: lse, then exp(lse - M)
  float* x = wts + G * parts;  // [G][D]
  float* s_max = x + G * D;    // [8]
  float* s_den = s_max + 8;    // [8]
  // The tail is a chain of L2 round trips (~0.3-0.4 µs each): every phase issues all its
  // loads before it uses one. The parts' lse and the poison check's loads go together.
  for (int i = tid; i < G * parts; i += nthreads) {
    const int h = i / parts, s = i % parts;
    wts[i] = __ldcg(part_lse + static_cast<int64_t>(s) * rows + row0 + h);
  }
  // Poison: the sequence's fault word, or one of its raw queries not finite (16-byte loads:
  // a 32-bit word holds two BF16 or one F32).
  int poison = 0;
  if (f.faults != nullptr) {
    const DeviceFault fault = f.faults[b];
    if (fault.tag != 0) {
      if (tid == 0) {
        poison = FaultMatches(
            *reinterpret_cast<const volatile unsigned long long*>(fault.device_word), fault.tag);
      }
      if (q_raw != nullptr) {
        const int64_t bytes = static_cast<int64_t>(num_q_heads) * D * (q_bf16 ? 2 : 4);
        const uint8_t* base = static_cast<const uint8_t*>(q_raw) + b * bytes;
        auto bad = [&](uint32_t w) {  // the high BF16 (or the F32) and, for BF16, the low one
          return (w & 0x7f800000u) == 0x7f800000u || (q_bf16 && (w & 0x7f80u) == 0x7f80u);
        };
        if (reinterpret_cast<uintptr_t>(base) % 16 == 0 && bytes % 16 == 0) {
          const uint4* v = reinterpret_cast<const uint4*>(base);
#pragma unroll 4
          for (int64_t k = tid; k < bytes / 16; k += nthreads) {
            const uint4 w = __ldcg(v + k);
            poison |= bad(w.x) | bad(w.y) | bad(w.z) | bad(w.w);
          }
        } else {
          const uint32_t* v = reinterpret_cast<const uint32_t*>(base);
#pragma unroll 8
          for (int64_t k = tid; k < bytes / 4; k += nthreads) poison |= bad(__ldcg(v + k));
        }
      }
    }
  }
  poison = __syncthreads_or(poison);
  const int lane = tid & 31, warp = tid >> 5, warps = nthreads >> 5;
  for (int h = warp; h < G; h += warps) {
    float* w = wts + h * parts;
    float mx = -INFINITY;
    for (int s = lane; s < parts; s += 32) mx = fmaxf(mx, w[s]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float den = 0.0f;
    for (int s = lane; s < parts; s += 32) {
      const float ls = w[s];
      const float e = (mx > -INFINITY && ls > -INFINITY) ? __expf(ls - mx) : 0.0f;
      w[s] = e;
      den += e;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffffu, den, off);
    if (lane == 0) {
      s_max[h] = mx;
      s_den[h] = den;
    }
  }
  __syncthreads();
  // x[h][4c..4c+3] = sum_s w[h][s] part_o[s][row0 + h][4c..] / den[h]: one float4 column of
  // one row per thread (G x D / 4 of them: 128 at Qwen3-8B's G 4, d 128), sixteen parts'
  // loads in flight.
  for (int o = tid; o < G * (D / 4); o += nthreads) {
    const int h = o / (D / 4), c = o % (D / 4);
    const float* w = wts + h * parts;
    const float4* p =
        reinterpret_cast<const float4*>(part_o + static_cast<int64_t>(row0 + h) * D) + c;
    const int64_t stride = static_cast<int64_t>(rows) * (D / 4);  // one part, in float4
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
    for (int s = 0; s < parts; ++s) {
      const float4 v = __ldcg(p + s * stride);
      const float ws = w[s];
      acc.x = fmaf(ws, v.x, acc.x);
      acc.y = fmaf(ws, v.y, acc.y);
      acc.z = fmaf(ws, v.z, acc.z);
      acc.w = fmaf(ws, v.w, acc.w);
    }
    const float den = s_den[h];
    float* xo = x + h * D + 4 * c;
    xo[0] = den > 0.0f ? acc.x / den : 0.0f;
    xo[1] = den > 0.0f ? acc.y / den : 0.0f;
    xo[2] = den > 0.0f ? acc.z / den : 0.0f;
    xo[3] = den > 0.0f ? acc.w / den : 0.0f;
  }
  __syncthreads();
  // o = x R_v^T, column j of every row per thread, R_v^T read once, 32 loads in flight.
  for (int j = tid; j < D; j += nthreads) {
    float out[8];
    if (f.r_v_t == nullptr) {
#pragma unroll
      for (int h = 0; h < 8; ++h) out[h] = h < G ? x[h * D + j] : 0.0f;
    } else {
#pragma unroll
      for (int h = 0; h < 8; ++h) out[h] = 0.0f;
      ColumnTimesRows<D>(f.r_v_t, j, reinterpret_cast<const float(*)[D]>(x), out, G);
    }
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      if (h < G) f.o[static_cast<int64_t>(row0 + h) * D + j] = poison ? NAN : out[h];
    }
  }
  if (tid < G) {
    const float den = s_den[tid];
    f.lse[row0 + tid] = poison ? NAN : den > 0.0f ? s_max[tid] + logf(den) : -INFINITY;
  }
  // Zero for the next call: every CTA of this call has counted (it is the last).
  if (tid == 0) f.counters[static_cast<int64_t>(b) * num_kv_heads + kvh] = 0u;
}

// A launch writing parts [part_base, part_base + splits) of the call's rows takes its share of
// the folded merge of `m` (MergeTarget::fold_counters): false when the target does not allow
// the fold (no counters or outputs, too many parts, parts past `parts`, faults per entry other
// than per sequence).
inline bool SetFold(const MergeTarget& m, const DecodeGeometry& g, int part_base, int splits,
                    FoldArgs* f) {
  if (m.fold_counters == nullptr || m.o == nullptr || m.lse == nullptr || m.parts <= 0 ||
      m.parts > MaxFoldedMergeParts(g.head_dim) || part_base < 0 || part_base + splits > m.parts ||
      (m.faults != nullptr && m.rows_per_entry != g.num_q_heads)) {
    return false;
  }
  *f = FoldArgs{m.fold_counters, m.parts, m.r_v_t, m.o, m.lse, m.faults};
  return true;
}

}  // namespace kvcd::kernels::cuda
