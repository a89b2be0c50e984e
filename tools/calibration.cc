#include "tools/calibration.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/rotation.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd {
namespace {

// The first n tokens of KV head h and its g query heads, as a one-KV-head layer.
LayerActivations HeadSlice(const LayerActivations& a, int64_t n, int hq, int hkv, int d, int h) {
  const int g = hq / hkv;
  LayerActivations s;
  s.q.resize(static_cast<size_t>(n * g * d));
  s.k.resize(static_cast<size_t>(n * d));
  s.v.resize(s.k.size());
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(a.q.data() + (t * hq + h * g) * d, g * d, s.q.data() + t * g * d);
    std::copy_n(a.k.data() + (t * hkv + h) * d, d, s.k.data() + t * d);
    std::copy_n(a.v.data() + (t * hkv + h) * d, d, s.v.data() + t * d);
  }
  return s;
}

}  // namespace

std::vector<float> ClipGrid(float floor) {
  std::vector<float> grid;
  const int first = std::clamp(static_cast<int>(std::lround(floor * 100.0f)), 2, 100);
  for (int i = first; i <= 100; i += 2) grid.push_back(static_cast<float>(i) / 100.0f);
  return grid;
}

std::vector<int64_t> HeldOutQueries(int64_t train, int64_t n, int max_queries) {
  std::vector<int64_t> q;
  const int64_t held = n - train;
  if (held <= 0 || max_queries <= 0) return q;
  if (held <= max_queries) {
    for (int64_t t = train; t < n; ++t) q.push_back(t);
    return q;
  }
  for (int i = 0; i < max_queries; ++i) {  // evenly spaced, the last held-out token included
    const int64_t t = train + (held - 1) * i / (max_queries - 1);
    if (q.empty() || q.back() != t) q.push_back(t);
  }
  return q;
}

double EigenSpread(const std::vector<double>& e) {
  if (e.empty()) return std::numeric_limits<double>::infinity();
  const double hi = e.back(), lo = e.front();
  if (!(hi > 0) || !(lo > hi * 1e-12)) return std::numeric_limits<double>::infinity();
  return hi / lo;
}

absl::StatusOr<std::vector<LayerCalibration>> Calibrate(const ActivationDump& dump,
                                                        const CalibrationOptions& opt,
                                                        CalibrationReport* report) {
  const int d = dump.head_dim, hq = dump.num_q_heads, hkv = dump.num_kv_heads;
  if (d < 8 || d > 256 || (d & (d - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", d, " is not a power of two in 8..256"));
  }
  if (!(opt.holdout > 0 && opt.holdout < 1)) {
    return absl::InvalidArgumentError("holdout must be in (0, 1)");
  }
  const int64_t n = dump.tokens;
  const int64_t train = std::max<int64_t>(1, static_cast<int64_t>(n * (1.0 - opt.holdout)));
  const std::vector<int64_t> queries = HeldOutQueries(train, n, opt.max_queries);
  if (report != nullptr) {
    const int64_t first_int2 = opt.windows.sink + opt.windows.recent;
    if (queries.empty() || queries.back() < first_int2) {
      report->warnings.push_back(absl::StrCat(
          "no held-out query (tokens ", train, "..", n - 1, ") has INT2 history with windows ",
          opt.windows.sink, " + ", opt.windows.recent,
          ": the held-out error is BF16 rounding only and --search-clip keeps the defaults; "
          "use a dump longer than ",
          static_cast<int64_t>(std::ceil(first_int2 / (1.0 - opt.holdout))), " tokens"));
    }
  }
  const int groups = opt.per_head ? hkv : 1;
  const size_t dd = static_cast<size_t>(d) * d;
  std::vector<LayerCalibration> out;
  for (int l = 0; l < dump.num_layers; ++l) {
    if (opt.progress) opt.progress(l, dump.num_layers);
    const LayerActivations& a = dump.layers[l];
    LayerCalibration c;
    Int2Layer& codec = c.codec;
    codec.groups = groups;
    codec.r_k.resize(groups * dd);
    codec.r_v.resize(groups * dd);
    codec.rho_k.assign(groups, kernels::kDefaultRhoK);
    codec.rho_v.assign(groups, kernels::kDefaultRhoV);
    for (int g = 0; g < groups; ++g) {
      // Covariances over the training rows only (the first `train` tokens).
      std::vector<double> ek, ev;
      std::vector<float> rk, rv;
      if (opt.hadamard) {
        rk = rv = HadamardMatrix(d);
      } else if (groups == 1) {
        rk = OscarRotation(KeyCovariance(a, train, hq, hkv, d), d, &ek);
        rv = OscarRotation(ValueCovariance(a, train, hq, hkv, d), d, &ev);
      } else {
        const LayerActivations s = HeadSlice(a, train, hq, hkv, d, g);
        rk = OscarRotation(KeyCovariance(s, train, hq / hkv, 1, d), d, &ek);
        rv = OscarRotation(ValueCovariance(s, train, hq / hkv, 1, d), d, &ev);
      }
      std::copy(rk.begin(), rk.end(), codec.r_k.begin() + g * dd);
      std::copy(rv.begin(), rv.end(), codec.r_v.begin() + g * dd);
      c.orthogonality_k = std::max(c.orthogonality_k, OrthogonalityError(rk, d));
      c.orthogonality_v = std::max(c.orthogonality_v, OrthogonalityError(rv, d));
      if (!opt.hadamard) {  // --hadamard fits no covariance: nothing to be singular
        c.spread_k = std::max(c.spread_k, EigenSpread(ek));
        c.spread_v = std::max(c.spread_v, EigenSpread(ev));
      }
    }
    // Scoring: K/V as kvcd stores them at each held-out query (BF16 windows).
    std::vector<float> kb(a.k.size()), vb(a.v.size()), kh(a.k.size()), vh(a.v.size());
    for (size_t i = 0; i < a.k.size(); ++i) {
      kb[i] = kernels::Bf16ToFloat(kernels::FloatToBf16(a.k[i]));
      vb[i] = kernels::Bf16ToFloat(kernels::FloatToBf16(a.v[i]));
    }
    Int2RoundTrip(a.k, n, hkv, d, codec, 0, -1, &kh);
    Int2RoundTrip(a.v, n, hkv, d, codec, 1, -1, &vh);
    const std::vector<double> exact = ExactOutputs(a, hq, hkv, d, queries);
    auto score = [&](int kv_head) {
      return StoredAttentionError(a, hq, hkv, d, kb, vb, kh, vh, opt.windows, queries, kv_head,
                                  &exact);
    };
    if (opt.search_clip) {
      // Per group, keys first, then values with the chosen key quantile (joint: and again
      // until neither changes). A group's error depends only on its own KV heads' rows, so
      // groups are searched apart.
      const std::vector<float> grid = ClipGrid(opt.clip_floor);
      for (int g = 0; g < groups; ++g) {
        const int head = groups == 1 ? -1 : g;
        const int passes = opt.joint_clip ? 6 : 2;
        int unchanged = 0;
        for (int pass = 0; pass < passes && unchanged < 2; ++pass) {
          const int which = pass % 2;
          float& rho = (which == 0 ? codec.rho_k : codec.rho_v)[g];
          std::vector<float>& hat = which == 0 ? kh : vh;
          const std::vector<float>& src = which == 0 ? a.k : a.v;
          double best = score(head);
          const float start = rho;
          float best_rho = rho;
          for (float r : grid) {
            if (r == start) continue;
            rho = r;
            Int2RoundTrip(src, n, hkv, d, codec, which, head, &hat);
            const double e = score(head);
            if (e < best) best = e, best_rho = r;
          }
          rho = best_rho;
          unchanged = best_rho == start && pass > 0 ? unchanged + 1 : 0;
          Int2RoundTrip(src, n, hkv, d, codec, which, head, &hat);
        }
      }
    }
    c.heldout_error = score(-1);
    out.push_back(std::move(c));
  }
  if (opt.progress) opt.progress(dump.num_layers, dump.num_layers);
  int singular = 0;
  for (const auto& c : out) singular += std::isinf(c.spread_k) || std::isinf(c.spread_v);
  if (report != nullptr && singular > 0) {
    report->warnings.push_back(absl::StrCat(
        "singular covariances on ", singular, " of ", dump.num_layers,
        " layers (spread inf): ", train, " training tokens give fewer rows than head_dim ", d, " (",
        train * (opt.per_head ? 1 : hkv),
        " value rows per covariance); the rotations are fitted to noise in the null space: "
        "use a dump of at least ",
        static_cast<int64_t>(std::ceil(d / ((1.0 - opt.holdout) * (opt.per_head ? 1 : hkv)))),
        " tokens"));
  }
  return out;
}

SafetensorsWriter CodecFile(const std::vector<LayerCalibration>& layers, int d,
                            const std::string& source) {
  SafetensorsWriter w;
  bool v2 = false;
  for (const auto& l : layers) v2 = v2 || l.codec.groups != 1;
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    const Int2Layer& c = layers[l].codec;
    std::vector<int64_t> mat = {d, d};
    if (v2) mat.insert(mat.begin(), c.groups);
    const int64_t rho = v2 ? c.groups : 1;
    w.AddF32(p + "r_k", mat, c.r_k);
    w.AddF32(p + "r_v", mat, c.r_v);
    w.AddF32(p + "rho_k", {rho}, c.rho_k);
    w.AddF32(p + "rho_v", {rho}, c.rho_v);
  }
  w.SetMetadata("kvcd.codec", "int2-oscar");
  if (v2) w.SetMetadata("kvcd.codec_version", "2");
  w.SetMetadata("kvcd.calibration", source);
  return w;
}

}  // namespace kvcd
