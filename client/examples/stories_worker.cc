#include "client/examples/stories_worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/rotation.h"
#include "common/safetensors.h"
#include "common/synthetic_activations.h"
#include "common/tensor_ref.h"

namespace kvcd::llama2 {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<double> Softmax(const std::vector<float>& x) {
  const double mx = *std::max_element(x.begin(), x.end());
  std::vector<double> p(x.size());
  double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) sum += (p[i] = std::exp(x[i] - mx));
  for (auto& v : p) v /= sum;
  return p;
}

}  // namespace

int Argmax(const std::vector<float>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

double KlDivergence(const std::vector<float>& p_logits, const std::vector<float>& q_logits) {
  const auto p = Softmax(p_logits), q = Softmax(q_logits);
  double kl = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] > 0) kl += p[i] * (std::log(p[i]) - std::log(std::max(q[i], 1e-300)));
  }
  return kl;
}

absl::StatusOr<RunResult> RunReference(Model& model, const Tokenizer& tok,
                                       const std::vector<int>& prompt, int steps,
                                       LocalAttention* calibration) {
  LocalAttention local(model.config());
  LocalAttention& attn = calibration != nullptr ? *calibration : local;
  RunResult r;
  int token = prompt[0];
  r.text = "";
  const double t0 = Now();
  for (int pos = 0; pos < steps; ++pos) {
    std::vector<float> logits;
    absl::Status s =
        model.Forward(token, pos, std::ref(attn), &logits,
                      [&attn](int layer, int, const float* x) { attn.AddResidual(layer, x); });
    if (!s.ok()) return s;
    const int next = pos + 1 < static_cast<int>(prompt.size()) ? prompt[pos + 1] : Argmax(logits);
    r.text += tok.Piece(token, next);
    r.logits.push_back(std::move(logits));
    r.tokens.push_back(next);
    token = next;
  }
  r.seconds = Now() - t0;
  return r;
}

absl::Status RegisterProfile(Client& client, const Config& c, const std::string& name,
                             const std::string& format, const std::string& codec_blob) {
  v1::ModelProfile p;
  p.set_name(name);
  p.set_num_layers(c.n_layers);
  p.set_num_q_heads(c.n_heads);
  p.set_num_kv_heads(c.n_kv_heads);
  p.set_head_dim(c.head_dim());
  // Small windows so that a 100-token run has INT2 history: page 4, sink 4, recent 8.
  p.set_page_size(4);
  p.set_sink_tokens(4);
  p.set_recent_tokens(8);
  p.mutable_rope()->set_theta(10000);
  p.set_memory_bytes(4 << 20);
  p.set_bf16_fraction(0.5);
  if (format == "bf16") {
    p.set_history_format(v1::HISTORY_FORMAT_BF16);
  } else {
    p.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
    if (format == "int2-identity") p.set_codec("identity");
    if (format == "int2-hadamard") p.set_codec("hadamard");
  }
  auto r = client.RegisterModel(p, format == "int2-oscar" ? codec_blob : "");
  return r.status();
}

absl::StatusOr<RunResult> RunServed(Client& client, Model& model, const Tokenizer& tok,
                                    const std::string& name, const std::vector<int>& prompt,
                                    int steps, const std::vector<int>* teacher) {
  const Config& c = model.config();
  const int kv = c.kv_dim(), hd = c.head_dim();
  const int prefill = static_cast<int>(prompt.size()) - 1;
  // Prefill worker: K/V of prompt[0 .. prefill) computed locally, Put.
  LocalAttention pre(c);
  for (int pos = 0; pos < prefill; ++pos) {
    std::vector<float> logits;
    absl::Status s = model.Forward(prompt[pos], pos, std::ref(pre), &logits);
    if (!s.ok()) return s;
  }
  const std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + prefill);
  auto kv_tensor = [&](bool values, int begin, int n, v1::TensorRef* out) {
    std::vector<float> buf(static_cast<size_t>(c.n_layers) * n * kv);
    for (int l = 0; l < c.n_layers; ++l) {
      const auto& src = values ? pre.values(l) : pre.keys(l);
      std::copy(src.begin() + static_cast<int64_t>(begin) * kv,
                src.begin() + static_cast<int64_t>(begin + n) * kv,
                buf.begin() + static_cast<int64_t>(l) * n * kv);
    }
    SetF32Tensor(out, {c.n_layers, n, c.n_kv_heads, hd}, buf.data());
  };
  if (prefill > 0) {
    v1::PutRequest put;
    put.set_model(name);
    put.mutable_tokens()->Add(prefix.begin(), prefix.end());
    kv_tensor(false, 0, prefill, put.mutable_k());
    kv_tensor(true, 0, prefill, put.mutable_v());
    auto r = client.Put(put);
    if (!r.ok()) return r.status();
  }
  auto open = client.OpenSequence(name, "", prefix);
  if (!open.ok()) return open.status();
  const uint64_t seq = open->sequence_id();
  const int matched = static_cast<int>(open->matched_tokens());
  if (matched < prefill) {
    v1::AppendRequest app;
    app.set_sequence_id(seq);
    app.mutable_tokens()->Add(prefix.begin() + matched, prefix.end());
    kv_tensor(false, matched, prefill - matched, app.mutable_k());
    kv_tensor(true, matched, prefill - matched, app.mutable_v());
    auto len = client.Append(app);
    if (!len.ok()) return len.status();
  }
  auto stream = client.OpenDecodeStream();
  if (!stream.ok()) return stream.status();
  RunResult r;
  int token = prompt[prefill];
  int current = token;
  auto attend = [&](int layer, int pos, const float* q, const float* k, const float* v,
                    float* o) -> absl::Status {
    v1::AttentionDecodeRequest req;
    req.set_layer(layer);
    req.add_sequence_ids(seq);
    req.set_request_id(static_cast<uint64_t>(pos) * 1000 + layer);
    SetF32Tensor(req.mutable_q(), {1, c.n_heads, hd}, q);
    SetF32Tensor(req.mutable_k_new(), {1, c.n_kv_heads, hd}, k);
    SetF32Tensor(req.mutable_v_new(), {1, c.n_kv_heads, hd}, v);
    req.add_new_tokens(current);
    auto resp = (*stream)->Call(req);
    if (!resp.ok()) return resp.status();
    CopyAsFloat(resp->o(), 0, c.dim, o);
    return absl::OkStatus();
  };
  for (int pos = 0; pos < prefill; ++pos) r.text += tok.Piece(prompt[pos], prompt[pos + 1]);
  const double t0 = Now();
  for (int pos = prefill; pos < steps; ++pos) {
    current = token;
    std::vector<float> logits;
    absl::Status s = model.Forward(token, pos, attend, &logits);
    if (!s.ok()) return s;
    int next = Argmax(logits);
    if (pos + 1 < static_cast<int>(prompt.size())) next = prompt[pos + 1];
    if (teacher != nullptr && pos < static_cast<int>(teacher->size())) next = (*teacher)[pos];
    r.text += tok.Piece(token, next);
    r.logits.push_back(std::move(logits));
    r.tokens.push_back(next);
    token = next;
  }
  r.seconds = Now() - t0;
  absl::Status closed = (*stream)->Close();
  if (!closed.ok()) return closed;
  auto len = client.CloseSequence(seq);
  if (!len.ok()) return len.status();
  return r;
}

std::string CalibrateCodec(const Config& c, const std::vector<const LocalAttention*>& runs) {
  const int hd = c.head_dim();
  SafetensorsWriter w;
  for (int l = 0; l < c.n_layers; ++l) {
    LayerActivations a;
    int64_t n = 0;
    for (const LocalAttention* run : runs) {
      a.q.insert(a.q.end(), run->queries(l).begin(), run->queries(l).end());
      a.k.insert(a.k.end(), run->keys(l).begin(), run->keys(l).end());
      a.v.insert(a.v.end(), run->values(l).begin(), run->values(l).end());
      n += static_cast<int64_t>(run->keys(l).size()) / c.kv_dim();
    }
    w.AddF32(absl::StrCat("layers.", l, ".r_k"), {hd, hd},
             OscarRotation(KeyCovariance(a, n, c.n_heads, c.n_kv_heads, hd), hd));
    w.AddF32(absl::StrCat("layers.", l, ".r_v"), {hd, hd},
             OscarRotation(ValueCovariance(a, n, c.n_heads, c.n_kv_heads, hd), hd));
  }
  w.SetMetadata("kvcd.codec", "int2-oscar");
  w.SetMetadata("kvcd.calibration", "stories worker activations");
  return w.Serialize();
}

}  // namespace kvcd::llama2
