#include "examples/llama_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/activation_dump.h"
#include "common/fsq_codec.h"
#include "common/safetensors.h"
#include "examples/llama_matmul.h"
#include "examples/llama_worker.h"

namespace kvcd::llama {
namespace llama_model_test {

// A small random llama-family model, written and read through safetensors like the real one.
struct Spec {
  int dim = 32, hidden = 48, layers = 2, heads = 4, kv_heads = 2, head_dim = 8, vocab = 40;
  std::string pairing = "half";
  bool tied = true, qk_norm = false;
};

struct Tensors {
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> t;
  std::vector<float>& operator[](const std::string& name) { return t[name].second; }
};

Tensors RandomTensors(const Spec& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Tensors out;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale, float mean) {
    int64_t size = 1;
    for (int64_t d : shape) size *= d;
    std::vector<float> v(static_cast<size_t>(size));
    for (auto& x : v) x = mean + scale * n(rng);
    out.t[name] = {shape, v};
  };
  const int64_t d = s.dim, qd = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  add("model.embed_tokens.weight", {s.vocab, d}, 1.0f, 0);
  add("model.norm.weight", {d}, 0.1f, 1);
  if (!s.tied) add("lm_head.weight", {s.vocab, d}, 1.0f, 0);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {d}, 0.1f, 1);
    add(p + "self_attn.q_proj.weight", {qd, d}, 0.4f, 0);
    add(p + "self_attn.k_proj.weight", {kv, d}, 0.4f, 0);
    add(p + "self_attn.v_proj.weight", {kv, d}, 0.3f, 0);
    add(p + "self_attn.o_proj.weight", {d, qd}, 0.2f, 0);
    if (s.qk_norm) {
      add(p + "self_attn.q_norm.weight", {s.head_dim}, 0.1f, 1);
      add(p + "self_attn.k_norm.weight", {s.head_dim}, 0.1f, 1);
    }
    add(p + "post_attention_layernorm.weight", {d}, 0.1f, 1);
    add(p + "mlp.gate_proj.weight", {s.hidden, d}, 0.3f, 0);
    add(p + "mlp.up_proj.weight", {s.hidden, d}, 0.3f, 0);
    add(p + "mlp.down_proj.weight", {d, s.hidden}, 0.2f, 0);
  }
  return out;
}

absl::StatusOr<Model> Build(const Spec& s, const Tensors& t,
                            std::map<std::string, std::string> meta_override = {}) {
  SafetensorsWriter w;
  for (const auto& [name, v] : t.t) w.AddF32(name, v.first, v.second);
  std::map<std::string, std::string> meta = {
      {"kvcd.model", "llama"},
      {"kvcd.dim", std::to_string(s.dim)},
      {"kvcd.hidden_dim", std::to_string(s.hidden)},
      {"kvcd.n_layers", std::to_string(s.layers)},
      {"kvcd.n_heads", std::to_string(s.heads)},
      {"kvcd.n_kv_heads", std::to_string(s.kv_heads)},
      {"kvcd.head_dim", std::to_string(s.head_dim)},
      {"kvcd.vocab_size", std::to_string(s.vocab)},
      {"kvcd.max_seq_len", "64"},
      {"kvcd.rope_theta", "100.0"},
      {"kvcd.rms_eps", "1e-5"},
      {"kvcd.rope_pairing", s.pairing},
      {"kvcd.tied_embeddings", s.tied ? "1" : "0"},
      {"kvcd.qk_norm", s.qk_norm ? "1" : "0"},
  };
  for (const auto& [k, v] : meta_override) meta[k] = v;
  for (const auto& [k, v] : meta) {
    if (!v.empty()) w.SetMetadata(k, v);
  }
  auto f = SafetensorsFile::Parse(w.Serialize());
  if (!f.ok()) return f.status();
  return Model::FromSafetensors(*f);
}

// Logits of a few tokens decoded in sequence with local attention.
std::vector<std::vector<float>> Decode(const Model& m) {
  LocalAttention attn(m.config());
  std::vector<std::vector<float>> out;
  const int tokens[] = {3, 17, 5, 39, 0, 22, 8};
  for (int pos = 0; pos < 7; ++pos) {
    std::vector<float> logits;
    EXPECT_TRUE(m.Forward(tokens[pos], pos, std::ref(attn), &logits).ok());
    out.push_back(logits);
  }
  return out;
}

double MaxDiff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < a[i].size(); ++j) m = std::max(m, std::fabs(double{a[i][j]} - b[i][j]));
  }
  return m;
}

// llama.cpp's converter permutation of q/k rows: per head [2][d/2] -> [d/2][2].
std::vector<float> PermuteToInterleaved(const std::vector<float>& w, int heads, int hd, int in) {
  std::vector<float> out(w.size());
  for (int h = 0; h < heads; ++h) {
    for (int half = 0; half < 2; ++half) {
      for (int i = 0; i < hd / 2; ++i) {
        const int src = h * hd + half * (hd / 2) + i, dst = h * hd + 2 * i + half;
        std::copy(w.begin() + int64_t{src} * in, w.begin() + int64_t{src + 1} * in,
                  out.begin() + int64_t{dst} * in);
      }
    }
  }
  return out;
}

TEST(LlamaModelTest, RopeRotatesPairsByPositionAngles) {
  // head_dim 4, theta 100: pair 0 turns by pos rad, pair 1 by pos / 10 rad.
  float half[4] = {1, 2, 3, 4}, inter[4] = {1, 3, 2, 4};
  ApplyRope(half, 1, 4, 2, 100.0, RopePairing::kHalf);          // pairs (0,2), (1,3)
  ApplyRope(inter, 1, 4, 2, 100.0, RopePairing::kInterleaved);  // pairs (0,1), (2,3)
  const double c0 = std::cos(2.0), s0 = std::sin(2.0), c1 = std::cos(0.2), s1 = std::sin(0.2);
  EXPECT_NEAR(half[0], 1 * c0 - 3 * s0, 1e-6);
  EXPECT_NEAR(half[2], 1 * s0 + 3 * c0, 1e-6);
  EXPECT_NEAR(half[1], 2 * c1 - 4 * s1, 1e-6);
  EXPECT_NEAR(half[3], 2 * s1 + 4 * c1, 1e-6);
  // The interleaved layout of the same vector gives the same values, permuted.
  EXPECT_FLOAT_EQ(inter[0], half[0]);
  EXPECT_FLOAT_EQ(inter[1], half[2]);
  EXPECT_FLOAT_EQ(inter[2], half[1]);
  EXPECT_FLOAT_EQ(inter[3], half[3]);
  float zero[4] = {1, 2, 3, 4};
  ApplyRope(zero, 1, 4, 0, 100.0, RopePairing::kHalf);
  EXPECT_FLOAT_EQ(zero[1], 2);
}

TEST(LlamaModelTest, PermutedRowsWithInterleavedRopeEqualHalfSplitRope) {
  Spec s;
  Tensors t = RandomTensors(s, 1);
  auto half = Build(s, t);
  ASSERT_TRUE(half.ok()) << half.status();
  Tensors p = t;
  for (int l = 0; l < s.layers; ++l) {
    const std::string q = absl::StrCat("model.layers.", l, ".self_attn.q_proj.weight");
    const std::string k = absl::StrCat("model.layers.", l, ".self_attn.k_proj.weight");
    p[q] = PermuteToInterleaved(t[q], s.heads, s.head_dim, s.dim);
    p[k] = PermuteToInterleaved(t[k], s.kv_heads, s.head_dim, s.dim);
  }
  Spec si = s;
  si.pairing = "interleaved";
  auto inter = Build(si, p);
  ASSERT_TRUE(inter.ok());
  const auto ref = Decode(*half);
  EXPECT_LT(MaxDiff(ref, Decode(*inter)), 1e-4);
  // The permuted rows with the wrong pairing are a different model.
  auto wrong = Build(s, p);
  ASSERT_TRUE(wrong.ok());
  EXPECT_GT(MaxDiff(ref, Decode(*wrong)), 1e-2);
}

TEST(LlamaModelTest, GroupedQueryHeadsShareTheirKvHead) {
  // 4 query heads on 2 KV heads == 4 KV heads where heads 2i and 2i+1 carry KV head i.
  Spec s;
  Tensors t = RandomTensors(s, 2);
  auto gqa = Build(s, t);
  ASSERT_TRUE(gqa.ok());
  Spec sm = s;
  sm.kv_heads = s.heads;
  Tensors m = t;
  for (int l = 0; l < s.layers; ++l) {
    for (const char* w : {"k_proj", "v_proj"}) {
      const std::string name = absl::StrCat("model.layers.", l, ".self_attn.", w, ".weight");
      const int64_t rows = int64_t{s.head_dim} * s.dim;
      std::vector<float> full;
      for (int h = 0; h < s.heads; ++h) {
        const int kvh = h / (s.heads / s.kv_heads);
        full.insert(full.end(), t[name].begin() + kvh * rows, t[name].begin() + (kvh + 1) * rows);
      }
      m.t[name] = {{int64_t{s.heads} * s.head_dim, s.dim}, full};
    }
  }
  auto mha = Build(sm, m);
  ASSERT_TRUE(mha.ok()) << mha.status();
  EXPECT_LT(MaxDiff(Decode(*gqa), Decode(*mha)), 1e-4);
}

TEST(LlamaModelTest, SeparateHeadEqualToEmbeddingsMatchesTiedModel) {
  Spec s;
  Tensors t = RandomTensors(s, 3);
  auto tied = Build(s, t);
  Spec ss = s;
  ss.tied = false;
  Tensors u = t;
  u.t["lm_head.weight"] = t.t["model.embed_tokens.weight"];
  auto separate = Build(ss, u);
  ASSERT_TRUE(tied.ok() && separate.ok());
  EXPECT_LT(MaxDiff(Decode(*tied), Decode(*separate)), 1e-5);
  u["lm_head.weight"][0] += 1.0f;  // a different head changes the logits
  auto other = Build(ss, u);
  ASSERT_TRUE(other.ok());
  EXPECT_GT(MaxDiff(Decode(*tied), Decode(*other)), 1e-3);
}

TEST(LlamaModelTest, QkNormMakesAttentionInvariantToQkScale) {
  // Per-head RMSNorm of q and k: scaling W_q and W_k changes nothing with it, much without.
  for (bool qk_norm : {true, false}) {
    Spec s;
    s.qk_norm = qk_norm;
    Tensors t = RandomTensors(s, 4);
    Tensors scaled = t;
    for (int l = 0; l < s.layers; ++l) {
      for (const char* w : {"q_proj", "k_proj"}) {
        for (auto& x : scaled[absl::StrCat("model.layers.", l, ".self_attn.", w, ".weight")])
          x *= 4;
      }
    }
    auto a = Build(s, t), b = Build(s, scaled);
    ASSERT_TRUE(a.ok() && b.ok());
    if (qk_norm) {
      EXPECT_LT(MaxDiff(Decode(*a), Decode(*b)), 1e-3);
    } else {
      EXPECT_GT(MaxDiff(Decode(*a), Decode(*b)), 1e-2);
    }
  }
}

// The same weights as a llama2.c checkpoint: header, then each kind stacked over the
// layers (w1 = gate, w3 = up, w2 = down), the final norm, the RoPE tables and, untied, the
// classifier. `cut` drops that many bytes from the end.
std::string WriteLlama2c(const Spec& s, Tensors t, int max_seq_len, const std::string& name,
                         size_t cut = 0) {
  std::string bytes;
  auto put = [&](const std::vector<float>& v) {
    bytes.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  };
  const int32_t header[7] = {
      s.dim, s.hidden, s.layers, s.heads, s.kv_heads, s.tied ? s.vocab : -s.vocab, max_seq_len};
  bytes.append(reinterpret_cast<const char*>(header), sizeof(header));
  put(t["model.embed_tokens.weight"]);
  for (const char* kind : {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                           "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
                           "mlp.gate_proj", "mlp.down_proj", "mlp.up_proj"}) {
    for (int l = 0; l < s.layers; ++l)
      put(t[absl::StrCat("model.layers.", l, ".", kind, ".weight")]);
  }
  put(t["model.norm.weight"]);
  put(std::vector<float>(static_cast<size_t>(max_seq_len) * s.head_dim, 0.5f));  // freq_cis
  if (!s.tied) put(t["lm_head.weight"]);
  bytes.resize(bytes.size() - cut);
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

TEST(LlamaModelTest, Llama2cCheckpointEqualsTheSameWeightsFromSafetensors) {
  for (bool tied : {true, false}) {
    Spec s;
    s.pairing = "interleaved";  // llama2.c's RoPE
    s.tied = tied;
    const Tensors t = RandomTensors(s, 21);
    auto st = Build(s, t, {{"kvcd.rope_theta", "10000"}});
    ASSERT_TRUE(st.ok()) << st.status();
    auto l2 = Model::LoadLlama2c(WriteLlama2c(s, t, 64, "m.bin"));
    ASSERT_TRUE(l2.ok()) << l2.status();
    const Config& c = l2->config();
    EXPECT_EQ(c.head_dim, s.dim / s.heads);
    EXPECT_EQ(c.pairing, RopePairing::kInterleaved);
    EXPECT_EQ(c.tied_embeddings, tied);
    EXPECT_EQ(c.max_seq_len, 64);
    EXPECT_EQ(l2->wk(1), st->wk(1));
    EXPECT_EQ(MaxDiff(Decode(*l2), Decode(*st)), 0.0) << "tied " << tied;
  }
}

TEST(LlamaModelTest, Llama2cRejectsTruncatedAndImplausibleFiles) {
  Spec s;
  s.pairing = "interleaved";
  const Tensors t = RandomTensors(s, 5);
  EXPECT_EQ(Model::LoadLlama2c(WriteLlama2c(s, t, 64, "cut.bin", 4)).status().code(),
            absl::StatusCode::kInvalidArgument);
  Spec bad = s;
  bad.heads = 5;  // dim 32 not a multiple of 5 heads
  EXPECT_EQ(Model::LoadLlama2c(WriteLlama2c(bad, t, 64, "bad.bin")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Model::LoadLlama2c("/nonexistent/stories.bin").status().code(),
            absl::StatusCode::kNotFound);
}

// The residual handed to the attention callback is the input of the K/V projections: at
// position 0 (no rotation) the token's k is W_k x and v is W_v x.
TEST(LlamaModelTest, AttentionInputResidualFeedsTheKvProjections) {
  Spec s;
  const Tensors t = RandomTensors(s, 8);
  auto m = Build(s, t);
  ASSERT_TRUE(m.ok());
  LocalAttention attn(m->config());
  std::vector<float> logits;
  ASSERT_TRUE(m->Forward(7, 0, std::ref(attn), &logits).ok());
  const int kv = m->config().kv_dim(), d = s.dim;
  for (int l = 0; l < s.layers; ++l) {
    ASSERT_EQ(attn.residuals(l).size(), static_cast<size_t>(d));
    const float* x = attn.residuals(l).data();
    double norm = 0;
    for (int i = 0; i < d; ++i) norm += double{x[i]} * x[i];
    EXPECT_GT(norm, 0.1);
    for (int r = 0; r < kv; ++r) {
      double k = 0, v = 0;
      for (int i = 0; i < d; ++i) {
        k += double{m->wk(l)[r * d + i]} * x[i];
        v += double{m->wv(l)[r * d + i]} * x[i];
      }
      EXPECT_NEAR(attn.keys(l)[r], k, 1e-4 * (1 + std::fabs(k))) << "layer " << l << " row " << r;
      EXPECT_NEAR(attn.values(l)[r], v, 1e-4 * (1 + std::fabs(v))) << "layer " << l << " row " << r;
    }
  }
}

// Recorded runs become an activation dump with the residuals (what kvcd-llama --dump and
// kvcd_stories --dump write, kvcd-calibrate fsq reads), and an FSQ codec initialized on
// them carries the model's geometry and, with qk_norm, its k_norm weights.
TEST(LlamaWorkerTest, RecordedRunsGiveADumpWithResidualsAndAnFsqCodec) {
  for (bool qk_norm : {false, true}) {
    Spec s;
    s.qk_norm = qk_norm;
    auto m = Build(s, RandomTensors(s, 31));
    ASSERT_TRUE(m.ok());
    LocalAttention a(m->config()), b(m->config());
    ASSERT_TRUE(RunReference(*m, {3, 17, 5, 39, 0, 22}, 30, -1, &a).ok());
    ASSERT_TRUE(RunReference(*m, {8, 1}, 33, -1, &b).ok());
    const ActivationDump dump = MakeActivationDump(m->config(), {&a, &b}, "test");
    const std::string path = ::testing::TempDir() + "/llama-worker.dump";
    ASSERT_TRUE(WriteActivationDump(dump, path).ok());
    auto back = LoadActivationDump(path);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->tokens, 35 + 34);
    EXPECT_EQ(back->residual_width, s.dim);
    ASSERT_EQ(back->x.size(), static_cast<size_t>(s.layers));
    std::vector<float> x1 = a.residuals(1);
    x1.insert(x1.end(), b.residuals(1).begin(), b.residuals(1).end());
    EXPECT_EQ(back->x[1], x1);
    EXPECT_EQ(back->layers[0].k.size(), static_cast<size_t>(69 * s.kv_heads * s.head_dim));

    auto blob = InitializeFsqCodec(*m, {&a, &b}, 12);
    ASSERT_TRUE(blob.ok()) << blob.status();
    auto file = SafetensorsFile::Parse(*blob);
    ASSERT_TRUE(file.ok());
    FsqCodecShape shape{s.layers, s.dim, 12, s.kv_heads, s.head_dim, qk_norm, 1e-5f};
    auto codec = FsqCodec::FromSafetensors(*file, shape);
    ASSERT_TRUE(codec.ok()) << codec.status();
    if (qk_norm) {
      EXPECT_EQ(codec->layer(1).key_norm, m->k_norm(1));
    }
    shape.latent_width = 13;
    EXPECT_EQ(FsqCodec::FromSafetensors(*file, shape).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(InitializeFsqCodec(*m, {&a, &b}, 0).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// MatMul's summation order (llama_matmul.h), written out one output at a time.
std::vector<float> ReferenceMatMul(const std::vector<float>& w, const std::vector<float>& x, int n,
                                   int out, int in) {
  std::vector<float> y(static_cast<size_t>(n) * out);
  for (int t = 0; t < n; ++t) {
    for (int o = 0; o < out; ++o) {
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const int body = in / 8 * 8;
      for (int i = 0; i < body; ++i) lane[i % 8] += w[o * in + i] * x[t * in + i];
      float tail = 0;
      for (int i = body; i < in; ++i) tail += w[o * in + i] * x[t * in + i];
      y[t * out + o] = tail + ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
                       ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    }
  }
  return y;
}

bool BitIdentical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every ISA's version against the order written out, bit for bit, on random inputs whose
// sizes hit every tile edge and a tail of in % 8.
TEST(LlamaMatMulTest, EveryIsaSumsInTheContractsOrder) {
  std::mt19937 rng(41);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const kernels::CpuIsa best = kernels::DetectCpuIsa();
  for (const auto& [n, out, in] : std::vector<std::tuple<int, int, int>>{{1, 1, 1},
                                                                         {1, 7, 8},
                                                                         {2, 5, 13},
                                                                         {3, 9, 64},
                                                                         {7, 23, 172},
                                                                         {11, 4099, 3},
                                                                         {20, 61, 96}}) {
    std::vector<float> w(static_cast<size_t>(out) * in), x(static_cast<size_t>(n) * in);
    for (auto& v : w) v = g(rng);
    for (auto& v : x) v = g(rng);
    const std::vector<float> want = ReferenceMatMul(w, x, n, out, in);
    for (kernels::CpuIsa isa :
         {kernels::CpuIsa::kScalar, kernels::CpuIsa::kAvx2, kernels::CpuIsa::kAvx512}) {
      if (static_cast<int>(isa) > static_cast<int>(best)) continue;
      std::vector<float> y(want.size(), -1.0f);
      MatMulForIsa(isa, w.data(), x.data(), n, out, in, y.data());
      EXPECT_TRUE(BitIdentical(y, want))
          << kernels::CpuIsaName(isa) << " n " << n << " out " << out << " in " << in;
    }
    // A different input changes the product (the comparison can fail).
    x[0] += 1.0f;
    std::vector<float> y(want.size());
    MatMul(w.data(), x.data(), n, out, in, y.data());
    EXPECT_FALSE(BitIdentical(y, want));
  }
}

// LocalAttention against its summation order written out one score and one output lane at
// a time (the order it promises to keep), bit for bit, on random q/k/v at head_dim 8 and 10
// (a lane tail) and histories past eight positions (its blocks of eight and the rest).
TEST(LlamaModelTest, LocalAttentionSumsInOneLoopPerScoreOrder) {
  for (int hd : {8, 10}) {
    Config c;
    c.dim = 16;
    c.n_layers = 1;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = hd;
    const int qd = c.q_dim(), kv = c.kv_dim(), g = c.n_heads / c.n_kv_heads;
    std::mt19937 rng(hd);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    LocalAttention attn(c);
    std::vector<float> keys, values;
    for (int pos = 0; pos < 21; ++pos) {
      std::vector<float> x(c.dim), q(qd), k(kv), v(kv), o(qd);
      for (auto* vec : {&x, &q, &k, &v}) {
        for (auto& e : *vec) e = dist(rng);
      }
      keys.insert(keys.end(), k.begin(), k.end());
      values.insert(values.end(), v.begin(), v.end());
      ASSERT_TRUE(attn(0, pos, x.data(), q.data(), k.data(), v.data(), o.data()).ok());
      std::vector<float> want(qd);
      const int n = pos + 1;
      const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
      for (int h = 0; h < c.n_heads; ++h) {
        const int kvh = h / g;
        std::vector<float> att(n);
        float mx = -1e30f;
        for (int t = 0; t < n; ++t) {
          float s = 0;
          for (int i = 0; i < hd; ++i) s += q[h * hd + i] * keys[t * kv + kvh * hd + i];
          att[t] = s * scale;
          mx = std::max(mx, att[t]);
        }
        float sum = 0;
        for (int t = 0; t < n; ++t) sum += (att[t] = std::exp(att[t] - mx));
        for (int t = 0; t < n; ++t) {
          const float w = att[t] / sum;
          for (int i = 0; i < hd; ++i) want[h * hd + i] += w * values[t * kv + kvh * hd + i];
        }
      }
      EXPECT_TRUE(BitIdentical(o, want)) << "head_dim " << hd << " position " << pos;
    }
  }
}

// A span of tokens through Model::Forward equals the same tokens one step at a time, bit for
// bit: every step's logits and everything the local attention recorded; so do two steps of
// the same token with two callbacks (a served step beside its reference).
TEST(LlamaModelTest, MultiTokenForwardIsBitIdenticalToOneTokenSteps) {
  for (bool qk_norm : {false, true}) {
    Spec s;
    s.dim = 40;  // head_dim 10, hidden 52: rows of in % 8 != 0 in the down projection
    s.head_dim = 10;
    s.hidden = 52;
    s.qk_norm = qk_norm;
    s.tied = !qk_norm;
    auto m = Build(s, RandomTensors(s, 51));
    ASSERT_TRUE(m.ok()) << m.status();
    const std::vector<int> tokens = {3, 17, 5, 39, 0, 22, 8, 8, 1, 30, 12, 7, 19, 2, 33, 4, 26};
    const int n = static_cast<int>(tokens.size());
    LocalAttention one(m->config()), span(m->config());
    std::vector<std::vector<float>> want(tokens.size()), got(tokens.size());
    for (int t = 0; t < n; ++t) {
      ASSERT_TRUE(m->Forward(tokens[t], t, std::ref(one), &want[t]).ok());
    }
    // Two spans, the second with logits on every other step only.
    const Model::AttentionFn attend = std::ref(span);
    std::vector<Model::Step> steps;
    for (int t = 0; t < n; ++t) steps.push_back({tokens[t], t, &attend, &got[t]});
    for (int t = 9; t < n; t += 2) steps[t].logits = nullptr;
    ASSERT_TRUE(m->Forward(absl::MakeConstSpan(steps).subspan(0, 5)).ok());
    ASSERT_TRUE(m->Forward(absl::MakeConstSpan(steps).subspan(5)).ok());
    for (int t = 0; t < n; ++t) {
      if (t >= 9 && (t - 9) % 2 == 0) {
        EXPECT_TRUE(got[t].empty()) << "step " << t << " asked for no logits";
      } else {
        EXPECT_TRUE(BitIdentical(got[t], want[t])) << "qk_norm " << qk_norm << " step " << t;
      }
    }
    for (int l = 0; l < s.layers; ++l) {
      EXPECT_TRUE(BitIdentical(span.keys(l), one.keys(l))) << "layer " << l;
      EXPECT_TRUE(BitIdentical(span.values(l), one.values(l))) << "layer " << l;
      EXPECT_TRUE(BitIdentical(span.queries(l), one.queries(l))) << "layer " << l;
      EXPECT_TRUE(BitIdentical(span.residuals(l), one.residuals(l))) << "layer " << l;
    }
    // ForwardTokens: the last token's logits.
    LocalAttention whole(m->config());
    std::vector<float> last;
    ASSERT_TRUE(m->ForwardTokens(tokens, 0, std::ref(whole), &last).ok());
    EXPECT_TRUE(BitIdentical(last, want.back()));
    EXPECT_EQ(whole.tokens(), n);
    // One token through two recorders at once, after different histories.
    LocalAttention a(m->config()), b(m->config());
    ASSERT_TRUE(
        m->ForwardTokens(absl::MakeConstSpan(tokens).subspan(0, 6), 0, std::ref(a), nullptr).ok());
    const std::vector<int> other = {9, 9, 9, 9, 9, 9};
    ASSERT_TRUE(m->ForwardTokens(other, 0, std::ref(b), nullptr).ok());
    const Model::AttentionFn fa = std::ref(a), fb = std::ref(b);
    std::vector<float> la, lb;
    const Model::Step pair[2] = {{tokens[6], 6, &fa, &la}, {tokens[6], 6, &fb, &lb}};
    ASSERT_TRUE(m->Forward(pair).ok());
    EXPECT_TRUE(BitIdentical(la, want[6]));
    LocalAttention c(m->config());
    std::vector<float> lc;
    ASSERT_TRUE(m->ForwardTokens(other, 0, std::ref(c), nullptr).ok());
    ASSERT_TRUE(m->Forward(tokens[6], 6, std::ref(c), &lc).ok());
    EXPECT_TRUE(BitIdentical(lb, lc));
    EXPECT_FALSE(BitIdentical(la, lb));  // the histories differ, so do the logits
    // A bad step refuses the whole call before anything runs.
    LocalAttention untouched(m->config());
    const Model::AttentionFn fu = std::ref(untouched);
    const Model::Step bad[2] = {{1, 0, &fu, nullptr}, {s.vocab, 1, &fu, nullptr}};
    EXPECT_EQ(m->Forward(bad).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(untouched.tokens(), 0);
  }
}

TEST(LlamaModelTest, RejectsBadFilesAndInputs) {
  Spec s;
  Tensors t = RandomTensors(s, 5);
  EXPECT_EQ(Build(s, t, {{"kvcd.model", ""}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Build(s, t, {{"kvcd.n_heads", "x"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Build(s, t, {{"kvcd.n_heads", "3"}}).status().code(),  // 3 % 2 kv heads
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Build(s, t, {{"kvcd.rope_pairing", "neox"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Build(s, t, {{"kvcd.dim", "31"}}).status().code(),  // shapes no longer match
            absl::StatusCode::kInvalidArgument);
  Tensors missing = t;
  missing.t.erase("model.layers.1.mlp.up_proj.weight");
  auto m = Build(s, missing);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  auto good = Build(s, t);
  ASSERT_TRUE(good.ok());
  LocalAttention attn(good->config());
  std::vector<float> logits;
  EXPECT_EQ(good->Forward(s.vocab, 0, std::ref(attn), &logits).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(good->Forward(1, 64, std::ref(attn), &logits).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(good->Forward(1, 1, std::ref(attn), &logits).code(),  // position 0 never seen
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Model::Load("/nonexistent/model.safetensors").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace llama_model_test
}  // namespace kvcd::llama
