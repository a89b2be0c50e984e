// The format registry: API ids and config names of every history format, and the factories'
// codec loading, where codec_blob and codec_file errors name their source.
#include "server/formats/format_registry.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "common/fsq_codec.h"
#include "common/key_transform_profile.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvcd {
namespace format_registry_test {

using testing_util::TinyInt2Spec;
using testing_util::TinySpec;

ModelSpec TinyFsqSpec() {
  ModelSpec s = TinySpec();
  s.name = "tiny-fsq";
  s.history_format = FormatId::kFsq;
  s.fsq_residual_width = 24;
  s.fsq_latent_width = 9;
  return s;
}

FsqCodecShape FsqShape(const ModelSpec& s) {
  FsqCodecShape c;
  c.num_layers = s.num_layers;
  c.residual_width = s.fsq_residual_width;
  c.latent_width = s.fsq_latent_width;
  c.num_kv_heads = s.num_kv_heads;
  c.head_dim = s.head_dim;
  return c;
}

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(FormatRegistryTest, ApiIdsAndConfigNamesRoundTrip) {
  for (FormatId id : {FormatId::kBf16, FormatId::kInt2Oscar, FormatId::kFsq}) {
    const int proto = ProtoOfHistoryFormat(id);
    EXPECT_GT(proto, 0) << FormatName(id);
    auto back = HistoryFormatOfProto(proto);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, id);
    FormatId parsed = FormatId::kFsqWindow;
    ASSERT_TRUE(ParseFormatName(FormatName(id), "history_format", &parsed).ok());
    EXPECT_EQ(parsed, id);
  }
  EXPECT_EQ(*HistoryFormatOfProto(0), FormatId::kBf16);  // unspecified
  auto unknown = HistoryFormatOfProto(9);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(unknown.status()),
            "profile.history_format is 9, not a known HistoryFormat; expected "
            "HISTORY_FORMAT_BF16 (1), HISTORY_FORMAT_INT2_OSCAR (2) or HISTORY_FORMAT_FSQ (3)");
  FormatId out = FormatId::kBf16;
  const absl::Status bad = ParseFormatName("int2-transform", "history_format", &out);
  EXPECT_EQ(Message(bad),
            "history_format is 'int2-transform', expected 'bf16', 'int2-oscar' or 'fsq'");
  EXPECT_STREQ(FormatName(FormatId::kInt2Transform), "int2-transform");
  EXPECT_STREQ(FormatName(FormatId::kFsqWindow), "bf16+fsq");
}

TEST(FormatRegistryTest, FactoriesBuildEachHistoryOnTheCpu) {
  const ModelSpec tf = [] {
    ModelSpec s = TinyInt2Spec();
    s.codec = "";
    return s;
  }();
  const std::string v3 = KeyTransformProfile::ToSafetensors(
                             KeyTransformProfile::SyntheticHeads(2, 2, 16, 3), 2, 2, 16, "test")
                             .Serialize();
  const std::string fsq =
      FsqCodec::Synthetic(FsqShape(TinyFsqSpec()), 1).ToSafetensors().Serialize();
  const struct {
    ModelSpec spec;
    std::string blob;
    std::vector<FormatId> formats;
  } cases[] = {
      {TinySpec(), "", {FormatId::kBf16}},
      {TinyInt2Spec(), "", {FormatId::kBf16, FormatId::kInt2Oscar}},
      {tf, v3, {FormatId::kBf16, FormatId::kInt2Transform}},
      {TinyFsqSpec(), fsq, {FormatId::kFsqWindow, FormatId::kFsq}},
  };
  for (const auto& c : cases) {
    auto codec = LoadModelCodec(c.spec, c.blob);
    ASSERT_TRUE(codec.ok()) << codec.status();
    EXPECT_EQ((*codec)->history(), c.formats.back());
    const PageGeometry g{c.spec.num_layers, c.spec.num_kv_heads, c.spec.head_dim, c.spec.page_size};
    auto formats = (*codec)->CreateFormats(g, BackendKind::kCpu);
    ASSERT_TRUE(formats.ok()) << formats.status();
    ASSERT_EQ(formats->size(), c.formats.size());
    for (size_t i = 0; i < c.formats.size(); ++i) EXPECT_EQ((*formats)[i]->id(), c.formats[i]);
  }
}

TEST(FormatRegistryTest, CodecErrorsNameTheirSource) {
  const ModelSpec s = TinyFsqSpec();
  FsqCodecShape other = FsqShape(s);
  other.latent_width = 8;  // G of the codec != the profile's
  const std::string wrong = FsqCodec::Synthetic(other, 1).ToSafetensors().Serialize();

  auto blob = LoadModelCodec(s, wrong);
  EXPECT_EQ(blob.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(Message(blob.status()).find("model 'tiny-fsq': codec_blob: "), std::string::npos)
      << blob.status();
  EXPECT_NE(Message(blob.status()).find("'latent_width' is '8', expected 9"), std::string::npos)
      << blob.status();

  ModelSpec from_file = s;
  from_file.codec_file = WriteFile("wrong_fsq.safetensors", wrong);
  auto file = LoadModelCodec(from_file, "");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(Message(file.status()).find("codec_file '" + from_file.codec_file + "': "),
            std::string::npos)
      << file.status();
  EXPECT_EQ(Message(file.status()).find("codec_blob"), std::string::npos) << file.status();

  // Missing and malformed files, for each format that reads one.
  ModelSpec int2 = TinyInt2Spec();
  int2.codec = "";
  for (ModelSpec m : {s, int2}) {
    m.codec_file = ::testing::TempDir() + "/no_such_codec.safetensors";
    auto missing = LoadModelCodec(m, "");
    EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(Message(missing.status()).find("codec_file '" + m.codec_file + "'"),
              std::string::npos)
        << missing.status();
    m.codec_file = WriteFile("garbage.safetensors", "not a safetensors file");
    auto garbage = LoadModelCodec(m, "");
    EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(Message(garbage.status()).find("codec_file '" + m.codec_file + "'"),
              std::string::npos)
        << garbage.status();
    auto garbage_blob = LoadModelCodec(m, "not a safetensors file");
    EXPECT_NE(Message(garbage_blob.status()).find("codec_blob: "), std::string::npos)
        << garbage_blob.status();
  }

  // A blob only int2-oscar and fsq models read.
  auto bf16 = LoadModelCodec(TinySpec(), "x");
  EXPECT_EQ(bf16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(Message(bf16.status()).find("codec_blob is only used with history_format int2-oscar"),
            std::string::npos)
      << bf16.status();
}

}  // namespace format_registry_test
}  // namespace kvcd
