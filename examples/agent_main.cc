// kvcd-agent: the agent conversation of examples/agent_conversation.h on a llama-family chat
// model (SmolLM2-135M-Instruct, scripts/fetch-smollm2.sh) with its attention served by a
// kvcd daemon, once per history format, printing per turn what the cache served, what was
// prefilled, the text, the next-token KL against FP32 and the bytes per token held.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "examples/agent_conversation.h"
#include "examples/bpe_tokenizer.h"
#include "examples/llama_worker.h"

ABSL_FLAG(std::string, model, "", "directory of model.safetensors and tokenizer.txt");
ABSL_FLAG(std::string, target, "", "daemon address HOST:PORT");
ABSL_FLAG(std::string, histories, "bf16,int2-transform",
          "history formats served by the daemon, comma-separated");
ABSL_FLAG(std::string, calib_text, "",
          "text whose first line's FP32 run calibrates int2-transform, int2-oscar, fsq:G=N");
ABSL_FLAG(int32_t, calib_tokens, 160, "tokens of the calibration run");
ABSL_FLAG(int32_t, max_new, 24, "tokens generated per turn at most");
ABSL_FLAG(bool, generate_tool_call, false,
          "let the model generate the tool call instead of feeding the script's as tokens");
ABSL_FLAG(int32_t, page, 16, "page size of the registered model");
ABSL_FLAG(int32_t, sink, 16, "BF16 sink tokens of the registered model");
ABSL_FLAG(int32_t, recent, 32, "BF16 recent tokens of the registered model");
ABSL_FLAG(int32_t, memory_mib, 128, "memory of the registered model in MiB");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd-agent",
      .summary = "an agent conversation of a chat model with its attention served by kvcd",
      .files = {__FILE__},
      .synopsis = R"(--model DIR --target HOST:PORT [--histories bf16,int2-transform]
           [--calib-text FILE [--calib-tokens 160]] [--max-new 24] [--generate-tool-call]
           [--page 16] [--sink 16] [--recent 32] [--memory-mib 128])",
      .notes =
          R"(DIR holds model.safetensors and tokenizer.txt (scripts/fetch-smollm2.sh prints it).
For each history format the model is registered on the daemon (llama-agent-<format>) and
runs examples/agent_conversation.h: a system prompt with a tool's description prefilled
and Put; session 1 asks a question the tool answers (the script's tool call fed as tokens:
SmolLM2-135M does not emit one reliably; --generate-tool-call lets the model write it),
gets the tool's result and answers; the
sequence is committed (CommitSequence: it stays open) and forked; a follow-up question in the
open session prefills only its message; the same follow-up on a new sequence opened on the
committed history, and after a fresh FP32 prefill of the whole conversation (Put under
another salt, teacher-forced on the resumed run's tokens); session 1 closes with commit; the
fork answers another follow-up; session 2 opens on the cached system prompt. Per turn: tokens served
from the cache (pages stored by Put / by a commit), already held by the sequence, the new
message's tokens, tokens prefilled (fed before the first generated token), generated,
KL(FP32 || served) of the next-token distribution (first step, mean), and the model's pool
bytes in use per token held. Histories as kvcd-llama's --histories (int2-transform,
int2-oscar and fsq:G=N calibrate in process on the first --calib-tokens tokens of the first
line of --calib-text; fsq=CODEC serves a trained FSQ codec file).)"};
  return program;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "kvcd-agent: %s: %s\n", what.c_str(), std::string(s.message()).c_str());
  return 1;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

std::string Printable(const std::string& s) {
  std::string out;
  for (char ch : s) out += ch == '\n' ? std::string("\\n") : std::string(1, ch);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  namespace ll = kvcd::llama;
  kvcd::cli::Parse(Cli(), argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_model), target = absl::GetFlag(FLAGS_target),
                    calib_text = absl::GetFlag(FLAGS_calib_text);
  const std::vector<std::string> histories =
      absl::StrSplit(absl::GetFlag(FLAGS_histories), ',', absl::SkipEmpty());
  const int max_new = absl::GetFlag(FLAGS_max_new), page = absl::GetFlag(FLAGS_page),
            sink = absl::GetFlag(FLAGS_sink), recent = absl::GetFlag(FLAGS_recent),
            calib_tokens = absl::GetFlag(FLAGS_calib_tokens),
            memory_mib = absl::GetFlag(FLAGS_memory_mib);
  const std::pair<const char*, int> counts[] = {{"--max-new", max_new},
                                                {"--page", page},
                                                {"--sink", sink},
                                                {"--recent", recent},
                                                {"--calib-tokens", calib_tokens},
                                                {"--memory-mib", memory_mib}};
  for (const auto& [flag, value] : counts) {
    if (value < 1) {
      return kvcd::cli::UsageError(
          Cli(), nullptr, absl::StrCat("bad value for ", flag, ": ", value, " (at least 1)"));
    }
  }
  if (dir.empty()) return kvcd::cli::UsageError(Cli(), nullptr, "--model DIR is required");
  if (target.empty()) return kvcd::cli::UsageError(Cli(), nullptr, "--target is required");
  auto tok = ll::BpeTokenizer::Load(dir + "/tokenizer.txt");
  if (!tok.ok()) return Fail("tokenizer", tok.status());
  auto model = ll::Model::Load(dir + "/model.safetensors");
  if (!model.ok()) return Fail("model", model.status());
  const ll::Config& c = model->config();
  std::printf(
      "model %s: dim %d, %d layers, %d q / %d kv heads, head_dim %d; dense BF16 K/V "
      "%.0f B/token\n",
      dir.c_str(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
      ll::DenseBytesPerToken(c));

  // The calibration run: the FP32 reference over the first calib_tokens of the text.
  const auto start = std::chrono::steady_clock::now();
  ll::LocalAttention calib(c);
  std::vector<const ll::LocalAttention*> calibration;
  if (!calib_text.empty()) {
    std::ifstream in(calib_text);
    std::string line;
    if (!in || !std::getline(in, line)) {
      return Fail("calibration",
                  absl::NotFoundError("cannot read --calib-text '" + calib_text + "'"));
    }
    std::vector<int> ids = tok->Encode(line);
    if (static_cast<int>(ids.size()) > calib_tokens) ids.resize(static_cast<size_t>(calib_tokens));
    if (auto r = ll::RunReference(*model, ids, 1, -1, &calib); !r.ok()) {
      return Fail("calibration", r.status());
    }
    calibration.push_back(&calib);
    std::printf("calibration run: %d tokens of %s in FP32 (%.1f s)\n", calib.tokens(),
                calib_text.c_str(), Seconds(start));
  }
  bool fsq = false;
  for (const auto& h : histories) fsq = fsq || absl::StartsWith(h, "fsq");
  if (!fsq) {
    std::printf(
        "FSQ: not run. No trained FSQ codec for this model is part of the repository's "
        "flow (tools/fsq_finetune trains one, docs/fsq.md); --histories ...,fsq=CODEC "
        "serves one.\n");
  }

  kvcd::ClientOptions co;
  co.target = target;
  kvcd::ApplySecurityEnvironment(&co);
  auto client = kvcd::Client::Connect(co);
  if (!client.ok()) return Fail("connect", client.status());
  ll::AgentScript script = ll::DefaultAgentScript();
  if (absl::GetFlag(FLAGS_generate_tool_call)) script.tool_call.clear();
  auto text = [&](const std::vector<int>& ids) {
    auto s = tok->Decode(ids);
    return s.ok() ? Printable(*s) : std::string("<bad ids>");
  };
  ll::AgentOptions options;
  options.max_new = max_new;
  options.on_turn = [&](const ll::AgentTurn& t) {
    std::printf("  [%s] %s%s (%.1f s): %s\n", t.session.c_str(), t.what.c_str(),
                t.scripted ? ", tokens followed" : "", t.seconds, text(t.tokens).c_str());
    std::fflush(stdout);
  };
  struct Outcome {
    std::string history;
    ll::AgentResult r;
  };
  std::vector<Outcome> outcomes;
  for (const auto& h : histories) {
    std::string note;
    const auto resolving = std::chrono::steady_clock::now();
    auto p = ll::ResolveHistory(h, *model, calibration, &note, sink);
    if (!p.ok()) return Fail("history " + h, p.status());
    p->name = absl::StrCat("llama-agent-", h.substr(0, h.find('=')));
    p->page_size = page;
    p->sink_tokens = sink;
    p->recent_tokens = recent;
    p->memory_bytes = int64_t{memory_mib} << 20;
    auto info = ll::RegisterProfile(**client, c, *p);
    if (!info.ok()) return Fail("RegisterModel " + h, info.status());
    std::printf(
        "\n=== %s history: model %s, page %d, BF16 sink %d + recent %d; B/token: sink %.0f, "
        "history %.0f, recent %.0f%s%s\n",
        h.c_str(), p->name.c_str(), page, sink, recent, info->bytes_per_token_sink(),
        info->bytes_per_token_history(), info->bytes_per_token_recent(),
        note.empty() ? "" : "\n    codec: ", note.c_str());
    if (!note.empty()) std::printf("    codec ready in %.1f s\n", Seconds(resolving));
    const auto began = std::chrono::steady_clock::now();
    auto r = ll::RunAgentConversation(**client, *model, *tok, *p, script, options);
    if (!r.ok()) return Fail("conversation " + h, r.status());
    std::printf("%-7s %-41s %6s %6s %6s %6s %6s %6s %9s %9s %8s %6s\n", "session", "turn", "c:put",
                "c:comm", "held", "msg", "prefil", "gen", "KL first", "KL mean", "B/token", "s");
    for (const auto& t : r->turns) {
      std::printf("%-7s %-41s %6lld %6lld %6lld %6lld %6lld %6zu %9.3g %9.3g %8.0f %6.1f\n",
                  t.session.c_str(), t.what.c_str(), static_cast<long long>(t.from_put),
                  static_cast<long long>(t.from_committed), static_cast<long long>(t.held),
                  static_cast<long long>(t.message), static_cast<long long>(t.prefilled),
                  t.tokens.size(), t.first_kl, t.mean_kl, t.bytes_per_token, t.seconds);
    }
    const auto& s = r->stats;
    const auto& b = r->stats_before;
    std::printf(
        "session 1 committed after its answer (kept open): %lld of its %lld tokens in the tree "
        "(%lld pages inserted, %lld already there); closed with commit after the follow-up: "
        "%lld of %lld (%lld inserted, %lld already there)\n",
        static_cast<long long>(r->checkpoint.committed_tokens()),
        static_cast<long long>(r->history_tokens),
        static_cast<long long>(r->checkpoint.inserted_pages()),
        static_cast<long long>(r->checkpoint.deduplicated_pages()),
        static_cast<long long>(r->close_commit.committed_tokens()),
        static_cast<long long>(r->session_tokens),
        static_cast<long long>(r->close_commit.inserted_pages()),
        static_cast<long long>(r->close_commit.deduplicated_pages()));
    std::printf(
        "daemon, during this conversation: hit tokens %llu (from Put %llu, from commits "
        "%llu), committed pages in the tree +%llu, forks %llu\n",
        static_cast<unsigned long long>(s.hit_tokens() - b.hit_tokens()),
        static_cast<unsigned long long>(s.hit_tokens_put() - b.hit_tokens_put()),
        static_cast<unsigned long long>(s.hit_tokens_committed() - b.hit_tokens_committed()),
        static_cast<unsigned long long>(s.committed_pages() - b.committed_pages()),
        static_cast<unsigned long long>(s.forks() - b.forks()));
    std::printf("%s: the conversation took %.1f s (codec calibration before it excluded)\n",
                h.c_str(), Seconds(began));
    outcomes.push_back({h, std::move(*r)});
  }
  std::printf(
      "\n=== follow-up turn: in the open session after its commit, on a new sequence opened "
      "on the committed history, and after a fresh FP32 prefill of the whole conversation "
      "(Put, then opened; same tokens as the resumed run)\n");
  std::printf("%-16s %8s %9s %10s %10s %10s %12s %12s %8s\n", "history", "history", "message",
              "prefilled", "prefilled", "prefilled", "KL mean", "KL mean", "ratio");
  std::printf("%-16s %8s %9s %10s %10s %10s %12s %12s %8s\n", "", "tokens", "tokens", "session",
              "resumed", "fresh", "resumed", "fresh", "");
  for (const auto& o : outcomes) {
    const auto& r = o.r;
    std::printf("%-16s %8lld %9lld %10lld %10lld %10lld %12.4g %12.4g %8.3f\n", o.history.c_str(),
                static_cast<long long>(r.history_tokens),
                static_cast<long long>(r.committed.message),
                static_cast<long long>(r.in_session.prefilled),
                static_cast<long long>(r.committed.prefilled),
                static_cast<long long>(r.fresh.prefilled), r.committed.mean_kl, r.fresh.mean_kl,
                r.fresh.mean_kl > 0 ? r.committed.mean_kl / r.fresh.mean_kl : 0.0);
  }
  std::printf(
      "(prefilled in the open session = the message alone; on the committed history = the "
      "message + the history's last partial page, which a commit leaves with the sequence: "
      "%d tokens a page)\n",
      page);
  return 0;
}
