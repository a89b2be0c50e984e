// cluster-attention-bench: attention across daemons against pulling the pages
// (docs/cluster.md "Attention across daemons", issue 32), between two running daemons of one
// cluster (bench/run-cluster-attention.sh starts them). For each history size: the history is
// stored on daemon A and a session's own tokens on daemon B.
//   across  every decode step calls AttentionDecode on A (the history) and B (the session's
//           own tokens) at once, per layer, and merges (o, LSE) with the C++ cluster client's
//           exact merge (client/cluster/attention_across.h). Nothing moves.
//   pulled  B first pulls the history's pages from A (PullPrefix: B calls A, pages as
//           stored), opens the whole sequence, and every step attends on B alone.
// Reported: the pull's time and bytes, the median step of each (all layers), the steps after
// which the pull has paid for itself, and the largest difference of the two answers.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/cluster/attention_across.h"
#include "common/cli.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

ABSL_FLAG(std::string, a, "", "daemon A (holds the history), HOST:PORT");
ABSL_FLAG(std::string, b, "", "daemon B (the session), HOST:PORT");
ABSL_FLAG(std::string, peer, "", "A's member id (B pulls from it)");
ABSL_FLAG(std::string, history, "1024,8192,32768", "history sizes in tokens (multiples of 16)");
ABSL_FLAG(int64_t, own, 256, "the session's own tokens on B");
ABSL_FLAG(int32_t, steps, 20, "decode steps measured per mode");
ABSL_FLAG(int32_t, layers, 4, "layers of the model");
ABSL_FLAG(int32_t, q_heads, 8, "query heads");
ABSL_FLAG(int32_t, kv_heads, 2, "KV heads");
ABSL_FLAG(int32_t, head_dim, 128, "head_dim");

namespace {

using Clock = std::chrono::steady_clock;

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "cluster-attention-bench",
      .summary = "attention across two daemons against pulling the history's pages",
      .files = {__FILE__},
      .synopsis = "--a HOST:PORT --b HOST:PORT --peer MEMBER_ID [--history 1024,8192]",
      .notes = "Prints a markdown table row per history size (bench/run-cluster-attention.sh)."};
  return program;
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Appends tokens [first, first + n) of stream `seed` (their rows) to a sequence, in chunks.
absl::Status AppendRows(kvcd::Client& c, const kvcd::v1::ModelProfile& p, uint64_t seed,
                        uint64_t sequence, const std::vector<int32_t>& tokens, int64_t first,
                        int64_t n) {
  for (int64_t at = 0; at < n; at += 2048) {
    const int64_t m = std::min<int64_t>(2048, n - at);
    kvcd::v1::AppendRequest app;
    app.set_sequence_id(sequence);
    app.mutable_tokens()->Add(tokens.begin() + first + at, tokens.begin() + first + at + m);
    const std::vector<int64_t> shape = {p.num_layers(), m, p.num_kv_heads(), p.head_dim()};
    kvcd::SetBf16FromFloat(app.mutable_k(), shape,
                           kvcd::synthetic::Kv(seed, p, first + at, m, 0).data());
    kvcd::SetBf16FromFloat(app.mutable_v(), shape,
                           kvcd::synthetic::Kv(seed, p, first + at, m, 1).data());
    auto len = c.Append(app);
    if (!len.ok()) return len.status();
  }
  return absl::OkStatus();
}

// Stores tokens [0, n) of stream `seed` on `c` (Put in page-aligned chunks).
absl::Status Store(kvcd::Client& c, const kvcd::v1::ModelProfile& p, uint64_t seed,
                   const std::vector<int32_t>& tokens, int64_t n) {
  for (int64_t at = 0; at < n; at += 2048) {
    const int64_t m = std::min<int64_t>(2048, n - at);
    kvcd::v1::PutRequest put;
    put.set_model(p.name());
    put.mutable_tokens()->Add(tokens.begin(), tokens.begin() + at + m);
    put.set_kv_first_token(at);
    const std::vector<int64_t> shape = {p.num_layers(), m, p.num_kv_heads(), p.head_dim()};
    kvcd::SetBf16FromFloat(put.mutable_k(), shape, kvcd::synthetic::Kv(seed, p, at, m, 0).data());
    kvcd::SetBf16FromFloat(put.mutable_v(), shape, kvcd::synthetic::Kv(seed, p, at, m, 1).data());
    auto r = c.Put(put);
    if (!r.ok()) return r.status();
  }
  return absl::OkStatus();
}

absl::Status Run(kvcd::Client& a, kvcd::Client& b, int64_t history) {
  const int64_t own = absl::GetFlag(FLAGS_own);
  const int steps = absl::GetFlag(FLAGS_steps);
  kvcd::v1::ModelProfile p;
  p.set_name(absl::StrCat("xattn-", history));
  p.set_num_layers(absl::GetFlag(FLAGS_layers));
  p.set_num_q_heads(absl::GetFlag(FLAGS_q_heads));
  p.set_num_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  p.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  p.set_page_size(16);
  p.set_recent_tokens(16);
  p.set_history_format(kvcd::v1::HISTORY_FORMAT_BF16);
  const uint64_t page_bytes = 2ull * 2 * 16 * static_cast<uint64_t>(p.num_layers()) *
                              static_cast<uint64_t>(p.num_kv_heads()) *
                              static_cast<uint64_t>(p.head_dim());
  // Room for the history, the session and the pulled copy, with slack.
  p.set_memory_bytes(static_cast<uint64_t>((history + own) / 16 + 64) * page_bytes);
  for (kvcd::Client* c : {&a, &b}) {
    auto r = c->RegisterModel(p);
    if (!r.ok()) return r.status();
  }
  const uint64_t seed = static_cast<uint64_t>(history);
  const std::vector<int32_t> tokens = kvcd::synthetic::Tokens(seed, 0, history + own);
  const std::vector<int32_t> shared(tokens.begin(), tokens.begin() + history);
  const std::vector<int32_t> mine(tokens.begin() + history, tokens.end());
  if (absl::Status s = Store(a, p, seed, tokens, history); !s.ok()) return s;
  auto seq_a = a.OpenSequence(p.name(), "", shared);
  if (!seq_a.ok()) return seq_a.status();
  auto seq_b = b.OpenSequence(p.name(), "", mine);
  if (!seq_b.ok()) return seq_b.status();
  if (absl::Status s = AppendRows(b, p, seed, seq_b->sequence_id(), tokens, history, own); !s.ok())
    return s;

  auto query = [&](int layer, int step) {
    kvcd::v1::AttentionDecodeRequest req;
    req.set_layer(layer);
    const std::vector<float> q = kvcd::synthetic::Row(seed + 1, p, layer, history + own + step, 2);
    kvcd::SetF32Tensor(req.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
    return req;
  };
  std::vector<double> across_ms;
  std::vector<std::vector<float>> across_o;
  for (int step = 0; step < steps; ++step) {
    const auto t0 = Clock::now();
    for (int layer = 0; layer < p.num_layers(); ++layer) {
      kvcd::v1::AttentionDecodeRequest ra = query(layer, step), rb = ra;
      ra.add_sequence_ids(seq_a->sequence_id());
      rb.add_sequence_ids(seq_b->sequence_id());
      auto m = kvcd::cluster::AttendAcross(a, ra, b, rb);
      if (!m.ok()) return m.status();
      if (step == 0) across_o.push_back(m->o);
    }
    across_ms.push_back(Ms(Clock::now() - t0));
  }

  kvcd::v1::PullPrefixRequest pull;
  pull.set_model(p.name());
  pull.mutable_tokens()->Add(shared.begin(), shared.end());
  pull.set_peer_member_id(absl::GetFlag(FLAGS_peer));
  const auto t_pull = Clock::now();
  auto pulled = b.PullPrefix(pull);
  const double pull_ms = Ms(Clock::now() - t_pull);
  if (!pulled.ok()) return pulled.status();
  if (pulled->pulled_tokens() != history) {
    return absl::InternalError(absl::StrCat("PullPrefix moved ", pulled->pulled_tokens(),
                                            " tokens of the ", history, "-token history"));
  }
  auto seq_full = b.OpenSequence(p.name(), "", tokens);
  if (!seq_full.ok()) return seq_full.status();
  if (seq_full->matched_tokens() != history) {
    return absl::InternalError(absl::StrCat("B holds ", seq_full->matched_tokens(),
                                            " tokens of the pulled history, expected ", history));
  }
  if (absl::Status s = AppendRows(b, p, seed, seq_full->sequence_id(), tokens, history, own);
      !s.ok())
    return s;
  std::vector<double> local_ms;
  double diff = 0;
  for (int step = 0; step < steps; ++step) {
    const auto t0 = Clock::now();
    for (int layer = 0; layer < p.num_layers(); ++layer) {
      kvcd::v1::AttentionDecodeRequest r = query(layer, step);
      r.add_sequence_ids(seq_full->sequence_id());
      auto got = b.AttentionDecode(r);
      if (!got.ok()) return got.status();
      if (step == 0) {
        for (size_t i = 0; i < across_o[static_cast<size_t>(layer)].size(); ++i) {
          diff = std::max(diff, static_cast<double>(std::abs(
                                    across_o[static_cast<size_t>(layer)][i] -
                                    kvcd::ElementAsFloat(got->o(), static_cast<int64_t>(i)))));
        }
      }
    }
    local_ms.push_back(Ms(Clock::now() - t0));
  }
  for (auto [c, id] : {std::pair{&a, seq_a->sequence_id()}, std::pair{&b, seq_b->sequence_id()},
                       std::pair{&b, seq_full->sequence_id()}}) {
    (void)c->CloseSequence(id);
  }
  const double across = Median(across_ms), local = Median(local_ms);
  const std::string payback =
      across > local ? absl::StrCat(static_cast<int64_t>(std::ceil(pull_ms / (across - local))))
                     : "never";
  std::printf("| %s | %.1f (%.1f MiB) | %.2f | %.2f | %s | %.1e |\n",
              absl::StrFormat("%d", history).c_str(), pull_ms,
              static_cast<double>(pulled->pulled_bytes()) / (1 << 20), across, local,
              payback.c_str(), diff);
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  kvcd::cli::Parse(Cli(), argc, argv);
  if (absl::GetFlag(FLAGS_a).empty() || absl::GetFlag(FLAGS_b).empty() ||
      absl::GetFlag(FLAGS_peer).empty()) {
    return kvcd::cli::UsageError(Cli(), nullptr, "--a, --b and --peer are required");
  }
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_history), ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0 || v % 16 != 0) {
      return kvcd::cli::UsageError(Cli(), nullptr, "--history takes multiples of 16");
    }
    sizes.push_back(v);
  }
  kvcd::ClientOptions o;
  o.deadline = std::chrono::milliseconds(600000);
  o.target = absl::GetFlag(FLAGS_a);
  auto a = kvcd::Client::Connect(o);
  o.target = absl::GetFlag(FLAGS_b);
  auto b = kvcd::Client::Connect(o);
  if (!a.ok() || !b.ok()) {
    std::fprintf(stderr, "cluster-attention-bench: %s\n",
                 std::string((!a.ok() ? a.status() : b.status()).message()).c_str());
    return 1;
  }
  std::printf(
      "| history tokens | pull once: ms (MiB) | across: ms per step | pulled: ms per step | "
      "steps to pay back the pull | max abs diff |\n|---|---:|---:|---:|---:|---:|\n");
  for (int64_t h : sizes) {
    if (absl::Status s = Run(**a, **b, h); !s.ok()) {
      std::fprintf(stderr, "cluster-attention-bench: history %lld: %s\n", static_cast<long long>(h),
                   std::string(s.message()).c_str());
      return 1;
    }
  }
  return 0;
}
