// FSQ encode on tensor cores (cuda_fsq_encode_tc.h): u = E x as a BF16 or FP16 GEMM with
// FP32 accumulation, the float64 bias and thresholds in the epilogue.
//
// A block computes 128 tokens x 128 latents of one layer (8 warps of 32 tokens x 64
// latents, mma.sync m16n8k16, 64 FP32 accumulators per thread) over C in steps of 32:
// the step's E tile (128 latents x 32, per plane) comes by cp.async, the x tile through
// registers (loaded one step ahead, checked for NaN/Inf and rounded to the operand type as
// it is stored), two shared-memory stages. FP16 operands: each row of E is scaled by a
// power of two (max |E_g| in [2^14, 2^15)) when prepared and the accumulator scaled back
// in the epilogue (exact), x clamped to +-65504 when finite. Rows are padded to 40 BF16 (80 bytes)
// so ldmatrix's 8 row addresses fall in 8 distinct 4-bank groups. Epilogue: each thread holds
// latents (2i, 2i+1) of its tokens, i.e. whole code bytes; they go through shared memory so each
// token's code row is written by consecutive threads.
// Cost by count: 2 C G FLOP per token and layer (x ops): 2.47 TFLOP for 32k tokens x 36
// layers at C 4096, G 256.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "dynamic_smem.cuh"
#include "kvcd/kernels/cuda_fsq_encode_tc.h"
#include "paged_rows.cuh"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kTcTokens = 128;   // tokens per block
constexpr int kTcLatents = 128;  // latents per block
constexpr int kTcK = 32;         // residual elements per stage
constexpr int kTcRow = 40;       // BF16 per shared-memory row (32 + 8 padding)
constexpr int kTcThreads = 256;
constexpr int kTcTileElems = kTcTokens * kTcRow;  // one x or E plane tile (BF16)
static_assert(kTcTokens == kTcLatents, "x and E tiles share a size");

int64_t PaddedLatents(int32_t g) { return (int64_t{g} + kTcLatents - 1) / kTcLatents * kTcLatents; }
int64_t PaddedResidual(int32_t c) { return (int64_t{c} + kTcK - 1) / kTcK * kTcK; }

struct Thresholds {
  double t[kFsqThresholds];
};

struct TcArgs {
  RowBlock x;
  PagedRows dst;
  int64_t codes_offset;
  const FsqLayerCodec* codecs;
  const uint16_t* prepared;  // BF16 or FP16 operands (then the F32 row scales)
  int64_t layer_elems;       // prepared 16-bit elements per layer (row scales included)
  int64_t plane_elems;       // per plane
  int64_t cp;                // padded C (prepared row length)
  int32_t c, g;
  int32_t k_steps;
  int64_t token_tiles;
  bool vector_x;  // 16-byte x loads (aligned rows, C a multiple of 32)
  Thresholds thr;
  StoreCheck check;
  bool has_check;
};

__device__ __forceinline__ int Quantize(double u, const Thresholds& thr) {
  if (u != u) return 0;
  int z = -8;
#pragma unroll
  for (int k = 0; k < kFsqThresholds; ++k) z += u >= thr.t[k] ? 1 : 0;
  return z;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(smem)), "l"(global));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}

template <bool kFp16>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (kFp16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two residual values as one FP16 operand word: finite values clamped to +-65504 (FP16's
// largest), NaN and Inf kept.
__device__ __forceinline__ uint32_t ToFp16x2(float lo, float hi) {
  constexpr float kMax = 65504.0f;
  lo = fabsf(lo) <= kMax || !isfinite(lo) ? lo : copysignf(kMax, lo);
  hi = fabsf(hi) <= kMax || !isfinite(hi) ? hi : copysignf(kMax, hi);
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float Bf16Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// 16 residual values of one token row, as loaded (BF16 bits or F32), before they are
// rounded and stored.
template <bool kBf16>
struct XRegs {
  uint32_t w[kBf16 ? 8 : 16];  // BF16: 8 words of 2 BF16; F32: 16 floats' bits
};

__device__ __forceinline__ bool NonFiniteBf16(uint32_t h) { return (h & 0x7f80u) == 0x7f80u; }
__device__ __forceinline__ bool NonFiniteF32(uint32_t f) {
  return (f & 0x7f800000u) == 0x7f800000u;
}

// Thread `tid` loads token row tid / 2, elements (tid % 2) * 16 .. + 15 of step k0.
template <bool kBf16>
__device__ __forceinline__ void LoadX(const TcArgs& a, int layer, int64_t t, int c0,
                                      XRegs<kBf16>& r) {
  const bool in = t < a.dst.num_tokens;
  const int64_t row = layer * a.x.layer_stride + t * a.x.token_stride;
  if constexpr (kBf16) {
    const auto* p = static_cast<const uint16_t*>(a.x.data) + row + c0;
    if (a.vector_x) {
      uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
      if (in) {
        v0 = __ldg(reinterpret_cast<const uint4*>(p));
        v1 = __ldg(reinterpret_cast<const uint4*>(p) + 1);
      }
      r.w[0] = v0.x, r.w[1] = v0.y, r.w[2] = v0.z, r.w[3] = v0.w;
      r.w[4] = v1.x, r.w[5] = v1.y, r.w[6] = v1.z, r.w[7] = v1.w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t lo = in && c0 + 2 * j < a.c ? p[2 * j] : 0u;
        const uint32_t hi = in && c0 + 2 * j + 1 < a.c ? p[2 * j + 1] : 0u;
        r.w[j] = lo | (hi << 16);
      }
    }
  } else {
    const auto* p = static_cast<const float*>(a.x.data) + row + c0;
    if (a.vector_x) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (in) v = __ldg(reinterpret_cast<const float4*>(p) + j);
        r.w[4 * j] = __float_as_uint(v.x), r.w[4 * j + 1] = __float_as_uint(v.y);
        r.w[4 * j + 2] = __float_as_uint(v.z), r.w[4 * j + 3] = __float_as_uint(v.w);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) r.w[j] = in && c0 + j < a.c ? __float_as_uint(p[j]) : 0u;
    }
  }
}

// Counts the non-finite values of r and stores them as the operand type (BF16, or FP16
// with kFp16) at dst (16 elements).
template <bool kBf16, bool kFp16>
__device__ __forceinline__ int StoreX(const XRegs<kBf16>& r, uint16_t* dst) {
  int bad = 0;
  uint32_t o[8];
  if constexpr (kBf16) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      bad += NonFiniteBf16(r.w[j] & 0xffffu) + NonFiniteBf16(r.w[j] >> 16);
      if constexpr (kFp16) {
        o[j] = ToFp16x2(Bf16Lo(r.w[j]), Bf16Hi(r.w[j]));
      } else {
        o[j] = r.w[j];
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      bad += NonFiniteF32(r.w[2 * j]) + NonFiniteF32(r.w[2 * j + 1]);
      const float lo = __uint_as_float(r.w[2 * j]), hi = __uint_as_float(r.w[2 * j + 1]);
      if constexpr (kFp16) {
        o[j] = ToFp16x2(lo, hi);
      } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        o[j] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
  }
  auto* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(o[0], o[1], o[2], o[3]);
  d[1] = make_uint4(o[4], o[5], o[6], o[7]);
  return bad;
}

// kMinBlocks 2: two blocks per SM in 128 registers (a few spilled); 1: one block, ~200
// registers, none spilled (KVCD_FSQ_TC_BLOCKS_PER_SM=1, for measurements).
template <int kPlanes, bool kBf16, bool kFp16, int kMinBlocks>
__global__ void __launch_bounds__(kTcThreads, kMinBlocks) FsqEncodeTcKernel(const TcArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  // Stage s: x tile at tiles + s * (1 + kPlanes) * kTcTileElems, then the planes' E tiles.
  auto* tiles = reinterpret_cast<uint16_t*>(smem);
  __shared__ int bad_rows[kTcTokens];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp % 4, wn = warp / 4;  // tokens wm * 32 .., latents wn * 64 ..
  const int layer = blockIdx.z;
  const int g0 = blockIdx.x * kTcLatents;
  const uint16_t* e_layer = a.prepared + layer * a.layer_elems;
  // FP16: the rows' scales back (powers of two) after the planes.
  const float* e_scale = reinterpret_cast<const float*>(e_layer + kPlanes * a.plane_elems);
  const float* e_bias = a.codecs[layer].encoder_bias;
  const int64_t cb = (int64_t{a.g} + 1) / 2;
  constexpr int kStageElems = (1 + kPlanes) * kTcTileElems;
  const int x_row = tid / 2, x_col = (tid % 2) * 16;

  for (int64_t tile = blockIdx.y; tile < a.token_tiles; tile += gridDim.y) {
    const int64_t t0 = tile * kTcTokens;
    const int64_t my_t = t0 + x_row;

    // E tile of step k into stage s: per plane 128 rows x 4 chunks of 16 bytes.
    auto load_e = [&](int s, int k) {
      uint16_t* st = tiles + s * kStageElems + kTcTileElems;
#pragma unroll
      for (int p = 0; p < kPlanes; ++p) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int chunk = tid + i * kTcThreads, row = chunk / 4, col = (chunk % 4) * 8;
          CpAsync16(st + p * kTcTileElems + row * kTcRow + col,
                    e_layer + p * a.plane_elems + (g0 + row) * a.cp + k * kTcK + col);
        }
      }
      asm volatile("cp.async.commit_group;\n" ::);
    };

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
    int bad = 0;
    XRegs<kBf16> xr;

    __syncthreads();  // the previous tile's epilogue is done with shared memory
    load_e(0, 0);
    LoadX(a, layer, my_t, x_col, xr);
    bad += StoreX<kBf16, kFp16>(xr, tiles + x_row * kTcRow + x_col);
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();

    for (int k = 0; k < a.k_steps; ++k) {
      const int s = k & 1;
      const bool next = k + 1 < a.k_steps;
      if (next) {
        load_e(s ^ 1, k + 1);
        LoadX(a, layer, my_t, (k + 1) * kTcK + x_col, xr);
      }
      const uint16_t* xs = tiles + s * kStageElems;
      const uint16_t* es = xs + kTcTileElems;
#pragma unroll
      for (int kk = 0; kk < kTcK; kk += 16) {
        uint32_t af[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int row = wm * 32 + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
          LdMatrixX4(af[mt], xs + row * kTcRow + kk + (lane / 16) * 8);
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          const int row = wn * 64 + np * 16 + (lane % 8) + (lane / 16) * 8;
#pragma unroll
          for (int p = 0; p < kPlanes; ++p) {
            uint32_t bf[4];
            LdMatrixX4(bf, es + p * kTcTileElems + row * kTcRow + kk + ((lane / 8) % 2) * 8);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              Mma<kFp16>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
              Mma<kFp16>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
            }
          }
        }
      }
      if (next) {
        bad += StoreX<kBf16, kFp16>(xr, tiles + (s ^ 1) * kStageElems + x_row * kTcRow + x_col);
      }
      asm volatile("cp.async.wait_all;\n" ::);
      __syncthreads();
    }

    // Non-finite values per token row (the two threads of a row are neighbouring lanes).
    bad += __shfl_xor_sync(0xffffffffu, bad, 1);
    if (tid % 2 == 0) bad_rows[x_row] = bad;
    __syncthreads();

    // Code bytes into shared memory: [token][64 bytes] (the stages are free now).
    uint8_t* codes = smem;
    constexpr int kRowBytes = kTcLatents / 2;
    const int gq = lane / 4, tq = lane % 4;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * 32 + mt * 16 + gq + 8 * h;
        const bool row_bad = a.has_check && bad_rows[r] > 0;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int lg = wn * 64 + nt * 8 + 2 * tq;  // latent in the block
          const int g = g0 + lg;
          int lo = 0, hi = 0;
          if (!row_bad && g < a.g) {
            double u0 = acc[mt][nt][2 * h], u1 = acc[mt][nt][2 * h + 1];
            if constexpr (kFp16) {  // powers of two: exact
              u0 *= static_cast<double>(e_scale[g]);
              u1 *= static_cast<double>(e_scale[g + 1]);  // padded rows: scale 1
            }
            lo = Quantize(u0 + static_cast<double>(e_bias[g]), a.thr);
            if (g + 1 < a.g) hi = Quantize(u1 + static_cast<double>(e_bias[g + 1]), a.thr);
          }
          codes[r * kRowBytes + lg / 2] =
              static_cast<uint8_t>((lo + 8) | (g + 1 < a.g ? (hi + 8) << 4 : 0));
        }
      }
    }
    __syncthreads();

    // Report bad rows once (the first latent block), then write the code rows.
    if (a.has_check && blockIdx.x == 0 && tid % 2 == 0 && bad_rows[x_row] > 0 &&
        my_t < a.dst.num_tokens) {
      StoreRow sr{};
      sr.layer = layer;
      sr.token = my_t;
      sr.which = 0;
      ReportBadRow(a.check, sr, layer * a.dst.num_tokens + my_t, bad_rows[x_row]);
    }
    const int64_t byte0 = g0 / 2;
    for (int i = tid; i < kTcTokens * kRowBytes; i += kTcThreads) {
      const int r = i / kRowBytes, b = i % kRowBytes;
      const int64_t t = t0 + r;
      if (t >= a.dst.num_tokens || byte0 + b >= cb) continue;
      const int64_t at = a.dst.slots != nullptr ? a.dst.slots[t] : a.dst.inline_slots[t];
      const int64_t page = at / a.dst.page_size, slot = at - page * a.dst.page_size;
      a.dst.base[layer * a.dst.layer_stride + page * a.dst.page_bytes + a.codes_offset + slot * cb +
                 byte0 + b] = codes[r * kRowBytes + b];
    }
  }
}

// One block per (padded) row g: E[g] into the operand planes (zero padding), and for FP16
// the row's power-of-two scale 2^k (max |E_g| 2^k in [2^14, 2^15); 1 for a zero row) applied
// before rounding, its inverse stored after the planes.
__global__ void PrepareEncoderKernel(const float* e, int32_t c, int32_t g, int64_t cp, int64_t gp,
                                     int planes, bool fp16, uint16_t* out) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const float* er = e + row * c;
  float scale = 1.0f;
  if (fp16) {
    float m = 0.0f;
    if (row < g) {
      for (int i = threadIdx.x; i < c; i += blockDim.x) m = fmaxf(m, fabsf(er[i]));
    }
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0.0f;
    for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) m = fmaxf(m, red[i]);
    int ex = 0;
    if (m > 0.0f) (void)frexpf(m, &ex);  // m = f 2^ex, f in [0.5, 1)
    // 2^k with k = 15 - ex, kept within F32's normal range (rows beyond it, |E| < 2^-111,
    // lose precision instead).
    const int k = m > 0.0f ? min(max(15 - ex, -126), 126) : 0;
    scale = ldexpf(1.0f, k);
    if (threadIdx.x == 0) reinterpret_cast<float*>(out + planes * gp * cp)[row] = ldexpf(1.0f, -k);
  }
  for (int64_t col = threadIdx.x; col < cp; col += blockDim.x) {
    const float v = row < g && col < c ? er[col] * scale : 0.0f;
    const int64_t i = row * cp + col;
    if (fp16) {
      const __half h = __float2half_rn(v);
      out[i] = *reinterpret_cast<const uint16_t*>(&h);
    } else {
      const __nv_bfloat16 hi = __float2bfloat16_rn(v);
      out[i] = *reinterpret_cast<const uint16_t*>(&hi);
      if (planes == 2) {
        const __nv_bfloat16 lo = __float2bfloat16_rn(v - __bfloat162float(hi));
        out[gp * cp + i] = *reinterpret_cast<const uint16_t*>(&lo);
      }
    }
  }
}

int Planes(FsqTcOperands ops) { return ops == FsqTcOperands::kBf16Split ? 2 : 1; }
bool ValidOps(FsqTcOperands ops) {
  return ops == FsqTcOperands::kBf16 || ops == FsqTcOperands::kBf16Split ||
         ops == FsqTcOperands::kFp16;
}

template <int kPlanes>
size_t TcSmemBytes() {
  return size_t{2} * (1 + kPlanes) * kTcTileElems * sizeof(uint16_t);
}

template <int kPlanes, bool kBf16, bool kFp16, int kMinBlocks>
Error LaunchTcBlocks(const TcArgs& a, dim3 grid, cudaStream_t stream) {
  const size_t smem = TcSmemBytes<kPlanes>();
  const cudaError_t attr =
      RaiseDynamicSmem<FsqEncodeTcKernel<kPlanes, kBf16, kFp16, kMinBlocks>>(smem);
  if (attr != cudaSuccess) return ToError(attr);
  FsqEncodeTcKernel<kPlanes, kBf16, kFp16, kMinBlocks><<<grid, kTcThreads, smem, stream>>>(a);
  return ToError(cudaGetLastError());
}

template <int kPlanes, bool kBf16, bool kFp16>
Error LaunchTc(const TcArgs& a, dim3 grid, cudaStream_t stream) {
  static const bool one_block = [] {
    const char* v = std::getenv("KVCD_FSQ_TC_BLOCKS_PER_SM");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return one_block ? LaunchTcBlocks<kPlanes, kBf16, kFp16, 1>(a, grid, stream)
                   : LaunchTcBlocks<kPlanes, kBf16, kFp16, 2>(a, grid, stream);
}

}  // namespace

size_t FsqEncoderTcBytes(int32_t residual_width, int32_t latent_width, FsqTcOperands ops) {
  const int64_t gp = PaddedLatents(latent_width);
  return static_cast<size_t>(Planes(ops) * gp * PaddedResidual(residual_width) * 2 +
                             (ops == FsqTcOperands::kFp16 ? gp * 4 : 0));
}

Error LaunchFsqPrepareEncoderTc(const float* encoder, int32_t residual_width, int32_t latent_width,
                                FsqTcOperands ops, void* prepared, cudaStream_t stream) {
  KVCD_CUDA_BIND_THREAD();
  if (encoder == nullptr || prepared == nullptr || residual_width < 1 || latent_width < 1 ||
      latent_width > kFsqMaxLatent || !ValidOps(ops) ||
      reinterpret_cast<uintptr_t>(prepared) % 16 != 0) {
    return ToError(cudaErrorInvalidValue);
  }
  const int64_t gp = PaddedLatents(latent_width);
  PrepareEncoderKernel<<<static_cast<unsigned>(gp), 256, 0, stream>>>(
      encoder, residual_width, latent_width, PaddedResidual(residual_width), gp, Planes(ops),
      ops == FsqTcOperands::kFp16, static_cast<uint16_t*>(prepared));
  return ToError(cudaGetLastError());
}

Error LaunchFsqEncodeRowsTc(const RowBlock& x, const PagedRows& dst, int64_t codes_offset,
                            const FsqLayerCodec* layer_codecs, const void* prepared,
                            int32_t residual_width, int32_t latent_width, FsqTcOperands ops,
                            cudaStream_t stream, const StoreCheck* check) {
  KVCD_CUDA_BIND_THREAD();
  if (x.data == nullptr || dst.base == nullptr || layer_codecs == nullptr || prepared == nullptr ||
      reinterpret_cast<uintptr_t>(prepared) % 16 != 0 || residual_width < 1 || latent_width < 1 ||
      latent_width > kFsqMaxLatent || dst.page_size < 1 || dst.num_layers < 1 ||
      dst.num_tokens < 0 || codes_offset < 0 || !ValidOps(ops) ||
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
  TcArgs a{};
  a.x = x;
  a.dst = dst;
  a.codes_offset = codes_offset;
  a.codecs = layer_codecs;
  a.prepared = static_cast<const uint16_t*>(prepared);
  a.cp = PaddedResidual(residual_width);
  a.plane_elems = PaddedLatents(latent_width) * a.cp;
  a.layer_elems = static_cast<int64_t>(FsqEncoderTcBytes(residual_width, latent_width, ops)) / 2;
  a.c = residual_width;
  a.g = latent_width;
  a.k_steps = static_cast<int32_t>(a.cp / kTcK);
  a.token_tiles = (dst.num_tokens + kTcTokens - 1) / kTcTokens;
  const int64_t elem = x.bf16 ? 2 : 4, vec = 16 / elem;
  a.vector_x = reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && residual_width % kTcK == 0 &&
               x.token_stride % vec == 0 && x.layer_stride % vec == 0;
  a.thr = thr;
  a.has_check = check != nullptr;
  if (check != nullptr) a.check = *check;
  const dim3 grid(static_cast<unsigned>(PaddedLatents(latent_width) / kTcLatents),
                  static_cast<unsigned>(a.token_tiles < 65535 ? a.token_tiles : 65535),
                  static_cast<unsigned>(dst.num_layers));
  switch (ops) {
    case FsqTcOperands::kBf16:
      return x.bf16 ? LaunchTc<1, true, false>(a, grid, stream)
                    : LaunchTc<1, false, false>(a, grid, stream);
    case FsqTcOperands::kBf16Split:
      return x.bf16 ? LaunchTc<2, true, false>(a, grid, stream)
                    : LaunchTc<2, false, false>(a, grid, stream);
    case FsqTcOperands::kFp16:
      break;
  }
  return x.bf16 ? LaunchTc<1, true, true>(a, grid, stream)
                : LaunchTc<1, false, true>(a, grid, stream);
}

}  // namespace kvcd::kernels::cuda
