// CPU decode attention: OSCAR INT2 history and transform-coded key history (int2-transform,
// a synthetic version-3 codec) against BF16 history, same process, same geometry, through
// the CPU backend (split-K items on the compute threads, exact merge, q rotation and output
// un-rotation for INT2; per-head query projection and value un-rotation inside the
// int2-transform kernel). Prints a table and optionally appends it to a results file. The
// formats' repetitions alternate so all see the same machine load; times are medians; the
// last columns give core-nanoseconds per token and KV head and the 1-minute load average
// when the row finished.
//
//   attention_cpu_bench [--contexts 4096,32768,100000] [--batches 1,8] [--threads N]
//                       [--iters N] [--results FILE.md]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "common/codec_profile.h"
#include "common/key_transform_profile.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cpu_features.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/transform_attention.h"
#include "server/backends/backend.h"
#include "server/formats/format_registry.h"
#include "server/formats/page_pool.h"

ABSL_FLAG(std::string, contexts, "4096,32768,100000", "context lengths, comma-separated");
ABSL_FLAG(std::string, batches, "1,8", "batch sizes, comma-separated");
ABSL_FLAG(int32_t, threads, 0, "compute threads of the CPU backend (0: every core)");
ABSL_FLAG(int32_t, iters, 0, "repetitions per row (0: chosen from the size)");
ABSL_FLAG(std::string, results, "", "append the table to this Markdown file");

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 64;  // Qwen3-8B geometry, one layer
constexpr int kFormats = 3;                              // bf16, int2-oscar, int2-transform
constexpr int kTransformCodeBytes = (2 * kD + 16) / 8;   // SyntheticHeads' widths

struct Pool {
  std::unique_ptr<kvcd::PagePool> pool;
  uint8_t* mem = nullptr;
  uint64_t bytes = 0;
};

// One layer's pool with `pages` pages of the given format, filled with valid data.
Pool MakePool(kvcd::Backend& be, const char* format, int64_t pages, std::mt19937& rng) {
  Pool p;
  const bool int2 = std::strcmp(format, "bf16") != 0;
  const bool transform = std::strcmp(format, "int2-transform") == 0;
  const kvcd::kernels::TransformPageLayout tl{kHkv, kPage, kD, kTransformCodeBytes};
  const int64_t layer_bytes = transform ? tl.Bytes()
                              : int2    ? kvcd::kernels::Int2PageBytes(kHkv, kPage, kD)
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
  } else if (transform) {
    for (int64_t pg = 0; pg < pages; ++pg) {
      uint8_t* base = p.mem + pg * layer_bytes;
      for (int64_t i = 0; i < layer_bytes; ++i) base[i] = static_cast<uint8_t>(rng());
      for (int h = 0; h < kHkv; ++h) {
        auto* gains = reinterpret_cast<uint16_t*>(base + tl.KGains(h));
        const auto v = tl.V(base, h);
        for (int slot = 0; slot < kPage; ++slot) {
          gains[slot] = kvcd::kernels::FloatToHalf(0.5f + 0.001f * ((slot * 3 + h) % 101));
          v.scale[slot] = kvcd::kernels::FloatToHalf(0.5f + 0.001f * ((slot * 7 + h) % 97));
          v.lo[slot] = kvcd::kernels::FloatToHalf(-0.75f - 0.001f * ((slot * 5 + h) % 89));
        }
      }
    }
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

struct Setup {
  Pool pool;
  std::vector<std::unique_ptr<kvcd::PageFormat>> formats;
  std::vector<float> q, o, lse;
  kvcd::AttentionBatch batch;
  double mb = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "attention_cpu_bench",
      .summary = "CPU decode attention: INT2 and int2-transform history against BF16",
      .files = {__FILE__},
      .synopsis =
          "[--contexts 4096,32768,100000] [--batches 1,8] [--threads N] [--iters N]\n"
          "    [--results FILE.md]"};
  kvcd::cli::Parse(program, argc, argv);
  std::vector<int64_t> contexts;
  for (auto s : absl::StrSplit(absl::GetFlag(FLAGS_contexts), ',')) {
    contexts.push_back(std::stoll(std::string(s)));
  }
  std::vector<int> batches;
  for (auto s : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    batches.push_back(std::stoi(std::string(s)));
  }
  const int threads = absl::GetFlag(FLAGS_threads), iters = absl::GetFlag(FLAGS_iters);
  const std::string results = absl::GetFlag(FLAGS_results);
  auto backend = kvcd::MakeCpuBackend(threads);
  std::mt19937 rng(1);
  const int cores =
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string table =
      "| context | batch | reps | BF16 ms | BF16 MB read | BF16 GB/s | INT2 ms | INT2 MB read | "
      "INT2 GB/s | INT2 speed-up | BF16 core-ns/token-head | INT2 core-ns/token-head | "
      "transform ms | transform GB/s | transform speed-up | transform core-ns/token-head | "
      "load |\n"
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  std::printf("CPU decode attention, Qwen3-8B layer (32 q / 8 kv heads, d 128, page 64), isa %s\n",
              kvcd::kernels::CpuIsaName(kvcd::kernels::ActiveCpuIsa()));
  for (int64_t n : contexts) {
    for (int batch : batches) {
      const int64_t pages_per_seq = (n + kPage - 1) / kPage;
      // The formats set up as the daemon sets up a model (model_cache.cc): a BF16-history
      // model has only the BF16 format and no codec profile; an INT2-history model has the
      // BF16 window format plus int2-oscar, both sharing its codec profile (Hadamard, as a
      // model without a codec file gets), and Attend rotates q and un-rotates the output; an
      // int2-transform model has a BF16 window without rotation plus int2-transform (a
      // synthetic version-3 codec: 272 key code bits + FP16 gain per row at d 128, INT2's bytes).
      Setup setup[kFormats];
      const char* names[kFormats] = {"bf16", "int2-oscar", "int2-transform"};
      for (int fmt = 0; fmt < kFormats; ++fmt) {
        Setup& su = setup[fmt];
        su.pool = MakePool(*backend, names[fmt], pages_per_seq * batch, rng);
        // The model's formats as the daemon builds them: its history format's factory.
        kvcd::ModelSpec spec;
        spec.name = names[fmt];
        spec.num_layers = 1;
        spec.num_kv_heads = kHkv;
        spec.head_dim = kD;
        spec.page_size = kPage;
        std::string codec_blob;
        if (fmt == 1) {
          spec.history_format = kvcd::FormatId::kInt2Oscar;
          spec.codec = "hadamard";
        } else if (fmt == 2) {
          spec.history_format = kvcd::FormatId::kInt2Oscar;  // a version-3 codec file
          codec_blob =
              kvcd::KeyTransformProfile::ToSafetensors(
                  kvcd::KeyTransformProfile::SyntheticHeads(1, kHkv, kD, 1), 1, kHkv, kD, "bench")
                  .Serialize();
          auto file = kvcd::SafetensorsFile::Parse(codec_blob);
          auto tp = kvcd::KeyTransformProfile::FromSafetensors(*file, 1, kHkv, kD);
          if (!tp.ok() || tp->key_code_bits() != 8 * kTransformCodeBytes) {
            std::fprintf(stderr, "synthetic version-3 codec: %s\n",
                         std::string(tp.status().message()).c_str());
            return 1;
          }
        }
        auto codec = kvcd::LoadModelCodec(spec, codec_blob);
        if (!codec.ok()) {
          std::fprintf(stderr, "%s\n", std::string(codec.status().message()).c_str());
          return 1;
        }
        auto formats =
            (*codec)->CreateFormats(kvcd::PageGeometry{1, kHkv, kD, kPage}, backend->kind());
        if (!formats.ok()) {
          std::fprintf(stderr, "%s\n", std::string(formats.status().message()).c_str());
          return 1;
        }
        su.formats = std::move(*formats);
        su.q.resize(static_cast<size_t>(batch) * kHq * kD);
        su.o.resize(su.q.size());
        su.lse.resize(static_cast<size_t>(batch) * kHq);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (auto& x : su.q) x = normal(rng);
        kvcd::AttentionBatch& b = su.batch;
        b.num_q_heads = kHq;
        b.num_kv_heads = kHkv;
        b.head_dim = kD;
        b.page_size = kPage;
        b.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kD));
        b.model_format = su.formats[0].get();
        for (int s = 0; s < batch; ++s) {
          kvcd::AttentionJob job;
          kvcd::AttentionSegment seg;
          seg.format = su.formats.back().get();
          seg.pool = su.pool.pool.get();
          for (int64_t p = 0; p < pages_per_seq; ++p)
            seg.page_ids.push_back(static_cast<int32_t>(s * pages_per_seq + p));
          seg.token_end = n;
          job.segments.push_back(std::move(seg));
          job.q = su.q.data() + s * kHq * kD;
          job.o = su.o.data() + s * kHq * kD;
          job.lse = su.lse.data() + s * kHq;
          b.jobs.push_back(std::move(job));
        }
        const double bytes_per_token = fmt == 0   ? 2.0 * kHkv * kD * 2
                                       : fmt == 1 ? 2.0 * kHkv * (kD / 4 + 4)
                                                  : kHkv * (kTransformCodeBytes + 2.0 + kD / 4 + 4);
        su.mb = bytes_per_token * n * batch / 1e6;
        if (absl::Status st = backend->Attend(b); !st.ok()) {  // warm-up
          std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
          return 1;
        }
      }
      // Interleaved repetitions (BF16, INT2, transform, BF16, ...): all see the same load.
      const int reps = iters > 0 ? iters : std::max(5, static_cast<int>(2e9 / (setup[0].mb * 1e6)));
      std::vector<double> times[kFormats];
      for (int r = 0; r < reps; ++r) {
        for (int fmt = 0; fmt < kFormats; ++fmt) {
          const auto t0 = std::chrono::steady_clock::now();
          (void)backend->Attend(setup[fmt].batch);
          times[fmt].push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count());
        }
      }
      double ms[kFormats], mb[kFormats];
      for (int fmt = 0; fmt < kFormats; ++fmt) {
        std::sort(times[fmt].begin(), times[fmt].end());
        ms[fmt] = times[fmt][times[fmt].size() / 2];  // median
        mb[fmt] = setup[fmt].mb;
        backend->FreePoolMemory(setup[fmt].pool.mem, setup[fmt].pool.bytes);
      }
      // Core-nanoseconds per token and KV head (the 4 query heads of its group).
      const double token_heads = static_cast<double>(n) * batch * kHkv;
      double load[3] = {0, 0, 0};
      if (getloadavg(load, 3) < 1) load[0] = -1;
      char line[640];
      std::snprintf(line, sizeof(line),
                    "| %lld | %d | %d | %.3f | %.1f | %.1f | %.3f | %.1f | %.1f | %.2fx | %.1f | "
                    "%.1f | %.3f | %.1f | %.2fx | %.1f | %.2f |\n",
                    static_cast<long long>(n), batch, reps, ms[0], mb[0], mb[0] / ms[0], ms[1],
                    mb[1], mb[1] / ms[1], ms[0] / ms[1], ms[0] * 1e6 * cores / token_heads,
                    ms[1] * 1e6 * cores / token_heads, ms[2], mb[2] / ms[2], ms[0] / ms[2],
                    ms[2] * 1e6 * cores / token_heads, load[0]);
      std::fputs(line, stdout);
      std::fflush(stdout);
      table += line;
    }
  }
  if (!results.empty()) std::ofstream(results, std::ios::app) << table;
  return 0;
}
