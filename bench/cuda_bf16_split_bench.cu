// BF16 history decode attention on the GPU (issue #19): the split tensor-core kernel
// (LaunchBf16SplitDecodeParts) against the first BF16 kernel (LaunchBf16DecodeParts, one warp
// per token) in the same process, at the Qwen3-8B layer geometry (32 q / 8 KV heads, head_dim
// 128, pages of 64 tokens). Self-contained (kernels only).
//
//   cuda_bf16_split_bench [--contexts 32768,100000] [--batches 1,8]
//
// 1. Check: both kernels on the same random pages and queries (odd lengths, batch 3), parts
//    merged by LaunchMergeParts; max |o difference| / max |o| and max |lse difference|.
//    Exit status 1 when they disagree beyond 1e-3 (the unit tests hold the CPU reference).
// 2. Timing per (context, batch, kernel): the parts alone and the whole call (parts + merge,
//    as the daemon queues a BF16-history call), single (one call between two events, launch
//    gaps included) and b2b (40 calls back to back cycling over up to 4 layers of pages, what
//    a decode step over layers sees), median; TB/s counts the K/V bytes read, tokens x kv heads
//    x d x 2 (K, V) x 2 bytes per sequence. Queries are read raw as BF16 (the daemon's IPC
//    path). Extra rows at batch 1: the split kernel with a dense R_k (the rotation a BF16
//    window of an INT2 model applies), with half and with twice its split count.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cuda_bf16_split_attention.h"
#include "kvcd/kernels/cuda_decode_attention.h"

namespace kc = kvcd::kernels::cuda;

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kPs = 64;

// BF16 values in (-2, 2) from a sine of the index: finite, varied, no host generation.
__global__ void FillPool(uint16_t* p, int64_t n, float phase) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = 2.0f * __sinf(static_cast<float>(i % 1048573) * 0.7071f + phase);
    p[i] = static_cast<uint16_t>(__float_as_uint(x) >> 16);
  }
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p != '\0';) {
    v.push_back(std::atoi(p));
    const char* c = std::strchr(p, ',');
    if (c == nullptr) break;
    p = c + 1;
  }
  return v;
}

const char* KernelName(kc::Bf16Kernel k) { return k == kc::Bf16Kernel::kSplit ? "split" : "warp"; }

// Layers of BF16 pages for `batch` sequences of `n` tokens (page table: identity).
struct Pages {
  int batch, n, pages_per;
  int64_t page_bytes, layer_bytes;
  std::vector<uint16_t*> layers;
  int32_t *table = nullptr, *lengths = nullptr;

  Pages(int batch_, int n_, int max_layers, const std::vector<int>& lens) : batch(batch_), n(n_) {
    pages_per = (n + kPs - 1) / kPs;
    page_bytes = kvcd::kernels::Bf16PageElems(kHkv, kPs, kD) * 2;
    layer_bytes = int64_t{pages_per} * batch * page_bytes;
    const int count =
        static_cast<int>(std::clamp<int64_t>(int64_t{1000000000} / layer_bytes, 1, max_layers));
    for (int l = 0; l < count; ++l) {
      void* p = nullptr;
      CHECK(cudaMalloc(&p, layer_bytes));
      FillPool<<<4096, 256>>>(static_cast<uint16_t*>(p), layer_bytes / 2, 0.3f + l);
      CHECK(cudaGetLastError());
      layers.push_back(static_cast<uint16_t*>(p));
    }
    std::vector<int32_t> ids(int64_t{pages_per} * batch);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    table = Upload(ids);
    lengths = Upload(lens);
  }
  ~Pages() {
    for (uint16_t* p : layers) CHECK(cudaFree(p));
    CHECK(cudaFree(table));
    CHECK(cudaFree(lengths));
  }
  kc::PagedList List(int layer) const {
    return kc::PagedList{reinterpret_cast<const uint8_t*>(layers[layer % layers.size()]),
                         page_bytes, table, pages_per, lengths};
  }
};

// Device buffers of one call: parts (for the kernel's split count), o, lse.
struct Call {
  kc::Bf16Kernel kernel;
  int splits, rows;
  float *part_o = nullptr, *part_lse = nullptr, *o = nullptr, *lse = nullptr;
  // splits_x2: the kernel's split count times splits_x2 / 2 (2: as the daemon launches).
  Call(kc::Bf16Kernel k, int batch, int max_tokens, int sms, int splits_x2 = 2) : kernel(k) {
    splits = std::max(1, kc::Bf16DecodeSplits(k, batch, kHkv, kD, max_tokens, sms) * splits_x2 / 2);
    rows = batch * kHq;
    CHECK(cudaMalloc(&part_o, sizeof(float) * splits * rows * kD));
    CHECK(cudaMalloc(&part_lse, sizeof(float) * splits * rows));
    CHECK(cudaMalloc(&o, sizeof(float) * rows * kD));
    CHECK(cudaMalloc(&lse, sizeof(float) * rows));
  }
  ~Call() {
    const void* ptrs[] = {part_o, part_lse, o, lse};
    for (const void* p : ptrs) CHECK(cudaFree(const_cast<void*>(p)));
  }
  void Parts(const kc::PagedList& list, int batch, int max_tokens, const kc::RawQueries& q,
             const float* r_k, cudaStream_t stream) const {
    const kc::DecodeGeometry geo{batch, kHq, kHkv, kD, kPs};
    CHECK(kc::LaunchBf16Parts(kernel, list, geo, nullptr, r_k, 1.0f / std::sqrt(float{kD}), splits,
                              max_tokens, part_o, part_lse, 0, stream, &q));
  }
  void Merge(cudaStream_t stream) const {
    CHECK(kc::LaunchMergeParts(part_o, part_lse, splits, rows, kD, nullptr, o, lse, stream));
  }
};

// Both kernels on the same inputs: the largest relative o difference and lse difference.
bool Check(int sms, cudaStream_t stream) {
  const std::vector<int> lens = {4103, 1, 777};
  const int batch = static_cast<int>(lens.size()), n = 4103;
  const Pages pages(batch, n, 1, lens);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> q(static_cast<size_t>(batch) * kHq * kD);
  for (auto& x : q) x = kvcd::kernels::FloatToBf16(normal(rng));
  uint16_t* d_q = Upload(q);
  const kc::RawQueries raw{d_q, true, nullptr, 0};
  std::vector<std::vector<float>> o, lse;
  for (const kc::Bf16Kernel k : {kc::Bf16Kernel::kSplit, kc::Bf16Kernel::kWarp}) {
    const Call c(k, batch, n, sms);
    c.Parts(pages.List(0), batch, n, raw, nullptr, stream);
    c.Merge(stream);
    CHECK(cudaStreamSynchronize(stream));
    o.emplace_back(static_cast<size_t>(c.rows) * kD);
    lse.emplace_back(c.rows);
    CHECK(
        cudaMemcpy(o.back().data(), c.o, sizeof(float) * o.back().size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(lse.back().data(), c.lse, sizeof(float) * c.rows, cudaMemcpyDeviceToHost));
  }
  CHECK(cudaFree(d_q));
  double max_o = 0, d_o = 0, d_lse = 0;
  bool finite = true;
  for (size_t i = 0; i < o[0].size(); ++i) {
    finite = finite && std::isfinite(o[0][i]);
    max_o = std::max(max_o, std::fabs(double{o[1][i]}));
    d_o = std::max(d_o, std::fabs(double{o[0][i]} - o[1][i]));
  }
  for (size_t i = 0; i < lse[0].size(); ++i) {
    finite = finite && std::isfinite(lse[0][i]);
    d_lse = std::max(d_lse, std::fabs(double{lse[0][i]} - lse[1][i]) / (1 + std::fabs(lse[1][i])));
  }
  const bool ok = finite && d_o <= 1e-3 * max_o && d_lse <= 1e-3;
  std::printf(
      "check split vs warp kernel (lengths 4103, 1, 777): max |o diff| / max |o| %.2e, max lse "
      "diff (relative) %.2e: %s\n",
      d_o / std::max(max_o, 1e-30), d_lse, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

ABSL_FLAG(std::string, contexts, "32768,100000", "context lengths, comma-separated");
ABSL_FLAG(std::string, batches, "1,8", "batch sizes, comma-separated");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_bf16_split_bench",
      .summary = "the split tensor-core BF16 decode kernel against the first BF16 kernel",
      .files = {__FILE__},
      .synopsis = "[--contexts 32768,100000] [--batches 1,8]"};
  kvcd::cli::Parse(program, argc, argv);
  const std::vector<int> contexts = ParseList(absl::GetFlag(FLAGS_contexts).c_str()),
                         batches = ParseList(absl::GetFlag(FLAGS_batches).c_str());
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs\n", prop.name, sms);
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const bool ok = Check(sms, stream);
  std::printf("read ceiling: %.2f TB/s (4 GiB read-only reduction, median of 10)\n",
              ReadCeilingTbps(stream, sms, int64_t{4} << 30));
  std::printf(
      "\nBF16 decode attention, Qwen3-8B layer (32 q / 8 kv heads, d 128, page 64), queries raw "
      "BF16\n"
      "parts: the attention kernel alone; call: parts + merge. single: one call between two\n"
      "events; b2b: 40 calls back to back over up to 4 layers of pages, per call (median).\n");
  std::printf("%-6s %8s %6s %7s %12s %12s %12s %10s %10s\n", "kernel", "context", "batch", "splits",
              "parts b2b us", "call 1 us", "call b2b us", "MB read", "TB/s parts");
  for (int n : contexts) {
    for (int batch : batches) {
      const Pages pages(batch, n, 4, std::vector<int>(batch, n));
      std::vector<uint16_t> q(static_cast<size_t>(batch) * kHq * kD, 0x3f80);   // 1.0
      for (size_t i = 0; i < q.size(); ++i) q[i] = i % 3 == 0 ? 0xbf00 : q[i];  // -0.5
      uint16_t* d_q = Upload(q);
      const kc::RawQueries raw{d_q, true, nullptr, 0};
      const double mb = 2.0 * 2.0 * n * kHkv * kD * batch / 1e6;
      std::vector<float> rk(kD * kD);
      std::mt19937 rng(9);
      std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(float{kD}));
      for (auto& x : rk) x = normal(rng);
      float* d_rk = Upload(rk);
      struct Row {
        kc::Bf16Kernel kernel;
        const float* r_k;
        const char* note;
        int splits_x2 = 2;
      };
      std::vector<Row> rows_to_run = {{kc::Bf16Kernel::kSplit, nullptr, ""},
                                      {kc::Bf16Kernel::kWarp, nullptr, ""}};
      if (batch == 1) {  // what the split count and a rotation do to the split kernel
        rows_to_run.push_back({kc::Bf16Kernel::kSplit, d_rk, "  (with a dense R_k)"});
        rows_to_run.push_back({kc::Bf16Kernel::kSplit, nullptr, "  (half the splits)", 1});
        rows_to_run.push_back({kc::Bf16Kernel::kSplit, nullptr, "  (twice the splits)", 4});
      }
      for (const Row& r : rows_to_run) {
        const Call c(r.kernel, batch, n, sms, r.splits_x2);
        const int calls = 40;
        const double parts_b2b = MedianUsPerCall(stream, 7, 2, calls, [&](int i) {
          c.Parts(pages.List(i), batch, n, raw, r.r_k, stream);
        });
        const double call1 = MedianUsPerCall(stream, 21, 3, 1, [&](int) {
          c.Parts(pages.List(0), batch, n, raw, r.r_k, stream);
          c.Merge(stream);
        });
        const double call_b2b = MedianUsPerCall(stream, 7, 2, calls, [&](int i) {
          c.Parts(pages.List(i), batch, n, raw, r.r_k, stream);
          c.Merge(stream);
        });
        std::printf("%-6s %8d %6d %7d %12.1f %12.1f %12.1f %10.1f %10.2f%s\n", KernelName(r.kernel),
                    n, batch, c.splits, parts_b2b, call1, call_b2b, mb, mb / parts_b2b, r.note);
      }
      CHECK(cudaFree(d_q));
      CHECK(cudaFree(d_rk));
    }
  }
  CHECK(cudaStreamDestroy(stream));
  return ok ? 0 : 1;
}
