// INT2 decode attention on the GPU: correctness against the CPU scalar oracle (fresh
// random pages, odd lengths, poisoned outputs), then timing at Qwen3-8B geometry with
// the achieved bandwidth against a read-only reduction's ceiling measured in the same run.
// Self-contained (kernels only), so it runs on a GPU machine without the daemon's libraries.
//
//   cuda_int2_bench [--check-only] [--bench-only] [--one N BATCH CTAS_PER_SM [PREFETCH]]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "common/rotation.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/int2_codec.h"

namespace kk = kvcd::kernels;

namespace {

struct CaseResult {
  double err;      // max relative error of o and lse
  double max_lse;  // largest |lse| of the oracle: the logit range of the case
};

// One correctness case: batch sequences of the given lengths.
// growth > 0 scales the K/V rows of token t by (1 + t * growth), so the running max of the
// logits and the value scales keep rising (every rescale path of the kernels runs).
CaseResult CheckCase(int hq, int hkv, int d, int ps, const std::vector<int>& lengths, uint32_t seed,
                     float growth, kk::cuda::Int2Kernel kernel) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int batch = static_cast<int>(lengths.size());
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  const int max_pages = std::max(1, (max_len + ps - 1) / ps);
  const int64_t page_bytes = kk::Int2PageBytes(hkv, ps, d);
  const int pool_pages = batch * max_pages + 3;
  std::vector<uint8_t> pool(pool_pages * page_bytes);
  for (auto& b : pool) b = static_cast<uint8_t>(rng());
  std::vector<int32_t> ids(pool_pages);
  for (int i = 0; i < pool_pages; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> table(batch * max_pages);
  for (int i = 0; i < batch * max_pages; ++i) table[i] = ids[i];
  const kk::Int2PageLayout layout{hkv, ps, d};
  std::vector<float> row(d);
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < lengths[b]; ++t) {
      uint8_t* page = pool.data() + table[b * max_pages + t / ps] * page_bytes;
      for (int h = 0; h < hkv; ++h) {
        for (int which = 0; which < 2; ++which) {
          const float gain = (which == 0 ? 2.0f : 1.0f) * (1.0f + growth * static_cast<float>(t));
          for (auto& x : row) x = normal(rng) * gain;
          kk::DemoteRowsToInt2(row.data(), 1, d, nullptr, which == 0 ? 0.96f : 0.92f,
                               which == 0 ? layout.K(page, h) : layout.V(page, h), t % ps);
        }
      }
    }
  }
  std::vector<float> q(batch * hq * d);
  for (auto& x : q) x = normal(rng);
  const std::vector<float> rk = kvcd::HadamardMatrix(d);
  std::vector<float> rvt(d * d);  // a different rotation for V: a permuted Hadamard
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) rvt[i * d + j] = rk[i * d + (j * 5 + 3) % d];
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  kk::cuda::Int2DecodeParams p;
  p.pages = Upload(pool);
  p.page_stride = page_bytes;
  p.page_table = Upload(table);
  p.max_pages = max_pages;
  p.lengths = Upload(std::vector<int32_t>(lengths.begin(), lengths.end()));
  p.batch = batch;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.page_size = ps;
  p.q = Upload(q);
  p.r_k = Upload(rk);
  p.r_v_t = Upload(rvt);
  p.softmax_scale = scale;
  p.num_splits =
      kk::cuda::Int2DecodeSplits(batch, hkv, max_len, 132, kk::cuda::Int2CtasPerSm(hq, hkv, d));
  std::vector<float> nan_fill(batch * hq * d, NAN);
  p.o = Upload(nan_fill);
  p.lse = Upload(std::vector<float>(batch * hq, NAN));
  void* ws = nullptr;
  CHECK(cudaMalloc(&ws, kk::cuda::Int2DecodeWorkspaceBytes(batch, hq, d, p.num_splits)));
  p.workspace = ws;
  p.kernel = kernel;
  CHECK(kk::cuda::LaunchInt2Decode(p, max_len, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> o(batch * hq * d), lse(batch * hq);
  CHECK(cudaMemcpy(o.data(), p.o, o.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(lse.data(), p.lse, lse.size() * 4, cudaMemcpyDeviceToHost));

  double worst = 0, max_lse = 0;
  const int g = hq / hkv;
  for (int b = 0; b < batch; ++b) {
    std::vector<float> qr(hq * d), orot(hq * d), oref(hq * d), lref(hq);
    kk::RotateRows(q.data() + b * hq * d, hq, d, rk.data(), qr.data());
    kk::Int2PageTable kv{pool.data(), page_bytes, table.data() + b * max_pages, max_pages, ps,
                         hkv,         d};
    for (int h = 0; h < hkv; ++h) {
      kk::AttendInt2PagesReference(kv, h, qr.data() + h * g * d, g, scale, 0, lengths[b],
                                   orot.data() + h * g * d, lref.data() + h * g);
    }
    kk::RotateRows(orot.data(), hq, d, rvt.data(), oref.data());
    for (int h = 0; h < hq; ++h) {
      double err = 0, norm = 0;
      for (int c = 0; c < d; ++c) {
        const double a = o[(b * hq + h) * d + c], r = oref[h * d + c];
        if (std::isnan(a)) return {INFINITY, 0};
        err += (a - r) * (a - r);
        norm += r * r;
      }
      double rel = lengths[b] == 0 ? std::sqrt(err) : std::sqrt(err / norm);
      if (lengths[b] > 0) {
        rel = std::max(rel, static_cast<double>(std::fabs(lse[b * hq + h] - lref[h]) /
                                                (1 + std::fabs(lref[h]))));
      }
      if (lengths[b] == 0 && !(std::isinf(lse[b * hq + h]) && lse[b * hq + h] < 0)) {
        return {INFINITY, 0};
      }
      worst = std::max(worst, rel);
      if (lengths[b] > 0) max_lse = std::max(max_lse, static_cast<double>(std::fabs(lref[h])));
    }
  }
  const void* to_free[] = {p.pages, p.page_table, p.lengths, p.q, p.r_k, p.r_v_t, p.o, p.lse, ws};
  for (const void* ptr : to_free) CHECK(cudaFree(const_cast<void*>(ptr)));
  return {worst, max_lse};
}

}  // namespace

ABSL_FLAG(bool, check_only, false, "only the correctness checks");
ABSL_FLAG(bool, bench_only, false, "only the timings");
ABSL_FLAG(bool, one, false, "one config of the v2 kernel: N BATCH CTAS_PER_SM follow");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_int2_bench",
      .summary = "the INT2 decode attention kernels: correctness against the CPU, then timings",
      .files = {__FILE__},
      .synopsis = "[--check-only | --bench-only | --one N BATCH CTAS_PER_SM]",
      .takes_args = true};
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(program, argc, argv);
  bool check = !absl::GetFlag(FLAGS_bench_only), bench = !absl::GetFlag(FLAGS_check_only);
  // --one N BATCH CTAS_PER_SM: a single config of the v2 kernel
  int one_n = 0, one_batch = 0, one_cps = 0;
  if (absl::GetFlag(FLAGS_one)) {
    if (cli.args.size() != 3) {
      return kvcd::cli::UsageError(program, nullptr, "--one takes N BATCH CTAS_PER_SM");
    }
    one_n = std::atoi(cli.args[0].c_str());
    one_batch = std::atoi(cli.args[1].c_str());
    one_cps = std::atoi(cli.args[2].c_str());
    check = false;
  } else if (!cli.args.empty()) {
    return kvcd::cli::UsageError(program, nullptr, "unexpected argument '" + cli.args[0] + "'");
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  bool checks_ok = true;
  if (check) {
    uint32_t seed =
        static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("correctness vs CPU oracle (seed %u): max relative error of o and lse\n", seed);
    struct Case {
      int hq, hkv, d, ps;
      std::vector<int> lengths;
      float growth;
    };
    const Case cases[] = {
        {32, 8, 128, 64, {1, 33, 1000, 4097}, 0.0f},
        {8, 8, 128, 32, {65, 0, 7}, 0.0f},
        {16, 2, 128, 64, {3000}, 0.0f},
        {24, 8, 128, 64, {777, 64}, 0.0f},
        {32, 8, 128, 64, {20000, 95}, 0.002f},
        {32, 8, 128, 64, {20000, 95}, 0.002f},  // the rising cases again, other seeds
        {32, 8, 128, 64, {20000, 95}, 0.002f},
        {32, 8, 128, 64, {8000}, 0.01f},
        {64, 8, 128, 32, {2049, 5}, 0.01f},
        {8, 2, 64, 64, {1, 200, 999}, 0.0f},
        {32, 4, 64, 64, {2000, 63}, 0.005f},
        {16, 4, 256, 32, {517, 31}, 0.0f},
        {4, 4, 64, 32, {100000}, 0.0f},
        {32, 8, 128, 128, {5000, 300}, 0.001f},  // a warp's pages entered mid-page
        {8, 2, 128, 96, {3001, 64}, 0.0f},
    };
    for (const auto kernel : {kk::cuda::Int2Kernel::kAuto, kk::cuda::Int2Kernel::kFirst}) {
      std::printf(" kernel %s\n", kernel == kk::cuda::Int2Kernel::kAuto
                                      ? "auto (int32 accumulation where supported)"
                                      : "first");
      for (const auto& c : cases) {
        const CaseResult r = CheckCase(c.hq, c.hkv, c.d, c.ps, c.lengths, seed++, c.growth, kernel);
        // The query enters the MMAs as two int8 digits (about 15 bits relative to its largest
        // element), so the absolute logit error grows with the logit range: 2e-3 relative up
        // to a range of 64 (real models stay well inside it), proportionally beyond.
        const double bound = 2e-3 * std::max(1.0, r.max_lse / 64.0);
        const bool pass = r.err < bound;
        checks_ok &= pass;
        std::printf("  hq %2d hkv %d d %3d page %2d growth %.3f lengths", c.hq, c.hkv, c.d, c.ps,
                    c.growth);
        for (int l : c.lengths) std::printf(" %d", l);
        std::printf(": %.2e (bound %.1e, max |lse| %.0f) %s\n", r.err, bound, r.max_lse,
                    pass ? "ok" : "FAIL");
      }
    }
    if (!checks_ok) std::printf("CORRECTNESS FAILED (timings follow; exit status 1)\n");
  }
  if (!bench) return checks_ok ? 0 : 1;
  // Demote throughput: bench/cuda_demote_bench.cu.
  // Read ceiling: a large read-only reduction.
  if (one_n == 0) {
    std::printf("read ceiling: %.2f TB/s (8 GiB read-only reduction, median of 10)\n",
                ReadCeilingTbps(nullptr, prop.multiProcessorCount, int64_t{8} << 30));
  }
  const int hq = 32, hkv = 8, d = 128, ps = 64;
  std::printf("\nINT2 decode attention, Qwen3-8B layer (32 q / 8 kv heads, d 128, page 64)\n");
  std::printf(
      "single: one call between two events (launch gaps included); b2b: 40 calls back to back,\n"
      "cycling over up to 4 layers of pages (what a decode step over layers sees), per call.\n");
  std::printf("%8s %6s %7s %10s %10s %10s %9s\n", "context", "batch", "splits", "single us",
              "b2b us", "MB read", "TB/s b2b");
  struct Variant {
    const char* label;
    kk::cuda::Int2Kernel kernel;
    int cps;
    bool dependent = true;
  };
  const auto kAuto = kk::cuda::Int2Kernel::kAuto;
  const std::vector<Variant> variants =
      one_n ? std::vector<Variant>{{"v2", kAuto, one_cps}}
            : std::vector<Variant>{
                  {"v2, default, 4 CTAs per SM", kAuto, 4},
                  {"v2, splits for 3 CTAs per SM", kAuto, 3},
                  {"v2, plain launches (no programmatic dependents)", kAuto, 4, false},
                  {"first kernel", kk::cuda::Int2Kernel::kFirst, 4}};
  // Timed on a stream of its own (as a serving process would launch; the programmatic
  // dependent launches of the v2 path are taken there).
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::vector<int> n_list = one_n ? std::vector<int>{one_n} : std::vector<int>{32768, 100000};
  const std::vector<int> b_list = one_n ? std::vector<int>{one_batch} : std::vector<int>{1, 8, 64};
  for (const Variant& var : variants) {
    std::printf("-- %s (splits for %d CTAs per SM) --\n", var.label, var.cps);
    for (int n : n_list) {
      for (int batch : b_list) {
        const int pages_per = (n + ps - 1) / ps;
        const int64_t page_bytes = kk::Int2PageBytes(hkv, ps, d);
        const int64_t n_pages = int64_t{pages_per} * batch;
        const int64_t layer_bytes = n_pages * page_bytes;
        const int layers =
            static_cast<int>(std::clamp<int64_t>(int64_t{1000000000} / layer_bytes, 1, 4));
        std::vector<uint8_t*> pages(layers);
        for (int l = 0; l < layers; ++l) {
          CHECK(cudaMalloc(&pages[l], layer_bytes));
          FillPages<<<4096, 256>>>(pages[l], n_pages, page_bytes, ps,
                                   2 * int64_t{hkv} * ps * (d / 4), 7u + l);
          CHECK(cudaGetLastError());
        }
        std::vector<int32_t> table(n_pages);
        for (int64_t i = 0; i < n_pages; ++i) table[i] = static_cast<int32_t>(i);
        std::mt19937 rng(5);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> q(batch * hq * d);
        for (auto& x : q) x = normal(rng);
        kk::cuda::Int2DecodeParams p;
        p.pages = pages[0];
        p.page_stride = page_bytes;
        p.page_table = Upload(table);
        p.max_pages = pages_per;
        p.lengths = Upload(std::vector<int32_t>(batch, n));
        p.batch = batch;
        p.num_q_heads = hq;
        p.num_kv_heads = hkv;
        p.head_dim = d;
        p.page_size = ps;
        p.q = Upload(q);
        const std::vector<float> h = kvcd::HadamardMatrix(d);
        p.r_k = Upload(h);
        p.r_v_t = Upload(h);
        p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
        p.num_splits = kk::cuda::Int2DecodeSplits(batch, hkv, n, prop.multiProcessorCount, var.cps);
        p.kernel = var.kernel;
        p.dependent_launch = var.dependent;
        float *o = nullptr, *lse = nullptr;
        void* ws = nullptr;
        CHECK(cudaMalloc(&o, batch * hq * d * 4));
        CHECK(cudaMalloc(&lse, batch * hq * 4));
        CHECK(cudaMalloc(&ws, kk::cuda::Int2DecodeWorkspaceBytes(batch, hq, d, p.num_splits)));
        p.o = o;
        p.lse = lse;
        p.workspace = ws;
        // single: one call at a time; b2b: 40 calls back to back over the layers.
        const double us = MedianUsPerCall(stream, one_n ? 5 : 33, one_n ? 0 : 3, 1, [&](int) {
          CHECK(kk::cuda::LaunchInt2Decode(p, n, stream));
        });
        const int calls = 40;
        const double us_b2b = MedianUsPerCall(stream, 7, 2, calls, [&](int c) {
          kk::cuda::Int2DecodeParams pc = p;
          pc.pages = pages[c % layers];
          CHECK(kk::cuda::LaunchInt2Decode(pc, n, stream));
        });
        const double mb = static_cast<double>(layer_bytes) / 1e6;
        std::printf("%8d %6d %7d %10.1f %10.1f %10.1f %9.2f", n, batch, p.num_splits, us, us_b2b,
                    mb, mb / us_b2b);
        if (batch == 1 && &var == &variants[0]) {
          // The call's parts: query preparation + decode grid without the merge, and the
          // merge kernel alone on the last parts.
          const int rows = batch * hq;
          float* part_o = static_cast<float*>(ws);
          float* part_lse = part_o + static_cast<size_t>(p.num_splits) * rows * d;
          kk::cuda::Int2PartsOptions opt;
          opt.state = part_lse + static_cast<size_t>(p.num_splits) * rows;
          const kk::cuda::PagedList list{p.pages, p.page_stride, p.page_table, p.max_pages,
                                         p.lengths};
          const kk::cuda::DecodeGeometry geo{batch, hq, hkv, d, ps};
          const double parts_us = MedianUsPerCall(stream, 7, 2, calls, [&](int c) {
            kk::cuda::PagedList lc = list;
            lc.pages = pages[c % layers];
            CHECK(kk::cuda::LaunchInt2DecodeParts(lc, geo, p.q, p.r_k, p.softmax_scale,
                                                  p.num_splits, n, part_o, part_lse, 0, stream,
                                                  opt));
          });
          const double merge_us = MedianUsPerCall(stream, 7, 2, calls, [&](int) {
            CHECK(kk::cuda::LaunchMergeParts(part_o, part_lse, p.num_splits, rows, d, p.r_v_t, o,
                                             lse, stream));
          });
          std::printf("   (b2b: query prep + decode grid %.1f us, merge alone %.1f us)", parts_us,
                      merge_us);
          // The same call as a CUDA graph (issue #36: "capture each shape's per-layer work as
          // a graph"): one graph per layer's pages, captured from the stream (the programmatic
          // launches become programmatic edges), timed as above. Its results must equal the
          // stream's bit for bit.
          const size_t o_bytes = static_cast<size_t>(rows) * d * sizeof(float);
          std::vector<float> o_stream(static_cast<size_t>(rows) * d), o_graph(o_stream.size());
          CHECK(kk::cuda::LaunchInt2Decode(p, n, stream));
          CHECK(cudaMemcpyAsync(o_stream.data(), o, o_bytes, cudaMemcpyDeviceToHost, stream));
          CHECK(cudaStreamSynchronize(stream));
          std::vector<cudaGraphExec_t> execs(layers);
          for (int l = 0; l < layers; ++l) {
            kk::cuda::Int2DecodeParams pl = p;
            pl.pages = pages[l];
            cudaGraph_t graph = nullptr;
            CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            CHECK(kk::cuda::LaunchInt2Decode(pl, n, stream));
            CHECK(cudaStreamEndCapture(stream, &graph));
            CHECK(cudaGraphInstantiate(&execs[l], graph, 0));
            CHECK(cudaGraphDestroy(graph));
          }
          CHECK(cudaMemsetAsync(o, 0, o_bytes, stream));
          CHECK(cudaGraphLaunch(execs[0], stream));
          CHECK(cudaMemcpyAsync(o_graph.data(), o, o_bytes, cudaMemcpyDeviceToHost, stream));
          CHECK(cudaStreamSynchronize(stream));
          const bool same = std::memcmp(o_stream.data(), o_graph.data(), o_bytes) == 0;
          checks_ok &= same;
          const double graph_us = MedianUsPerCall(
              stream, 33, 3, 1, [&](int) { CHECK(cudaGraphLaunch(execs[0], stream)); });
          const double graph_b2b = MedianUsPerCall(stream, 7, 2, calls, [&](int c) {
            CHECK(cudaGraphLaunch(execs[c % layers], stream));
          });
          std::printf("   (as a CUDA graph: single %.1f us, b2b %.1f us, o %s)", graph_us,
                      graph_b2b, same ? "bit-identical" : "DIFFERS");
          for (cudaGraphExec_t e : execs) CHECK(cudaGraphExecDestroy(e));
        }
        std::printf("\n");
        for (uint8_t* pg : pages) CHECK(cudaFree(pg));
        const void* to_free[] = {p.page_table, p.lengths, p.q, p.r_k, p.r_v_t, o, lse, ws};
        for (const void* ptr : to_free) CHECK(cudaFree(const_cast<void*>(ptr)));
      }
    }
  }
  CHECK(cudaStreamDestroy(stream));
  return checks_ok ? 0 : 1;
}
