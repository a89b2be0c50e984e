// Cost of the non-finite check fused into the CUDA kernels that read a client's tensors
// (issue #21.3): each kernel with the check compiled in against the same kernel without it,
// in the same process, on the same data, interleaved rep by rep (best and median of the
// reps). Qwen3-8B geometry (36 layers, 8 KV heads, 32 query heads, head_dim 128, pages of
// 64). Self-contained (kernels only).
//
//   cuda_finite_check_bench [--tokens N] [--reps R]
//
// 1. Put-size paged row stores: N tokens (default 8192) of BF16 K and V, every layer, into
//    BF16 pages (rotated) and INT2 pages: no check / check with the synchronous report, and
//    the host time of what Put now waits for (store, then the 16-byte report read back)
//    against the store alone followed by a device synchronize.
// 2. Decode-step kernels at batch 1, 8, 64 (one layer): the fused append's row store (no
//    check / pipelined report through per-sequence fault words), the query conversion
//    (LaunchToFloat / LaunchQueriesToFloat) and the whole INT2 decode call at 32768 tokens
//    per sequence (query conversion + INT2 parts + merge, as the daemon queues it, 40 calls
//    back to back) without and with fault targets.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_device_copy.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/device_fault.h"
#include "kvcd/kernels/int2_attention.h"

namespace kk = kvcd::kernels;
namespace kc = kvcd::kernels::cuda;

namespace {

constexpr int kLayers = 36, kHkv = 8, kHq = 32, kD = 128, kPs = 64;

// Finite BF16 values from a hash of the index (no host generation of gigabytes).
__global__ void FillBf16(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float f = (static_cast<float>(h & 0xffff) / 32768.0f - 1.0f) * 3.0f;
    p[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);
  }
}
__global__ void FillBytes(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2246822519u ^ seed;
    h ^= h >> 15;
    // FP16 parameters stay finite: never an all-ones exponent in an odd byte.
    p[i] = static_cast<uint8_t>((i & 1) ? (h & 0x3b) : h);
  }
}

template <class T>
T* Alloc(size_t n) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<size_t>(1, n * sizeof(T))));
  return static_cast<T*>(p);
}

struct Stat {
  double best = 1e30, median = 0;
};
Stat Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2]};
}

// Device time of fn() (which queues work on the default stream), in ms.
double DeviceMs(const std::function<void()>& fn) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  fn();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return ms;
}
double HostMs(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Runs each variant once per rep, interleaved; returns their stats.
std::vector<Stat> Interleaved(int reps, const std::vector<std::function<double()>>& variants) {
  std::vector<std::vector<double>> t(variants.size());
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < variants.size(); ++i) t[i].push_back(variants[i]());
  std::vector<Stat> out;
  for (auto& v : t) out.push_back(Summarize(v));
  return out;
}

void Row(const char* what, const char* unit, Stat base, Stat with) {
  std::printf("| %s | %.4g | %.4g | %.4g | %.4g | %+.2f%% |\n", what, base.best, with.best,
              base.median, with.median, 100.0 * (with.median / base.median - 1.0));
  (void)unit;
}

}  // namespace

ABSL_FLAG(int64_t, tokens, 8192, "Put tokens (Qwen3-8B geometry)");
ABSL_FLAG(int32_t, reps, 15, "repetitions (best and median)");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_finite_check_bench",
      .summary = "cost of the non-finite check fused into the CUDA kernels",
      .files = {__FILE__},
      .synopsis = "[--tokens N] [--reps N]"};
  kvcd::cli::Parse(program, argc, argv);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const int reps = absl::GetFlag(FLAGS_reps);
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; Qwen3-8B geometry, %lld Put tokens, %d reps\n\n", prop.name,
              prop.multiProcessorCount, static_cast<long long>(tokens), reps);

  // Rotations (identity-scaled noise: the cost does not depend on the values) and clips.
  std::vector<float> rot(static_cast<size_t>(2) * kLayers * kD * kD, 0.0f);
  for (size_t m = 0; m < 2 * kLayers; ++m)
    for (int i = 0; i < kD; ++i) rot[m * kD * kD + i * kD + i] = 1.0f;
  float* d_rot = Alloc<float>(rot.size());
  CHECK(cudaMemcpy(d_rot, rot.data(), rot.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> rho(2 * kLayers, 0.94f);
  float* d_rho = Alloc<float>(rho.size());
  CHECK(cudaMemcpy(d_rho, rho.data(), rho.size() * 4, cudaMemcpyHostToDevice));
  kc::RowCodec codec;
  codec.r_k = d_rot;
  codec.r_v = d_rot + int64_t{kLayers} * kD * kD;
  codec.r_layer_stride = int64_t{kD} * kD;
  codec.rho_k = d_rho;
  codec.rho_v = d_rho + kLayers;
  unsigned long long* d_report = Alloc<unsigned long long>(2);

  // 1. Put-size stores.
  {
    const int64_t elems = int64_t{kLayers} * tokens * kHkv * kD;
    uint16_t* src = Alloc<uint16_t>(2 * elems);
    FillBf16<<<1024, 256>>>(src, 2 * elems, 7);
    const int64_t pages = (tokens + kPs - 1) / kPs;
    std::vector<int64_t> slots(tokens);
    for (int64_t t = 0; t < tokens; ++t) slots[t] = t;
    int64_t* d_slots = Alloc<int64_t>(tokens);
    CHECK(cudaMemcpy(d_slots, slots.data(), tokens * 8, cudaMemcpyHostToDevice));
    std::printf("## Put of %lld tokens (%.2f GB of BF16 K+V), all layers, one launch\n\n",
                static_cast<long long>(tokens), 4.0 * elems / 1e9);
    std::printf(
        "| kernel | no check best ms | check best ms | no check median | check median | "
        "cost (median) |\n|---|---:|---:|---:|---:|---:|\n");
    for (int fmt = 0; fmt < 2; ++fmt) {
      const int64_t page_bytes =
          fmt == 0 ? kk::Bf16PageElems(kHkv, kPs, kD) * 2 : kk::Int2PageBytes(kHkv, kPs, kD);
      uint8_t* pool = Alloc<uint8_t>(static_cast<size_t>(kLayers * pages * page_bytes));
      const PutRows put(src, kLayers, tokens, kHkv, kD, kPs, d_slots, pool, pages, page_bytes);
      const kc::RowBlock& k = put.k;
      const kc::RowBlock& v = put.v;
      const kc::PagedRows& dst = put.dst;
      kc::StoreCheck sync;
      sync.count = d_report;
      sync.first_row = d_report + 1;
      auto launch = [&](const kc::StoreCheck* c) {
        CHECK(fmt == 0 ? kc::LaunchStoreBf16Rows(k, v, dst, codec, nullptr, c)
                       : kc::LaunchStoreInt2Rows(k, v, dst, codec, nullptr, c));
      };
      launch(nullptr);
      launch(&sync);
      CHECK(cudaDeviceSynchronize());
      const unsigned long long init[2] = {0, ~0ull};
      const auto s = Interleaved(
          reps, {[&] { return DeviceMs([&] { launch(nullptr); }); },
                 [&] {
                   CHECK(cudaMemcpy(d_report, init, sizeof(init), cudaMemcpyHostToDevice));
                   return DeviceMs([&] { launch(&sync); });
                 },
                 // What the host waits for: the store then a device synchronize (before), the
                 // store then the report read back (after: Put reads it before publishing).
                 [&] {
                   return HostMs([&] {
                     launch(nullptr);
                     CHECK(cudaDeviceSynchronize());
                   });
                 },
                 [&] {
                   return HostMs([&] {
                     CHECK(cudaMemcpyAsync(d_report, init, sizeof(init), cudaMemcpyHostToDevice));
                     launch(&sync);
                     unsigned long long got[2];
                     CHECK(cudaMemcpy(got, d_report, sizeof(got), cudaMemcpyDeviceToHost));
                     if (got[0] != 0) std::exit(2);  // the data is finite
                   });
                 }});
      Row(fmt == 0 ? "store BF16 rows (rotated), device ms" : "store INT2 rows, device ms", "ms",
          s[0], s[1]);
      Row(fmt == 0 ? "store BF16 rows + wait (host ms): sync vs report read"
                   : "store INT2 rows + wait (host ms): sync vs report read",
          "ms", s[2], s[3]);
      CHECK(cudaFree(pool));
    }
    CHECK(cudaFree(src));
    CHECK(cudaFree(d_slots));
  }

  // 2. Decode-step kernels.
  std::printf(
      "\n## Decode step, one layer (µs per call; 200 calls back to back for the small "
      "kernels, 40 for the INT2 decode call)\n\n");
  std::printf(
      "| kernel | no check best | check best | no check median | check median | "
      "cost (median) |\n|---|---:|---:|---:|---:|---:|\n");
  const int context = 32768;
  for (int batch : {1, 8, 64}) {
    // Fault words: device memory for both (the kernels do not care where they are).
    unsigned long long* words = Alloc<unsigned long long>(2 * batch);
    CHECK(cudaMemset(words, 0, 16 * batch));
    std::vector<kk::DeviceFault> faults(batch);
    for (int b = 0; b < batch; ++b) {
      faults[b].host_word = words + b;
      faults[b].device_word = words + batch + b;
      faults[b].tag = kk::FaultTag(b + 1, 3);
    }
    kk::DeviceFault* d_faults = Alloc<kk::DeviceFault>(batch);
    CHECK(cudaMemcpy(d_faults, faults.data(), batch * sizeof(kk::DeviceFault),
                     cudaMemcpyHostToDevice));
    // Fused append: batch tokens of one layer into a window pool.
    uint16_t* rows = Alloc<uint16_t>(2 * batch * kHkv * kD);
    FillBf16<<<64, 256>>>(rows, 2 * batch * kHkv * kD, 3);
    const int64_t wpage = kk::Bf16PageElems(kHkv, kPs, kD) * 2;
    uint8_t* window = Alloc<uint8_t>(static_cast<size_t>(batch * wpage));
    std::vector<int64_t> slots(batch);
    for (int b = 0; b < batch; ++b) slots[b] = int64_t{b} * kPs + 17;
    int64_t* d_slots = Alloc<int64_t>(batch);
    CHECK(cudaMemcpy(d_slots, slots.data(), batch * 8, cudaMemcpyHostToDevice));
    kc::RowBlock k, v;
    k.data = rows;
    v.data = rows + batch * kHkv * kD;
    k.token_stride = v.token_stride = kHkv * kD;
    k.head_stride = v.head_stride = kD;
    kc::PagedRows dst;
    dst.num_layers = 1;
    dst.num_tokens = batch;
    dst.num_kv_heads = kHkv;
    dst.head_dim = kD;
    dst.page_size = kPs;
    dst.base = window;
    dst.layer_stride = batch * wpage;
    dst.page_bytes = wpage;
    kc::StoreCheck piped;
    if (batch <= kc::PagedRows::kInlineSlots) {
      std::copy(slots.begin(), slots.end(), dst.inline_slots);
      std::copy(faults.begin(), faults.end(), piped.inline_faults);
      piped.use_inline_faults = true;
    } else {
      dst.slots = d_slots;
      piped.faults = d_faults;
    }
    auto many = [&](int n, const std::function<void()>& fn) {
      return 1e3 * DeviceMs([&] {
               for (int i = 0; i < n; ++i) fn();
             }) /
             n;
    };
    auto s = Interleaved(
        reps,
        {[&] {
           return many(200, [&] { CHECK(kc::LaunchStoreBf16Rows(k, v, dst, codec, nullptr)); });
         },
         [&] {
           return many(200,
                       [&] { CHECK(kc::LaunchStoreBf16Rows(k, v, dst, codec, nullptr, &piped)); });
         }});
    char label[160];
    std::snprintf(label, sizeof(label), "batch %d: fused append row store (BF16, rotated)", batch);
    Row(label, "us", s[0], s[1]);
    // Query conversion.
    const int64_t q_elems = int64_t{batch} * kHq * kD;
    float* q_src = Alloc<float>(q_elems);
    float* q = Alloc<float>(q_elems);
    CHECK(cudaMemset(q_src, 0, q_elems * 4));
    s = Interleaved(reps, {[&] {
                             return many(200, [&] {
                               CHECK(kc::LaunchToFloat(q_src, false, q_elems, q, nullptr));
                             });
                           },
                           [&] {
                             return many(200, [&] {
                               CHECK(kc::LaunchQueriesToFloat(
                                   q_src, false, batch, int64_t{kHq} * kD, q, d_faults, nullptr));
                             });
                           }});
    std::snprintf(label, sizeof(label), "batch %d: query conversion (F32 queries)", batch);
    Row(label, "us", s[0], s[1]);
    // The INT2 decode call: query conversion, INT2 parts, merge (as the daemon queues it).
    const int max_pages = context / kPs;
    const int64_t page_bytes = kk::Int2PageBytes(kHkv, kPs, kD);
    uint8_t* pool = Alloc<uint8_t>(static_cast<size_t>(batch) * max_pages * page_bytes);
    FillBytes<<<1024, 256>>>(pool, int64_t{batch} * max_pages * page_bytes, 9);
    std::vector<int32_t> table(static_cast<size_t>(batch) * max_pages);
    for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
    int32_t* d_table = Alloc<int32_t>(table.size());
    CHECK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(batch, context);
    int32_t* d_lens = Alloc<int32_t>(batch);
    CHECK(cudaMemcpy(d_lens, lens.data(), batch * 4, cudaMemcpyHostToDevice));
    const kc::DecodeGeometry geo{batch, kHq, kHkv, kD, kPs};
    const int splits = kc::Int2DecodeSplits(batch, kHkv, context, prop.multiProcessorCount,
                                            kc::Int2CtasPerSm(kHq, kHkv, kD));
    const int rows_n = batch * kHq;
    float* part_o = Alloc<float>(static_cast<size_t>(splits) * rows_n * kD);
    float* part_lse = Alloc<float>(static_cast<size_t>(splits) * rows_n);
    float* o = Alloc<float>(static_cast<size_t>(rows_n) * kD);
    float* lse = Alloc<float>(rows_n);
    void* state = Alloc<uint8_t>(kc::Int2StateBytes(batch, kHkv));
    const kc::PagedList list{pool, page_bytes, d_table, max_pages, d_lens};
    auto call = [&](bool checked) {
      if (checked) {
        CHECK(
            kc::LaunchQueriesToFloat(q_src, false, batch, int64_t{kHq} * kD, q, d_faults, nullptr));
      } else {
        CHECK(kc::LaunchToFloat(q_src, false, q_elems, q, nullptr));
      }
      const kc::MergeTarget merge{splits, d_rot, o, lse, checked ? d_faults : nullptr, kHq};
      kc::Int2PartsOptions opt;
      opt.state = state;
      opt.merge = &merge;
      CHECK(kc::LaunchInt2DecodeParts(list, geo, q, d_rot, 0.088f, splits, context, part_o,
                                      part_lse, 0, nullptr, opt));
    };
    s = Interleaved(reps, {[&] { return many(40, [&] { call(false); }); },
                           [&] { return many(40, [&] { call(true); }); }});
    std::snprintf(label, sizeof(label),
                  "batch %d: INT2 decode call, %d tokens (conversion + parts + merge)", batch,
                  context);
    Row(label, "us", s[0], s[1]);
    unsigned long long set = 0;
    CHECK(cudaMemcpy(&set, words, 8, cudaMemcpyDeviceToHost));
    if (set != 0) std::printf("unexpected fault word %llx\n", set);
    for (void* p :
         {static_cast<void*>(words), static_cast<void*>(d_faults), static_cast<void*>(rows),
          static_cast<void*>(window), static_cast<void*>(d_slots), static_cast<void*>(q_src),
          static_cast<void*>(q), static_cast<void*>(pool), static_cast<void*>(d_table),
          static_cast<void*>(d_lens), static_cast<void*>(part_o), static_cast<void*>(part_lse),
          static_cast<void*>(o), static_cast<void*>(lse), state})
      CHECK(cudaFree(p));
  }
  return 0;
}
