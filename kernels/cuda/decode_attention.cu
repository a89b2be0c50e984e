// OSCAR INT2 decode attention on int8 tensor cores (see cuda_int2_attention.h).
//
// mma.sync.m16n8k32 fragments (g = lane / 4, t = lane % 4):
//   A (16 x 32, row): a0 = (row g, k 4t..4t+3), a1 = (row g+8, same k), a2 = (row g,
//                     k 4t+16..), a3 = (row g+8, k 4t+16..)
//   B (32 x 8, col):  b0 = (k 4t..4t+3, col g), b1 = (k 4t+16.., col g)
//   C (16 x 8):       c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, same cols)
// Rows are (head, digit): head h < 8 with its high digit in row h and its low digit in
// row h + 8, so one lane holds both digits of one head for the same columns.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "kvcd/kernels/cuda_decode_attention.h"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kTile = 32;  // tokens per warp step
constexpr uint32_t kPlane = 0x03030303u;

__device__ __forceinline__ void Mma(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int Digit(float x) { return max(-127, min(127, __float2int_rn(x))); }

__device__ __forceinline__ uint32_t Pack4(int a, int b, int c, int d) {
  return (static_cast<uint32_t>(a) & 0xffu) | ((static_cast<uint32_t>(b) & 0xffu) << 8) |
         ((static_cast<uint32_t>(c) & 0xffu) << 16) | ((static_cast<uint32_t>(d) & 0xffu) << 24);
}

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
};

// q_rot[b][h] = (q[b][h] . R_k) * scale; one block per (b, h), head_dim threads. The
// loop over i is unrolled so the loads of R (coalesced across j, from L2) overlap.
__global__ void RotateQueries(const float* q, const float* r_k, float scale, int head_dim,
                              float* q_rot) {
  extern __shared__ float x[];
  const int64_t row = blockIdx.x;
  const int j = threadIdx.x;
  x[j] = q[row * head_dim + j];
  __syncthreads();
  float acc = 0.0f;
  if (r_k == nullptr) {
    acc = x[j];
  } else {
#pragma unroll 16
    for (int i = 0; i < head_dim; ++i) acc += x[i] * __ldg(r_k + i * head_dim + j);
  }
  q_rot[row * head_dim + j] = acc * scale;
}

// Fills s_q[h] (h < 8) with the group's queries rotated by R_k and scaled (zero rows past
// the group); `raw` is 8 x D floats of shared scratch. Ends with a barrier.
template <int D>
__device__ void LoadQueries(const PartArgs& a, int b, int kvh, int G, float (*s_q)[D],
                            float (*raw)[D]) {
  for (int i = threadIdx.x; i < 8 * D; i += blockDim.x) {
    const int h = i / D;
    raw[h][i % D] =
        h < G ? a.q[(static_cast<int64_t>(b) * a.geo.num_q_heads + kvh * G + h) * D + i % D] : 0.0f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 8 * D; i += blockDim.x) {
    const int h = i / D, j = i % D;
    float acc = 0.0f;
    if (h < G) {
      if (a.r_k == nullptr) {
        acc = raw[h][j];
      } else {
#pragma unroll 8
        for (int k = 0; k < D; ++k) acc += raw[h][k] * __ldg(a.r_k + k * D + j);
      }
    }
    s_q[h][j] = acc * a.scale;
  }
  __syncthreads();
}

// Merges the CTA's warps (state per warp and head: max m, sum l, o accumulated without the
// 1/l, and lacc added to every element) and writes part (part_base + split).
template <int D>
__device__ void WritePart(const PartArgs& a, int split, int b, int kvh, int G,
                          const float (&s_m)[kWarps][8], const float (&s_l)[kWarps][8],
                          const float (&s_lacc)[kWarps][8], const float (&s_o)[kWarps][8][D]) {
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
  LoadQueries<D>(a, b, kvh, G, s_q, s_o[0]);
  if (threadIdx.x < 8) {
    float mx = 0.0f, sum = 0.0f;
    for (int e = 0; e < D; ++e) {
      mx = fmaxf(mx, fabsf(s_q[threadIdx.x][e]));
      sum += s_q[threadIdx.x][e];
    }
    s_step[threadIdx.x] = mx > 0.0f ? mx / 127.0f : 1.0f;
    s_qsum[threadIdx.x] = sum;
  }
  __syncthreads();
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
    const uint8_t* base =
        p.pages + static_cast<int64_t>(p.page_table[static_cast<int64_t>(b) * p.max_pages + page]) *
                      p.page_stride;
    // Page layout (int2_attention.h): K codes, V codes, K params, V params.
    const int64_t code_bytes = static_cast<int64_t>(geo.num_kv_heads) * ps * Q;
    const uint32_t* kwords =
        reinterpret_cast<const uint32_t*>(base + static_cast<int64_t>(kvh) * ps * Q);
    const uint32_t* vwords =
        reinterpret_cast<const uint32_t*>(base + code_bytes + static_cast<int64_t>(kvh) * ps * Q);
    const __half* kparams =
        reinterpret_cast<const __half*>(base + 2 * code_bytes) + static_cast<int64_t>(kvh) * 2 * ps;
    const __half* vparams = kparams + static_cast<int64_t>(geo.num_kv_heads) * 2 * ps;

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
}

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
}

// Merges the parts of each (b, head) row and applies R_v^T; one block per row of
// kMergeLanes * head_dim threads: the split weights exp(lse_s - M) are computed once in
// shared memory, each of the kMergeLanes thread groups sums every kMergeLanes-th part.
constexpr int kMergeLanes = 4;

__global__ void MergeSplits(const float* part_o, const float* part_lse, int splits, int rows,
                            int head_dim, const float* r_v_t, float* o, float* lse) {
  extern __shared__ float smem[];  // x [head_dim], partial sums [kMergeLanes][head_dim], wts
  float* x = smem;
  float* partial = x + head_dim;
  float* wts = partial + kMergeLanes * head_dim;
  __shared__ float s_max[32], s_den[32];
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = (blockDim.x + 31) / 32;
  float mx = -INFINITY;
  for (int s = tid; s < splits; s += blockDim.x) {
    mx = fmaxf(mx, part_lse[static_cast<int64_t>(s) * rows + row]);
  }
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) s_max[warp] = mx;
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < warps; ++w) M = fmaxf(M, s_max[w]);
  float den = 0.0f;
  for (int s = tid; s < splits; s += blockDim.x) {
    const float ls = part_lse[static_cast<int64_t>(s) * rows + row];
    const float f = (M > -INFINITY && ls > -INFINITY) ? __expf(ls - M) : 0.0f;
    wts[s] = f;
    den += f;
  }
  for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffffu, den, off);
  if (lane == 0) s_den[warp] = den;
  __syncthreads();
  den = 0.0f;
  for (int w = 0; w < warps; ++w) den += s_den[w];
  const int group = tid / head_dim, j = tid % head_dim;
  float num = 0.0f;
#pragma unroll 4
  for (int s = group; s < splits; s += kMergeLanes) {
    num += wts[s] * part_o[(static_cast<int64_t>(s) * rows + row) * head_dim + j];
  }
  partial[group * head_dim + j] = num;
  __syncthreads();
  if (group == 0) {
    float total = 0.0f;
    for (int g = 0; g < kMergeLanes; ++g) total += partial[g * head_dim + j];
    x[j] = den > 0.0f ? total / den : 0.0f;
  }
  __syncthreads();
  if (group != 0) return;
  float acc = x[j];
  if (r_v_t != nullptr) {
    acc = 0.0f;
#pragma unroll 16
    for (int i = 0; i < head_dim; ++i) acc += x[i] * __ldg(r_v_t + i * head_dim + j);
  }
  o[static_cast<int64_t>(row) * head_dim + j] = acc;
  if (j == 0) lse[row] = den > 0.0f ? M + logf(den) : -INFINITY;
}

}  // namespace

size_t Int2DecodeWorkspaceBytes(int batch, int num_q_heads, int head_dim, int max_splits) {
  const size_t rows = static_cast<size_t>(batch) * num_q_heads;
  return sizeof(float) *
         (rows * head_dim + static_cast<size_t>(max_splits) * rows * (head_dim + 1));
}

int Int2DecodeSplits(int batch, int num_kv_heads, int max_tokens, int num_sms, int ctas_per_sm) {
  const int ctas = batch * num_kv_heads;
  int splits = (ctas_per_sm * num_sms + ctas - 1) / ctas;
  const int max_by_tokens = (max_tokens + kWarps * kTile - 1) / (kWarps * kTile);
  splits = splits < max_by_tokens ? splits : max_by_tokens;
  return splits < 1 ? 1 : splits;
}

namespace {

bool SupportedGeometry(const DecodeGeometry& g) {
  const int d = g.head_dim;
  return (d == 64 || d == 128 || d == 256) && g.num_kv_heads > 0 && g.batch > 0 &&
         g.num_q_heads % g.num_kv_heads == 0 && g.num_q_heads / g.num_kv_heads <= 8 &&
         g.page_size > 0;
}

int TokensPerSplit(int max_tokens, int splits) {
  const int per = (max_tokens + splits - 1) / splits;
  return (per + kTile - 1) / kTile * kTile;
}

}  // namespace

cudaError_t LaunchRotateQueries(const float* q, const float* r_k, float scale, int rows,
                                int head_dim, float* q_rot, cudaStream_t stream) {
  RotateQueries<<<rows, head_dim, head_dim * sizeof(float), stream>>>(q, r_k, scale, head_dim,
                                                                      q_rot);
  return cudaGetLastError();
}

cudaError_t LaunchInt2DecodeParts(const PagedList& list, const DecodeGeometry& geo, const float* q,
                                  const float* r_k, float scale, int splits, int max_tokens,
                                  float* part_o, float* part_lse, int part_base,
                                  cudaStream_t stream) {
  if (!SupportedGeometry(geo) || geo.page_size % kTile != 0 || splits <= 0) {
    return cudaErrorInvalidValue;
  }
  const PartArgs a{list,   geo,      q,        r_k, scale, TokensPerSplit(max_tokens, splits),
                   part_o, part_lse, part_base};
  const dim3 grid(splits, geo.num_kv_heads, geo.batch);
  switch (geo.head_dim) {  // one instantiation per head_dim
    case 64:
      Int2DecodeKernel<64><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
    case 128:
      Int2DecodeKernel<128><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
    default:
      Int2DecodeKernel<256><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchBf16DecodeParts(const PagedList& list, const DecodeGeometry& geo, const float* q,
                                  const float* r_k, float scale, int splits, int max_tokens,
                                  float* part_o, float* part_lse, int part_base,
                                  cudaStream_t stream) {
  if (!SupportedGeometry(geo) || splits <= 0) return cudaErrorInvalidValue;
  const PartArgs a{list,   geo,      q,        r_k, scale, TokensPerSplit(max_tokens, splits),
                   part_o, part_lse, part_base};
  const dim3 grid(splits, geo.num_kv_heads, geo.batch);
  switch (geo.head_dim) {
    case 64:
      Bf16DecodeKernel<64><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
    case 128:
      Bf16DecodeKernel<128><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
    default:
      Bf16DecodeKernel<256><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchMergeParts(const float* part_o, const float* part_lse, int parts, int rows,
                             int head_dim, const float* r_v_t, float* o, float* lse,
                             cudaStream_t stream) {
  MergeSplits<<<rows, kMergeLanes * head_dim,
                (head_dim * (1 + kMergeLanes) + parts) * sizeof(float), stream>>>(
      part_o, part_lse, parts, rows, head_dim, r_v_t, o, lse);
  return cudaGetLastError();
}

cudaError_t LaunchInt2Decode(const Int2DecodeParams& p, int max_tokens, cudaStream_t stream) {
  const DecodeGeometry geo{p.batch, p.num_q_heads, p.num_kv_heads, p.head_dim, p.page_size};
  if (!SupportedGeometry(geo) || p.page_size % kTile != 0 || p.num_splits <= 0) {
    return cudaErrorInvalidValue;
  }
  const int rows = p.batch * p.num_q_heads;
  float* part_o = static_cast<float*>(p.workspace);
  float* part_lse = part_o + static_cast<size_t>(p.num_splits) * rows * p.head_dim;
  const PagedList list{p.pages, p.page_stride, p.page_table, p.max_pages, p.lengths};
  const cudaError_t e = LaunchInt2DecodeParts(list, geo, p.q, p.r_k, p.softmax_scale, p.num_splits,
                                              max_tokens, part_o, part_lse, 0, stream);
  if (e != cudaSuccess) return e;
  return LaunchMergeParts(part_o, part_lse, p.num_splits, rows, p.head_dim, p.r_v_t, p.o, p.lse,
                          stream);
}

}  // namespace kvcd::kernels::cuda
