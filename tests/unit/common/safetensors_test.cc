#include "common/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "kvcd/kernels/bf16.h"

namespace kvcd {
namespace safetensors_test {

TEST(SafetensorsTest, RoundTrip) {
  SafetensorsWriter w;
  w.AddF32("a", {2, 3}, {1, 2, 3, 4, 5, 6});
  std::vector<uint16_t> b = {kernels::FloatToBf16(0.5f), kernels::FloatToBf16(-2.0f)};
  w.Add("b", "BF16", {2}, b.data(), 4);
  w.SetMetadata("model", "tiny");
  auto f = SafetensorsFile::Parse(w.Serialize());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("model"), "tiny");
  auto a = f->ReadFloats("a", {2, 3});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)[5], 6.0f);
  auto bf = f->ReadFloats("b", {});
  ASSERT_TRUE(bf.ok());
  EXPECT_EQ((*bf)[1], -2.0f);
  EXPECT_EQ(f->ReadFloats("a", {3, 2}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f->Get("missing").status().code(), absl::StatusCode::kNotFound);
}

// Load reads a file as Parse reads its bytes; a missing file is NOT_FOUND, a truncated one
// or a directory INVALID_ARGUMENT naming the path.
TEST(SafetensorsTest, LoadReadsTheFileAsParseReadsItsBytes) {
  SafetensorsWriter w;
  w.AddF32("a", {2, 3}, {1, 2, 3, 4, 5, 6});
  w.SetMetadata("model", "tiny");
  const std::string bytes = w.Serialize();
  const std::string path = ::testing::TempDir() + "/safetensors_test.safetensors";
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  auto f = SafetensorsFile::Load(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("model"), "tiny");
  auto a = f->ReadFloats("a", {2, 3});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  const std::string cut = ::testing::TempDir() + "/safetensors_test_cut.safetensors";
  std::ofstream(cut, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 4));
  auto truncated = SafetensorsFile::Load(cut);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(truncated.status().message().find(cut), std::string::npos) << truncated.status();
  EXPECT_EQ(SafetensorsFile::Load(::testing::TempDir()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsFile::Load(::testing::TempDir() + "/no-such.safetensors").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, MalformedFilesAreRejected) {
  EXPECT_FALSE(SafetensorsFile::Parse("abc").ok());
  std::string huge(8, '\xff');
  EXPECT_FALSE(SafetensorsFile::Parse(huge).ok());
  auto with_header = [](const std::string& json, size_t data) {
    std::string out(8, '\0');
    uint64_t n = json.size();
    std::memcpy(out.data(), &n, 8);
    return out + json + std::string(data, '\0');
  };
  EXPECT_FALSE(SafetensorsFile::Parse(with_header("[1]", 0)).ok());
  EXPECT_FALSE(SafetensorsFile::Parse(
                   with_header(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})", 8))
                   .ok());  // 4 floats need 16 bytes
  EXPECT_FALSE(SafetensorsFile::Parse(
                   with_header(R"({"x":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", 1))
                   .ok());
  EXPECT_FALSE(SafetensorsFile::Parse(
                   with_header(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 2))
                   .ok());  // past the end
  EXPECT_TRUE(SafetensorsFile::Parse(
                  with_header(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4))
                  .ok());
}

// Issue #35.5: names, dtypes and metadata keys come from the file; an error quotes them in
// 64 bytes (common/quote.h) so that it fits gRPC's metadata and reaches the client as
// INVALID_ARGUMENT, not RESOURCE_EXHAUSTED.
TEST(SafetensorsTest, ErrorsQuoteFileStringsBounded) {
  const std::string long_name(10240, 'n'), long_dtype(10240, 'D');
  auto with_header = [](const std::string& json) {
    std::string out(8, '\0');
    uint64_t n = json.size();
    std::memcpy(out.data(), &n, 8);
    return out + json + std::string(4, '\0');
  };
  const std::string files[] = {
      with_header("{\"" + long_name + "\":3}"),
      with_header("{\"x\":{\"dtype\":\"" + long_dtype +
                  "\",\"shape\":[1],\"data_offsets\":[0,4]}}"),
      with_header("{\"" + long_name +
                  "\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}"),
      with_header("{\"" + long_name +
                  "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}"),
      with_header("{\"__metadata__\":{\"" + long_name + "\":1}}"),
  };
  for (const std::string& f : files) {
    auto parsed = SafetensorsFile::Parse(f);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_LE(parsed.status().message().size(), 300u) << parsed.status().message().substr(0, 300);
    EXPECT_NE(parsed.status().message().find("...' (10240 bytes)"), std::string::npos)
        << parsed.status().message().substr(0, 300);
  }
  // A parsed file's tensor of an unreadable dtype, or of another shape, named bounded too.
  SafetensorsWriter w;
  const uint8_t bytes[4] = {};
  w.Add(long_name, "I32", {1}, bytes, 4);
  auto file = SafetensorsFile::Parse(w.Serialize());
  ASSERT_TRUE(file.ok()) << file.status();
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{}, std::vector<int64_t>{2}}) {
    const absl::Status s = file->ReadFloats(long_name, shape).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_LE(s.message().size(), 300u);
  }
  EXPECT_LE(file->Get(long_name + "x").status().message().size(), 300u);
}

}  // namespace safetensors_test
}  // namespace kvcd
