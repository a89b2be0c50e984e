// int2-transform decode attention on the GPU (cuda_transform.h) beside the INT2 kernel
// (cuda_decode_attention.h) at the same context: SmolLM2-135M's layer (9 q / 3 kv heads,
// d 64) and Qwen3-8B's (32 q / 8 kv heads, d 128), batch 1 and 8, 32k and 100k tokens, page
// 64; int2-transform through both decode variants (FP32, tensor cores).
// Pages hold random codes with valid FP16 parameters (the kernels' time does not depend on
// the values; cuda_transform_test checks the results). Calls go back to back over enough
// layers of pages (>= 256 MB) that L2 does not hold them, as a decode step over the layers
// sees them. Also the Put-size row stores (int2-transform: float64 key encode; INT2).
// Self-contained (kernels only).
//
//   cuda_transform_bench [--out FILE.md]
//   cuda_transform_bench --tc-only --layer Qwen3-8B --batch 1 --context 100000
//       (only that tensor-core call, a few times: for ncu)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "common/key_transform_profile.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/cuda_transform.h"
#include "kvcd/kernels/int2_attention.h"
#include "transform_device_codec.cuh"

namespace kk = kvcd::kernels;
namespace kc = kvcd::kernels::cuda;

namespace {

struct Geometry {
  const char* name;
  int hq, hkv, d;
};

// Head codecs ([layer][kv head] of a synthetic version-3 profile) in device memory.

// How many layers of `layer_bytes` the back-to-back calls cycle over (>= 256 MB in all).
int LayersFor(int64_t layer_bytes) {
  return static_cast<int>(
      std::clamp<int64_t>(((int64_t{256} << 20) + layer_bytes - 1) / layer_bytes, 2, 64));
}

}  // namespace

ABSL_FLAG(std::string, out, "", "also write the table to this Markdown file");
ABSL_FLAG(std::string, layer, "",
          "only this layer geometry, by its name in the table (e.g. Qwen3-8B; empty: all)");
ABSL_FLAG(int32_t, batch, 0, "only this batch size (0: all)");
ABSL_FLAG(int32_t, context, 0, "only this context length in tokens (0: all)");
ABSL_FLAG(bool, tc_only, false,
          "time only the tensor-core variant, one call after one warm-up (for Nsight Compute)");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_transform_bench",
      .summary =
          "int2-transform decode attention on the GPU (FP32 and tensor-core variants) "
          "beside the INT2 kernel",
      .files = {__FILE__},
      .synopsis = "[--out FILE.md] [--tc-only --layer NAME --batch B --context N]"};
  kvcd::cli::Parse(program, argc, argv);
  const std::string out_path = absl::GetFlag(FLAGS_out);
  const std::string only_layer = absl::GetFlag(FLAGS_layer);
  const int only_batch = absl::GetFlag(FLAGS_batch);
  const int only_context = absl::GetFlag(FLAGS_context);
  const bool tc_only = absl::GetFlag(FLAGS_tc_only);
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::string md;
  auto emit = [&md](const std::string& s) {
    std::fputs(s.c_str(), stdout);
    md += s;
  };
  char line[512];
  std::snprintf(line, sizeof(line), "device: %s, %d SMs\n", prop.name, sms);
  emit(line);
  const double ceiling = tc_only ? 0.0 : ReadCeilingTbps(nullptr, sms, int64_t{2} << 30);
  std::snprintf(line, sizeof(line), "read ceiling: %.2f TB/s (2 GiB read-only reduction)\n\n",
                ceiling);
  emit(line);
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int ps = 64, calls = tc_only ? 3 : 40;
  emit(
      "decode attention, page 64: one layer's history per call (each sequence its own pages),\n"
      "calls back to back over >= 256 MB of layers; int2-transform fp32 / tc = the FP32 or the\n"
      "tensor-core decode kernel (tc: + its query preparation) + LaunchMergeParts (the daemon\n"
      "merges their parts with the windows'), INT2 = LaunchInt2Decode (v2 kernel + fused merge);\n"
      "x INT2 = time over INT2's time\n\n");
  emit(
      "| layer | batch | context | B/token-head xform | splits fp32 / tc | fp32 us | fp32 GB/s | "
      "tc us | tc GB/s | B/token-head INT2 | INT2 us | INT2 GB/s | fp32 x INT2 | tc x INT2 "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Geometry& g : {Geometry{"SmolLM2-135M", 9, 3, 64}, Geometry{"Qwen3-8B", 32, 8, 128}}) {
    if (!only_layer.empty() && only_layer != g.name) continue;
    const int d = g.d, hq = g.hq, hkv = g.hkv;
    // The codec: one layer's heads of a synthetic version-3 profile.
    const TransformDeviceCodec codec(kvcd::KeyTransformProfile::SyntheticHeads(1, hkv, d, 7), d);
    const kk::TransformPageLayout layout{hkv, ps, d, codec.code_bytes};
    const kc::TransformPageOffsets offsets(layout);
    for (int batch : {1, 8}) {
      if (only_batch > 0 && batch != only_batch) continue;
      for (int n : {32768, 100000}) {
        if (only_context > 0 && n != only_context) continue;
        const int pages_per = (n + ps - 1) / ps;
        const int64_t pages = int64_t{pages_per} * batch;  // per layer
        std::vector<int32_t> table(static_cast<size_t>(pages));
        for (int64_t i = 0; i < pages; ++i) table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
        int32_t* d_table = Upload(table);
        int32_t* d_len = Upload(std::vector<int32_t>(batch, n));
        std::mt19937 rng(5);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> q(static_cast<size_t>(batch) * hq * d);
        for (auto& x : q) x = normal(rng);
        float* d_q = Upload(q);
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        const kc::DecodeGeometry geo{batch, hq, hkv, d, ps};
        const int rows = batch * hq;
        float *o = nullptr, *lse = nullptr;
        CHECK(cudaMalloc(&o, sizeof(float) * rows * d));
        CHECK(cudaMalloc(&lse, sizeof(float) * rows));

        // int2-transform, both variants on the same pages.
        const int64_t x_layer = pages * layout.Bytes();
        const int x_layers = LayersFor(x_layer);
        uint8_t* x_pages = nullptr;
        CHECK(cudaMalloc(&x_pages, x_layer * x_layers));
        FillPages<<<4096, 256>>>(x_pages, pages * x_layers, layout.Bytes(), ps, offsets.v_params,
                                 11u, offsets.k_gains, int64_t{hkv} * ps * 2);
        CHECK(cudaGetLastError());
        const int splits_f = kc::TransformDecodeSplits(batch, hkv, n, sms);
        const int splits_t = kc::TransformTcDecodeSplits(batch, hq, hkv, n, sms);
        const int splits = std::max(splits_f, splits_t);
        float *part_o = nullptr, *part_lse = nullptr;
        void* state = nullptr;
        CHECK(cudaMalloc(&part_o, sizeof(float) * splits * rows * d));
        CHECK(cudaMalloc(&part_lse, sizeof(float) * splits * rows));
        CHECK(cudaMalloc(&state, kc::TransformTcStateBytes(batch, hkv)));
        auto list_of = [&](int c) {
          return kc::PagedList{x_pages + (c % x_layers) * x_layer, layout.Bytes(), d_table,
                               pages_per, d_len};
        };
        const double f_us = tc_only ? 0.0 : MedianUsPerCall(stream, 7, 2, calls, [&](int c) {
          CHECK(kc::LaunchTransformDecodeParts(list_of(c), geo, offsets, codec.heads, d_q, scale,
                                               splits_f, n, part_o, part_lse, 0, stream));
          CHECK(kc::LaunchMergeParts(part_o, part_lse, splits_f, rows, d, nullptr, o, lse, stream));
        });
        const bool tc = kc::TransformTensorCoreServes(geo, offsets);
        const double t_us =
            !tc ? 0.0
                : MedianUsPerCall(stream, tc_only ? 1 : 7, tc_only ? 0 : 2, calls, [&](int c) {
                    CHECK(kc::LaunchTransformDecodePartsTc(list_of(c), geo, offsets, codec.heads,
                                                           d_q, scale, splits_t, n, part_o,
                                                           part_lse, 0, state, stream));
                    CHECK(kc::LaunchMergeParts(part_o, part_lse, splits_t, rows, d, nullptr, o, lse,
                                               stream));
                  });
        const double x_token_head = static_cast<double>(layout.Bytes()) / (ps * hkv);
        const double x_bytes = static_cast<double>(n) * batch * hkv * x_token_head;

        // INT2 at the same context.
        const int64_t i_page = kk::Int2PageBytes(hkv, ps, d);
        const int64_t i_layer = pages * i_page;
        const int i_layers = tc_only ? 1 : LayersFor(i_layer);
        uint8_t* i_pages = nullptr;
        CHECK(cudaMalloc(&i_pages, i_layer * i_layers));
        FillPages<<<4096, 256>>>(i_pages, pages * i_layers, i_page, ps,
                                 2 * int64_t{hkv} * ps * (d / 4), 7u);
        CHECK(cudaGetLastError());
        kc::Int2DecodeParams p;
        p.page_stride = i_page;
        p.page_table = d_table;
        p.max_pages = pages_per;
        p.lengths = d_len;
        p.batch = batch;
        p.num_q_heads = hq;
        p.num_kv_heads = hkv;
        p.head_dim = d;
        p.page_size = ps;
        p.q = d_q;
        p.softmax_scale = scale;
        p.num_splits = kc::Int2DecodeSplits(batch, hkv, n, sms, kc::Int2CtasPerSm(hq, hkv, d));
        p.o = o;
        p.lse = lse;
        void* ws = nullptr;
        CHECK(cudaMalloc(&ws, kc::Int2DecodeWorkspaceBytes(batch, hq, d, p.num_splits)));
        p.workspace = ws;
        const double i_us = tc_only ? 1.0 : MedianUsPerCall(stream, 7, 2, calls, [&](int c) {
          kc::Int2DecodeParams pc = p;
          pc.pages = i_pages + (c % i_layers) * i_layer;
          CHECK(kc::LaunchInt2Decode(pc, n, stream));
        });
        const double i_token_head = static_cast<double>(i_page) / (ps * hkv);
        const double i_bytes = static_cast<double>(n) * batch * hkv * i_token_head;
        std::snprintf(line, sizeof(line),
                      "| %s | %d | %d | %.1f | %d / %d | %.1f | %.0f | %.1f | %.0f | %.1f | %.1f | "
                      "%.0f | %.2f | %.2f |\n",
                      g.name, batch, n, x_token_head, splits_f, splits_t, f_us,
                      x_bytes / (f_us * 1e3), t_us, tc ? x_bytes / (t_us * 1e3) : 0.0, i_token_head,
                      i_us, i_bytes / (i_us * 1e3), f_us / i_us, t_us / i_us);
        emit(line);
        CHECK(cudaFree(x_pages));
        CHECK(cudaFree(i_pages));
        CHECK(cudaFree(part_o));
        CHECK(cudaFree(part_lse));
        CHECK(cudaFree(state));
        CHECK(cudaFree(ws));
        CHECK(cudaFree(o));
        CHECK(cudaFree(lse));
        CHECK(cudaFree(d_q));
        CHECK(cudaFree(d_table));
        CHECK(cudaFree(d_len));
      }
    }
  }

  // Put-size stores: 4096 tokens x 30 layers of SmolLM2-135M (3 KV heads, d 64), BF16 rows.
  if (!tc_only) {
    const int layers = 30, hkv = 3, d = 64, tokens = 4096;
    const TransformDeviceCodec codec(kvcd::KeyTransformProfile::SyntheticHeads(layers, hkv, d, 9),
                                     d);
    const kk::TransformPageLayout layout{hkv, ps, d, codec.code_bytes};
    const int64_t pages = tokens / ps;
    std::vector<uint16_t> rows(static_cast<size_t>(2) * layers * tokens * hkv * d);
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& x : rows) x = kk::FloatToBf16(normal(rng));
    const uint16_t* d_rows = Upload(rows);
    std::vector<int64_t> slots(tokens);
    for (int t = 0; t < tokens; ++t) slots[t] = t;
    const int64_t* d_slots = Upload(slots);
    uint8_t* x_pool = nullptr;
    CHECK(cudaMalloc(&x_pool, layers * pages * layout.Bytes()));
    PutRows x(d_rows, layers, tokens, hkv, d, ps, d_slots, x_pool, pages, layout.Bytes());
    const double x_us = MedianUsPerCall(stream, 5, 1, 1, [&](int) {
      CHECK(kc::LaunchStoreTransformRows(x.k, x.v, x.dst, kc::TransformPageOffsets(layout),
                                         codec.heads, stream));
    });
    uint8_t* i_pool = nullptr;
    const int64_t i_page = kk::Int2PageBytes(hkv, ps, d);
    CHECK(cudaMalloc(&i_pool, layers * pages * i_page));
    PutRows r(d_rows, layers, tokens, hkv, d, ps, d_slots, i_pool, pages, i_page);
    const std::vector<float> rho(layers, 0.92f);
    kc::RowCodec rc;
    rc.rho_k = Upload(rho);
    rc.rho_v = rc.rho_k;
    const double i_us = MedianUsPerCall(
        stream, 5, 1, 1, [&](int) { CHECK(kc::LaunchStoreInt2Rows(r.k, r.v, r.dst, rc, stream)); });
    std::snprintf(line, sizeof(line),
                  "\nPut-size row store, %d tokens x %d layers x %d KV heads (d %d, BF16 rows): "
                  "int2-transform %.0f us (%.1f M key rows/s), INT2 (no rotation) %.0f us\n",
                  tokens, layers, hkv, d, x_us, layers * tokens * hkv / x_us, i_us);
    emit(line);
  }
  if (!out_path.empty()) {
    if (FILE* f = std::fopen(out_path.c_str(), "w")) {
      std::fputs(md.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}
