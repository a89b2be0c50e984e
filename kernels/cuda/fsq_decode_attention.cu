// FSQ decode attention on the GPU (cuda_fsq.h), the FP16 variant (the reference one): the
// kernel is fsq_decode_kernel.cuh's with its key rebuild on m16n8k16 FP16 MMAs; here the
// decoder's preparation (W_k as FP16 B fragments, rows scaled by their max |w|: FP16's 11-bit
// significand on values in [-1, 1] gives each weight a relative error <= 2^-12) and the
// launchers.
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "fsq_decode_kernel.cuh"
#include "kvcd/kernels/cuda_fsq.h"

namespace kvcd::kernels::cuda {
namespace {

// Prepared decoder: the FP16 B fragments, then (scale, bias) per dim.
size_t FragBytes(int hkv, int d, int latent) {
  return static_cast<size_t>(hkv) * ((latent + 15) / 16) * (d / 8) * 32 * sizeof(uint2);
}

// col[row] = (max |W_k[row]| or 1 if 0, b_k[row]); one warp per row.
__global__ void FsqRowScaleKernel(const float* w_k, const float* b_k, int nrows, int latent,
                                  float2* col) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (row >= nrows) return;
  float mx = 0.0f;
  for (int k = lane; k < latent; k += 32)
    mx = fmaxf(mx, fabsf(w_k[static_cast<int64_t>(row) * latent + k]));
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) col[row] = make_float2(mx > 0.0f ? mx : 1.0f, b_k[row]);
}

// Fragment (head, slice s, n-tile n, lane): halves W[8n + g][16 s + 2t + {0, 1, 8, 9}] / scale.
__global__ void FsqFragKernel(const float* w_k, const float2* col, int hkv, int d, int latent,
                              uint2* frags) {
  const int slices = (latent + 15) / 16, nt = d / 8;
  const int64_t total = static_cast<int64_t>(hkv) * slices * nt * 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int lane = static_cast<int>(i % 32);
  const int n = static_cast<int>((i / 32) % nt);
  const int s = static_cast<int>((i / 32 / nt) % slices);
  const int h = static_cast<int>(i / 32 / nt / slices);
  const int g = lane >> 2, t = lane & 3;
  const int64_t row = static_cast<int64_t>(h) * d + 8 * n + g;
  const float inv = 1.0f / col[row].x;
  float w[4];
  const int ks[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
  for (int k = 0; k < 4; ++k) {
    const int lat = 16 * s + ks[k];
    w[k] = lat < latent ? w_k[row * latent + lat] * inv : 0.0f;
  }
  const __half2 lo = __floats2half2_rn(w[0], w[1]), hi = __floats2half2_rn(w[2], w[3]);
  frags[i] =
      make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

}  // namespace

size_t FsqDecoderBytes(int num_kv_heads, int head_dim, int latent_width) {
  return FragBytes(num_kv_heads, head_dim, latent_width) +
         static_cast<size_t>(num_kv_heads) * head_dim * sizeof(float2);
}

Error LaunchFsqPrepareDecoder(const FsqLayerCodec& codec, void* prepared, cudaStream_t stream) {
  KVCD_CUDA_BIND_THREAD();
  const int hkv = codec.num_kv_heads, d = codec.head_dim, G = codec.latent_width;
  if (prepared == nullptr || codec.decoder_k == nullptr || codec.bias_k == nullptr || hkv < 1 ||
      d < 8 || d % 8 != 0 || G < 1 || G > kFsqMaxLatent ||
      reinterpret_cast<uintptr_t>(prepared) % 16 != 0) {
    return ToError(cudaErrorInvalidValue);
  }
  auto* frags = static_cast<uint2*>(prepared);
  auto* col = reinterpret_cast<float2*>(static_cast<uint8_t*>(prepared) + FragBytes(hkv, d, G));
  const int nrows = hkv * d;
  FsqRowScaleKernel<<<(nrows + 7) / 8, 256, 0, stream>>>(codec.decoder_k, codec.bias_k, nrows, G,
                                                         col);
  const int64_t total = static_cast<int64_t>(hkv) * ((G + 15) / 16) * (d / 8) * 32;
  FsqFragKernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
      codec.decoder_k, col, hkv, d, G, frags);
  return ToError(cudaGetLastError());
}

size_t FsqDecodeWorkspaceBytes(int batch, int num_q_heads, int latent_width, int splits) {
  const size_t rows = static_cast<size_t>(batch) * num_q_heads;
  const size_t gp = static_cast<size_t>((latent_width + 15) / 16) * 16;
  return static_cast<size_t>(splits) * rows * (gp + 1) * sizeof(float);
}

int FsqDecodeSplits(int batch, int num_kv_heads, int max_tokens, int num_sms) {
  // One CTA per SM (a wave), each warp of a split at least one tile: at 2,048 tokens, batch 1
  // (H100, session 25, bench/run-h200-fsq-fixed.sh) 4 splits (four tiles a warp, the rule
  // before) took 80.1 us, 8 61.4, 16 55.7, 32 (half a tile a warp) 63.2.
  const int64_t ctas = int64_t{batch} * num_kv_heads;
  const int64_t want = int64_t{num_sms} / ctas;  // no second, partial wave
  const int64_t most = (int64_t{max_tokens} + kWarps * kTile - 1) / (kWarps * kTile);
  const int64_t s = want < most ? want : most;
  return static_cast<int>(s < 1 ? 1 : s);
}

Error LaunchFsqDecodeParts(const PagedList& list, const DecodeGeometry& geo,
                           const FsqDecodeArgs& args, int max_tokens, float* part_o,
                           float* part_lse, int part_base, cudaStream_t stream,
                           const MergeTarget* merge) {
  KVCD_CUDA_BIND_THREAD();
  return LaunchFsqDecode<false>(list, geo, args, max_tokens, part_o, part_lse, part_base, stream,
                                merge,
                                FragBytes(geo.num_kv_heads, geo.head_dim, args.codec.latent_width));
}

}  // namespace kvcd::kernels::cuda
