// int2-transform row stores (cuda_transform.h): keys encoded in float64 as
// EncodeTransformKeys does, values quantized as DemoteRowsToInt2 does with the row's KV head
// rotation, both placed as TransformPageLayout says.
//
// Keys: a block per (8 tokens, KV head, layer), one thread per direction i. Every step is
// the CPU encoder's, in its order, each product and sum rounded on its own (__dmul_rn,
// __dadd_rn, __ddiv_rn, __dsqrt_rn: nvcc never contracts these into FMAs):
//   diff_j = x_j - mean_j; s_i = sum_j (e_ij diff_j) in order of j; z_i = s_i / sigma_i;
//   ss = sum_i z_i^2 in order of i (one thread per token); g = max(sqrt(ss / coded),
//   max_i |z_i| / half_range_i); gain = FP16 of float(g (1 + 2^-10)) (1 if 0 or not finite);
//   c_i = clamp(floor(z_i / (step_i gain) + 2^(b_i - 1)), 0, 2^b_i - 1).
// The d x d products cost d^2 float64 multiply-adds per row (4096 at d = 64), once per token.
// Values: one warp per row, the shared INT2 row quantizer (int2_row_quantizer.cuh).
#include <cuda_fp16.h>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "dispatch.cuh"
#include "int2_row_quantizer.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_transform.h"
#include "paged_rows.cuh"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kEncTokens = 8;  // key rows of one head per block

struct KeyArgs {
  RowBlock k;
  PagedRows dst;
  TransformPageOffsets lay;
  const TransformHeadCodec* heads;
  double steps[kMaxTransformBits + 1];  // TransformStep(b), from the CPU definition
  StoreCheck check;
  bool has_check;
};

__device__ __forceinline__ int64_t SlotOf(const PagedRows& p, int64_t t) {
  return p.slots != nullptr ? p.slots[t] : p.inline_slots[t];
}

template <int D>
__global__ void __launch_bounds__(D) EncodeTransformKeysKernel(const KeyArgs a) {
  __shared__ double diff[kEncTokens][D];
  __shared__ double zs[kEncTokens][D];
  __shared__ uint32_t bitbuf[kEncTokens][D / 4 + 1];  // code_bytes <= D
  __shared__ double gains[kEncTokens];
  __shared__ int bad[kEncTokens];
  const int layer = blockIdx.z, head = blockIdx.y, i = threadIdx.x;
  const int heads = a.dst.num_kv_heads;
  const int64_t n = a.dst.num_tokens;
  const int64_t t0 = int64_t{blockIdx.x} * kEncTokens;
  const TransformHeadCodec& c = a.heads[int64_t{layer} * heads + head];
  const float* mean = c.k_mean;
  if (i < kEncTokens) bad[i] = 0;
  for (int w = i; w < kEncTokens * (D / 4 + 1); w += D) (&bitbuf[0][0])[w] = 0u;
  __syncthreads();
  float x[kEncTokens];
  const int64_t row_at = layer * a.k.layer_stride + head * a.k.head_stride + i;
#pragma unroll
  for (int tok = 0; tok < kEncTokens; ++tok) {
    x[tok] = 0.0f;
    if (t0 + tok < n) {
      const int64_t off = row_at + (t0 + tok) * a.k.token_stride;
      x[tok] = a.k.bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(a.k.data)[off])
                        : static_cast<const float*>(a.k.data)[off];
      if (a.has_check && (__float_as_uint(x[tok]) & 0x7f800000u) == 0x7f800000u) {
        atomicAdd(&bad[tok], 1);
      }
    }
  }
  __syncthreads();
  const double mean_i = static_cast<double>(mean[i]);
#pragma unroll
  for (int tok = 0; tok < kEncTokens; ++tok) {
    const float xv = bad[tok] > 0 ? 0.0f : x[tok];  // a non-finite row: a zero row's codes
    diff[tok][i] = __dsub_rn(static_cast<double>(xv), mean_i);
  }
  __syncthreads();
  const int b = c.k_bits[i];
  double s[kEncTokens];
#pragma unroll
  for (int tok = 0; tok < kEncTokens; ++tok) s[tok] = 0.0;
  if (b > 0) {
    const float* e = c.k_encode_t + i;  // e[j * D] = k_encode[i][j]
#pragma unroll 4
    for (int j = 0; j < D; ++j) {
      const double ej = static_cast<double>(__ldg(e + j * D));
#pragma unroll
      for (int tok = 0; tok < kEncTokens; ++tok) {
        s[tok] = __dadd_rn(s[tok], __dmul_rn(ej, diff[tok][j]));
      }
    }
  }
  const double sigma_i = static_cast<double>(c.k_sigma[i]);
#pragma unroll
  for (int tok = 0; tok < kEncTokens; ++tok) zs[tok][i] = b > 0 ? __ddiv_rn(s[tok], sigma_i) : 0.0;
  __syncthreads();
  if (i < kEncTokens) {  // the gain of token i, its squares summed in order
    const int tok = i;
    double ss = 0.0;
    int coded = 0;
    for (int d = 0; d < c.coded; ++d) {
      if (c.k_bits[d] == 0) continue;
      const double z = zs[tok][d];
      ss = __dadd_rn(ss, __dmul_rn(z, z));
      ++coded;
    }
    double gain = 1.0;
    if (coded > 0) {
      double g = __dsqrt_rn(__ddiv_rn(ss, static_cast<double>(coded)));
      for (int d = 0; d < c.coded; ++d) {
        const int bd = c.k_bits[d];
        if (bd == 0) continue;
        const double half_range = static_cast<double>(1 << (bd - 1)) * a.steps[bd];  // exact
        const double v = __ddiv_rn(fabs(zs[tok][d]), half_range);
        g = g < v ? v : g;  // std::max(g, v)
      }
      // Saturated at FP16's largest finite value, as EncodeTransformKeys does.
      const float gf = __double2float_rn(fmin(__dmul_rn(g, 1.0 + 1.0 / 1024), double{kFp16Max}));
      const float h = __half2float(__float2half_rn(gf));
      gain = h > 0.0f && isfinite(h) ? static_cast<double>(h) : 1.0;
    }
    gains[tok] = gain;
    const int64_t t = t0 + tok;
    if (t < n) {
      const int64_t at = SlotOf(a.dst, t);
      const int64_t page = at / a.dst.page_size;
      const int64_t slot = at - page * a.dst.page_size;
      uint8_t* pg = a.dst.base + layer * a.dst.layer_stride + page * a.dst.page_bytes;
      reinterpret_cast<uint16_t*>(pg + a.lay.k_gains + head * a.lay.k_gains_head)[slot] =
          __half_as_ushort(__float2half_rn(static_cast<float>(gain)));
      if (bad[tok] > 0) {
        StoreRow r{};
        r.layer = layer;
        r.token = t;
        r.which = 0;
        r.head = head;
        ReportBadRow(a.check, r, ((layer * n + t) * 2 + 0) * heads + head, bad[tok]);
      }
    }
  }
  __syncthreads();
  if (b > 0) {
    const uint32_t dw = c.k_dirs[i];
    const int pos = static_cast<int>((dw >> 16) * 32 + (dw & 31u));
    const int levels = 1 << b;
#pragma unroll
    for (int tok = 0; tok < kEncTokens; ++tok) {
      const double step = __dmul_rn(a.steps[b], gains[tok]);
      const double f = floor(__dadd_rn(__ddiv_rn(zs[tok][i], step), levels / 2.0));
      const double k = f < 0.0 ? 0.0 : (levels - 1.0 < f ? levels - 1.0 : f);  // std::clamp
      const uint32_t code = static_cast<uint32_t>(static_cast<int>(k));
      atomicOr(&bitbuf[tok][pos >> 5], code << (pos & 31));
      if ((pos & 31) + b > 32) atomicOr(&bitbuf[tok][(pos >> 5) + 1], code >> (32 - (pos & 31)));
    }
  }
  __syncthreads();
  const int cb = a.lay.code_bytes;
#pragma unroll
  for (int tok = 0; tok < kEncTokens; ++tok) {
    const int64_t t = t0 + tok;
    if (t >= n) break;
    const int64_t at = SlotOf(a.dst, t);
    const int64_t page = at / a.dst.page_size;
    const int64_t slot = at - page * a.dst.page_size;
    uint8_t* row = a.dst.base + layer * a.dst.layer_stride + page * a.dst.page_bytes +
                   a.lay.k_codes + head * a.lay.k_codes_head + slot * cb;
    for (int j = i; j < cb; j += D) {
      row[j] = static_cast<uint8_t>(bitbuf[tok][j >> 2] >> (8 * (j & 3)));
    }
  }
}

// One warp per value row r = (layer * num_tokens + token) * num_kv_heads + head.
template <int D, bool kCheck>
__global__ void StoreTransformValuesKernel(RowBlock v, PagedRows p, TransformPageOffsets lay,
                                           const TransformHeadCodec* heads, StoreCheck check) {
  constexpr int kQ = D / 4;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kStoreWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t n = p.num_tokens;
  if (r >= int64_t{p.num_layers} * n * p.num_kv_heads) return;
  StoreRow s;
  s.head = static_cast<int32_t>(r % p.num_kv_heads);
  s.token = (r / p.num_kv_heads) % n;
  s.layer = static_cast<int32_t>(r / p.num_kv_heads / n);
  s.which = 1;
  const int64_t at = SlotOf(p, s.token);
  s.page = at / p.page_size;
  s.slot = static_cast<int32_t>(at - s.page * p.page_size);
  float x[D / 32];
  LoadStoreRow<D>(v, s, lane, x);
  const TransformHeadCodec& hc = heads[int64_t{s.layer} * p.num_kv_heads + s.head];
  bool rotate = true;
  if constexpr (kCheck) {
    if (const int bad = RowNonFiniteCount<D>(x); bad > 0) {  // stored as zeros
      if (lane == 0) {
        ReportBadRow(check, s, ((s.layer * n + s.token) * 2 + 1) * p.num_kv_heads + s.head, bad);
      }
#pragma unroll
      for (int e = 0; e < D / 32; ++e) x[e] = 0.0f;
      rotate = false;
    }
  }
  if (rotate) {
    if (hc.hadamard_v != 0.0f) {
      HadamardRowGroup<D, 32, 1>(x, GroupOf<32>(lane), hc.hadamard_v);
    } else {
      RotateRowWarp<D>(x, hc.r_v, lane);
    }
  }
  int q[D / 32];
  float scale, lo;
  QuantizeRowInt2<D, 32>(x, hc.rho_v, GroupOf<32>(lane), q, &scale, &lo);
  uint8_t* page = StorePage(p, s);
  // V codes [heads][P4][Q][4] (int2_attention.h), then FP16 scales and minimums per head.
  uint8_t* codes =
      page + lay.v_codes + s.head * lay.v_codes_head + (s.slot / 4) * 4 * kQ + s.slot % 4;
  PackRowInt2<D>(q, lane, [&](int j, uint8_t byte) { codes[4 * j] = byte; });
  if (lane == 0) {
    auto* params =
        reinterpret_cast<uint16_t*>(page + lay.v_params + s.head * lay.v_params_head) + s.slot;
    params[0] = __half_as_ushort(__float2half_rn(scale));
    params[p.page_size] = __half_as_ushort(__float2half_rn(lo));
  }
}

}  // namespace

Error LaunchStoreTransformRows(const RowBlock& k, const RowBlock& v, const PagedRows& dst,
                               const TransformPageOffsets& layout, const TransformHeadCodec* heads,
                               cudaStream_t stream, const StoreCheck* check) {
  KVCD_CUDA_BIND_THREAD();
  if (!ValidStore(k, v, dst, check) || heads == nullptr || dst.head_dim != layout.head_dim ||
      dst.num_kv_heads != layout.num_kv_heads || dst.page_size != layout.page_size ||
      layout.code_bytes < 1 || layout.code_bytes > layout.head_dim || dst.num_layers > 65535 ||
      dst.num_kv_heads > 65535) {
    return ToError(cudaErrorInvalidValue);
  }
  if (dst.num_tokens == 0) return Error();
  const int64_t token_blocks = (dst.num_tokens + kEncTokens - 1) / kEncTokens;
  if (token_blocks > 0x7fffffff) return ToError(cudaErrorInvalidValue);
  KeyArgs a{};
  a.k = k;
  a.dst = dst;
  a.lay = layout;
  a.heads = heads;
  for (int b = 0; b <= kMaxTransformBits; ++b) a.steps[b] = TransformStep(b);
  a.has_check = check != nullptr;
  if (check != nullptr) a.check = *check;
  const StoreCheck c = check != nullptr ? *check : StoreCheck{};
  return ToError(DispatchHeadDim(dst.head_dim, [&](auto hd) {
    constexpr int kD = decltype(hd)::value;
    CountLaunch();
    const dim3 grid(static_cast<unsigned>(token_blocks), static_cast<unsigned>(dst.num_kv_heads),
                    static_cast<unsigned>(dst.num_layers));
    EncodeTransformKeysKernel<kD><<<grid, kD, 0, stream>>>(a);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    // Value rows: StoreGrid counts K and V rows; one warp per V row is half of it.
    const int64_t rows = int64_t{dst.num_layers} * dst.num_tokens * dst.num_kv_heads;
    const dim3 vgrid(static_cast<unsigned>((rows + kStoreWarpsPerBlock - 1) / kStoreWarpsPerBlock));
    CountLaunch();
    if (check != nullptr) {
      StoreTransformValuesKernel<kD, true>
          <<<vgrid, 32 * kStoreWarpsPerBlock, 0, stream>>>(v, dst, layout, heads, c);
    } else {
      StoreTransformValuesKernel<kD, false>
          <<<vgrid, 32 * kStoreWarpsPerBlock, 0, stream>>>(v, dst, layout, heads, c);
    }
    return cudaGetLastError();
  }));
}

}  // namespace kvcd::kernels::cuda
