// kvcd-llama: a llama-family model (e.g. SmolLM2-135M-Instruct, fetched and converted by
// scripts/fetch-smollm2.sh) generating greedily on the CPU, with local FP32 attention and,
// given a daemon, with its attention served by kvcd; or dumping its real activations.
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/examples/bpe_tokenizer.h"
#include "client/examples/llama_worker.h"
#include "common/activation_dump.h"

namespace {

constexpr char kUsage[] = R"(kvcd-llama — a llama-family model with its attention served by kvcd

Usage: kvcd-llama --model DIR [--prompt TEXT] [--chat] [--max-new 32]
                  [--target HOST:PORT] [--histories bf16,int2-identity,int2-hadamard,
                                                    int2-oscar=CODEC.safetensors]
                  [--page 16] [--sink 16] [--recent 32]
       kvcd-llama --model DIR --dump OUT.safetensors --dump-text FILE [--dump-max-tokens 512]
       kvcd-llama --model DIR --encode FILE

DIR holds model.safetensors and tokenizer.txt (scripts/fetch-smollm2.sh prints it).
Without --target: greedy generation with local FP32 attention (the reference), stopping at
the end-of-turn token. --chat wraps the prompt in the model's chat template (one user
turn). With --target, for each history format the model is registered on the daemon
(<model>-<format>, the given page size and BF16 windows), generates greedily, and then
runs teacher-forced on the reference's tokens: the table gives the first step whose
greedy token differs and KL(FP32 || served) of the next-token distributions.
--dump runs the reference over each line of FILE (tokens concatenated, each line at most
--dump-max-tokens) and writes the post-RoPE q, k, v of every layer as an activation dump
for kvcd-calibrate / kvcd-eval. --encode prints the token ids of each line of FILE (the
two characters \n stand for a newline; tools/check_tokenizer_hf.py compares them with the
Hugging Face tokenizers library).
)";

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
  std::string dir, prompt = "The capital of France is", target, dump_path, dump_text, encode;
  std::vector<std::string> histories = {"bf16", "int2-identity", "int2-hadamard"};
  bool chat = false;
  int max_new = 32, page = 16, sink = 16, recent = 32, dump_max = 512;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--chat") {
      chat = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "kvcd-llama: %s needs a value\n%s", a.c_str(), kUsage);
      return 2;
    }
    const std::string v = argv[++i];
    auto positive = [&](int* out) { return absl::SimpleAtoi(v, out) && *out > 0; };
    if (a == "--model") {
      dir = v;
    } else if (a == "--prompt") {
      prompt = v;
    } else if (a == "--target") {
      target = v;
    } else if (a == "--dump") {
      dump_path = v;
    } else if (a == "--encode") {
      encode = v;
    } else if (a == "--dump-text") {
      dump_text = v;
    } else if (a == "--histories") {
      histories = absl::StrSplit(v, ',', absl::SkipEmpty());
    } else if ((a == "--max-new" && positive(&max_new)) || (a == "--page" && positive(&page)) ||
               (a == "--sink" && positive(&sink)) || (a == "--recent" && positive(&recent)) ||
               (a == "--dump-max-tokens" && positive(&dump_max))) {
    } else {
      std::fprintf(stderr, "kvcd-llama: bad flag %s %s\n%s", a.c_str(), v.c_str(), kUsage);
      return 2;
    }
  }
  if (dir.empty()) {
    std::fprintf(stderr, "kvcd-llama: --model DIR is required\n%s", kUsage);
    return 2;
  }
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

  if (!dump_path.empty()) {
    std::ifstream in(dump_text);
    if (!in)
      return Fail("dump", absl::NotFoundError("cannot open --dump-text '" + dump_text + "'"));
    kvcd::ActivationDump dump;
    dump.num_layers = c.n_layers;
    dump.num_q_heads = c.n_heads;
    dump.num_kv_heads = c.n_kv_heads;
    dump.head_dim = c.head_dim;
    dump.source = dir + ": FP32 reference over " + dump_text;
    dump.layers.resize(static_cast<size_t>(c.n_layers));
    std::string line;
    int prompts = 0;
    while (std::getline(in, line)) {
      std::vector<int> ids = tok->Encode(line);
      if (ids.empty()) continue;
      if (static_cast<int>(ids.size()) > dump_max) ids.resize(static_cast<size_t>(dump_max));
      ll::LocalAttention rec(c);
      // Teacher-forced over the line: the prompt is the whole line, one step feeds its last token.
      auto r = ll::RunReference(*model, ids, 1, -1, &rec);
      if (!r.ok()) return Fail("dump", r.status());
      for (int l = 0; l < c.n_layers; ++l) {
        auto& a = dump.layers[l];
        a.q.insert(a.q.end(), rec.queries(l).begin(), rec.queries(l).end());
        a.k.insert(a.k.end(), rec.keys(l).begin(), rec.keys(l).end());
        a.v.insert(a.v.end(), rec.values(l).begin(), rec.values(l).end());
      }
      dump.tokens += rec.tokens();
      ++prompts;
      std::fprintf(stderr, "dump: line %d, %d tokens\n", prompts, rec.tokens());
    }
    if (dump.tokens == 0)
      return Fail("dump", absl::InvalidArgumentError("no tokens in --dump-text"));
    auto s = kvcd::WriteActivationDump(dump, dump_path);
    if (!s.ok()) return Fail("dump", s);
    std::printf("wrote %s: %lld tokens from %d lines\n", dump_path.c_str(),
                static_cast<long long>(dump.tokens), prompts);
    return 0;
  }

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
  std::printf("prompt: %zu tokens: %s\n", ptoks.size(), text(ptoks).c_str());
  auto ref = ll::RunReference(*model, ptoks, max_new, stop);
  if (!ref.ok()) return Fail("reference", ref.status());
  std::printf("\n[reference, FP32 attention, %zu tokens, %.1f tokens/s]\n%s\n", ref->tokens.size(),
              ref->tokens.size() / ref->seconds, text(ref->tokens).c_str());
  if (target.empty()) return 0;

  kvcd::ClientOptions co;
  co.target = target;
  auto client = kvcd::Client::Connect(co);
  if (!client.ok()) return Fail("connect", client.status());
  struct Row {
    std::string history;
    double tps = 0, mean_kl = 0, max_kl = 0;
    int first_diff = -1;
  };
  std::vector<Row> rows;
  for (const auto& h : histories) {
    ll::ServedProfile p;
    p.name = "llama-" + h;
    p.history = h;
    if (absl::StartsWith(h, "int2-oscar=")) {  // a codec file from kvcd-calibrate
      const std::string path = h.substr(std::string("int2-oscar=").size());
      std::ifstream in(path, std::ios::binary);
      if (!in) return Fail("codec", absl::NotFoundError("cannot open codec file '" + path + "'"));
      p.codec_blob.assign(std::istreambuf_iterator<char>(in), {});
      p.history = "int2-oscar";
      p.name = absl::StrCat("llama-oscar-", rows.size());
    }
    p.page_size = page;
    p.sink_tokens = sink;
    p.recent_tokens = recent;
    absl::Status reg = ll::RegisterProfile(**client, c, p);
    if (!reg.ok()) return Fail("RegisterModel", reg);
    auto run = ll::RunServed(**client, *model, p.name, ptoks, max_new, stop);
    if (!run.ok()) return Fail("served run", run.status());
    auto forced = ll::RunServed(**client, *model, p.name, ptoks, max_new, stop, &ref->tokens);
    if (!forced.ok()) return Fail("teacher-forced run", forced.status());
    Row row;
    row.history = h;
    row.tps = run->tokens.size() / run->seconds;
    for (size_t i = 0; i < forced->logits.size(); ++i) {
      const double kl = ll::KlDivergence(ref->logits[i], forced->logits[i]);
      row.mean_kl += kl / forced->logits.size();
      row.max_kl = std::max(row.max_kl, kl);
      if (row.first_diff < 0 && ll::Argmax(ref->logits[i]) != ll::Argmax(forced->logits[i])) {
        row.first_diff = static_cast<int>(i);
      }
    }
    std::printf("\n[%s history served by kvcd, %zu tokens, %.1f tokens/s]\n%s\n", h.c_str(),
                run->tokens.size(), row.tps, text(run->tokens).c_str());
    rows.push_back(row);
  }
  std::printf("\n%-16s %12s %14s %12s %12s\n", "history", "tokens/s", "first differs", "mean KL",
              "max KL");
  for (const auto& r : rows) {
    std::printf("%-16s %12.1f %14s %12.3g %12.3g\n", r.history.c_str(), r.tps,
                r.first_diff < 0 ? "never" : std::to_string(r.first_diff).c_str(), r.mean_kl,
                r.max_kl);
  }
  return 0;
}
