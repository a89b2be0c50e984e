#include "tools/transform_calibration.h"

#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "tools/bit_allocation.h"

namespace kvcd {
namespace {

HeadPrediction Predict(const TransformCodec& c, const std::vector<double>& w,
                       const std::vector<double>& metric, int budget_bits) {
  const int d = c.d;
  const auto& mse = GaussianUniformMseTable();
  HeadPrediction p;
  double total = std::accumulate(w.begin(), w.end(), 0.0);  // tr(W C) in the fitted basis
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
  (void)total;
  return p;
}

}  // namespace

absl::StatusOr<TransformCalibration> CalibrateTransforms(const ActivationDump& dump,
                                                         const TransformCalibrationOptions& opt) {
  const int d = dump.head_dim, hq = dump.num_q_heads, hkv = dump.num_kv_heads, g = hq / hkv;
  const int64_t n = dump.tokens, first = std::min<int64_t>(opt.first_row, n);
  if (n - first < 2 * d) {
    return absl::InvalidArgumentError(absl::StrCat("the calibration dump has ", n - first,
                                                   " rows past row ", first, ", fewer than 2 * head_dim = ",
                                                   2 * d, ": the covariances would be singular"));
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
      const int budget = ck.RowBits() + (opt.k.row_gain ? 0 : 16);
      cal.pred_k.back().push_back(Predict(ck, wk, sq, budget));
      cal.pred_v.back().push_back(Predict(cv, wv, {}, budget));
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
  c.rows_fixed_bytes = static_cast<double>(cal->k.size()) * hkv * 2 * (2.0 * d * d * 4 + 2 * d * 4 + d);
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
        TransformRoundTrip(codecs[h], rows.data() + (t * hkv + h) * d, out->data() + (t * hkv + h) * d);
  };
  return c;
}

}  // namespace kvcd
