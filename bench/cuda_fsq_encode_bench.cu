// The FSQ encoders on the GPU: the float64 encoder (cuda_fsq.h, bit-identical to the CPU)
// against the tensor-core encoder (cuda_fsq_encode_tc.h: BF16, FP16, split BF16) at C = 4096,
// G = 256 (and 84): timings for 8,192 tokens of one layer and a 32k-token prompt over 36
// layers (BF16 residuals, as a worker sends them), the BF16 mma.sync ceiling measured in the
// same run, the fraction of codes that differ from the float64 encoder's on synthetic data
// (the synthetic codec's scales, residual channels of uneven scale), and the effect of the
// differing codes on attention (the float64 oracle on both code sets, Qwen3-8B layer).
//
//   cuda_fsq_encode_bench            all of it
//   cuda_fsq_encode_bench --tc-timings   the tensor-core timings only
//   cuda_fsq_encode_bench --one V T L   variant V (exact | bf16 | fp16 | split) on T tokens x L
//                                       layers at G 256, three calls (profilers)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/cuda_fsq.h"
#include "kvcd/kernels/cuda_fsq_encode_tc.h"
#include "kvcd/kernels/fsq.h"

namespace kk = kvcd::kernels;
namespace kc = kvcd::kernels::cuda;

namespace {

constexpr int kC = 4096, kHkv = 8, kD = 128, kHq = 32, kPs = 64;

// Residuals: x = s_c n with n ~ N(0, 1) (Box-Muller on a hash) and channel scales s_c of 1,
// with every 61st channel at 8 (the few large channels of a normalized residual), as BF16.
__global__ void FillResiduals(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t a = static_cast<uint32_t>(i) * 2654435761u ^ seed, b = a * 0x9e3779b9u + 0x7f4a7c15u;
    a ^= a >> 15, a *= 0x2c1b3c6du, a ^= a >> 12;
    b ^= b >> 15, b *= 0x297a2d39u, b ^= b >> 12;
    const float u1 = (static_cast<float>(a >> 8) + 1.0f) * (1.0f / 16777217.0f);
    const float u2 = static_cast<float>(b >> 8) * (1.0f / 16777216.0f);
    const float g = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    x[i] = __float2bfloat16_rn(g * ((i % kC) % 61 == 3 ? 8.0f : 1.0f));
  }
}

// The BF16 mma.sync ceiling: independent m16n8k16 MMAs on registers.
__global__ void MmaLoopBf16(int iters, float* out) {
  uint32_t a[4] = {threadIdx.x, threadIdx.x * 3u, 7u, 9u}, b0 = threadIdx.x ^ 5u, b1 = 3u;
  float c[8][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
  }
  float s = 0;
  for (int k = 0; k < 8; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (s == 1.2345f) out[0] = s;
}

enum class Variant { kExact, kBf16, kSplit, kFp16 };
const char* Name(Variant v) {
  return v == Variant::kExact  ? "float64 (exact)"
         : v == Variant::kBf16 ? "TC BF16"
         : v == Variant::kFp16 ? "TC FP16"
                               : "TC split BF16";
}
kk::FsqTcOperands Ops(Variant v) {
  return v == Variant::kBf16   ? kk::FsqTcOperands::kBf16
         : v == Variant::kFp16 ? kk::FsqTcOperands::kFp16
                               : kk::FsqTcOperands::kBf16Split;
}

// One layer's encoder (synthetic scales: E ~ N(0, 4/C), e ~ N(0, 0.01)) on the host and
// device, prepared for both tensor-core variants; `layers` copies of the layer array.
struct Encoder {
  int G;
  std::vector<float> e, eb;
  float *d_e = nullptr, *d_eb = nullptr;
  void *prep_bf16 = nullptr, *prep_split = nullptr, *prep_fp16 = nullptr;  // [layers] each
  kk::FsqLayerCodec* d_layers = nullptr;
  Encoder(int g, int layers, uint32_t seed) : G(g) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    e.resize(static_cast<size_t>(G) * kC);
    eb.resize(G);
    for (auto& v : e) v = normal(rng) * 2.0f / std::sqrt(static_cast<float>(kC));
    for (auto& v : eb) v = 0.1f * normal(rng);
    d_e = Upload(e);
    d_eb = Upload(eb);
    kk::FsqLayerCodec lc{};
    lc.residual_width = kC;
    lc.latent_width = G;
    lc.encoder = d_e;
    lc.encoder_bias = d_eb;
    d_layers = Upload(std::vector<kk::FsqLayerCodec>(layers, lc));
    for (auto [ops, p] : {std::pair{kk::FsqTcOperands::kBf16, &prep_bf16},
                          std::pair{kk::FsqTcOperands::kBf16Split, &prep_split},
                          std::pair{kk::FsqTcOperands::kFp16, &prep_fp16}}) {
      const size_t bytes = kc::FsqEncoderTcBytes(kC, G, ops);
      CHECK(cudaMalloc(p, bytes * layers));
      for (int l = 0; l < layers; ++l) {
        CHECK(kc::LaunchFsqPrepareEncoderTc(d_e, kC, G, ops, static_cast<uint8_t*>(*p) + l * bytes,
                                            nullptr));
      }
    }
    CHECK(cudaDeviceSynchronize());
  }
};

// Device residuals and code pages of `tokens` x `layers` (token t in slot t).
struct Batch {
  int tokens, layers, G;
  __nv_bfloat16* x = nullptr;
  uint8_t* pool = nullptr;
  int64_t* slots = nullptr;
  kc::RowBlock rb;
  kc::PagedRows dst;
  Batch(int t, int l, int g, uint32_t seed) : tokens(t), layers(l), G(g) {
    const int64_t n = int64_t{layers} * tokens * kC;
    CHECK(cudaMalloc(&x, n * 2));
    FillResiduals<<<4096, 256>>>(x, n, seed);
    CHECK(cudaGetLastError());
    const int64_t cb = kk::FsqCodeBytes(G);
    const int pages = (tokens + kPs - 1) / kPs;
    CHECK(cudaMalloc(&pool, int64_t{layers} * pages * kPs * cb));
    std::vector<int64_t> s(tokens);
    for (int i = 0; i < tokens; ++i) s[i] = i;
    slots = Upload(s);
    rb.data = x;
    rb.bf16 = true;
    rb.layer_stride = int64_t{tokens} * kC;
    rb.token_stride = kC;
    dst.num_layers = layers;
    dst.num_tokens = tokens;
    dst.page_size = kPs;
    dst.base = pool;
    dst.layer_stride = int64_t{pages} * kPs * cb;
    dst.page_bytes = kPs * cb;
    dst.slots = slots;
  }
  ~Batch() {
    CHECK(cudaFree(x));
    CHECK(cudaFree(pool));
    CHECK(cudaFree(slots));
  }
  int64_t PoolBytes() const { return int64_t{layers} * dst.layer_stride; }
};

void Encode(const Encoder& enc, const Batch& b, Variant v, cudaStream_t stream) {
  if (v == Variant::kExact) {
    CHECK(kc::LaunchFsqEncodeRows(b.rb, b.dst, 0, enc.d_layers, kC, enc.G, stream));
  } else {
    const void* prep = v == Variant::kBf16   ? enc.prep_bf16
                       : v == Variant::kFp16 ? enc.prep_fp16
                                             : enc.prep_split;
    CHECK(kc::LaunchFsqEncodeRowsTc(b.rb, b.dst, 0, enc.d_layers, prep, kC, enc.G, Ops(v), stream));
  }
}

// The effect of the tensor-core codes on attention: the float64 oracle over `n` tokens of
// one layer (Qwen3-8B: 32 q / 8 KV heads, d 128, key norm, half RoPE 128, positions from
// 100000) with the exact codes and with the variant's codes: relative L2 difference of o
// over every head and max |dlse|.
void AttentionEffect(const Encoder& enc, const std::vector<uint8_t>& exact,
                     const std::vector<uint8_t>& tc, int n, const char* name) {
  const int G = enc.G;
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> wk(kHkv * kD * G), wv(kHkv * kD * G), bk(kHkv * kD), bv(kHkv * kD), kn(kD);
  for (auto& v : wk) v = normal(rng) / std::sqrt(static_cast<float>(G));
  for (auto& v : wv) v = normal(rng) / std::sqrt(static_cast<float>(G));
  for (auto& v : bk) v = 0.1f * normal(rng);
  for (auto& v : bv) v = 0.1f * normal(rng);
  for (auto& v : kn) v = 1.0f + 0.1f * normal(rng);
  kk::FsqLayerCodec c{};
  c.residual_width = kC;
  c.latent_width = G;
  c.num_kv_heads = kHkv;
  c.head_dim = kD;
  c.decoder_k = wk.data();
  c.decoder_v = wv.data();
  c.bias_k = bk.data();
  c.bias_v = bv.data();
  c.key_norm = kn.data();
  kk::RopeSpec rope;
  rope.theta = 1000000.0;
  rope.rotary_dims = kD;
  std::vector<float> q(kHq * kD);
  for (auto& v : q) v = 2.0f * normal(rng);
  const int pages = (n + kPs - 1) / kPs;
  std::vector<int32_t> ids(pages);
  for (int i = 0; i < pages; ++i) ids[i] = i;
  const int group = kHq / kHkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  double err = 0, norm = 0, dl = 0;
  std::vector<float> o1(group * kD), l1(group), o2(group * kD), l2(group);
  for (int h = 0; h < kHkv; ++h) {
    kk::FsqPageTable t;
    t.page_stride = kPs * kk::FsqCodeBytes(G);
    t.page_ids = ids.data();
    t.num_pages = pages;
    t.page_size = kPs;
    t.first_position = 100000;
    t.base = exact.data();
    kk::AttendFsqPagesReference(t, c, rope, h, q.data() + h * group * kD, group, scale, 0, n,
                                o1.data(), l1.data());
    t.base = tc.data();
    kk::AttendFsqPagesReference(t, c, rope, h, q.data() + h * group * kD, group, scale, 0, n,
                                o2.data(), l2.data());
    for (int i = 0; i < group * kD; ++i) {
      err += std::pow(double{o2[i]} - o1[i], 2);
      norm += std::pow(double{o1[i]}, 2);
    }
    for (int j = 0; j < group; ++j) dl = std::max(dl, std::fabs(double{l2[j]} - l1[j]));
  }
  std::printf(
      "  attention (float64 oracle, %d tokens, 32 q heads) with %s codes vs exact codes: "
      "relative L2 of o %.2e, max |dlse| %.1e\n",
      n, name, std::sqrt(err / norm), dl);
}

}  // namespace

ABSL_FLAG(bool, one, false, "one configuration only (profilers): VARIANT TOKENS LAYERS follow");
ABSL_FLAG(bool, tc_timings, false, "the tensor-core encoders' timings only");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_fsq_encode_bench",
      .summary = "FSQ encoders on the GPU: float64 against tensor cores",
      .files = {__FILE__},
      .synopsis = "[--tc-timings | --one exact|bf16|fp16|split TOKENS LAYERS]",
      .takes_args = true};
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(program, argc, argv);
  const bool one = absl::GetFlag(FLAGS_one);
  const bool tc_timings = absl::GetFlag(FLAGS_tc_timings);
  if (one ? cli.args.size() != 3 : !cli.args.empty()) {
    return kvcd::cli::UsageError(program, nullptr,
                                 one ? "--one takes VARIANT TOKENS LAYERS" : "unexpected argument");
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  if (one) {
    const std::string v = cli.args[0];
    const Variant var = v == "exact"   ? Variant::kExact
                        : v == "split" ? Variant::kSplit
                        : v == "fp16"  ? Variant::kFp16
                                       : Variant::kBf16;
    const int tokens = std::atoi(cli.args[1].c_str()), layers = std::atoi(cli.args[2].c_str());
    Encoder enc(256, layers, 1256);
    Batch b(tokens, layers, 256, 5);
    for (int i = 0; i < 3; ++i) Encode(enc, b, var, stream);
    CHECK(cudaStreamSynchronize(stream));
    std::printf("%s: %d tokens x %d layers encoded 3 times\n", Name(var), tokens, layers);
    return 0;
  }

  double mma_tflops = 1;
  {
    float* out = nullptr;
    CHECK(cudaMalloc(&out, 4));
    const int iters = 4096, blocks = prop.multiProcessorCount * 4, threads = 256;
    const double us = MedianUsPerCall(
        stream, 5, 1, 1, [&](int) { MmaLoopBf16<<<blocks, threads, 0, stream>>>(iters, out); });
    mma_tflops = 2.0 * 16 * 8 * 16 * 8 * double{iters} * blocks * (threads / 32) / us / 1e6;
    CHECK(cudaFree(out));
    std::printf(
        "mma.sync m16n8k16 BF16 ceiling %.0f TFLOP/s (register-only loop; datasheet dense "
        "990)\n",
        mma_tflops);
  }

  // Timings.
  std::printf(
      "\n| G | tokens x layers | variant | ms | TFLOP/s (2 C G per token, x2 split) | "
      "of the mma.sync ceiling |\n|---|---|---|---|---|---|\n");
  struct Case {
    int G, tokens, layers;
  };
  for (const Case k : {Case{256, 8192, 1}, Case{84, 8192, 1}, Case{256, 32768, 36}}) {
    Encoder enc(k.G, k.layers, 1000u + k.G);
    Batch b(k.tokens, k.layers, k.G, 7);
    for (Variant v : {Variant::kExact, Variant::kBf16, Variant::kFp16, Variant::kSplit}) {
      if (tc_timings && v == Variant::kExact) continue;
      const bool big = k.layers > 1;
      const double us = MedianUsPerCall(stream, v == Variant::kExact && big ? 2 : 7, 1, 1,
                                        [&](int) { Encode(enc, b, v, stream); });
      const double flop = 2.0 * k.tokens * k.layers * k.G * kC;
      const double tf = flop * (v == Variant::kSplit ? 2 : 1) / us / 1e6;
      std::printf("| %d | %d x %d | %s | %.3f | %.0f | %.0f%% |\n", k.G, k.tokens, k.layers,
                  Name(v), us / 1e3, tf, v == Variant::kExact ? 0.0 : 100.0 * tf / mma_tflops);
    }
  }

  if (tc_timings) return 0;
  // Codes against the float64 encoder's (8,192 tokens of 4 layers, G 256 and 84).
  std::printf("\ncodes against the float64 encoder (8192 tokens x 4 layers, BF16 residuals):\n");
  for (int G : {256, 84}) {
    Encoder enc(G, 4, 2000u + G);
    Batch b(8192, 4, G, 11);
    CHECK(cudaMemset(b.pool, 0, b.PoolBytes()));
    Encode(enc, b, Variant::kExact, stream);
    CHECK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> exact(b.PoolBytes()), got(b.PoolBytes());
    CHECK(cudaMemcpy(exact.data(), b.pool, exact.size(), cudaMemcpyDeviceToHost));
    for (Variant v : {Variant::kBf16, Variant::kFp16, Variant::kSplit}) {
      CHECK(cudaMemset(b.pool, 0, b.PoolBytes()));
      Encode(enc, b, v, stream);
      CHECK(cudaStreamSynchronize(stream));
      CHECK(cudaMemcpy(got.data(), b.pool, got.size(), cudaMemcpyDeviceToHost));
      int64_t differ = 0, far = 0, total = int64_t{8192} * 4 * G;
      std::vector<int64_t> hist(16);
      for (size_t i = 0; i < got.size(); ++i) {
        for (int s : {0, 4}) {
          const int a = (exact[i] >> s) & 15, c = (got[i] >> s) & 15;
          if (a != c) ++differ;
          if (std::abs(a - c) > 1) ++far;
          ++hist[a];
        }
      }
      std::printf("  G %3d %s: %lld of %lld codes differ (%.4f%%), %lld by more than one step\n", G,
                  Name(v), static_cast<long long>(differ), static_cast<long long>(total),
                  100.0 * differ / total, static_cast<long long>(far));
      if (v == Variant::kBf16) {
        std::printf("  code histogram (exact, z = -8..7):");
        for (int z = 0; z < 16; ++z) std::printf(" %lld", static_cast<long long>(hist[z]));
        std::printf("\n");
      }
      if (G == 256) AttentionEffect(enc, exact, got, 2048, Name(v));
    }
  }
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
