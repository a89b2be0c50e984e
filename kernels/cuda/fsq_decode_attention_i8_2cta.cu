// FSQ decode attention on int8 tensor cores at two CTAs per SM (fsq_decode_2cta.cuh,
// cuda_fsq_i8.h kInt8Occ2): fsq_decode_kernel.cuh's int8 kernel with kOcc2 (at most 128
// registers a thread, steps 1-3 in passes over the key's n-tiles, one shared-memory region
// for the tiles and the warps' states), launched where the device holds two of its CTAs per
// SM; the one-CTA int8 kernel elsewhere (shared memory past half an SM: d 256 with G past
// 160).
#include <atomic>
#include <cstdint>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "fsq_decode_2cta.cuh"
#include "fsq_decode_kernel.cuh"
#include "kvcd/kernels/cuda_fsq.h"
#include "kvcd/kernels/cuda_fsq_i8.h"
#include "kvcd/kernels/fsq_i8_fragments.h"

namespace kvcd::kernels::cuda {
namespace {

// CTAs of kKernel an SM holds with `smem` bytes of dynamic shared memory, into *n. The shared
// memory of two CTAs needs the largest carveout: asked for here (a function's attribute,
// kept), with the dynamic limit, before the residency and before the kernel's first launch.
template <auto kKernel>
cudaError_t Residency(size_t smem, int* n) {
  cudaError_t err = RaiseDynamicSmem<kKernel>(smem);
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. more shared memory than the device gives a CTA
    return err;
  }
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, kKernel, kWarps * 32, smem);
}

// The two-CTA instantiation's residency for (head_dim, G) on the current device: the kernel
// LaunchFsqDecode<true, true> launches (MTOK 1, MT by G) with its shared memory, as the device
// reports it; 0 for a geometry the kernel does not take, or where the device refuses that much
// shared memory. The device is asked once per (device, head_dim, G, fixed) and its answer
// kept: the split count and the launch of every layer's call need it. fixed: of the instance
// with the code size compiled in where FsqOcc2Specialized names the geometry.
int Occ2Residency(int head_dim, int G, bool fixed) {
  const int dim_at = head_dim == 64 ? 0 : head_dim == 128 ? 1 : head_dim == 256 ? 2 : -1;
  if (G < 1 || G > kFsqCudaMaxLatent || dim_at < 0) return 0;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  // residency + 1; 0: not yet
  static std::atomic<int8_t> known[64][2][3][kFsqCudaMaxLatent + 1];
  std::atomic<int8_t>* const slot =
      dev >= 0 && dev < 64 ? &known[dev][fixed ? 1 : 0][dim_at][G] : nullptr;
  if (slot != nullptr) {
    if (const int v = slot->load(std::memory_order_relaxed); v > 0) return v - 1;
  }
  int n = 0;
  const cudaError_t e = DispatchHeadDim(head_dim, [&](auto hd) -> cudaError_t {
    constexpr int D = decltype(hd)::value;
    const int kchunks = (G + 31) / 32;
    const int stage = StageBytes(static_cast<int>(FsqCodeBytes(G)), kTile);
    // The instance LaunchFsqDecode<true, true> launches for this geometry.
    if constexpr (D == kFsqOcc2SpecD) {
      if (fixed && FsqOcc2Specialized(D, static_cast<int>(FsqCodeBytes(G)))) {
        return Residency<FsqDecodeKernel<D, 16, 1, true, true, kFsqOcc2SpecCb>>(
            SmemBytes<D, 16, 1, true>(stage, kchunks), &n);
      }
    }
    return (G + 15) / 16 <= 8 ? Residency<FsqDecodeKernel<D, 8, 1, true, true>>(
                                    SmemBytes<D, 8, 1, true>(stage, kchunks), &n)
                              : Residency<FsqDecodeKernel<D, 16, 1, true, true>>(
                                    SmemBytes<D, 16, 1, true>(stage, kchunks), &n);
  });
  if (e != cudaSuccess) return 0;
  if (slot != nullptr) slot->store(static_cast<int8_t>(n + 1), std::memory_order_relaxed);
  return n;
}

}  // namespace

int FsqI8TwoCtaPerSm(int head_dim, int latent_width, bool fixed_size) {
  if (!BindThread().ok()) return 1;
  const int n = Occ2Residency(head_dim, latent_width, fixed_size);
  return n >= 2 ? n : 1;
}

Error LaunchFsqDecodeI8TwoCta(const PagedList& list, const DecodeGeometry& geo,
                              const FsqDecodeArgs& args, int max_tokens, float* part_o,
                              float* part_lse, int part_base, cudaStream_t stream,
                              const MergeTarget* merge, bool fixed_size) {
  KVCD_CUDA_BIND_THREAD();
  if (Occ2Residency(geo.head_dim, args.codec.latent_width, fixed_size) < 2) {
    return LaunchFsqDecodeParts(FsqKeyKernel::kInt8, list, geo, args, max_tokens, part_o, part_lse,
                                part_base, stream, merge);
  }
  return LaunchFsqDecode<true, true>(
      list, geo, args, max_tokens, part_o, part_lse, part_base, stream, merge,
      FsqI8FragBytes(geo.num_kv_heads, geo.head_dim, args.codec.latent_width), fixed_size);
}

}  // namespace kvcd::kernels::cuda
