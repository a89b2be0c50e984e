#include "examples/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "examples/llama_matmul.h"

namespace kvcd::llama {
namespace {

void RmsNorm(const float* x, const float* w, int n, double eps, float* out) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

absl::StatusOr<int> IntMeta(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata().find("kvcd." + key);
  int v = 0;
  if (it == f.metadata().end() || !absl::SimpleAtoi(it->second, &v) || v <= 0 || v > (1 << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model metadata kvcd.", key, ": expected a positive integer, got '",
                     it == f.metadata().end() ? "<missing>" : it->second, "'"));
  }
  return v;
}

absl::StatusOr<double> DoubleMeta(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata().find("kvcd." + key);
  double v = 0;
  if (it == f.metadata().end() || !absl::SimpleAtod(it->second, &v) || !(v > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model metadata kvcd.", key, ": expected a positive number, got '",
                     it == f.metadata().end() ? "<missing>" : it->second, "'"));
  }
  return v;
}

absl::StatusOr<bool> FlagMeta(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata().find("kvcd." + key);
  if (it == f.metadata().end() || (it->second != "0" && it->second != "1")) {
    return absl::InvalidArgumentError(
        absl::StrCat("model metadata kvcd.", key, ": expected \"0\" or \"1\", got '",
                     it == f.metadata().end() ? "<missing>" : it->second, "'"));
  }
  return it->second == "1";
}

}  // namespace

void ApplyRope(float* x, int n_heads, int head_dim, int pos, double theta, RopePairing pairing) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = pos * std::pow(theta, -2.0 * i / head_dim);
    const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    const int a = pairing == RopePairing::kHalf ? i : 2 * i;
    const int b = pairing == RopePairing::kHalf ? i + half : 2 * i + 1;
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + static_cast<int64_t>(h) * head_dim;
      const float x0 = v[a], x1 = v[b];
      v[a] = x0 * c - x1 * s;
      v[b] = x0 * s + x1 * c;
    }
  }
}

absl::StatusOr<Model> Model::Load(const std::string& path) {
  auto f = SafetensorsFile::Load(path);
  if (!f.ok()) return f.status();
  return FromSafetensors(*f);
}

absl::StatusOr<Model> Model::FromSafetensors(const SafetensorsFile& f) {
  auto kind = f.metadata().find("kvcd.model");
  if (kind == f.metadata().end() || kind->second != "llama") {
    return absl::InvalidArgumentError(
        "model metadata kvcd.model: expected \"llama\" (a file written by "
        "tools/gguf_to_safetensors.py)");
  }
  Model m;
  Config& c = m.c_;
  KVCD_ASSIGN_OR_RETURN(c.dim, IntMeta(f, "dim"));
  KVCD_ASSIGN_OR_RETURN(c.hidden_dim, IntMeta(f, "hidden_dim"));
  KVCD_ASSIGN_OR_RETURN(c.n_layers, IntMeta(f, "n_layers"));
  KVCD_ASSIGN_OR_RETURN(c.n_heads, IntMeta(f, "n_heads"));
  KVCD_ASSIGN_OR_RETURN(c.n_kv_heads, IntMeta(f, "n_kv_heads"));
  KVCD_ASSIGN_OR_RETURN(c.head_dim, IntMeta(f, "head_dim"));
  KVCD_ASSIGN_OR_RETURN(c.vocab_size, IntMeta(f, "vocab_size"));
  KVCD_ASSIGN_OR_RETURN(c.max_seq_len, IntMeta(f, "max_seq_len"));
  KVCD_ASSIGN_OR_RETURN(c.rope_theta, DoubleMeta(f, "rope_theta"));
  KVCD_ASSIGN_OR_RETURN(c.rms_eps, DoubleMeta(f, "rms_eps"));
  KVCD_ASSIGN_OR_RETURN(c.tied_embeddings, FlagMeta(f, "tied_embeddings"));
  KVCD_ASSIGN_OR_RETURN(c.qk_norm, FlagMeta(f, "qk_norm"));
  auto pairing = f.metadata().find("kvcd.rope_pairing");
  if (pairing != f.metadata().end() && pairing->second == "half") {
    c.pairing = RopePairing::kHalf;
  } else if (pairing != f.metadata().end() && pairing->second == "interleaved") {
    c.pairing = RopePairing::kInterleaved;
  } else {
    return absl::InvalidArgumentError(
        "model metadata kvcd.rope_pairing: expected \"half\" or \"interleaved\"");
  }
  if (c.head_dim % 2 != 0 || c.n_heads % c.n_kv_heads != 0 || c.n_layers > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model geometry: expected an even head_dim, n_heads a multiple of n_kv_heads and at "
        "most 1024 layers; got head_dim ",
        c.head_dim, ", ", c.n_heads, " / ", c.n_kv_heads, " heads, ", c.n_layers, " layers"));
  }
  const int64_t d = c.dim, qd = c.q_dim(), kv = c.kv_dim(), hid = c.hidden_dim, hd = c.head_dim;
  auto read = [&](const std::string& name, std::vector<int64_t> shape,
                  std::vector<float>* out) -> absl::Status {
    auto v = f.ReadFloats(name, shape);
    if (!v.ok()) return v.status();
    *out = std::move(*v);
    return absl::OkStatus();
  };
  KVCD_RETURN_IF_ERROR(
      read("model.embed_tokens.weight", (std::vector<int64_t>{c.vocab_size, d}), &m.embed_));
  KVCD_RETURN_IF_ERROR(read("model.norm.weight", {d}, &m.final_norm_));
  if (!c.tied_embeddings) {
    KVCD_RETURN_IF_ERROR(
        read("lm_head.weight", (std::vector<int64_t>{c.vocab_size, d}), &m.lm_head_));
  }
  m.layers_.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    Layer& L = m.layers_[l];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    KVCD_RETURN_IF_ERROR(read(p + "input_layernorm.weight", {d}, &L.attn_norm));
    KVCD_RETURN_IF_ERROR(read(p + "self_attn.q_proj.weight", (std::vector<int64_t>{qd, d}), &L.wq));
    KVCD_RETURN_IF_ERROR(read(p + "self_attn.k_proj.weight", (std::vector<int64_t>{kv, d}), &L.wk));
    KVCD_RETURN_IF_ERROR(read(p + "self_attn.v_proj.weight", (std::vector<int64_t>{kv, d}), &L.wv));
    KVCD_RETURN_IF_ERROR(read(p + "self_attn.o_proj.weight", (std::vector<int64_t>{d, qd}), &L.wo));
    if (c.qk_norm) {
      KVCD_RETURN_IF_ERROR(read(p + "self_attn.q_norm.weight", {hd}, &L.q_norm));
      KVCD_RETURN_IF_ERROR(read(p + "self_attn.k_norm.weight", {hd}, &L.k_norm));
    }
    KVCD_RETURN_IF_ERROR(read(p + "post_attention_layernorm.weight", {d}, &L.ffn_norm));
    KVCD_RETURN_IF_ERROR(
        read(p + "mlp.gate_proj.weight", (std::vector<int64_t>{hid, d}), &L.w_gate));
    KVCD_RETURN_IF_ERROR(read(p + "mlp.up_proj.weight", (std::vector<int64_t>{hid, d}), &L.w_up));
    KVCD_RETURN_IF_ERROR(
        read(p + "mlp.down_proj.weight", (std::vector<int64_t>{d, hid}), &L.w_down));
  }
  return m;
}

absl::StatusOr<Model> Model::LoadLlama2c(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open checkpoint '", path, "'"));
  int32_t h[7];
  in.read(reinterpret_cast<char*>(h), sizeof(h));
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": shorter than its header"));
  Model m;
  Config& c = m.c_;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.vocab_size = h[5] == INT32_MIN ? 0 : std::abs(h[5]);
  c.max_seq_len = h[6];
  c.rope_theta = 10000;
  c.rms_eps = 1e-5;
  c.pairing = RopePairing::kInterleaved;  // llama2.c rotates lanes (2i, 2i + 1)
  c.tied_embeddings = h[5] > 0;
  c.qk_norm = false;
  if (c.dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || c.vocab_size <= 0 ||
      c.vocab_size > (1 << 24) || c.hidden_dim <= 0 || c.hidden_dim > (1 << 20) ||
      c.max_seq_len <= 0 || c.max_seq_len > (1 << 24) || c.dim > 65536 || c.n_layers > 1024 ||
      (c.dim / c.n_heads) % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": implausible llama2.c header (dim ", h[0], ", hidden ", h[1], ", layers ", h[2],
        ", heads ", h[3], "/", h[4], ", vocab ", h[5], ", seq_len ", h[6], ")"));
  }
  c.head_dim = c.dim / c.n_heads;
  const int64_t L = c.n_layers, d = c.dim, kv = c.kv_dim(), hid = c.hidden_dim;
  auto read = [&](int64_t n, std::vector<float>* v) {
    v->resize(static_cast<size_t>(n));
    in.read(reinterpret_cast<char*>(v->data()), static_cast<std::streamsize>(n * 4));
    return static_cast<bool>(in);
  };
  // The file stacks each kind over the layers; split it into per-layer tensors.
  std::vector<float> rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, freqs;
  if (!read(c.vocab_size * d, &m.embed_) || !read(L * d, &rms_att) || !read(L * d * d, &wq) ||
      !read(L * kv * d, &wk) || !read(L * kv * d, &wv) || !read(L * d * d, &wo) ||
      !read(L * d, &rms_ffn) || !read(L * hid * d, &w1) || !read(L * d * hid, &w2) ||
      !read(L * hid * d, &w3) || !read(d, &m.final_norm_) ||
      // Precomputed RoPE tables (freq_cis_real, freq_cis_imag [seq_len][head_dim / 2]):
      // unused, ApplyRope computes the same angles.
      !read(int64_t{c.max_seq_len} * c.head_dim, &freqs) ||
      (!c.tied_embeddings && !read(c.vocab_size * d, &m.lm_head_))) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated weights"));
  }
  auto slice = [](const std::vector<float>& all, int64_t l, int64_t n) {
    return std::vector<float>(all.begin() + l * n, all.begin() + (l + 1) * n);
  };
  m.layers_.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    Layer& y = m.layers_[l];
    y.attn_norm = slice(rms_att, l, d);
    y.wq = slice(wq, l, d * d);
    y.wk = slice(wk, l, kv * d);
    y.wv = slice(wv, l, kv * d);
    y.wo = slice(wo, l, d * d);
    y.ffn_norm = slice(rms_ffn, l, d);
    y.w_gate = slice(w1, l, hid * d);  // llama2.c w1: gate, w3: up, w2: down
    y.w_up = slice(w3, l, hid * d);
    y.w_down = slice(w2, l, d * hid);
  }
  return m;
}

absl::Status Model::Forward(int token, int pos, const AttentionFn& attend,
                            std::vector<float>* logits) const {
  const Step step{token, pos, &attend, logits};
  return Forward(absl::MakeConstSpan(&step, 1));
}

absl::Status Model::ForwardTokens(absl::Span<const int> tokens, int first_pos,
                                  const AttentionFn& attend,
                                  std::vector<float>* last_logits) const {
  std::vector<Step> steps;
  for (size_t begin = 0; begin < tokens.size(); begin += kSpan) {
    const size_t end = std::min(tokens.size(), begin + kSpan);
    steps.clear();
    for (size_t i = begin; i < end; ++i) {
      steps.push_back({tokens[i], first_pos + static_cast<int>(i), &attend,
                       i + 1 == tokens.size() ? last_logits : nullptr});
    }
    KVCD_RETURN_IF_ERROR(Forward(steps));
  }
  return absl::OkStatus();
}

absl::Status Model::Forward(absl::Span<const Step> steps) const {
  const Config& c = c_;
  const int d = c.dim, qd = c.q_dim(), kv = c.kv_dim(), hid = c.hidden_dim, hd = c.head_dim;
  for (const Step& st : steps) {
    if (st.token < 0 || st.token >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", st.token, " out of range [0, ", c.vocab_size, ")"));
    }
    if (st.pos < 0 || st.pos >= c.max_seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("position ", st.pos, " out of range [0, ", c.max_seq_len, ")"));
    }
  }
  const int n = static_cast<int>(steps.size());
  // Row t of each buffer is step t's vector.
  std::vector<float> x(static_cast<size_t>(n) * d), xb(x.size()), tmp(x.size());
  std::vector<float> q(static_cast<size_t>(n) * qd), o(q.size());
  std::vector<float> k(static_cast<size_t>(n) * kv), v(k.size());
  std::vector<float> gate(static_cast<size_t>(n) * hid), up(gate.size());
  for (int t = 0; t < n; ++t) {
    std::copy(embed_.begin() + static_cast<int64_t>(steps[t].token) * d,
              embed_.begin() + static_cast<int64_t>(steps[t].token + 1) * d,
              x.begin() + static_cast<int64_t>(t) * d);
  }
  auto row = [](std::vector<float>& m, int t, int width) {
    return m.data() + static_cast<int64_t>(t) * width;
  };
  for (int l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
    for (int t = 0; t < n; ++t) {
      RmsNorm(row(x, t, d), L.attn_norm.data(), d, c.rms_eps, row(xb, t, d));
    }
    MatMul(L.wq.data(), xb.data(), n, qd, d, q.data());
    MatMul(L.wk.data(), xb.data(), n, kv, d, k.data());
    MatMul(L.wv.data(), xb.data(), n, kv, d, v.data());
    for (int t = 0; t < n; ++t) {
      float* qt = row(q, t, qd);
      float* kt = row(k, t, kv);
      if (c.qk_norm) {
        for (int h = 0; h < c.n_heads; ++h) {
          RmsNorm(qt + h * hd, L.q_norm.data(), hd, c.rms_eps, qt + h * hd);
        }
        for (int h = 0; h < c.n_kv_heads; ++h) {
          RmsNorm(kt + h * hd, L.k_norm.data(), hd, c.rms_eps, kt + h * hd);
        }
      }
      ApplyRope(qt, c.n_heads, hd, steps[t].pos, c.rope_theta, c.pairing);
      ApplyRope(kt, c.n_kv_heads, hd, steps[t].pos, c.rope_theta, c.pairing);
    }
    for (int t = 0; t < n; ++t) {
      absl::Status s = (*steps[t].attend)(l, steps[t].pos, row(xb, t, d), row(q, t, qd),
                                          row(k, t, kv), row(v, t, kv), row(o, t, qd));
      if (!s.ok()) return s;
    }
    MatMul(L.wo.data(), o.data(), n, d, qd, tmp.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];
    for (int t = 0; t < n; ++t) {
      RmsNorm(row(x, t, d), L.ffn_norm.data(), d, c.rms_eps, row(xb, t, d));
    }
    MatMul(L.w_gate.data(), xb.data(), n, hid, d, gate.data());
    MatMul(L.w_up.data(), xb.data(), n, hid, d, up.data());
    for (size_t i = 0; i < gate.size(); ++i)
      gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];  // SwiGLU
    MatMul(L.w_down.data(), gate.data(), n, d, hid, tmp.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];
  }
  // The classifier for the steps that want logits only (the final norm's rows gathered).
  std::vector<int> wanted;
  for (int t = 0; t < n; ++t) {
    if (steps[t].logits != nullptr) wanted.push_back(t);
  }
  if (wanted.empty()) return absl::OkStatus();
  const int m = static_cast<int>(wanted.size());
  std::vector<float> normed(static_cast<size_t>(m) * d);
  for (int i = 0; i < m; ++i) {
    RmsNorm(row(x, wanted[i], d), final_norm_.data(), d, c.rms_eps, row(normed, i, d));
  }
  std::vector<float> all(static_cast<size_t>(m) * c.vocab_size);
  const std::vector<float>& head = c.tied_embeddings ? embed_ : lm_head_;
  MatMul(head.data(), normed.data(), m, c.vocab_size, d, all.data());
  for (int i = 0; i < m; ++i) {
    steps[wanted[i]].logits->assign(all.begin() + static_cast<int64_t>(i) * c.vocab_size,
                                    all.begin() + static_cast<int64_t>(i + 1) * c.vocab_size);
  }
  return absl::OkStatus();
}

LocalAttention::LocalAttention(const Config& c)
    : c_(c), k_(static_cast<size_t>(c.n_layers)), v_(k_.size()), q_(k_.size()), x_(k_.size()) {}

absl::Status LocalAttention::operator()(int layer, int pos, const float* x, const float* q,
                                        const float* k, const float* v, float* o) {
  const int hd = c_.head_dim, kv = c_.kv_dim(), g = c_.n_heads / c_.n_kv_heads;
  if (layer < 0 || layer >= c_.n_layers ||
      static_cast<int64_t>(k_[layer].size()) != static_cast<int64_t>(pos) * kv) {
    return absl::FailedPreconditionError(
        absl::StrCat("local attention: layer ", layer, " position ", pos, " arrived out of order"));
  }
  k_[layer].insert(k_[layer].end(), k, k + kv);
  v_[layer].insert(v_[layer].end(), v, v + kv);
  q_[layer].insert(q_[layer].end(), q, q + c_.q_dim());
  x_[layer].insert(x_[layer].end(), x, x + c_.dim);
  const int n = pos + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* keys = k_[layer].data();
  const float* values = v_[layer].data();
  std::vector<float> att(static_cast<size_t>(n));
  // Each score sums its products in order of i, and each output lane its positions in order
  // of t, as one loop per score and per position would; the loops are arranged so that the
  // CPU has independent sums to overlap (eight positions' scores at once, four lanes of the
  // output at once, in vectors of four that every x86-64 CPU has) without changing any sum's
  // order.
  typedef float Lanes4 __attribute__((vector_size(16)));
  typedef float Lanes4Unaligned __attribute__((vector_size(16), aligned(4), may_alias));
  for (int h = 0; h < c_.n_heads; ++h) {
    const int kvh = h / g;  // grouped-query attention: g query heads share a KV head
    const float* qh = q + h * hd;
    int t = 0;
    for (; t + 8 <= n; t += 8) {
      Lanes4 s0 = {0, 0, 0, 0}, s1 = {0, 0, 0, 0};
      const float* kr = keys + static_cast<int64_t>(t) * kv + kvh * hd;
      for (int i = 0; i < hd; ++i) {
        const float* k0 = kr + i;
        const Lanes4 a = {k0[0], k0[kv], k0[2 * kv], k0[3 * kv]};
        const Lanes4 b = {k0[4 * kv], k0[5 * kv], k0[6 * kv], k0[7 * kv]};
        s0 += qh[i] * a;
        s1 += qh[i] * b;
      }
      for (int j = 0; j < 4; ++j) {
        att[t + j] = s0[j] * scale;
        att[t + 4 + j] = s1[j] * scale;
      }
    }
    for (; t < n; ++t) {
      float s = 0;
      const float* kr = keys + static_cast<int64_t>(t) * kv + kvh * hd;
      for (int i = 0; i < hd; ++i) s += qh[i] * kr[i];
      att[t] = s * scale;
    }
    float mx = -1e30f;
    for (int u = 0; u < n; ++u) mx = std::max(mx, att[u]);
    float sum = 0;
    for (int u = 0; u < n; ++u) sum += (att[u] = std::exp(att[u] - mx));
    for (int u = 0; u < n; ++u) att[u] /= sum;  // the weights
    float* out = o + h * hd;
    const float* vh = values + kvh * hd;
    const int body = hd / 8 * 8;
    for (int i = 0; i < body; i += 8) {
      Lanes4 a0 = {0, 0, 0, 0}, a1 = {0, 0, 0, 0};
      for (int u = 0; u < n; ++u) {
        const float* vr = vh + static_cast<int64_t>(u) * kv + i;
        a0 += att[u] * *reinterpret_cast<const Lanes4Unaligned*>(vr);
        a1 += att[u] * *reinterpret_cast<const Lanes4Unaligned*>(vr + 4);
      }
      std::memcpy(out + i, &a0, sizeof(a0));
      std::memcpy(out + i + 4, &a1, sizeof(a1));
    }
    for (int i = body; i < hd; ++i) {
      float acc = 0;
      for (int u = 0; u < n; ++u) acc += att[u] * vh[static_cast<int64_t>(u) * kv + i];
      out[i] = acc;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcd::llama
