// kvcd_stories: a llama2.c checkpoint (e.g. stories260K) decoding with its attention served
// by kvcd, next to the same model with local FP32 attention: the llama worker
// (llama_worker.h) configured for a llama2.c model, its tokenizer and small windows.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/activation_dump.h"
#include "common/cli.h"
#include "common/safetensors.h"
#include "examples/llama2c_tokenizer.h"
#include "examples/llama_worker.h"

ABSL_FLAG(std::string, checkpoint, "", "llama2.c checkpoint (e.g. stories260K.bin)");
ABSL_FLAG(std::string, tokenizer, "", "llama2.c tokenizer (e.g. tok512.bin)");
ABSL_FLAG(std::string, target, "127.0.0.1:50051", "daemon address HOST:PORT");
ABSL_FLAG(int32_t, steps, 100, "positions decoded (at most the model's max_seq_len)");
ABSL_FLAG(std::string, prompt, "", "prompt of the runs");
ABSL_FLAG(std::string, formats, "bf16,int2-identity,int2-hadamard,int2-oscar",
          "history formats served by the daemon, comma-separated");
ABSL_FLAG(std::string, calib_prompts, "", "';'-separated prompts of the calibration runs");
ABSL_FLAG(int32_t, calib_steps, 512, "positions of each calibration run");
ABSL_FLAG(int32_t, page, 4, "page size of the registered model");
ABSL_FLAG(int32_t, sink, 4, "BF16 sink tokens of the registered model");
ABSL_FLAG(int32_t, recent, 8, "BF16 recent tokens of the registered model");
ABSL_FLAG(std::string, dump, "", "write the reference runs as an activation dump and exit");
ABSL_FLAG(std::string, dump_prompts, "", "--dump: ';'-separated prompts, one run each");
ABSL_FLAG(std::string, weights, "", "write the model's K/V projections here");
ABSL_FLAG(std::string, logits, "", "write the FP32 reference run's inputs and logits here");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd_stories",
      .summary = "real-model decoding with attention served by kvcd",
      .files = {__FILE__},
      .synopsis = R"(--checkpoint stories260K.bin --tokenizer tok512.bin
    [--target HOST:PORT] [--steps 100] [--prompt TEXT]
    [--formats bf16,int2-identity,int2-hadamard,int2-oscar,
               int2-oscar=CODEC,fsq=CODEC,fsq:G=N]
    [--calib-prompts 'A;B' [--calib-steps 512]]
    [--page 4] [--sink 4] [--recent 8]
    [--dump ACTIVATIONS.safetensors [--dump-prompts 'A;B']
     [--weights WEIGHTS.safetensors] [--logits LOGITS.safetensors]])",
      .notes =
          R"(For each history format the model is registered on the daemon (page 4, sink 4, recent 8 by
default) and runs twice: greedy (the text) and teacher-forced on the FP32 reference's
tokens: the first position whose greedy token differs, KL(FP32 || served) of the
next-token distributions over the served steps, and the bytes the daemon stores per token
(history alone, and over the whole run with the BF16 windows) against dense BF16 K/V.
int2-oscar rotations and fsq:G=N codecs (tools/fsq_calibration: PCA encoder, ridge
decoder) are calibrated here on the model's own runs: greedy runs of --calib-steps
positions from each --calib-prompts prompt, or by default the reference run plus two
fixed prompts (64 positions each). fsq=CODEC serves an FSQ codec file (kvcd-calibrate
fsq, or fine-tuned by tools/fsq_finetune). --dump writes the reference runs' post-RoPE
activations and the attention blocks' normalized residuals (layers.<l>.x) as an
activation dump (for kvcd-calibrate / kvcd-eval) and exits without a daemon. Its runs
are the greedy run from --prompt plus two fixed prompts (256 positions each), or, with
--dump-prompts, one greedy run of --steps positions per ';'-separated prompt (one prompt
= one sequence whose row t is position t, as kvcd-eval's FSQ codecs need). --weights
writes the model's K/V projections as safetensors (layers.<l>.wk, layers.<l>.wv [kv_dim,
dim], F32; no biases in llama2.c) for `kvcd-calibrate fsq`; --logits writes the FP32
reference run from --prompt (inputs [steps] I32: the token fed at each position; logits
[steps, vocab] F32) to check another implementation of the model against this one.)"};
  return program;
}

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "kvcd_stories: %s: %s\n", what, std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  namespace ll = kvcd::llama;
  kvcd::cli::Parse(Cli(), argc, argv);
  const std::string checkpoint = absl::GetFlag(FLAGS_checkpoint),
                    tokenizer = absl::GetFlag(FLAGS_tokenizer),
                    target = absl::GetFlag(FLAGS_target), prompt = absl::GetFlag(FLAGS_prompt),
                    dump_path = absl::GetFlag(FLAGS_dump),
                    weights_path = absl::GetFlag(FLAGS_weights),
                    logits_path = absl::GetFlag(FLAGS_logits);
  const std::vector<std::string> dump_prompts =
      absl::StrSplit(absl::GetFlag(FLAGS_dump_prompts), ';', absl::SkipEmpty());
  const std::vector<std::string> calib_prompts =
      absl::StrSplit(absl::GetFlag(FLAGS_calib_prompts), ';', absl::SkipEmpty());
  const std::vector<std::string> formats =
      absl::StrSplit(absl::GetFlag(FLAGS_formats), ',', absl::SkipEmpty());
  int steps = absl::GetFlag(FLAGS_steps), calib_steps = absl::GetFlag(FLAGS_calib_steps);
  const int page = absl::GetFlag(FLAGS_page), sink = absl::GetFlag(FLAGS_sink),
            recent = absl::GetFlag(FLAGS_recent);
  const std::pair<const char*, int> counts[] = {{"--steps", steps},
                                                {"--page", page},
                                                {"--sink", sink},
                                                {"--recent", recent},
                                                {"--calib-steps", calib_steps}};
  for (const auto& [flag, value] : counts) {
    if (value < 1) {
      return kvcd::cli::UsageError(
          Cli(), nullptr, absl::StrCat("bad value for ", flag, ": ", value, " (at least 1)"));
    }
  }
  if (checkpoint.empty() || tokenizer.empty()) {
    return kvcd::cli::UsageError(Cli(), nullptr, "--checkpoint and --tokenizer are required");
  }
  auto model = ll::Model::LoadLlama2c(checkpoint);
  if (!model.ok()) return Fail("checkpoint", model.status());
  const ll::Config& c = model->config();
  auto tok = ll::Llama2cTokenizer::Load(tokenizer, c.vocab_size);
  if (!tok.ok()) return Fail("tokenizer", tok.status());
  steps = std::min(steps, c.max_seq_len);
  calib_steps = std::min(calib_steps, c.max_seq_len);
  const std::vector<int> ptoks = tok->Encode(prompt);
  if (static_cast<int>(ptoks.size()) > steps) {
    return Fail("prompt",
                absl::InvalidArgumentError(absl::StrCat("prompt of ", ptoks.size(),
                                                        " tokens is longer than --steps ", steps)));
  }
  std::printf("model: dim %d, %d layers, %d q / %d kv heads, head_dim %d, vocab %d\n", c.dim,
              c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size);
  // A run over `positions` positions (0 .. positions-1): the prompt, then greedy tokens.
  auto greedy = [&](const std::vector<int>& p, int positions, ll::LocalAttention* rec) {
    return ll::RunReference(*model, p, positions - static_cast<int>(p.size()) + 1, -1, rec);
  };

  ll::LocalAttention calib(c);
  auto ref = greedy(ptoks, steps, &calib);
  if (!ref.ok()) return Fail("reference", ref.status());
  std::printf("\n[reference, FP32 attention, %.1f tokens/s]\n%s\n",
              ref->tokens.size() / ref->seconds,
              tok->Decode(ptoks[0],
                          [&] {
                            std::vector<int> all(ptoks.begin() + 1, ptoks.end());
                            all.insert(all.end(), ref->tokens.begin(), ref->tokens.end());
                            return all;
                          }())
                  .c_str());

  if (!logits_path.empty()) {
    // Teacher-forced from BOS on the same tokens, so that every position has its logits.
    std::vector<int> fed(ptoks.begin() + 1, ptoks.end());
    fed.insert(fed.end(), ref->tokens.begin(), ref->tokens.end());
    auto full = ll::RunReference(*model, {ptoks[0]}, 0, -1, nullptr, &fed);
    if (!full.ok()) return Fail("logits", full.status());
    kvcd::SafetensorsWriter w;
    std::vector<int32_t> inputs = {ptoks[0]};
    inputs.insert(inputs.end(), fed.begin(), fed.end() - 1);
    std::vector<float> logits;
    for (const auto& l : full->logits) logits.insert(logits.end(), l.begin(), l.end());
    w.Add("inputs", "I32", {steps}, inputs.data(), static_cast<int64_t>(inputs.size()) * 4);
    w.AddF32("logits", {steps, c.vocab_size}, logits);
    w.SetMetadata("source", checkpoint + ": FP32 reference, prompt '" + prompt + "'");
    auto s = w.WriteFile(logits_path);
    if (!s.ok()) return Fail("logits", s);
    std::printf("wrote %s: %d positions\n", logits_path.c_str(), steps);
  }
  if (!weights_path.empty()) {
    kvcd::SafetensorsWriter w = ll::KvProjectionFile(*model);
    w.SetMetadata("source", checkpoint);
    auto s = w.WriteFile(weights_path);
    if (!s.ok()) return Fail("weights", s);
    std::printf("wrote %s: K/V projections of %d layers\n", weights_path.c_str(), c.n_layers);
  }
  if (!dump_path.empty()) {
    std::vector<ll::LocalAttention> runs;
    std::string source = checkpoint + ": greedy from BOS + 2 prompts";
    if (dump_prompts.empty()) {
      runs = {calib, ll::LocalAttention(c), ll::LocalAttention(c)};
      for (int r = 1; r < 3; ++r) {
        auto g = greedy(tok->Encode(r == 1 ? "Tom had a big dog" : "The sun was hot"),
                        std::min(256, c.max_seq_len), &runs[r]);
        if (!g.ok()) return Fail("dump run", g.status());
      }
    } else {
      source = checkpoint + ": greedy, " + std::to_string(steps) + " positions from";
      runs.reserve(dump_prompts.size());
      for (const auto& p : dump_prompts) {
        runs.emplace_back(c);
        auto r = greedy(tok->Encode(p), steps, &runs.back());
        if (!r.ok()) return Fail("dump run", r.status());
        source += " '" + p + "'";
      }
    }
    std::vector<const ll::LocalAttention*> ptrs;
    for (const auto& r : runs) ptrs.push_back(&r);
    auto s = kvcd::WriteActivationDump(ll::MakeActivationDump(c, ptrs, source), dump_path);
    if (!s.ok()) return Fail("dump", s);
    int64_t n = 0;
    for (const auto& r : runs) n += r.tokens();
    std::printf("wrote %s: %lld tokens\n", dump_path.c_str(), static_cast<long long>(n));
  }
  if (!dump_path.empty() || !weights_path.empty() || !logits_path.empty()) return 0;

  kvcd::ClientOptions co;
  co.target = target;
  auto client = kvcd::Client::Connect(co);
  if (!client.ok()) return Fail("connect", client.status());
  // Calibration runs for in-process codecs (int2-oscar, fsq:G=N).
  std::vector<ll::LocalAttention> calib_runs;
  std::vector<const ll::LocalAttention*> calibration;
  if (calib_prompts.empty()) {
    calib_runs = {ll::LocalAttention(c), ll::LocalAttention(c)};
    calibration = {&calib, &calib_runs[0], &calib_runs[1]};
    for (int r = 0; r < 2; ++r) {
      auto g =
          greedy(tok->Encode(r == 0 ? "Tom had a big dog" : "The sun was hot"), 64, &calib_runs[r]);
      if (!g.ok()) return Fail("calibration run", g.status());
    }
  } else {
    calib_runs.reserve(calib_prompts.size());
    for (const auto& p : calib_prompts) {
      calib_runs.emplace_back(c);
      auto g = greedy(tok->Encode(p), calib_steps, &calib_runs.back());
      if (!g.ok()) return Fail("calibration run", g.status());
      calibration.push_back(&calib_runs.back());
    }
  }
  struct Row {
    std::string format;
    double tps = 0, history_bytes = 0, ratio_history = 0, ratio_run = 0;
    ll::Agreement agree;
  };
  std::vector<Row> rows;
  const int prefill = static_cast<int>(ptoks.size()) - 1;
  for (const auto& f : formats) {
    std::string note;
    auto p = ll::ResolveHistory(f, *model, calibration, &note);
    if (!p.ok()) return Fail("history", p.status());
    if (!note.empty()) std::printf("\n%s: %s\n", f.c_str(), note.c_str());
    p->name = absl::StrCat("stories260k-", rows.size());
    p->page_size = page;
    p->sink_tokens = sink;
    p->recent_tokens = recent;
    p->memory_bytes = 4 << 20;
    auto info = ll::RegisterProfile(**client, c, *p);
    if (!info.ok()) return Fail("RegisterModel", info.status());
    auto run = ll::RunServed(**client, *model, *p, ptoks, steps - prefill);
    if (!run.ok()) return Fail("served run", run.status());
    auto forced = ll::RunServed(**client, *model, *p, ptoks, 0, -1, &ref->tokens);
    if (!forced.ok()) return Fail("teacher-forced run", forced.status());
    Row row;
    row.format = f;
    row.tps = run->tokens.size() / run->seconds;
    row.agree = ll::Compare(*ref, *forced);
    row.history_bytes = info->bytes_per_token_history();
    row.ratio_history = ll::DenseBytesPerToken(c) / row.history_bytes;
    row.ratio_run = ll::CompressionAt(c, *info, steps);
    std::vector<int> text(ptoks.begin() + 1, ptoks.end());
    text.insert(text.end(), run->tokens.begin(), run->tokens.end());
    std::printf("\n[%s history served by kvcd, %.1f tokens/s]\n%s\n", f.c_str(), row.tps,
                tok->Decode(ptoks[0], text).c_str());
    rows.push_back(row);
  }
  std::printf(
      "\ndense BF16 K/V: %.0f B/token; ratio (run) counts the BF16 windows over %d tokens\n",
      ll::DenseBytesPerToken(c), steps);
  std::printf("%-22s %10s %14s %10s %10s %11s %10s %11s\n", "history", "tokens/s", "first differs",
              "mean KL", "max KL", "hist B/tok", "ratio hist", "ratio (run)");
  for (const auto& r : rows) {
    std::printf(
        "%-22s %10.1f %14s %10.3g %10.3g %11.1f %10.2f %11.2f\n", r.format.c_str(), r.tps,
        r.agree.first_diff < 0 ? "never" : std::to_string(prefill + r.agree.first_diff).c_str(),
        r.agree.mean_kl, r.agree.max_kl, r.history_bytes, r.ratio_history, r.ratio_run);
  }
  return 0;
}
