// FSQ encode on the GPU (cuda_fsq.h): residual rows -> packed 4-bit codes in page slots,
// bit for bit FsqEncodeRows.
//
// Why float64 FMA chains and not a tensor-core GEMM: the CPU definition of a code sums
// u = sum_c E[g][c] x[c] in order of c in float64, and a latent whose u sits near a
// rounding threshold changes code with the last bit of u. Tensor cores (FP16/BF16/TF32 with
// FP32 accumulation, or DMMA with its own summation order) give a different u, so their
// codes would differ from the host's on some tokens. Each (token, latent) here is one chain
// of fma(e, x, acc) in float64: the product of two floats is exact in float64, so each step
// rounds exactly as the host's multiply-then-add does, in the same order. The GEMM shape is
// kept for the data movement: a block computes 16 tokens x 64 latents from E and x tiles in
// shared memory, every thread 2 tokens x 2 latents (one output byte per token).
// Cost: C*G float64 FMAs per token and layer (1 M at C = 4096, G = 256): about 0.15 ms
// for a 64-sequence decode step over 36 layers at the H100/H200 float64 rate, ~6 ms per
// layer for a 100k-token Put.
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "kvcd/kernels/cuda_fsq.h"
#include "paged_rows.cuh"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kEncTokens = 16;   // tokens per block
constexpr int kEncLatents = 64;  // latents per block
constexpr int kEncChunk = 32;    // residual elements per shared-memory stage
constexpr int kEncThreads = 256;

struct Thresholds {
  double t[kFsqThresholds];
};

struct EncodeArgs {
  RowBlock x;
  PagedRows dst;
  int64_t codes_offset;
  const FsqLayerCodec* codecs;
  int32_t c, g;
  Thresholds thr;
  StoreCheck check;
  bool has_check;
};

__device__ __forceinline__ int Quantize(double u, const Thresholds& thr) {
  if (u != u) return 0;  // NaN, as FsqQuantizeLatent
  int z = -8;
#pragma unroll
  for (int k = 0; k < kFsqThresholds; ++k) z += u >= thr.t[k] ? 1 : 0;
  return z;
}

__global__ void __launch_bounds__(kEncThreads) FsqEncodeKernel(const EncodeArgs a) {
  // Widened to float64 once, as loaded (exact), so the inner loop is loads and FMAs only.
  __shared__ double xs[kEncChunk][kEncTokens];   // [c][token]
  __shared__ double es[kEncChunk][kEncLatents];  // [c][latent]: E transposed
  __shared__ int bad[kEncTokens];                // non-finite values per token row
  const int layer = blockIdx.z;
  const int64_t t0 = int64_t{blockIdx.x} * kEncTokens;
  const int g0 = blockIdx.y * kEncLatents;
  const int tid = threadIdx.x;
  const int pair = tid % 32, tg = tid / 32;  // latents g0 + 2 pair (+1), tokens tg, tg + 8
  const int C = a.c, G = a.g;
  const float* e = a.codecs[layer].encoder;
  const float* e_bias = a.codecs[layer].encoder_bias;
  if (tid < kEncTokens) bad[tid] = 0;
  const int64_t x_layer = layer * a.x.layer_stride;

  double acc[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
  for (int c0 = 0; c0 < C; c0 += kEncChunk) {
    const int cn = min(kEncChunk, C - c0);
    __syncthreads();  // the previous chunk is consumed (and bad[] initialized)
    for (int i = tid; i < kEncTokens * kEncChunk; i += kEncThreads) {
      const int tok = i / kEncChunk, c = i % kEncChunk;
      float v = 0.0f;
      if (c < cn && t0 + tok < a.dst.num_tokens) {
        const int64_t off = x_layer + (t0 + tok) * a.x.token_stride + c0 + c;
        v = a.x.bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(a.x.data)[off])
                     : static_cast<const float*>(a.x.data)[off];
        if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) atomicAdd(&bad[tok], 1);
      }
      xs[c][tok] = v;
    }
    for (int i = tid; i < kEncLatents * kEncChunk; i += kEncThreads) {
      const int lat = i / kEncChunk, c = i % kEncChunk;
      es[c][lat] = (c < cn && g0 + lat < G) ? e[int64_t{g0 + lat} * C + c0 + c] : 0.0f;
    }
    __syncthreads();
    for (int c = 0; c < cn; ++c) {
      const double x0 = xs[c][tg], x1 = xs[c][tg + 8];
      const double2 ev = *reinterpret_cast<const double2*>(&es[c][2 * pair]);
      const double e0 = ev.x, e1 = ev.y;
      acc[0][0] = __fma_rn(e0, x0, acc[0][0]);
      acc[0][1] = __fma_rn(e1, x0, acc[0][1]);
      acc[1][0] = __fma_rn(e0, x1, acc[1][0]);
      acc[1][1] = __fma_rn(e1, x1, acc[1][1]);
    }
  }
  __syncthreads();  // bad[] complete

  const int g = g0 + 2 * pair;
  const int64_t cb = (int64_t{G} + 1) / 2;  // FsqCodeBytes
  for (int i = 0; i < 2; ++i) {
    const int tok = tg + 8 * i;
    const int64_t t = t0 + tok;
    if (t >= a.dst.num_tokens) continue;
    const bool row_bad = a.has_check && bad[tok] > 0;
    if (row_bad && blockIdx.y == 0 && pair == 0) {
      StoreRow s{};
      s.layer = layer;
      s.token = t;
      s.which = 0;
      ReportBadRow(a.check, s, layer * a.dst.num_tokens + t, bad[tok]);
    }
    if (g >= G) continue;
    int lo = 0, hi = 0;
    if (!row_bad) {
      lo = Quantize(acc[i][0] + static_cast<double>(e_bias[g]), a.thr);
      if (g + 1 < G) hi = Quantize(acc[i][1] + static_cast<double>(e_bias[g + 1]), a.thr);
    }
    const uint8_t byte =
        static_cast<uint8_t>((lo + 8) | (g + 1 < G ? (hi + 8) << 4 : 0));  // odd G: high 0
    const int64_t at = a.dst.slots != nullptr ? a.dst.slots[t] : a.dst.inline_slots[t];
    const int64_t page = at / a.dst.page_size, slot = at - page * a.dst.page_size;
    a.dst.base[layer * a.dst.layer_stride + page * a.dst.page_bytes + a.codes_offset + slot * cb +
               g / 2] = byte;
  }
}

}  // namespace

Error LaunchFsqEncodeRows(const RowBlock& x, const PagedRows& dst, int64_t codes_offset,
                          const FsqLayerCodec* layer_codecs, int32_t residual_width,
                          int32_t latent_width, cudaStream_t stream, const StoreCheck* check) {
  KVCD_CUDA_BIND_THREAD();
  if (x.data == nullptr || dst.base == nullptr || layer_codecs == nullptr || residual_width < 1 ||
      latent_width < 1 || latent_width > kFsqMaxLatent || dst.page_size < 1 || dst.num_layers < 1 ||
      dst.num_tokens < 0 || codes_offset < 0 ||
      (dst.slots == nullptr && dst.num_tokens > PagedRows::kInlineSlots) ||
      (check != nullptr && check->use_inline_faults && dst.num_tokens > PagedRows::kInlineSlots) ||
      dst.num_layers > 65535) {
    return ToError(cudaErrorInvalidValue);
  }
  if (dst.num_tokens == 0) return Error();
  static const Thresholds thr = [] {
    Thresholds t{};
    FsqLatentThresholds(t.t);
    return t;
  }();
  EncodeArgs a{};
  a.x = x;
  a.dst = dst;
  a.codes_offset = codes_offset;
  a.codecs = layer_codecs;
  a.c = residual_width;
  a.g = latent_width;
  a.thr = thr;
  a.has_check = check != nullptr;
  if (check != nullptr) a.check = *check;
  const int64_t token_blocks = (dst.num_tokens + kEncTokens - 1) / kEncTokens;
  if (token_blocks > 0x7fffffff) return ToError(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(token_blocks),
                  static_cast<unsigned>((latent_width + kEncLatents - 1) / kEncLatents),
                  static_cast<unsigned>(dst.num_layers));
  FsqEncodeKernel<<<grid, kEncThreads, 0, stream>>>(a);
  return ToError(cudaGetLastError());
}

}  // namespace kvcd::kernels::cuda
