// Decode attention over int2-transform pages (cuda_transform.h), computed on the codes.
//
// Grid (splits, kv heads, batch), 4 warps. A CTA first projects its GQA group's queries
// into the key basis (a_i = sigma_i step_i (D^T q')_i, c_mean = q' . mean, c_off = -sum_i
// a_i (2^b_i - 1) / 2: G d^2 FMAs, the decode matrix read from L2), then each warp walks
// 32-token tiles of the split (a tile lies in one page: page_size % 32 == 0):
//  - keys, one lane per token: the lane's code row is re-aligned from global memory into a
//    shared-memory row of 32-bit words (an odd word stride: conflict-free), then read as a
//    bit stream in direction order. Every lane of the warp is at the same bit position, so
//    the stream's word advances are warp-uniform, and a direction costs a funnel shift, a
//    mask and an exact integer-to-float (the code OR'ed into the mantissa of 2^23) plus one
//    FMA per query head (the direction's word, shift and mask, and a_i, are broadcast
//    loads);
//  - online softmax per query head (one warp max per tile; sums kept per lane);
//  - values, one lane per 4 (head_dim 64/128) or 8 (256) value elements: each 32-bit word of
//    the [P4][Q][4] layout holds 4 elements of 4 tokens; p_t scale_t is broadcast from
//    shared memory and sum_t p_t lo_t is kept apart (added to every element at the end).
// The warps' states are merged in shared memory, the split's output rotated back
// (o R_v^T, R_v^T read coalesced) and written as one part per query head.
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "dispatch.cuh"
#include "dynamic_smem.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_transform.h"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kTile = 32;

struct DecodeArgs {
  PagedList list;
  DecodeGeometry geo;
  TransformPageOffsets lay;
  const TransformHeadCodec* heads;
  const float* q;
  float scale;
  int tokens_per_split;
  float* part_o;
  float* part_lse;
  int part_base;
  int row_words;  // shared-memory stride of a re-aligned code row (odd)
};

// Shared memory of the kernel (in 4-byte words): a_s [D][G] (the output rows x after the
// loop), dirs [D], ws [warps][G][32], c_mean / c_off [G] each, then a union of the code rows
// [warps][32][row_words], the scaled queries [G][D] and the warps' states.
struct Smem {
  int a, dirs, ws, cm, co, u, total;
  __host__ __device__ Smem(int d, int g, int row_words) {
    a = 0;
    dirs = a + d * g;
    ws = dirs + d;
    cm = ws + kWarps * g * kTile;
    co = cm + g;
    u = (co + g + 3) / 4 * 4;  // 16-byte aligned
    const int rows = kWarps * kTile * row_words;
    const int red = kWarps * g * d + 3 * kWarps * g;
    const int union_words =
        rows > red ? (rows > g * d ? rows : g * d) : (red > g * d ? red : g * d);
    total = u + union_words;
  }
};

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// An integer 0 <= c < 2^23 as a float, exactly: c in the mantissa of 2^23, minus 2^23.
__device__ __forceinline__ float CodeToFloat(uint32_t c) {
  return __uint_as_float(c | 0x4b000000u) - 8388608.0f;
}

// G: the query heads the CTA's arrays hold (2, 4 or 8: float4 loads of a_s); K <= G: the
// heads its hot loops compute (the GQA group, e.g. 3 for SmolLM2-135M in arrays of 4).
template <int D, int G, int K>
__global__ void __launch_bounds__(kWarps * 32) TransformDecodeKernel(const DecodeArgs a) {
  static_assert(K >= 1 && K <= G, "K heads in arrays of G");
  constexpr int kQ = D / 4;
  constexpr int kJL = kQ < 32 ? kQ : 32;  // lanes across the value bytes of a word row
  constexpr int kTS = 32 / kJL;           // token groups walked side by side
  constexpr int kQJ = kQ / kJL;           // value words per lane and token group
  constexpr int kE = 4 * kQJ;             // value elements per lane
  extern __shared__ __align__(16) uint32_t smem[];
  const Smem sm(D, G, a.row_words);
  float* a_s = reinterpret_cast<float*>(smem + sm.a);
  uint32_t* dirs = smem + sm.dirs;
  float* ws_all = reinterpret_cast<float*>(smem + sm.ws);
  float* cm_s = reinterpret_cast<float*>(smem + sm.cm);
  float* co_s = reinterpret_cast<float*>(smem + sm.co);
  uint32_t* un = smem + sm.u;

  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int hq = a.geo.num_q_heads;
  const int group = hq / a.geo.num_kv_heads;
  const int ps = a.geo.page_size;
  const TransformHeadCodec& hc = a.heads[h];
  const int len = a.list.lengths[b];
  const int t_begin = split * a.tokens_per_split;
  const int t_end = min(len, t_begin + a.tokens_per_split);

  // The scaled queries (padding heads 0), the direction words.
  float* qs = reinterpret_cast<float*>(un);
  for (int x = tid; x < G * D; x += kWarps * 32) {
    const int g = x / D, e = x % D;
    qs[x] = g < group ? a.q[(int64_t{b} * hq + h * group + g) * D + e] * a.scale : 0.0f;
  }
  for (int i = tid; i < D; i += kWarps * 32) dirs[i] = hc.k_dirs[i];
  __syncthreads();
  // a[i][g] = unit_i sum_j D[j][i] q'_g[j] (the CPU kernel's order: sum over j, then scale).
  for (int i = tid; i < D; i += kWarps * 32) {
    float acc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = 0.0f;
#pragma unroll 16  // 16 independent L2 loads in flight per thread
    for (int j = 0; j < D; ++j) {
      const float dji = __ldg(hc.k_decode + j * D + i);
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = fmaf(qs[g * D + j], dji, acc[g]);
    }
    const float unit = __ldg(hc.k_unit + i);
#pragma unroll
    for (int g = 0; g < G; ++g) a_s[i * G + g] = acc[g] * unit;
  }
  __syncthreads();
  for (int g = warp; g < G; g += kWarps) {
    float sm_ = 0.0f, so = 0.0f;
    for (int j = lane; j < D; j += 32) {
      sm_ = fmaf(qs[g * D + j], __ldg(hc.k_mean + j), sm_);
      so = fmaf(a_s[j * G + g], 0.5f * static_cast<float>((dirs[j] >> 8) & 0xffu), so);
    }
    sm_ = WarpSum(sm_);
    so = WarpSum(so);
    if (lane == 0) {
      cm_s[g] = sm_;
      co_s[g] = -so;
    }
  }
  __syncthreads();  // the queries' space becomes the code rows

  float cm[G], co[G], m[G], l[G], la[G], o[G][kE];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    cm[g] = cm_s[g];
    co[g] = co_s[g];
    m[g] = -INFINITY;
    l[g] = 0.0f;
    la[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kE; ++e) o[g][e] = 0.0f;
  }
  const int cb = a.lay.code_bytes;
  const int words = (cb + 3) / 4;
  const int coded = hc.coded;
  uint32_t* row = un + (warp * kTile + lane) * a.row_words;
  float* ws = ws_all + warp * G * kTile;
  const int jl = lane % kJL, ts = lane / kJL;
  const int32_t* table = a.list.page_table + int64_t{b} * a.list.max_pages;

  for (int t0 = t_begin + warp * kTile; t0 < t_end; t0 += kWarps * kTile) {
    const int slot0 = t0 % ps;  // t0 % 32 == 0 and page_size % 32 == 0: one page
    const uint8_t* page = a.list.pages + int64_t{table[t0 / ps]} * a.list.page_stride;
    const bool valid = t0 + lane < t_end;
    const int slot = slot0 + lane;
    // The lane's code row, re-aligned to words (reads stay inside the page: the gains and
    // values follow the codes).
    const auto* kw =
        reinterpret_cast<const uint32_t*>(page + a.lay.k_codes + h * a.lay.k_codes_head);
    const int byte0 = slot * cb;
    const int w0 = byte0 >> 2, sh = (byte0 & 3) * 8;
    uint32_t prev = kw[w0];
    for (int w = 0; w < words; ++w) {
      const uint32_t nx = kw[w0 + w + 1];
      row[w] = __funnelshift_r(prev, nx, sh);
      prev = nx;
    }
    row[words] = 0u;
    const auto* gp = reinterpret_cast<const __half*>(page + a.lay.k_gains + h * a.lay.k_gains_head);
    const auto* vp =
        reinterpret_cast<const __half*>(page + a.lay.v_params + h * a.lay.v_params_head);
    const float gain = valid ? __half2float(gp[slot]) : 0.0f;
    const float vscale = valid ? __half2float(vp[slot]) : 0.0f;
    const float vlo = valid ? __half2float(vp[ps + slot]) : 0.0f;

    float acc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = 0.0f;
    uint32_t cur = row[0], nxt = row[1];
    int cw = 0;
    for (int i = 0; i < coded; ++i) {
      const uint32_t dw = dirs[i];
      const int w = static_cast<int>(dw >> 16);
      if (w != cw) {  // warp-uniform: every lane is at the same bit position
        cur = nxt;
        nxt = row[w + 1];
        cw = w;
      }
      const float c = CodeToFloat(__funnelshift_r(cur, nxt, dw & 31u) & ((dw >> 8) & 0xffu));
      const float* ai = a_s + i * G;
      if constexpr (G % 4 == 0) {
#pragma unroll
        for (int g = 0; g < G; g += 4) {
          const float4 av = *reinterpret_cast<const float4*>(ai + g);
          if (g < K) acc[g] = fmaf(av.x, c, acc[g]);
          if (g + 1 < K) acc[g + 1] = fmaf(av.y, c, acc[g + 1]);
          if (g + 2 < K) acc[g + 2] = fmaf(av.z, c, acc[g + 2]);
          if (g + 3 < K) acc[g + 3] = fmaf(av.w, c, acc[g + 3]);
        }
      } else {
#pragma unroll
        for (int g = 0; g < K; ++g) acc[g] = fmaf(ai[g], c, acc[g]);
      }
    }
    // Online softmax (natural log); the tile has a valid token (lane 0). Heads K.. keep
    // their empty state (m = -inf, l = 0, o = 0).
#pragma unroll
    for (int g = 0; g < K; ++g) {
      const float logit = valid ? cm[g] + gain * (co[g] + acc[g]) : -INFINITY;
      const float mn = fmaxf(m[g], WarpMax(logit));
      const float alpha = __expf(m[g] - mn);  // 0 while m is -inf
      const float p = valid ? __expf(logit - mn) : 0.0f;
      l[g] = l[g] * alpha + p;
      la[g] = la[g] * alpha + p * vlo;
      ws[g * kTile + lane] = p * vscale;
#pragma unroll
      for (int e = 0; e < kE; ++e) o[g][e] *= alpha;
      m[g] = mn;
    }
    __syncwarp();
    // Values: word (group q4, byte j) of the tile holds element j + mm Q of its 4 tokens.
    const auto* vw =
        reinterpret_cast<const uint32_t*>(page + a.lay.v_codes + h * a.lay.v_codes_head) +
        (slot0 / 4) * kQ;
#pragma unroll 2
    for (int q4 = ts; q4 < kTile / 4; q4 += kTS) {
      uint32_t word[kQJ];
#pragma unroll
      for (int k = 0; k < kQJ; ++k) word[k] = vw[q4 * kQ + jl + kJL * k];
#pragma unroll
      for (int tk = 0; tk < 4; ++tk) {
        float wv[G];
#pragma unroll
        for (int g = 0; g < K; ++g) wv[g] = ws[g * kTile + 4 * q4 + tk];
#pragma unroll
        for (int k = 0; k < kQJ; ++k) {
#pragma unroll
          for (int mm = 0; mm < 4; ++mm) {
            const float c = CodeToFloat((word[k] >> (8 * tk + 2 * mm)) & 3u);
#pragma unroll
            for (int g = 0; g < K; ++g) o[g][4 * k + mm] = fmaf(wv[g], c, o[g][4 * k + mm]);
          }
        }
      }
    }
    __syncwarp();  // ws is rewritten by the next tile
  }

  // The warp's state: sums over lanes (and over the token groups walked side by side).
#pragma unroll
  for (int g = 0; g < G; ++g) {
    l[g] = WarpSum(l[g]);
    la[g] = WarpSum(la[g]);
    if constexpr (kTS == 2) {
#pragma unroll
      for (int e = 0; e < kE; ++e) o[g][e] += __shfl_xor_sync(0xffffffffu, o[g][e], 16);
    }
  }
  __syncthreads();                              // the code rows' space becomes the warps' states
  float* red_o = reinterpret_cast<float*>(un);  // [warps][G][D]
  float* red_s = red_o + kWarps * G * D;        // [warps][G][3]: m, l, la
  if (ts == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int k = 0; k < kQJ; ++k) {
#pragma unroll
        for (int mm = 0; mm < 4; ++mm) {
          red_o[(warp * G + g) * D + jl + kJL * k + mm * kQ] = o[g][4 * k + mm];
        }
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      red_s[(warp * G + g) * 3] = m[g];
      red_s[(warp * G + g) * 3 + 1] = l[g];
      red_s[(warp * G + g) * 3 + 2] = la[g];
    }
  }
  __syncthreads();
  float* xs = a_s;  // [G][D] the split's output in the rotated value space
  const int64_t row0 = (int64_t{a.part_base + split} * a.geo.batch + b) * hq + h * group;
  for (int x = tid; x < G * D; x += kWarps * 32) {
    const int g = x / D, e = x % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_s[(w * G + g) * 3]);
    float L = 0.0f, LA = 0.0f, O = 0.0f;
    if (M > -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = red_s[(w * G + g) * 3];
        const float f = mw > -INFINITY ? __expf(mw - M) : 0.0f;
        L += f * red_s[(w * G + g) * 3 + 1];
        LA += f * red_s[(w * G + g) * 3 + 2];
        O += f * red_o[(w * G + g) * D + e];
      }
    }
    xs[x] = L > 0.0f ? (O + LA) / L : 0.0f;
    if (e == 0 && g < group) a.part_lse[row0 + g] = L > 0.0f ? M + logf(L) : -INFINITY;
  }
  __syncthreads();
  // out_c = sum_e x_e R_v[c][e] = sum_e x_e R_v^T[e][c] (UnrotateTransformOutput).
  for (int x = tid; x < G * D; x += kWarps * 32) {
    const int g = x / D, c = x % D;
    if (g >= group) continue;
    float out = 0.0f;
#pragma unroll 16
    for (int e = 0; e < D; ++e) out = fmaf(xs[g * D + e], __ldg(hc.r_v_t + e * D + c), out);
    a.part_o[(row0 + g) * D + c] = out;
  }
}

int RowWords(int code_bytes) { return ((code_bytes + 3) / 4 + 1) | 1; }

template <int D, int G, int K>
cudaError_t Launch(const DecodeArgs& a, dim3 grid, cudaStream_t stream) {
  const size_t smem = sizeof(uint32_t) * static_cast<size_t>(Smem(D, G, a.row_words).total);
  if (const cudaError_t e = RaiseDynamicSmem<TransformDecodeKernel<D, G, K>>(smem);
      e != cudaSuccess) {
    return e;
  }
  CountLaunch();
  TransformDecodeKernel<D, G, K><<<grid, kWarps * 32, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

int TransformDecodeSplits(int batch, int num_kv_heads, int max_tokens, int num_sms) {
  const int64_t work = int64_t{batch} * num_kv_heads;
  if (work <= 0 || max_tokens <= 0) return 1;
  // One wave of 4 CTAs per SM, at least 4 tiles (one per warp) per split.
  const int64_t wave = (int64_t{num_sms} * 4 + work - 1) / work;
  const int64_t most = (max_tokens + kWarps * kTile - 1) / (kWarps * kTile);
  return static_cast<int>(std::max<int64_t>(1, std::min(wave, most)));
}

Error LaunchTransformDecodeParts(const PagedList& list, const DecodeGeometry& geo,
                                 const TransformPageOffsets& layout,
                                 const TransformHeadCodec* heads, const float* q, float scale,
                                 int splits, int max_tokens, float* part_o, float* part_lse,
                                 int part_base, cudaStream_t stream) {
  KVCD_CUDA_BIND_THREAD();
  if (geo.batch < 1 || geo.num_kv_heads < 1 || geo.num_q_heads % geo.num_kv_heads != 0 ||
      geo.num_q_heads / geo.num_kv_heads > kTransformCudaMaxGroup || geo.page_size % kTile != 0 ||
      geo.page_size < kTile || splits < 1 || max_tokens < 0 || part_base < 0 || heads == nullptr ||
      q == nullptr || part_o == nullptr || part_lse == nullptr || list.pages == nullptr ||
      list.page_table == nullptr || list.lengths == nullptr || layout.head_dim != geo.head_dim ||
      layout.num_kv_heads != geo.num_kv_heads || layout.page_size != geo.page_size ||
      layout.code_bytes < 1 || layout.code_bytes > layout.head_dim || geo.batch > 65535 ||
      geo.num_kv_heads > 65535 || list.page_stride % 4 != 0) {
    return ToError(cudaErrorInvalidValue);
  }
  const int per = (max_tokens + splits - 1) / splits;
  DecodeArgs a{list,
               geo,
               layout,
               heads,
               q,
               scale,
               (per + kTile - 1) / kTile * kTile,
               part_o,
               part_lse,
               part_base,
               RowWords(layout.code_bytes)};
  if (a.tokens_per_split == 0) a.tokens_per_split = kTile;
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(geo.num_kv_heads),
                  static_cast<unsigned>(geo.batch));
  const int group = geo.num_q_heads / geo.num_kv_heads;
  return ToError(DispatchHeadDim(geo.head_dim, [&](auto hd) -> cudaError_t {
    constexpr int kD = decltype(hd)::value;
    if (group <= 2) return Launch<kD, 2, 2>(a, grid, stream);
    if (group == 3) return Launch<kD, 4, 3>(a, grid, stream);  // SmolLM2-135M
    if (group == 4) return Launch<kD, 4, 4>(a, grid, stream);
    return Launch<kD, 8, 8>(a, grid, stream);
  }));
}

}  // namespace kvcd::kernels::cuda
