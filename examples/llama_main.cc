// kvcd-llama: a llama-family model (e.g. SmolLM2-135M-Instruct, fetched and converted by
// scripts/fetch-smollm2.sh) generating greedily on the CPU, with local FP32 attention and,
// given a daemon, with its attention served by kvcd; or dumping its real activations.
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/activation_dump.h"
#include "common/cli.h"
#include "examples/bpe_tokenizer.h"
#include "examples/llama_worker.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "directory of model.safetensors and tokenizer.txt");
ABSL_FLAG(std::string, prompt, "The capital of France is", "prompt of the greedy generation");
ABSL_FLAG(bool, chat, false, "wrap the prompt in the model's chat template (one user turn)");
ABSL_FLAG(int32_t, max_new, 32, "tokens generated at most");
ABSL_FLAG(std::string, target, "", "daemon address HOST:PORT (empty: local FP32 attention only)");
ABSL_FLAG(std::string, histories, "bf16,int2-identity,int2-hadamard",
          "history formats served by the daemon, comma-separated");
ABSL_FLAG(std::string, calib_text, "",
          "text whose FP32 runs calibrate int2-oscar, int2-transform, fsq:G=N");
ABSL_FLAG(int32_t, calib_max_tokens, 1024, "tokens per calibration run at most");
ABSL_FLAG(std::string, eval_text, "", "compare teacher-forced on this text instead");
ABSL_FLAG(int32_t, eval_steps, 64, "--eval-text: its last tokens fed one by one");
ABSL_FLAG(int32_t, page, 16, "page size of the registered model");
ABSL_FLAG(int32_t, sink, 16, "BF16 sink tokens of the registered model");
ABSL_FLAG(int32_t, recent, 32, "BF16 recent tokens of the registered model");
ABSL_FLAG(int32_t, memory_mib, 64, "memory of the registered model in MiB");
ABSL_FLAG(std::string, dump, "", "write an activation dump of the reference runs here");
ABSL_FLAG(std::string, dump_text, "", "--dump: text whose lines are run");
ABSL_FLAG(int32_t, dump_max_tokens, 512, "--dump: tokens per line at most");
ABSL_FLAG(std::string, weights, "", "--dump: also write the K/V projections here");
ABSL_FLAG(std::string, encode, "", "print the token ids of each line of this file");
ABSL_FLAG(std::string, json, "",
          "with --target: also write the comparison table to this JSON file");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd-llama",
      .summary = "a llama-family model with its attention served by kvcd",
      .files = {__FILE__},
      .synopsis = R"(--model DIR [--prompt TEXT] [--chat] [--max-new 32]
           [--target HOST:PORT] [--histories bf16,int2-identity,int2-hadamard,
               int2-oscar,int2-transform,int2-oscar=CODEC,fsq=CODEC,fsq:G=N]
           [--calib-text FILE [--calib-max-tokens 1024]]
           [--eval-text FILE [--eval-steps 64]]
           [--page 16] [--sink 16] [--recent 32] [--memory-mib 64] [--json OUT.json]
       kvcd-llama --model DIR --dump OUT.safetensors --dump-text FILE [--dump-max-tokens 512]
           [--weights WEIGHTS.safetensors]
       kvcd-llama --model DIR --encode FILE)",
      .notes =
          R"(DIR holds model.safetensors and tokenizer.txt (scripts/fetch-smollm2.sh prints it).
Without --target: greedy generation with local FP32 attention (the reference), stopping at
the end-of-turn token. --chat wraps the prompt in the model's chat template (one user
turn). With --target, for each history format the model is registered on the daemon
(the given page size and BF16 windows), generates greedily, and then runs teacher-forced
on the reference's tokens: the table gives the first step whose greedy token differs,
KL(FP32 || served) of the next-token distributions, and the bytes the daemon stores per
token (history alone, and over the whole sequence with the BF16 windows) against dense
BF16 K/V. With --eval-text the comparison is teacher-forced on that text instead (no
greedy run): its tokens but the last --eval-steps are the prompt (prefilled and Put),
the last --eval-steps are fed one by one. --json writes the table (per history: mean and
max KL, first differing step, history bytes per token, compression of the history and of
the whole run against dense BF16 K/V) for tools/plot_quality.py.
Histories int2-oscar (rotations, default clips), int2-transform (codec file version 3:
transform-coded keys fitted on the rows past --sink, Hadamard INT2 values) and fsq:G=N
(an FSQ codec initialized by
tools/fsq_calibration: PCA encoder, ridge decoder folded into W_K, W_V) are calibrated in
process on the model's FP32 runs over --calib-text (each line one run, at most
--calib-max-tokens tokens); int2-oscar=CODEC and fsq=CODEC serve codec files
(kvcd-calibrate, or an FSQ codec fine-tuned by tools/fsq_finetune).
--dump runs the reference over each line of FILE (tokens concatenated, each line at most
--dump-max-tokens) and writes the post-RoPE q, k, v and the attention blocks' normalized
residuals x of every layer as an activation dump for kvcd-calibrate / kvcd-eval;
--weights writes the K/V projections for kvcd-calibrate fsq. --encode prints the token
ids of each line of FILE (the two characters \n stand for a newline;
tools/check_tokenizer_hf.py compares them with the Hugging Face tokenizers library).)"};
  return program;
}

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "kvcd-llama: %s: %s\n", what, std::string(s.message()).c_str());
  return 1;
}

std::string Printable(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '\n') {
      out += "\\n";
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  namespace ll = kvcd::llama;
  kvcd::cli::Parse(Cli(), argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_model), prompt = absl::GetFlag(FLAGS_prompt),
                    target = absl::GetFlag(FLAGS_target), dump_path = absl::GetFlag(FLAGS_dump),
                    dump_text = absl::GetFlag(FLAGS_dump_text),
                    encode = absl::GetFlag(FLAGS_encode),
                    weights_path = absl::GetFlag(FLAGS_weights),
                    calib_text = absl::GetFlag(FLAGS_calib_text),
                    eval_text = absl::GetFlag(FLAGS_eval_text),
                    json_path = absl::GetFlag(FLAGS_json);
  const std::vector<std::string> histories =
      absl::StrSplit(absl::GetFlag(FLAGS_histories), ',', absl::SkipEmpty());
  const bool chat = absl::GetFlag(FLAGS_chat);
  const int max_new = absl::GetFlag(FLAGS_max_new), page = absl::GetFlag(FLAGS_page),
            sink = absl::GetFlag(FLAGS_sink), recent = absl::GetFlag(FLAGS_recent),
            dump_max = absl::GetFlag(FLAGS_dump_max_tokens),
            calib_max = absl::GetFlag(FLAGS_calib_max_tokens),
            eval_steps = absl::GetFlag(FLAGS_eval_steps),
            memory_mib = absl::GetFlag(FLAGS_memory_mib);
  const std::pair<const char*, int> counts[] = {{"--max-new", max_new},
                                                {"--page", page},
                                                {"--sink", sink},
                                                {"--recent", recent},
                                                {"--dump-max-tokens", dump_max},
                                                {"--calib-max-tokens", calib_max},
                                                {"--eval-steps", eval_steps},
                                                {"--memory-mib", memory_mib}};
  for (const auto& [flag, value] : counts) {
    if (value < 1) {
      return kvcd::cli::UsageError(
          Cli(), nullptr, absl::StrCat("bad value for ", flag, ": ", value, " (at least 1)"));
    }
  }
  if (dir.empty()) return kvcd::cli::UsageError(Cli(), nullptr, "--model DIR is required");
  auto tok = ll::BpeTokenizer::Load(dir + "/tokenizer.txt");
  if (!tok.ok()) return Fail("tokenizer", tok.status());
  if (!encode.empty()) {
    std::ifstream in(encode);
    if (!in) return Fail("encode", absl::NotFoundError("cannot open --encode '" + encode + "'"));
    std::string line;
    while (std::getline(in, line)) {
      std::string s;
      for (size_t i = 0; i < line.size(); ++i) {
        const bool newline = line[i] == '\\' && i + 1 < line.size() && line[i + 1] == 'n';
        s += newline ? '\n' : line[i];
        i += newline ? 1 : 0;
      }
      for (int id : tok->Encode(s)) std::printf("%d ", id);
      std::printf("\n");
    }
    return 0;
  }
  auto model = ll::Model::Load(dir + "/model.safetensors");
  if (!model.ok()) return Fail("model", model.status());
  const ll::Config& c = model->config();
  std::printf("model: dim %d, %d layers, %d q / %d kv heads, head_dim %d, vocab %d, rope %s\n",
              c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size,
              c.pairing == ll::RopePairing::kHalf ? "half" : "interleaved");

  if (!weights_path.empty()) {
    kvcd::SafetensorsWriter w = ll::KvProjectionFile(*model);
    w.SetMetadata("source", dir);
    auto s = w.WriteFile(weights_path);
    if (!s.ok()) return Fail("weights", s);
    std::printf("wrote %s: K/V projections of %d layers\n", weights_path.c_str(), c.n_layers);
  }
  // The FP32 reference over each line of a text file (at most max_tokens tokens a line),
  // recorded: calibration and dumps.
  auto record_lines = [&](const std::string& path, int max_tokens,
                          std::vector<ll::LocalAttention>* runs) -> absl::Status {
    std::ifstream in(path);
    if (!in) return absl::NotFoundError("cannot open '" + path + "'");
    std::string line;
    while (std::getline(in, line)) {
      std::vector<int> ids = tok->Encode(line);
      if (ids.empty()) continue;
      if (static_cast<int>(ids.size()) > max_tokens) ids.resize(static_cast<size_t>(max_tokens));
      runs->emplace_back(c);
      // Teacher-forced over the line: the prompt is the whole line, one step feeds its last token.
      auto r = ll::RunReference(*model, ids, 1, -1, &runs->back());
      if (!r.ok()) return r.status();
      std::fprintf(stderr, "%s: line %zu, %d tokens\n", path.c_str(), runs->size(),
                   runs->back().tokens());
    }
    if (runs->empty()) return absl::InvalidArgumentError("no tokens in '" + path + "'");
    return absl::OkStatus();
  };
  if (!dump_path.empty()) {
    std::vector<ll::LocalAttention> runs;
    if (auto s = record_lines(dump_text, dump_max, &runs); !s.ok()) return Fail("dump", s);
    std::vector<const ll::LocalAttention*> ptrs;
    for (const auto& r : runs) ptrs.push_back(&r);
    const kvcd::ActivationDump dump =
        ll::MakeActivationDump(c, ptrs, dir + ": FP32 reference over " + dump_text);
    auto s = kvcd::WriteActivationDump(dump, dump_path);
    if (!s.ok()) return Fail("dump", s);
    std::printf("wrote %s: %lld tokens from %zu lines\n", dump_path.c_str(),
                static_cast<long long>(dump.tokens), runs.size());
    return 0;
  }
  if (!weights_path.empty()) return 0;

  std::vector<int> ptoks;
  if (chat) {
    auto t = tok->EncodeChat(prompt);
    if (!t.ok()) return Fail("chat", t.status());
    ptoks = *t;
  } else {
    ptoks = tok->Encode(prompt);
  }
  if (ptoks.empty()) return Fail("prompt", absl::InvalidArgumentError("empty prompt"));
  const int stop = tok->eos();
  auto text = [&](const std::vector<int>& ids) {
    auto s = tok->Decode(ids);
    return s.ok() ? Printable(*s) : std::string("<bad ids>");
  };
  std::vector<int> teacher;  // --eval-text: the tokens fed after the prompt
  if (!eval_text.empty()) {
    std::ifstream in(eval_text);
    if (!in)
      return Fail("eval", absl::NotFoundError("cannot open --eval-text '" + eval_text + "'"));
    std::string all(std::istreambuf_iterator<char>(in), {});
    while (!all.empty() && all.back() == '\n') all.pop_back();
    std::vector<int> ids = tok->Encode(all);
    if (static_cast<int>(ids.size()) > c.max_seq_len)
      ids.resize(static_cast<size_t>(c.max_seq_len));
    if (static_cast<int>(ids.size()) <= eval_steps + 1) {
      return Fail("eval", absl::InvalidArgumentError(absl::StrCat(
                              "--eval-text has ", ids.size(),
                              " tokens, need more than --eval-steps ", eval_steps, " + 1")));
    }
    teacher.assign(ids.end() - eval_steps, ids.end());
    ptoks.assign(ids.begin(), ids.end() - eval_steps);
  }
  std::printf("prompt: %zu tokens: %s\n", ptoks.size(), text(ptoks).c_str());
  ll::LocalAttention recorded(c);  // the prefill, reused by the served runs
  auto ref = ll::RunReference(*model, ptoks, max_new, stop, &recorded,
                              teacher.empty() ? nullptr : &teacher);
  if (!ref.ok()) return Fail("reference", ref.status());
  std::printf("\n[reference, FP32 attention, %zu tokens, %.1f tokens/s]\n%s\n", ref->tokens.size(),
              ref->tokens.size() / ref->seconds, text(ref->tokens).c_str());
  if (target.empty()) return 0;

  std::vector<ll::LocalAttention> calib_runs;
  std::vector<const ll::LocalAttention*> calibration;
  if (!calib_text.empty()) {
    if (auto s = record_lines(calib_text, calib_max, &calib_runs); !s.ok()) {
      return Fail("calibration", s);
    }
    for (const auto& r : calib_runs) calibration.push_back(&r);
  }
  kvcd::ClientOptions co;
  co.target = target;
  auto client = kvcd::Client::Connect(co);
  if (!client.ok()) return Fail("connect", client.status());
  struct Row {
    std::string history;
    double tps = 0, history_bytes = 0, ratio_history = 0, ratio_run = 0;
    ll::Agreement agree;
  };
  std::vector<Row> rows;
  const int64_t tokens =
      static_cast<int64_t>(ptoks.size()) + static_cast<int64_t>(ref->tokens.size());
  for (const auto& h : histories) {
    std::string note;
    auto p = ll::ResolveHistory(h, *model, calibration, &note, sink);
    if (!p.ok()) return Fail("history", p.status());
    if (!note.empty()) std::printf("\n%s: %s\n", h.c_str(), note.c_str());
    p->name = absl::StrCat("llama-", rows.size());
    p->page_size = page;
    p->sink_tokens = sink;
    p->recent_tokens = recent;
    p->memory_bytes = int64_t{memory_mib} << 20;
    auto info = ll::RegisterProfile(**client, c, *p);
    if (!info.ok()) return Fail("RegisterModel", info.status());
    Row row;
    row.history = h;
    if (teacher.empty()) {
      auto run = ll::RunServed(**client, *model, *p, ptoks, max_new, stop, nullptr, &recorded);
      if (!run.ok()) return Fail("served run", run.status());
      row.tps = run->tokens.size() / run->seconds;
      std::printf("\n[%s history served by kvcd, %zu tokens, %.1f tokens/s]\n%s\n", h.c_str(),
                  run->tokens.size(), row.tps, text(run->tokens).c_str());
    }
    auto forced =
        ll::RunServed(**client, *model, *p, ptoks, max_new, stop, &ref->tokens, &recorded);
    if (!forced.ok()) return Fail("teacher-forced run", forced.status());
    if (!teacher.empty()) row.tps = forced->tokens.size() / forced->seconds;
    row.agree = ll::Compare(*ref, *forced);
    row.history_bytes = info->bytes_per_token_history();
    row.ratio_history = ll::DenseBytesPerToken(c) / row.history_bytes;
    row.ratio_run = ll::CompressionAt(c, *info, tokens);
    std::printf("%s: mean KL %.4g, max KL %.4g, first differs %d\n", h.c_str(), row.agree.mean_kl,
                row.agree.max_kl, row.agree.first_diff);
    rows.push_back(row);
  }
  std::printf(
      "\ndense BF16 K/V: %.0f B/token; ratio (run) counts the BF16 windows over %lld tokens\n",
      ll::DenseBytesPerToken(c), static_cast<long long>(tokens));
  std::printf("%-22s %10s %14s %10s %10s %11s %10s %11s\n", "history", "tokens/s", "first differs",
              "mean KL", "max KL", "hist B/tok", "ratio hist", "ratio (run)");
  for (const auto& r : rows) {
    std::printf("%-22s %10.1f %14s %10.3g %10.3g %11.1f %10.2f %11.2f\n", r.history.c_str(), r.tps,
                r.agree.first_diff < 0 ? "never" : std::to_string(r.agree.first_diff).c_str(),
                r.agree.mean_kl, r.agree.max_kl, r.history_bytes, r.ratio_history, r.ratio_run);
  }
  if (!json_path.empty()) {
    nlohmann::json j;
    j["model"] = dir;
    j["eval_text"] = eval_text;
    j["steps"] = static_cast<int64_t>(ref->tokens.size());
    j["tokens"] = tokens;
    j["page"] = page;
    j["sink"] = sink;
    j["recent"] = recent;
    j["dense_bytes_per_token"] = ll::DenseBytesPerToken(c);
    j["codecs"] = nlohmann::json::array();
    for (const auto& r : rows) {
      j["codecs"].push_back({{"name", r.history},
                             {"kl_mean", r.agree.mean_kl},
                             {"kl_max", r.agree.max_kl},
                             {"first_differs", r.agree.first_diff},
                             {"history_bytes_per_token", r.history_bytes},
                             {"compression_ratio_history", r.ratio_history},
                             {"compression_ratio", r.ratio_run}});
    }
    std::ofstream out(json_path);
    out << j.dump(2) << "\n";
    if (!out) return Fail("json", absl::InternalError("cannot write '" + json_path + "'"));
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
