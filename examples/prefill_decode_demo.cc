// kvcd_demo: a synthetic disaggregated workload through the real client. A "prefill
// worker" caches prompts that share one system prompt; a "decode worker" opens a
// sequence per session on the cached prefix and runs a per-layer decode loop of batched
// fused append+attention calls over one AttentionDecodeStream. The attention outputs
// are checked against a float64 computation over the same K/V, and a summary is printed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "common/cli.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/reference_attention.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "daemon address HOST:PORT");
ABSL_FLAG(std::string, models, "qwen3-8b,qwen3-8b-int2",
          "models to run the workload on, comma-separated");
ABSL_FLAG(int64_t, system_tokens, 512, "tokens of the shared system prompt");
ABSL_FLAG(int64_t, suffix_tokens, 96, "tokens of each session's own suffix");
ABSL_FLAG(int64_t, sessions, 8, "sessions (sequences decoding together)");
ABSL_FLAG(int64_t, steps, 8, "decode steps");
ABSL_FLAG(bool, no_put, false,
          "skip the prefill worker: the decode worker appends each whole prompt itself");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd_demo",
      .summary = "synthetic prefill -> prefix-shared decode workload",
      .files = {__FILE__},
      .synopsis = R"([--target HOST:PORT] [--models A,B] [--system-tokens N]
    [--suffix-tokens N] [--sessions N] [--steps N] [--no-put])",
      .notes =
          R"(--no-put skips the prefill worker: the decode worker appends each whole prompt itself, so
pages leave the recent window through Append and are demoted (quantize-on-demote).

Runs the workload once per model and prints one summary column per model.
)"};
  return program;
}

struct Options {
  std::string target = "127.0.0.1:50051";
  std::vector<std::string> models = {"qwen3-8b", "qwen3-8b-int2"};
  int64_t system_tokens = 512, suffix_tokens = 96, sessions = 8, steps = 8;
  bool put = true;
};

constexpr uint64_t kSystemSeed = 1;

// Session s's stream: the shared system prompt, then its own tokens.
uint64_t SeedAt(int64_t session, int64_t pos, int64_t system_tokens) {
  return pos < system_tokens ? kSystemSeed : 1000 + static_cast<uint64_t>(session);
}

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "kvcd_demo: %s: %s: %s\n", what, absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return 1;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Summary {
  std::string model, history, codec;
  double hit_ratio = 0, bits_per_element = 16, bytes_per_token = 0, dense_bytes_per_token = 0;
  double compression = 1, err_exact = 0, err_stored = -1, tokens_per_s = 0, kernel_share = 0;
  double prefill_s = 0;
  int64_t matched = 0, prompt_tokens = 0, pages_bf16 = 0, pages_int2 = 0, demoted = 0;
  bool pass = false;
};

int RunWorkload(kvcd::Client& client, const Options& opt, const std::string& model_name,
                Summary* out);
int PrintSummaries(kvcd::Client& client, const Options& opt, const std::vector<Summary>& r);

}  // namespace

int main(int argc, char** argv) {
  kvcd::cli::Parse(Cli(), argc, argv);
  Options opt;
  opt.target = absl::GetFlag(FLAGS_target);
  opt.models = absl::StrSplit(absl::GetFlag(FLAGS_models), ',', absl::SkipEmpty());
  opt.put = !absl::GetFlag(FLAGS_no_put);
  const std::pair<const char*, int64_t*> counts[] = {{"--system-tokens", &opt.system_tokens},
                                                     {"--suffix-tokens", &opt.suffix_tokens},
                                                     {"--sessions", &opt.sessions},
                                                     {"--steps", &opt.steps}};
  opt.system_tokens = absl::GetFlag(FLAGS_system_tokens);
  opt.suffix_tokens = absl::GetFlag(FLAGS_suffix_tokens);
  opt.sessions = absl::GetFlag(FLAGS_sessions);
  opt.steps = absl::GetFlag(FLAGS_steps);
  for (const auto& [flag, value] : counts) {
    if (*value < 1) {
      return kvcd::cli::UsageError(
          Cli(), nullptr, absl::StrCat("bad value for ", flag, ": ", *value, " (at least 1)"));
    }
  }
  kvcd::ClientOptions co;
  co.target = opt.target;
  co.deadline = std::chrono::milliseconds(120000);
  auto client_or = kvcd::Client::Connect(co);
  if (!client_or.ok()) return Fail("connect", client_or.status());
  std::vector<Summary> results;
  for (const std::string& name : opt.models) {
    Summary sum;
    if (RunWorkload(**client_or, opt, name, &sum) != 0) return 1;
    results.push_back(sum);
  }
  return PrintSummaries(**client_or, opt, results);
}

namespace {

int RunWorkload(kvcd::Client& client, const Options& opt, const std::string& model_name,
                Summary* out) {
  auto model = client.GetModel(model_name);
  if (!model.ok()) return Fail("model", model.status());
  const kvcd::v1::ModelProfile p = model->profile();
  const int L = p.num_layers(), hq = p.num_q_heads(), hkv = p.num_kv_heads(), d = p.head_dim();
  const int64_t prompt = opt.system_tokens + opt.suffix_tokens;
  const int64_t B = opt.sessions;

  auto session_tokens = [&](int64_t s, int64_t begin, int64_t n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      t[i] = kvcd::synthetic::Token(SeedAt(s, begin + i, opt.system_tokens), begin + i);
    }
    return t;
  };
  auto value = [&](int64_t s, int32_t layer, int64_t pos, int32_t head, int32_t c, int kind) {
    return kvcd::synthetic::Value(SeedAt(s, pos, opt.system_tokens), layer, pos, head, c, kind);
  };

  // --- Prefill worker: cache every session's prompt. ---------------------------------
  std::printf("prefill: %lld sessions x %lld tokens (%lld shared system + %lld own), model %s\n",
              static_cast<long long>(B), static_cast<long long>(prompt),
              static_cast<long long>(opt.system_tokens), static_cast<long long>(opt.suffix_tokens),
              p.name().c_str());
  const auto t_prefill = std::chrono::steady_clock::now();
  int64_t put_cached = 0, put_inserted = 0;
  for (int64_t s = 0; s < B && opt.put; ++s) {
    kvcd::v1::PutRequest req;
    req.set_model(p.name());
    const auto tokens = session_tokens(s, 0, prompt);
    req.mutable_tokens()->Add(tokens.begin(), tokens.end());
    std::vector<float> k(static_cast<size_t>(L * prompt * hkv * d)), v(k.size());
    size_t i = 0;
    for (int32_t l = 0; l < L; ++l)
      for (int64_t t = 0; t < prompt; ++t)
        for (int32_t h = 0; h < hkv; ++h)
          for (int32_t c = 0; c < d; ++c, ++i) {
            k[i] = value(s, l, t, h, c, 0);
            v[i] = value(s, l, t, h, c, 1);
          }
    kvcd::SetBf16FromFloat(req.mutable_k(), {L, prompt, hkv, d}, k.data());
    kvcd::SetBf16FromFloat(req.mutable_v(), {L, prompt, hkv, d}, v.data());
    auto r = client.Put(req);
    if (!r.ok()) return Fail("Put", r.status());
    put_cached += r->cached_tokens();
    put_inserted += r->inserted_tokens();
  }
  const double prefill_s = Seconds(t_prefill);

  // --- Decode worker: open on the cached prefixes, append the tails. -----------------
  std::vector<uint64_t> seqs;
  int64_t matched_total = 0;
  for (int64_t s = 0; s < B; ++s) {
    const auto tokens = session_tokens(s, 0, prompt);
    auto open = client.OpenSequence(p.name(), "", tokens);
    if (!open.ok()) return Fail("OpenSequence", open.status());
    seqs.push_back(open->sequence_id());
    const int64_t m = open->matched_tokens();
    matched_total += m;
    if (m < prompt) {
      kvcd::v1::AppendRequest app;
      app.set_sequence_id(open->sequence_id());
      app.mutable_tokens()->Add(tokens.begin() + m, tokens.end());
      const int64_t n = prompt - m;
      std::vector<float> k(static_cast<size_t>(L * n * hkv * d)), v(k.size());
      size_t i = 0;
      for (int32_t l = 0; l < L; ++l)
        for (int64_t t = m; t < prompt; ++t)
          for (int32_t h = 0; h < hkv; ++h)
            for (int32_t c = 0; c < d; ++c, ++i) {
              k[i] = value(s, l, t, h, c, 0);
              v[i] = value(s, l, t, h, c, 1);
            }
      kvcd::SetBf16FromFloat(app.mutable_k(), {L, n, hkv, d}, k.data());
      kvcd::SetBf16FromFloat(app.mutable_v(), {L, n, hkv, d}, v.data());
      auto len = client.Append(app);
      if (!len.ok()) return Fail("Append", len.status());
    }
  }
  auto stream_or = client.OpenDecodeStream();
  if (!stream_or.ok()) return Fail("stream", stream_or.status());
  auto& stream = **stream_or;
  double kernel_s = 0, err_exact = 0, err_stored = -1, max_abs_err = 0, max_ref = 0;
  int checks = 0;
  auto rel_error = [&](const kvcd::v1::TensorRef& o, int64_t s, const std::vector<double>& ref) {
    double e = 0, n2 = 0;
    for (int64_t i = 0; i < hq * d; ++i) {
      const double x = kvcd::ElementAsFloat(o, s * hq * d + i);
      e += (x - ref[i]) * (x - ref[i]);
      n2 += ref[i] * ref[i];
      max_abs_err = std::max(max_abs_err, std::fabs(x - ref[i]));
      max_ref = std::max(max_ref, std::fabs(ref[i]));
    }
    return std::sqrt(e / n2);
  };
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto t_decode = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < opt.steps; ++step) {
    const int64_t pos = prompt + step;
    for (int32_t l = 0; l < L; ++l) {
      kvcd::v1::AttentionDecodeRequest req;
      req.set_layer(l);
      req.set_request_id(static_cast<uint64_t>(step * L + l));
      std::vector<float> q(static_cast<size_t>(B * hq * d)), kn(static_cast<size_t>(B * hkv * d)),
          vn(kn.size());
      for (int64_t s = 0; s < B; ++s) {
        req.add_sequence_ids(seqs[s]);
        req.add_new_tokens(kvcd::synthetic::Token(1000 + s, pos));
        for (int32_t h = 0; h < hq; ++h)
          for (int32_t c = 0; c < d; ++c) q[(s * hq + h) * d + c] = value(s, l, pos, h, c, 2);
        for (int32_t h = 0; h < hkv; ++h)
          for (int32_t c = 0; c < d; ++c) {
            kn[(s * hkv + h) * d + c] = value(s, l, pos, h, c, 0);
            vn[(s * hkv + h) * d + c] = value(s, l, pos, h, c, 1);
          }
      }
      kvcd::SetF32Tensor(req.mutable_q(), {B, hq, d}, q.data());
      kvcd::SetBf16FromFloat(req.mutable_k_new(), {B, hkv, d}, kn.data());
      kvcd::SetBf16FromFloat(req.mutable_v_new(), {B, hkv, d}, vn.data());
      auto r = stream.Call(req);
      if (!r.ok()) return Fail("AttentionDecode", r.status());
      kernel_s += r->kernel_seconds();
      if (step != opt.steps - 1 || (l != 0 && l != L - 1)) continue;
      // float64 attention over exactly what the decode worker sent (BF16-rounded K/V): the
      // error of the stored format.
      const int64_t n = pos + 1;
      for (int64_t s = 0; s < B; ++s) {
        std::vector<float> k(static_cast<size_t>(n * hkv * d)), v(k.size());
        for (int64_t t = 0; t < n; ++t)
          for (int32_t h = 0; h < hkv; ++h)
            for (int32_t c = 0; c < d; ++c) {
              const size_t idx = static_cast<size_t>((t * hkv + h) * d + c);
              k[idx] =
                  kvcd::kernels::Bf16ToFloat(kvcd::kernels::FloatToBf16(value(s, l, t, h, c, 0)));
              v[idx] =
                  kvcd::kernels::Bf16ToFloat(kvcd::kernels::FloatToBf16(value(s, l, t, h, c, 1)));
            }
        std::vector<double> ro(static_cast<size_t>(hq * d)), rl(static_cast<size_t>(hq));
        kvcd::kernels::ReferenceAttention(q.data() + s * hq * d, k.data(), v.data(), n, hq, hkv, d,
                                          scale, ro.data(), rl.data());
        err_exact += rel_error(r->o(), s, ro);
        ++checks;
      }
      if (l == L - 1) {
        // float64 attention over what kvcd holds (FetchPages, expanded to BF16): checks the
        // kernels, independently of the format's quantization error.
        kvcd::v1::FetchPagesRequest f;
        f.set_sequence_id(seqs[0]);
        f.set_expand_to_bf16(true);
        auto fetched = client.FetchPages(f);
        if (!fetched.ok()) return Fail("FetchPages", fetched.status());
        const int64_t nf = fetched->num_tokens();
        std::vector<float> k(static_cast<size_t>(nf * hkv * d)), v(k.size());
        kvcd::CopyAsFloat(fetched->k(), static_cast<int64_t>(l) * nf * hkv * d, nf * hkv * d,
                          k.data());
        kvcd::CopyAsFloat(fetched->v(), static_cast<int64_t>(l) * nf * hkv * d, nf * hkv * d,
                          v.data());
        std::vector<double> ro(static_cast<size_t>(hq * d)), rl(static_cast<size_t>(hq));
        kvcd::kernels::ReferenceAttention(q.data(), k.data(), v.data(), nf, hq, hkv, d, scale,
                                          ro.data(), rl.data());
        const double save_abs = max_abs_err, save_ref = max_ref;
        err_stored = rel_error(r->o(), 0, ro);
        max_abs_err = save_abs;
        max_ref = save_ref;
      }
    }
  }
  const double decode_s = Seconds(t_decode);
  auto closed = stream.Close();
  if (!closed.ok()) return Fail("stream close", closed);
  auto stats = client.Stats();
  if (!stats.ok()) return Fail("Stats", stats.status());
  Summary& sum = *out;
  sum.model = p.name();
  for (const auto& m : stats->models()) {
    if (m.profile().name() != p.name()) continue;
    sum.history = kvcd::v1::HistoryFormat_Name(m.profile().history_format());
    sum.codec = m.codec();
    sum.bits_per_element = m.history_bits_per_element();
    sum.compression = m.compression_ratio();
    sum.demoted = static_cast<int64_t>(m.demoted_pages());
    uint64_t used = 0;
    for (const auto& pool : m.pools()) {
      used += pool.pages_used() * pool.page_bytes();
      (pool.format() == "bf16" ? sum.pages_bf16 : sum.pages_int2) +=
          static_cast<int64_t>(pool.pages_used());
    }
    sum.bytes_per_token = static_cast<double>(used) / static_cast<double>(B * (prompt + opt.steps));
  }
  for (uint64_t id : seqs) {
    auto c = client.CloseSequence(id);
    if (!c.ok()) return Fail("CloseSequence", c.status());
  }
  sum.dense_bytes_per_token = 2.0 * L * hkv * d * 2;
  sum.hit_ratio =
      static_cast<double>(matched_total + put_cached) / static_cast<double>(2 * B * prompt);
  sum.matched = matched_total;
  sum.prompt_tokens = B * prompt;
  sum.err_exact = err_exact / std::max(1, checks);
  sum.err_stored = err_stored;
  sum.tokens_per_s = B * opt.steps / decode_s;
  sum.kernel_share = kernel_s / decode_s;
  sum.prefill_s = prefill_s;
  const bool compressed = sum.pages_int2 > 0;
  // BF16 history: exact up to FP32 accumulation. INT2: the kernels must match float64 over
  // the stored (dequantized) values up to the BF16 rounding of the fetched copy.
  sum.pass = (matched_total > 0 || !opt.put) &&
             (compressed ? err_stored >= 0 && err_stored < 1e-2
                         : max_abs_err <= 1e-4 * std::max(1.0, max_ref));
  (void)put_inserted;
  return 0;
}

int PrintSummaries(kvcd::Client& client, const Options& opt, const std::vector<Summary>& r) {
  auto stats = client.Stats();
  if (!stats.ok()) return Fail("Stats", stats.status());
  std::printf("\n=== kvcd main job summary (backend %s, kvcd %s) ===\n", stats->backend().c_str(),
              stats->version().c_str());
  std::printf(
      "%lld sessions x %lld-token prompts (%lld shared system + %lld own), %lld decode "
      "steps each, per-layer fused append + attention on one stream\n\n",
      static_cast<long long>(opt.sessions),
      static_cast<long long>(opt.system_tokens + opt.suffix_tokens),
      static_cast<long long>(opt.system_tokens), static_cast<long long>(opt.suffix_tokens),
      static_cast<long long>(opt.steps));
  auto row = [&](const char* name, auto fmt) {
    std::printf("%-40s", name);
    for (const auto& s : r) std::printf(" %26s", fmt(s).c_str());
    std::printf("\n");
  };
  auto str = [](const char* f, auto... a) {
    char b[128];
    std::snprintf(b, sizeof(b), f, a...);
    return std::string(b);
  };
  row("model", [&](const Summary& s) { return s.model; });
  row("history format", [&](const Summary& s) { return s.history.substr(15); });
  row("codec", [&](const Summary& s) { return s.codec; });
  row("prefix hit ratio (Put + OpenSequence)",
      [&](const Summary& s) { return str("%.3f", s.hit_ratio); });
  row("prompt tokens served from the cache", [&](const Summary& s) {
    return str("%lld / %lld", static_cast<long long>(s.matched),
               static_cast<long long>(s.prompt_tokens));
  });
  row("pages in use: bf16 / int2", [&](const Summary& s) {
    return str("%lld / %lld", static_cast<long long>(s.pages_bf16),
               static_cast<long long>(s.pages_int2));
  });
  row("pages demoted (quantize-on-demote)",
      [&](const Summary& s) { return str("%lld", static_cast<long long>(s.demoted)); });
  row("history bits per element",
      [&](const Summary& s) { return str("%.2f", s.bits_per_element); });
  row("bytes stored per token held", [&](const Summary& s) {
    return str("%.0f (dense %.0f)", s.bytes_per_token, s.dense_bytes_per_token);
  });
  row("pool compression vs dense BF16",
      [&](const Summary& s) { return str("%.2fx", s.compression); });
  row("attention rel. error vs float64, exact K/V",
      [&](const Summary& s) { return str("%.3g", s.err_exact); });
  row("attention rel. error vs float64, stored",
      [&](const Summary& s) { return str("%.3g", s.err_stored); });
  row("decode throughput (tokens/s)", [&](const Summary& s) {
    return str("%.1f (kernel %.0f%%)", s.tokens_per_s, 100 * s.kernel_share);
  });
  row("prefill (synthesis + Put), s", [&](const Summary& s) { return str("%.2f", s.prefill_s); });
  row("result", [&](const Summary& s) { return std::string(s.pass ? "PASS" : "FAIL"); });
  bool ok = true;
  for (const auto& s : r) ok &= s.pass;
  return ok ? 0 : 1;
}

}  // namespace
