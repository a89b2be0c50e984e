#include "examples/llama_worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/key_transform_profile.h"
#include "common/layer_activations.h"
#include "common/rotation.h"
#include "common/status_macros.h"
#include "kvcd/kernels/int2_codec.h"
#include "proto/tensor_ref.h"
#include "tools/int2_layer.h"
#include "tools/transform_calibration.h"

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
  // Positions fed: the prompt's but its last token's (prefill), then one per step.
  const int64_t total = static_cast<int64_t>(prompt.size()) - 1 + steps;
  if (steps < 0 || total > model.config().max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", prompt.size(), " tokens + ", steps,
                                                   " steps exceeds the model's context of ",
                                                   model.config().max_seq_len, " positions"));
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

void RecordedRows(const Config& c, const LocalAttention& rec, Recorded what, int begin, int n,
                  v1::TensorRef* out) {
  const int w = what == Recorded::kResiduals ? c.dim : c.kv_dim();
  std::vector<float> buf(static_cast<size_t>(c.n_layers) * n * w);
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& src = what == Recorded::kKeys     ? rec.keys(l)
                      : what == Recorded::kValues ? rec.values(l)
                                                  : rec.residuals(l);
    std::copy(src.begin() + static_cast<int64_t>(begin) * w,
              src.begin() + static_cast<int64_t>(begin + n) * w,
              buf.begin() + static_cast<int64_t>(l) * n * w);
  }
  if (what == Recorded::kResiduals) {
    SetF32Tensor(out, {c.n_layers, n, c.dim}, buf.data());
  } else {
    SetF32Tensor(out, {c.n_layers, n, c.n_kv_heads, c.head_dim}, buf.data());
  }
}

absl::StatusOr<v1::PutResponse> PutRecorded(Client& client, const Config& c, const ServedProfile& p,
                                            const std::string& salt,
                                            absl::Span<const int32_t> tokens,
                                            const LocalAttention& recorded) {
  const int n = static_cast<int>(tokens.size());
  if (recorded.tokens() < n) {
    return absl::FailedPreconditionError(
        absl::StrCat("the recorder holds ", recorded.tokens(), " positions, the Put needs ", n));
  }
  v1::PutRequest put;
  put.set_model(p.name);
  put.set_cache_salt(salt);
  put.mutable_tokens()->Add(tokens.begin(), tokens.end());
  RecordedRows(c, recorded, Recorded::kKeys, 0, n, put.mutable_k());
  RecordedRows(c, recorded, Recorded::kValues, 0, n, put.mutable_v());
  if (p.history == "fsq") RecordedRows(c, recorded, Recorded::kResiduals, 0, n, put.mutable_x());
  return client.Put(put);
}

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
                                        int max_new, int stop, LocalAttention* record,
                                        const std::vector<int>* teacher) {
  const int steps = teacher != nullptr ? static_cast<int>(teacher->size()) : max_new;
  if (auto s = CheckPrompt(model, prompt, steps); !s.ok()) return s;
  LocalAttention local(model.config());
  LocalAttention& attn = record != nullptr ? *record : local;
  if (attn.tokens() != 0) {
    return absl::FailedPreconditionError("RunReference needs an empty recorder");
  }
  const int prefill = static_cast<int>(prompt.size()) - 1;
  const Model::AttentionFn attend = std::ref(attn);
  KVCD_RETURN_IF_ERROR(
      model.ForwardTokens(absl::MakeConstSpan(prompt.data(), prefill), 0, attend, nullptr));
  if (teacher == nullptr) {
    int current = 0;
    return Decode(model, attend, prefill, prompt.back(), max_new, stop, nullptr, &current);
  }
  // Teacher-forced: every step's token is known, so the steps run in spans too.
  Generation g;
  g.tokens = *teacher;
  g.logits.resize(teacher->size());
  const double t0 = Now();
  std::vector<Model::Step> span;
  for (int begin = 0; begin < steps; begin += Model::kSpan) {
    span.clear();
    for (int i = begin; i < std::min(steps, begin + Model::kSpan); ++i) {
      span.push_back({i == 0 ? prompt.back() : (*teacher)[i - 1], prefill + i, &attend,
                      &g.logits[static_cast<size_t>(i)]});
    }
    KVCD_RETURN_IF_ERROR(model.Forward(span));
  }
  g.seconds = Now() - t0;
  return g;
}

absl::StatusOr<v1::ModelInfo> RegisterProfile(Client& client, const Config& c,
                                              const ServedProfile& sp) {
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
  p.mutable_rope()->set_rotary_dims(c.head_dim);
  p.mutable_rope()->set_scaling(1.0);
  p.mutable_rope()->set_pairing(c.pairing == RopePairing::kHalf ? v1::ROPE_PAIRING_HALF
                                                                : v1::ROPE_PAIRING_INTERLEAVED);
  p.set_memory_bytes(sp.memory_bytes);
  p.set_bf16_fraction(0.5);
  std::string blob;
  if (sp.history == "bf16") {
    p.set_history_format(v1::HISTORY_FORMAT_BF16);
  } else if (sp.history == "int2-identity" || sp.history == "int2-hadamard") {
    p.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
    p.set_codec(sp.history == "int2-identity" ? "identity" : "hadamard");
  } else if (sp.history == "int2-oscar" && !sp.codec_blob.empty()) {
    p.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
    blob = sp.codec_blob;
  } else if (sp.history == "fsq" && !sp.codec_blob.empty()) {
    // G comes from the codec file; the daemon checks the rest of it against the profile.
    auto f = SafetensorsFile::Parse(sp.codec_blob);
    if (!f.ok()) return f.status();
    auto g = f->metadata().find("latent_width");
    int latent = 0;
    if (g == f->metadata().end() || !absl::SimpleAtoi(g->second, &latent) || latent <= 0) {
      return absl::InvalidArgumentError(
          "FSQ codec file: metadata latent_width missing or not a positive integer");
    }
    p.set_history_format(v1::HISTORY_FORMAT_FSQ);
    p.set_fsq_residual_width(c.dim);
    p.set_fsq_latent_width(latent);
    if (c.qk_norm) {
      p.set_key_norm(v1::KEY_NORM_RMS);
      p.set_key_norm_eps(static_cast<float>(c.rms_eps));
    }
    blob = sp.codec_blob;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "history '", sp.history,
        "': expected bf16, int2-identity, int2-hadamard, or int2-oscar / fsq with a codec file"));
  }
  return client.RegisterModel(p, blob);
}

absl::StatusOr<Generation> RunServed(Client& client, const Model& model, const ServedProfile& sp,
                                     const std::vector<int>& prompt, int max_new, int stop,
                                     const std::vector<int>* teacher,
                                     const LocalAttention* prefilled) {
  const int steps = teacher != nullptr ? static_cast<int>(teacher->size()) : max_new;
  if (auto s = CheckPrompt(model, prompt, steps); !s.ok()) return s;
  const Config& c = model.config();
  const std::string& name = sp.name;
  const bool fsq = sp.history == "fsq";
  const int hd = c.head_dim, dim = c.dim;
  const int prefill = static_cast<int>(prompt.size()) - 1;
  // Prefill worker: K/V (and residuals) of prompt[0 .. prefill) computed locally (or taken
  // from `prefilled`), Put.
  LocalAttention own(c);
  if (prefilled != nullptr && prefilled->tokens() < prefill) {
    return absl::FailedPreconditionError(absl::StrCat("prefilled recorder holds ",
                                                      prefilled->tokens(),
                                                      " positions, the prompt needs ", prefill));
  }
  if (prefilled == nullptr) {
    KVCD_RETURN_IF_ERROR(model.ForwardTokens(absl::MakeConstSpan(prompt.data(), prefill), 0,
                                             std::ref(own), nullptr));
  }
  const LocalAttention& pre = prefilled != nullptr ? *prefilled : own;
  const std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + prefill);
  if (prefill > 0) {
    auto r = PutRecorded(client, c, sp, "", prefix, pre);
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
    RecordedRows(c, pre, Recorded::kKeys, matched, prefill - matched, app.mutable_k());
    RecordedRows(c, pre, Recorded::kValues, matched, prefill - matched, app.mutable_v());
    if (fsq)
      RecordedRows(c, pre, Recorded::kResiduals, matched, prefill - matched, app.mutable_x());
    auto len = client.Append(app);
    if (!len.ok()) return len.status();
  }
  auto stream = client.OpenDecodeStream();
  if (!stream.ok()) return stream.status();
  int current = 0;
  auto attend = [&](int layer, int pos, const float* x, const float* q, const float* k,
                    const float* v, float* o) -> absl::Status {
    v1::AttentionDecodeRequest req;
    req.set_layer(layer);
    req.add_sequence_ids(seq);
    req.set_request_id(static_cast<uint64_t>(pos) * 1000 + layer);
    SetF32Tensor(req.mutable_q(), {1, c.n_heads, hd}, q);
    SetF32Tensor(req.mutable_k_new(), {1, c.n_kv_heads, hd}, k);
    SetF32Tensor(req.mutable_v_new(), {1, c.n_kv_heads, hd}, v);
    if (fsq) SetF32Tensor(req.mutable_x_new(), {1, dim}, x);
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

ActivationDump MakeActivationDump(const Config& c, const std::vector<const LocalAttention*>& runs,
                                  const std::string& source) {
  ActivationDump dump;
  dump.num_layers = c.n_layers;
  dump.num_q_heads = c.n_heads;
  dump.num_kv_heads = c.n_kv_heads;
  dump.head_dim = c.head_dim;
  dump.residual_width = c.dim;
  dump.source = source;
  for (const LocalAttention* run : runs) dump.tokens += run->tokens();
  for (int l = 0; l < c.n_layers; ++l) {
    LayerActivations a;
    std::vector<float> x;
    for (const LocalAttention* run : runs) {
      a.q.insert(a.q.end(), run->queries(l).begin(), run->queries(l).end());
      a.k.insert(a.k.end(), run->keys(l).begin(), run->keys(l).end());
      a.v.insert(a.v.end(), run->values(l).begin(), run->values(l).end());
      x.insert(x.end(), run->residuals(l).begin(), run->residuals(l).end());
    }
    dump.layers.push_back(std::move(a));
    dump.x.push_back(std::move(x));
  }
  return dump;
}

std::string CalibrateOscarCodec(const Config& c, const std::vector<const LocalAttention*>& runs) {
  const ActivationDump dump = MakeActivationDump(c, runs, "");
  const int hd = c.head_dim;
  SafetensorsWriter w;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerActivations& a = dump.layers[l];
    w.AddF32(absl::StrCat("layers.", l, ".r_k"), {hd, hd},
             OscarRotation(KeyCovariance(a, dump.tokens, c.n_heads, c.n_kv_heads, hd), hd));
    w.AddF32(absl::StrCat("layers.", l, ".r_v"), {hd, hd},
             OscarRotation(ValueCovariance(a, dump.tokens, c.n_heads, c.n_kv_heads, hd), hd));
  }
  w.SetMetadata("kvcd.codec", "int2-oscar");
  w.SetMetadata("kvcd.calibration", "llama worker activations");
  return w.Serialize();
}

SafetensorsWriter KvProjectionFile(const Model& model) {
  const Config& c = model.config();
  SafetensorsWriter w;
  for (int l = 0; l < c.n_layers; ++l) {
    w.AddF32(absl::StrCat("layers.", l, ".wk"), {c.kv_dim(), c.dim}, model.wk(l));
    w.AddF32(absl::StrCat("layers.", l, ".wv"), {c.kv_dim(), c.dim}, model.wv(l));
    if (c.qk_norm) w.AddF32(absl::StrCat("layers.", l, ".k_norm"), {c.head_dim}, model.k_norm(l));
  }
  return w;
}

absl::StatusOr<std::string> CalibrateTransformCodec(const Config& c,
                                                    const std::vector<const LocalAttention*>& runs,
                                                    int64_t first_row) {
  const ActivationDump dump = MakeActivationDump(c, runs, "");
  TransformCalibrationOptions opt;
  opt.first_row = first_row;
  auto cal = CalibrateTransforms(dump, opt);
  if (!cal.ok()) return cal.status();
  const int hd = c.head_dim;
  Int2Layer values;  // Hadamard INT2 values, default clips, shared by the KV heads
  values.r_k = values.r_v = HadamardMatrix(hd);
  values.rho_k = {kernels::kDefaultRhoK};
  values.rho_v = {kernels::kDefaultRhoV};
  const std::vector<KeyTransformProfile::Head> heads =
      KeyTransformHeads(*cal, std::vector<Int2Layer>(static_cast<size_t>(c.n_layers), values));
  return KeyTransformProfile::ToSafetensors(heads, c.n_layers, c.n_kv_heads, hd,
                                            absl::StrCat("llama worker activations, ", dump.tokens,
                                                         " tokens, rows from ", first_row))
      .Serialize();
}

absl::StatusOr<std::string> InitializeFsqCodec(const Model& model,
                                               const std::vector<const LocalAttention*>& runs,
                                               int latent_width,
                                               std::vector<FsqLayerReport>* reports) {
  const Config& c = model.config();
  const ActivationDump dump = MakeActivationDump(c, runs, "");
  std::vector<KvProjection> proj(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    proj[l].wk = model.wk(l);
    proj[l].wv = model.wv(l);
    proj[l].key_norm = model.k_norm(l);  // empty without qk_norm
  }
  FsqCalibrationOptions opt;
  opt.latent_width = latent_width;
  opt.key_norm_eps = static_cast<float>(c.rms_eps);
  std::vector<FsqLayerReport> local;
  auto codec = CalibrateFsq(dump, proj, opt, reports != nullptr ? reports : &local);
  if (!codec.ok()) return codec.status();
  SafetensorsWriter w = codec->ToSafetensors();
  w.SetMetadata("source", absl::StrCat("kvcd llama worker: initialized on ", dump.tokens,
                                       " tokens of the model's own residuals"));
  return w.Serialize();
}

absl::StatusOr<ServedProfile> ResolveHistory(const std::string& spec, const Model& model,
                                             const std::vector<const LocalAttention*>& calibration,
                                             std::string* note, int sink_tokens) {
  ServedProfile p;
  std::string said;
  auto read_file = [](const std::string& path, std::string* out) -> absl::Status {
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot open codec file '", path, "'"));
    out->assign(std::istreambuf_iterator<char>(in), {});
    return absl::OkStatus();
  };
  auto need_calibration = [&]() -> absl::Status {
    if (calibration.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("history '", spec, "' calibrates in process and needs a calibration text"));
    }
    return absl::OkStatus();
  };
  if (spec == "bf16" || spec == "int2-identity" || spec == "int2-hadamard") {
    p.history = spec;
  } else if (spec == "int2-oscar") {
    KVCD_RETURN_IF_ERROR(need_calibration());
    p.history = spec;
    p.codec_blob = CalibrateOscarCodec(model.config(), calibration);
    said = "OSCAR rotations calibrated on the calibration runs (default clips)";
  } else if (spec == "int2-transform") {
    KVCD_RETURN_IF_ERROR(need_calibration());
    p.history = "int2-oscar";  // the version-3 file makes the daemon's history int2-transform
    auto blob = CalibrateTransformCodec(model.config(), calibration, sink_tokens);
    if (!blob.ok()) return blob.status();
    p.codec_blob = std::move(*blob);
    said = absl::StrCat("transform-coded keys calibrated on the calibration runs (rows from ",
                        sink_tokens, "), Hadamard INT2 values: codec file version 3");
  } else if (absl::StartsWith(spec, "int2-oscar=") || absl::StartsWith(spec, "fsq=")) {
    const size_t eq = spec.find('=');
    p.history = spec.substr(0, eq);
    KVCD_RETURN_IF_ERROR(read_file(spec.substr(eq + 1), &p.codec_blob));
    said = absl::StrCat("codec file ", spec.substr(eq + 1));
  } else if (absl::StartsWith(spec, "fsq:G=")) {
    int g = 0;
    if (!absl::SimpleAtoi(spec.substr(6), &g) || g <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("history '", spec, "': expected fsq:G=N with a positive integer N"));
    }
    KVCD_RETURN_IF_ERROR(need_calibration());
    std::vector<FsqLayerReport> reports;
    auto blob = InitializeFsqCodec(model, calibration, g, &reports);
    if (!blob.ok()) return blob.status();
    p.history = "fsq";
    p.codec_blob = std::move(*blob);
    said = absl::StrCat("FSQ G = ", g, " initialized on ",
                        reports.empty() ? 0 : reports[0].train_tokens,
                        " calibration tokens; held-out K / V rel. error per layer:");
    for (const auto& r : reports) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), " %.3f/%.3f", r.k_rel_err, r.v_rel_err);
      said += buf;
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("history '", spec,
                     "': expected bf16, int2-identity, int2-hadamard, int2-oscar, "
                     "int2-transform, int2-oscar=FILE, fsq=FILE or fsq:G=N"));
  }
  if (note != nullptr) *note = said;
  return p;
}

Agreement Compare(const Generation& reference, const Generation& served) {
  Agreement a;
  a.steps = static_cast<int>(std::min(reference.logits.size(), served.logits.size()));
  for (int i = 0; i < a.steps; ++i) {
    const double kl = KlDivergence(reference.logits[i], served.logits[i]);
    a.mean_kl += kl / a.steps;
    a.max_kl = std::max(a.max_kl, kl);
    if (a.first_diff < 0 && Argmax(reference.logits[i]) != Argmax(served.logits[i])) {
      a.first_diff = i;
    }
  }
  return a;
}

double DenseBytesPerToken(const Config& c) {
  return static_cast<double>(c.n_layers) * c.kv_dim() * 2 /* K and V */ * 2 /* BF16 */;
}

double CompressionAt(const Config& c, const v1::ModelInfo& info, int64_t tokens) {
  const int64_t sink = std::min<int64_t>(tokens, info.profile().sink_tokens());
  const int64_t recent = std::min<int64_t>(tokens - sink, info.profile().recent_tokens());
  const double stored =
      static_cast<double>(sink) * info.bytes_per_token_sink() +
      static_cast<double>(recent) * info.bytes_per_token_recent() +
      static_cast<double>(tokens - sink - recent) * info.bytes_per_token_history();
  return stored > 0 ? DenseBytesPerToken(c) * static_cast<double>(tokens) / stored : 0;
}

}  // namespace kvcd::llama
