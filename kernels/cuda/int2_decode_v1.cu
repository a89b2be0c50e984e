// The first OSCAR INT2 decode kernel (int2_decode.cuh): every head_dim; the rotated query
// and the softmax weights enter the int8 MMAs as A (two digits), the codes as one masked plane
// of K or V words (B), and the value products are accumulated in FP32 per 32-token tile.
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "decode_parts.cuh"
#include "dispatch.cuh"
#include "int2_decode.cuh"
#include "kvcd/kernels/call_counts.h"

namespace kvcd::kernels::cuda {
namespace {

__device__ __forceinline__ void Mma(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Pack4(int a, int b, int c, int d) {
  return (static_cast<uint32_t>(a) & 0xffu) | ((static_cast<uint32_t>(b) & 0xffu) << 8) |
         ((static_cast<uint32_t>(c) & 0xffu) << 16) | ((static_cast<uint32_t>(d) & 0xffu) << 24);
}

// LoadQueries, then RowSteps over the 8 rows. Ends with a barrier.
template <int D>
__device__ void PrepareQueries(const PartArgs& a, int b, int kvh, int G, float (*s_q)[D],
                               float (*raw)[D], float* s_step, float* s_qsum) {
  LoadQueries<D>(a, b, kvh, G, s_q, raw);
  RowSteps<D>(s_q, 8, s_step, nullptr, s_qsum);
}

// Where one KV head's rows of one INT2 page-layer live (layout of int2_attention.h: K codes,
// V codes, K params, V params).
struct Int2HeadPtrs {
  const uint32_t* kwords;   // [Q/4 groups][page_size] words
  const uint32_t* vwords;   // [page_size/4 quads][Q] words
  const uint16_t* kparams;  // FP16 [2][page_size]: scales, minimums
  const uint16_t* vparams;
};

__device__ __forceinline__ Int2HeadPtrs HeadPtrs(const PagedList& p, const DecodeGeometry& geo,
                                                 int kvh, int page_id, int q_bytes) {
  const uint8_t* base = p.pages + static_cast<int64_t>(page_id) * p.page_stride;
  const Int2HeadOffsets off = HeadOffsets(geo, geo.page_size, kvh, q_bytes);
  Int2HeadPtrs h;
  h.kwords = reinterpret_cast<const uint32_t*>(base + off.k);
  h.vwords = reinterpret_cast<const uint32_t*>(base + off.v);
  h.kparams = reinterpret_cast<const uint16_t*>(base + off.kp);
  h.vparams = reinterpret_cast<const uint16_t*>(base + off.vp);
  return h;
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32) Int2DecodeKernel(PartArgs a) {
  const PagedList& p = a.list;
  const DecodeGeometry& geo = a.geo;
  const int tokens_per_split = a.tokens_per_split;
  constexpr int Q = D / 4;          // bytes per row
  constexpr int kGroups = Q / 4;    // 4-byte groups per row
  constexpr int kKBlocks = D / 32;  // logit MMAs per 8 tokens
  constexpr int kVTiles = D / 8;    // value MMAs per 32 tokens
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int G = geo.num_q_heads / geo.num_kv_heads;
  const int ps = geo.page_size;
  const int len = p.lengths[b];
  const int t_begin = split * tokens_per_split;
  const int t_end = min(len, t_begin + tokens_per_split);

  __shared__ float s_q[8][D];
  __shared__ float s_step[8], s_qsum[8];
  __shared__ __align__(16) int8_t s_w[kWarps][16][kTile];  // value weight digits
  __shared__ float s_m[kWarps][8], s_l[kWarps][8], s_lacc[kWarps][8];
  __shared__ float s_o[kWarps][8][D];

  // Rotated, scaled queries of this KV head's group (s_o is free scratch until the end);
  // their int8 step and sum.
  PrepareQueries<D>(a, b, kvh, G, s_q, s_o[0], s_step, s_qsum);
  // A fragments of the logit MMAs: k-block kb covers group-planes kb*8 .. kb*8+7, where
  // group-plane gp = plane * kGroups + group holds elements plane*Q + 4*group + 0..3.
  uint32_t qa[kKBlocks][4];
  const float step = s_step[g];
#pragma unroll
  for (int kb = 0; kb < kKBlocks; ++kb) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int gp = kb * 8 + t + 4 * half;
      const int e0 = (gp / kGroups) * Q + 4 * (gp % kGroups);
      int hi[4], lo[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float x = s_q[g][e0 + c];
        hi[c] = Digit(x / step);
        lo[c] = Digit((x - hi[c] * step) * 254.0f / step);
      }
      qa[kb][2 * half] = Pack4(hi[0], hi[1], hi[2], hi[3]);
      qa[kb][2 * half + 1] = Pack4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
  const float qsum = s_qsum[g];

  float m = -FLT_MAX, l = 0.0f, lacc = 0.0f;
  bool any = false;
  float o[kVTiles][2];
#pragma unroll
  for (int i = 0; i < kVTiles; ++i) o[i][0] = o[i][1] = 0.0f;

  for (int tile = t_begin + warp * kTile; tile < t_end; tile += kWarps * kTile) {
    const int page = tile / ps, slot0 = tile % ps;
    const Int2HeadPtrs hp =
        HeadPtrs(p, geo, kvh, p.page_table[static_cast<int64_t>(b) * p.max_pages + page], Q);
    const uint32_t* kwords = hp.kwords;
    const uint32_t* vwords = hp.vwords;
    const __half* kparams = reinterpret_cast<const __half*>(hp.kparams);
    const __half* vparams = reinterpret_cast<const __half*>(hp.vparams);

    // Issue every global load of the tile first (K and V words are independent of the
    // logits), so a tile costs one memory round trip.
    // A lane needs, per token, the K words of the groups t, t+4, ... (kWordsK of them) and,
    // per 4-token quad, the V words j0 + g for the Q/8 column offsets j0: each word feeds
    // the MMAs of all 4 planes.
    constexpr int kWordsK = kGroups / 4 > 0 ? kGroups / 4 : 1;
    constexpr int kWordsV = Q / 8;
    uint32_t kw[4][kWordsK];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int slot = slot0 + nt * 8 + g;  // this lane's B column (token)
#pragma unroll
      for (int i = 0; i < kWordsK; ++i)
        kw[nt][i] = __ldg(kwords + (t + 4 * i) % kGroups * ps + slot);
    }
    const int quad0 = slot0 / 4 + t;
    uint32_t vw[kWordsV][2];
#pragma unroll
    for (int i = 0; i < kWordsV; ++i) {
      vw[i][0] = __ldg(vwords + quad0 * Q + 8 * i + g);
      vw[i][1] = __ldg(vwords + (quad0 + 4) * Q + 8 * i + g);
    }
    // --- logits: 4 MMA column tiles of 8 tokens ---
    float s[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      int c[4] = {0, 0, 0, 0};
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
        const int gp0 = kb * 8 + t, gp1 = gp0 + 4;
        const uint32_t w0 = kw[nt][((gp0 % kGroups) / 4) % kWordsK];
        const uint32_t w1 = kw[nt][((gp1 % kGroups) / 4) % kWordsK];
        Mma(c, qa[kb], (w0 >> (2 * (gp0 / kGroups))) & kPlane,
            (w1 >> (2 * (gp1 / kGroups))) & kPlane);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int ts = slot0 + nt * 8 + 2 * t + j;
        const float dot = c[j] * step + c[2 + j] * (step / 254.0f);
        const float logit = dot * __half2float(kparams[ts]) + __half2float(kparams[ps + ts]) * qsum;
        s[nt][j] = (tile + nt * 8 + 2 * t + j < t_end) ? logit : -FLT_MAX;
      }
    }
    // --- online softmax (per head: the 4 lanes of a lane group) ---
    float mx = m;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) mx = fmaxf(mx, fmaxf(s[nt][0], s[nt][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float alpha = any ? __expf(m - mx) : 0.0f;
    any = true;
    m = mx;
    l *= alpha;
    lacc *= alpha;
#pragma unroll
    for (int i = 0; i < kVTiles; ++i) {
      o[i][0] *= alpha;
      o[i][1] *= alpha;
    }
    float w[4][2], wmax = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // Slots past the sequence hold stale bytes (possibly NaN as FP16): never read them.
        const int ts = slot0 + nt * 8 + 2 * t + j;
        const bool valid = tile + nt * 8 + 2 * t + j < t_end;
        const float pr = valid ? __expf(s[nt][j] - m) : 0.0f;
        l += pr;
        lacc += valid ? pr * __half2float(vparams[ps + ts]) : 0.0f;
        w[nt][j] = valid ? pr * __half2float(vparams[ts]) : 0.0f;
        wmax = fmaxf(wmax, w[nt][j]);
      }
    }
    wmax = fmaxf(wmax, __shfl_xor_sync(0xffffffffu, wmax, 1));
    wmax = fmaxf(wmax, __shfl_xor_sync(0xffffffffu, wmax, 2));
    const float wstep = wmax > 0.0f ? wmax / 127.0f : 1.0f;
    // Weight digits to shared memory [row][token], rows >= G stay zero.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = nt * 8 + 2 * t + j;
        const int hi = g < G ? Digit(w[nt][j] / wstep) : 0;
        const int lo = g < G ? Digit((w[nt][j] - hi * wstep) * 254.0f / wstep) : 0;
        s_w[warp][g][col] = static_cast<int8_t>(hi);
        s_w[warp][g + 8][col] = static_cast<int8_t>(lo);
      }
    }
    __syncwarp();
    uint32_t va[4];
    va[0] = *reinterpret_cast<const uint32_t*>(&s_w[warp][g][4 * t]);
    va[1] = *reinterpret_cast<const uint32_t*>(&s_w[warp][g + 8][4 * t]);
    va[2] = *reinterpret_cast<const uint32_t*>(&s_w[warp][g][4 * t + 16]);
    va[3] = *reinterpret_cast<const uint32_t*>(&s_w[warp][g + 8][4 * t + 16]);
    __syncwarp();
    // --- values: D/8 MMA column tiles of 8 elements; B = one plane of V words ---
#pragma unroll
    for (int vt = 0; vt < kVTiles; ++vt) {
      const int plane = (vt * 8) / Q, i = ((vt * 8) % Q) / 8;
      int c[4] = {0, 0, 0, 0};
      Mma(c, va, (vw[i][0] >> (2 * plane)) & kPlane, (vw[i][1] >> (2 * plane)) & kPlane);
      o[vt][0] += c[0] * wstep + c[2] * (wstep / 254.0f);
      o[vt][1] += c[1] * wstep + c[3] * (wstep / 254.0f);
    }
  }
  // Reduce the per-lane sums over the 4 lanes of each head, then merge the warps.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  lacc += __shfl_xor_sync(0xffffffffu, lacc, 1);
  lacc += __shfl_xor_sync(0xffffffffu, lacc, 2);
  if (t == 0) {
    s_m[warp][g] = any ? m : -FLT_MAX;
    s_l[warp][g] = l;
    s_lacc[warp][g] = lacc;
  }
#pragma unroll
  for (int vt = 0; vt < kVTiles; ++vt) {
    s_o[warp][g][vt * 8 + 2 * t] = o[vt][0];
    s_o[warp][g][vt * 8 + 2 * t + 1] = o[vt][1];
  }
  __syncthreads();
  WritePart<D>(a, split, b, kvh, G, s_m, s_l, s_lacc, s_o);
  FoldAfterPart<D>(a, b, kvh, &s_o[0][0][0]);
}

}  // namespace

cudaError_t LaunchInt2V1(dim3 grid, const PartArgs& a, cudaStream_t stream) {
  CountLaunch();
  return DispatchHeadDim(a.geo.head_dim, [&](auto hd) {
    constexpr int kD = decltype(hd)::value;
    Int2DecodeKernel<kD><<<grid, kWarps * 32, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace kvcd::kernels::cuda
