#include "client/examples/llama2.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"

namespace kvcd::llama2 {
namespace {

void RmsNorm(const float* x, const float* w, int n, float* out) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + 1e-5f);
  for (int i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// y = W x, W [out][in].
void MatVec(const float* w, const float* x, int out, int in, float* y) {
  for (int o = 0; o < out; ++o) {
    float acc = 0;
    const float* row = w + static_cast<int64_t>(o) * in;
    for (int i = 0; i < in; ++i) acc += row[i] * x[i];
    y[o] = acc;
  }
}

// RoPE on adjacent pairs (2i, 2i+1) of each head: angle pos * 10000^(-(2i mod hd)/hd).
void Rope(float* x, int n, int head_dim, int pos) {
  for (int i = 0; i < n; i += 2) {
    const float freq = std::pow(10000.0f, -static_cast<float>(i % head_dim) / head_dim);
    const float a = pos * freq, c = std::cos(a), s = std::sin(a);
    const float x0 = x[i], x1 = x[i + 1];
    x[i] = x0 * c - x1 * s;
    x[i + 1] = x0 * s + x1 * c;
  }
}

}  // namespace

absl::StatusOr<Model> Model::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open checkpoint '", path, "'"));
  int32_t h[7];
  in.read(reinterpret_cast<char*>(h), sizeof(h));
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": shorter than its header"));
  Model m;
  m.c_ = Config{h[0], h[1], h[2], h[3], h[4], std::abs(h[5]), h[6]};
  const Config& c = m.c_;
  if (c.dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || c.vocab_size <= 0 ||
      c.hidden_dim <= 0 || c.seq_len <= 0 || c.dim > 65536 || c.n_layers > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": implausible llama2.c header"));
  }
  if (h[5] < 0) return absl::UnimplementedError("unshared classifier weights are not supported");
  const int64_t L = c.n_layers, d = c.dim, kv = c.kv_dim(), hid = c.hidden_dim;
  auto read = [&](std::vector<float>* v, int64_t n) {
    v->resize(static_cast<size_t>(n));
    in.read(reinterpret_cast<char*>(v->data()), static_cast<std::streamsize>(n * 4));
    return static_cast<bool>(in);
  };
  if (!read(&m.emb_, c.vocab_size * d) || !read(&m.rms_att_, L * d) || !read(&m.wq_, L * d * d) ||
      !read(&m.wk_, L * kv * d) || !read(&m.wv_, L * kv * d) || !read(&m.wo_, L * d * d) ||
      !read(&m.rms_ffn_, L * d) || !read(&m.w1_, L * hid * d) || !read(&m.w2_, L * d * hid) ||
      !read(&m.w3_, L * hid * d) || !read(&m.rms_final_, d)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated weights"));
  }
  return m;
}

absl::Status Model::Forward(int token, int pos, const AttentionFn& attend,
                            std::vector<float>* logits, const ResidualFn& residual) {
  const Config& c = c_;
  const int d = c.dim, kv = c.kv_dim(), hid = c.hidden_dim, hd = c.head_dim();
  if (token < 0 || token >= c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("token ", token, " out of range"));
  }
  std::vector<float> x(emb_.begin() + static_cast<int64_t>(token) * d,
                       emb_.begin() + static_cast<int64_t>(token + 1) * d);
  std::vector<float> xb(d), q(d), k(kv), v(kv), o(d), tmp(d), h1(hid), h3(hid);
  for (int l = 0; l < c.n_layers; ++l) {
    RmsNorm(x.data(), rms_att_.data() + l * d, d, xb.data());
    if (residual) residual(l, pos, xb.data());
    MatVec(wq_.data() + static_cast<int64_t>(l) * d * d, xb.data(), d, d, q.data());
    MatVec(wk_.data() + static_cast<int64_t>(l) * kv * d, xb.data(), kv, d, k.data());
    MatVec(wv_.data() + static_cast<int64_t>(l) * kv * d, xb.data(), kv, d, v.data());
    Rope(q.data(), d, hd, pos);
    Rope(k.data(), kv, hd, pos);
    absl::Status s = attend(l, pos, q.data(), k.data(), v.data(), o.data());
    if (!s.ok()) return s;
    MatVec(wo_.data() + static_cast<int64_t>(l) * d * d, o.data(), d, d, tmp.data());
    for (int i = 0; i < d; ++i) x[i] += tmp[i];
    RmsNorm(x.data(), rms_ffn_.data() + l * d, d, xb.data());
    MatVec(w1_.data() + static_cast<int64_t>(l) * hid * d, xb.data(), hid, d, h1.data());
    MatVec(w3_.data() + static_cast<int64_t>(l) * hid * d, xb.data(), hid, d, h3.data());
    for (int i = 0; i < hid; ++i) h1[i] = h1[i] / (1.0f + std::exp(-h1[i])) * h3[i];  // SwiGLU
    MatVec(w2_.data() + static_cast<int64_t>(l) * d * hid, h1.data(), d, hid, tmp.data());
    for (int i = 0; i < d; ++i) x[i] += tmp[i];
  }
  RmsNorm(x.data(), rms_final_.data(), d, xb.data());
  logits->resize(static_cast<size_t>(c.vocab_size));
  MatVec(emb_.data(), xb.data(), c.vocab_size, d, logits->data());  // shared classifier
  return absl::OkStatus();
}

LocalAttention::LocalAttention(const Config& c)
    : c_(c), k_(static_cast<size_t>(c.n_layers)), v_(k_.size()), q_(k_.size()), r_(k_.size()) {}

absl::Status LocalAttention::operator()(int layer, int pos, const float* q, const float* k,
                                        const float* v, float* o) {
  const int hd = c_.head_dim(), kv = c_.kv_dim(), g = c_.n_heads / c_.n_kv_heads;
  if (static_cast<int64_t>(k_[layer].size()) != static_cast<int64_t>(pos) * kv) {
    return absl::FailedPreconditionError("local attention: positions must arrive in order");
  }
  k_[layer].insert(k_[layer].end(), k, k + kv);
  v_[layer].insert(v_[layer].end(), v, v + kv);
  q_[layer].insert(q_[layer].end(), q, q + c_.dim);
  const int n = pos + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> att(static_cast<size_t>(n));
  for (int h = 0; h < c_.n_heads; ++h) {
    const int kvh = h / g;
    float mx = -1e30f;
    for (int t = 0; t < n; ++t) {
      float s = 0;
      for (int i = 0; i < hd; ++i) s += q[h * hd + i] * k_[layer][t * kv + kvh * hd + i];
      att[t] = s * scale;
      mx = std::max(mx, att[t]);
    }
    float sum = 0;
    for (int t = 0; t < n; ++t) sum += (att[t] = std::exp(att[t] - mx));
    for (int i = 0; i < hd; ++i) {
      float acc = 0;
      for (int t = 0; t < n; ++t) acc += att[t] * v_[layer][t * kv + kvh * hd + i];
      o[h * hd + i] = acc / sum;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& path, int vocab_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open tokenizer '", path, "'"));
  int32_t max_len = 0;
  in.read(reinterpret_cast<char*>(&max_len), 4);
  Tokenizer t;
  for (int i = 0; i < vocab_size; ++i) {
    float score = 0;
    int32_t len = 0;
    in.read(reinterpret_cast<char*>(&score), 4);
    in.read(reinterpret_cast<char*>(&len), 4);
    if (!in || len < 0 || len > 1024) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad entry ", i));
    }
    std::string s(static_cast<size_t>(len), '\0');
    in.read(s.data(), len);
    t.vocab_.push_back(std::move(s));
    t.scores_.push_back(score);
  }
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": truncated"));
  return t;
}

std::vector<int> Tokenizer::Encode(const std::string& text) const {
  std::map<std::string, int> index;
  for (int i = 0; i < static_cast<int>(vocab_.size()); ++i) index.emplace(vocab_[i], i);
  std::vector<int> tokens = {1};  // BOS
  if (text.empty()) return tokens;
  std::vector<int> t;
  const std::string s = " " + text;  // dummy prefix
  for (size_t i = 0; i < s.size();) {
    size_t len = 1;  // one UTF-8 code point
    while (i + len < s.size() && (static_cast<unsigned char>(s[i + len]) & 0xC0) == 0x80) ++len;
    auto it = index.find(s.substr(i, len));
    if (it != index.end()) {
      t.push_back(it->second);
    } else {
      for (size_t b = 0; b < len; ++b) t.push_back(static_cast<unsigned char>(s[i + b]) + 3);
    }
    i += len;
  }
  for (;;) {  // merge the best-scoring adjacent pair
    float best = -1e10f;
    int best_id = -1, best_at = -1;
    for (size_t i = 0; i + 1 < t.size(); ++i) {
      auto it = index.find(vocab_[t[i]] + vocab_[t[i + 1]]);
      if (it != index.end() && scores_[it->second] > best) {
        best = scores_[it->second];
        best_id = it->second;
        best_at = static_cast<int>(i);
      }
    }
    if (best_at < 0) break;
    t[best_at] = best_id;
    t.erase(t.begin() + best_at + 1);
  }
  tokens.insert(tokens.end(), t.begin(), t.end());
  return tokens;
}

std::string Tokenizer::Piece(int prev, int token) const {
  std::string p = vocab_[token];
  if (prev == 1 && !p.empty() && p[0] == ' ') p.erase(0, 1);
  unsigned byte = 0;
  if (p.size() == 6 && std::sscanf(p.c_str(), "<0x%02X>", &byte) == 1)
    return std::string(1, static_cast<char>(byte));
  return p;
}

}  // namespace kvcd::llama2
