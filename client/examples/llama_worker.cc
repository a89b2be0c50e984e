#include "client/examples/llama_worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/tensor_ref.h"

namespace kvcd::llama {
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

absl::Status CheckPrompt(const Model& model, const std::vector<int>& prompt, int steps) {
  if (prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  const int64_t total = static_cast<int64_t>(prompt.size()) + steps;
  if (steps < 0 || total > model.config().max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", prompt.size(), " tokens + ", steps,
                                                   " steps exceeds the model's context of ",
                                                   model.config().max_seq_len));
  }
  return absl::OkStatus();
}

// The decode loop shared by both paths: step i feeds `token` at position prompt-1+i.
absl::StatusOr<Generation> Decode(const Model& model, const Model::AttentionFn& attend,
                                  int first_pos, int first_token, int max_new, int stop,
                                  const std::vector<int>* teacher, int* current) {
  Generation g;
  int token = first_token;
  const int steps = teacher != nullptr ? static_cast<int>(teacher->size()) : max_new;
  const double t0 = Now();
  for (int i = 0; i < steps; ++i) {
    *current = token;
    std::vector<float> logits;
    absl::Status s = model.Forward(token, first_pos + i, attend, &logits);
    if (!s.ok()) return s;
    const int next = teacher != nullptr ? (*teacher)[i] : Argmax(logits);
    g.logits.push_back(std::move(logits));
    g.tokens.push_back(next);
    token = next;
    if (teacher == nullptr && next == stop) break;
  }
  g.seconds = Now() - t0;
  return g;
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

absl::StatusOr<Generation> RunReference(const Model& model, const std::vector<int>& prompt,
                                        int max_new, int stop, LocalAttention* record) {
  if (auto s = CheckPrompt(model, prompt, max_new); !s.ok()) return s;
  LocalAttention local(model.config());
  LocalAttention& attn = record != nullptr ? *record : local;
  if (attn.tokens() != 0) {
    return absl::FailedPreconditionError("RunReference needs an empty recorder");
  }
  const int prefill = static_cast<int>(prompt.size()) - 1;
  for (int pos = 0; pos < prefill; ++pos) {
    std::vector<float> logits;
    absl::Status s = model.Forward(prompt[pos], pos, std::ref(attn), &logits);
    if (!s.ok()) return s;
  }
  int current = 0;
  return Decode(model, std::ref(attn), prefill, prompt.back(), max_new, stop, nullptr, &current);
}

absl::Status RegisterProfile(Client& client, const Config& c, const ServedProfile& sp) {
  v1::ModelProfile p;
  p.set_name(sp.name);
  p.set_num_layers(c.n_layers);
  p.set_num_q_heads(c.n_heads);
  p.set_num_kv_heads(c.n_kv_heads);
  p.set_head_dim(c.head_dim);
  p.set_page_size(sp.page_size);
  p.set_sink_tokens(sp.sink_tokens);
  p.set_recent_tokens(sp.recent_tokens);
  p.mutable_rope()->set_theta(c.rope_theta);
  p.set_memory_bytes(sp.memory_bytes);
  p.set_bf16_fraction(0.5);
  if (sp.history == "bf16") {
    p.set_history_format(v1::HISTORY_FORMAT_BF16);
  } else if (sp.history == "int2-identity" || sp.history == "int2-hadamard") {
    p.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
    p.set_codec(sp.history == "int2-identity" ? "identity" : "hadamard");
  } else if (sp.history == "int2-oscar" && !sp.codec_blob.empty()) {
    p.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "history '", sp.history,
        "': expected bf16, int2-identity, int2-hadamard or int2-oscar with a codec file"));
  }
  return client.RegisterModel(p, sp.history == "int2-oscar" ? sp.codec_blob : "").status();
}

absl::StatusOr<Generation> RunServed(Client& client, const Model& model, const std::string& name,
                                     const std::vector<int>& prompt, int max_new, int stop,
                                     const std::vector<int>* teacher) {
  const int steps = teacher != nullptr ? static_cast<int>(teacher->size()) : max_new;
  if (auto s = CheckPrompt(model, prompt, steps); !s.ok()) return s;
  const Config& c = model.config();
  const int kv = c.kv_dim(), hd = c.head_dim;
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
  int current = 0;
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
    CopyAsFloat(resp->o(), 0, c.q_dim(), o);
    return absl::OkStatus();
  };
  auto g = Decode(model, attend, prefill, prompt.back(), max_new, stop, teacher, &current);
  absl::Status closed = (*stream)->Close();
  auto len = client.CloseSequence(seq);
  if (!g.ok()) return g.status();
  if (!closed.ok()) return closed;
  if (!len.ok()) return len.status();
  return g;
}

}  // namespace kvcd::llama
