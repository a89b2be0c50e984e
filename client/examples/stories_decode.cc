// kvcd_stories: a real language model (llama2.c checkpoint, e.g. stories260K) decoding
// with its attention served by kvcd, next to the same model with local FP32 attention.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/examples/stories_worker.h"
#include "common/activation_dump.h"

namespace {

constexpr char kUsage[] = R"(kvcd_stories — real-model decoding with attention served by kvcd

Usage: kvcd_stories --checkpoint stories260K.bin --tokenizer tok512.bin
                    [--target HOST:PORT] [--steps 100] [--prompt TEXT]
                    [--formats bf16,int2-identity,int2-hadamard,int2-oscar]
                    [--dump ACTIVATIONS.safetensors]

For each history format the model is registered on the daemon (stories260k-<format>,
page 4, sink 4, recent 8) and runs twice: greedy (the text) and teacher-forced on the
FP32 reference's tokens (first step whose greedy token differs, KL of the next-token
distributions). int2-oscar rotations are calibrated here on the model's own activations
(three reference runs). --dump writes the reference runs' post-RoPE activations as an
activation dump (for kvcd-calibrate / kvcd-eval) and exits without a daemon.
)";

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "kvcd_stories: %s: %s\n", what, std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, tokenizer, target = "127.0.0.1:50051", prompt, dump_path;
  std::vector<std::string> formats = {"bf16", "int2-identity", "int2-hadamard", "int2-oscar"};
  int steps = 100;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "kvcd_stories: %s needs a value\n%s", a.c_str(), kUsage);
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--checkpoint") {
      checkpoint = v;
    } else if (a == "--tokenizer") {
      tokenizer = v;
    } else if (a == "--target") {
      target = v;
    } else if (a == "--prompt") {
      prompt = v;
    } else if (a == "--dump") {
      dump_path = v;
    } else if (a == "--formats") {
      formats = absl::StrSplit(v, ',', absl::SkipEmpty());
    } else if (a == "--steps" && absl::SimpleAtoi(v, &steps) && steps > 0) {
    } else {
      std::fprintf(stderr, "kvcd_stories: bad flag %s %s\n%s", a.c_str(), v.c_str(), kUsage);
      return 2;
    }
  }
  if (checkpoint.empty() || tokenizer.empty()) {
    std::fprintf(stderr, "kvcd_stories: --checkpoint and --tokenizer are required\n%s", kUsage);
    return 2;
  }
  namespace l2 = kvcd::llama2;
  auto model = l2::Model::Load(checkpoint);
  if (!model.ok()) return Fail("checkpoint", model.status());
  auto tok = l2::Tokenizer::Load(tokenizer, model->config().vocab_size);
  if (!tok.ok()) return Fail("tokenizer", tok.status());
  const auto& c = model->config();
  if (steps > c.seq_len) steps = c.seq_len;
  const std::vector<int> ptoks = tok->Encode(prompt);
  std::printf("model: dim %d, %d layers, %d q / %d kv heads, head_dim %d, vocab %d\n", c.dim,
              c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(), c.vocab_size);

  l2::LocalAttention calib(c), calib2(c), calib3(c);
  auto ref = l2::RunReference(*model, *tok, ptoks, steps, &calib);
  if (!ref.ok()) return Fail("reference", ref.status());
  std::printf("\n[reference, FP32 attention, %.1f tokens/s]\n%s\n", steps / ref->seconds,
              ref->text.c_str());

  if (!dump_path.empty()) {
    (void)l2::RunReference(*model, *tok, tok->Encode("Tom had a big dog"), 256, &calib2);
    (void)l2::RunReference(*model, *tok, tok->Encode("The sun was hot"), 256, &calib3);
    kvcd::ActivationDump dump;
    dump.num_layers = c.n_layers;
    dump.num_q_heads = c.n_heads;
    dump.num_kv_heads = c.n_kv_heads;
    dump.head_dim = c.head_dim();
    dump.source = checkpoint + ": greedy from BOS + 2 prompts";
    for (int l = 0; l < c.n_layers; ++l) {
      kvcd::LayerActivations a;
      for (const l2::LocalAttention* run : {&calib, &calib2, &calib3}) {
        a.q.insert(a.q.end(), run->queries(l).begin(), run->queries(l).end());
        a.k.insert(a.k.end(), run->keys(l).begin(), run->keys(l).end());
        a.v.insert(a.v.end(), run->values(l).begin(), run->values(l).end());
      }
      dump.tokens = static_cast<int64_t>(a.k.size()) / c.kv_dim();
      dump.layers.push_back(std::move(a));
    }
    auto s = kvcd::WriteActivationDump(dump, dump_path);
    if (!s.ok()) return Fail("dump", s);
    std::printf("wrote %s: %lld tokens\n", dump_path.c_str(), static_cast<long long>(dump.tokens));
    return 0;
  }
  kvcd::ClientOptions co;
  co.target = target;
  auto client = kvcd::Client::Connect(co);
  if (!client.ok()) return Fail("connect", client.status());
  std::string codec;
  for (const auto& f : formats) {
    if (f != "int2-oscar") continue;
    (void)l2::RunReference(*model, *tok, tok->Encode("Tom had a big dog"), 64, &calib2);
    (void)l2::RunReference(*model, *tok, tok->Encode("The sun was hot"), 64, &calib3);
    codec = l2::CalibrateCodec(c, {&calib, &calib2, &calib3});
  }
  struct Row {
    std::string format;
    double tps = 0, mean_kl = 0, max_kl = 0;
    int first_diff = -1;
  };
  std::vector<Row> rows;
  for (const auto& f : formats) {
    const std::string name = "stories260k-" + f;
    absl::Status reg = l2::RegisterProfile(**client, c, name, f, codec);
    if (!reg.ok()) return Fail("RegisterModel", reg);
    auto run = l2::RunServed(**client, *model, *tok, name, ptoks, steps);
    if (!run.ok()) return Fail("served run", run.status());
    auto forced = l2::RunServed(**client, *model, *tok, name, ptoks, steps, &ref->tokens);
    if (!forced.ok()) return Fail("teacher-forced run", forced.status());
    Row row;
    row.format = f;
    row.tps = (steps - static_cast<int>(ptoks.size()) + 1) / run->seconds;
    const size_t first = ptoks.size() - 1;
    for (size_t i = 0; i < forced->logits.size(); ++i) {
      const auto& rl = ref->logits[first + i];
      const double kl = l2::KlDivergence(rl, forced->logits[i]);
      row.mean_kl += kl / forced->logits.size();
      row.max_kl = std::max(row.max_kl, kl);
      if (row.first_diff < 0 && l2::Argmax(rl) != l2::Argmax(forced->logits[i])) {
        row.first_diff = static_cast<int>(first + i);
      }
    }
    std::printf("\n[%s history served by kvcd, %.1f tokens/s]\n%s\n", f.c_str(), row.tps,
                run->text.c_str());
    rows.push_back(row);
  }
  std::printf("\n%-16s %12s %14s %12s %12s\n", "history", "tokens/s", "first differs", "mean KL",
              "max KL");
  for (const auto& r : rows) {
    std::printf("%-16s %12.1f %14s %12.3g %12.3g\n", r.format.c_str(), r.tps,
                r.first_diff < 0 ? "never" : std::to_string(r.first_diff).c_str(), r.mean_kl,
                r.max_kl);
  }
  return 0;
}
