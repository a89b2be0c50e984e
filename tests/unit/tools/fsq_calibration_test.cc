#include "tools/fsq_calibration.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "tools/eval.h"

namespace kvcd {
namespace fsq_calibration_test {

constexpr int kC = 16, kRank = 8, kHkv = 2, kD = 8, kKv = kHkv * kD, kTrain = 128;
constexpr double kSigma[kRank] = {4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5};

// Residuals that lie exactly in a kRank-dim subspace with known scales: x_t = mu + Σ_j
// s_j(t) b_j with b_j orthonormal and s_j(t) = sigma_j · H[t][j+1] (Sylvester Hadamard
// columns: ±1, zero mean, mutually orthogonal), so the sample covariance is exactly
// Σ_j sigma_j² b_j b_jᵀ. Every coordinate of E x + e is ±1/3, whose FSQ code is ±2.
// Tokens [kTrain, 2·kTrain) repeat the first kTrain (held out with holdout 0.5).
struct Synthetic {
  std::vector<std::vector<double>> b;  // [kRank][kC]
  std::vector<double> mu;
  std::vector<std::vector<double>> s;  // [2·kTrain][kRank]
  ActivationDump dump;
  std::vector<KvProjection> proj;
};

// Interleaved RoPE (pairs 2i, 2i+1, frequency 10000^(-2i/d)) of every head, as the
// llama2.c model applies it: the test's own ground truth for the post-RoPE keys.
void RopeInterleaved(double* k, int heads, int d, int64_t pos) {
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < d / 2; ++i) {
      const double a = pos * std::pow(10000.0, -2.0 * i / d), c = std::cos(a), s = std::sin(a);
      double* y = k + h * d + 2 * i;
      const double y0 = y[0], y1 = y[1];
      y[0] = y0 * c - y1 * s;
      y[1] = y0 * s + y1 * c;
    }
}

int Hadamard(int t, int j) { return __builtin_popcount(static_cast<unsigned>(t & j)) % 2 ? -1 : 1; }

Synthetic MakeSynthetic() {
  Synthetic syn;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  while (static_cast<int>(syn.b.size()) < kRank) {  // Gram-Schmidt on random vectors
    std::vector<double> v(kC);
    for (double& x : v) x = normal(rng);
    for (const auto& p : syn.b) {
      double dot = 0;
      for (int i = 0; i < kC; ++i) dot += v[i] * p[i];
      for (int i = 0; i < kC; ++i) v[i] -= dot * p[i];
    }
    double norm = 0;
    for (double x : v) norm += x * x;
    for (double& x : v) x /= std::sqrt(norm);
    syn.b.push_back(v);
  }
  for (int i = 0; i < kC; ++i) syn.mu.push_back(0.25 * i - 1.5);
  const int n = 2 * kTrain;
  syn.dump.num_layers = 1;
  syn.dump.num_q_heads = kHkv;
  syn.dump.num_kv_heads = kHkv;
  syn.dump.head_dim = kD;
  syn.dump.tokens = n;
  syn.dump.residual_width = kC;
  syn.dump.layers.resize(1);
  syn.dump.x.resize(1);
  for (int t = 0; t < n; ++t) {
    std::vector<double> st(kRank);
    for (int j = 0; j < kRank; ++j) st[j] = kSigma[j] * Hadamard(t % kTrain, j + 1);
    std::vector<double> x = syn.mu;
    for (int j = 0; j < kRank; ++j)
      for (int i = 0; i < kC; ++i) x[i] += st[j] * syn.b[j][i];
    for (double v : x) syn.dump.x[0].push_back(static_cast<float>(v));
    syn.s.push_back(st);
  }
  KvProjection p;
  std::uniform_real_distribution<float> uni(-0.5f, 0.5f);
  for (int i = 0; i < kKv * kC; ++i) p.wk.push_back(uni(rng));
  for (int i = 0; i < kKv * kC; ++i) p.wv.push_back(uni(rng));
  syn.proj.push_back(p);
  return syn;
}

// ||W (x - x_hat)||_F / ||W x||_F over the held-out tokens, where the centered
// reconstruction keeps coordinate j scaled by keep[j] (the ridge shrinkage) and drops the
// rest: x - x_hat = Σ_j (1 - keep[j]) s_j b_j.
double ExpectedRelErr(const Synthetic& syn, const std::vector<float>& w,
                      const std::vector<double>& keep) {
  double err = 0, norm = 0;
  for (int t = kTrain; t < 2 * kTrain; ++t) {
    std::vector<double> diff(kC, 0.0), xc(kC, 0.0);
    for (int j = 0; j < kRank; ++j)
      for (int i = 0; i < kC; ++i) {
        diff[i] += (1.0 - keep[j]) * syn.s[t][j] * syn.b[j][i];
        xc[i] += syn.s[t][j] * syn.b[j][i];
      }
    for (int i = 0; i < kC; ++i) xc[i] += syn.mu[i];  // K = W x, mean included
    for (int r = 0; r < kKv; ++r) {
      double a = 0, b = 0;
      for (int i = 0; i < kC; ++i) {
        a += w[r * kC + i] * diff[i];
        b += w[r * kC + i] * xc[i];
      }
      err += a * a;
      norm += b * b;
    }
  }
  return std::sqrt(err / norm);
}

TEST(FsqCalibrationTest, RidgeSolveOnATinyCase) {
  // Z = [[1,0],[0,2],[1,1]], X = [1,2,3]ᵀ, λ = 1: (ZᵀZ + I) = [[3,1],[1,6]], ZᵀX = [4,7],
  // D = [1, 1]; with λ = 0: [[2,1],[1,5]] D = [4,7] gives D = [13/9, 10/9].
  const std::vector<double> z = {1, 0, 0, 2, 1, 1}, x = {1, 2, 3};
  auto d = RidgeDecoder(z, x, 3, 2, 1, 1.0);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_NEAR(d[0], 1.0, 1e-12);
  EXPECT_NEAR(d[1], 1.0, 1e-12);
  d = RidgeDecoder(z, x, 3, 2, 1, 0.0);
  EXPECT_NEAR(d[0], 13.0 / 9, 1e-12);
  EXPECT_NEAR(d[1], 10.0 / 9, 1e-12);
}

TEST(FsqCalibrationTest, RecoversTheSubspaceAndItsScale) {
  const Synthetic syn = MakeSynthetic();
  FsqCalibrationOptions opt;
  opt.latent_width = kRank;
  opt.holdout = 0.5;
  std::vector<FsqLayerReport> rep;
  auto codec = CalibrateFsq(syn.dump, syn.proj, opt, &rep);
  ASSERT_TRUE(codec.ok()) << codec.status();
  ASSERT_EQ(rep.size(), 1u);
  EXPECT_EQ(rep[0].train_tokens, kTrain);
  const FsqLayerTensors& L = codec->layer(0);
  // E_i = ±b_i / (3 σ_i), the sign making the row's largest-magnitude entry positive.
  for (int i = 0; i < kRank; ++i) {
    int arg = 0;
    for (int k = 1; k < kC; ++k)
      if (std::abs(syn.b[i][k]) > std::abs(syn.b[i][arg])) arg = k;
    const double sign = syn.b[i][arg] > 0 ? 1.0 : -1.0;
    double bias = 0;
    for (int k = 0; k < kC; ++k) {
      EXPECT_NEAR(L.encoder[i * kC + k], sign * syn.b[i][k] / (3 * kSigma[i]), 1e-5)
          << "row " << i << " col " << k;
      bias -= L.encoder[i * kC + k] * syn.mu[k];
    }
    EXPECT_NEAR(L.encoder_bias[i], bias, 1e-5);
  }
  // b_k = W^K μ.
  for (int r = 0; r < kKv; ++r) {
    double bk = 0;
    for (int k = 0; k < kC; ++k) bk += syn.proj[0].wk[r * kC + k] * syn.mu[k];
    EXPECT_NEAR(L.bias_k[r], bk, 1e-4);
  }
  // Every code is ±2, ZᵀZ = 4n·I, so the ridge keeps 4n / (4n + λ) of each coordinate:
  // the centered residual's relative error is λ / (4n + λ).
  const double keep = 4.0 * kTrain / (4.0 * kTrain + 1.0);
  const std::vector<double> all(kRank, keep);
  EXPECT_NEAR(rep[0].x_rel_err, 1.0 / (4.0 * kTrain + 1.0), 1e-6);
  EXPECT_NEAR(rep[0].k_rel_err, ExpectedRelErr(syn, syn.proj[0].wk, all), 1e-6);
  EXPECT_NEAR(rep[0].v_rel_err, ExpectedRelErr(syn, syn.proj[0].wv, all), 1e-6);
  EXPECT_GT(rep[0].k_rel_err, 1e-4);
  EXPECT_NEAR(rep[0].explained, 1.0, 1e-9);
  EXPECT_EQ(rep[0].saturated, 0.0);
  // Without the ridge term the codes reconstruct the residuals exactly.
  opt.lambda = 0;
  ASSERT_TRUE(CalibrateFsq(syn.dump, syn.proj, opt, &rep).ok());
  EXPECT_LT(rep[0].k_rel_err, 1e-5);
}

TEST(FsqCalibrationTest, FewerLatentsDropTheSmallestComponents) {
  const Synthetic syn = MakeSynthetic();
  FsqCalibrationOptions opt;
  opt.latent_width = 4;
  opt.holdout = 0.5;
  std::vector<FsqLayerReport> rep;
  ASSERT_TRUE(CalibrateFsq(syn.dump, syn.proj, opt, &rep).ok());
  const double keep = 4.0 * kTrain / (4.0 * kTrain + 1.0);
  const std::vector<double> keeps = {keep, keep, keep, keep, 0, 0, 0, 0};
  EXPECT_NEAR(rep[0].k_rel_err, ExpectedRelErr(syn, syn.proj[0].wk, keeps), 1e-5);
  EXPECT_NEAR(rep[0].v_rel_err, ExpectedRelErr(syn, syn.proj[0].wv, keeps), 1e-5);
  double top = 0, all = 0;
  for (int j = 0; j < kRank; ++j) (j < 4 ? top : all) += kSigma[j] * kSigma[j];
  EXPECT_NEAR(rep[0].explained, top / (top + all), 1e-9);
}

TEST(FsqCalibrationTest, LatentsBeyondTheRankAndBeyondCRepeatDirections) {
  const Synthetic syn = MakeSynthetic();
  FsqCalibrationOptions opt;
  opt.holdout = 0.5;
  std::vector<FsqLayerReport> rep;
  // G = 12: directions 8..11 carry no variance: zero encoder rows, code 0, same error.
  opt.latent_width = 12;
  auto codec = CalibrateFsq(syn.dump, syn.proj, opt, &rep);
  ASSERT_TRUE(codec.ok());
  for (int k = 0; k < kC; ++k) EXPECT_EQ(codec->layer(0).encoder[10 * kC + k], 0.0f);
  const double k4 = 4.0 * kTrain / (4.0 * kTrain + 1.0);
  EXPECT_NEAR(rep[0].k_rel_err, ExpectedRelErr(syn, syn.proj[0].wk, std::vector<double>(kRank, k4)),
              1e-6);
  EXPECT_NEAR(rep[0].x_rel_err, 1.0 / (4.0 * kTrain + 1.0), 1e-6);
  // G = C + 4 = 20: latents 16..19 repeat directions 0..3 (i mod C); the ridge splits the
  // duplicated columns evenly, keeping 8n / (8n + λ) of them.
  opt.latent_width = kC + 4;
  codec = CalibrateFsq(syn.dump, syn.proj, opt, &rep);
  ASSERT_TRUE(codec.ok());
  for (int k = 0; k < kC; ++k) {
    EXPECT_EQ(codec->layer(0).encoder[(kC + 2) * kC + k], codec->layer(0).encoder[2 * kC + k]);
  }
  const double k8 = 8.0 * kTrain / (8.0 * kTrain + 1.0);
  EXPECT_NEAR(rep[0].k_rel_err,
              ExpectedRelErr(syn, syn.proj[0].wk, {k8, k8, k8, k8, k4, k4, k4, k4}), 1e-6);
}

TEST(FsqCalibrationTest, CalibratedCodecRoundTripsThroughTheCodecFile) {
  const Synthetic syn = MakeSynthetic();
  FsqCalibrationOptions opt;
  opt.latent_width = 5;
  auto codec = CalibrateFsq(syn.dump, syn.proj, opt, nullptr);
  ASSERT_TRUE(codec.ok()) << codec.status();
  auto file = SafetensorsFile::Parse(codec->ToSafetensors().Serialize());
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->metadata().at("kvcd.codec"), "fsq");
  EXPECT_EQ(file->metadata().at("latent_width"), "5");
  EXPECT_EQ(file->metadata().at("key_norm"), "none");
  auto back = FsqCodec::FromSafetensors(*file, codec->shape());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->layer(0).decoder_v, codec->layer(0).decoder_v);
  EXPECT_EQ(back->layer(0).encoder, codec->layer(0).encoder);
  EXPECT_EQ(back->layer(0).bias_k, codec->layer(0).bias_k);
}

TEST(FsqCalibrationTest, BadInputIsRejected) {
  Synthetic syn = MakeSynthetic();
  FsqCalibrationOptions opt;
  opt.latent_width = 4;
  ActivationDump no_x = syn.dump;
  no_x.residual_width = 0;
  no_x.x.clear();
  EXPECT_EQ(CalibrateFsq(no_x, syn.proj, opt, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  ActivationDump nan = syn.dump;
  nan.x[0][17] = std::nanf("");
  auto s = CalibrateFsq(nan, syn.proj, opt, nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layers.0.x"), std::string::npos) << s;
  auto short_w = syn.proj;
  short_w[0].wv.pop_back();
  EXPECT_EQ(CalibrateFsq(syn.dump, short_w, opt, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  opt.latent_width = kernels::kFsqMaxLatent + 1;
  EXPECT_EQ(CalibrateFsq(syn.dump, syn.proj, opt, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FsqCalibrationTest, ResidualsRoundTripThroughTheDump) {
  const Synthetic syn = MakeSynthetic();
  ActivationDump d = syn.dump;
  d.layers[0].q.assign(static_cast<size_t>(d.tokens) * kHkv * kD, 0.5f);
  d.layers[0].k.assign(static_cast<size_t>(d.tokens) * kHkv * kD, 0.25f);
  d.layers[0].v.assign(static_cast<size_t>(d.tokens) * kHkv * kD, 0.125f);
  const std::string path = ::testing::TempDir() + "/fsq_dump.safetensors";
  ASSERT_TRUE(WriteActivationDump(d, path).ok());
  auto back = LoadActivationDump(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->residual_width, kC);
  ASSERT_EQ(back->x.size(), 1u);
  EXPECT_EQ(back->x[0], d.x[0]);
  // A dump with x tensors but no residual_width is malformed.
  SafetensorsWriter w;
  w.AddF32("layers.0.q", {1, 1, 8}, std::vector<float>(8, 1.0f));
  w.AddF32("layers.0.k", {1, 1, 8}, std::vector<float>(8, 1.0f));
  w.AddF32("layers.0.v", {1, 1, 8}, std::vector<float>(8, 1.0f));
  w.AddF32("layers.0.x", {1, 4}, std::vector<float>(4, 1.0f));
  for (auto [k, v] : {std::pair<const char*, const char*>{"kvcd.dump", "1"},
                      {"num_layers", "1"},
                      {"num_q_heads", "1"},
                      {"num_kv_heads", "1"},
                      {"head_dim", "8"},
                      {"tokens", "1"}}) {
    w.SetMetadata(k, v);
  }
  ASSERT_TRUE(w.WriteFile(path).ok());
  EXPECT_EQ(LoadActivationDump(path).status().code(), absl::StatusCode::kInvalidArgument);
  w.SetMetadata("residual_width", "5");  // disagrees with the tensor
  ASSERT_TRUE(w.WriteFile(path).ok());
  EXPECT_EQ(LoadActivationDump(path).status().code(), absl::StatusCode::kInvalidArgument);
  std::remove(path.c_str());
}

TEST(FsqCalibrationTest, EvalRebuildsPostRopeKeysAndCountsCodeBytes) {
  Synthetic syn = MakeSynthetic();
  ActivationDump& d = syn.dump;
  const int64_t n = d.tokens;
  kernels::RopeSpec rope;
  rope.rotary_dims = kD;
  rope.pairing = kernels::RopePairing::kInterleaved;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  LayerActivations& a = d.layers[0];
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> k(kKv), v(kKv);
    for (int r = 0; r < kKv; ++r)
      for (int i = 0; i < kC; ++i) {
        k[r] += static_cast<double>(syn.proj[0].wk[r * kC + i]) * d.x[0][t * kC + i];
        v[r] += static_cast<double>(syn.proj[0].wv[r * kC + i]) * d.x[0][t * kC + i];
      }
    RopeInterleaved(k.data(), kHkv, kD, t);
    for (int r = 0; r < kKv; ++r) {
      a.k.push_back(static_cast<float>(k[r]));
      a.v.push_back(static_cast<float>(v[r]));
      a.q.push_back(normal(rng));
    }
  }
  FsqCalibrationOptions opt;
  opt.latent_width = kRank;
  opt.lambda = 0;  // exact reconstruction of this subspace
  opt.holdout = 0.5;
  auto codec = CalibrateFsq(d, syn.proj, opt, nullptr);
  ASSERT_TRUE(codec.ok());
  std::vector<EvalCodec> codecs(2);
  for (int i = 0; i < 2; ++i) {
    codecs[i].kind = EvalCodec::Kind::kFsq;
    codecs[i].fsq = *codec;
    codecs[i].rope = rope;
  }
  codecs[0].name = "fsq";
  codecs[1].name = "fsq-wrong-pairing";
  codecs[1].rope.pairing = kernels::RopePairing::kHalf;
  EvalOptions eo;
  eo.sink = 4;
  eo.recent = 8;
  auto res = Evaluate(d, codecs, eo);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_LT((*res)[0].overall.out_err, 1e-3);
  EXPECT_LT((*res)[0].overall.kl_mean, 1e-5);  // the BF16 windows' rounding
  EXPECT_GT((*res)[1].overall.kl_mean, 100 * (*res)[0].overall.kl_mean + 1e-4);
  // 244 history tokens of ceil(8/2) = 4 bytes for both KV heads, 12 window tokens of
  // 2 heads x 8 dims x 2 (K, V) x 2 bytes.
  const double per_token = (244.0 * 4 + 12.0 * kHkv * kD * 4) / 256;
  EXPECT_NEAR((*res)[0].bytes_per_token, per_token, 1e-9);
  EXPECT_NEAR((*res)[0].compression, kHkv * kD * 4 / per_token, 1e-9);
  // A codec whose geometry does not match the dump is rejected.
  FsqCodecShape other = codec->shape();
  other.num_kv_heads = 1;
  other.head_dim = 2 * kD;  // same K/V width, another geometry
  std::vector<FsqLayerTensors> layers = {codec->layer(0)};
  auto wrong = FsqCodec::FromLayers(other, layers);
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  codecs[0].fsq = *wrong;
  EXPECT_EQ(Evaluate(d, {codecs[0]}, eo).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace fsq_calibration_test
}  // namespace kvcd
