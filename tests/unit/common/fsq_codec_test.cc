#include "common/fsq_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace kvcd {
namespace fsq_codec_test {

FsqCodecShape SmallShape(bool key_norm) {
  FsqCodecShape s;
  s.num_layers = 2;
  s.residual_width = 12;
  s.latent_width = 5;
  s.num_kv_heads = 2;
  s.head_dim = 4;
  s.key_norm = key_norm;
  s.key_norm_eps = 1e-5f;
  return s;
}

// Rebuilds a writer from a codec with one tensor or metadata key changed.
std::string Mutated(const FsqCodec& codec, const std::string& tensor, std::vector<int64_t> shape,
                    std::vector<float> values, const std::string& dtype = "F32") {
  SafetensorsWriter w;
  const FsqCodecShape& s = codec.shape();
  const int64_t g = s.latent_width, c = s.residual_width, kv = s.num_kv_heads * s.head_dim;
  for (int l = 0; l < s.num_layers; ++l) {
    const FsqLayerTensors& t = codec.layer(l);
    const std::pair<std::string, std::pair<std::vector<int64_t>, const std::vector<float>*>> all[] =
        {{"encoder", {{g, c}, &t.encoder}},
         {"encoder_bias", {{g}, &t.encoder_bias}},
         {"decoder_k", {{kv, g}, &t.decoder_k}},
         {"decoder_v", {{kv, g}, &t.decoder_v}},
         {"bias_k", {{kv}, &t.bias_k}},
         {"bias_v", {{kv}, &t.bias_v}},
         {"key_norm", {{s.head_dim}, &t.key_norm}}};
    for (const auto& [which, st] : all) {
      const std::string name = "layers." + std::to_string(l) + "." + which;
      if (which == "key_norm" && !s.key_norm && name != tensor) continue;
      if (name == tensor) {
        if (values.empty()) continue;  // dropped
        if (dtype == "F32") {
          w.AddF32(name, shape, values);
        } else {
          std::vector<uint16_t> half(values.size(), 0);
          w.Add(name, dtype, shape, half.data(), static_cast<int64_t>(half.size() * 2));
        }
      } else {
        w.AddF32(name, st.first, *st.second);
      }
    }
  }
  SafetensorsFile meta_src = *SafetensorsFile::Parse(codec.ToSafetensors().Serialize());
  for (const auto& [k, v] : meta_src.metadata()) w.SetMetadata(k, v);
  return w.Serialize();
}

absl::Status Load(const std::string& bytes, const FsqCodecShape& expected) {
  auto f = SafetensorsFile::Parse(bytes);
  if (!f.ok()) return f.status();
  return FsqCodec::FromSafetensors(*f, expected).status();
}

void ExpectInvalid(const absl::Status& st, const std::string& needle) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find(needle), std::string::npos)
      << "message '" << st.message() << "' lacks '" << needle << "'";
}

TEST(FsqCodecTest, RoundTripKeepsEveryTensorAndTheKernelView) {
  for (bool key_norm : {false, true}) {
    const FsqCodecShape shape = SmallShape(key_norm);
    const FsqCodec codec = FsqCodec::Synthetic(shape, 7);
    auto file = SafetensorsFile::Parse(codec.ToSafetensors().Serialize());
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->metadata().at("kvcd.codec"), "fsq");
    EXPECT_EQ(file->metadata().at("key_norm"), key_norm ? "rms" : "none");
    auto back = FsqCodec::FromSafetensors(*file, shape);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->source(), "synthetic seed 7");
    for (int l = 0; l < shape.num_layers; ++l) {
      EXPECT_EQ(back->layer(l).encoder, codec.layer(l).encoder);
      EXPECT_EQ(back->layer(l).encoder_bias, codec.layer(l).encoder_bias);
      EXPECT_EQ(back->layer(l).decoder_k, codec.layer(l).decoder_k);
      EXPECT_EQ(back->layer(l).decoder_v, codec.layer(l).decoder_v);
      EXPECT_EQ(back->layer(l).bias_k, codec.layer(l).bias_k);
      EXPECT_EQ(back->layer(l).bias_v, codec.layer(l).bias_v);
      EXPECT_EQ(back->layer(l).key_norm, codec.layer(l).key_norm);
      const kernels::FsqLayerCodec k = back->Layer(l);
      EXPECT_EQ(k.residual_width, 12);
      EXPECT_EQ(k.latent_width, 5);
      EXPECT_EQ(k.num_kv_heads, 2);
      EXPECT_EQ(k.head_dim, 4);
      EXPECT_EQ(k.encoder, back->layer(l).encoder.data());
      EXPECT_EQ(k.decoder_v[3], codec.layer(l).decoder_v[3]);
      EXPECT_EQ(k.key_norm != nullptr, key_norm);
      EXPECT_EQ(k.key_norm_eps, 1e-5f);
    }
  }
}

TEST(FsqCodecTest, MetadataMustMatchTheProfile) {
  const FsqCodecShape shape = SmallShape(false);
  const std::string good = FsqCodec::Synthetic(shape, 1).ToSafetensors().Serialize();
  for (auto [field, value] : std::vector<std::pair<const char*, int>>{{"num_layers", 3},
                                                                      {"residual_width", 16},
                                                                      {"latent_width", 6},
                                                                      {"num_kv_heads", 1},
                                                                      {"head_dim", 8}}) {
    FsqCodecShape other = shape;
    if (std::string(field) == "num_layers") other.num_layers = value;
    if (std::string(field) == "residual_width") other.residual_width = value;
    if (std::string(field) == "latent_width") other.latent_width = value;
    if (std::string(field) == "num_kv_heads") other.num_kv_heads = value;
    if (std::string(field) == "head_dim") other.head_dim = value;
    ExpectInvalid(Load(good, other), std::string("metadata '") + field + "'");
  }
  FsqCodecShape with_norm = shape;
  with_norm.key_norm = true;
  ExpectInvalid(Load(good, with_norm), "metadata 'key_norm' is 'none', expected 'rms'");

  // Another codec kind, and a file without metadata.
  SafetensorsWriter w = FsqCodec::Synthetic(shape, 1).ToSafetensors();
  w.SetMetadata("kvcd.codec", "int2-oscar");
  ExpectInvalid(Load(w.Serialize(), shape), "metadata 'kvcd.codec' is 'int2-oscar'");
  w.SetMetadata("kvcd.codec", "fsq");
  w.SetMetadata("version", "2");
  ExpectInvalid(Load(w.Serialize(), shape), "metadata 'version'");
  SafetensorsWriter bare;
  bare.AddF32("layers.0.encoder", {1}, {0.0f});
  ExpectInvalid(Load(bare.Serialize(), shape), "metadata 'kvcd.codec' is missing");
}

TEST(FsqCodecTest, EachBadTensorIsNamed) {
  const FsqCodecShape shape = SmallShape(true);
  const FsqCodec codec = FsqCodec::Synthetic(shape, 3);
  ASSERT_TRUE(Load(Mutated(codec, "none", {}, {}), shape).ok());
  const int64_t kv = 8;
  struct Case {
    std::string tensor;
    std::vector<int64_t> shape;
    int64_t n;
    std::string needle;
  };
  const Case cases[] = {
      {"layers.1.encoder", {12, 5}, 60, "'layers.1.encoder' has shape [12, 5], expected [5, 12]"},
      {"layers.0.encoder_bias", {6}, 6, "'layers.0.encoder_bias' has shape [6], expected [5]"},
      {"layers.1.decoder_k", {kv, 4}, kv * 4, "'layers.1.decoder_k' has shape [8, 4]"},
      {"layers.0.decoder_v", {kv + 1, 5}, (kv + 1) * 5, "'layers.0.decoder_v'"},
      {"layers.1.bias_k", {kv, 1}, kv, "'layers.1.bias_k' has shape [8, 1], expected [8]"},
      {"layers.1.bias_v", {7}, 7, "'layers.1.bias_v'"},
      {"layers.0.key_norm", {5}, 5, "'layers.0.key_norm' has shape [5], expected [4]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.tensor);
    ExpectInvalid(Load(Mutated(codec, c.tensor, c.shape, std::vector<float>(c.n, 0.5f)), shape),
                  c.needle);
    // Missing.
    ExpectInvalid(Load(Mutated(codec, c.tensor, {}, {}), shape), "'" + c.tensor + "' is missing");
  }
  // Wrong dtype.
  ExpectInvalid(
      Load(Mutated(codec, "layers.1.decoder_v", {kv, 5}, std::vector<float>(kv * 5, 1.0f), "BF16"),
           shape),
      "'layers.1.decoder_v' has dtype 'BF16', expected F32");
  // Non-finite values.
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> v = codec.layer(1).bias_v;
    v[5] = bad;
    ExpectInvalid(Load(Mutated(codec, "layers.1.bias_v", {kv}, v), shape),
                  "'layers.1.bias_v' element 5");
  }
  // A key norm the profile does not have.
  FsqCodecShape no_norm = shape;
  no_norm.key_norm = false;
  SafetensorsWriter w = codec.ToSafetensors();
  w.SetMetadata("key_norm", "none");
  ExpectInvalid(Load(w.Serialize(), no_norm), "'layers.0.key_norm' is present");
}

TEST(FsqCodecTest, ShapeRangesAndFromLayers) {
  FsqCodecShape s = SmallShape(false);
  s.latent_width = 0;
  ExpectInvalid(FsqCodec::ValidateShape(s), "latent_width is 0, expected 1..4096");
  s.latent_width = 4097;
  ExpectInvalid(FsqCodec::ValidateShape(s), "latent_width is 4097");
  s = SmallShape(true);
  s.key_norm_eps = 0.0f;
  ExpectInvalid(FsqCodec::ValidateShape(s), "key norm eps");
  s = SmallShape(false);
  s.residual_width = -1;
  ExpectInvalid(FsqCodec::ValidateShape(s), "residual_width is -1");

  s = SmallShape(false);
  FsqCodec good = FsqCodec::Synthetic(s, 2);
  std::vector<FsqLayerTensors> layers = {good.layer(0), good.layer(1)};
  EXPECT_TRUE(FsqCodec::FromLayers(s, layers).ok());
  layers[1].encoder_bias[2] = std::nanf("");
  ExpectInvalid(FsqCodec::FromLayers(s, layers).status(), "'layers.1.encoder_bias' element 2");
  layers = {good.layer(0)};
  ExpectInvalid(FsqCodec::FromLayers(s, layers).status(), "1 layers, expected 2");
}

}  // namespace fsq_codec_test
}  // namespace kvcd
