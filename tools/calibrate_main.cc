// kvcd-calibrate: OSCAR rotations (and optionally clip quantiles) from an activation dump,
// written as the codec file the daemon loads (codec_file: / RegisterModel codec_blob).
#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "common/activation_dump.h"
#include "testing/synthetic_activations.h"
#include "tools/calibration.h"
#include "tools/fsq_calibration.h"
#include "tools/progress.h"

namespace {

constexpr char kUsage[] = R"(kvcd-calibrate — OSCAR INT2 rotations from post-RoPE activations

Usage:
  kvcd-calibrate --dump ACTIVATIONS.safetensors --out CODEC.safetensors
                 [--search-clip] [--per-head] [--hadamard] [--holdout 0.2]
                 [--clip-floor 0.60] [--joint-clip]
                 [--sink 64] [--recent 256] [--max-queries 64]
  kvcd-calibrate fsq --dump ACTIVATIONS.safetensors --weights WEIGHTS.safetensors
                 --latent G --out CODEC.safetensors [--holdout 0.2] [--lambda 1]
                 [--key-norm-eps 1e-6]
  kvcd-calibrate synth --out DUMP.safetensors [--tokens 512] [--layers 2]
                 [--q-heads 8] [--kv-heads 2] [--head-dim 128] [--seed 1]

The dump layout (tensors layers.<l>.q/k/v, metadata kvcd.dump = "1" and the geometry) is in
README.md "Calibration"; tools/dump_activations.py writes one from a Hugging Face model,
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
version 1 only. --hadamard keeps R = H (the data-free rotation) and only fits the clips.

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
)";

int Usage(const char* why) {
  if (why) std::fprintf(stderr, "kvcd-calibrate: %s\n\n", why);
  std::fputs(kUsage, why ? stderr : stdout);
  return why ? 2 : 0;
}

}  // namespace

namespace {

int Fsq(int argc, char** argv) {
  std::string dump_path, out_path, weights_path;
  kvcd::FsqCalibrationOptions opt;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return Usage(nullptr);
    if (i + 1 >= argc) return Usage(("flag " + a + " needs a value").c_str());
    const std::string v = argv[++i];
    bool ok = true;
    if (a == "--dump") {
      dump_path = v;
    } else if (a == "--out") {
      out_path = v;
    } else if (a == "--weights") {
      weights_path = v;
    } else if (a == "--latent") {
      ok = absl::SimpleAtoi(v, &opt.latent_width) && opt.latent_width > 0;
    } else if (a == "--holdout") {
      ok = absl::SimpleAtod(v, &opt.holdout) && opt.holdout > 0 && opt.holdout < 1;
    } else if (a == "--lambda") {
      ok = absl::SimpleAtod(v, &opt.lambda) && opt.lambda >= 0;
    } else if (a == "--key-norm-eps") {
      ok = absl::SimpleAtof(v, &opt.key_norm_eps) && opt.key_norm_eps > 0;
    } else {
      return Usage(("unknown flag " + a).c_str());
    }
    if (!ok) return Usage(("bad value for " + a + ": " + v).c_str());
  }
  if (dump_path.empty() || weights_path.empty() || out_path.empty() || opt.latent_width == 0) {
    return Usage("fsq needs --dump, --weights, --latent and --out");
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
  if (argc > 1 && std::string(argv[1]) == "fsq") return Fsq(argc, argv);
  std::string dump_path, out_path;
  bool synth = false, search = false, per_head = false;
  kvcd::CalibrationOptions opt;
  double holdout = 0.2;
  int64_t tokens = 512;
  int layers = 2, hq = 8, hkv = 2, d = 128;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return Usage(nullptr);
    if (a == "synth" && i == 1) {
      synth = true;
      continue;
    }
    if (a == "--search-clip") {
      search = true;
      continue;
    }
    if (a == "--per-head") {
      per_head = true;
      continue;
    }
    if (a == "--hadamard") {
      opt.hadamard = true;
      continue;
    }
    if (a == "--joint-clip") {
      opt.joint_clip = true;
      continue;
    }
    if (i + 1 >= argc) return Usage(("flag " + a + " needs a value").c_str());
    const std::string v = argv[++i];
    bool ok = true;
    if (a == "--dump") {
      dump_path = v;
    } else if (a == "--out") {
      out_path = v;
    } else if (a == "--holdout") {
      ok = absl::SimpleAtod(v, &holdout);
    } else if (a == "--sink") {
      ok = absl::SimpleAtoi(v, &opt.windows.sink) && opt.windows.sink >= 0;
    } else if (a == "--recent") {
      ok = absl::SimpleAtoi(v, &opt.windows.recent) && opt.windows.recent >= 0;
    } else if (a == "--clip-floor") {
      ok = absl::SimpleAtof(v, &opt.clip_floor) && opt.clip_floor > 0 && opt.clip_floor <= 1;
    } else if (a == "--max-queries") {
      ok = absl::SimpleAtoi(v, &opt.max_queries) && opt.max_queries > 0;
    } else if (a == "--tokens") {
      ok = absl::SimpleAtoi(v, &tokens) && tokens > 0;
    } else if (a == "--layers") {
      ok = absl::SimpleAtoi(v, &layers) && layers > 0;
    } else if (a == "--q-heads") {
      ok = absl::SimpleAtoi(v, &hq) && hq > 0;
    } else if (a == "--kv-heads") {
      ok = absl::SimpleAtoi(v, &hkv) && hkv > 0 && hq % hkv == 0;
    } else if (a == "--head-dim") {
      ok = absl::SimpleAtoi(v, &d) && d >= 8 && (d & (d - 1)) == 0;
    } else if (a == "--seed") {
      ok = absl::SimpleAtoi(v, &seed);
    } else {
      return Usage(("unknown flag " + a).c_str());
    }
    if (!ok) return Usage(("bad value for " + a + ": " + v).c_str());
  }
  if (out_path.empty()) return Usage("--out is required");
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
  if (dump_path.empty()) return Usage("--dump is required");
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
