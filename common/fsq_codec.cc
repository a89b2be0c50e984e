#include "common/fsq_codec.h"

#include <cmath>
#include <cstdlib>
#include <random>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/finite_floats.h"
#include "common/quote.h"

namespace kvcd {
namespace {

constexpr const char* kCodecName = "fsq";
constexpr const char* kVersion = "1";

std::string TensorName(int l, const char* which) { return absl::StrCat("layers.", l, ".", which); }

absl::Status CheckTensor(const std::string& name, const std::vector<float>& v, int64_t expected) {
  if (static_cast<int64_t>(v.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("fsq codec: tensor '", name, "' has ", v.size(),
                                                   " elements, expected ", expected));
  }
  const int64_t bad = FirstNonFinite(v);
  if (bad >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("fsq codec: tensor '", name, "' element ", bad,
                                                   " is ", v[static_cast<size_t>(bad)],
                                                   ", expected a finite value"));
  }
  return absl::OkStatus();
}

absl::Status CheckMetadataInt(const std::map<std::string, std::string>& meta, const char* key,
                              int64_t expected) {
  auto it = meta.find(key);
  if (it == meta.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsq codec: metadata '", key, "' is missing, expected ", expected));
  }
  int64_t v = 0;
  if (!absl::SimpleAtoi(it->second, &v) || v != expected) {
    return absl::InvalidArgumentError(absl::StrCat("fsq codec: metadata '", key, "' is ",
                                                   Quote(it->second), ", expected ", expected,
                                                   " (the model profile)"));
  }
  return absl::OkStatus();
}

absl::Status CheckMetadataString(const std::map<std::string, std::string>& meta, const char* key,
                                 const std::string& expected) {
  auto it = meta.find(key);
  if (it == meta.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsq codec: metadata '", key, "' is missing, expected '", expected, "'"));
  }
  if (it->second != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fsq codec: metadata '", key, "' is ", Quote(it->second), ", expected '", expected, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FsqCodec::ValidateShape(const FsqCodecShape& s) {
  if (s.num_layers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsq codec: num_layers is ", s.num_layers, ", expected > 0"));
  }
  if (s.residual_width <= 0 || s.residual_width > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsq codec: residual_width is ", s.residual_width, ", expected 1..", 1 << 20));
  }
  if (s.latent_width <= 0 || s.latent_width > kernels::kFsqMaxLatent) {
    return absl::InvalidArgumentError(absl::StrCat("fsq codec: latent_width is ", s.latent_width,
                                                   ", expected 1..", kernels::kFsqMaxLatent));
  }
  if (s.num_kv_heads <= 0 || s.head_dim <= 0 ||
      int64_t{s.num_kv_heads} * s.head_dim > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsq codec: num_kv_heads x head_dim is ", s.num_kv_heads, " x ", s.head_dim,
                     ", expected positive with a product <= ", 1 << 20));
  }
  if (s.key_norm && !(std::isfinite(s.key_norm_eps) && s.key_norm_eps > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsq codec: key norm eps is ", s.key_norm_eps, ", expected > 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<FsqCodec> FsqCodec::FromLayers(const FsqCodecShape& shape,
                                              std::vector<FsqLayerTensors> layers,
                                              std::string source) {
  if (absl::Status st = ValidateShape(shape); !st.ok()) return st;
  if (static_cast<int64_t>(layers.size()) != shape.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsq codec: ", layers.size(), " layers, expected ", shape.num_layers));
  }
  const int64_t g = shape.latent_width, c = shape.residual_width;
  const int64_t kv = int64_t{shape.num_kv_heads} * shape.head_dim;
  for (int l = 0; l < shape.num_layers; ++l) {
    const FsqLayerTensors& t = layers[static_cast<size_t>(l)];
    const std::pair<const char*, std::pair<const std::vector<float>*, int64_t>> checks[] = {
        {"encoder", {&t.encoder, g * c}},
        {"encoder_bias", {&t.encoder_bias, g}},
        {"decoder_k", {&t.decoder_k, kv * g}},
        {"decoder_v", {&t.decoder_v, kv * g}},
        {"bias_k", {&t.bias_k, kv}},
        {"bias_v", {&t.bias_v, kv}},
        {"key_norm", {&t.key_norm, shape.key_norm ? int64_t{shape.head_dim} : 0}},
    };
    for (const auto& [which, tensor] : checks) {
      if (absl::Status st = CheckTensor(TensorName(l, which), *tensor.first, tensor.second);
          !st.ok()) {
        return st;
      }
    }
  }
  FsqCodec codec;
  codec.shape_ = shape;
  codec.layers_ = std::move(layers);
  codec.source_ = std::move(source);
  return codec;
}

absl::StatusOr<FsqCodec> FsqCodec::FromSafetensors(const SafetensorsFile& file,
                                                   const FsqCodecShape& expected) {
  if (absl::Status st = ValidateShape(expected); !st.ok()) return st;
  const auto& meta = file.metadata();
  for (absl::Status st :
       {CheckMetadataString(meta, "kvcd.codec", kCodecName),
        CheckMetadataString(meta, "version", kVersion),
        CheckMetadataInt(meta, "num_layers", expected.num_layers),
        CheckMetadataInt(meta, "residual_width", expected.residual_width),
        CheckMetadataInt(meta, "latent_width", expected.latent_width),
        CheckMetadataInt(meta, "num_kv_heads", expected.num_kv_heads),
        CheckMetadataInt(meta, "head_dim", expected.head_dim),
        CheckMetadataString(meta, "key_norm", expected.key_norm ? "rms" : "none")}) {
    if (!st.ok()) return st;
  }
  const int64_t g = expected.latent_width, c = expected.residual_width;
  const int64_t kv = int64_t{expected.num_kv_heads} * expected.head_dim;
  std::vector<FsqLayerTensors> layers(static_cast<size_t>(expected.num_layers));
  for (int l = 0; l < expected.num_layers; ++l) {
    FsqLayerTensors& t = layers[static_cast<size_t>(l)];
    const std::pair<const char*, std::pair<std::vector<float>*, std::vector<int64_t>>> reads[] = {
        {"encoder", {&t.encoder, {g, c}}},      {"encoder_bias", {&t.encoder_bias, {g}}},
        {"decoder_k", {&t.decoder_k, {kv, g}}}, {"decoder_v", {&t.decoder_v, {kv, g}}},
        {"bias_k", {&t.bias_k, {kv}}},          {"bias_v", {&t.bias_v, {kv}}},
    };
    for (const auto& [which, target] : reads) {
      const std::string name = TensorName(l, which);
      auto view = file.Get(name);
      if (!view.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("fsq codec: tensor '", name,
                         "' is missing (every layer needs encoder, encoder_bias, "
                         "decoder_k, decoder_v, bias_k, bias_v)"));
      }
      if (view->dtype != "F32") {
        return absl::InvalidArgumentError(absl::StrCat("fsq codec: tensor '", name, "' has dtype ",
                                                       Quote(view->dtype), ", expected F32"));
      }
      auto v = file.ReadFloats(name, target.second);
      if (!v.ok())
        return absl::InvalidArgumentError(absl::StrCat("fsq codec: ", v.status().message()));
      *target.first = std::move(*v);
    }
    const std::string norm_name = TensorName(l, "key_norm");
    if (expected.key_norm) {
      auto view = file.Get(norm_name);
      if (!view.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("fsq codec: tensor '", norm_name,
                                                       "' is missing, expected [",
                                                       expected.head_dim, "] (key_norm = rms)"));
      }
      if (view->dtype != "F32") {
        return absl::InvalidArgumentError(absl::StrCat("fsq codec: tensor '", norm_name,
                                                       "' has dtype ", Quote(view->dtype),
                                                       ", expected F32"));
      }
      auto v = file.ReadFloats(norm_name, {expected.head_dim});
      if (!v.ok())
        return absl::InvalidArgumentError(absl::StrCat("fsq codec: ", v.status().message()));
      t.key_norm = std::move(*v);
    } else if (file.Has(norm_name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fsq codec: tensor '", norm_name, "' is present but the profile has no key norm"));
    }
  }
  std::string source;
  if (auto it = meta.find("source"); it != meta.end()) source = it->second;
  return FromLayers(expected, std::move(layers), std::move(source));
}

FsqCodec FsqCodec::Synthetic(const FsqCodecShape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](int64_t n, float scale, float offset = 0.0f) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = offset + scale * normal(rng);
    return v;
  };
  const int64_t g = shape.latent_width, c = shape.residual_width;
  const int64_t kv = int64_t{shape.num_kv_heads} * shape.head_dim;
  FsqCodec codec;
  codec.shape_ = shape;
  codec.source_ = absl::StrCat("synthetic seed ", seed);
  for (int l = 0; l < shape.num_layers; ++l) {
    FsqLayerTensors t;
    t.encoder = fill(g * c, 2.0f / std::sqrt(static_cast<float>(c)));
    t.encoder_bias = fill(g, 0.1f);
    t.decoder_k = fill(kv * g, 1.0f / std::sqrt(static_cast<float>(g)));
    t.decoder_v = fill(kv * g, 1.0f / std::sqrt(static_cast<float>(g)));
    t.bias_k = fill(kv, 0.1f);
    t.bias_v = fill(kv, 0.1f);
    if (shape.key_norm) t.key_norm = fill(shape.head_dim, 0.1f, 1.0f);
    codec.layers_.push_back(std::move(t));
  }
  return codec;
}

SafetensorsWriter FsqCodec::ToSafetensors() const {
  SafetensorsWriter w;
  const int64_t g = shape_.latent_width, c = shape_.residual_width;
  const int64_t kv = int64_t{shape_.num_kv_heads} * shape_.head_dim;
  for (int l = 0; l < num_layers(); ++l) {
    const FsqLayerTensors& t = layer(l);
    w.AddF32(TensorName(l, "encoder"), {g, c}, t.encoder);
    w.AddF32(TensorName(l, "encoder_bias"), {g}, t.encoder_bias);
    w.AddF32(TensorName(l, "decoder_k"), {kv, g}, t.decoder_k);
    w.AddF32(TensorName(l, "decoder_v"), {kv, g}, t.decoder_v);
    w.AddF32(TensorName(l, "bias_k"), {kv}, t.bias_k);
    w.AddF32(TensorName(l, "bias_v"), {kv}, t.bias_v);
    if (shape_.key_norm) w.AddF32(TensorName(l, "key_norm"), {shape_.head_dim}, t.key_norm);
  }
  w.SetMetadata("kvcd.codec", kCodecName);
  w.SetMetadata("version", kVersion);
  w.SetMetadata("num_layers", absl::StrCat(shape_.num_layers));
  w.SetMetadata("residual_width", absl::StrCat(shape_.residual_width));
  w.SetMetadata("latent_width", absl::StrCat(shape_.latent_width));
  w.SetMetadata("num_kv_heads", absl::StrCat(shape_.num_kv_heads));
  w.SetMetadata("head_dim", absl::StrCat(shape_.head_dim));
  w.SetMetadata("key_norm", shape_.key_norm ? "rms" : "none");
  if (!source_.empty()) w.SetMetadata("source", source_);
  return w;
}

kernels::FsqLayerCodec FsqCodec::Layer(int l) const {
  const FsqLayerTensors& t = layer(l);
  kernels::FsqLayerCodec k;
  k.residual_width = shape_.residual_width;
  k.latent_width = shape_.latent_width;
  k.num_kv_heads = shape_.num_kv_heads;
  k.head_dim = shape_.head_dim;
  k.encoder = t.encoder.data();
  k.encoder_bias = t.encoder_bias.data();
  k.decoder_k = t.decoder_k.data();
  k.decoder_v = t.decoder_v.data();
  k.bias_k = t.bias_k.data();
  k.bias_v = t.bias_v.data();
  k.key_norm = shape_.key_norm ? t.key_norm.data() : nullptr;
  k.key_norm_eps = shape_.key_norm_eps;
  return k;
}

}  // namespace kvcd
