// Paged copies (cuda_page_copy.h): a grid-stride loop over 16-byte words (or bytes) of the
// run; word w of the run is byte 16w of layer page (w / words_per_layer_page), which is
// page p = item / num_layers, layer l = item % num_layers.
#include <cstdint>

#include "cuda_error.cuh"
#include "device_binding.cuh"
#include "kvcd/kernels/call_counts.h"
#include "kvcd/kernels/cuda_page_copy.h"

namespace kvcd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned CheckHalf(uint16_t h, int64_t index, uint32_t check,
                                              uint32_t block) {
  if (check == kCheckBf16Finite) return (h & 0x7f80u) == 0x7f80u ? 1u : 0u;
  if (check == kCheckF32Finite) return (index & 1) != 0 && (h & 0x7f80u) == 0x7f80u ? 1u : 0u;
  if (check == kCheckFp16ScaleMin) {
    if ((h & 0x7c00u) == 0x7c00u) return 1u;  // Inf or NaN
    const bool is_scale = block == 0 || (index / block) % 2 == 0;
    return is_scale && (h & 0x8000u) != 0 && (h & 0x7fffu) != 0 ? 1u : 0u;
  }
  return 0u;
}

// Counts the failing 16-bit values among `n` halves starting at byte `off` of a layer page.
__device__ __forceinline__ unsigned CheckHalves(const uint16_t* h, int n, int64_t off,
                                                const PagedCopyArgs& a) {
  unsigned bad = 0;
  for (int k = 0; k < n; ++k) {
    const int64_t b = off + 2 * k - a.check_offset;
    if (b >= 0 && b < a.check_bytes) bad += CheckHalf(h[k], b / 2, a.check, a.check_block);
  }
  return bad;
}

template <bool kVec>
__global__ void PagedCopyKernel(int kind, PagedCopyArgs a, unsigned long long* bad) {
  constexpr int64_t kUnit = kVec ? 16 : 2;
  const int64_t per_page = a.layer_bytes / kUnit;
  const int64_t total = per_page * a.num_layers * a.num_pages;
  unsigned local_bad = 0;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < total;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t item = w / per_page;
    const int64_t off = (w - item * per_page) * kUnit;
    uint8_t* run = a.run + item * a.layer_bytes + off;
    uint8_t* pool = nullptr;
    if (kind != static_cast<int>(PageCopy::kCheck)) {
      const int64_t page = item / a.num_layers;
      const int64_t layer = item - page * a.num_layers;
      pool = a.pool + layer * a.pool_layer_stride + a.page_ids[page] * a.layer_bytes + off;
    }
    const uint8_t* src = kind == static_cast<int>(PageCopy::kGather) ? pool : run;
    uint8_t* dst = kind == static_cast<int>(PageCopy::kScatter)  ? pool
                   : kind == static_cast<int>(PageCopy::kGather) ? run
                                                                 : nullptr;
    if constexpr (kVec) {
      const uint4 v = *reinterpret_cast<const uint4*>(src);
      if (dst != nullptr) *reinterpret_cast<uint4*>(dst) = v;
      if (a.check != kCheckNone) {
        const uint16_t h[8] = {static_cast<uint16_t>(v.x), static_cast<uint16_t>(v.x >> 16),
                               static_cast<uint16_t>(v.y), static_cast<uint16_t>(v.y >> 16),
                               static_cast<uint16_t>(v.z), static_cast<uint16_t>(v.z >> 16),
                               static_cast<uint16_t>(v.w), static_cast<uint16_t>(v.w >> 16)};
        local_bad += CheckHalves(h, 8, off, a);
      }
    } else {
      const uint16_t v = static_cast<uint16_t>(src[0] | (src[1] << 8));
      if (dst != nullptr) {
        dst[0] = src[0];
        dst[1] = src[1];
      }
      if (a.check != kCheckNone) local_bad += CheckHalves(&v, 1, off, a);
    }
  }
  if (local_bad != 0 && bad != nullptr) atomicAdd(bad, static_cast<unsigned long long>(local_bad));
}

}  // namespace

Error LaunchPagedCopy(PageCopy kind, const PagedCopyArgs& a, unsigned long long* bad,
                      cudaStream_t stream) {
  KVCD_CUDA_BIND_THREAD();
  if (a.num_pages < 0 || a.num_layers <= 0 || a.layer_bytes <= 0 || a.layer_bytes % 2 != 0 ||
      a.check_offset % 2 != 0 || a.check_bytes % 2 != 0 || a.run == nullptr ||
      (kind != PageCopy::kCheck && (a.pool == nullptr || a.page_ids == nullptr)) ||
      (a.check != kCheckNone && bad == nullptr)) {
    return ToError(cudaErrorInvalidValue);
  }
  if (a.num_pages == 0) return Error();
  const bool vec =
      ((reinterpret_cast<uintptr_t>(a.pool) | reinterpret_cast<uintptr_t>(a.run) |
        static_cast<uintptr_t>(a.layer_bytes) | static_cast<uintptr_t>(a.pool_layer_stride)) &
       15u) == 0;
  const int64_t units = a.layer_bytes / (vec ? 16 : 2) * a.num_layers * a.num_pages;
  // Enough blocks to fill the GPU several times over; each thread strides through the rest.
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const int64_t want = (units + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 16LL * sms ? want : 16LL * sms);
  CountLaunch();
  if (vec) {
    PagedCopyKernel<true><<<blocks, kThreads, 0, stream>>>(static_cast<int>(kind), a, bad);
  } else {
    PagedCopyKernel<false><<<blocks, kThreads, 0, stream>>>(static_cast<int>(kind), a, bad);
  }
  return ToError(cudaGetLastError());
}

}  // namespace kvcd::kernels::cuda
