#include "common/key_transform_profile.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/finite_floats.h"
#include "common/quote.h"
#include "common/rotation.h"

namespace kvcd {

absl::StatusOr<KeyTransformProfile> KeyTransformProfile::FromSafetensors(
    const SafetensorsFile& file, int num_layers, int hkv, int d) {
  auto version = file.metadata().find("kvcd.codec_version");
  if (version == file.metadata().end() || version->second != "3") {
    return absl::InvalidArgumentError(
        absl::StrCat("codec file version ",
                     version == file.metadata().end() ? std::string("1") : Quote(version->second),
                     ": expected 3 (transform-coded keys, kvcd.codec_version = \"3\")"));
  }
  if (file.Has(absl::StrCat("layers.", num_layers, ".k_encode"))) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec file has more layers than the model's ", num_layers, " (layers.",
                     num_layers, ".k_encode exists): it was calibrated for another model"));
  }
  KeyTransformProfile p;
  p.num_layers_ = num_layers;
  p.num_kv_heads_ = hkv;
  p.head_dim_ = d;
  const size_t dd = static_cast<size_t>(d) * d;
  for (int l = 0; l < num_layers; ++l) {
    auto read = [&](const char* what,
                    std::vector<int64_t> shape) -> absl::StatusOr<std::vector<float>> {
      const std::string name = absl::StrCat("layers.", l, ".", what);
      auto v = file.ReadFloats(name, shape);
      if (!v.ok()) {
        std::string s;
        for (int64_t x : shape) absl::StrAppend(&s, s.empty() ? "" : ", ", x);
        return absl::InvalidArgumentError(absl::StrCat(
            "codec file version 3: ", v.status().message(), " (", name, " must be F32 [", s, "])"));
      }
      if (absl::Status f = CheckFinite(name, *v); !f.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("codec file: ", f.message()));
      }
      return v;
    };
    auto enc = read("k_encode", {hkv, d, d});
    if (!enc.ok()) return enc.status();
    auto dec = read("k_decode", {hkv, d, d});
    if (!dec.ok()) return dec.status();
    auto mean = read("k_mean", {hkv, d});
    if (!mean.ok()) return mean.status();
    auto sigma = read("k_sigma", {hkv, d});
    if (!sigma.ok()) return sigma.status();
    auto bits = read("k_bits", {hkv, d});
    if (!bits.ok()) return bits.status();
    auto rv = read("r_v", {hkv, d, d});
    if (!rv.ok()) return rv.status();
    auto rho = read("rho_v", {hkv});
    if (!rho.ok()) return rho.status();
    for (int h = 0; h < hkv; ++h) {
      Head hd;
      hd.k_encode.assign(enc->begin() + h * dd, enc->begin() + (h + 1) * dd);
      hd.k_decode.assign(dec->begin() + h * dd, dec->begin() + (h + 1) * dd);
      hd.k_mean.assign(mean->begin() + h * d, mean->begin() + (h + 1) * d);
      hd.k_sigma.assign(sigma->begin() + h * d, sigma->begin() + (h + 1) * d);
      hd.r_v.assign(rv->begin() + h * dd, rv->begin() + (h + 1) * dd);
      hd.rho_v = (*rho)[h];
      const std::string at = absl::StrCat("layers.", l, ".");
      int sum = 0;
      for (int i = 0; i < d; ++i) {
        const float b = (*bits)[h * d + i];
        if (!(b >= 0 && b <= 8 && b == std::floor(b))) {
          return absl::InvalidArgumentError(absl::StrCat("codec file: ", at, "k_bits[", h, "][", i,
                                                         "] = ", b,
                                                         ", expected an integer in 0..8"));
        }
        if (i > 0 && b > hd.k_bits.back()) {
          return absl::InvalidArgumentError(absl::StrCat("codec file: ", at, "k_bits[", h,
                                                         "] rises at direction ", i,
                                                         ", expected non-increasing widths"));
        }
        hd.k_bits.push_back(static_cast<int>(b));
        sum += static_cast<int>(b);
        const float s = hd.k_sigma[i];
        if (b > 0 && !(s > 0 && std::isfinite(s))) {
          return absl::InvalidArgumentError(absl::StrCat("codec file: ", at, "k_sigma[", h, "][", i,
                                                         "] = ", s, ", expected > 0 (",
                                                         static_cast<int>(b), " bits)"));
        }
      }
      if (sum % 8 != 0 || sum == 0 || (p.key_code_bits_ != 0 && sum != p.key_code_bits_)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "codec file: ", at, "k_bits[", h, "] sums to ", sum,
            p.key_code_bits_ != 0 ? absl::StrCat(", the first head's to ", p.key_code_bits_) : "",
            ": expected one positive multiple of 8 for every layer and head"));
      }
      p.key_code_bits_ = sum;
      const double err = OrthogonalityError(hd.r_v, d);
      if (!(err <= 1e-3)) {
        return absl::InvalidArgumentError(
            absl::StrCat("codec file: ", at, "r_v[", h,
                         "] is not orthogonal (max |R R^T - I| = ", err, ", expected <= 1e-3)"));
      }
      if (!(hd.rho_v > 0.0f && hd.rho_v <= 1.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("codec file: ", at, "rho_v[", h, "] = ", hd.rho_v, ", expected (0, 1]"));
      }
      p.heads_.push_back(std::move(hd));
    }
  }
  return p;
}

kernels::TransformKeyCode KeyTransformProfile::KeyCode(int layer, int kv_head) const {
  const Head& x = head(layer, kv_head);
  kernels::TransformKeyCode c;
  c.d = head_dim_;
  c.encode = x.k_encode.data();
  c.decode = x.k_decode.data();
  c.mean = x.k_mean.data();
  c.sigma = x.k_sigma.data();
  c.bits = x.k_bits.data();
  c.code_bytes = key_code_bits_ / 8;
  return c;
}

std::vector<KeyTransformProfile::Head> KeyTransformProfile::SyntheticHeads(int layers, int hkv,
                                                                           int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<Head> heads;
  for (int i = 0; i < layers * hkv; ++i) {
    Head x;
    x.k_encode = RandomOrthogonal(d, static_cast<uint32_t>(rng()));
    x.k_decode.resize(x.k_encode.size());
    for (int r = 0; r < d; ++r)
      for (int c = 0; c < d; ++c) x.k_decode[c * d + r] = x.k_encode[r * d + c];
    int left = 2 * d + 16;  // INT2's 2d + 32 bits per row, less the 16-bit gain
    for (int j = 0; j < d; ++j) {
      x.k_mean.push_back(g(rng));
      x.k_sigma.push_back(3.0f * std::pow(0.93f, static_cast<float>(j)) + 0.01f);
      x.k_bits.push_back(std::max(0, std::min(left, 7 - 14 * j / d)));
      left -= x.k_bits.back();
    }
    for (int j = 0; left > 0; j = (j + 1) % d) {  // the rest on the widest with room
      if (x.k_bits[j] < 8 && (j == 0 || x.k_bits[j] < x.k_bits[j - 1])) ++x.k_bits[j], --left;
    }
    x.r_v = RandomOrthogonal(d, static_cast<uint32_t>(rng()));
    x.rho_v = 0.92f;
    heads.push_back(std::move(x));
  }
  return heads;
}

SafetensorsWriter KeyTransformProfile::ToSafetensors(const std::vector<Head>& heads, int layers,
                                                     int hkv, int d, const std::string& source) {
  SafetensorsWriter w;
  for (int l = 0; l < layers; ++l) {
    std::vector<float> enc, dec, mean, sigma, bits, rv, rho;
    for (int h = 0; h < hkv; ++h) {
      const Head& x = heads[static_cast<size_t>(l) * hkv + h];
      enc.insert(enc.end(), x.k_encode.begin(), x.k_encode.end());
      dec.insert(dec.end(), x.k_decode.begin(), x.k_decode.end());
      mean.insert(mean.end(), x.k_mean.begin(), x.k_mean.end());
      sigma.insert(sigma.end(), x.k_sigma.begin(), x.k_sigma.end());
      for (int b : x.k_bits) bits.push_back(static_cast<float>(b));
      rv.insert(rv.end(), x.r_v.begin(), x.r_v.end());
      rho.push_back(x.rho_v);
    }
    const std::string p = absl::StrCat("layers.", l, ".");
    w.AddF32(p + "k_encode", {hkv, d, d}, enc);
    w.AddF32(p + "k_decode", {hkv, d, d}, dec);
    w.AddF32(p + "k_mean", {hkv, d}, mean);
    w.AddF32(p + "k_sigma", {hkv, d}, sigma);
    w.AddF32(p + "k_bits", {hkv, d}, bits);
    w.AddF32(p + "r_v", {hkv, d, d}, rv);
    w.AddF32(p + "rho_v", {hkv}, rho);
  }
  w.SetMetadata("kvcd.codec", "int2-oscar");
  w.SetMetadata("kvcd.codec_version", "3");
  w.SetMetadata("kvcd.calibration", source);
  return w;
}

}  // namespace kvcd
