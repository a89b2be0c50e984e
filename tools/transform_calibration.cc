#include "tools/transform_calibration.h"

#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/rotation.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/int2_codec.h"
#include "tools/bit_allocation.h"
#include "tools/calibration.h"

namespace kvcd {
namespace {

HeadPrediction Predict(const TransformCodec& c, const std::vector<double>& w,
                       const std::vector<double>& metric, int budget_bits) {
  const int d = c.d;
  const auto& mse = GaussianUniformMseTable();
  HeadPrediction p;
  double tr_w = d;
  if (!metric.empty()) {
    tr_w = 0;
    for (int i = 0; i < d; ++i) tr_w += metric[i * d + i];
  }
  // tr(C) from sigma and the basis: for orthogonal bases sum sigma^2; in general we use
  // sum_i sigma_i^2 * ||decode column i||^2, exact when the y_i are uncorrelated.
  double tr_c = 0;
  for (int i = 0; i < d; ++i) {
    double col = 0;
    for (int j = 0; j < d; ++j) col += c.decode[j * d + i] * c.decode[j * d + i];
    tr_c += c.sigma[i] * c.sigma[i] * col;
  }
  p.hadamard = mse[2] * tr_w * tr_c / d;
  for (int i = 0; i < d; ++i) p.allocated += w[i] * mse[c.bits[i]];
  const int code = std::accumulate(c.bits.begin(), c.bits.end(), 0);
  for (int i = 0; i < d; ++i) {
    const int b = code / d + (i < code % d ? 1 : 0);
    p.uniform += w[i] * mse[b];
  }
  p.rd_floor = ReverseWaterFilling(w, budget_bits);
  return p;
}

}  // namespace

absl::StatusOr<TransformCalibration> CalibrateTransforms(const ActivationDump& dump,
                                                         const TransformCalibrationOptions& opt) {
  const int d = dump.head_dim, hq = dump.num_q_heads, hkv = dump.num_kv_heads, g = hq / hkv;
  const int64_t n = dump.tokens, first = std::min<int64_t>(opt.first_row, n);
  if (n - first < 2 * d) {
    return absl::InvalidArgumentError(
        absl::StrCat("the calibration dump has ", n - first, " rows past row ", first,
                     ", fewer than 2 * head_dim = ", 2 * d, ": the covariances would be singular"));
  }
  TransformCalibration cal;
  for (int l = 0; l < dump.num_layers; ++l) {
    const LayerActivations& a = dump.layers[l];
    cal.k.emplace_back();
    cal.v.emplace_back();
    cal.pred_k.emplace_back();
    cal.pred_v.emplace_back();
    for (int h = 0; h < hkv; ++h) {
      std::vector<double> kr, vr, sq(static_cast<size_t>(d) * d, 0.0);
      for (int64_t t = first; t < n; ++t)
        for (int j = 0; j < d; ++j) {
          kr.push_back(a.k[(t * hkv + h) * d + j]);
          vr.push_back(a.v[(t * hkv + h) * d + j]);
        }
      // Query second moment of the group, over every token (queries at all positions read
      // the history).
      for (int64_t t = 0; t < n; ++t)
        for (int qh = h * g; qh < (h + 1) * g; ++qh) {
          const float* q = a.q.data() + (t * hq + qh) * d;
          for (int i = 0; i < d; ++i)
            for (int j = 0; j < d; ++j) sq[i * d + j] += static_cast<double>(q[i]) * q[j] / (n * g);
        }
      const int64_t rows = n - first;
      std::vector<double> wk, wv;
      TransformFitOptions ko = opt.k, vo = opt.v;
      if (vo.basis == TransformBasis::kMetricEigen) vo.basis = TransformBasis::kDataKlt;
      TransformCodec ck = FitTransform(kr, rows, d, sq, ko, &wk);
      TransformCodec cv = FitTransform(vr, rows, d, {}, vo, &wv);
      if (opt.uniform_bits) {
        for (TransformCodec* c : {&ck, &cv}) {
          const int code = std::accumulate(c->bits.begin(), c->bits.end(), 0);
          for (int i = 0; i < d; ++i) c->bits[i] = code / d + (i < code % d ? 1 : 0);
        }
      }
      // The floor at the row's whole budget (codes and gain: 160 bits at 2.5 bits/element).
      cal.pred_k.back().push_back(Predict(ck, wk, sq, ko.code_bits + (ko.row_gain ? 16 : 0)));
      cal.pred_v.back().push_back(Predict(cv, wv, {}, vo.code_bits + (vo.row_gain ? 16 : 0)));
      cal.k.back().push_back(std::move(ck));
      cal.v.back().push_back(std::move(cv));
    }
  }
  return cal;
}

EvalCodec TransformEvalCodec(std::shared_ptr<const TransformCalibration> cal,
                             const std::string& name, int hkv, int keep) {
  EvalCodec c;
  c.name = name;
  c.kind = EvalCodec::Kind::kRows;
  const TransformCodec& k0 = cal->k[0][0];
  const int d = k0.d;
  c.row_bits_k = keep == 2 ? 16.0 * d : k0.RowBits();
  c.row_bits_v = keep == 1 ? 16.0 * d : cal->v[0][0].RowBits();
  // Per head: encode, decode (f32), mean, sigma (f32), bits (one byte each), K and V.
  c.rows_fixed_bytes =
      static_cast<double>(cal->k.size()) * hkv * 2 * (2.0 * d * d * 4 + 2 * d * 4 + d);
  c.round_trip = [cal, hkv, keep](int layer, int which, const std::vector<float>& rows, int64_t n,
                                  std::vector<float>* out) {
    if ((which == 0 && keep == 2) || (which == 1 && keep == 1)) {
      *out = rows;
      return;
    }
    const auto& codecs = which == 0 ? cal->k[layer] : cal->v[layer];
    const int d = codecs[0].d;
    for (int64_t t = 0; t < n; ++t)
      for (int h = 0; h < hkv; ++h)
        TransformRoundTrip(codecs[h], rows.data() + (t * hkv + h) * d,
                           out->data() + (t * hkv + h) * d);
  };
  return c;
}

std::vector<Int2Layer> SearchValueClips(const ActivationDump& dump, const TransformCalibration& cal,
                                        double holdout, int max_queries, float clip_floor,
                                        const StoredWindows& windows) {
  const int d = dump.head_dim, hq = dump.num_q_heads, hkv = dump.num_kv_heads;
  const int64_t n = dump.tokens;
  const int64_t train = std::max<int64_t>(1, static_cast<int64_t>(n * (1.0 - holdout)));
  const std::vector<int64_t> queries = HeldOutQueries(train, n, max_queries);
  const std::vector<float> h = HadamardMatrix(d), grid = ClipGrid(clip_floor);
  std::vector<Int2Layer> out;
  for (int l = 0; l < dump.num_layers; ++l) {
    const LayerActivations& a = dump.layers[l];
    Int2Layer v;
    v.groups = hkv;
    for (int g = 0; g < hkv; ++g) {
      v.r_k.insert(v.r_k.end(), h.begin(), h.end());
      v.r_v.insert(v.r_v.end(), h.begin(), h.end());
    }
    v.rho_k.assign(hkv, 1.0f);
    v.rho_v.assign(hkv, kernels::kDefaultRhoV);
    std::vector<float> kb(a.k.size()), vb(a.v.size()), kh(a.k.size()), vh(a.v.size());
    for (size_t i = 0; i < a.k.size(); ++i) {
      kb[i] = kernels::Bf16ToFloat(kernels::FloatToBf16(a.k[i]));
      vb[i] = kernels::Bf16ToFloat(kernels::FloatToBf16(a.v[i]));
    }
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < hkv; ++g)
        TransformRoundTrip(cal.k[l][g], a.k.data() + (t * hkv + g) * d,
                           kh.data() + (t * hkv + g) * d);
    const std::vector<double> exact = ExactOutputs(a, hq, hkv, d, queries);
    for (int g = 0; g < hkv; ++g) {
      double best = 1e300;
      float best_rho = v.rho_v[g];
      for (float r : grid) {
        v.rho_v[g] = r;
        Int2RoundTrip(a.v, n, hkv, d, v, 1, g, &vh);
        const double e =
            StoredAttentionError(a, hq, hkv, d, kb, vb, kh, vh, windows, queries, g, &exact);
        if (e < best) best = e, best_rho = r;
      }
      v.rho_v[g] = best_rho;
    }
    out.push_back(std::move(v));
  }
  return out;
}

std::vector<KeyTransformProfile::Head> KeyTransformHeads(const TransformCalibration& cal,
                                                         const std::vector<Int2Layer>& values) {
  std::vector<KeyTransformProfile::Head> heads;
  for (size_t l = 0; l < cal.k.size(); ++l) {
    for (size_t h = 0; h < cal.k[l].size(); ++h) {
      const TransformCodec& c = cal.k[l][h];
      const Int2Layer& v = values[l];
      const size_t dd = static_cast<size_t>(c.d) * c.d, g = v.Group(static_cast<int>(h));
      KeyTransformProfile::Head x;
      x.k_encode.assign(c.encode.begin(), c.encode.end());
      x.k_decode.assign(c.decode.begin(), c.decode.end());
      x.k_mean.assign(c.mean.begin(), c.mean.end());
      x.k_sigma.assign(c.sigma.begin(), c.sigma.end());
      x.k_bits = c.bits;
      x.r_v.assign(v.r_v.begin() + g * dd, v.r_v.begin() + (g + 1) * dd);
      x.rho_v = v.rho_v[g];
      heads.push_back(std::move(x));
    }
  }
  return heads;
}

EvalCodec KeyTransformEvalCodec(const KeyTransformProfile& p, const std::string& name) {
  const int d = p.head_dim(), hkv = p.num_kv_heads();
  auto keys = std::make_shared<std::vector<TransformCodec>>();  // [layer][kv head]
  auto values = std::make_shared<std::vector<Int2Layer>>();
  for (int l = 0; l < p.num_layers(); ++l) {
    Int2Layer v;
    v.groups = hkv;
    for (int h = 0; h < hkv; ++h) {
      const KeyTransformProfile::Head& x = p.head(l, h);
      TransformCodec c;
      c.d = d;
      c.encode.assign(x.k_encode.begin(), x.k_encode.end());
      c.decode.assign(x.k_decode.begin(), x.k_decode.end());
      c.mean.assign(x.k_mean.begin(), x.k_mean.end());
      c.sigma.assign(x.k_sigma.begin(), x.k_sigma.end());
      c.bits = x.k_bits;
      keys->push_back(std::move(c));
      v.r_k.insert(v.r_k.end(), x.r_v.begin(), x.r_v.end());  // unused (keys are transform-coded)
      v.r_v.insert(v.r_v.end(), x.r_v.begin(), x.r_v.end());
      v.rho_k.push_back(1.0f);
      v.rho_v.push_back(x.rho_v);
    }
    values->push_back(std::move(v));
  }
  EvalCodec c;
  c.name = name;
  c.kind = EvalCodec::Kind::kRows;
  c.row_bits_k = p.key_code_bits() + 16;
  c.row_bits_v = 2.0 * d + 32;
  c.rows_fixed_bytes =
      static_cast<double>(p.num_layers()) * hkv * (3.0 * d * d * 4 + 3 * d * 4 + 4);
  c.round_trip = [keys, values, hkv, d](int l, int which, const std::vector<float>& rows, int64_t n,
                                        std::vector<float>* out) {
    if (which == 1) {
      Int2RoundTrip(rows, n, hkv, d, (*values)[l], 1, -1, out);
      return;
    }
    for (int64_t t = 0; t < n; ++t)
      for (int h = 0; h < hkv; ++h)
        TransformRoundTrip((*keys)[static_cast<size_t>(l) * hkv + h],
                           rows.data() + (t * hkv + h) * d, out->data() + (t * hkv + h) * d);
  };
  return c;
}

}  // namespace kvcd
