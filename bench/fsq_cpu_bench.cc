// CPU decode attention on Transformer-FSQ codes against the BF16 and OSCAR INT2 kernels, same
// process, same geometry (one layer of Qwen3-8B: 32 q / 8 KV heads, d 128, pages of 64), and
// the FSQ encoder's cost per token. Kernels are called directly on one thread, one call per
// (sequence, KV head) over the whole history, so the figures are per-core kernel figures
// (no split-K, no merge, no INT2 query/output rotation).
//
//   fsq_cpu_bench [--contexts 32768] [--batches 1,8] [--latents 256,84] [--iters N]
//                 [--results FILE.md]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cpu_features.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/fsq.h"
#include "kvcd/kernels/int2_attention.h"

ABSL_FLAG(std::string, contexts, "32768", "context lengths, comma-separated");
ABSL_FLAG(std::string, batches, "1,8", "batch sizes, comma-separated");
ABSL_FLAG(std::string, latents, "256,84", "FSQ latent widths G, comma-separated");
ABSL_FLAG(int32_t, iters, 0, "repetitions per timing (0: 5)");
ABSL_FLAG(std::string, results, "", "append the table to this Markdown file");

namespace {

using namespace kvcd::kernels;
constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 64, kGroup = kHq / kHkv, kC = 4096;

std::vector<int> ParseInts(const std::string& v) {
  std::vector<int> out;
  std::stringstream ss(v);
  for (std::string s; std::getline(ss, s, ',');) out.push_back(std::stoi(s));
  return out;
}

double g_wall_ms = 0;

double ThreadCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// Median over reps of the CPU time this thread spent in f (the machine is shared: wall time
// counts other processes' slices, CPU time does not). The wall median goes to g_wall_ms.
template <class F>
double MedianMs(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> cpu, wall;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = ThreadCpuMs();
    f();
    cpu.push_back(ThreadCpuMs() - c0);
    wall.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(cpu.begin(), cpu.end());
  std::sort(wall.begin(), wall.end());
  g_wall_ms = wall[wall.size() / 2];
  return cpu[cpu.size() / 2];
}

struct FsqCodec {
  std::vector<float> wk, wv, bk, bv, knorm, enc, enc_bias;
  FsqLayerCodec codec;
  FsqCodec(int G, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float ws = 1.0f / std::sqrt(static_cast<float>(G));
    wk.resize(static_cast<size_t>(kHkv) * kD * G);
    wv.resize(wk.size());
    for (auto& x : wk) x = normal(rng) * ws;
    for (auto& x : wv) x = normal(rng) * ws;
    bk.resize(kHkv * kD);
    bv.resize(kHkv * kD);
    knorm.resize(kD);
    for (auto& x : bk) x = normal(rng) * 0.1f;
    for (auto& x : bv) x = normal(rng) * 0.1f;
    for (auto& x : knorm) x = 1.0f + 0.1f * normal(rng);
    enc.resize(static_cast<size_t>(G) * kC);
    enc_bias.resize(G);
    for (auto& x : enc) x = normal(rng) / std::sqrt(static_cast<float>(kC));
    for (auto& x : enc_bias) x = 0.1f * normal(rng);
    codec = FsqLayerCodec{kC,        G,         kHkv,      kD,        enc.data(),   enc_bias.data(),
                          wk.data(), wv.data(), bk.data(), bv.data(), knorm.data(), 1e-6f};
  }
};

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "fsq_cpu_bench",
      .summary = "CPU decode attention on Transformer-FSQ codes against BF16 and OSCAR INT2",
      .files = {__FILE__},
      .synopsis =
          "[--contexts 32768] [--batches 1,8] [--latents 256,84] [--iters N]\n"
          "    [--results FILE.md]"};
  kvcd::cli::Parse(program, argc, argv);
  const std::vector<int> contexts = ParseInts(absl::GetFlag(FLAGS_contexts)),
                         batches = ParseInts(absl::GetFlag(FLAGS_batches)),
                         latents = ParseInts(absl::GetFlag(FLAGS_latents));
  const int iters = absl::GetFlag(FLAGS_iters);
  const std::string results = absl::GetFlag(FLAGS_results);
  const CpuIsa isa = ActiveCpuIsa();
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::string out;
  char line[512];
  std::snprintf(line, sizeof(line),
                "FSQ vs BF16 vs INT2 decode attention, one Qwen3-8B layer (%d q / %d kv heads, "
                "d %d, page %d), one thread, isa %s\n\n",
                kHq, kHkv, kD, kPage, CpuIsaName(isa));
  out += line;
  out +=
      "| kernel | context | batch | CPU ms | wall ms | MB read | GB/s | key-rebuild GFLOP | "
      "GFLOP/s | ns per "
      "token-head |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  std::fputs(out.c_str(), stdout);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  for (int n : contexts) {
    for (int batch : batches) {
      const int64_t pps = (n + kPage - 1) / kPage, pages = pps * batch;
      std::vector<int32_t> ids(pages);
      for (int64_t p = 0; p < pages; ++p) ids[p] = static_cast<int32_t>(p);
      std::vector<float> q(static_cast<size_t>(batch) * kHq * kD), o(q.size()), lse(batch * kHq);
      for (auto& x : q) x = normal(rng);
      auto row = [&](const char* name, double ms, double mb, double gflop) {
        const double token_heads = double{1.0} * n * batch * kHkv;
        std::snprintf(line, sizeof(line),
                      "| %s | %d | %d | %.2f | %.2f | %.1f | %.2f | %.2f | %.1f | %.1f |\n", name,
                      n, batch, ms, g_wall_ms, mb, mb / ms, gflop,
                      gflop > 0 ? gflop / ms * 1e3 : 0.0, ms * 1e6 / token_heads);
        std::fputs(line, stdout);
        std::fflush(stdout);
        out += line;
      };
      {  // BF16: K and V rows, 4096 B per token.
        const int64_t elems = Bf16PageElems(kHkv, kPage, kD);
        std::vector<uint16_t> pool(static_cast<size_t>(elems * pages));
        for (size_t i = 0; i < pool.size(); ++i)
          pool[i] =
              FloatToBf16(0.5f * static_cast<float>(static_cast<int>(i * 7919 % 255) - 127) / 64);
        Bf16PageTable t{pool.data(), elems, ids.data(), static_cast<int32_t>(pages),
                        kPage,       kHkv,  kD};
        const double mb = 2.0 * kHkv * kD * 2 * n * batch / 1e6;
        const double ms = MedianMs(iters > 0 ? iters : 5, [&] {
          for (int s = 0; s < batch; ++s) {
            Bf16PageTable ts = t;
            ts.page_ids = ids.data() + s * pps;
            for (int h = 0; h < kHkv; ++h)
              AttendBf16Pages(ts, h, q.data() + (s * kHq + h * kGroup) * kD, kGroup, scale, 0, n,
                              o.data() + (s * kHq + h * kGroup) * kD,
                              lse.data() + s * kHq + h * kGroup, isa);
          }
        });
        row("BF16", ms, mb, 0);
      }
      {  // INT2: codes + FP16 scale/min, 576 B per token.
        const int64_t bytes = Int2PageBytes(kHkv, kPage, kD);
        std::vector<uint8_t> pool(static_cast<size_t>(bytes * pages));
        for (auto& b : pool) b = static_cast<uint8_t>(rng());
        const Int2PageLayout layout{kHkv, kPage, kD};
        for (int64_t p = 0; p < pages; ++p) {
          for (int h = 0; h < kHkv; ++h) {
            for (int slot = 0; slot < kPage; ++slot) {
              for (const auto& ref :
                   {layout.K(pool.data() + p * bytes, h), layout.V(pool.data() + p * bytes, h)}) {
                ref.scale[slot] = FloatToHalf(0.5f + 0.001f * ((slot * 7 + h) % 97));
                ref.lo[slot] = FloatToHalf(-0.75f - 0.001f * ((slot * 5 + h) % 89));
              }
            }
          }
        }
        Int2PageTable t{pool.data(), bytes, ids.data(), static_cast<int32_t>(pages),
                        kPage,       kHkv,  kD};
        const double mb = 2.0 * kHkv * (kD / 4 + 4) * n * batch / 1e6;
        const double ms = MedianMs(iters > 0 ? iters : 5, [&] {
          for (int s = 0; s < batch; ++s) {
            Int2PageTable ts = t;
            ts.page_ids = ids.data() + s * pps;
            for (int h = 0; h < kHkv; ++h)
              AttendInt2Pages(ts, h, q.data() + (s * kHq + h * kGroup) * kD, kGroup, scale, 0, n,
                              o.data() + (s * kHq + h * kGroup) * kD,
                              lse.data() + s * kHq + h * kGroup, isa);
          }
        });
        row("INT2", ms, mb, 0);
      }
      for (int G : latents) {  // FSQ: ceil(G/2) B of codes per token, shared by the 8 KV heads.
        FsqCodec fc(G, rng);
        const int64_t bytes = FsqPageBytes(kPage, G);
        std::vector<uint8_t> pool(static_cast<size_t>(bytes * pages));
        for (auto& b : pool) b = static_cast<uint8_t>(rng());
        const RopeSpec rope{1e6, kD, 1.0, RopePairing::kHalf};
        FsqPageTable t{pool.data(), bytes, ids.data(), static_cast<int32_t>(pages), kPage, 0};
        // Bytes: the codes once per (sequence, KV head) call plus W_k, W_v of the head per call.
        const double mb =
            (static_cast<double>(FsqCodeBytes(G)) * n * kHkv + 2.0 * kHkv * kD * G * 4) * batch /
            1e6;
        const double gflop = 2.0 * kD * G * double{1.0} * n * kHkv * batch / 1e9;
        const double ms = MedianMs(iters > 0 ? iters : 3, [&] {
          for (int s = 0; s < batch; ++s) {
            FsqPageTable ts = t;
            ts.page_ids = ids.data() + s * pps;
            for (int h = 0; h < kHkv; ++h)
              AttendFsqPages(ts, fc.codec, rope, h, q.data() + (s * kHq + h * kGroup) * kD, kGroup,
                             scale, 0, n, o.data() + (s * kHq + h * kGroup) * kD,
                             lse.data() + s * kHq + h * kGroup, isa);
          }
        });
        const std::string name = "FSQ G=" + std::to_string(G);
        row(name.c_str(), ms, mb, gflop);
      }
    }
  }
  // The encoder: C*G float64 MACs per token, summed in order (docs/fsq.md).
  out += "\n| encoder | tokens | us per token | GFLOP/s (double) |\n|---|---:|---:|---:|\n";
  std::fputs("\n| encoder | tokens | us per token | GFLOP/s (double) |\n|---|---:|---:|---:|\n",
             stdout);
  for (int G : latents) {
    FsqCodec fc(G, rng);
    for (int tokens : {64, 1}) {  // a Put's block of tokens; one Append'ed token
      std::vector<float> x(static_cast<size_t>(tokens) * kC);
      for (auto& v : x) v = normal(rng);
      std::vector<uint8_t> codes(tokens * FsqCodeBytes(G));
      const double ms = MedianMs(iters > 0 ? std::max(iters, 5) : 9, [&] {
        FsqEncodeRows(fc.codec, x.data(), tokens, codes.data(), isa);
      });
      const double us = ms * 1e3 / tokens;
      std::snprintf(line, sizeof(line), "| C=%d G=%d | %d | %.1f | %.2f |\n", kC, G, tokens, us,
                    2.0 * kC * G / (us * 1e3));
      std::fputs(line, stdout);
      out += line;
    }
  }
  if (!results.empty()) std::ofstream(results, std::ios::app) << out;
  return 0;
}
