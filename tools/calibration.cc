#include "tools/calibration.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/rotation.h"
#include "kvcd/kernels/int2_codec.h"
#include "kvcd/kernels/reference_attention.h"

namespace kvcd {

double AttentionErrorWithCodec(const LayerActivations& a, int64_t n, int hq, int hkv, int d,
                               const std::vector<float>& r_k, const std::vector<float>& r_v,
                               float rho_k, float rho_v, int64_t q_begin, int64_t q_end) {
  std::vector<float> k_hat(static_cast<size_t>(n * hkv * d)), v_hat(k_hat.size());
  std::vector<uint8_t> codes(static_cast<size_t>(d / 4));
  uint16_t params[2];
  for (int64_t row = 0; row < n * hkv; ++row) {
    for (int which = 0; which < 2; ++which) {
      const float* src = (which == 0 ? a.k : a.v).data() + row * d;
      float* dst = (which == 0 ? k_hat : v_hat).data() + row * d;
      const auto& r = which == 0 ? r_k : r_v;
      const auto ref =
          kernels::Int2RowRef::RowMajor(codes.data(), d / 4, &params[0], &params[1], 2);
      kernels::DemoteRowsToInt2(src, 1, d, r.data(), which == 0 ? rho_k : rho_v, ref);
      kernels::ExpandInt2Rows(ref, 1, d, r.data(), dst);
    }
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> o(static_cast<size_t>(hq * d)), oh(o.size()), l(static_cast<size_t>(hq));
  double total = 0;
  int64_t count = 0;
  for (int64_t t = q_begin; t < q_end; ++t) {
    const float* q = a.q.data() + t * hq * d;
    kernels::ReferenceAttention(q, a.k.data(), a.v.data(), t + 1, hq, hkv, d, scale, o.data(),
                                l.data());
    kernels::ReferenceAttention(q, k_hat.data(), v_hat.data(), t + 1, hq, hkv, d, scale, oh.data(),
                                l.data());
    for (int h = 0; h < hq; ++h) {
      double err = 0, norm = 0;
      for (int c = 0; c < d; ++c) {
        const double diff = oh[h * d + c] - o[h * d + c];
        err += diff * diff;
        norm += o[h * d + c] * o[h * d + c];
      }
      if (norm > 0) {
        total += std::sqrt(err / norm);
        ++count;
      }
    }
  }
  return count > 0 ? total / count : 0.0;
}

absl::StatusOr<std::vector<LayerCalibration>> Calibrate(const ActivationDump& dump,
                                                        const CalibrationOptions& opt) {
  const int d = dump.head_dim;
  if (d < 2 || (d & (d - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", d, " is not a power of two"));
  }
  if (!(opt.holdout > 0 && opt.holdout < 1)) {
    return absl::InvalidArgumentError("holdout must be in (0, 1)");
  }
  const int64_t n = dump.tokens;
  const int64_t train = std::max<int64_t>(1, static_cast<int64_t>(n * (1.0 - opt.holdout)));
  const int64_t q_end = n, q_begin = std::max(train, n - opt.max_queries);
  std::vector<LayerCalibration> out;
  for (int l = 0; l < dump.num_layers; ++l) {
    if (opt.progress) opt.progress(l, dump.num_layers);
    const LayerActivations& a = dump.layers[l];
    LayerCalibration c;
    std::vector<double> ek, ev;
    // Covariances over the training rows only (the first `train` tokens).
    c.r_k = OscarRotation(KeyCovariance(a, train, dump.num_q_heads, dump.num_kv_heads, d), d, &ek);
    c.r_v =
        OscarRotation(ValueCovariance(a, train, dump.num_q_heads, dump.num_kv_heads, d), d, &ev);
    c.orthogonality_k = OrthogonalityError(c.r_k, d);
    c.orthogonality_v = OrthogonalityError(c.r_v, d);
    auto spread = [](const std::vector<double>& e) {
      const double lo = std::max(e.front(), 1e-300);
      return e.back() / lo;
    };
    c.spread_k = spread(ek);
    c.spread_v = spread(ev);
    auto score = [&](float rk, float rv) {
      return AttentionErrorWithCodec(a, n, dump.num_q_heads, dump.num_kv_heads, d, c.r_k, c.r_v, rk,
                                     rv, q_begin, q_end);
    };
    if (opt.search_clip) {
      const float grid[] = {0.88f, 0.90f, 0.92f, 0.94f, 0.96f, 0.98f, 1.0f};
      double best = score(c.rho_k, c.rho_v);
      for (float rk : grid) {  // keys first, then values with the chosen key quantile
        const double e = score(rk, c.rho_v);
        if (e < best) best = e, c.rho_k = rk;
      }
      for (float rv : grid) {
        const double e = score(c.rho_k, rv);
        if (e < best) best = e, c.rho_v = rv;
      }
      c.heldout_error = best;
    } else {
      c.heldout_error = score(c.rho_k, c.rho_v);
    }
    out.push_back(std::move(c));
  }
  if (opt.progress) opt.progress(dump.num_layers, dump.num_layers);
  return out;
}

SafetensorsWriter CodecFile(const std::vector<LayerCalibration>& layers, int d,
                            const std::string& source) {
  SafetensorsWriter w;
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    w.AddF32(p + "r_k", {d, d}, layers[l].r_k);
    w.AddF32(p + "r_v", {d, d}, layers[l].r_v);
    w.AddF32(p + "rho_k", {1}, {layers[l].rho_k});
    w.AddF32(p + "rho_v", {1}, {layers[l].rho_v});
  }
  w.SetMetadata("kvcd.codec", "int2-oscar");
  w.SetMetadata("kvcd.calibration", source);
  return w;
}

}  // namespace kvcd
