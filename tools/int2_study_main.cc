// kvcd-int2-study: the INT2-budget experiments of issue #22 on real activations — uneven
// bits across eigen-directions (tools/transform_calibration.h) against Hadamard INT2 and
// calibrated OSCAR codec files, scored by kvcd-eval's core on a held-out dump.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "tools/eval.h"
#include "tools/transform_calibration.h"

ABSL_FLAG(std::string, calib, "", "calibration dump (the codes are fitted on it)");
ABSL_FLAG(std::string, heldout, "", "held-out dump (the codes are scored on it)");
ABSL_FLAG(std::string, codec, "",
          "NAME=CODEC.safetensors: one more codec file to score (repeat the flag for more)");
ABSL_FLAG(int32_t, positions, 48, "query positions evaluated, spread over the held-out dump");
ABSL_FLAG(int64_t, sink, kvcd::EvalOptions{}.sink, "BF16 sink window in tokens");
ABSL_FLAG(int64_t, recent, kvcd::EvalOptions{}.recent, "BF16 recent window in tokens");
ABSL_FLAG(std::string, step_scales, "1.0", "quantizer step scales to try, comma-separated");
ABSL_FLAG(std::string, variants, "all", "all or best");
ABSL_FLAG(std::string, kv_shifts, "0", "code bits per row moved from V to K, comma-separated");
ABSL_FLAG(
    int32_t, code_bits, 144,
    "code bits per K and V row (a multiple of 8, at most 8 * head_dim; the gain's 16 on top)");
ABSL_FLAG(std::string, json, "", "write every figure to this JSON file");
ABSL_FLAG(std::string, out_codec, "", "write codec file version 3 here");
ABSL_FLAG(float, search_v_clip, 0, "search the values' clip over FLOOR..1.00 (0: no search)");
ABSL_FLAG(double, overload, 1.0, "how far past its half range the gain may let a coordinate reach");

namespace {

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd-int2-study",
      .summary = "uneven bits across eigen-directions at the INT2 budget",
      .files = {__FILE__},
      .synopsis = R"(--calib CALIB.dump.safetensors --heldout HELDOUT.dump.safetensors
    [--codec NAME=CODEC.safetensors ...] [--positions 48] [--sink 64] [--recent 256]
    [--step-scales 1.0[,...]] [--variants all|best] [--kv-shifts 0[,32,...]]
    [--json OUT.json] [--out-codec OUT.safetensors] [--search-v-clip FLOOR] [--overload 1.0]
    [--code-bits 144])",
      .notes =
          R"(Fits per layer and KV head transform codes on the calibration dump (rows past the sink):
keys in the basis whitened by the query group's second moment (the logit error is plain
squared error there), values in their covariance's eigenbasis; 144 code bits per row
allocated across directions by reverse water-filling plus one FP16 gain per row: 160 bits
per 64-value row, the budget of INT2 with an FP16 scale and min (--kv-shifts S moves S code
bits per row from V to K: the same 2.5 bits per element on average over K and V). --code-bits
N sets the 144: INT2's budget less the gain is 2 * head_dim + 16 (272 at head_dim 128,
bench/make-qwen3-transform-codec.sh). Prints the spectral
prediction (model distortion against Hadamard, and the Gaussian rate-distortion floor),
then kvcd-eval's figures on the held-out dump for each variant, Hadamard INT2 and every
--codec file, and the split of the best variant's error between K and V. --out-codec
writes codec file version 3 (common/key_transform_profile.h): keys by the first variant's
transform code, values by Hadamard INT2 at the default clip (the combination that halves
Hadamard INT2's error; kvcd-eval reads the file). --search-v-clip FLOOR: the values' clip
per KV head searched over FLOOR..1.00 on the calibration dump's last 20% of queries (24 of
them) with the keys transform-coded, for the file and as one more hybrid. --overload X:
the gain may let a coordinate reach X times its quantizer's half range (clipped beyond);
1 never clips (the gain is then set by the row's most extreme coordinate, and
--step-scales cancels out).)"};
  return program;
}

int BadValue(const char* flag, const std::string& value) {
  return kvcd::cli::UsageError(Cli(), nullptr, std::string("bad value for ") + flag + ": " + value);
}

struct Variant {
  std::string name;
  kvcd::TransformCalibrationOptions opt;
};

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(Cli(), argc, argv);
  const std::string calib_path = absl::GetFlag(FLAGS_calib);
  const std::string heldout_path = absl::GetFlag(FLAGS_heldout);
  const std::string json_path = absl::GetFlag(FLAGS_json);
  const std::string out_codec = absl::GetFlag(FLAGS_out_codec);
  const std::string variants = absl::GetFlag(FLAGS_variants);
  if (variants != "all" && variants != "best") return BadValue("--variants", variants);
  std::vector<std::pair<std::string, std::string>> codec_files;
  for (const std::string& v : cli.Values("codec")) {
    const auto eq = v.find('=');
    if (eq == std::string::npos || eq == 0) return BadValue("--codec", v);
    codec_files.push_back({v.substr(0, eq), v.substr(eq + 1)});
  }
  std::vector<double> step_scales;
  for (auto s : absl::StrSplit(absl::GetFlag(FLAGS_step_scales), ',')) {
    double x = 0;
    if (!absl::SimpleAtod(s, &x) || !(x > 0)) {
      return BadValue("--step-scales", absl::GetFlag(FLAGS_step_scales));
    }
    step_scales.push_back(x);
  }
  const int code_bits = absl::GetFlag(FLAGS_code_bits);
  if (code_bits < 8 || code_bits % 8 != 0)
    return BadValue("--code-bits", std::to_string(code_bits));
  std::vector<int> kv_shifts;
  for (auto s : absl::StrSplit(absl::GetFlag(FLAGS_kv_shifts), ',')) {
    int x = 0;
    if (!absl::SimpleAtoi(s, &x) || x <= -code_bits || x >= code_bits) {
      return BadValue("--kv-shifts", absl::GetFlag(FLAGS_kv_shifts));
    }
    kv_shifts.push_back(x);
  }
  const float v_clip_floor = absl::GetFlag(FLAGS_search_v_clip);  // 0: no value clip search
  if (cli.Given("search_v_clip") && !(v_clip_floor > 0 && v_clip_floor <= 1)) {
    return BadValue("--search-v-clip", std::to_string(v_clip_floor));
  }
  const double overload = absl::GetFlag(FLAGS_overload);
  if (!(overload >= 1)) return BadValue("--overload", std::to_string(overload));
  kvcd::EvalOptions eo;
  eo.positions = absl::GetFlag(FLAGS_positions);
  eo.sink = absl::GetFlag(FLAGS_sink);
  eo.recent = absl::GetFlag(FLAGS_recent);
  if (eo.positions <= 0) return BadValue("--positions", std::to_string(eo.positions));
  if (eo.sink < 0) return BadValue("--sink", std::to_string(eo.sink));
  if (eo.recent < 0) return BadValue("--recent", std::to_string(eo.recent));
  if (calib_path.empty() || heldout_path.empty()) {
    return kvcd::cli::UsageError(Cli(), nullptr, "--calib and --heldout are required");
  }
  auto calib = kvcd::LoadActivationDump(calib_path);
  if (!calib.ok()) return std::fprintf(stderr, "%s\n", calib.status().ToString().c_str()), 1;
  auto held = kvcd::LoadActivationDump(heldout_path);
  if (!held.ok()) return std::fprintf(stderr, "%s\n", held.status().ToString().c_str()), 1;
  if (held->head_dim != calib->head_dim || held->num_kv_heads != calib->num_kv_heads ||
      held->num_q_heads != calib->num_q_heads || held->num_layers != calib->num_layers) {
    return std::fprintf(stderr, "the calibration and held-out dumps are of different models\n"), 1;
  }
  const int hkv = held->num_kv_heads, d = held->head_dim;
  if (code_bits > 8 * d) {  // 8 bits per direction at most
    return BadValue("--code-bits", std::to_string(code_bits) +
                                       " (more than 8 * head_dim = " + std::to_string(8 * d) + ")");
  }

  std::vector<Variant> vs;
  for (double s : step_scales) {
    const std::string suffix = s == 1.0 ? "" : "-s" + std::to_string(s).substr(0, 4);
    Variant w{"tc-whiten" + suffix, {}};
    w.opt.k.code_bits = w.opt.v.code_bits = code_bits;
    w.opt.k.step_scale = w.opt.v.step_scale = s;
    w.opt.k.overload = w.opt.v.overload = overload;
    vs.push_back(w);
    if (variants == "best") continue;
    Variant u = w;
    u.name = "tc-whiten-uniform" + suffix;
    u.opt.uniform_bits = true;
    vs.push_back(u);
    Variant e = w;
    e.name = "tc-ueig" + suffix;  // the OSCAR U for K (orthogonal), KLT for V
    e.opt.k.basis = e.opt.v.basis = kvcd::TransformBasis::kMetricEigen;
    vs.push_back(e);
    Variant k = w;
    k.name = "tc-klt" + suffix;  // plain KLT of the rows (orthogonal)
    k.opt.k.basis = k.opt.v.basis = kvcd::TransformBasis::kDataKlt;
    vs.push_back(k);
    Variant ng = w;
    ng.name = "tc-whiten-nogain" + suffix;  // the gain's 16 bits as codes, no per-row gain
    ng.opt.k.row_gain = ng.opt.v.row_gain = false;
    ng.opt.k.code_bits = ng.opt.v.code_bits = code_bits + 16;
    vs.push_back(ng);
  }
  for (int shift : kv_shifts) {
    if (shift == 0) continue;
    Variant w{"tc-whiten-kv" + std::to_string(code_bits + shift) + "/" +
                  std::to_string(code_bits - shift),
              {}};
    w.opt.k.code_bits = code_bits + shift;
    w.opt.k.overload = w.opt.v.overload = overload;
    w.opt.v.code_bits = code_bits - shift;
    vs.push_back(w);
  }

  std::vector<kvcd::EvalCodec> codecs;
  const auto standard = kvcd::StandardCodecs(held->num_layers, d);
  codecs.push_back(standard[2]);  // int2-hadamard, default clip
  for (const auto& [name, path] : codec_files) {
    auto file = kvcd::SafetensorsFile::Load(path);
    if (!file.ok()) return std::fprintf(stderr, "%s\n", file.status().ToString().c_str()), 1;
    auto c = kvcd::LoadInt2Codec(*file, *held, name);
    if (!c.ok()) return std::fprintf(stderr, "%s\n", c.status().ToString().c_str()), 1;
    codecs.push_back(std::move(*c));
  }
  nlohmann::json out;
  std::printf("spectral prediction (model distortion per row, error metric; error ~ sqrt(D)):\n");
  std::printf("%-24s %-2s %10s %10s %10s %10s\n", "variant", "", "alloc/had", "unif/had",
              "floor/had", "sqrt(a/h)");
  std::vector<std::shared_ptr<const kvcd::TransformCalibration>> cals;
  for (const Variant& v : vs) {
    auto cal = kvcd::CalibrateTransforms(*calib, v.opt);
    if (!cal.ok()) return std::fprintf(stderr, "%s\n", cal.status().ToString().c_str()), 1;
    auto shared = std::make_shared<const kvcd::TransformCalibration>(std::move(*cal));
    for (int which = 0; which < 2; ++which) {
      // Sums over layers and heads of the per-head ratios' logs: geometric means.
      double la = 0, lu = 0, lf = 0;
      int count = 0;
      const auto& pred = which == 0 ? shared->pred_k : shared->pred_v;
      for (const auto& layer : pred)
        for (const auto& p : layer) {
          la += std::log(p.allocated / p.hadamard);
          lu += std::log(p.uniform / p.hadamard);
          lf += std::log(p.rd_floor / p.hadamard);
          ++count;
        }
      std::printf("%-24s %-2s %10.3f %10.3f %10.3f %10.3f\n", v.name.c_str(), which ? "V" : "K",
                  std::exp(la / count), std::exp(lu / count), std::exp(lf / count),
                  std::sqrt(std::exp(la / count)));
      out["prediction"][v.name][which ? "v" : "k"] = {
          {"alloc_over_hadamard", std::exp(la / count)},
          {"uniform_over_hadamard", std::exp(lu / count)},
          {"rd_floor_over_hadamard", std::exp(lf / count)}};
    }
    if (v.name == "tc-whiten") {
      std::printf("bits per direction, tc-whiten, layer 0 head 0 K:");
      for (int b : shared->k[0][0].bits) std::printf(" %d", b);
      std::printf("\n                                          V:");
      for (int b : shared->v[0][0].bits) std::printf(" %d", b);
      std::printf("\n");
    }
    cals.push_back(shared);
    codecs.push_back(kvcd::TransformEvalCodec(shared, v.name, hkv));
  }
  std::fflush(stdout);
  std::vector<kvcd::Int2Layer> values(held->num_layers);
  for (auto& v : values) {
    v.r_v = standard[2].int2[0].r_v;
    v.r_k = v.r_v;
    v.rho_k = {1.0f};
    v.rho_v = standard[2].int2[0].rho_v;
  }
  if (v_clip_floor > 0) {
    values = kvcd::SearchValueClips(*calib, *cals[0], 0.2, 24, v_clip_floor,
                                    kvcd::StoredWindows{eo.sink, eo.recent});
    std::printf("value clips searched (floor %.2f):", v_clip_floor);
    for (const auto& v : values)
      for (float r : v.rho_v) std::printf(" %.2f", r);
    std::printf("\n");
  }
  if (!out_codec.empty()) {
    const auto heads = kvcd::KeyTransformHeads(*cals[0], values);
    auto st = kvcd::KeyTransformProfile::ToSafetensors(heads, held->num_layers, hkv, d, calib_path)
                  .WriteFile(out_codec);
    if (!st.ok()) return std::fprintf(stderr, "%s\n", std::string(st.message()).c_str()), 1;
    auto file = kvcd::SafetensorsFile::Load(out_codec);
    if (!file.ok()) return std::fprintf(stderr, "%s\n", file.status().ToString().c_str()), 1;
    auto c = kvcd::LoadInt2Codec(*file, *held, "file:" + out_codec);
    if (!c.ok()) return std::fprintf(stderr, "%s\n", c.status().ToString().c_str()), 1;
    codecs.push_back(std::move(*c));
    std::printf("wrote codec file version 3: %s\n", out_codec.c_str());
  }
  // The K / V split for Hadamard and for the first variant.
  for (int keep = 1; keep <= 2; ++keep) {
    kvcd::EvalCodec h;
    h.name = keep == 1 ? "int2-hadamard[K only]" : "int2-hadamard[V only]";
    h.kind = kvcd::EvalCodec::Kind::kRows;
    h.row_bits_k = keep == 1 ? 2.0 * d + 32 : 16.0 * d;
    h.row_bits_v = keep == 2 ? 2.0 * d + 32 : 16.0 * d;
    const auto layers = standard[2].int2;
    h.round_trip = [layers, hkv, d, keep](int l, int which, const std::vector<float>& rows,
                                          int64_t n, std::vector<float>* o) {
      if ((which == 0) != (keep == 1)) {
        *o = rows;
        return;
      }
      kvcd::Int2RoundTrip(rows, n, hkv, d, layers[l], which, -1, o);
    };
    codecs.push_back(std::move(h));
  }
  // Hybrids: keys through the first variant's transform code, values through INT2 with
  // Hadamard's default clip or each --codec file's rotation and value clip (K: the
  // transform's --code-bits + 16 bits per row, V: INT2's 2 + 32/d bits per element).
  const size_t int2_codecs = 1 + codec_files.size();
  for (size_t i = 0; i < int2_codecs; ++i) {
    kvcd::EvalCodec h =
        kvcd::TransformEvalCodec(cals[0], vs[0].name + "-K+" + codecs[i].name + "-V", hkv);
    const auto layers = codecs[i].int2;
    const auto keys = h.round_trip;
    h.row_bits_v = 2.0 * d + 32;
    h.rows_fixed_bytes /= 2;  // the transform's K half
    for (const auto& il : layers) h.rows_fixed_bytes += il.groups * d * d * 4.0;
    h.round_trip = [layers, hkv, d, keys](int l, int which, const std::vector<float>& rows,
                                          int64_t n, std::vector<float>* o) {
      if (which == 0) {
        keys(l, which, rows, n, o);
      } else {
        kvcd::Int2RoundTrip(rows, n, hkv, d, layers[l], which, -1, o);
      }
    };
    codecs.push_back(std::move(h));
  }
  codecs.push_back(kvcd::TransformEvalCodec(cals[0], vs[0].name + "[K only]", hkv, 1));
  codecs.push_back(kvcd::TransformEvalCodec(cals[0], vs[0].name + "[V only]", hkv, 2));
  auto results = kvcd::Evaluate(*held, codecs, eo);
  if (!results.ok()) return std::fprintf(stderr, "%s\n", results.status().ToString().c_str()), 1;
  std::printf("\nheld-out (%lld tokens, %d positions, windows %lld + %lld BF16):\n",
              static_cast<long long>(held->tokens), eo.positions, static_cast<long long>(eo.sink),
              static_cast<long long>(eo.recent));
  std::printf("%-28s %10s %10s %10s %12s %12s\n", "codec", "out err", "KL mean", "KL p99",
              "bits/el hist", "fixed bytes");
  for (size_t i = 0; i < results->size(); ++i) {
    const auto& r = (*results)[i];
    const auto& c = codecs[i];
    const double hist = c.kind == kvcd::EvalCodec::Kind::kRows
                            ? (c.row_bits_k + c.row_bits_v) / (2.0 * d)
                            : 2.0 + 32.0 / d;
    std::printf("%-28s %10.4f %10.4f %10.3f %12.3f %12.0f\n", r.name.c_str(), r.overall.out_err,
                r.overall.kl_mean, r.overall.kl_p99, hist, r.fixed_bytes);
    nlohmann::json j = {{"out_err", r.overall.out_err},
                        {"kl_mean", r.overall.kl_mean},
                        {"kl_p99", r.overall.kl_p99},
                        {"history_bits_per_element", hist},
                        {"bits_per_element_with_windows", r.bits_per_element},
                        {"fixed_bytes", r.fixed_bytes}};
    for (const auto& l : r.layers) j["layers_out_err"].push_back(l.out_err);
    out["results"][r.name] = j;
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  return 0;
}
