// kvcd-calibrate: OSCAR rotations (and optionally clip quantiles) from an activation dump,
// written as the codec file the daemon loads (codec_file: / RegisterModel codec_blob).
#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "common/activation_dump.h"
#include "common/cli.h"
#include "testing/synthetic_activations.h"
#include "tools/calibration.h"
#include "tools/fsq_calibration.h"
#include "tools/progress.h"

ABSL_FLAG(std::string, dump, "", "activation dump (safetensors; docs/calibration.md)");
ABSL_FLAG(std::string, out, "", "codec file to write (synth: the dump to write)");
ABSL_FLAG(double, holdout, 0.2, "last fraction of the tokens: not fitted, scored");
ABSL_FLAG(bool, search_clip, false, "grid-search rho_k, then rho_v, per layer");
ABSL_FLAG(bool, per_head, false, "one rotation and clip pair per KV head (codec file version 2)");
ABSL_FLAG(bool, hadamard, false, "keep R = H (the data-free rotation); fit only the clips");
ABSL_FLAG(bool, joint_clip, false, "alternate keys and values until neither quantile changes");
ABSL_FLAG(float, clip_floor, kvcd::CalibrationOptions{}.clip_floor,
          "lowest quantile of the clip grid (0, 1]");
ABSL_FLAG(int64_t, sink, kvcd::StoredWindows{}.sink, "BF16 sink tokens of the scoring");
ABSL_FLAG(int64_t, recent, kvcd::StoredWindows{}.recent, "BF16 recent tokens of the scoring");
ABSL_FLAG(int32_t, max_queries, kvcd::CalibrationOptions{}.max_queries,
          "held-out queries scored, evenly spaced");
ABSL_FLAG(std::string, weights, "", "fsq: the model's K/V projections (safetensors)");
ABSL_FLAG(int32_t, latent, 0, "fsq: latent width G");
ABSL_FLAG(double, lambda, kvcd::FsqCalibrationOptions{}.lambda, "fsq: ridge of the decoder fit");
ABSL_FLAG(float, key_norm_eps, kvcd::FsqCalibrationOptions{}.key_norm_eps,
          "fsq: epsilon of the key norm");
ABSL_FLAG(int64_t, tokens, 512, "synth: tokens");
ABSL_FLAG(int32_t, layers, 2, "synth: layers");
ABSL_FLAG(int32_t, q_heads, 8, "synth: query heads");
ABSL_FLAG(int32_t, kv_heads, 2, "synth: KV heads (divides --q-heads)");
ABSL_FLAG(int32_t, head_dim, 128, "synth: head_dim (a power of two, at least 8)");
ABSL_FLAG(uint64_t, seed, 1, "synth: seed of the generator");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd-calibrate",
      .summary = "OSCAR INT2 rotations from post-RoPE activations",
      .files = {__FILE__},
      .commands = {
          {.name = "",
           .synopsis = R"(--dump ACTIVATIONS.safetensors --out CODEC.safetensors
    [--search-clip] [--per-head] [--hadamard] [--holdout 0.2] [--clip-floor 0.60]
    [--joint-clip] [--sink 64] [--recent 256] [--max-queries 64])",
           .description = R"(OSCAR rotations (and optionally clip quantiles) into a codec file
The dump layout (tensors layers.<l>.q/k/v, metadata kvcd.dump = "1" and the geometry) is in
docs/calibration.md; tools/dump_activations.py writes one from a Hugging Face model,
'synth' writes one from kvcd's synthetic activation generator.

Per layer it prints the orthogonality error of R_k and R_v, the eigenvalue spread
(largest / smallest) of the key and value covariances, the clip quantiles and the
attention-output relative error on the held-out tokens (the last --holdout fraction,
excluded from the covariances). The error is scored the way kvcd stores K/V at each
held-out query position t: rows [sink, t + 1 - recent) through INT2, the BF16 sink and
recent windows (--sink, --recent) as BF16, against exact attention; the held-out queries
are all of the held-out fraction, or --max-queries of them evenly spaced over it. A dump
too short for any held-out query to have INT2 history gets a warning (the error is then
BF16 rounding only). A spread of inf means a singular covariance (fewer training tokens
than head_dim; warned).

--search-clip grid-searches rho_k, then rho_v, over 0.60, 0.62, ..., 1.00 per layer (per
KV head with --per-head) on that error; --clip-floor lowers the grid's floor (e.g. 0.30),
--joint-clip alternates keys and values until neither quantile changes. --per-head fits one rotation and clip pair per KV
head (covariances of that head's query group) and writes codec file version 2
(layers.<l>.r_k/r_v [Hkv, d, d], rho_k/rho_v [Hkv]); kvcd-eval reads it, the daemon reads
versions 1 and 3, not 2. --hadamard keeps R = H (the data-free rotation) and only fits the clips.
)",
           .flags = {"dump", "out", "holdout", "search_clip", "per_head", "hadamard", "joint_clip",
                     "clip_floor", "sink", "recent", "max_queries"}},
          {.name = "fsq",
           .synopsis = R"(--dump ACTIVATIONS.safetensors --weights WEIGHTS.safetensors
    --latent G --out CODEC.safetensors [--holdout 0.2] [--lambda 1] [--key-norm-eps 1e-6])",
           .description = R"(a Transformer-FSQ codec without training
'fsq' initializes a Transformer-FSQ codec (docs/fsq.md) without training: per layer, PCA
of the dump's normalized residuals (layers.<l>.x), E_i = u_(i mod C) / (3 sigma_(i mod C)),
e = -E mu, the 4-bit codes of the training tokens, the ridge decoder
D = (Z^T Z + lambda I)^-1 Z^T X_c and W_k = W^K D^T, b_k = W^K mu + b^K (same for V).
WEIGHTS holds the model's projections layers.<l>.wk / .wv [Hkv*d, C] and the optional
layers.<l>.bk / .bv [Hkv*d] and layers.<l>.k_norm [d] (kvcd_stories --weights writes
them for a llama2.c checkpoint). Per layer it prints the relative error of K and V
(||K_hat - K||_F / ||K||_F, pre-RoPE, equal to post-RoPE) and of the centered residual on
the held-out tokens, the training variance in the first G principal components and the
fraction of saturated code coordinates.
)",
           .flags = {"dump", "weights", "latent", "out", "holdout", "lambda", "key_norm_eps"}},
          {.name = "synth",
           .synopsis = R"(--out DUMP.safetensors [--tokens 512] [--layers 2] [--q-heads 8]
    [--kv-heads 2] [--head-dim 128] [--seed 1])",
           .description = "an activation dump from kvcd's synthetic activation generator",
           .flags = {"out", "tokens", "layers", "q_heads", "kv_heads", "head_dim", "seed"}}}};
  return program;
}

// A flag's value outside its range: a usage error naming it.
int BadValue(const kvcd::cli::Parsed& cli, const char* flag, const std::string& value) {
  return kvcd::cli::UsageError(Cli(), cli.command,
                               std::string("bad value for ") + flag + ": " + value);
}

}  // namespace

namespace {

int Fsq(const kvcd::cli::Parsed& cli) {
  const std::string dump_path = absl::GetFlag(FLAGS_dump);
  const std::string out_path = absl::GetFlag(FLAGS_out);
  const std::string weights_path = absl::GetFlag(FLAGS_weights);
  kvcd::FsqCalibrationOptions opt;
  opt.latent_width = absl::GetFlag(FLAGS_latent);
  opt.holdout = absl::GetFlag(FLAGS_holdout);
  opt.lambda = absl::GetFlag(FLAGS_lambda);
  opt.key_norm_eps = absl::GetFlag(FLAGS_key_norm_eps);
  if (opt.latent_width < 0) return BadValue(cli, "--latent", std::to_string(opt.latent_width));
  if (!(opt.holdout > 0 && opt.holdout < 1)) {
    return BadValue(cli, "--holdout", std::to_string(opt.holdout));
  }
  if (!(opt.lambda >= 0)) return BadValue(cli, "--lambda", std::to_string(opt.lambda));
  if (!(opt.key_norm_eps > 0)) {
    return BadValue(cli, "--key-norm-eps", std::to_string(opt.key_norm_eps));
  }
  if (dump_path.empty() || weights_path.empty() || out_path.empty() || opt.latent_width == 0) {
    return kvcd::cli::UsageError(Cli(), cli.command,
                                 "fsq needs --dump, --weights, --latent and --out");
  }
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "kvcd-calibrate: %s\n", std::string(s.message()).c_str());
    return 1;
  };
  auto dump = kvcd::LoadActivationDump(dump_path);
  if (!dump.ok()) return fail(dump.status());
  auto wfile = kvcd::SafetensorsFile::Load(weights_path);
  if (!wfile.ok()) return fail(wfile.status());
  auto proj = kvcd::ReadKvProjections(*wfile, dump->num_layers, dump->num_kv_heads * dump->head_dim,
                                      std::max(dump->residual_width, 1), dump->head_dim);
  if (!proj.ok()) return fail(proj.status());
  std::vector<kvcd::FsqLayerReport> reports;
  auto codec = kvcd::CalibrateFsq(*dump, *proj, opt, &reports);
  if (!codec.ok()) return fail(codec.status());
  const double dense = 2.0 * 2 * dump->num_kv_heads * dump->head_dim;
  std::printf(
      "dump %s: %d layers, %lld tokens, C = %d; G = %d: %lld code bytes per token per "
      "layer, %.2fx of dense BF16 K/V (%.0f bytes)\n",
      dump_path.c_str(), dump->num_layers, static_cast<long long>(dump->tokens),
      dump->residual_width, opt.latent_width,
      static_cast<long long>(kvcd::kernels::FsqCodeBytes(opt.latent_width)),
      dense / static_cast<double>(kvcd::kernels::FsqCodeBytes(opt.latent_width)), dense);
  std::printf("%5s %10s %10s %10s %10s %10s %8s %8s\n", "layer", "K rel err", "V rel err",
              "x rel err", "explained", "saturated", "train", "held");
  for (size_t l = 0; l < reports.size(); ++l) {
    const auto& r = reports[l];
    std::printf("%5zu %10.4f %10.4f %10.4f %10.4f %10.4f %8lld %8lld\n", l, r.k_rel_err,
                r.v_rel_err, r.x_rel_err, r.explained, r.saturated,
                static_cast<long long>(r.train_tokens), static_cast<long long>(r.heldout_tokens));
  }
  auto s = codec->ToSafetensors().WriteFile(out_path);
  if (!s.ok()) return fail(s);
  std::printf("wrote FSQ codec file %s\n", out_path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(Cli(), argc, argv);
  if (cli.command->name == "fsq") return Fsq(cli);
  const bool synth = cli.command->name == "synth";
  const std::string dump_path = absl::GetFlag(FLAGS_dump);
  const std::string out_path = absl::GetFlag(FLAGS_out);
  const bool search = absl::GetFlag(FLAGS_search_clip);
  const bool per_head = absl::GetFlag(FLAGS_per_head);
  kvcd::CalibrationOptions opt;
  opt.hadamard = absl::GetFlag(FLAGS_hadamard);
  opt.joint_clip = absl::GetFlag(FLAGS_joint_clip);
  opt.windows.sink = absl::GetFlag(FLAGS_sink);
  opt.windows.recent = absl::GetFlag(FLAGS_recent);
  opt.clip_floor = absl::GetFlag(FLAGS_clip_floor);
  opt.max_queries = absl::GetFlag(FLAGS_max_queries);
  const double holdout = absl::GetFlag(FLAGS_holdout);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const int layers = absl::GetFlag(FLAGS_layers), hq = absl::GetFlag(FLAGS_q_heads),
            hkv = absl::GetFlag(FLAGS_kv_heads), d = absl::GetFlag(FLAGS_head_dim);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (opt.windows.sink < 0) return BadValue(cli, "--sink", std::to_string(opt.windows.sink));
  if (opt.windows.recent < 0) {
    return BadValue(cli, "--recent", std::to_string(opt.windows.recent));
  }
  if (!(opt.clip_floor > 0 && opt.clip_floor <= 1)) {
    return BadValue(cli, "--clip-floor", std::to_string(opt.clip_floor));
  }
  if (opt.max_queries <= 0) {
    return BadValue(cli, "--max-queries", std::to_string(opt.max_queries));
  }
  if (tokens <= 0) return BadValue(cli, "--tokens", std::to_string(tokens));
  if (layers <= 0) return BadValue(cli, "--layers", std::to_string(layers));
  if (hq <= 0) return BadValue(cli, "--q-heads", std::to_string(hq));
  if (hkv <= 0 || hq % hkv != 0) return BadValue(cli, "--kv-heads", std::to_string(hkv));
  if (d < 8 || (d & (d - 1)) != 0) return BadValue(cli, "--head-dim", std::to_string(d));
  if (out_path.empty()) return kvcd::cli::UsageError(Cli(), cli.command, "--out is required");
  if (synth) {
    kvcd::ActivationSpec spec;
    spec.num_layers = layers;
    spec.num_q_heads = hq;
    spec.num_kv_heads = hkv;
    spec.head_dim = d;
    spec.tokens = tokens;
    spec.seed = seed;
    kvcd::ActivationDump dump{layers,
                              hq,
                              hkv,
                              d,
                              tokens,
                              "kvcd synthetic generator, seed " + std::to_string(seed),
                              kvcd::GenerateActivations(spec)};
    auto s = kvcd::WriteActivationDump(dump, out_path);
    if (!s.ok()) {
      std::fprintf(stderr, "kvcd-calibrate: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    std::printf("wrote %s: %d layers x %lld tokens (%d q / %d kv heads, head_dim %d)\n",
                out_path.c_str(), layers, static_cast<long long>(tokens), hq, hkv, d);
    return 0;
  }
  if (dump_path.empty()) return kvcd::cli::UsageError(Cli(), cli.command, "--dump is required");
  auto dump = kvcd::LoadActivationDump(dump_path);
  if (!dump.ok()) {
    std::fprintf(stderr, "kvcd-calibrate: %s\n", std::string(dump.status().message()).c_str());
    return 1;
  }
  std::printf("dump %s: %d layers, %lld tokens, %d q / %d kv heads, head_dim %d%s%s\n",
              dump_path.c_str(), dump->num_layers, static_cast<long long>(dump->tokens),
              dump->num_q_heads, dump->num_kv_heads, dump->head_dim,
              dump->source.empty() ? "" : ", source: ", dump->source.c_str());
  opt.holdout = holdout;
  opt.search_clip = search;
  opt.per_head = per_head;
  opt.progress = kvcd::LayerProgress(stderr);
  kvcd::CalibrationReport report;
  auto layers_out = kvcd::Calibrate(*dump, opt, &report);
  for (const auto& w : report.warnings)
    std::fprintf(stderr, "kvcd-calibrate: warning: %s\n", w.c_str());
  if (!layers_out.ok()) {
    std::fprintf(stderr, "kvcd-calibrate: %s\n",
                 std::string(layers_out.status().message()).c_str());
    return 1;
  }
  std::printf("%5s %12s %12s %12s %12s %6s %6s %14s\n", "layer", "orth R_k", "orth R_v",
              "spread C_q", "spread C_v", "rho_k", "rho_v", "held-out err");
  for (size_t l = 0; l < layers_out->size(); ++l) {
    const auto& c = (*layers_out)[l];
    for (int g = 0; g < c.codec.groups; ++g) {
      std::printf("%5zu %12.2e %12.2e %12.3g %12.3g %6.2f %6.2f %14.4f\n", l, c.orthogonality_k,
                  c.orthogonality_v, c.spread_k, c.spread_v, c.codec.rho_k[g], c.codec.rho_v[g],
                  c.heldout_error);
    }
  }
  auto s = kvcd::CodecFile(*layers_out, dump->head_dim, dump_path).WriteFile(out_path);
  if (!s.ok()) {
    std::fprintf(stderr, "kvcd-calibrate: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("wrote codec file %s\n", out_path.c_str());
  return 0;
}
