#include "tools/fsq_calibration.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvcd {
namespace {

using Eigen::MatrixXd;
using Eigen::VectorXd;

// Per-head RMSNorm in place: y / sqrt(mean(y²) + eps) · w.
void KeyNorm(double* y, int hkv, int d, const float* w, float eps) {
  if (w == nullptr) return;
  for (int h = 0; h < hkv; ++h) {
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += y[h * d + i] * y[h * d + i];
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int i = 0; i < d; ++i) y[h * d + i] = y[h * d + i] * inv * w[i];
  }
}

bool AllFinite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

absl::StatusOr<std::vector<KvProjection>> ReadKvProjections(const SafetensorsFile& f,
                                                            int num_layers, int kv, int c, int d) {
  std::vector<KvProjection> out;
  for (int l = 0; l < num_layers; ++l) {
    KvProjection p;
    const std::string pre = absl::StrCat("layers.", l, ".");
    std::vector<std::tuple<std::string, std::vector<float>*, std::vector<int64_t>, bool>> t = {
        {"wk", &p.wk, {kv, c}, true},
        {"wv", &p.wv, {kv, c}, true},
        {"bk", &p.bk, {kv}, false},
        {"bv", &p.bv, {kv}, false},
        {"k_norm", &p.key_norm, {d}, false}};
    for (auto& [name, target, shape, required] : t) {
      if (!required && !f.Has(pre + name)) continue;
      auto v = f.ReadFloats(pre + name, shape);
      if (!v.ok()) return v.status();
      if (!AllFinite(*v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("weights: tensor '", pre, name, "' has a NaN or Inf"));
      }
      *target = std::move(*v);
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<double> RidgeDecoder(const std::vector<double>& z, const std::vector<double>& xc,
                                 int64_t n, int g, int c, double lambda) {
  const Eigen::Map<const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> Z(
      z.data(), n, g),
      X(xc.data(), n, c);
  MatrixXd a = Z.transpose() * Z;
  a.diagonal().array() += lambda;
  const MatrixXd d = a.ldlt().solve(Z.transpose() * X);  // [G][C]
  std::vector<double> out(static_cast<size_t>(g) * c);
  for (int i = 0; i < g; ++i)
    for (int j = 0; j < c; ++j) out[static_cast<size_t>(i) * c + j] = d(i, j);
  return out;
}

absl::StatusOr<FsqCodec> CalibrateFsq(const ActivationDump& dump,
                                      const std::vector<KvProjection>& proj,
                                      const FsqCalibrationOptions& opt,
                                      std::vector<FsqLayerReport>* reports) {
  const int c = dump.residual_width, g = opt.latent_width, hkv = dump.num_kv_heads,
            d = dump.head_dim, kv = hkv * d;
  if (c <= 0) {
    return absl::InvalidArgumentError(
        "activation dump has no residuals (layers.<l>.x, metadata residual_width); write it "
        "with kvcd_stories --dump or another dumper that records them");
  }
  if (g < 1 || g > kernels::kFsqMaxLatent) {
    return absl::InvalidArgumentError(
        absl::StrCat("latent width ", g, " out of range 1..", kernels::kFsqMaxLatent));
  }
  if (!(opt.holdout > 0 && opt.holdout < 1)) {
    return absl::InvalidArgumentError("holdout must be in (0, 1)");
  }
  if (!(opt.lambda >= 0)) return absl::InvalidArgumentError("ridge lambda must be >= 0");
  if (static_cast<int>(dump.x.size()) != dump.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activation dump has residuals of ", dump.x.size(), " layers, expected ", dump.num_layers));
  }
  if (static_cast<int>(proj.size()) != dump.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights have ", proj.size(), " layers, the dump ", dump.num_layers));
  }
  const int64_t n = dump.tokens;
  const int64_t train = static_cast<int64_t>(std::floor(n * (1.0 - opt.holdout)));
  if (train < 2 || train >= n) {
    return absl::InvalidArgumentError(absl::StrCat("holdout ", opt.holdout, " of ", n,
                                                   " tokens leaves no training or held-out rows"));
  }
  for (int l = 0; l < dump.num_layers; ++l) {
    const size_t w = static_cast<size_t>(kv) * c;
    if (proj[l].wk.size() != w || proj[l].wv.size() != w ||
        (!proj[l].bk.empty() && proj[l].bk.size() != static_cast<size_t>(kv)) ||
        (!proj[l].bv.empty() && proj[l].bv.size() != static_cast<size_t>(kv)) ||
        (!proj[l].key_norm.empty() && proj[l].key_norm.size() != static_cast<size_t>(d))) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l, ": projections must be W^K, W^V [", kv, ", ", c, "], biases [",
                       kv, "], key norm [", d, "]"));
    }
    if (dump.x[l].size() != static_cast<size_t>(n) * c) {
      return absl::InvalidArgumentError(
          absl::StrCat("residual layers.", l, ".x must hold [", n, ", ", c, "]"));
    }
    if (!std::all_of(dump.x[l].begin(), dump.x[l].end(),
                     [](float v) { return std::isfinite(v); })) {
      return absl::InvalidArgumentError(absl::StrCat("residual layers.", l, ".x has a NaN or Inf"));
    }
  }
  FsqCodecShape shape;
  shape.num_layers = dump.num_layers;
  shape.residual_width = c;
  shape.latent_width = g;
  shape.num_kv_heads = hkv;
  shape.head_dim = d;
  shape.key_norm = !proj[0].key_norm.empty();
  shape.key_norm_eps = opt.key_norm_eps;
  for (int l = 1; l < dump.num_layers; ++l) {
    if (proj[l].key_norm.empty() == shape.key_norm) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l, ": key norm weights present in some layers only"));
    }
  }
  const kernels::RopeSpec no_rope{10000.0, d, 1.0, kernels::RopePairing::kHalf};  // position 0
  std::vector<FsqLayerTensors> layers;
  const std::string source = absl::StrCat("kvcd-calibrate fsq: PCA + ridge (lambda ", opt.lambda,
                                          ") on ", train, " tokens of ", dump.source);
  if (reports) reports->clear();
  for (int l = 0; l < dump.num_layers; ++l) {
    const KvProjection& P = proj[l];
    const float* xs = dump.x[l].data();
    // Mean and covariance of the training rows (FP64).
    VectorXd mu = VectorXd::Zero(c);
    for (int64_t t = 0; t < train; ++t)
      for (int j = 0; j < c; ++j) mu(j) += xs[t * c + j];
    mu /= static_cast<double>(train);
    MatrixXd xc(train, c);
    for (int64_t t = 0; t < train; ++t)
      for (int j = 0; j < c; ++j) xc(t, j) = xs[t * c + j] - mu(j);
    const MatrixXd cov = (xc.transpose() * xc) / static_cast<double>(train);
    Eigen::SelfAdjointEigenSolver<MatrixXd> eig(cov);
    // Descending eigenvalues; each eigenvector's largest-magnitude entry positive (the first
    // such on ties), as the OSCAR calibration fixes signs.
    std::vector<double> sigma(static_cast<size_t>(c));
    MatrixXd u(c, c);
    for (int i = 0; i < c; ++i) {
      const int src = c - 1 - i;
      VectorXd col = eig.eigenvectors().col(src);
      int arg = 0;
      for (int j = 1; j < c; ++j)
        if (std::abs(col(j)) > std::abs(col(arg))) arg = j;
      if (col(arg) < 0) col = -col;
      u.col(i) = col;
      sigma[i] = std::sqrt(std::max(eig.eigenvalues()(src), 0.0));
    }
    const double total_var = std::max(cov.trace(), 1e-300);
    FsqLayerTensors L;
    L.encoder.assign(static_cast<size_t>(g) * c, 0.0f);
    L.encoder_bias.assign(static_cast<size_t>(g), 0.0f);
    // A principal direction with (numerically) no variance gets a zero encoder row: its
    // coordinate is constant (z = 0) instead of amplified rounding noise.
    const double floor_sigma = 1e-6 * std::max(sigma[0], 1e-300);
    for (int i = 0; i < g; ++i) {
      const int j = i % c;
      if (sigma[j] <= floor_sigma) continue;
      double dot = 0;
      for (int k = 0; k < c; ++k) {
        const float e = static_cast<float>(u(k, j) / (3.0 * sigma[j]));
        L.encoder[static_cast<size_t>(i) * c + k] = e;
        dot += static_cast<double>(e) * mu(k);
      }
      L.encoder_bias[i] = static_cast<float>(-dot);
    }
    // Codes of every token with the encoder as stored (F32).
    kernels::FsqLayerCodec view;
    view.residual_width = c;
    view.latent_width = g;
    view.num_kv_heads = hkv;
    view.head_dim = d;
    view.encoder = L.encoder.data();
    view.encoder_bias = L.encoder_bias.data();
    const int64_t cb = kernels::FsqCodeBytes(g);
    std::vector<uint8_t> packed(static_cast<size_t>(n * cb));
    kernels::FsqEncodeRows(view, xs, n, packed.data());
    std::vector<int8_t> z(static_cast<size_t>(n) * g);
    for (int64_t t = 0; t < n; ++t)
      kernels::FsqUnpackCode(packed.data() + t * cb, g, z.data() + t * g);
    std::vector<double> zt(static_cast<size_t>(train) * g), xct(static_cast<size_t>(train) * c);
    for (int64_t i = 0; i < train * g; ++i) zt[i] = z[i];
    for (int64_t t = 0; t < train; ++t)
      for (int j = 0; j < c; ++j) xct[t * c + j] = xc(t, j);
    const std::vector<double> D = RidgeDecoder(zt, xct, train, g, c, opt.lambda);  // [G][C]
    // W_k = W^K Dᵀ [kv][G], b_k = W^K μ + b^K.
    L.decoder_k.resize(static_cast<size_t>(kv) * g);
    L.decoder_v.resize(L.decoder_k.size());
    L.bias_k.resize(static_cast<size_t>(kv));
    L.bias_v.resize(L.bias_k.size());
    for (int r = 0; r < kv; ++r) {
      const float* wk = P.wk.data() + static_cast<int64_t>(r) * c;
      const float* wv = P.wv.data() + static_cast<int64_t>(r) * c;
      for (int i = 0; i < g; ++i) {
        double ak = 0, av = 0;
        for (int j = 0; j < c; ++j) {
          ak += static_cast<double>(wk[j]) * D[static_cast<size_t>(i) * c + j];
          av += static_cast<double>(wv[j]) * D[static_cast<size_t>(i) * c + j];
        }
        L.decoder_k[static_cast<size_t>(r) * g + i] = static_cast<float>(ak);
        L.decoder_v[static_cast<size_t>(r) * g + i] = static_cast<float>(av);
      }
      double bk = P.bk.empty() ? 0.0 : P.bk[r], bv = P.bv.empty() ? 0.0 : P.bv[r];
      for (int j = 0; j < c; ++j) {
        bk += static_cast<double>(wk[j]) * mu(j);
        bv += static_cast<double>(wv[j]) * mu(j);
      }
      L.bias_k[r] = static_cast<float>(bk);
      L.bias_v[r] = static_cast<float>(bv);
    }
    L.key_norm = P.key_norm;

    // Held-out report: K, V through the model's projections vs rebuilt from the codes.
    FsqLayerReport rep;
    rep.train_tokens = train;
    rep.heldout_tokens = n - train;
    double ev = 0;
    for (int i = 0; i < std::min(g, c); ++i) ev += sigma[i] * sigma[i];
    rep.explained = ev / total_var;
    view.decoder_k = L.decoder_k.data();
    view.decoder_v = L.decoder_v.data();
    view.bias_k = L.bias_k.data();
    view.bias_v = L.bias_v.data();
    view.key_norm = L.key_norm.empty() ? nullptr : L.key_norm.data();
    view.key_norm_eps = opt.key_norm_eps;
    std::vector<double> k(static_cast<size_t>(kv)), v(k.size());
    std::vector<float> kh(k.size()), vh(k.size());
    double ek = 0, nk = 0, evv = 0, nv = 0, ex = 0, nx = 0;
    int64_t sat = 0;
    for (int64_t t = train; t < n; ++t) {
      const float* x = xs + t * c;
      const int8_t* zz = z.data() + t * g;
      for (int i = 0; i < g; ++i) sat += (zz[i] == -8 || zz[i] == 7);
      for (int r = 0; r < kv; ++r) {
        double ak = P.bk.empty() ? 0.0 : P.bk[r], av = P.bv.empty() ? 0.0 : P.bv[r];
        for (int j = 0; j < c; ++j) {
          ak += static_cast<double>(P.wk[static_cast<size_t>(r) * c + j]) * x[j];
          av += static_cast<double>(P.wv[static_cast<size_t>(r) * c + j]) * x[j];
        }
        k[r] = ak;
        v[r] = av;
      }
      KeyNorm(k.data(), hkv, d, P.key_norm.empty() ? nullptr : P.key_norm.data(), opt.key_norm_eps);
      kernels::FsqExpandToken(view, no_rope, packed.data() + t * cb, 0, kh.data(), vh.data());
      for (int r = 0; r < kv; ++r) {
        ek += (kh[r] - k[r]) * (kh[r] - k[r]);
        nk += k[r] * k[r];
        evv += (vh[r] - v[r]) * (vh[r] - v[r]);
        nv += v[r] * v[r];
      }
      for (int j = 0; j < c; ++j) {
        double xr = 0;
        for (int i = 0; i < g; ++i) xr += D[static_cast<size_t>(i) * c + j] * zz[i];
        const double target = x[j] - mu(j);
        ex += (xr - target) * (xr - target);
        nx += target * target;
      }
    }
    rep.k_rel_err = nk > 0 ? std::sqrt(ek / nk) : 0;
    rep.v_rel_err = nv > 0 ? std::sqrt(evv / nv) : 0;
    rep.x_rel_err = nx > 0 ? std::sqrt(ex / nx) : 0;
    rep.saturated = static_cast<double>(sat) / static_cast<double>((n - train) * g);
    if (reports) reports->push_back(rep);
    layers.push_back(std::move(L));
  }
  return FsqCodec::FromLayers(shape, std::move(layers), source);
}

}  // namespace kvcd
