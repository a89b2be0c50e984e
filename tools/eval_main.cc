// kvcd-eval: attention quality of KV codecs on an activation dump (see tools/eval.h).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "common/cli.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "tools/eval.h"

ABSL_FLAG(std::string, dump, "", "activation dump (safetensors)");
ABSL_FLAG(std::string, codec, "",
          "NAME=CODEC.safetensors: one more codec to score (repeat the flag for more)");
ABSL_FLAG(int64_t, sink, kvcd::EvalOptions{}.sink, "BF16 sink window in tokens");
ABSL_FLAG(int64_t, recent, kvcd::EvalOptions{}.recent, "BF16 recent window in tokens");
ABSL_FLAG(int32_t, positions, kvcd::EvalOptions{}.positions,
          "query positions evaluated, spread over the dump");
ABSL_FLAG(std::string, json, "", "write every figure to this JSON file");
ABSL_FLAG(std::string, plot, "", "plot error against position to this PNG (needs gnuplot)");
ABSL_FLAG(double, rope_theta, kvcd::kernels::RopeSpec{}.theta, "FSQ codecs: RoPE theta");
ABSL_FLAG(std::string, rope_pairing, "half", "FSQ codecs: RoPE pairing, half or interleaved");
ABSL_FLAG(int32_t, rotary_dims, 0, "FSQ codecs: rotary dimensions (0: head_dim)");
ABSL_FLAG(double, rope_scaling, kvcd::kernels::RopeSpec{}.scaling,
          "FSQ codecs: RoPE position scaling");
ABSL_FLAG(float, key_norm_eps, 1e-6f, "FSQ codecs: epsilon of the key norm");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd-eval",
      .summary = "attention quality of KV codecs on an activation dump",
      .files = {__FILE__},
      .synopsis = R"(--dump ACTIVATIONS.safetensors [--codec NAME=CODEC.safetensors ...]
    [--sink 64] [--recent 256] [--positions 16] [--json OUT.json] [--plot OUT.png]
    [--rope-theta 10000] [--rope-pairing half|interleaved] [--rotary-dims HEAD_DIM]
    [--rope-scaling 1] [--key-norm-eps 1e-6])",
      .notes =
          R"(Codecs: bf16, int2-naive (identity rotation), int2-hadamard, kivi2 (per-channel K /
per-token V, group 32, FP16 residual window 128), and every --codec file: an OSCAR INT2
codec (kvcd-calibrate), or an FSQ codec (metadata kvcd.codec = "fsq", from
kvcd-calibrate fsq or tools/fsq_finetune): its history K/V are rebuilt from the 4-bit
codes of the dump's residuals (layers.<l>.x) with the --rope-* parameters of the model
(dump row t = position t: one sequence per dump). The daemon's storage path is simulated: BF16 sink and recent
windows, the history between them through the codec's kernels. Query positions are spread
over the dump past the windows; per layer and overall it reports KL(p || p_hat) of the
attention distributions (mean and p99 over heads and positions), the attention-output and
logit relative errors, and bits per element / bytes per token with the windows included
(FSQ: ceil(G/2) code bytes per token per layer for all KV heads) and the compression
ratio against dense BF16 K/V; the codec's own tensors are a fixed per-model cost, listed
apart. --json writes all of it (tools/plot_quality.py draws quality against compression);
--plot (error against position) needs gnuplot (Debian: gnuplot-nox).)"};
  return program;
}

int BadValue(const char* flag, const std::string& value) {
  return kvcd::cli::UsageError(Cli(), nullptr, std::string("bad value for ") + flag + ": " + value);
}

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(Cli(), argc, argv);
  const std::string dump_path = absl::GetFlag(FLAGS_dump);
  const std::string json_path = absl::GetFlag(FLAGS_json);
  const std::string plot_path = absl::GetFlag(FLAGS_plot);
  std::vector<std::pair<std::string, std::string>> codec_files;
  for (const std::string& v : cli.Values("codec")) {
    const auto eq = v.find('=');
    if (eq == std::string::npos || eq == 0) return BadValue("--codec", v);
    codec_files.push_back({v.substr(0, eq), v.substr(eq + 1)});
  }
  kvcd::EvalOptions opt;
  opt.sink = absl::GetFlag(FLAGS_sink);
  opt.recent = absl::GetFlag(FLAGS_recent);
  opt.positions = absl::GetFlag(FLAGS_positions);
  kvcd::kernels::RopeSpec rope;
  rope.theta = absl::GetFlag(FLAGS_rope_theta);
  rope.scaling = absl::GetFlag(FLAGS_rope_scaling);
  rope.rotary_dims = absl::GetFlag(FLAGS_rotary_dims);
  const std::string pairing = absl::GetFlag(FLAGS_rope_pairing);
  rope.pairing = pairing == "half" ? kvcd::kernels::RopePairing::kHalf
                                   : kvcd::kernels::RopePairing::kInterleaved;
  const float key_norm_eps = absl::GetFlag(FLAGS_key_norm_eps);
  if (opt.sink < 0) return BadValue("--sink", std::to_string(opt.sink));
  if (opt.recent < 0) return BadValue("--recent", std::to_string(opt.recent));
  if (opt.positions <= 0) return BadValue("--positions", std::to_string(opt.positions));
  if (!(rope.theta > 0)) return BadValue("--rope-theta", std::to_string(rope.theta));
  if (!(rope.scaling > 0)) return BadValue("--rope-scaling", std::to_string(rope.scaling));
  if (cli.Given("rotary_dims") && rope.rotary_dims <= 0) {
    return BadValue("--rotary-dims", std::to_string(rope.rotary_dims));
  }
  if (pairing != "half" && pairing != "interleaved") return BadValue("--rope-pairing", pairing);
  if (!(key_norm_eps > 0)) return BadValue("--key-norm-eps", std::to_string(key_norm_eps));
  if (dump_path.empty()) return kvcd::cli::UsageError(Cli(), nullptr, "--dump is required");
  auto dump = kvcd::LoadActivationDump(dump_path);
  if (!dump.ok()) {
    std::fprintf(stderr, "kvcd-eval: %s\n", std::string(dump.status().message()).c_str());
    return 1;
  }
  auto codecs = kvcd::StandardCodecs(dump->num_layers, dump->head_dim);
  for (const auto& [name, path] : codec_files) {
    auto file = kvcd::SafetensorsFile::Load(path);
    if (!file.ok()) {
      std::fprintf(stderr, "kvcd-eval: %s\n", std::string(file.status().message()).c_str());
      return 1;
    }
    if (auto kind = file->metadata().find("kvcd.codec");
        kind != file->metadata().end() && kind->second == "fsq") {
      if (dump->residual_width == 0) {
        std::fprintf(stderr,
                     "kvcd-eval: %s is an FSQ codec: the dump must carry the residuals "
                     "(layers.<l>.x, metadata residual_width; kvcd_stories --dump writes them)\n",
                     path.c_str());
        return 1;
      }
      // The dump fixes the geometry; G and the key norm come from the file's metadata.
      kvcd::FsqCodecShape shape;
      shape.num_layers = dump->num_layers;
      shape.residual_width = dump->residual_width;
      shape.num_kv_heads = dump->num_kv_heads;
      shape.head_dim = dump->head_dim;
      shape.key_norm_eps = key_norm_eps;
      auto g = file->metadata().find("latent_width");
      auto norm = file->metadata().find("key_norm");
      shape.key_norm = norm != file->metadata().end() && norm->second == "rms";
      if (g == file->metadata().end() || !absl::SimpleAtoi(g->second, &shape.latent_width)) {
        std::fprintf(stderr, "kvcd-eval: %s: metadata 'latent_width' missing or not a number\n",
                     path.c_str());
        return 1;
      }
      auto fsq = kvcd::FsqCodec::FromSafetensors(*file, shape);
      if (!fsq.ok()) {
        std::fprintf(stderr, "kvcd-eval: %s: %s\n", path.c_str(),
                     std::string(fsq.status().message()).c_str());
        return 1;
      }
      kvcd::EvalCodec c;
      c.name = name;
      c.kind = kvcd::EvalCodec::Kind::kFsq;
      c.fsq = std::move(*fsq);
      c.rope = rope;
      if (c.rope.rotary_dims == 0) c.rope.rotary_dims = dump->head_dim;
      codecs.push_back(std::move(c));
      continue;
    }
    auto c = kvcd::LoadInt2Codec(*file, *dump, name);
    if (!c.ok()) {
      std::fprintf(stderr, "kvcd-eval: %s: %s\n", path.c_str(),
                   std::string(c.status().message()).c_str());
      return 1;
    }
    codecs.push_back(std::move(*c));
  }
  auto results = kvcd::Evaluate(*dump, codecs, opt);
  if (!results.ok()) {
    std::fprintf(stderr, "kvcd-eval: %s\n", std::string(results.status().message()).c_str());
    return 1;
  }
  std::printf(
      "dump %s: %d layers, %lld tokens, %d q / %d kv heads, head_dim %d; windows %lld + %lld\n\n",
      dump_path.c_str(), dump->num_layers, static_cast<long long>(dump->tokens), dump->num_q_heads,
      dump->num_kv_heads, dump->head_dim, static_cast<long long>(opt.sink),
      static_cast<long long>(opt.recent));
  std::printf("%-16s %10s %10s %12s %12s %10s %12s %8s %12s\n", "codec", "KL mean", "KL p99",
              "out rel err", "logit rel", "bits/elem", "bytes/token", "ratio", "fixed bytes");
  nlohmann::json j;
  j["dump"] = dump_path;
  j["tokens"] = dump->tokens;
  j["sink"] = opt.sink;
  j["recent"] = opt.recent;
  for (const auto& r : *results) {
    if (!r.warning.empty())
      std::fprintf(stderr, "kvcd-eval: warning: %s: %s\n", r.name.c_str(), r.warning.c_str());
  }
  for (const auto& r : *results) {
    std::printf("%-16s %10.4g %10.4g %12.4f %12.4f %10.2f %12.1f %8.2f %12.0f\n", r.name.c_str(),
                r.overall.kl_mean, r.overall.kl_p99, r.overall.out_err, r.overall.logit_err,
                r.bits_per_element, r.bytes_per_token, r.compression, r.fixed_bytes);
    nlohmann::json c;
    c["name"] = r.name;
    c["kl_mean"] = r.overall.kl_mean;
    c["kl_p99"] = r.overall.kl_p99;
    c["out_rel_err"] = r.overall.out_err;
    c["logit_rel_err"] = r.overall.logit_err;
    c["bits_per_element"] = r.bits_per_element;
    c["bytes_per_token"] = r.bytes_per_token;
    c["compression_ratio"] = r.compression;
    c["fixed_bytes"] = r.fixed_bytes;
    if (!r.warning.empty()) c["warning"] = r.warning;
    for (size_t l = 0; l < r.layers.size(); ++l) {
      c["layers"].push_back({{"kl_mean", r.layers[l].kl_mean},
                             {"kl_p99", r.layers[l].kl_p99},
                             {"out_rel_err", r.layers[l].out_err},
                             {"logit_rel_err", r.layers[l].logit_err}});
    }
    for (const auto& [t, e] : r.out_err_by_position) c["out_rel_err_by_position"].push_back({t, e});
    j["codecs"].push_back(c);
  }
  std::printf("\nper layer: out rel err\n%-6s", "layer");
  for (const auto& r : *results) std::printf(" %14s", r.name.c_str());
  std::printf("\n");
  for (int l = 0; l < dump->num_layers; ++l) {
    std::printf("%-6d", l);
    for (const auto& r : *results) std::printf(" %14.4f", r.layers[l].out_err);
    std::printf("\n");
  }
  if (!json_path.empty()) {
    std::ofstream(json_path) << j.dump(2) << "\n";
    std::printf("wrote %s\n", json_path.c_str());
  }
  if (!plot_path.empty()) {
    const std::string data = plot_path + ".dat", script = plot_path + ".gp";
    std::ofstream out(data);
    for (const auto& r : *results) {
      out << "# " << r.name << "\n";
      for (const auto& [t, e] : r.out_err_by_position) out << t << " " << e << "\n";
      out << "\n\n";
    }
    out.close();
    std::ofstream gp(script);
    gp << "set terminal pngcairo size 900,540 noenhanced\nset output '" << plot_path << "'\n"
       << "set title 'attention-output relative error vs context position'\n"
       << "set xlabel 'query position (tokens)'\nset ylabel '||o_hat - o|| / ||o||'\n"
       << "set key outside right\nset grid\nplot ";
    for (size_t i = 0; i < results->size(); ++i) {
      gp << (i ? ", " : "") << "'" << data << "' index " << i << " with linespoints title '"
         << (*results)[i].name << "'";
    }
    gp << "\n";
    gp.close();
    if (std::system(("gnuplot '" + script + "'").c_str()) != 0) {
      std::fprintf(stderr,
                   "kvcd-eval: gnuplot failed or is not installed (apt-get install "
                   "gnuplot-nox); data left in %s\n",
                   data.c_str());
      return 1;
    }
    std::printf("wrote %s\n", plot_path.c_str());
  }
  return 0;
}
