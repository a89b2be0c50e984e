// Demote and paged INT2 store throughput on the device (#20): quantize-on-demote of BF16
// rows (d = 128) with no rotation, the Hadamard (butterflies) and a dense FP32 rotation, by
// the grouped and the warp-per-row kernel, at the K and V clips; the paged INT2 row store
// that Put over CUDA IPC launches (Qwen3-8B geometry, every layer in one launch) with the
// Hadamard flagged, the same matrix applied densely, and no rotation; the read ceiling
// (a large read-only reduction) in the same run. Figures: TB/s of BF16 consumed (2 bytes per
// value read), median of the timed repetitions.
//   cuda_demote_bench [--rows N] [--tokens T] [--reps R]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/cuda_demote.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/int2_codec.h"

namespace kk = kvcd::kernels;
namespace kc = kvcd::kernels::cuda;

namespace {

constexpr int kD = 128, kLayers = 36, kHkv = 8, kPs = 64;

__global__ void FillBf16(uint16_t* out, int64_t n, uint32_t seed) {  // values in (-4, 4)
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 0x2c1b3c6du;
    x ^= x >> 12;
    const float f = (static_cast<float>(x & 0xffffff) / 16777216.0f - 0.5f) * 8.0f;
    out[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);
  }
}

template <class T>
T* Alloc(size_t n) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

// Median seconds of one call of fn, two warm-up calls first.
template <class F>
double MedianSeconds(int reps, F fn) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int it = 0; it < reps + 2; ++it) {
    CHECK(cudaEventRecord(a));
    fn();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (it >= 2) ms.push_back(t);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1e-3;
}

std::vector<float> Hadamard(int d) {
  std::vector<float> h(static_cast<size_t>(d) * d);
  const float c = 1.0f / std::sqrt(static_cast<float>(d));
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) h[i * d + j] = __builtin_popcount(i & j) % 2 ? -c : c;
  return h;
}

const char* KindName(kk::Rotation k) {
  return k == kk::Rotation::kNone ? "none" : k == kk::Rotation::kHadamard ? "hadamard" : "dense";
}

}  // namespace

ABSL_FLAG(int64_t, rows, int64_t{8} << 20, "rows of the read ceiling (8Mi rows: 2 GiB of BF16)");
ABSL_FLAG(int64_t, tokens, 32768, "tokens demoted per call");
ABSL_FLAG(int32_t, reps, 5, "repetitions (medians)");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_demote_bench",
      .summary = "demote and paged INT2 store throughput on the device",
      .files = {__FILE__},
      .synopsis = "[--rows N] [--tokens N] [--reps N]"};
  kvcd::cli::Parse(program, argc, argv);
  const int64_t n = absl::GetFlag(FLAGS_rows);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const int reps = absl::GetFlag(FLAGS_reps);
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  // Read ceiling.
  {
    const int64_t bytes = int64_t{4} << 30;
    uint4* p = Alloc<uint4>(bytes / 16);
    CHECK(cudaMemset(p, 1, bytes));
    unsigned* sink = Alloc<unsigned>(1);
    const double t = MedianSeconds(
        reps, [&] { ReadReduce<<<prop.multiProcessorCount * 8, 512>>>(p, bytes / 16, sink); });
    std::printf("read ceiling: %.3f TB/s (4 GiB read-only reduction)\n", bytes / t / 1e12);
    CHECK(cudaFree(p));
    CHECK(cudaFree(sink));
  }

  const std::vector<float> h = Hadamard(kD);
  float* d_h = Upload(h);
  std::vector<float> dense(static_cast<size_t>(kD) * kD);
  for (size_t i = 0; i < dense.size(); ++i) dense[i] = ((i * 7919) % 255 - 127) / 1024.0f;
  float* d_dense = Upload(dense);

  // Demote.
  {
    uint16_t* rows = Alloc<uint16_t>(n * kD);
    uint8_t* codes = Alloc<uint8_t>(n * kD / 4);
    uint16_t* params = Alloc<uint16_t>(2 * n);
    FillBf16<<<4096, 256>>>(rows, n * kD, 11u);
    CHECK(cudaGetLastError());
    const kk::Int2RowRef out = kk::Int2RowRef::RowMajor(codes, kD / 4, params, params + 1, 2);
    std::printf("\ndemote of %lld BF16 rows, d = %d (%.2f GB):\n", static_cast<long long>(n), kD,
                n * kD * 2 / 1e9);
    std::printf("| rotation | rho | kernel | ms | TB/s |\n|---|---|---|---:|---:|\n");
    for (kk::Rotation kind : {kk::Rotation::kNone, kk::Rotation::kHadamard, kk::Rotation::kDense}) {
      const float* rot = kind == kk::Rotation::kHadamard ? d_h
                         : kind == kk::Rotation::kDense  ? d_dense
                                                         : nullptr;
      for (float rho : {0.96f, 0.92f}) {
        for (kc::DemoteKernel kernel :
             {kc::DemoteKernel::kWarpPerRow, kc::DemoteKernel::kGrouped}) {
          if (kind == kk::Rotation::kDense && kernel == kc::DemoteKernel::kGrouped) continue;
          const double t = MedianSeconds(reps, [&] {
            CHECK(kc::LaunchDemoteInt2(rows, n, kD, rot, kind, rho, out, 0, nullptr, kernel));
          });
          std::printf("| %s | %.2f | %s | %.3f | %.3f |\n", KindName(kind), rho,
                      kernel == kc::DemoteKernel::kGrouped ? "grouped" : "warp-per-row", t * 1e3,
                      n * kD * 2 / t / 1e12);
        }
      }
    }
    CHECK(cudaFree(rows));
    CHECK(cudaFree(codes));
    CHECK(cudaFree(params));
  }

  // The paged INT2 store of a Put over CUDA IPC: every layer, K and V, in one launch.
  {
    const int64_t elems = int64_t{kLayers} * tokens * kHkv * kD;
    uint16_t* src = Alloc<uint16_t>(2 * elems);
    FillBf16<<<4096, 256>>>(src, 2 * elems, 7u);
    CHECK(cudaGetLastError());
    const int64_t pages = (tokens + kPs - 1) / kPs;
    std::vector<int64_t> slots(tokens);
    for (int64_t t = 0; t < tokens; ++t) slots[t] = t;
    const int64_t* d_slots = Upload(slots);
    const int64_t page_bytes = kk::Int2PageBytes(kHkv, kPs, kD);
    uint8_t* pool = Alloc<uint8_t>(static_cast<size_t>(kLayers * pages * page_bytes));
    const PutRows put(src, kLayers, tokens, kHkv, kD, kPs, d_slots, pool, pages, page_bytes);
    std::vector<float> rot_all(static_cast<size_t>(2) * kLayers * kD * kD);
    for (size_t m = 0; m < 2 * kLayers; ++m)
      std::copy(h.begin(), h.end(), rot_all.begin() + m * h.size());
    const float* d_rot = Upload(rot_all);
    const uint8_t* d_flags = Upload(std::vector<uint8_t>(2 * kLayers, 1));
    const float* d_rho = Upload(std::vector<float>(2 * kLayers, 0.94f));
    std::printf("\npaged INT2 store (Put over IPC), Qwen3-8B geometry, %lld tokens (%.2f GB):\n",
                static_cast<long long>(tokens), 4.0 * elems / 1e9);
    std::printf("| rotation | ms | TB/s |\n|---|---:|---:|\n");
    for (kk::Rotation kind : {kk::Rotation::kNone, kk::Rotation::kHadamard, kk::Rotation::kDense}) {
      kc::RowCodec codec;
      codec.rho_k = d_rho;
      codec.rho_v = d_rho + kLayers;
      if (kind != kk::Rotation::kNone) {
        codec.r_k = d_rot;
        codec.r_v = d_rot + int64_t{kLayers} * kD * kD;
        codec.r_layer_stride = int64_t{kD} * kD;
      }
      if (kind == kk::Rotation::kHadamard) {
        codec.hadamard_k = d_flags;
        codec.hadamard_v = d_flags + kLayers;
      }
      const double t = MedianSeconds(reps, [&] {
        CHECK(kc::LaunchStoreInt2Rows(put.k, put.v, put.dst, codec, nullptr, nullptr));
      });
      std::printf("| %s | %.3f | %.3f |\n",
                  kind == kk::Rotation::kDense ? "hadamard applied densely" : KindName(kind),
                  t * 1e3, 4.0 * elems / t / 1e12);
    }
  }
  return 0;
}
