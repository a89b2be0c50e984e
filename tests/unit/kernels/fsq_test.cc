// Transformer-FSQ kernels (docs/fsq.md): the encoder against a straightforward re-derivation
// (ties, saturation, packing), unpack, expand against an explicit re-derivation of the
// decoder math, and the optimized attention (every ISA this CPU has) against the float64
// oracle on fresh random codes and weights.
#include "kvcd/kernels/fsq.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvcd/kernels/attention_state.h"

namespace kvcd::kernels {
namespace fsq_test {

std::vector<CpuIsa> AvailableIsas() {
  std::vector<CpuIsa> isas = {CpuIsa::kScalar};
  const CpuIsa best = DetectCpuIsa();
  if (best >= CpuIsa::kAvx2) isas.push_back(CpuIsa::kAvx2);
  if (best >= CpuIsa::kAvx512) isas.push_back(CpuIsa::kAvx512);
  return isas;
}

// The code of one latent coordinate, re-derived: nearbyint in the default rounding mode
// (to nearest, ties to even).
int ExpectedLatent(double u) {
  const double ut = kFsqH * std::tanh(u + std::atanh(kFsqDelta / kFsqH)) - kFsqDelta;
  return static_cast<int>(std::clamp(std::nearbyint(ut), -8.0, 7.0));
}

void ExpectedCode(const std::vector<int>& z, std::vector<uint8_t>& bytes) {
  bytes.assign((z.size() + 1) / 2, 0);
  for (size_t g = 0; g < z.size(); ++g)
    bytes[g / 2] |= static_cast<uint8_t>((z[g] + 8) << (g % 2 == 0 ? 0 : 4));
}

struct RandomEncoder {
  int C, G;
  std::vector<float> e, bias;
  FsqLayerCodec codec;
  RandomEncoder(int c, int g, float spread, std::mt19937& rng) : C(c), G(g) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    e.resize(static_cast<size_t>(G) * C);
    bias.resize(G);
    for (auto& x : e) x = normal(rng) * spread / std::sqrt(static_cast<float>(C));
    for (auto& x : bias) x = normal(rng) * 0.3f;
    codec.residual_width = C;
    codec.latent_width = G;
    codec.encoder = e.data();
    codec.encoder_bias = bias.data();
  }
};

TEST(FsqEncodeTest, MatchesTheDefinitionWithSaturation) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (CpuIsa isa : AvailableIsas()) {
    for (int G : {1, 7, 84, 91, 256}) {
      for (int C : {5, 37, 300}) {
        SCOPED_TRACE(testing::Message() << "isa " << CpuIsaName(isa) << " G " << G << " C " << C);
        // Spread 3: |u| often above 2, so both saturated levels (-8 and 7) appear.
        RandomEncoder enc(C, G, 3.0f, rng);
        const int tokens = 11;  // blocks of 4 tokens and a tail
        std::vector<float> x(static_cast<size_t>(tokens) * C);
        for (auto& v : x) v = normal(rng);
        const int64_t cb = FsqCodeBytes(G);
        std::vector<uint8_t> codes(tokens * cb, 0xAB);
        FsqEncodeRows(enc.codec, x.data(), tokens, codes.data(), isa);
        int lo = 0, hi = 0;
        for (int t = 0; t < tokens; ++t) {
          std::vector<int> z(G);
          for (int g = 0; g < G; ++g) {
            double u = 0;
            for (int c = 0; c < C; ++c)
              u += static_cast<double>(enc.e[g * C + c]) * static_cast<double>(x[t * C + c]);
            u += enc.bias[g];
            z[g] = ExpectedLatent(u);
            lo += z[g] == -8;
            hi += z[g] == 7;
          }
          std::vector<uint8_t> want;
          ExpectedCode(z, want);
          for (int b = 0; b < cb; ++b)
            ASSERT_EQ(codes[t * cb + b], want[b]) << "G=" << G << " C=" << C << " t=" << t;
          if (G % 2 == 1) {
            EXPECT_EQ(codes[t * cb + cb - 1] >> 4, 0);
          }
          // A token's code does not depend on the batch it is encoded in.
          std::vector<uint8_t> alone(cb, 0x5C);
          FsqEncodeRows(enc.codec, x.data() + t * C, 1, alone.data(), isa);
          for (int b = 0; b < cb; ++b) ASSERT_EQ(alone[b], codes[t * cb + b]);
        }
        if (G * tokens >= 84 * 11) {
          EXPECT_GT(lo, 0) << "no saturation at -8";
          EXPECT_GT(hi, 0) << "no saturation at 7";
        }
      }
    }
  }
}

// u values whose u~ = h tanh(u + atanh(delta/h)) - delta is exactly k + 0.5 in float64,
// written as a + b + c of three floats so that an encoder row (a, b, c) against x = (1,1,1)
// sums to u exactly.
TEST(FsqEncodeTest, ExactTiesRoundToEven) {
  const double shift = std::atanh(kFsqDelta / kFsqH);
  std::vector<float> rows;
  std::vector<int> want;
  for (int k = -8; k <= 6; ++k) {
    const double target = k + 0.5;
    const double w0 = std::atanh((target + kFsqDelta) / kFsqH);
    double wp = w0, wm = w0;
    bool found = false;
    for (int step = 0; step < 4000 && !found; ++step) {
      for (double w : {wp, wm}) {
        if (found || kFsqH * std::tanh(w) - kFsqDelta != target) continue;
        const double u = w - shift;
        if (kFsqH * std::tanh(u + shift) - kFsqDelta != target) continue;
        const float a = static_cast<float>(u);
        const float b = static_cast<float>(u - a);
        const float c = static_cast<float>(u - a - b);
        double sum = 0;
        sum += static_cast<double>(a);
        sum += static_cast<double>(b);
        sum += static_cast<double>(c);
        if (sum + 0.0 != u) continue;
        rows.insert(rows.end(), {a, b, c});
        want.push_back(k % 2 == 0 ? k : k + 1);  // the even neighbour of k + 0.5
        found = true;
      }
      wp = std::nextafter(wp, 10.0);
      wm = std::nextafter(wm, -10.0);
    }
  }
  const int G = static_cast<int>(want.size());
  ASSERT_GE(G, 8) << "too few exact ties constructed";
  std::vector<float> bias(G, 0.0f), x = {1.0f, 1.0f, 1.0f};
  FsqLayerCodec codec;
  codec.residual_width = 3;
  codec.latent_width = G;
  codec.encoder = rows.data();
  codec.encoder_bias = bias.data();
  for (CpuIsa isa : AvailableIsas()) {
    std::vector<uint8_t> codes(FsqCodeBytes(G));
    FsqEncodeRows(codec, x.data(), 1, codes.data(), isa);
    std::vector<int8_t> z(G);
    FsqUnpackCode(codes.data(), G, z.data());
    for (int g = 0; g < G; ++g) EXPECT_EQ(z[g], want[g]) << "tie " << g << " " << CpuIsaName(isa);
  }
}

// The thresholds a device encoder rounds with (FsqLatentThresholds): at each threshold
// and at the double just below it, and on random latents, -8 + #{k : u >= t_k} is the code
// FsqEncodeRows gives (rows (a, b, c) summing exactly to u against x = (1, 1, 1)).
TEST(FsqEncodeTest, LatentThresholdsReproduceTheEncoder) {
  double thr[kFsqThresholds];
  FsqLatentThresholds(thr);
  std::vector<double> us;
  for (int k = 0; k < kFsqThresholds; ++k) {
    if (k > 0) {
      EXPECT_LT(thr[k - 1], thr[k]);
    }
    us.push_back(thr[k]);
    us.push_back(std::nextafter(thr[k], -10.0));
  }
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 1.5);
  for (int i = 0; i < 200; ++i) us.push_back(normal(rng));
  std::vector<float> rows;
  std::vector<double> exact;
  for (double u : us) {
    const float a = static_cast<float>(u);
    const float b = static_cast<float>(u - a);
    const float c = static_cast<float>(u - a - b);
    if ((static_cast<double>(a) + b) + c != u) continue;
    rows.insert(rows.end(), {a, b, c});
    exact.push_back(u);
  }
  const int G = static_cast<int>(exact.size());
  ASSERT_GE(G, 2 * kFsqThresholds);
  std::vector<float> bias(G, 0.0f), x = {1.0f, 1.0f, 1.0f};
  FsqLayerCodec codec;
  codec.residual_width = 3;
  codec.latent_width = G;
  codec.encoder = rows.data();
  codec.encoder_bias = bias.data();
  std::vector<uint8_t> codes(FsqCodeBytes(G));
  FsqEncodeRows(codec, x.data(), 1, codes.data());
  std::vector<int8_t> z(G);
  FsqUnpackCode(codes.data(), G, z.data());
  for (int g = 0; g < G; ++g) {
    int want = -8;
    for (double t : thr) want += exact[g] >= t ? 1 : 0;
    EXPECT_EQ(z[g], want) << "u = " << exact[g];
  }
}

TEST(FsqEncodeTest, NonFiniteResidualGivesZero) {
  std::mt19937 rng(7);
  RandomEncoder enc(4, 3, 1.0f, rng);
  const float x[4] = {1.0f, std::numeric_limits<float>::quiet_NaN(), 0.5f, 2.0f};
  uint8_t codes[2];
  FsqEncodeRows(enc.codec, x, 1, codes);
  int8_t z[3];
  FsqUnpackCode(codes, 3, z);
  for (int g = 0; g < 3; ++g) EXPECT_EQ(z[g], 0);
}

TEST(FsqUnpackTest, RoundTripsOddWidths) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> level(-8, 7);
  for (int G : {1, 2, 7, 83, 84, 4095}) {
    std::vector<int> z(G);
    for (auto& v : z) v = level(rng);
    std::vector<uint8_t> bytes;
    ExpectedCode(z, bytes);
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), FsqCodeBytes(G));
    std::vector<int8_t> out(G, 100);
    FsqUnpackCode(bytes.data(), G, out.data());
    for (int g = 0; g < G; ++g) ASSERT_EQ(out[g], z[g]) << "G=" << G << " g=" << g;
  }
}

// A random decoder-side codec (W_k, W_v, biases, key norm) with fresh nonzero values.
struct RandomCodec {
  std::vector<float> wk, wv, bk, bv, knorm;
  FsqLayerCodec codec;
  RandomCodec(int hkv, int d, int G, bool key_norm, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uni(0.5f, 1.5f);
    const float ws = 1.0f / std::sqrt(static_cast<float>(G));
    wk.resize(static_cast<size_t>(hkv) * d * G);
    wv.resize(wk.size());
    bk.resize(static_cast<size_t>(hkv) * d);
    bv.resize(bk.size());
    for (auto& x : wk) x = normal(rng) * ws;
    for (auto& x : wv) x = normal(rng) * ws;
    for (auto& x : bk) x = normal(rng) * 0.5f;
    for (auto& x : bv) x = normal(rng) * 0.5f;
    codec.residual_width = 16;
    codec.latent_width = G;
    codec.num_kv_heads = hkv;
    codec.head_dim = d;
    codec.decoder_k = wk.data();
    codec.decoder_v = wv.data();
    codec.bias_k = bk.data();
    codec.bias_v = bv.data();
    if (key_norm) {
      knorm.resize(d);
      for (auto& x : knorm) x = uni(rng);
      codec.key_norm = knorm.data();
      codec.key_norm_eps = 1e-6f;
    }
  }
};

TEST(FsqExpandTest, MatchesAnExplicitDecoder) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (RopePairing pairing : {RopePairing::kHalf, RopePairing::kInterleaved}) {
    for (bool key_norm : {false, true}) {
      for (int d : {16, 64}) {
        for (int r : {d, d / 2 + (d / 2) % 2, 0}) {
          const int hkv = 3, G = 7 + d;
          RandomCodec rc(hkv, d, G, key_norm, rng);
          const RopeSpec rope{1e6, r, 4.0, pairing};
          std::vector<uint8_t> code(FsqCodeBytes(G));
          for (auto& b : code) b = static_cast<uint8_t>(rng());
          const int64_t pos = 123457;
          std::vector<float> k(hkv * d, NAN), v(hkv * d, NAN);
          FsqExpandToken(rc.codec, rope, code.data(), pos, k.data(), v.data());
          std::vector<double> z(G);
          for (int g = 0; g < G; ++g) z[g] = ((code[g / 2] >> (4 * (g % 2))) & 15) - 8;
          for (int h = 0; h < hkv; ++h) {
            std::vector<double> y(d), vv(d);
            for (int i = 0; i < d; ++i) {
              y[i] = rc.bk[h * d + i];
              vv[i] = rc.bv[h * d + i];
              for (int g = 0; g < G; ++g) {
                y[i] += rc.wk[(h * d + i) * G + g] * z[g];
                vv[i] += rc.wv[(h * d + i) * G + g] * z[g];
              }
            }
            if (key_norm) {
              double ms = 0;
              for (double a : y) ms += a * a / d;
              for (int i = 0; i < d; ++i) y[i] = y[i] / std::sqrt(ms + 1e-6) * rc.knorm[i];
            }
            // Rotation as a 2x2 matrix on each pair.
            std::vector<double> rot = y;
            for (int i = 0; i < r / 2; ++i) {
              const int a = pairing == RopePairing::kHalf ? i : 2 * i;
              const int b = pairing == RopePairing::kHalf ? i + r / 2 : 2 * i + 1;
              const double ang = (pos / 4.0) * std::pow(1e6, -2.0 * i / r);
              rot[a] = y[a] * std::cos(ang) - y[b] * std::sin(ang);
              rot[b] = y[a] * std::sin(ang) + y[b] * std::cos(ang);
            }
            for (int i = 0; i < d; ++i) {
              EXPECT_NEAR(k[h * d + i], rot[i], 1e-5 * (1 + std::fabs(rot[i])))
                  << "h=" << h << " i=" << i << " r=" << r;
              EXPECT_NEAR(v[h * d + i], vv[i], 1e-5 * (1 + std::fabs(vv[i])));
            }
          }
        }
      }
    }
  }
}

struct AttendCase {
  int d, G, group, page_size;
  int64_t n;
  RopePairing pairing;
  int rotary;
  bool key_norm;
  double scaling;
  int64_t first_position;
};

void CheckAttend(const AttendCase& cs, CpuIsa isa, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int hkv = 2, d = cs.d, G = cs.G, ps = cs.page_size;
  RandomCodec rc(hkv, d, G, cs.key_norm, rng);
  const RopeSpec rope{10000.0, cs.rotary, cs.scaling, cs.pairing};
  const int64_t cb = FsqCodeBytes(G);
  const int64_t num_pages = (cs.n + ps - 1) / ps, pool_pages = num_pages + 3;
  const int64_t stride = ps * cb + 5;  // pages need not be packed back to back
  std::vector<uint8_t> pool(pool_pages * stride);
  for (auto& b : pool) b = static_cast<uint8_t>(rng());  // fresh random codes
  std::vector<int32_t> ids(pool_pages);
  for (int i = 0; i < pool_pages; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(num_pages);
  FsqPageTable table;
  table.base = pool.data();
  table.page_stride = stride;
  table.page_ids = ids.data();
  table.num_pages = static_cast<int32_t>(num_pages);
  table.page_size = ps;
  table.first_position = cs.first_position;
  std::vector<float> q(cs.group * d);
  for (auto& x : q) x = normal(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // FP32 key rebuild, RoPE recurrence and softmax against the float64 oracle on the same
  // codes: the relative L2 error of o and of lse measured up to ~2.5e-6 over many seeds; the
  // bound leaves a 10x margin.
  constexpr double kTol = 3e-5;
  const int64_t n = cs.n;
  const std::pair<int64_t, int64_t> ranges[] = {{0, n}, {n / 3, n - n / 5}, {n / 2, n / 2}};
  for (int h = 0; h < hkv; ++h) {
    for (auto [begin, end] : ranges) {
      std::vector<float> ro(cs.group * d, NAN), rl(cs.group, NAN);
      std::vector<float> o(cs.group * d, NAN), l(cs.group, NAN);
      AttendFsqPagesReference(table, rc.codec, rope, h, q.data(), cs.group, scale, begin, end,
                              ro.data(), rl.data());
      AttendFsqPages(table, rc.codec, rope, h, q.data(), cs.group, scale, begin, end, o.data(),
                     l.data(), isa);
      for (int i = 0; i < cs.group; ++i) {
        double err = 0, norm = 0;
        for (int c = 0; c < d; ++c) {
          ASSERT_TRUE(std::isfinite(o[i * d + c]));
          err += (o[i * d + c] - ro[i * d + c]) * (o[i * d + c] - ro[i * d + c]);
          norm += ro[i * d + c] * ro[i * d + c];
        }
        const auto where = testing::Message()
                           << "isa=" << CpuIsaName(isa) << " d=" << d << " G=" << G
                           << " group=" << cs.group << " ps=" << ps << " n=" << n << " range=["
                           << begin << "," << end << ") rotary=" << cs.rotary
                           << " pairing=" << static_cast<int>(cs.pairing)
                           << " key_norm=" << cs.key_norm << " head=" << h << " q=" << i;
        if (begin < end) {
          EXPECT_GT(norm, 0.0) << where;
          EXPECT_LE(std::sqrt(err), kTol * std::sqrt(norm)) << where;
          EXPECT_NEAR(l[i], rl[i], kTol * (1 + std::fabs(rl[i]))) << where;
        } else {
          EXPECT_EQ(err, 0.0) << where;
          EXPECT_EQ(norm, 0.0) << where;
          EXPECT_EQ(l[i], kEmptyLse) << where;
          EXPECT_EQ(rl[i], kEmptyLse) << where;
        }
      }
    }
  }
}

TEST(FsqAttentionTest, MatchesTheOracleAcrossPageSizes) {
  uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (CpuIsa isa : AvailableIsas()) {
    for (int ps : {1, 3, 16, 64}) {
      for (int64_t n : {1, 5, 130, 333}) {
        CheckAttend({128, 84, 4, ps, n, RopePairing::kHalf, 128, true, 1.0, 17}, isa, seed++);
      }
    }
  }
}

TEST(FsqAttentionTest, MatchesTheOracleAcrossGeometries) {
  uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int groups[] = {1, 3, 4};
  const int latents[] = {7, 84, 256, 33};
  int combo = 0;
  for (CpuIsa isa : AvailableIsas()) {
    for (int d : {64, 128, 256, 24}) {
      for (RopePairing pairing : {RopePairing::kHalf, RopePairing::kInterleaved}) {
        for (bool key_norm : {false, true}) {
          for (int rotary : {d, d / 2 + (d / 2) % 2}) {
            const int group = groups[combo % 3];
            const int G = latents[combo % 4];
            const double scaling = combo % 2 == 0 ? 1.0 : 4.0;
            const int64_t first = combo % 3 == 0 ? 0 : 40000 + combo;
            ++combo;
            CheckAttend({d, G, group, 16, 150, pairing, rotary, key_norm, scaling, first}, isa,
                        seed++);
          }
        }
      }
    }
  }
}

TEST(FsqAttentionTest, EmptyRangeGivesTheEmptyState) {
  std::mt19937 rng(3);
  RandomCodec rc(1, 64, 84, true, rng);
  const RopeSpec rope{10000.0, 64, 1.0, RopePairing::kHalf};
  std::vector<uint8_t> pool(FsqPageBytes(16, 84), 0x77);
  const int32_t id = 0;
  FsqPageTable table{pool.data(), FsqPageBytes(16, 84), &id, 1, 16, 0};
  std::vector<float> q(3 * 64, 0.5f);
  for (CpuIsa isa : AvailableIsas()) {
    std::vector<float> o(3 * 64, NAN), l(3, NAN);
    AttendFsqPages(table, rc.codec, rope, 0, q.data(), 3, 0.125f, 5, 5, o.data(), l.data(), isa);
    for (float x : o) EXPECT_EQ(x, 0.0f);
    for (float x : l) EXPECT_EQ(x, kEmptyLse);
  }
  std::vector<float> o(3 * 64, NAN), l(3, NAN);
  AttendFsqPagesReference(table, rc.codec, rope, 0, q.data(), 3, 0.125f, 5, 5, o.data(), l.data());
  for (float x : o) EXPECT_EQ(x, 0.0f);
  for (float x : l) EXPECT_EQ(x, kEmptyLse);
}

}  // namespace fsq_test
}  // namespace kvcd::kernels
