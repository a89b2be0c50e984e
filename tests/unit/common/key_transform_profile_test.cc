#include "common/key_transform_profile.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "common/rotation.h"

namespace kvcd {
namespace key_transform_profile_test {

constexpr int kD = 8, kHkv = 2, kLayers = 2;

std::vector<KeyTransformProfile::Head> Heads() {
  std::vector<KeyTransformProfile::Head> heads;
  for (int i = 0; i < kLayers * kHkv; ++i) {
    KeyTransformProfile::Head h;
    h.k_encode = h.k_decode = IdentityMatrix(kD);
    h.k_encode[1] = 0.5f + i;  // distinguishable per head
    h.k_mean.assign(kD, 0.25f * i);
    h.k_sigma.assign(kD, 1.0f);
    h.k_bits = {4, 3, 3, 2, 2, 1, 1, 0};  // 16 bits
    h.r_v = HadamardMatrix(kD);
    h.rho_v = 0.9f - 0.1f * i;
    heads.push_back(std::move(h));
  }
  return heads;
}

absl::StatusOr<KeyTransformProfile> RoundTrip(const std::vector<KeyTransformProfile::Head>& heads,
                                              int layers_in_file = kLayers, int layers = kLayers,
                                              int d = kD) {
  const std::string path = ::testing::TempDir() + "/key_transform_profile_test.st";
  EXPECT_TRUE(KeyTransformProfile::ToSafetensors(heads, layers_in_file, kHkv, kD, "test")
                  .WriteFile(path)
                  .ok());
  auto file = SafetensorsFile::Load(path);
  EXPECT_TRUE(file.ok()) << file.status();
  auto p = KeyTransformProfile::FromSafetensors(*file, layers, kHkv, d);
  std::remove(path.c_str());
  return p;
}

TEST(KeyTransformProfileTest, WritesAndReadsVersion3) {
  const auto heads = Heads();
  auto p = RoundTrip(heads);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->key_code_bits(), 16);
  for (int l = 0; l < kLayers; ++l)
    for (int h = 0; h < kHkv; ++h) {
      const auto& want = heads[l * kHkv + h];
      const auto& got = p->head(l, h);
      EXPECT_EQ(got.k_encode, want.k_encode);
      EXPECT_EQ(got.k_mean, want.k_mean);
      EXPECT_EQ(got.k_bits, want.k_bits);
      EXPECT_EQ(got.r_v, want.r_v);
      EXPECT_FLOAT_EQ(got.rho_v, want.rho_v);
    }
}

void ExpectRejected(const absl::StatusOr<KeyTransformProfile>& p, const std::string& needle) {
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find(needle), std::string::npos) << p.status().message();
}

TEST(KeyTransformProfileTest, RejectsWhatDoesNotFit) {
  ExpectRejected(RoundTrip(Heads(), kLayers, kLayers, 16), "k_encode must be F32 [2, 16, 16]");
  ExpectRejected(RoundTrip(Heads(), kLayers, kLayers - 1), "more layers than the model");
  auto h = Heads();
  h[1].k_bits[7] = 9;  // out of range (and the sum changes)
  ExpectRejected(RoundTrip(h), "expected an integer in 0..8");
  h = Heads();
  h[2].k_bits = {3, 4, 3, 2, 2, 1, 1, 0};  // rises
  ExpectRejected(RoundTrip(h), "non-increasing");
  h = Heads();
  h[3].k_bits = {4, 4, 3, 2, 2, 1, 1, 0};  // 17 bits: not a multiple of 8
  ExpectRejected(RoundTrip(h), "sums to 17");
  h = Heads();
  h[3].k_bits = {4, 4, 4, 4, 4, 2, 2, 0};  // 24 bits: differs from the first head's 16
  ExpectRejected(RoundTrip(h), "the first head's to 16");
  h = Heads();
  h[0].k_sigma[2] = 0.0f;
  ExpectRejected(RoundTrip(h), "k_sigma[0][2] = 0");
  h = Heads();
  h[1].r_v[0] = 3.0f;
  ExpectRejected(RoundTrip(h), "r_v[1] is not orthogonal");
  // Issue #35.1: NaN anywhere is refused by tensor and element, before any other check.
  h = Heads();
  h[1].r_v.assign(h[1].r_v.size(), std::nanf(""));
  ExpectRejected(RoundTrip(h), "layers.0.r_v element 64 is nan, expected finite values");
  h = Heads();
  h[2].k_sigma[7] = INFINITY;  // a direction of 0 bits: never used, still checked
  ExpectRejected(RoundTrip(h), "layers.1.k_sigma element 7 is inf");
  h = Heads();
  h[3].k_decode[3] = std::nanf("");
  ExpectRejected(RoundTrip(h), "layers.1.k_decode element 67 is nan");
  h = Heads();
  h[0].k_mean[0] = -INFINITY;
  ExpectRejected(RoundTrip(h), "layers.0.k_mean element 0 is -inf");
  h = Heads();
  h[2].rho_v = 0.0f;
  ExpectRejected(RoundTrip(h), "rho_v[0] = 0");
  // Version 2 files are not version 3.
  const std::string path = ::testing::TempDir() + "/key_transform_profile_v2.st";
  SafetensorsWriter w;
  w.AddF32("layers.0.r_k", {kHkv, kD, kD}, std::vector<float>(kHkv * kD * kD, 0.0f));
  w.SetMetadata("kvcd.codec_version", "2");
  ASSERT_TRUE(w.WriteFile(path).ok());
  auto file = SafetensorsFile::Load(path);
  ASSERT_TRUE(file.ok());
  ExpectRejected(KeyTransformProfile::FromSafetensors(*file, 1, kHkv, kD),
                 "version '2': expected 3");
  std::remove(path.c_str());
}

}  // namespace key_transform_profile_test
}  // namespace kvcd
