// The CUDA FSQ kernels (cuda_fsq.h) against the CPU definitions, on the device (skipped
// without a GPU): the encoder bit for bit (ties at every rounding threshold, odd widths,
// BF16 and F32 residuals, page slots with an offset, the non-finite check), and the decode
// attention against the float64 oracle on fresh random codes (every head_dim, odd G and
// lengths, both RoPE pairings, key norm on and off, poisoned outputs, merged with a BF16
// window part).
#include "kvcd/kernels/cuda_fsq.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "cuda_test_fixture.h"
#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cuda_device.h"
#include "kvcd/kernels/fsq.h"

namespace kvcd::kernels {
namespace cuda_fsq_test {

class CudaFsqTest : public CudaTestFixture {};

// Three floats whose in-order float64 sum is exactly u (u's 53 bits in 3 x 24).
void SplitDouble(double u, float f[3]) {
  f[0] = static_cast<float>(u);
  const double r = u - f[0];
  f[1] = static_cast<float>(r);
  f[2] = static_cast<float>(r - f[1]);
}

TEST_F(CudaFsqTest, EncodeIsBitIdenticalToTheCpu) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double thr[kFsqThresholds];
  FsqLatentThresholds(thr);
  for (const int C : {37, 300}) {
    for (const int G : {1, 84, 85, 256}) {
      for (const bool bf16 : {false, true}) {
        const int layers = 2, tokens = 37, ps = 16, pages = 4;
        const int64_t cb = FsqCodeBytes(G), offset = 24;
        const int64_t page_bytes = offset + ps * cb + 8;
        // Layer 0: random weights and residuals. Layer 1: latent g sums exactly to a
        // rounding threshold (even tokens) or the double just below it (odd tokens).
        std::vector<float> e(layers * G * C), eb(layers * G), x(layers * tokens * C);
        for (int i = 0; i < G * C; ++i) e[i] = normal(rng_) / std::sqrt(static_cast<float>(C));
        for (int i = 0; i < G; ++i) eb[i] = 0.3f * normal(rng_);
        for (int i = 0; i < tokens * C; ++i) x[i] = normal(rng_);
        for (int g = 0; g < G; ++g) {
          const double t = thr[g % kFsqThresholds];
          float f[3], fb[3];
          SplitDouble(t, f);
          SplitDouble(std::nextafter(t, -1.0e9), fb);
          ASSERT_EQ((static_cast<double>(f[0]) + f[1]) + f[2], t);
          for (int k = 0; k < 3; ++k) {
            e[(G + g) * C + k] = f[k];
            e[(G + g) * C + 3 + k] = fb[k];
          }
        }
        for (int t = 0; t < tokens; ++t) {
          for (int k = 0; k < 3; ++k) x[(tokens + t) * C + (t % 2) * 3 + k] = 1.0f;
        }
        if (bf16) {  // residuals as BF16 (layer 1 is exact in BF16 already)
          for (auto& v : x) v = Bf16ToFloat(FloatToBf16(v));
        }
        // Scattered slots.
        std::vector<int64_t> slots(pages * ps);
        for (int i = 0; i < pages * ps; ++i) slots[i] = i;
        std::shuffle(slots.begin(), slots.end(), rng_);
        slots.resize(tokens);
        // CPU.
        std::vector<uint8_t> want(layers * pages * page_bytes, 0xAB), code(cb);
        for (int l = 0; l < layers; ++l) {
          FsqLayerCodec c{};
          c.residual_width = C;
          c.latent_width = G;
          c.encoder = e.data() + l * G * C;
          c.encoder_bias = l == 0 ? eb.data() : eb.data() + G;  // layer 1: bias 0
          for (int t = 0; t < tokens; ++t) {
            FsqEncodeRows(c, x.data() + (l * tokens + t) * C, 1, code.data());
            std::copy(code.begin(), code.end(),
                      want.begin() + l * pages * page_bytes + (slots[t] / ps) * page_bytes +
                          offset + (slots[t] % ps) * cb);
          }
        }
        // GPU.
        float* d_e = Up(e);
        std::vector<float> eb_dev = eb;
        std::fill(eb_dev.begin() + G, eb_dev.end(), 0.0f);
        float* d_eb = Up(eb_dev);
        std::vector<FsqLayerCodec> codecs(layers);
        for (int l = 0; l < layers; ++l) {
          codecs[l].residual_width = C;
          codecs[l].latent_width = G;
          codecs[l].encoder = d_e + l * G * C;
          codecs[l].encoder_bias = d_eb + l * G;
        }
        cuda::RowBlock rb;
        std::vector<uint16_t> xb(x.size());
        for (size_t i = 0; i < x.size(); ++i) xb[i] = FloatToBf16(x[i]);
        rb.data = bf16 ? static_cast<const void*>(Up(xb)) : static_cast<const void*>(Up(x));
        rb.bf16 = bf16;
        rb.layer_stride = int64_t{tokens} * C;
        rb.token_stride = C;
        cuda::PagedRows dst;
        dst.num_layers = layers;
        dst.num_tokens = tokens;
        dst.page_size = ps;
        dst.base = Up(std::vector<uint8_t>(want.size(), 0xAB));
        dst.layer_stride = pages * page_bytes;
        dst.page_bytes = page_bytes;
        dst.slots = Up(slots);
        ASSERT_EQ(
            cuda::LaunchFsqEncodeRows(rb, dst, offset, Up(codecs), C, G, nullptr).device_code(),
            cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<uint8_t> got = Down(dst.base, want.size());
        int64_t diff = 0;
        for (size_t i = 0; i < got.size(); ++i) diff += got[i] != want[i];
        EXPECT_EQ(diff, 0) << "C=" << C << " G=" << G << " bf16=" << bf16;
        // The tie layer really sits on the thresholds: its codes take every level.
        std::vector<int> seen(16);
        for (int t = 0; t < tokens; ++t) {
          const uint8_t* cp = want.data() + pages * page_bytes + (slots[t] / ps) * page_bytes +
                              offset + (slots[t] % ps) * cb;
          std::vector<int8_t> z(G);
          FsqUnpackCode(cp, G, z.data());
          for (int8_t v : z) seen[v + 8] = 1;
        }
        if (G >= 15) {
          EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 16);
        }
      }
    }
  }
}

TEST_F(CudaFsqTest, EncodeCheckZeroesAndReportsNonFiniteRows) {
  const int C = 40, G = 9, tokens = 5, ps = 16;
  const int64_t cb = FsqCodeBytes(G);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> e(G * C), eb(G), x(tokens * C);
  for (auto& v : e) v = normal(rng_);
  for (auto& v : x) v = normal(rng_);
  x[2 * C + 7] = std::numeric_limits<float>::quiet_NaN();
  x[2 * C + 9] = std::numeric_limits<float>::infinity();
  x[4 * C + 0] = -std::numeric_limits<float>::infinity();
  FsqLayerCodec codec{};
  codec.residual_width = C;
  codec.latent_width = G;
  codec.encoder = Up(e);
  codec.encoder_bias = Up(eb);
  cuda::RowBlock rb;
  rb.data = Up(x);
  rb.bf16 = false;
  rb.layer_stride = int64_t{tokens} * C;
  rb.token_stride = C;
  cuda::PagedRows dst;
  dst.num_layers = 1;
  dst.num_tokens = tokens;
  dst.page_size = ps;
  dst.base = Up(std::vector<uint8_t>(ps * cb, 0xAB));
  dst.layer_stride = ps * cb;
  dst.page_bytes = ps * cb;
  for (int t = 0; t < tokens; ++t) dst.inline_slots[t] = t;
  auto* counters = Up(std::vector<unsigned long long>{0, ~0ull});
  cuda::StoreCheck check;
  check.count = counters;
  check.first_row = counters + 1;
  ASSERT_EQ(cuda::LaunchFsqEncodeRows(rb, dst, 0, Up(std::vector<FsqLayerCodec>{codec}), C, G,
                                      nullptr, &check)
                .device_code(),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = Down(dst.base, ps * cb);
  const auto cnt = Down(counters, 2);
  EXPECT_EQ(cnt[0], 3u);
  EXPECT_EQ(cnt[1], 2u);
  FsqLayerCodec host = codec;
  host.encoder = e.data();
  host.encoder_bias = eb.data();
  std::vector<uint8_t> code(cb);
  for (int t = 0; t < tokens; ++t) {
    if (t == 2 || t == 4) {
      for (int i = 0; i < cb; ++i) {
        EXPECT_EQ(got[t * cb + i], i == cb - 1 ? 0x08 : 0x88) << "t=" << t;  // z = 0, odd G
      }
    } else {
      FsqEncodeRows(host, x.data() + t * C, 1, code.data());
      EXPECT_TRUE(std::equal(code.begin(), code.end(), got.begin() + t * cb)) << "t=" << t;
    }
  }
}

struct AttnCase {
  int d, G, hq, hkv, ps;
  bool key_norm;
  RopePairing pairing;
  int rotary;
  std::vector<int> lengths;
  std::vector<int> window;  // BF16 window tokens per sequence (merged as a second part)
};

TEST_F(CudaFsqTest, DecodeAttentionMatchesTheOracle) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::vector<AttnCase> cases = {
      {128, 256, 32, 8, 16, true, RopePairing::kHalf, 128, {1000, 37, 0}, {5, 0, 19}},
      {128, 84, 8, 2, 32, false, RopePairing::kInterleaved, 38, {300, 1, 513}, {0, 3, 0}},
      {64, 37, 8, 1, 32, true, RopePairing::kInterleaved, 64, {77, 200}, {0, 0}},
      {64, 200, 8, 2, 64, true, RopePairing::kHalf, 64, {45, 1100}, {2, 0}},
      {64, 128, 4, 4, 48, false, RopePairing::kHalf, 32, {17, 96}, {1, 0}},
      {256, 85, 6, 2, 16, true, RopePairing::kHalf, 128, {129, 0}, {0, 7}},
      {256, 256, 16, 2, 32, false, RopePairing::kHalf, 0, {64, 333}, {0, 0}},
      {128, 256, 4, 1, 16, false, RopePairing::kHalf, 128, {2000}, {0}},
  };
  // KVCD_FSQ_TEST_SMALL=1 (the compute-sanitizer runs): the first two cases, short contexts.
  const bool small = std::getenv("KVCD_FSQ_TEST_SMALL") != nullptr;
  double worst = 0;
  for (AttnCase cs : small ? std::vector<AttnCase>(cases.begin(), cases.begin() + 2) : cases) {
    if (small) {
      for (int& n : cs.lengths) n = std::min(n, 70);
    }
    const int d = cs.d, G = cs.G, hq = cs.hq, hkv = cs.hkv, ps = cs.ps, group = hq / hkv;
    const int batch = static_cast<int>(cs.lengths.size());
    const int max_len = *std::max_element(cs.lengths.begin(), cs.lengths.end());
    const int max_pages = std::max(1, (max_len + ps - 1) / ps);
    const int64_t cb = FsqCodeBytes(G), page_bytes = ps * cb;
    // Codes: random bytes (odd G: the unused high nibble 0), shuffled pages.
    std::vector<uint8_t> pool(batch * max_pages * page_bytes);
    for (size_t i = 0; i < pool.size(); ++i) {
      pool[i] = static_cast<uint8_t>(rng_());
      if (G % 2 == 1 && i % cb == static_cast<size_t>(cb - 1)) pool[i] &= 0x0F;
    }
    std::vector<int32_t> ids(batch * max_pages);
    for (int i = 0; i < batch * max_pages; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng_);
    std::vector<float> wk(hkv * d * G), wv(hkv * d * G), bk(hkv * d), bv(hkv * d), kn(d);
    for (auto& v : wk) v = normal(rng_) / std::sqrt(static_cast<float>(G));
    for (auto& v : wv) v = normal(rng_) / std::sqrt(static_cast<float>(G));
    for (auto& v : bk) v = 0.2f * normal(rng_);
    for (auto& v : bv) v = 0.2f * normal(rng_);
    for (auto& v : kn) v = 1.0f + 0.3f * normal(rng_);
    std::vector<float> q(batch * hq * d);
    for (auto& v : q) v = normal(rng_);
    std::vector<int64_t> positions(batch);
    for (int b = 0; b < batch; ++b) positions[b] = b == 0 ? 100000 + rng_() % 1000 : rng_() % 64;
    RopeSpec rope;
    rope.theta = 1000000.0;
    rope.rotary_dims = cs.rotary;
    rope.scaling = cs.rotary == 38 ? 2.0 : 1.0;
    rope.pairing = cs.pairing;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    // BF16 windows (layout of bf16_attention.h), one page per sequence.
    const int wps = 32;
    const int64_t welems = Bf16PageElems(hkv, wps, d);
    std::vector<uint16_t> wpool(batch * welems);
    for (auto& v : wpool) v = FloatToBf16(normal(rng_));
    std::vector<int32_t> wids(batch);
    for (int b = 0; b < batch; ++b) wids[b] = b;

    // GPU.
    FsqLayerCodec dc{};
    dc.num_kv_heads = hkv;
    dc.head_dim = d;
    dc.latent_width = G;
    dc.decoder_k = Up(wk);
    dc.decoder_v = Up(wv);
    dc.bias_k = Up(bk);
    dc.bias_v = Up(bv);
    dc.key_norm = cs.key_norm ? Up(kn) : nullptr;
    dc.key_norm_eps = 1e-6f;
    void* prepared = nullptr;
    ASSERT_EQ(cudaMalloc(&prepared, cuda::FsqDecoderBytes(hkv, d, G)), cudaSuccess);
    owned_.push_back(prepared);
    ASSERT_EQ(cuda::LaunchFsqPrepareDecoder(dc, prepared, nullptr).device_code(), cudaSuccess);
    const int rows = batch * hq;
    const cuda::DecodeGeometry geo{batch, hq, hkv, d, ps};
    for (const int splits : {1, cuda::FsqDecodeSplits(batch, hkv, max_len, 132), 7}) {
      void* ws = nullptr;
      ASSERT_EQ(cudaMalloc(&ws, cuda::FsqDecodeWorkspaceBytes(batch, hq, G, splits)), cudaSuccess);
      owned_.push_back(ws);
      ASSERT_EQ(cudaMemset(ws, 0xFF, cuda::FsqDecodeWorkspaceBytes(batch, hq, G, splits)),
                cudaSuccess);  // NaN
      float* part_o = Up(std::vector<float>(2 * rows * d, NAN));
      float* part_lse = Up(std::vector<float>(2 * rows, NAN));
      float* o = Up(std::vector<float>(rows * d, NAN));
      float* lse = Up(std::vector<float>(rows, NAN));
      const float* d_q = Up(q);
      const cuda::DecodeGeometry wgeo{batch, hq, hkv, d, wps};
      const cuda::PagedList wlist{reinterpret_cast<const uint8_t*>(Up(wpool)), welems * 2, Up(wids),
                                  1, Up(std::vector<int32_t>(cs.window.begin(), cs.window.end()))};
      ASSERT_EQ(cuda::LaunchBf16DecodeParts(wlist, wgeo, d_q, nullptr, scale, 1, wps, part_o,
                                            part_lse, 0, nullptr)
                    .device_code(),
                cudaSuccess);
      cuda::FsqDecodeArgs args;
      args.codec = dc;
      args.prepared = prepared;
      args.rope = rope;
      args.positions = Up(positions);
      args.q = d_q;
      args.softmax_scale = scale;
      args.splits = splits;
      args.workspace = ws;
      const cuda::PagedList list{Up(pool), page_bytes, Up(ids), max_pages,
                                 Up(std::vector<int32_t>(cs.lengths.begin(), cs.lengths.end()))};
      const cuda::MergeTarget merge{2, nullptr, o, lse};
      ASSERT_EQ(
          cuda::LaunchFsqDecodeParts(list, geo, args, max_len, part_o, part_lse, 1, nullptr, &merge)
              .device_code(),
          cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto got_po = Down(part_o + rows * d, rows * d);
      const auto got_pl = Down(part_lse + rows, rows);
      const auto got_o = Down(o, rows * d);
      const auto got_l = Down(lse, rows);

      // CPU: the float64 oracle for the fsq part, the CPU BF16 kernel for the window.
      FsqLayerCodec hc = dc;
      hc.decoder_k = wk.data();
      hc.decoder_v = wv.data();
      hc.bias_k = bk.data();
      hc.bias_v = bv.data();
      hc.key_norm = cs.key_norm ? kn.data() : nullptr;
      for (int b = 0; b < batch; ++b) {
        FsqPageTable t;
        t.base = pool.data();
        t.page_stride = page_bytes;
        t.page_ids = ids.data() + b * max_pages;
        t.num_pages = max_pages;
        t.page_size = ps;
        t.first_position = positions[b];
        Bf16PageTable bt{wpool.data(), welems, wids.data() + b, 1, wps, hkv, d};
        for (int h = 0; h < hkv; ++h) {
          std::vector<float> po(group * d), pl(group), wo(group * d), wl(group);
          const float* qh = q.data() + (b * hq + h * group) * d;
          AttendFsqPagesReference(t, hc, rope, h, qh, group, scale, 0, cs.lengths[b], po.data(),
                                  pl.data());
          AttendBf16Pages(bt, h, qh, group, scale, 0, cs.window[b], wo.data(), wl.data());
          std::vector<float> mo = po, ml = pl;
          MergeStates(group, d, mo.data(), ml.data(), wo.data(), wl.data());
          for (int j = 0; j < group; ++j) {
            const int row = b * hq + h * group + j;
            double err = 0, norm = 0, merr = 0, mnorm = 0;
            for (int c = 0; c < d; ++c) {
              ASSERT_FALSE(std::isnan(got_po[row * d + c])) << "row " << row;
              ASSERT_FALSE(std::isnan(got_o[row * d + c])) << "row " << row;
              err += std::pow(got_po[row * d + c] - po[j * d + c], 2);
              norm += std::pow(po[j * d + c], 2);
              merr += std::pow(got_o[row * d + c] - mo[j * d + c], 2);
              mnorm += std::pow(mo[j * d + c], 2);
            }
            if (cs.lengths[b] == 0) {
              EXPECT_EQ(got_pl[row], -INFINITY);
              EXPECT_EQ(norm, 0.0);
              EXPECT_EQ(err, 0.0);
            } else {
              const double rel = std::sqrt(err / norm);
              worst = std::max(worst, rel);
              EXPECT_LE(rel, 4e-3) << "d=" << d << " G=" << G << " b=" << b << " row=" << row
                                   << " splits=" << splits;
              EXPECT_NEAR(got_pl[row], pl[j], 2e-3 * (1 + std::fabs(pl[j]))) << "row " << row;
            }
            if (cs.lengths[b] + cs.window[b] > 0) {
              EXPECT_LE(std::sqrt(merr), 4e-3 * std::sqrt(mnorm) + 1e-6) << "merged row " << row;
              EXPECT_NEAR(got_l[row], ml[j], 2e-3 * (1 + std::fabs(ml[j]))) << "row " << row;
            } else {
              EXPECT_EQ(got_l[row], -INFINITY);
            }
          }
        }
      }
    }
  }
  std::printf("fsq decode attention: worst relative error of o against the float64 oracle %.3g\n",
              worst);
}

TEST_F(CudaFsqTest, DecodeAttentionRejectsUnsupportedArguments) {
  cuda::FsqDecodeArgs args;
  args.codec.num_kv_heads = 1;
  args.codec.head_dim = 128;
  args.codec.latent_width = 84;
  int dummy_i = 0;
  args.codec.decoder_v = args.codec.bias_v = reinterpret_cast<const float*>(&dummy_i);
  const cuda::DecodeGeometry geo{1, 4, 1, 128, 16};
  float f = 0;
  const cuda::PagedList list{};
  // No prepared decoder, pages or positions; G > kFsqCudaMaxLatent; head_dim 96.
  EXPECT_EQ(cuda::LaunchFsqDecodeParts(list, geo, args, 16, &f, &f, 0, nullptr).device_code(),
            cudaErrorInvalidValue);
  args.codec.latent_width = 300;
  EXPECT_EQ(cuda::LaunchFsqDecodeParts(list, geo, args, 16, &f, &f, 0, nullptr).device_code(),
            cudaErrorInvalidValue);
  const cuda::DecodeGeometry geo96{1, 4, 1, 96, 16};
  EXPECT_EQ(cuda::LaunchFsqDecodeParts(list, geo96, args, 16, &f, &f, 0, nullptr).device_code(),
            cudaErrorInvalidValue);
}

}  // namespace cuda_fsq_test
}  // namespace kvcd::kernels
