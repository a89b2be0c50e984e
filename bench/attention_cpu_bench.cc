// CPU decode attention: OSCAR INT2 history against BF16 history, same process, same
// geometry, through the CPU backend (split-K items on the compute threads, exact merge,
// q rotation and output un-rotation for INT2). Prints a table and optionally appends it
// to a results file.
//
//   attention_cpu_bench [--contexts 4096,32768,100000] [--batches 1,8] [--threads N]
//                       [--iters N] [--results FILE.md]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/codec_profile.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cpu_features.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/int2_attention.h"
#include "server/backends/backend.h"
#include "server/formats/page_pool.h"

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 64;  // Qwen3-8B geometry, one layer

struct Pool {
  std::unique_ptr<kvcd::PagePool> pool;
  uint8_t* mem = nullptr;
  uint64_t bytes = 0;
};

// One layer's pool with `pages` pages of the given format, filled with valid data.
Pool MakePool(kvcd::Backend& be, const char* format, int64_t pages, std::mt19937& rng) {
  Pool p;
  const bool int2 = std::strcmp(format, "bf16") != 0;
  const int64_t layer_bytes = int2 ? kvcd::kernels::Int2PageBytes(kHkv, kPage, kD)
                                   : kvcd::kernels::Bf16PageElems(kHkv, kPage, kD) * 2;
  p.bytes = static_cast<uint64_t>(layer_bytes * pages);
  p.mem = *be.AllocatePoolMemory(p.bytes);
  p.pool =
      std::make_unique<kvcd::PagePool>(format, p.mem, 1, layer_bytes, static_cast<int32_t>(pages));
  if (!int2) {
    uint16_t vals[256];
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : vals) v = kvcd::kernels::FloatToBf16(normal(rng));
    uint16_t* w = reinterpret_cast<uint16_t*>(p.mem);
    const uint64_t n = p.bytes / 2;
    for (uint64_t i = 0; i < n; ++i) w[i] = vals[(i * 7919 + (i >> 9)) & 255];
  } else {
    const kvcd::kernels::Int2PageLayout layout{kHkv, kPage, kD};
    for (int64_t pg = 0; pg < pages; ++pg) {
      uint8_t* base = p.mem + pg * layer_bytes;
      for (int64_t i = 0; i < layout.KScale(0) * 2; ++i) base[i] = static_cast<uint8_t>(rng());
      for (int h = 0; h < kHkv; ++h) {
        for (int slot = 0; slot < kPage; ++slot) {
          for (const auto& ref : {layout.K(base, h), layout.V(base, h)}) {
            ref.scale[slot] = kvcd::kernels::FloatToHalf(0.5f + 0.001f * ((slot * 7 + h) % 97));
            ref.lo[slot] = kvcd::kernels::FloatToHalf(-0.75f - 0.001f * ((slot * 5 + h) % 89));
          }
        }
      }
    }
  }
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> contexts = {4096, 32768, 100000};
  std::vector<int> batches = {1, 8};
  int threads = 0, iters = 0;
  std::string results;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--contexts") {
      contexts.clear();
      for (auto s : absl::StrSplit(v, ',')) contexts.push_back(std::stoll(std::string(s)));
    } else if (a == "--batches") {
      batches.clear();
      for (auto s : absl::StrSplit(v, ',')) batches.push_back(std::stoi(std::string(s)));
    } else if (a == "--threads") {
      threads = std::stoi(v);
    } else if (a == "--iters") {
      iters = std::stoi(v);
    } else if (a == "--results") {
      results = v;
    }
  }
  auto backend = kvcd::MakeCpuBackend(threads);
  std::mt19937 rng(1);
  std::string table =
      "| context | batch | BF16 ms | BF16 MB read | BF16 GB/s | INT2 ms | INT2 MB read | INT2 GB/s "
      "| "
      "INT2 speed-up |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  std::printf("CPU decode attention, Qwen3-8B layer (32 q / 8 kv heads, d 128, page 64), isa %s\n",
              kvcd::kernels::CpuIsaName(kvcd::kernels::ActiveCpuIsa()));
  for (int64_t n : contexts) {
    for (int batch : batches) {
      const int64_t pages_per_seq = (n + kPage - 1) / kPage;
      double ms[2] = {0, 0}, mb[2] = {0, 0};
      for (int fmt = 0; fmt < 2; ++fmt) {
        Pool pool =
            MakePool(*backend, fmt == 0 ? "bf16" : "int2-oscar", pages_per_seq * batch, rng);
        std::vector<float> q(static_cast<size_t>(batch) * kHq * kD), o(q.size()), lse(batch * kHq);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (auto& x : q) x = normal(rng);
        kvcd::AttentionBatch b;
        b.num_q_heads = kHq;
        b.num_kv_heads = kHkv;
        b.head_dim = kD;
        b.page_size = kPage;
        b.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kD));
        // INT2 pages hold Hadamard-rotated rows: the model's formats share that rotation.
        std::shared_ptr<const kvcd::CodecProfile> rotation;
        if (fmt == 1) {
          rotation =
              std::make_shared<const kvcd::CodecProfile>(kvcd::CodecProfile::Hadamard(1, kD));
        }
        const std::vector<kvcd::FormatId> ids = {kvcd::FormatId::kBf16, kvcd::FormatId::kInt2Oscar};
        auto formats =
            backend->CreateFormats(ids, kvcd::PageGeometry{1, kHkv, kD, kPage}, rotation, nullptr);
        if (!formats.ok()) {
          std::fprintf(stderr, "%s\n", std::string(formats.status().message()).c_str());
          return 1;
        }
        b.model_format = (*formats)[0].get();
        for (int s = 0; s < batch; ++s) {
          kvcd::AttentionJob job;
          kvcd::AttentionSegment seg;
          seg.format = (*formats)[fmt].get();
          seg.pool = pool.pool.get();
          for (int64_t p = 0; p < pages_per_seq; ++p)
            seg.page_ids.push_back(static_cast<int32_t>(s * pages_per_seq + p));
          seg.token_end = n;
          job.segments.push_back(std::move(seg));
          job.q = q.data() + s * kHq * kD;
          job.o = o.data() + s * kHq * kD;
          job.lse = lse.data() + s * kHq;
          b.jobs.push_back(std::move(job));
        }
        const double bytes_per_token = fmt == 0 ? 2.0 * kHkv * kD * 2 : 2.0 * kHkv * (kD / 4 + 4);
        mb[fmt] = bytes_per_token * n * batch / 1e6;
        const int reps = iters > 0 ? iters : std::max(3, static_cast<int>(2e9 / (mb[fmt] * 1e6)));
        (void)backend->Attend(b);  // warm-up
        std::vector<double> times;
        for (int r = 0; r < reps; ++r) {
          const auto t0 = std::chrono::steady_clock::now();
          (void)backend->Attend(b);
          times.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count());
        }
        std::sort(times.begin(), times.end());
        ms[fmt] = times[times.size() / 2];  // median
        backend->FreePoolMemory(pool.mem, pool.bytes);
      }
      char line[512];
      std::snprintf(line, sizeof(line),
                    "| %lld | %d | %.3f | %.1f | %.1f | %.3f | %.1f | %.1f | %.2fx |\n",
                    static_cast<long long>(n), batch, ms[0], mb[0], mb[0] / ms[0], ms[1], mb[1],
                    mb[1] / ms[1], ms[0] / ms[1]);
      std::fputs(line, stdout);
      std::fflush(stdout);
      table += line;
    }
  }
  if (!results.empty()) std::ofstream(results, std::ios::app) << table;
  return 0;
}
