#include "tools/eval.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/codec_profile.h"
#include "common/finite_floats.h"
#include "common/key_transform_profile.h"
#include "common/quote.h"
#include "common/rotation.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/int2_codec.h"
#include "tools/transform_calibration.h"

namespace kvcd {
namespace {

using kernels::RoundBf16;
float RoundHalf(float x) { return kernels::HalfToFloat(kernels::FloatToHalf(x)); }

// KIVI-2: asymmetric 2-bit with FP16 scale and minimum per group; K per channel over groups
// of `group` tokens, V per token over groups of `group` channels.
void Kivi2(std::vector<float>* x, int64_t n, int heads, int d, int group, bool per_channel) {
  auto quant = [](float v, float lo, float scale) {
    const float q = std::min(std::max(std::floor((v - lo) / scale + 0.5f), 0.0f), 3.0f);
    return q * scale + lo;
  };
  if (per_channel) {
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < d; ++c)
        for (int64_t t0 = 0; t0 + group <= n; t0 += group) {
          float lo = std::numeric_limits<float>::max(), hi = -lo;
          for (int64_t t = t0; t < t0 + group; ++t) {
            lo = std::min(lo, (*x)[(t * heads + h) * d + c]);
            hi = std::max(hi, (*x)[(t * heads + h) * d + c]);
          }
          const float scale = RoundHalf(std::max(hi - lo, 1e-8f) / 3.0f), lo16 = RoundHalf(lo);
          for (int64_t t = t0; t < t0 + group; ++t) {
            float& v = (*x)[(t * heads + h) * d + c];
            v = quant(v, lo16, scale);
          }
        }
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int h = 0; h < heads; ++h)
        for (int c0 = 0; c0 < d; c0 += group) {
          float* row = x->data() + (t * heads + h) * d + c0;
          const int g = std::min(group, d - c0);
          float lo = *std::min_element(row, row + g), hi = *std::max_element(row, row + g);
          const float scale = RoundHalf(std::max(hi - lo, 1e-8f) / 3.0f), lo16 = RoundHalf(lo);
          for (int i = 0; i < g; ++i) row[i] = quant(row[i], lo16, scale);
        }
  }
}

// Logits, softmax, output of one query head over rows [0, n) (double).
void Attend(const float* q, const float* k, const float* v, int64_t n, int hkv, int kvh, int d,
            std::vector<double>* logits, std::vector<double>* p, std::vector<double>* o) {
  logits->assign(static_cast<size_t>(n), 0.0);
  p->assign(static_cast<size_t>(n), 0.0);
  o->assign(static_cast<size_t>(d), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    double s = 0;
    const float* kt = k + (t * hkv + kvh) * d;
    for (int c = 0; c < d; ++c) s += static_cast<double>(q[c]) * kt[c];
    (*logits)[t] = s * scale;
    mx = std::max(mx, (*logits)[t]);
  }
  double sum = 0;
  for (int64_t t = 0; t < n; ++t) sum += ((*p)[t] = std::exp((*logits)[t] - mx));
  for (int64_t t = 0; t < n; ++t) {
    (*p)[t] /= sum;
    const float* vt = v + (t * hkv + kvh) * d;
    for (int c = 0; c < d; ++c) (*o)[c] += (*p)[t] * vt[c];
  }
}

}  // namespace

std::vector<EvalCodec> StandardCodecs(int num_layers, int d) {
  std::vector<EvalCodec> c(4);
  c[0].name = "bf16";
  c[0].kind = EvalCodec::Kind::kBf16;
  c[1].name = "int2-naive";
  c[2].name = "int2-hadamard";
  for (int i = 1; i <= 2; ++i) {
    c[i].kind = EvalCodec::Kind::kInt2;
    const auto r = i == 1 ? IdentityMatrix(d) : HadamardMatrix(d);
    Int2Layer layer;
    layer.r_k = layer.r_v = r;
    layer.rho_k = {kernels::kDefaultRhoK};
    layer.rho_v = {kernels::kDefaultRhoV};
    c[i].int2.assign(num_layers, layer);
  }
  c[3].name = "kivi2";
  c[3].kind = EvalCodec::Kind::kKivi2;
  return c;
}

absl::StatusOr<std::vector<CodecResult>> Evaluate(const ActivationDump& dump,
                                                  const std::vector<EvalCodec>& codecs,
                                                  const EvalOptions& opt) {
  const int64_t n = dump.tokens;
  const int hq = dump.num_q_heads, hkv = dump.num_kv_heads, d = dump.head_dim, g = hq / hkv;
  const int64_t first =
      std::max<int64_t>(opt.min_position, std::min<int64_t>(n - 1, opt.sink + opt.recent));
  std::vector<int64_t> positions;
  for (int i = 0; i < opt.positions; ++i) {
    const int64_t t = first + (n - 1 - first) * (i + 1) / opt.positions;
    if (positions.empty() || positions.back() != t) positions.push_back(t);
  }
  std::vector<CodecResult> results;
  for (const EvalCodec& codec : codecs) {
    if (codec.kind == EvalCodec::Kind::kFsq) {
      const FsqCodecShape& f = codec.fsq.shape();
      if (dump.residual_width == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "codec '", codec.name, "' is FSQ: the dump must carry residuals (layers.<l>.x)"));
      }
      if (f.residual_width != dump.residual_width || f.num_kv_heads != hkv || f.head_dim != d ||
          f.num_layers != dump.num_layers) {
        return absl::InvalidArgumentError(absl::StrCat(
            "codec '", codec.name, "' has C = ", f.residual_width, ", ", f.num_kv_heads,
            " kv heads, head_dim ", f.head_dim, ", ", f.num_layers, " layers; the dump C = ",
            dump.residual_width, ", ", hkv, ", ", d, ", ", dump.num_layers));
      }
      if (codec.rope.rotary_dims <= 0 || codec.rope.rotary_dims > d ||
          codec.rope.rotary_dims % 2 != 0) {
        return absl::InvalidArgumentError(absl::StrCat("codec '", codec.name, "': rotary_dims ",
                                                       codec.rope.rotary_dims,
                                                       " must be even and in 2..", d));
      }
    }
    if (codec.kind == EvalCodec::Kind::kInt2) {
      if (static_cast<int>(codec.int2.size()) != dump.num_layers) {
        return absl::InvalidArgumentError(absl::StrCat("codec '", codec.name, "' has ",
                                                       codec.int2.size(), " layers, the dump ",
                                                       dump.num_layers));
      }
      for (const Int2Layer& l : codec.int2) {
        const size_t dd = static_cast<size_t>(d) * d, g = static_cast<size_t>(l.groups);
        if ((l.groups != 1 && l.groups != hkv) || l.r_k.size() != g * dd ||
            l.r_v.size() != g * dd || l.rho_k.size() != g || l.rho_v.size() != g) {
          return absl::InvalidArgumentError(absl::StrCat(
              "codec '", codec.name, "': ", l.groups, " rotation groups per layer, expected 1 or ",
              hkv, " of [", d, ", ", d, "] with one rho_k and rho_v each"));
        }
      }
    }
    if (codec.kind == EvalCodec::Kind::kRows && !codec.round_trip) {
      return absl::InvalidArgumentError(
          absl::StrCat("codec '", codec.name, "' is a row code without a round trip"));
    }
    const bool windowed = codec.kind == EvalCodec::Kind::kInt2 ||
                          codec.kind == EvalCodec::Kind::kFsq ||
                          codec.kind == EvalCodec::Kind::kRows;
    if (windowed && n <= opt.sink + opt.recent) {
      return absl::InvalidArgumentError(
          absl::StrCat("the dump has ", n, " tokens, not more than the BF16 windows (sink ",
                       opt.sink, " + recent ", opt.recent, "): codec '", codec.name,
                       "' would store nothing and score as BF16; use a longer dump or smaller "
                       "--sink/--recent"));
    }
    CodecResult res;
    res.name = codec.name;
    if (codec.kind == EvalCodec::Kind::kKivi2 && n < opt.kivi_residual + opt.kivi_group) {
      res.warning =
          absl::StrCat("the dump has ", n, " tokens, fewer than KIVI-2's FP16 residual window ",
                       opt.kivi_residual, " + one group of ", opt.kivi_group,
                       ": kivi2 quantizes nothing here (its figures are FP16's)");
    }
    std::vector<double> err_at(positions.size(), 0.0);
    std::vector<double> all_kl;
    for (int l = 0; l < dump.num_layers; ++l) {
      const LayerActivations& a = dump.layers[l];
      // Stored K/V: windows BF16, history through the codec (per evaluated position the
      // history is [sink, t - recent); rows outside it use their BF16 copy).
      std::vector<float> kb(a.k.size()), vb(a.v.size()), kq(a.k.size()), vq(a.v.size());
      for (size_t i = 0; i < a.k.size(); ++i) {
        kb[i] = RoundBf16(a.k[i]);
        vb[i] = RoundBf16(a.v[i]);
      }
      if (codec.kind == EvalCodec::Kind::kInt2) {
        Int2RoundTrip(a.k, n, hkv, d, codec.int2[l], 0, -1, &kq);
        Int2RoundTrip(a.v, n, hkv, d, codec.int2[l], 1, -1, &vq);
      } else if (codec.kind == EvalCodec::Kind::kFsq) {
        // Every token's code (kernels::FsqEncodeRows, the one definition), then its K/V
        // rebuilt at its position as the daemon's attention does.
        const kernels::FsqLayerCodec view = codec.fsq.Layer(l);
        const int64_t cb = kernels::FsqCodeBytes(view.latent_width);
        std::vector<uint8_t> codes(static_cast<size_t>(n * cb));
        kernels::FsqEncodeRows(view, dump.x[l].data(), n, codes.data());
        for (int64_t t = 0; t < n; ++t) {
          kernels::FsqExpandToken(view, codec.rope, codes.data() + t * cb, t,
                                  kq.data() + t * hkv * d, vq.data() + t * hkv * d);
        }
      } else if (codec.kind == EvalCodec::Kind::kRows) {
        codec.round_trip(l, 0, a.k, n, &kq);
        codec.round_trip(l, 1, a.v, n, &vq);
      } else if (codec.kind == EvalCodec::Kind::kKivi2) {
        kq = a.k;
        vq = a.v;
        Kivi2(&kq, n, hkv, d, opt.kivi_group, /*per_channel=*/true);
        Kivi2(&vq, n, hkv, d, opt.kivi_group, /*per_channel=*/false);
      } else {
        kq = kb;
        vq = vb;
      }
      EvalStats st;
      std::vector<double> kls;
      int64_t count = 0;
      std::vector<float> ks, vs;
      std::vector<double> l0, p0, o0, l1, p1, o1;
      for (size_t pi = 0; pi < positions.size(); ++pi) {
        const int64_t t = positions[pi];
        // Assemble the stored state at position t.
        const int64_t hist_begin = codec.kind == EvalCodec::Kind::kKivi2 ? 0 : opt.sink;
        const int64_t hist_end = codec.kind == EvalCodec::Kind::kKivi2
                                     ? std::max<int64_t>(0, (t + 1 - opt.kivi_residual) /
                                                                opt.kivi_group * opt.kivi_group)
                                     : std::max<int64_t>(hist_begin, t + 1 - opt.recent);
        ks.assign(kb.begin(), kb.begin() + (t + 1) * hkv * d);
        vs.assign(vb.begin(), vb.begin() + (t + 1) * hkv * d);
        if (codec.kind == EvalCodec::Kind::kKivi2) {  // residual window in FP16
          for (int64_t i = 0; i < (t + 1) * hkv * d; ++i) {
            ks[i] = RoundHalf(a.k[i]);
            vs[i] = RoundHalf(a.v[i]);
          }
        }
        for (int64_t r = hist_begin * hkv * d; r < hist_end * hkv * d; ++r) {
          ks[r] = kq[r];
          vs[r] = vq[r];
        }
        double err_t = 0;
        for (int h = 0; h < hq; ++h) {
          const float* q = a.q.data() + (t * hq + h) * d;
          Attend(q, a.k.data(), a.v.data(), t + 1, hkv, h / g, d, &l0, &p0, &o0);
          Attend(q, ks.data(), vs.data(), t + 1, hkv, h / g, d, &l1, &p1, &o1);
          double kl = 0, le = 0, ln = 0, oe = 0, on = 0;
          for (int64_t j = 0; j <= t; ++j) {
            if (p0[j] > 0) kl += p0[j] * (std::log(p0[j]) - std::log(std::max(p1[j], 1e-300)));
            le += (l1[j] - l0[j]) * (l1[j] - l0[j]);
            ln += l0[j] * l0[j];
          }
          for (int c = 0; c < d; ++c) {
            oe += (o1[c] - o0[c]) * (o1[c] - o0[c]);
            on += o0[c] * o0[c];
          }
          const double out_err = on > 0 ? std::sqrt(oe / on) : 0;
          kls.push_back(std::max(kl, 0.0));
          st.out_err += out_err;
          st.logit_err += ln > 0 ? std::sqrt(le / ln) : 0;
          err_t += out_err / hq;
          ++count;
        }
        err_at[pi] += err_t / dump.num_layers;
      }
      for (double k : kls) st.kl_mean += k;
      st.kl_mean /= std::max<int64_t>(1, count);
      st.out_err /= std::max<int64_t>(1, count);
      st.logit_err /= std::max<int64_t>(1, count);
      std::sort(kls.begin(), kls.end());
      st.kl_p99 = kls.empty() ? 0 : kls[std::min(kls.size() - 1, kls.size() * 99 / 100)];
      all_kl.insert(all_kl.end(), kls.begin(), kls.end());
      res.layers.push_back(st);
      res.overall.kl_mean += st.kl_mean / dump.num_layers;
      res.overall.out_err += st.out_err / dump.num_layers;
      res.overall.logit_err += st.logit_err / dump.num_layers;
    }
    std::sort(all_kl.begin(), all_kl.end());
    res.overall.kl_p99 =
        all_kl.empty() ? 0 : all_kl[std::min(all_kl.size() - 1, all_kl.size() * 99 / 100)];
    for (size_t pi = 0; pi < positions.size(); ++pi)
      res.out_err_by_position.push_back({positions[pi], err_at[pi]});
    // Storage cost at the full context, windows included, per token-head for K and V.
    double bytes_th = 0;
    const double dense = 2.0 * 2 * d;
    if (codec.kind == EvalCodec::Kind::kBf16) {
      bytes_th = dense;
    } else if (codec.kind == EvalCodec::Kind::kInt2) {
      const int64_t w = std::min<int64_t>(n, opt.sink + opt.recent);
      bytes_th = ((n - w) * 2.0 * (d / 4 + 4) + w * dense) / n;
      for (const Int2Layer& il : codec.int2) res.fixed_bytes += 2.0 * il.groups * d * d * 4;
    } else if (codec.kind == EvalCodec::Kind::kRows) {
      const int64_t w = std::min<int64_t>(n, opt.sink + opt.recent);
      bytes_th = ((n - w) * (codec.row_bits_k + codec.row_bits_v) / 8.0 + w * dense) / n;
      res.fixed_bytes = codec.rows_fixed_bytes;
    } else if (codec.kind == EvalCodec::Kind::kFsq) {
      // One code of ceil(G/2) bytes per token per layer, shared by the KV heads.
      const int64_t w = std::min<int64_t>(n, opt.sink + opt.recent);
      const FsqCodecShape& f = codec.fsq.shape();
      const double code = static_cast<double>(kernels::FsqCodeBytes(f.latent_width));
      bytes_th = ((n - w) * code / hkv + w * dense) / n;
      const double g = f.latent_width, c = f.residual_width, kvd = hkv * d;
      res.fixed_bytes =
          4.0 * dump.num_layers * (g * c + g + 2 * kvd * g + 2 * kvd + (f.key_norm ? d : 0));
    } else {
      const int64_t w = std::min<int64_t>(n, opt.kivi_residual);
      const double k_bytes =
          d / 4.0 + 4.0 * d / opt.kivi_group;  // codes + per-channel params / group tokens
      const double v_bytes = d / 4.0 + 4.0 * std::ceil(static_cast<double>(d) / opt.kivi_group);
      bytes_th = ((n - w) * (k_bytes + v_bytes) + w * dense) / n;
    }
    res.bits_per_element = bytes_th * 8 / (2.0 * d);
    res.bytes_per_token = bytes_th * hkv * dump.num_layers;
    res.compression = dense / bytes_th;
    results.push_back(std::move(res));
  }
  return results;
}

absl::StatusOr<EvalCodec> LoadInt2Codec(const SafetensorsFile& file, const ActivationDump& dump,
                                        const std::string& name) {
  const int d = dump.head_dim, hkv = dump.num_kv_heads, layers = dump.num_layers;
  EvalCodec c;
  c.name = name;
  c.kind = EvalCodec::Kind::kInt2;
  auto version = file.metadata().find("kvcd.codec_version");
  if (version == file.metadata().end() || version->second == "1") {
    auto profile = CodecProfile::FromSafetensors(file, layers, d, name);
    if (!profile.ok()) return profile.status();
    const size_t dd = static_cast<size_t>(d) * d;
    for (int l = 0; l < layers; ++l) {
      Int2Layer il;
      il.r_k.assign(profile->RK(l), profile->RK(l) + dd);
      il.r_v.assign(profile->RV(l), profile->RV(l) + dd);
      il.rho_k = {profile->RhoK(l)};
      il.rho_v = {profile->RhoV(l)};
      c.int2.push_back(std::move(il));
    }
    return c;
  }
  if (version->second == "3") {
    auto profile = KeyTransformProfile::FromSafetensors(file, layers, hkv, d);
    if (!profile.ok()) return profile.status();
    return KeyTransformEvalCodec(*profile, name);
  }
  if (version->second != "2") {
    return absl::InvalidArgumentError(
        absl::StrCat("codec file version ", Quote(version->second), ": expected 1, 2 or 3"));
  }
  if (file.Has(absl::StrCat("layers.", layers, ".r_k"))) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec file has more layers than the dump's ", layers, " (layers.", layers,
                     ".r_k exists): it was calibrated for another model"));
  }
  for (int l = 0; l < layers; ++l) {
    Int2Layer il;
    il.groups = hkv;
    for (const char* which : {"r_k", "r_v"}) {
      const std::string t = absl::StrCat("layers.", l, ".", which);
      auto v = file.ReadFloats(t, {hkv, d, d});
      if (!v.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("codec file version 2: ", v.status().message(),
                         " (every layer needs r_k and r_v of [", hkv, ", ", d, ", ", d, "])"));
      }
      if (absl::Status f = CheckFinite(t, *v); !f.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("codec file: ", f.message()));
      }
      for (int g = 0; g < hkv; ++g) {
        const std::vector<float> r(v->begin() + g * d * d, v->begin() + (g + 1) * d * d);
        const double err = OrthogonalityError(r, d);
        if (!(err <= 1e-3)) {
          return absl::InvalidArgumentError(
              absl::StrCat("codec file: ", t, "[", g,
                           "] is not orthogonal (max |R R^T - I| = ", err, ", expected <= 1e-3)"));
        }
      }
      (std::string(which) == "r_k" ? il.r_k : il.r_v) = std::move(*v);
    }
    for (const char* which : {"rho_k", "rho_v"}) {
      const std::string t = absl::StrCat("layers.", l, ".", which);
      auto v = file.ReadFloats(t, {hkv});
      if (!v.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "codec file version 2: ", v.status().message(), " (expected [", hkv, "])"));
      }
      for (float r : *v) {
        if (!(r > 0.0f && r <= 1.0f)) {
          return absl::InvalidArgumentError(
              absl::StrCat("codec file: ", t, " holds ", r, ", expected values in (0, 1]"));
        }
      }
      (std::string(which) == "rho_k" ? il.rho_k : il.rho_v) = std::move(*v);
    }
    c.int2.push_back(std::move(il));
  }
  return c;
}

}  // namespace kvcd
