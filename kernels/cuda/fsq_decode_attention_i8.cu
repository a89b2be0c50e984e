// FSQ decode attention with the key rebuild on int8 tensor cores (cuda_fsq_i8.h): the int8
// decoder's preparation, and the one dispatch between the two variants.
//
// Prepared decoder: [Hkv][ceil(G / 32)][d / 8][32 lanes] uint2 B fragments of m16n8k32 (the
// lane 4g + t of k-step s and n-tile n holds dim 8n + g; b0's byte i the weight of latent
// 32 s + 8 t + 2 i, b1's byte i that of latent 32 s + 8 t + 2 i + 1: the order in which the
// kernel's A fragments take the nibbles of one 4-byte word of codes; latents >= G are 0),
// then [Hkv * d] float2 (scale, b_k - 8 scale sum_k q[k] - 1.5 * 2^23 scale) per dim: the
// codes enter as their nibbles z + 8 and the accumulators start at the bits of 1.5 * 2^23
// (fsq_decode_kernel.cuh KeyAccBase), so K = scale * acc + that bias, one FMA. The bias
// is rounded once to float: ~2^-24 of 1.5 * 2^23 scale = 0.75 scale (a key element is
// ~ thousands of scale at G 256: ~1e-4 of it), the same for every token.
#include <cstdint>
#include <type_traits>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "fsq_decode_2cta.cuh"
#include "fsq_decode_kernel.cuh"
#include "kvcd/kernels/cuda_fsq.h"
#include "kvcd/kernels/cuda_fsq_i8.h"
#include "kvcd/kernels/fsq_i8_fragments.h"

namespace kvcd::kernels::cuda {
namespace {

// One warp per row of W_k: FsqQuantizeKeyRow's arithmetic, the bytes into their fragment
// slots (every slot of the row's k-steps, padding latents 0), then (scale, bias) of the row.
__global__ void FsqPrepareI8Kernel(const float* w_k, const float* b_k, int nrows, int d, int latent,
                                   uint8_t* frags, float2* col) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (row >= nrows) return;
  const float* w = w_k + static_cast<int64_t>(row) * latent;
  float mx = 0.0f;
  for (int k = lane; k < latent; k += 32) mx = fmaxf(mx, fabsf(w[k]));
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float inv = mx > 0.0f ? __fdiv_rn(127.0f, mx) : 0.0f;
  const int ksteps = (latent + 31) / 32;
  const int h = row / d, dim = row % d;
  int sum = 0;
  for (int k = lane; k < 32 * ksteps; k += 32) {
    int v = 0;
    if (k < latent) {
      v = static_cast<int>(fminf(fmaxf(rintf(__fmul_rn(w[k], inv)), -127.0f), 127.0f));
    }
    sum += v;
    frags[FsqI8WeightByte(h, dim, k, ksteps, d)] = static_cast<uint8_t>(static_cast<int8_t>(v));
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    const float scale = mx > 0.0f ? __fdiv_rn(mx, 127.0f) : 1.0f;
    col[row] = make_float2(scale, FsqI8Bias(b_k[row], scale, sum));
  }
}

template <FsqKeyKernel K>
using KeyKernel = std::integral_constant<FsqKeyKernel, K>;

// fn(KeyKernel<kernel>{}) for the kernel, `invalid` for another value.
template <class R, class Fn>
R WithKeyKernel(FsqKeyKernel kernel, Fn&& fn, R invalid) {
  switch (kernel) {
    case FsqKeyKernel::kFp16:
      return fn(KeyKernel<FsqKeyKernel::kFp16>{});
    case FsqKeyKernel::kInt8:
      return fn(KeyKernel<FsqKeyKernel::kInt8>{});
    case FsqKeyKernel::kInt8Occ2:
      return fn(KeyKernel<FsqKeyKernel::kInt8Occ2>{});
    case FsqKeyKernel::kInt8Occ2Fixed:
      return fn(KeyKernel<FsqKeyKernel::kInt8Occ2Fixed>{});
  }
  return invalid;
}

}  // namespace

size_t FsqDecoderBytes(FsqKeyKernel kernel, int num_kv_heads, int head_dim, int latent_width) {
  if (kernel == FsqKeyKernel::kFp16) return FsqDecoderBytes(num_kv_heads, head_dim, latent_width);
  return FsqI8FragBytes(num_kv_heads, head_dim, latent_width) +
         static_cast<size_t>(num_kv_heads) * head_dim * sizeof(float2);
}

Error LaunchFsqPrepareDecoder(FsqKeyKernel kernel, const FsqLayerCodec& codec, void* prepared,
                              cudaStream_t stream) {
  KVCD_CUDA_BIND_THREAD();
  return WithKeyKernel(
      kernel,
      [&](auto k) -> Error {
        if constexpr (decltype(k)::value == FsqKeyKernel::kFp16) {
          return LaunchFsqPrepareDecoder(codec, prepared, stream);
        } else {  // both int8 kernels take the same decoder
          const int hkv = codec.num_kv_heads, d = codec.head_dim, G = codec.latent_width;
          if (prepared == nullptr || codec.decoder_k == nullptr || codec.bias_k == nullptr ||
              hkv < 1 || d < 8 || d % 8 != 0 || G < 1 || G > kFsqCudaMaxLatent ||
              reinterpret_cast<uintptr_t>(prepared) % 16 != 0) {
            return ToError(cudaErrorInvalidValue);
          }
          auto* frags = static_cast<uint8_t*>(prepared);
          auto* col = reinterpret_cast<float2*>(frags + FsqI8FragBytes(hkv, d, G));
          const int nrows = hkv * d;
          FsqPrepareI8Kernel<<<(nrows + 7) / 8, 256, 0, stream>>>(codec.decoder_k, codec.bias_k,
                                                                  nrows, d, G, frags, col);
          return ToError(cudaGetLastError());
        }
      },
      ToError(cudaErrorInvalidValue));
}

Error LaunchFsqDecodeParts(FsqKeyKernel kernel, const PagedList& list, const DecodeGeometry& geo,
                           const FsqDecodeArgs& args, int max_tokens, float* part_o,
                           float* part_lse, int part_base, cudaStream_t stream,
                           const MergeTarget* merge) {
  KVCD_CUDA_BIND_THREAD();
  return WithKeyKernel(
      kernel,
      [&](auto k) -> Error {
        constexpr FsqKeyKernel K = decltype(k)::value;
        if constexpr (K == FsqKeyKernel::kFp16) {
          return LaunchFsqDecodeParts(list, geo, args, max_tokens, part_o, part_lse, part_base,
                                      stream, merge);
        } else if constexpr (K == FsqKeyKernel::kInt8) {
          return LaunchFsqDecode<true>(
              list, geo, args, max_tokens, part_o, part_lse, part_base, stream, merge,
              FsqI8FragBytes(geo.num_kv_heads, geo.head_dim, args.codec.latent_width));
        } else {
          return LaunchFsqDecodeI8TwoCta(list, geo, args, max_tokens, part_o, part_lse, part_base,
                                         stream, merge,
                                         /*fixed_size=*/K == FsqKeyKernel::kInt8Occ2Fixed);
        }
      },
      ToError(cudaErrorInvalidValue));
}

int FsqDecodeSplits(FsqKeyKernel kernel, const DecodeGeometry& geo, int latent_width,
                    int max_tokens, int num_sms) {
  const int per_sm = WithKeyKernel(
      kernel,
      [&](auto k) {
        constexpr FsqKeyKernel K = decltype(k)::value;
        return K == FsqKeyKernel::kInt8Occ2 || K == FsqKeyKernel::kInt8Occ2Fixed
                   ? FsqI8TwoCtaPerSm(geo.head_dim, latent_width,
                                      /*fixed_size=*/K == FsqKeyKernel::kInt8Occ2Fixed)
                   : 1;
      },
      1);
  return FsqDecodeSplits(geo.batch, geo.num_kv_heads, max_tokens, num_sms * per_sm);
}

}  // namespace kvcd::kernels::cuda
