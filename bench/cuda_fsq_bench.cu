// FSQ on the GPU (cuda_fsq.h): decode attention timings at Qwen3-8B geometry (C = 4096,
// 32 q / 8 KV heads, d = 128, key norm, half-pairing RoPE over 128 dims) for contexts 2k
// (the fixed cost of a call), 32k and 100k, batch 1 / 8 / 64, G = 256 (32x) and G = 84 (97.5x); the
// key-rebuild FLOPs and the bytes read per call against two ceilings measured in the same run (a
// read-only reduction's TB/s and a register-only mma.sync FP16 loop's TFLOP/s, and its int8
// m16n8k32 twin's TOPS); the error against the float64 oracle at that geometry; the device
// encoder's cost. The key-rebuild variants of cuda_fsq_i8.h that --kernel names: FP16 (the
// reference), int8, int8 at two CTAs per SM, the same with the code size compiled in
// (int8-2cta-fixed: d 128, G 255-256); both (the default) = FP16 and int8, all = the four;
// several separated by commas. Kernels only (runs on a GPU machine without the daemon's
// libraries).
//
//   cuda_fsq_bench [--quick] [--kernel=fp16|int8|int8-2cta|int8-2cta-fixed|both|all[,...]]
//   [--one G N BATCH
//   [--splits S]]
//   (--quick: contexts 32k only, batch 1 and 64)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/cuda_fsq.h"
#include "kvcd/kernels/cuda_fsq_i8.h"
#include "kvcd/kernels/fsq.h"

namespace kk = kvcd::kernels;

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kC = 4096, kPs = 64;

__global__ void FillBytes(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    p[i] = static_cast<uint8_t>(x >> 11);
  }
}

// The mma.sync ceiling: independent m16n8k16 FP16 MMAs on registers (8 accumulators per warp).
__global__ void MmaLoop(int iters, float* out) {
  uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, 7u, 9u}, b0 = threadIdx.x ^ 5u, b1 = 3u;
  float c[8][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
  }
  float s = 0;
  for (int k = 0; k < 8; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (s == 1.2345f) out[0] = s;
}

// The int8 ceiling: the same loop of m16n8k32 u8 x s8 MMAs.
__global__ void MmaLoopI8(int iters, int* out) {
  uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, 7u, 9u}, b0 = threadIdx.x ^ 5u, b1 = 3u;
  int c[8][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      asm volatile(
          "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+r"(c[k][0]), "+r"(c[k][1]), "+r"(c[k][2]), "+r"(c[k][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
  }
  int s = 0;
  for (int k = 0; k < 8; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (s == 12345) out[0] = s;
}

// One layer's codec at Qwen3-8B geometry, host and device copies.
struct Codec {
  std::vector<float> wk, wv, bk, bv, kn, e, eb;
  std::vector<float> wk_i8;  // the int8 decoder as floats (scale * q): the int8 kernel's oracle
  kk::FsqLayerCodec host{}, dev{};
  void* prepared[std::size(kk::cuda::kFsqKeyKernels)] = {};  // per FsqKeyKernel
  Codec(int G, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    wk.resize(kHkv * kD * G);
    wv.resize(kHkv * kD * G);
    bk.resize(kHkv * kD);
    bv.resize(kHkv * kD);
    kn.resize(kD);
    e.resize(static_cast<size_t>(G) * kC);
    eb.resize(G);
    for (auto& v : wk) v = normal(rng) / std::sqrt(static_cast<float>(G));
    for (auto& v : wv) v = normal(rng) / std::sqrt(static_cast<float>(G));
    for (auto& v : bk) v = 0.2f * normal(rng);
    for (auto& v : bv) v = 0.2f * normal(rng);
    for (auto& v : kn) v = 1.0f + 0.3f * normal(rng);
    for (auto& v : e) v = normal(rng) / 64.0f;
    for (auto& v : eb) v = 0.1f * normal(rng);
    host.residual_width = kC;
    host.latent_width = G;
    host.num_kv_heads = kHkv;
    host.head_dim = kD;
    host.encoder = e.data();
    host.encoder_bias = eb.data();
    host.decoder_k = wk.data();
    host.decoder_v = wv.data();
    host.bias_k = bk.data();
    host.bias_v = bv.data();
    host.key_norm = kn.data();
    dev = host;
    dev.encoder = Upload(e);
    dev.encoder_bias = Upload(eb);
    dev.decoder_k = Upload(wk);
    dev.decoder_v = Upload(wv);
    dev.bias_k = Upload(bk);
    dev.bias_v = Upload(bv);
    dev.key_norm = Upload(kn);
    for (const auto k : kk::cuda::kFsqKeyKernels) {
      void*& p = prepared[static_cast<int>(k)];
      CHECK(cudaMalloc(&p, kk::cuda::FsqDecoderBytes(k, kHkv, kD, G)));
      CHECK(kk::cuda::LaunchFsqPrepareDecoder(k, dev, p, nullptr));
    }
    wk_i8.resize(wk.size());
    std::vector<int8_t> q(G);
    for (int r = 0; r < kHkv * kD; ++r) {
      const float sc = kk::cuda::FsqQuantizeKeyRow(wk.data() + r * G, G, q.data());
      for (int k = 0; k < G; ++k) wk_i8[r * G + k] = sc * q[k];
    }
  }
};

kk::RopeSpec QwenRope() {
  kk::RopeSpec r;
  r.theta = 1000000.0;
  r.rotary_dims = kD;
  r.pairing = kk::RopePairing::kHalf;
  return r;
}

// Error of the kernel against the float64 oracle at this geometry: one sequence of n
// tokens at positions from `pos0`; relative L2 error of o over every head, max |dlse|; the
// int8 kernel also against the oracle of its own decoder (scale * q).
void ErrorAtGeometry(kk::cuda::FsqKeyKernel kernel, const Codec& c, int n, int64_t pos0,
                     int num_sms) {
  const int G = c.host.latent_width;
  const int64_t cb = kk::FsqCodeBytes(G), page_bytes = kPs * cb;
  const int pages = (n + kPs - 1) / kPs;
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> pool(pages * page_bytes);
  for (auto& b : pool) b = static_cast<uint8_t>(rng());
  std::vector<int32_t> ids(pages);
  for (int i = 0; i < pages; ++i) ids[i] = i;
  std::vector<float> q(kHq * kD);
  for (auto& v : q) v = 2.0f * normal(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  const kk::cuda::DecodeGeometry geo{1, kHq, kHkv, kD, kPs};
  const int splits = kk::cuda::FsqDecodeSplits(kernel, geo, G, n, num_sms);
  void* ws = nullptr;
  CHECK(cudaMalloc(&ws, kk::cuda::FsqDecodeWorkspaceBytes(1, kHq, G, splits)));
  float *po = nullptr, *pl = nullptr;
  CHECK(cudaMalloc(&po, kHq * kD * 4));
  CHECK(cudaMalloc(&pl, kHq * 4));
  kk::cuda::FsqDecodeArgs a;
  a.codec = c.dev;
  a.prepared = c.prepared[static_cast<int>(kernel)];
  a.rope = QwenRope();
  a.positions = Upload(std::vector<int64_t>{pos0});
  a.q = Upload(q);
  a.softmax_scale = scale;
  a.splits = splits;
  a.workspace = ws;
  const kk::cuda::PagedList list{Upload(pool), page_bytes, Upload(ids), pages,
                                 Upload(std::vector<int32_t>{n})};
  CHECK(kk::cuda::LaunchFsqDecodeParts(kernel, list, geo, a, n, po, pl, 0, nullptr));
  std::vector<float> got(kHq * kD), got_l(kHq);
  CHECK(cudaMemcpy(got.data(), po, got.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(got_l.data(), pl, got_l.size() * 4, cudaMemcpyDeviceToHost));
  kk::FsqPageTable t;
  t.base = pool.data();
  t.page_stride = page_bytes;
  t.page_ids = ids.data();
  t.num_pages = pages;
  t.page_size = kPs;
  t.first_position = pos0;
  const bool i8 = kernel != kk::cuda::FsqKeyKernel::kFp16;
  kk::FsqLayerCodec own = c.host;
  own.decoder_k = c.wk_i8.data();
  double err = 0, norm = 0, dl = 0, oerr = 0, onorm = 0;
  const int group = kHq / kHkv;
  std::vector<float> o(group * kD), l(group), oo(group * kD), ol(group);
  for (int h = 0; h < kHkv; ++h) {
    const float* qh = q.data() + h * group * kD;
    kk::AttendFsqPagesReference(t, c.host, QwenRope(), h, qh, group, scale, 0, n, o.data(),
                                l.data());
    if (i8) {
      kk::AttendFsqPagesReference(t, own, QwenRope(), h, qh, group, scale, 0, n, oo.data(),
                                  ol.data());
    }
    for (int i = 0; i < group * kD; ++i) {
      err += std::pow(got[h * group * kD + i] - o[i], 2);
      norm += std::pow(o[i], 2);
      if (i8) {
        oerr += std::pow(got[h * group * kD + i] - oo[i], 2);
        onorm += std::pow(oo[i], 2);
      }
    }
    for (int j = 0; j < group; ++j)
      dl = std::max(dl, std::fabs(double{got_l[h * group + j]} - l[j]));
  }
  std::printf(
      "  %s G %3d, %d tokens at positions %lld..: relative L2 error of o %.2e, max |dlse| "
      "%.1e",
      kk::cuda::FsqKeyKernelName(kernel), G, n, static_cast<long long>(pos0), std::sqrt(err / norm),
      dl);
  if (i8) std::printf(" (against the oracle on scale * q: %.2e)", std::sqrt(oerr / onorm));
  std::printf("\n");
}

}  // namespace

ABSL_FLAG(bool, quick, false, "fewer configurations");
ABSL_FLAG(bool, one, false, "that decode configuration only (profilers): G N BATCH follow");
ABSL_FLAG(int32_t, splits, 0,
          "with --one: this many splits of each sequence's tokens instead of the kernel's own "
          "count (FsqDecodeSplits; 0), to see what a call's split count costs");
ABSL_FLAG(std::string, kernel, "both",
          "key rebuild: fp16, int8, int8-2cta, int8-2cta-fixed, both (fp16 and int8) or all; "
          "several separated by commas");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_fsq_bench",
      .summary = "FSQ decode attention timings on the GPU against two ceilings",
      .files = {__FILE__},
      .synopsis =
          "[--quick | --one G N BATCH [--splits S]] "
          "[--kernel=fp16|int8|int8-2cta|int8-2cta-fixed|both|all[,...]]",
      .takes_args = true};
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(program, argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  // --one G N BATCH: that decode configuration only (profilers).
  const bool one = absl::GetFlag(FLAGS_one);
  if (one ? cli.args.size() != 3 : !cli.args.empty()) {
    return kvcd::cli::UsageError(program, nullptr,
                                 one ? "--one takes G N BATCH" : "unexpected argument");
  }
  // --kernel: names separated by commas, the variants in the order named.
  const std::string kernel_flag = absl::GetFlag(FLAGS_kernel);
  std::vector<kk::cuda::FsqKeyKernel> kernels;
  for (size_t at = 0; at <= kernel_flag.size();) {
    const size_t comma = std::min(kernel_flag.find(',', at), kernel_flag.size());
    const std::string name = kernel_flag.substr(at, comma - at);
    at = comma + 1;
    bool known = false;
    for (const auto k : kk::cuda::kFsqKeyKernels) {
      const bool in_both = k == kk::cuda::FsqKeyKernel::kFp16 || k == kk::cuda::FsqKeyKernel::kInt8;
      if (name == kk::cuda::FsqKeyKernelName(k) || name == "all" || (name == "both" && in_both)) {
        known = true;
        if (std::find(kernels.begin(), kernels.end(), k) == kernels.end()) kernels.push_back(k);
      }
    }
    if (!known) {
      std::string why = "--kernel takes ";
      for (const auto k : kk::cuda::kFsqKeyKernels)
        why += std::string(kk::cuda::FsqKeyKernelName(k)) + ", ";
      why += "both or all, or several separated by commas; got \"" + name + "\"";
      return kvcd::cli::UsageError(program, nullptr, why);
    }
  }
  const int one_g = one ? std::atoi(cli.args[0].c_str()) : 0,
            one_n = one ? std::atoi(cli.args[1].c_str()) : 0,
            one_b = one ? std::atoi(cli.args[2].c_str()) : 0;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Ceilings.
  double read_tbs = 1, mma_tflops = 1;
  if (!one) {
    read_tbs = ReadCeilingTbps(stream, prop.multiProcessorCount, int64_t{8} << 30);
    unsigned* out = nullptr;
    CHECK(cudaMalloc(&out, 4));
    const int iters = 4096, blocks = prop.multiProcessorCount * 4, threads = 256;
    const double mus = MedianUsPerCall(stream, 5, 1, 1, [&](int) {
      MmaLoop<<<blocks, threads, 0, stream>>>(iters, reinterpret_cast<float*>(out));
    });
    mma_tflops = 2.0 * 16 * 8 * 16 * 8 * double{iters} * blocks * (threads / 32) / mus / 1e6;
    const double mus8 = MedianUsPerCall(stream, 5, 1, 1, [&](int) {
      MmaLoopI8<<<blocks, threads, 0, stream>>>(iters, reinterpret_cast<int*>(out));
    });
    const double mma_tops8 =
        2.0 * 16 * 8 * 32 * 8 * double{iters} * blocks * (threads / 32) / mus8 / 1e6;
    CHECK(cudaFree(out));
    std::printf(
        "read ceiling %.2f TB/s (8 GiB read-only reduction); mma.sync m16n8k16 FP16 "
        "ceiling %.0f TFLOP/s (register-only loop; datasheet dense 990); m16n8k32 u8 x s8 "
        "%.0f TOPS (datasheet dense 1979)\n",
        read_tbs, mma_tflops, mma_tops8);
  }

  // Error against the float64 oracle at the benchmark geometry.
  std::printf(
      "\nerror against the float64 oracle (W_k FP16 per-row scaled, or int8 per-row scaled; "
      "TF32 scores, FP16 softmax weights):\n");
  std::vector<Codec*> codecs;
  for (int G : {256, 84}) {
    if (!one || G == one_g) codecs.push_back(new Codec(G, 1000u + G));
  }
  for (Codec* c : codecs) {
    for (const auto k : kernels) {
      if (!one) ErrorAtGeometry(k, *c, 4096, 100000, prop.multiProcessorCount);
    }
  }

  // Encode: one decode step (64 tokens x 36 layers) and a 8192-token Put of one layer.
  std::printf("\ndevice encoder (float64 FMA chains, bit-identical to the CPU):\n");
  for (Codec* c : one ? std::vector<Codec*>{} : codecs) {
    const int G = c->host.latent_width;
    for (const auto& [tokens, layers] : {std::pair<int, int>{64, 36}, {8192, 1}}) {
      std::vector<kk::FsqLayerCodec> lc(layers, c->dev);
      const int64_t cb = kk::FsqCodeBytes(G);
      float* x = nullptr;
      uint8_t* pool = nullptr;
      CHECK(cudaMalloc(&x, int64_t{layers} * tokens * kC * 4));
      CHECK(cudaMemset(x, 0, int64_t{layers} * tokens * kC * 4));
      const int pages = (tokens + kPs - 1) / kPs;
      CHECK(cudaMalloc(&pool, int64_t{layers} * pages * kPs * cb));
      std::vector<int64_t> slots(tokens);
      for (int t = 0; t < tokens; ++t) slots[t] = t;
      kk::cuda::RowBlock rb;
      rb.data = x;
      rb.bf16 = false;
      rb.layer_stride = int64_t{tokens} * kC;
      rb.token_stride = kC;
      kk::cuda::PagedRows dst;
      dst.num_layers = layers;
      dst.num_tokens = tokens;
      dst.page_size = kPs;
      dst.base = pool;
      dst.layer_stride = int64_t{pages} * kPs * cb;
      dst.page_bytes = kPs * cb;
      dst.slots = Upload(slots);
      const kk::FsqLayerCodec* d_lc = Upload(lc);
      const double us = MedianUsPerCall(stream, 7, 2, 1, [&](int) {
        CHECK(kk::cuda::LaunchFsqEncodeRows(rb, dst, 0, d_lc, kC, G, stream));
      });
      const double flop = 2.0 * tokens * layers * G * kC;
      std::printf("  G %3d: %5d tokens x %2d layers in %8.1f us (%.1f TFLOP/s float64)\n", G,
                  tokens, layers, us, flop / us / 1e6);
      CHECK(cudaFree(x));
      CHECK(cudaFree(pool));
      CHECK(cudaFree(const_cast<int64_t*>(dst.slots)));
      CHECK(cudaFree(const_cast<kk::FsqLayerCodec*>(d_lc)));
    }
  }

  std::printf(
      "\nFSQ decode attention, Qwen3-8B layer (32 q / 8 kv heads, d 128, page %d, key norm, "
      "RoPE half 128)\nsingle: one call between two events; b2b: 40 calls back to back over up "
      "to 4 layers of pages, per call.\nGFLOP: key rebuild 2 n Hkv d G per sequence; MB: codes "
      "read (+ prepared W_k, L2-resident).\n",
      kPs);
  std::printf("%9s %4s %8s %6s %7s %10s %10s %8s %8s %9s %8s %8s\n", "kernel", "G", "context",
              "batch", "splits", "single us", "b2b us", "MB", "GFLOP", "TB/s", "TFLOP/s", "bound");
  const std::vector<int> n_list = one     ? std::vector<int>{one_n}
                                  : quick ? std::vector<int>{32768}
                                          : std::vector<int>{2048, 32768, 100000};
  const std::vector<int> b_list = one     ? std::vector<int>{one_b}
                                  : quick ? std::vector<int>{1, 64}
                                          : std::vector<int>{1, 8, 64};
  for (Codec* c : codecs) {
    for (const auto kernel : kernels) {
      const int G = c->host.latent_width;
      const int64_t cb = kk::FsqCodeBytes(G), page_bytes = kPs * cb;
      for (int n : n_list) {
        for (int batch : b_list) {
          const int pages_per = (n + kPs - 1) / kPs;
          const int64_t n_pages = int64_t{pages_per} * batch;
          const int64_t layer_bytes = n_pages * page_bytes;
          const int layers =
              static_cast<int>(std::clamp<int64_t>(int64_t{1000000000} / layer_bytes, 1, 4));
          std::vector<uint8_t*> pools(layers);
          for (int l = 0; l < layers; ++l) {
            CHECK(cudaMalloc(&pools[l], layer_bytes));
            FillBytes<<<4096, 256>>>(pools[l], layer_bytes, 7u + l);
            CHECK(cudaGetLastError());
          }
          std::vector<int32_t> table(n_pages);
          for (int64_t i = 0; i < n_pages; ++i) table[i] = static_cast<int32_t>(i);
          std::mt19937 rng(5);
          std::normal_distribution<float> normal(0.0f, 1.0f);
          std::vector<float> q(batch * kHq * kD);
          for (auto& v : q) v = normal(rng);
          const kk::cuda::DecodeGeometry geo{batch, kHq, kHkv, kD, kPs};
          const int splits =
              one && absl::GetFlag(FLAGS_splits) > 0
                  ? absl::GetFlag(FLAGS_splits)
                  : kk::cuda::FsqDecodeSplits(kernel, geo, G, n, prop.multiProcessorCount);
          void* ws = nullptr;
          float *po = nullptr, *pl = nullptr;
          CHECK(cudaMalloc(&ws, kk::cuda::FsqDecodeWorkspaceBytes(batch, kHq, G, splits)));
          CHECK(cudaMalloc(&po, int64_t{batch} * kHq * kD * 4));
          CHECK(cudaMalloc(&pl, int64_t{batch} * kHq * 4));
          kk::cuda::FsqDecodeArgs a;
          a.codec = c->dev;
          a.prepared = c->prepared[static_cast<int>(kernel)];
          a.rope = QwenRope();
          a.positions = Upload(std::vector<int64_t>(batch, 64));
          a.q = Upload(q);
          a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kD));
          a.splits = splits;
          a.workspace = ws;
          kk::cuda::PagedList list{pools[0], page_bytes, Upload(table), pages_per,
                                   Upload(std::vector<int32_t>(batch, n))};
          const double us = MedianUsPerCall(stream, 25, 3, 1, [&](int) {
            CHECK(kk::cuda::LaunchFsqDecodeParts(kernel, list, geo, a, n, po, pl, 0, stream));
          });
          const double us_b2b = MedianUsPerCall(stream, 7, 2, 40, [&](int call) {
            kk::cuda::PagedList lc = list;
            lc.pages = pools[call % layers];
            CHECK(kk::cuda::LaunchFsqDecodeParts(kernel, lc, geo, a, n, po, pl, 0, stream));
          });
          const double mb = static_cast<double>(layer_bytes) / 1e6;
          const double gflop = 2.0 * n * batch * kHkv * kD * G / 1e9;
          const double tbs = mb / us_b2b, tflops = gflop / us_b2b * 1e3;
          std::printf("%9s %4d %8d %6d %7d %10.1f %10.1f %8.1f %8.1f %9.2f %8.0f",
                      kk::cuda::FsqKeyKernelName(kernel), G, n, batch, splits, us, us_b2b, mb,
                      gflop, tbs, tflops);
          if (one) {
            std::printf("       -\n");  // --one measures no ceilings
          } else {
            std::printf(" %7.0f%%%s\n", 100.0 * std::max(tbs / read_tbs, tflops / mma_tflops),
                        tbs / read_tbs > tflops / mma_tflops ? " read" : " mma");
          }
          for (uint8_t* p : pools) CHECK(cudaFree(p));
          const void* to_free[] = {list.page_table, list.lengths, a.positions, a.q, ws, po, pl};
          for (const void* p : to_free) CHECK(cudaFree(const_cast<void*>(p)));
        }
      }
    }
  }
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
