// Decode attention over int2-transform pages on int8 tensor cores (cuda_transform.h,
// TransformKernel::kTensorCore). Same pages, same parts as the FP32 kernel
// (transform_decode_attention.cu); the arithmetic is INT2 v2's (int2_decode_v2.cu,
// int2_decode.cuh).
//
// The key code as bits. A row's code is a bit stream of nb = 8 code_bytes bits in which
// direction i holds b_i bits at pos_i (LSB first), so the dot product the logit needs,
// sum_i a_i c_i, is linear in the row's BITS: sum_p w_p bit_p with w_p = a_i 2^(p - pos_i)
// for the direction i holding bit p (0 past the coded bits). The variable widths then never
// reach the inner loop: word kb of a row (bits 32kb..32kb+31) is one k-block of the logit
// MMA, and a lane's A registers are two masks of it (byte c of (word >> t) & 0x01010101 is
// bit 8c + t), whatever the widths.
//
// TransformQueryFragments (one CTA of 4 * D threads per (KV head, sequence), once per call):
// projects the group's scaled queries into the key basis (a_i = unit_i (D^T q')_i, the
// decode matrix read once), c_mean = q' . mean, c_off = -sum_i a_i (2^b_i - 1) / 2, spreads
// a over the bit weights w_p and splits them into three int8 digits per head (step =
// max |w| / 127, w = step (hi + mid / 254 + lo / 254^2)), written in the B-fragment lane
// order with the per-head logit unit and constants (log2 units). Why three: a wide
// direction's top bit weighs 2^(b-1) a_i, so
// with two digits (INT2's scheme) every bit's weight carried an error of up to
// max |w| / 64,516, which summed over a row's bits put the logits ~7e-4 off (the H200 run of
// 2026-12-05: 5-11e-4 against the 5e-4 bound); the third digit brings that under float
// rounding. The hi / mid digits of 4 heads fill an n-tile as INT2's two digits do; the lo
// digits of heads t and 4 + t share one more n-tile (columns 2t, 2t + 1), so a logit MMA
// covers NT + 1 n-tiles.
//
// TransformDecodeKernelTc: grid (splits, kv heads, batch), 4 warps; each warp walks a
// contiguous quarter of its split, 32-token tiles, one tile ahead in registers. Per tile
// (mma.sync.m16n8k32 fragments as in int2_decode_v2.cu, lane = 4g + t, the lane's tokens
// 4g..4g+3):
//  - keys: the tile's code rows (32 cb bytes, contiguous and 32-byte aligned in the page)
//    are loaded coalesced, put in the warp's shared-memory buffer, and each lane reads the
//    words of its 4 rows re-aligned (a funnel shift); word kb gives the A registers of
//    k-block kb: u8 bits x s8 query digits -> s32, logit = c_mean + g (c_off + unit dot);
//  - values, softmax: INT2 v2's integer path unchanged (the value layout is INT2's: V^T
//    codes as A, the weights p s_v as two uint8 digits as B, int32 sums flushed to FP32 on a
//    lazy rescale).
// The warps' states merge in shared memory; the split's output is rotated back (x R_v^T:
// butterflies when R_v = c H, else the dense product, R_v^T read from L2 16 loads deep) and
// written as one part per head.
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "dispatch.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_transform.h"
#include "merge_fold.cuh"
#include "programmatic_launch.cuh"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kTile = 32;
constexpr uint32_t kBits = 0x01010101u;
constexpr uint32_t kPlane = 0x03030303u;

// k-blocks of a code row the kernel holds registers for: rows of up to 3 bits per direction
// on average (INT2's 2 bits plus the transform's extra; 2.25 in the shipped profiles).
__host__ __device__ constexpr int MaxKb(int d) { return 3 * d / 32; }
// Per (sequence, KV head): KB x (NT + 1) x 2 registers x 32 lanes of B fragments (sized for
// the largest: head_dim 128, two n-tiles of hi / mid digits and one of lo digits), then
// unit[8], c_mean[8], c_off[8] (log2 units).
constexpr int kFragStride = MaxKb(128) * 3 * 2 * 32;
constexpr float kDigit2 = 254.0f * 254.0f;
constexpr int kScalStride = 24;

__host__ __device__ constexpr int TcHeadTiles(int group) { return group > 4 ? 2 : 1; }
__host__ __device__ constexpr int CtasPerSm(int head_tiles) { return head_tiles == 1 ? 4 : 3; }

struct TcArgs {
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
  int kb;  // k-blocks of a row: ceil(code_bytes / 4)
  uint32_t* frags;
  float* scal;
  FoldArgs fold;  // set: the merge folded into the launch (merge_fold.cuh)
};

// TODO(merge): shared with int2 v2 (int2_decode.cuh, int2_decode_v2.cu): the MMAs, the digit
// helpers, the lazy-rescale constants, the programmatic-launch controls.
__device__ __forceinline__ void MmaU8S8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void MmaU8U8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ int Digit(float x) { return max(-127, min(127, __float2int_rn(x))); }
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <int B>
__device__ __forceinline__ uint32_t PackBytes(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3) {
  constexpr uint32_t sel = (4 + B) << 4 | B;
  return __byte_perm(__byte_perm(x0, x1, sel), __byte_perm(x2, x3, sel), 0x5410);
}
__device__ __forceinline__ void HalvesToFloat(uint2 h, float (&f)[4]) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&h.x));
  const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&h.y));
  f[0] = a.x;
  f[1] = a.y;
  f[2] = c.x;
  f[3] = c.y;
}
constexpr float kLazyLog2 = 0.25f;
constexpr int kFlushTiles = 512;            // 512 * 32 tokens * 255 * 192 < 2^31
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: low byte = round(x) for |x| < 2^22
// Element of V^T m-tile vt, row r (0: row g, 1: row g + 8) for lane group g.
template <int D>
__device__ __forceinline__ int ValueElement(int vt, int r, int g) {
  constexpr int Q = D / 4, U = Q / 8, per_plane = U / 2;
  return (vt / per_plane) * Q + g * U + 2 * (vt % per_plane) + r;
}
// (end of the int2 v2 copies)

constexpr float kLog2e = 1.4426950408889634f;

template <int D, int NT>
__global__ void __launch_bounds__(4 * D) TransformQueryFragments(TcArgs a) {
  LaunchDependents();
  constexpr int R = 4 * NT, kPer = D / 4, kNb = 8 * D;
  const int kvh = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int hq = a.geo.num_q_heads, G = hq / a.geo.num_kv_heads;
  const TransformHeadCodec& hc = a.heads[kvh];
  __shared__ float s_q[R][D], s_part[4][R][D], s_a[R][D];
  __shared__ uint32_t s_bit[kNb];  // bit p: direction << 8 | shift (weight 2^shift), ~0: none
  __shared__ float s_step[R], s_inv[R];
  const int part = tid / D, i = tid % D;
  float r[kPer];  // D[j][i] for this thread's quarter of j (one memory round trip)
#pragma unroll
  for (int u = 0; u < kPer; ++u) r[u] = __ldg(hc.k_decode + (part * kPer + u) * D + i);
  for (int x = tid; x < R * D; x += blockDim.x) {
    const int h = x / D, e = x % D;
    s_q[h][e] = h < G ? a.q[(static_cast<int64_t>(b) * hq + kvh * G + h) * D + e] * a.scale : 0.0f;
  }
  for (int p = tid; p < kNb; p += blockDim.x) s_bit[p] = 0xffffffffu;
  __syncthreads();
  if (tid < hc.coded) {
    const uint32_t dw = hc.k_dirs[tid];
    const int pos = static_cast<int>(dw >> 16) * 32 + static_cast<int>(dw & 31u);
    const int bits = __popc((dw >> 8) & 0xffu);
    for (int k = 0; k < bits; ++k) s_bit[pos + k] = static_cast<uint32_t>(tid) << 8 | k;
  }
  {
    float acc[R];
#pragma unroll
    for (int h = 0; h < R; ++h) acc[h] = 0.0f;
#pragma unroll
    for (int u = 0; u < kPer; ++u)
#pragma unroll
      for (int h = 0; h < R; ++h) acc[h] = fmaf(s_q[h][part * kPer + u], r[u], acc[h]);
#pragma unroll
    for (int h = 0; h < R; ++h) s_part[part][h][i] = acc[h];
  }
  __syncthreads();
  for (int x = tid; x < R * D; x += blockDim.x) {
    const int h = x / D, e = x % D;
    s_a[h][e] = ((s_part[0][h][e] + s_part[1][h][e]) + (s_part[2][h][e] + s_part[3][h][e])) *
                __ldg(hc.k_unit + e);
  }
  __syncthreads();
  // Per head (one warp each): c_mean, c_off and the largest bit weight max_i |a_i| 2^(b_i-1).
  const int frag = b * a.geo.num_kv_heads + kvh;
  for (int h = warp; h < R; h += blockDim.x / 32) {
    float cm = 0.0f, co = 0.0f, mx = 0.0f;
    for (int e = lane; e < D; e += 32) {
      const float mask = static_cast<float>((hc.k_dirs[e] >> 8) & 0xffu);
      cm = fmaf(s_q[h][e], __ldg(hc.k_mean + e), cm);
      co = fmaf(s_a[h][e], 0.5f * mask, co);
      mx = fmaxf(mx, fabsf(s_a[h][e]) * (0.5f * (mask + 1.0f)));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      cm += __shfl_xor_sync(0xffffffffu, cm, off);
      co += __shfl_xor_sync(0xffffffffu, co, off);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    if (lane == 0) {
      const float step = mx > 0.0f ? mx / 127.0f : 1.0f;
      s_step[h] = step;
      s_inv[h] = mx > 0.0f ? 127.0f / mx : 1.0f;
      a.scal[frag * kScalStride + h] = step / kDigit2 * kLog2e;
      a.scal[frag * kScalStride + 8 + h] = cm * kLog2e;
      a.scal[frag * kScalStride + 16 + h] = -co * kLog2e;
    }
  }
  __syncthreads();
  // B fragments: k-block kb, n-tile nt, register half, lane (g, t): bytes c = 0..3 hold, for
  // the weight of bit 32 kb + t + 4 half + 8 c, digit hi (g even) or mid (g odd) of head
  // 4 nt + g / 2 (nt < NT), or digit lo of head g / 2 (g even) or 4 + g / 2 (g odd) (nt NT;
  // 0 for a head past the tiles).
  uint32_t* out = a.frags + static_cast<int64_t>(frag) * kFragStride;
  for (int x = tid; x < a.kb * (NT + 1) * 64; x += blockDim.x) {
    const int ln = x % 32, half = (x / 32) % 2, nt = (x / 64) % (NT + 1), kb = x / (64 * (NT + 1));
    const int g = ln >> 2, t = ln & 3;
    const bool lo_tile = nt == NT;
    const int h = lo_tile ? (g >> 1) + 4 * (g & 1) : 4 * nt + (g >> 1);
    uint32_t d[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      int digit = 0;
      if (h < R) {
        const float step = s_step[h], inv = s_inv[h];
        const uint32_t bit = s_bit[32 * kb + t + 4 * half + 8 * c];
        const float w =
            bit == 0xffffffffu ? 0.0f : s_a[h][bit >> 8] * static_cast<float>(1u << (bit & 0xffu));
        const int hi = Digit(w * inv);
        const float r1 = fmaf(-static_cast<float>(hi), step, w);
        const int mid = Digit(r1 * (254.0f * inv));
        const float r2 = fmaf(-static_cast<float>(mid), step * (1.0f / 254.0f), r1);
        const int lo = Digit(r2 * (kDigit2 * inv));
        digit = lo_tile ? lo : (g & 1) != 0 ? mid : hi;
      }
      d[c] = static_cast<uint32_t>(digit);
    }
    out[x] = PackBytes<0>(d[0], d[1], d[2], d[3]);
  }
}

// What one lane holds of one 32-token tile in registers: the V byte columns of quads t and
// t + 4 (INT2's), FP16 key gains and value scale / minimum of tokens 4g .. 4g + 3. (The
// tile's code block goes to shared memory by asynchronous copies.)
template <int D>
struct TcTile {
  static constexpr int U = D / 32;
  uint32_t v[2][U];
  uint2 kg, vs, vl;
};

__device__ __forceinline__ void CopyWordAsync(uint32_t* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void CommitCopies() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Every copy group but the last committed one is complete (for this thread).
__device__ __forceinline__ void WaitCopiesButLast() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void LoadWords(const uint8_t* p, uint32_t (&w)[N]) {
  if constexpr (N == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x;
    w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + 4 * i));
      w[i] = v.x;
      w[i + 1] = v.y;
      w[i + 2] = v.z;
      w[i + 3] = v.w;
    }
  }
}

// KB: the k-blocks of a row when compiled for one size (the shipped profiles' 2 d + 16 code
// bits: 5 at head_dim 64, 9 at 128), 0 for any size up to MaxKb(D) (a uniform branch per
// k-block).
// kFold: the instance that takes its share of a folded merge (merge_fold.cuh).
template <int D, int NT, int KB, bool kFold>
__global__ void __launch_bounds__(kWarps * 32, CtasPerSm(NT)) TransformDecodeKernelTc(TcArgs a) {
  constexpr int KBM = KB > 0 ? KB : MaxKb(D);
  constexpr int VT = D / 16;  // V^T m-tiles
  constexpr int Q = D / 4, U = Q / 8;
  constexpr int kBufWords = kTile * KBM + 2;
  const int lane = threadIdx.x & 31, warp = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0);
  const int g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const DecodeGeometry& geo = a.geo;
  const int G = geo.num_q_heads / geo.num_kv_heads;
  const int ps = geo.page_size;
  const int cb = a.lay.code_bytes, kb_n = KB > 0 ? KB : a.kb;
  const int k_words = 8 * cb;  // words of a tile's code block
  const int len = a.list.lengths[b];
  const int t_begin = split * a.tokens_per_split;
  const int t_end = min(len, t_begin + a.tokens_per_split);
  const int32_t* table = a.list.page_table + static_cast<int64_t>(b) * a.list.max_pages;

  __shared__ float s_m[kWarps][8], s_l[kWarps][8], s_lacc[kWarps][8];
  __shared__ float s_o[kWarps][4 * NT][D];
  __shared__ uint32_t s_k[kWarps][2][kBufWords];  // two code blocks per warp, in turn
  __shared__ uint2 s_bq[KBM][NT + 1][32];

  const int per_warp = a.tokens_per_split / kWarps;
  const int w_begin = t_begin + warp * per_warp;
  const int w_end = min(t_end, w_begin + per_warp);
  // The lane's byte offsets in a page-layer (tile slot 0): code block word `lane`, K gains
  // and V parameters of tokens 4g.., V quad t at byte column g U.
  const uint32_t off_k = static_cast<uint32_t>(a.lay.k_codes + kvh * a.lay.k_codes_head) + 4 * lane;
  const uint32_t off_kg = static_cast<uint32_t>(a.lay.k_gains + kvh * a.lay.k_gains_head) + 8 * g;
  const uint32_t off_vp = static_cast<uint32_t>(a.lay.v_params + kvh * a.lay.v_params_head) + 8 * g;
  const uint32_t off_v =
      static_cast<uint32_t>(a.lay.v_codes + kvh * a.lay.v_codes_head) + (t * Q + g * U) * 4;
  if (lane < 4) s_k[warp][lane / 2][kTile * KBM + lane % 2] = 0u;  // the re-aligned reads' end

  int tile = w_begin;
  // Tile `at`: its code block into buffer `which` (one copy group per call, committed by the
  // caller), the rest into tw.
  auto load = [&](int at, TcTile<D>& tw, int which) {
    const int slot = at % ps;
    const uint8_t* page =
        a.list.pages + static_cast<int64_t>(__ldg(table + at / ps)) * a.list.page_stride;
    const uint8_t* kp = page + off_k + slot * cb;
#pragma unroll
    for (int k = 0; k < KBM; ++k) {
      if (k < kb_n && lane + 32 * k < k_words) {
        CopyWordAsync(&s_k[warp][which][lane + 32 * k], kp + 128 * k);
      }
    }
    const uint8_t* vp = page + off_v + Q * slot;
    LoadWords<U>(vp, tw.v[0]);
    LoadWords<U>(vp + 16 * Q, tw.v[1]);  // quad t + 4
    tw.kg = __ldg(reinterpret_cast<const uint2*>(page + off_kg + 2 * slot));
    tw.vs = __ldg(reinterpret_cast<const uint2*>(page + off_vp + 2 * slot));
    tw.vl = __ldg(reinterpret_cast<const uint2*>(page + off_vp + 2 * slot + 2 * ps));
  };
  TcTile<D> ta, tb;
  if (tile < w_end) load(tile, ta, 0);
  CommitCopies();
  WaitPrimaryGrid();
  const int frag = b * geo.num_kv_heads + kvh;
  // The query digits (B of the logit MMAs), one copy per CTA in shared memory: (b0, b1) of
  // k-block kb, n-tile nt as one 8-byte word per lane.
  {
    const uint32_t* fw = a.frags + static_cast<int64_t>(frag) * kFragStride;
    for (int x = threadIdx.x; x < kb_n * (NT + 1) * 32; x += kWarps * 32) {
      const int ln = x % 32, nt = (x / 32) % (NT + 1), kb = x / (32 * (NT + 1));
      s_bq[kb][nt][ln] = make_uint2(__ldcg(fw + ((kb * (NT + 1) + nt) * 2) * 32 + ln),
                                    __ldcg(fw + ((kb * (NT + 1) + nt) * 2 + 1) * 32 + ln));
    }
  }
  __syncthreads();
  float unit[NT], cmean[NT], coff[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    unit[nt] = __ldcg(a.scal + frag * kScalStride + 4 * nt + t);
    cmean[nt] = __ldcg(a.scal + frag * kScalStride + 8 + 4 * nt + t);
    coff[nt] = __ldcg(a.scal + frag * kScalStride + 16 + 4 * nt + t);
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int vt = 0; vt < VT; ++vt) {
      s_o[warp][4 * nt + t][ValueElement<D>(vt, 0, g)] = 0.0f;
      s_o[warp][4 * nt + t][ValueElement<D>(vt, 1, g)] = 0.0f;
    }
  }
  __syncwarp();

  int acc[VT][NT][4];
#pragma unroll
  for (int vt = 0; vt < VT; ++vt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      acc[vt][nt][0] = acc[vt][nt][1] = acc[vt][nt][2] = acc[vt][nt][3] = 0;
  float m_ref[NT], l[NT], lacc[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    m_ref[nt] = -INFINITY;
    l[nt] = 0.0f;
    lacc[nt] = 0.0f;
  }
  float s_run = 0.0f, inv_w256 = 0.0f;
  int since_flush = 0;

  // As INT2 v2's: the int32 sums (scaled by the current inv_w) into the FP32 sums, which are
  // rescaled by alpha.
  auto flush = [&](const float(&alpha)[NT]) {
    const float to_w = inv_w256 > 0.0f ? 256.0f / inv_w256 : 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float* o = s_o[warp][4 * nt + t];
#pragma unroll
      for (int vt = 0; vt < VT; ++vt) {
        constexpr int per_plane = U / 2;
        const float sc = to_w / static_cast<float>(1 << (2 * (vt / per_plane)));
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float x = (static_cast<float>(acc[vt][nt][2 * r]) +
                           static_cast<float>(acc[vt][nt][2 * r + 1]) * (1.0f / 256.0f)) *
                          sc;
          const int e = ValueElement<D>(vt, r, g);
          o[e] = (o[e] + x) * alpha[nt];
          acc[vt][nt][2 * r] = acc[vt][nt][2 * r + 1] = 0;
        }
      }
    }
  };

  // One tile's math (code block in buffer `which`; the copies of the tile after it, if any,
  // committed last).
  auto compute = [&](const TcTile<D>& cur, int which) {
    const uint32_t* buf = s_k[warp][which];
    WaitCopiesButLast();
    __syncwarp();
    float kg[4], vsc[4], vlo[4];
    HalvesToFloat(cur.kg, kg);
    HalvesToFloat(cur.vs, vsc);
    HalvesToFloat(cur.vl, vlo);
    bool valid[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) valid[c] = tile + 4 * g + c < w_end;
    // --- logits of head t (and 4 + t) for tokens 4g .. 4g + 3 ---
    float lg[NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      // Rows g and g + 8 of m-tile mt: tokens 4g + 2mt and 4g + 2mt + 1.
      // The row's word kb is funnel(buf[w0 + kb], buf[w0 + kb + 1], sh); the lane's planes t
      // and t + 4 of it are two funnel shifts by sh + t and sh + t + 4 (< 32), masked.
      uint32_t w0[2], sh[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t byte0 = static_cast<uint32_t>((4 * g + 2 * mt + r) * cb);
        w0[r] = byte0 >> 2;
        sh[r] = (byte0 & 3u) * 8 + t;
      }
      int c[NT + 1][4];
#pragma unroll
      for (int nt = 0; nt <= NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0;
#pragma unroll
      for (int kb = 0; kb < KBM; ++kb) {
        if (kb < kb_n) {
          uint32_t x[2], y[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const uint32_t lo = buf[w0[r] + kb], hi = buf[w0[r] + kb + 1];
            x[r] = __funnelshift_r(lo, hi, sh[r]);
            y[r] = __funnelshift_r(lo, hi, sh[r] + 4);
          }
          const uint32_t a4[4] = {x[0] & kBits, x[1] & kBits, y[0] & kBits, y[1] & kBits};
#pragma unroll
          for (int nt = 0; nt <= NT; ++nt) {
            const uint2 bq = s_bq[kb][nt][lane];
            MmaU8S8(c[nt], a4, bq.x, bq.y);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int tok = 2 * mt + r;
          // hi * 254^2 + mid * 254 + lo (mid * 254 + lo is exact in int32 and float).
          const float dot = fmaf(static_cast<float>(c[nt][2 * r]), kDigit2,
                                 static_cast<float>(c[nt][2 * r + 1] * 254 + c[NT][2 * r + nt]));
          const float x = fmaf(dot, unit[nt] * kg[tok], fmaf(kg[tok], coff[nt], cmean[nt]));
          lg[nt][tok] = valid[tok] ? x : -INFINITY;
        }
      }
    }
    __syncwarp();  // the buffer is rewritten by the next tile
    // --- lazy rescale (INT2 v2's) ---
    float s_tile = 0.0f, mx[NT];
#pragma unroll
    for (int c = 0; c < 4; ++c) s_tile = fmaxf(s_tile, valid[c] ? fabsf(vsc[c]) : 0.0f);
    ++since_flush;
    bool need = s_tile > s_run || since_flush >= kFlushTiles;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mx[nt] = fmaxf(fmaxf(lg[nt][0], lg[nt][1]), fmaxf(lg[nt][2], lg[nt][3]));
      need = need || mx[nt] > m_ref[nt] + kLazyLog2;
    }
    if (__any_sync(0xffffffffu, need)) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        s_tile = fmaxf(s_tile, __shfl_xor_sync(0xffffffffu, s_tile, off));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mx[nt] = fmaxf(mx[nt], __shfl_xor_sync(0xffffffffu, mx[nt], off));
      }
      float alpha[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float m_new = fmaxf(m_ref[nt], mx[nt]);
        alpha[nt] = m_ref[nt] == -INFINITY ? 0.0f : Exp2Approx(m_ref[nt] - m_new);
        m_ref[nt] = m_new;
        l[nt] *= alpha[nt];
        lacc[nt] *= alpha[nt];
      }
      flush(alpha);
      s_run = fmaxf(s_run, fmaxf(s_tile, FLT_MIN));
      inv_w256 = 256.0f * (255.99f / (s_run * exp2f(kLazyLog2)));
      since_flush = 0;
    }
    // --- weights p * s_v as two uint8 digits in the B layout of the value MMAs ---
    uint32_t bw[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      uint32_t u[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float pr = valid[c] ? Exp2Approx(lg[nt][c] - m_ref[nt]) : 0.0f;
        l[nt] += pr;
        lacc[nt] += valid[c] ? pr * vlo[c] : 0.0f;
        const float w = valid[c] ? pr * vsc[c] : 0.0f;
        u[c] = __float_as_uint(__fmaf_rn(w, inv_w256, kRoundMagic));
      }
      const uint32_t hi4 = PackBytes<1>(u[0], u[1], u[2], u[3]);
      const uint32_t lo4 = PackBytes<0>(u[0], u[1], u[2], u[3]);
      const int src0 = 4 * t + (g >> 1), src1 = 16 + 4 * t + (g >> 1);
      const uint32_t h0 = __shfl_sync(0xffffffffu, hi4, src0);
      const uint32_t l0 = __shfl_sync(0xffffffffu, lo4, src0);
      const uint32_t h1 = __shfl_sync(0xffffffffu, hi4, src1);
      const uint32_t l1 = __shfl_sync(0xffffffffu, lo4, src1);
      bw[nt][0] = (g & 1) ? l0 : h0;
      bw[nt][1] = (g & 1) ? l1 : h1;
    }
    // --- values: V^T m-tiles, one mask per A register ---
#pragma unroll
    for (int vt = 0; vt < VT; ++vt) {
      constexpr int per_plane = U / 2;
      const int plane = vt / per_plane, v = vt % per_plane;
      const uint32_t mask = kPlane << (2 * plane);
      const uint32_t a4[4] = {cur.v[0][2 * v] & mask, cur.v[0][2 * v + 1] & mask,
                              cur.v[1][2 * v] & mask, cur.v[1][2 * v + 1] & mask};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) MmaU8U8(acc[vt][nt], a4, bw[nt][0], bw[nt][1]);
    }
    tile += kTile;
  };
  // Two register tiles in turn: the next tile's loads go out before this tile's math.
  while (tile < w_end) {
    if (tile + kTile < w_end) load(tile + kTile, tb, 1);
    CommitCopies();
    compute(ta, 0);
    if (tile >= w_end) break;
    if (tile + kTile < w_end) load(tile + kTile, ta, 0);
    CommitCopies();
    compute(tb, 1);
  }
  LaunchDependents();
  {
    float one[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) one[nt] = 1.0f;
    flush(one);
  }
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      l[nt] += __shfl_xor_sync(0xffffffffu, l[nt], off);
      lacc[nt] += __shfl_xor_sync(0xffffffffu, lacc[nt], off);
    }
    if (g == 0) {
      const int h = 4 * nt + t;
      s_m[warp][h] = l[nt] > 0.0f ? m_ref[nt] * kLn2 : -FLT_MAX;
      s_l[warp][h] = l[nt];
      s_lacc[warp][h] = lacc[nt];
    }
  }
  __syncthreads();
  // The warps merged: x [G][D] in the rotated value space (into warp 0's sums, each element
  // read and written by one thread), lse per head.
  const int tid = threadIdx.x;
  const int64_t row0 =
      (static_cast<int64_t>(a.part_base + split) * geo.batch + b) * geo.num_q_heads + kvh * G;
  float(*xs)[D] = s_o[0];
  for (int x = tid; x < G * D; x += kWarps * 32) {
    const int h = x / D, e = x % D;
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
    xs[h][e] = den > 0.0f ? num / den : 0.0f;
    if (e == 0) a.part_lse[row0 + h] = den > 0.0f ? M + __logf(den) : -INFINITY;
  }
  __syncthreads();
  // out = x R_v^T (UnrotateTransformOutput): R_v = c H as butterflies (x H^T = x H), else
  // the dense product with R_v^T read coalesced.
  const TransformHeadCodec& hc = a.heads[kvh];
  const float had = hc.hadamard_v;
  if (had != 0.0f) {
    for (int len2 = 1; len2 < D; len2 <<= 1) {
      for (int x = tid; x < G * D / 2; x += kWarps * 32) {
        const int h = x / (D / 2), k = x % (D / 2);
        const int i = (k / len2) * 2 * len2 + k % len2, j = i + len2;
        const float u = xs[h][i], v = xs[h][j];
        xs[h][i] = u + v;
        xs[h][j] = u - v;
      }
      __syncthreads();
    }
    for (int x = tid; x < G * D; x += kWarps * 32) {
      a.part_o[(row0 + x / D) * D + x % D] = had * xs[x / D][x % D];
    }
  } else {
    // Thread (e-part ep, column group cg): columns cg CW.. of the rows, summed over e in
    // part ep (D / 4 values of R_v^T per column, 16 or 4 loads in flight), the 4 parts then added
    // through shared memory: two L2 round trips instead of D / 16.
    constexpr int CW = D / 32;
    using Vec = std::conditional_t<CW == 4, float4, float2>;
    const int cg = tid % 32, ep = tid / 32;
    float acc[4 * NT][CW];
#pragma unroll
    for (int h = 0; h < 4 * NT; ++h)
#pragma unroll
      for (int j = 0; j < CW; ++j) acc[h][j] = 0.0f;
    constexpr int kDeep = NT == 1 ? 16 : 4;  // loads in flight (registers: 8 heads at NT 2)
#pragma unroll kDeep
    for (int e = ep * (D / 4); e < (ep + 1) * (D / 4); ++e) {
      const Vec r = __ldg(reinterpret_cast<const Vec*>(hc.r_v_t + e * D + cg * CW));
      const float* rv = reinterpret_cast<const float*>(&r);
#pragma unroll
      for (int h = 0; h < 4 * NT; ++h) {
        if (h < G) {
          const float xe = xs[h][e];
#pragma unroll
          for (int j = 0; j < CW; ++j) acc[h][j] = fmaf(xe, rv[j], acc[h][j]);
        }
      }
    }
    __syncthreads();  // xs (warp 0's sums) is read: the slabs take the partial sums
#pragma unroll
    for (int h = 0; h < 4 * NT; ++h) {
      if (h < G) {
#pragma unroll
        for (int j = 0; j < CW; ++j) s_o[ep][h][cg * CW + j] = acc[h][j];
      }
    }
    __syncthreads();
    for (int x = tid; x < G * D; x += kWarps * 32) {
      const int h = x / D, c = x % D;
      a.part_o[(row0 + h) * D + c] = (s_o[0][h][c] + s_o[1][h][c]) + (s_o[2][h][c] + s_o[3][h][c]);
    }
  }
  if constexpr (kFold) {  // the queries are converted ones: no raw queries to check
    FoldMerge<D>(a.fold, a.part_o, a.part_lse, geo.batch, geo.num_q_heads, geo.num_kv_heads, b, kvh,
                 nullptr, false, &s_o[0][0][0]);
  }
}

template <int D, int NT>
cudaError_t LaunchTc(const TcArgs& a, dim3 grid, cudaStream_t stream) {
  CountLaunch();
  TransformQueryFragments<D, NT><<<dim3(a.geo.num_kv_heads, a.geo.batch), 4 * D, 0, stream>>>(a);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  // One n-tile: the shipped size compiled in (2 D + 16 code bits). Two n-tiles: the generic
  // kernel only (the fixed size spills at 168 registers).
  constexpr int kShipped = NT == 1 ? (D == 64 ? 5 : 9) : 0;
  const bool shipped = kShipped > 0 && a.kb == kShipped;
  const dim3 block(kWarps * 32);
  if (a.fold.counters != nullptr) {
    return LaunchDependent(true,
                           shipped ? TransformDecodeKernelTc<D, NT, kShipped, true>
                                   : TransformDecodeKernelTc<D, NT, 0, true>,
                           grid, block, 0, stream, a);
  }
  return LaunchDependent(true,
                         shipped ? TransformDecodeKernelTc<D, NT, kShipped, false>
                                 : TransformDecodeKernelTc<D, NT, 0, false>,
                         grid, block, 0, stream, a);
}

}  // namespace

bool TransformTensorCoreServes(const DecodeGeometry& geo, const TransformPageOffsets& layout) {
  return (geo.head_dim == 64 || geo.head_dim == 128) && geo.num_kv_heads >= 1 &&
         geo.num_q_heads % geo.num_kv_heads == 0 &&
         geo.num_q_heads / geo.num_kv_heads <= kTransformCudaMaxGroup && geo.page_size >= kTile &&
         geo.page_size % kTile == 0 && layout.code_bytes >= 1 &&
         (layout.code_bytes + 3) / 4 <= MaxKb(geo.head_dim);
}

size_t TransformTcStateBytes(int batch, int num_kv_heads) {
  return static_cast<size_t>(batch) * num_kv_heads * sizeof(uint32_t) * (kFragStride + kScalStride);
}

int TransformTcDecodeSplits(int batch, int num_q_heads, int num_kv_heads, int max_tokens,
                            int num_sms) {
  const int64_t work = int64_t{batch} * num_kv_heads;
  if (work <= 0 || max_tokens <= 0 || num_kv_heads <= 0) return 1;
  const int per_sm = CtasPerSm(TcHeadTiles(num_q_heads / num_kv_heads));
  const int64_t wave = int64_t{num_sms} * per_sm / work;
  const int64_t most = (max_tokens + kWarps * kTile - 1) / (kWarps * kTile);
  return static_cast<int>(std::max<int64_t>(1, std::min(wave, most)));
}

Error LaunchTransformDecodePartsTc(const PagedList& list, const DecodeGeometry& geo,
                                   const TransformPageOffsets& layout,
                                   const TransformHeadCodec* heads, const float* q, float scale,
                                   int splits, int max_tokens, float* part_o, float* part_lse,
                                   int part_base, void* state, cudaStream_t stream,
                                   const MergeTarget* fold) {
  KVCD_CUDA_BIND_THREAD();
  if (geo.batch < 1 || !TransformTensorCoreServes(geo, layout) || splits < 1 || max_tokens < 0 ||
      part_base < 0 || heads == nullptr || q == nullptr || part_o == nullptr ||
      part_lse == nullptr || state == nullptr || list.pages == nullptr ||
      list.page_table == nullptr || list.lengths == nullptr || layout.head_dim != geo.head_dim ||
      layout.num_kv_heads != geo.num_kv_heads || layout.page_size != geo.page_size ||
      layout.code_bytes > layout.head_dim || geo.batch > 65535 || geo.num_kv_heads > 65535 ||
      list.page_stride % 16 != 0 || reinterpret_cast<uintptr_t>(list.pages) % 16 != 0) {
    return ToError(cudaErrorInvalidValue);
  }
  const int granule = kWarps * kTile;
  const int per = (max_tokens + splits - 1) / splits;
  const int n = static_cast<int>(int64_t{geo.batch} * geo.num_kv_heads);
  TcArgs a{list,
           geo,
           layout,
           heads,
           q,
           scale,
           std::max(granule, (per + granule - 1) / granule * granule),
           part_o,
           part_lse,
           part_base,
           (layout.code_bytes + 3) / 4,
           static_cast<uint32_t*>(state),
           reinterpret_cast<float*>(static_cast<uint32_t*>(state) + int64_t{n} * kFragStride)};
  if (fold != nullptr && !SetFold(*fold, geo, part_base, splits, &a.fold)) {
    return ToError(cudaErrorInvalidValue);
  }
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(geo.num_kv_heads),
                  static_cast<unsigned>(geo.batch));
  // The tensor-core variant's head dims (TransformTensorCoreServes) and GQA tile counts.
  return ToError(kernels::DispatchValue<64, 128>(
      geo.head_dim,
      [&](auto hd) {
        return DispatchHeadTiles(TcHeadTiles(geo.num_q_heads / geo.num_kv_heads), [&](auto nt) {
          return LaunchTc<decltype(hd)::value, decltype(nt)::value>(a, grid, stream);
        });
      },
      [] { return cudaErrorInvalidValue; }));
}

}  // namespace kvcd::kernels::cuda
