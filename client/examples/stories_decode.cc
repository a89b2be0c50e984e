// kvcd_stories: a real language model (llama2.c checkpoint, e.g. stories260K) decoding
// with its attention served by kvcd, next to the same model with local FP32 attention.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/examples/stories_worker.h"
#include "common/activation_dump.h"
#include "common/safetensors.h"

namespace {

constexpr char kUsage[] = R"(kvcd_stories — real-model decoding with attention served by kvcd

Usage: kvcd_stories --checkpoint stories260K.bin --tokenizer tok512.bin
                    [--target HOST:PORT] [--steps 100] [--prompt TEXT]
                    [--formats bf16,int2-identity,int2-hadamard,int2-oscar]
                    [--dump ACTIVATIONS.safetensors [--dump-prompts 'A;B']
                     [--weights WEIGHTS.safetensors] [--logits LOGITS.safetensors]]

For each history format the model is registered on the daemon (stories260k-<format>,
page 4, sink 4, recent 8) and runs twice: greedy (the text) and teacher-forced on the
FP32 reference's tokens (first step whose greedy token differs, KL of the next-token
distributions). int2-oscar rotations are calibrated here on the model's own activations
(three reference runs). --dump writes the reference runs' post-RoPE activations and the
attention blocks' normalized residuals (layers.<l>.x) as an activation dump (for
kvcd-calibrate / kvcd-eval) and exits without a daemon. Its runs are the greedy run from
--prompt plus two fixed prompts (256 positions each), or, with --dump-prompts, one greedy
run of --steps positions per ';'-separated prompt (one prompt = one sequence whose row t
is position t, as kvcd-eval's FSQ codecs need). --weights writes the model's K/V
projections as safetensors (layers.<l>.wk, layers.<l>.wv [kv_dim, dim], F32; no biases in
llama2.c) for `kvcd-calibrate fsq`; --logits writes the FP32 reference run from --prompt
(inputs [steps] I32: the token fed at each position; logits [steps, vocab] F32) to check
another implementation of the model against this one.
)";

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "kvcd_stories: %s: %s\n", what, std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string checkpoint, tokenizer, target = "127.0.0.1:50051", prompt, dump_path, weights_path,
                                     logits_path;
  std::vector<std::string> dump_prompts;
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
    } else if (a == "--dump-prompts") {
      dump_prompts = absl::StrSplit(v, ';', absl::SkipEmpty());
    } else if (a == "--weights") {
      weights_path = v;
    } else if (a == "--logits") {
      logits_path = v;
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

  if (!logits_path.empty()) {
    kvcd::SafetensorsWriter w;
    std::vector<int32_t> inputs;
    std::vector<float> logits;
    for (int pos = 0; pos < steps; ++pos) {
      inputs.push_back(pos == 0 ? ptoks[0] : ref->tokens[pos - 1]);
      logits.insert(logits.end(), ref->logits[pos].begin(), ref->logits[pos].end());
    }
    w.Add("inputs", "I32", {steps}, inputs.data(), static_cast<int64_t>(inputs.size()) * 4);
    w.AddF32("logits", {steps, c.vocab_size}, logits);
    w.SetMetadata("source", checkpoint + ": FP32 reference, prompt '" + prompt + "'");
    auto s = w.WriteFile(logits_path);
    if (!s.ok()) return Fail("logits", s);
    std::printf("wrote %s: %d positions\n", logits_path.c_str(), steps);
  }
  if (!weights_path.empty()) {
    kvcd::SafetensorsWriter w;
    const int64_t n = int64_t{c.kv_dim()} * c.dim;
    for (int l = 0; l < c.n_layers; ++l) {
      w.AddF32("layers." + std::to_string(l) + ".wk", {c.kv_dim(), c.dim},
               std::vector<float>(model->wk(l), model->wk(l) + n));
      w.AddF32("layers." + std::to_string(l) + ".wv", {c.kv_dim(), c.dim},
               std::vector<float>(model->wv(l), model->wv(l) + n));
    }
    w.SetMetadata("source", checkpoint);
    auto s = w.WriteFile(weights_path);
    if (!s.ok()) return Fail("weights", s);
    std::printf("wrote %s: K/V projections of %d layers\n", weights_path.c_str(), c.n_layers);
  }
  if (!dump_path.empty()) {
    std::vector<l2::LocalAttention> runs;
    std::string source = checkpoint + ": greedy from BOS + 2 prompts";
    if (dump_prompts.empty()) {
      runs = {calib, l2::LocalAttention(c), l2::LocalAttention(c)};
      (void)l2::RunReference(*model, *tok, tok->Encode("Tom had a big dog"), 256, &runs[1]);
      (void)l2::RunReference(*model, *tok, tok->Encode("The sun was hot"), 256, &runs[2]);
    } else {
      source = checkpoint + ": greedy, " + std::to_string(steps) + " positions from";
      for (const auto& p : dump_prompts) {
        runs.emplace_back(c);
        auto r = l2::RunReference(*model, *tok, tok->Encode(p), steps, &runs.back());
        if (!r.ok()) return Fail("dump run", r.status());
        source += " '" + p + "'";
      }
    }
    kvcd::ActivationDump dump;
    dump.num_layers = c.n_layers;
    dump.num_q_heads = c.n_heads;
    dump.num_kv_heads = c.n_kv_heads;
    dump.head_dim = c.head_dim();
    dump.residual_width = c.dim;
    dump.source = source;
    for (int l = 0; l < c.n_layers; ++l) {
      kvcd::LayerActivations a;
      std::vector<float> x;
      for (const l2::LocalAttention& run : runs) {
        a.q.insert(a.q.end(), run.queries(l).begin(), run.queries(l).end());
        a.k.insert(a.k.end(), run.keys(l).begin(), run.keys(l).end());
        a.v.insert(a.v.end(), run.values(l).begin(), run.values(l).end());
        x.insert(x.end(), run.residuals(l).begin(), run.residuals(l).end());
      }
      dump.tokens = static_cast<int64_t>(a.k.size()) / c.kv_dim();
      dump.layers.push_back(std::move(a));
      dump.x.push_back(std::move(x));
    }
    auto s = kvcd::WriteActivationDump(dump, dump_path);
    if (!s.ok()) return Fail("dump", s);
    std::printf("wrote %s: %lld tokens\n", dump_path.c_str(), static_cast<long long>(dump.tokens));
  }
  if (!dump_path.empty() || !weights_path.empty() || !logits_path.empty()) return 0;
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
