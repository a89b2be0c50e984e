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

#include "absl/strings/numbers.h"
#include "client/client.h"
#include "client/synthetic.h"
#include "common/tensor_ref.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/reference_attention.h"

namespace {

constexpr char kUsage[] = R"(kvcd_demo — synthetic prefill -> prefix-shared decode workload

Usage: kvcd_demo [--target HOST:PORT] [--model NAME] [--system-tokens N]
                 [--suffix-tokens N] [--sessions N] [--steps N]

Defaults: --target 127.0.0.1:50051 --model qwen3-8b --system-tokens 512
          --suffix-tokens 96 --sessions 8 --steps 8
)";

struct Options {
  std::string target = "127.0.0.1:50051";
  std::string model = "qwen3-8b";
  int64_t system_tokens = 512, suffix_tokens = 96, sessions = 8, steps = 8;
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

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "kvcd_demo: %s needs a value\n%s", a.c_str(), kUsage);
      return 2;
    }
    const std::string v = argv[++i];
    int64_t* num = a == "--system-tokens" ? &opt.system_tokens
                   : a == "--suffix-tokens" ? &opt.suffix_tokens
                   : a == "--sessions"      ? &opt.sessions
                   : a == "--steps"         ? &opt.steps
                                            : nullptr;
    if (a == "--target") {
      opt.target = v;
    } else if (a == "--model") {
      opt.model = v;
    } else if (num == nullptr || !absl::SimpleAtoi(v, num) || *num < 1) {
      std::fprintf(stderr, "kvcd_demo: bad flag %s %s\n%s", a.c_str(), v.c_str(), kUsage);
      return 2;
    }
  }
  kvcd::ClientOptions co;
  co.target = opt.target;
  co.deadline = std::chrono::milliseconds(120000);
  auto client_or = kvcd::Client::Connect(co);
  if (!client_or.ok()) return Fail("connect", client_or.status());
  kvcd::Client& client = **client_or;
  auto model = client.GetModel(opt.model);
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
  for (int64_t s = 0; s < B; ++s) {
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
  double kernel_s = 0, max_abs_err = 0, max_ref = 0;
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
      const bool check = step == opt.steps - 1 && (l == 0 || l == L - 1);
      if (!check) continue;
      // float64 attention over exactly what the decode worker sent (BF16-rounded K/V).
      const int64_t n = pos + 1;
      for (int64_t s = 0; s < B; ++s) {
        std::vector<float> k(static_cast<size_t>(n * hkv * d)), v(k.size());
        for (int64_t t = 0; t < n; ++t)
          for (int32_t h = 0; h < hkv; ++h)
            for (int32_t c = 0; c < d; ++c) {
              const size_t idx = static_cast<size_t>((t * hkv + h) * d + c);
              k[idx] = kvcd::kernels::Bf16ToFloat(kvcd::kernels::FloatToBf16(value(s, l, t, h, c, 0)));
              v[idx] = kvcd::kernels::Bf16ToFloat(kvcd::kernels::FloatToBf16(value(s, l, t, h, c, 1)));
            }
        std::vector<double> ro(static_cast<size_t>(hq * d)), rl(static_cast<size_t>(hq));
        kvcd::kernels::ReferenceAttention(q.data() + s * hq * d, k.data(), v.data(), n, hq, hkv, d,
                                          1.0 / std::sqrt(static_cast<double>(d)), ro.data(),
                                          rl.data());
        for (int64_t i = 0; i < hq * d; ++i) {
          max_abs_err = std::max(max_abs_err,
                                 std::fabs(kvcd::ElementAsFloat(r->o(), s * hq * d + i) - ro[i]));
          max_ref = std::max(max_ref, std::fabs(ro[i]));
        }
      }
    }
  }
  const double decode_s = Seconds(t_decode);
  auto closed = stream.Close();
  if (!closed.ok()) return Fail("stream close", closed);
  auto stats = client.Stats();
  if (!stats.ok()) return Fail("Stats", stats.status());
  uint64_t pages_used = 0, page_bytes = 0, cached_tokens = 0;
  for (const auto& m : stats->models()) {
    if (m.profile().name() != p.name()) continue;
    cached_tokens = m.cached_tokens();
    for (const auto& pool : m.pools()) {
      pages_used += pool.pages_used();
      page_bytes = pool.page_bytes();
    }
  }
  const int64_t tokens_held = B * (prompt + opt.steps);
  for (uint64_t id : seqs) {
    auto c = client.CloseSequence(id);
    if (!c.ok()) return Fail("CloseSequence", c.status());
  }
  const double bf16_bytes_per_token = 2.0 * L * hkv * d * 2;
  std::printf("\n=== kvcd main job summary (backend %s, kvcd %s) ===\n", stats->backend().c_str(),
              stats->version().c_str());
  std::printf("%-44s %s\n", "model", p.name().c_str());
  std::printf("%-44s %lld x %lld tokens (+%lld decoded each)\n", "sessions x prompt",
              static_cast<long long>(B), static_cast<long long>(prompt),
              static_cast<long long>(opt.steps));
  std::printf("%-44s %.3f (%llu hit / %llu miss tokens)\n", "prefix hit ratio (daemon)",
              stats->hit_ratio(), static_cast<unsigned long long>(stats->hit_tokens()),
              static_cast<unsigned long long>(stats->miss_tokens()));
  std::printf("%-44s %lld of %lld prompt tokens\n", "served from cache at OpenSequence",
              static_cast<long long>(matched_total), static_cast<long long>(B * prompt));
  std::printf("%-44s %lld cached, %lld inserted\n", "Put tokens", static_cast<long long>(put_cached),
              static_cast<long long>(put_inserted));
  std::printf("%-44s %llu (%llu tokens in the radix tree)\n", "pages in use",
              static_cast<unsigned long long>(pages_used),
              static_cast<unsigned long long>(cached_tokens));
  std::printf("%-44s %.0f B stored per token held (dense BF16: %.0f B)\n", "bytes per token",
              static_cast<double>(pages_used * page_bytes) / tokens_held, bf16_bytes_per_token);
  std::printf("%-44s %.3g (max |o| %.3g)\n", "attention max abs error vs float64", max_abs_err,
              max_ref);
  std::printf("%-44s %.1f tokens/s (%lld x %lld steps, %d layers, kernel %.0f%%)\n",
              "decode throughput", B * opt.steps / decode_s, static_cast<long long>(B),
              static_cast<long long>(opt.steps), L, 100.0 * kernel_s / decode_s);
  std::printf("%-44s %.2f s\n", "prefill time (synthesis + Put)", prefill_s);
  const bool ok = max_abs_err <= 1e-4 * std::max(1.0, max_ref) && matched_total > 0;
  std::printf("%-44s %s\n", "result", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
