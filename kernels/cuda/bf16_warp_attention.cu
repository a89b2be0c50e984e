// The first BF16 decode kernel (LaunchBf16DecodeParts), kept for comparison with the split
// kernel of bf16_split_attention.cu: CUDA cores, one warp per token.
#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>

#include "cuda_error.cuh"
#include "decode_parts.cuh"
#include "device_binding.cuh"
#include "dispatch.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_decode_attention.h"

namespace kvcd::kernels::cuda {
namespace {

// BF16 pages on CUDA cores: each warp takes tokens in turn; a lane holds D/32 elements of
// the K and V rows, a logit is a warp reduction. Meant for the short sink/recent windows
// (and BF16-history models), not tuned for long contexts.
template <int D>
__global__ void __launch_bounds__(kWarps * 32) Bf16DecodeKernel(PartArgs a) {
  constexpr int E = D / 32;  // elements per lane
  const PagedList& p = a.list;
  const DecodeGeometry& geo = a.geo;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int G = geo.num_q_heads / geo.num_kv_heads;
  const int ps = geo.page_size, hkv = geo.num_kv_heads;
  const int len = p.lengths[b];
  const int t_begin = split * a.tokens_per_split;
  const int t_end = min(len, t_begin + a.tokens_per_split);
  __shared__ float s_m[kWarps][8], s_l[kWarps][8], s_lacc[kWarps][8];
  __shared__ float s_o[kWarps][8][D];
  __shared__ float s_q[8][D];
  LoadQueries<D>(a, b, kvh, G, s_q, s_o[0]);
  __syncthreads();  // s_o is reused below only after every warp read its queries
  float q[8][E];
#pragma unroll
  for (int h = 0; h < 8; ++h)
#pragma unroll
    for (int e = 0; e < E; ++e) q[h][e] = s_q[h][lane * E + e];
  float m[8], l[8], o[8][E];
#pragma unroll
  for (int h = 0; h < 8; ++h) {
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[h][e] = 0.0f;
  }
  for (int tok = t_begin + warp; tok < t_end; tok += kWarps) {
    const __nv_bfloat16* page = reinterpret_cast<const __nv_bfloat16*>(
        p.pages +
        static_cast<int64_t>(p.page_table[static_cast<int64_t>(b) * p.max_pages + tok / ps]) *
            p.page_stride);
    const int64_t off = (static_cast<int64_t>(kvh) * ps + tok % ps) * D + lane * E;
    float k[E], v[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      k[e] = __bfloat162float(page[off + e]);
      v[e] = __bfloat162float(page[static_cast<int64_t>(hkv) * ps * D + off + e]);
    }
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      if (h >= G) break;
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) dot += q[h][e] * k[e];
#pragma unroll
      for (int off2 = 16; off2 > 0; off2 >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off2);
      const float mx = fmaxf(m[h], dot);
      const float alpha = __expf(m[h] - mx), pr = __expf(dot - mx);
      l[h] = l[h] * alpha + pr;
#pragma unroll
      for (int e = 0; e < E; ++e) o[h][e] = o[h][e] * alpha + pr * v[e];
      m[h] = mx;
    }
  }
#pragma unroll
  for (int h = 0; h < 8; ++h) {
    if (lane == 0) {
      s_m[warp][h] = l[h] > 0.0f ? m[h] : -FLT_MAX;
      s_l[warp][h] = l[h];
      s_lacc[warp][h] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) s_o[warp][h][lane * E + e] = o[h][e];
  }
  __syncthreads();
  WritePart<D>(a, split, b, kvh, G, s_m, s_l, s_lacc, s_o);
  FoldAfterPart<D>(a, b, kvh, &s_o[0][0][0]);
}

}  // namespace

Error LaunchBf16DecodeParts(const PagedList& list, const DecodeGeometry& geo, const float* q,
                            const float* r_k, float scale, int splits, int max_tokens,
                            float* part_o, float* part_lse, int part_base, cudaStream_t stream,
                            const RawQueries* raw, const MergeTarget* fold) {
  KVCD_CUDA_BIND_THREAD();
  if (!SupportedGeometry(geo) || splits <= 0) return ToError(cudaErrorInvalidValue);
  PartArgs a{list,   geo,      q,        r_k, scale, TokensPerSplit(max_tokens, splits, kTile),
             part_o, part_lse, part_base};
  SetRawQueries(raw, &a);
  if (fold != nullptr && !SetFold(*fold, geo, part_base, splits, &a.fold)) {
    return ToError(cudaErrorInvalidValue);
  }
  const dim3 grid(splits, geo.num_kv_heads, geo.batch);
  CountLaunch();
  return ToError(DispatchHeadDim(geo.head_dim, [&](auto hd) {
    constexpr int kD = decltype(hd)::value;
    Bf16DecodeKernel<kD><<<grid, kWarps * 32, 0, stream>>>(a);
    return cudaGetLastError();
  }));
}

}  // namespace kvcd::kernels::cuda
