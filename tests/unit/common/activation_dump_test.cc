#include "common/activation_dump.h"

#include <gtest/gtest.h>

#include <cstdio>

#include "common/codec_profile.h"
#include "testing/synthetic_activations.h"
#include "tools/calibration.h"

namespace kvcd {
namespace activation_dump_test {

TEST(ActivationDumpTest, RoundTripAndCalibrationToALoadableCodecFile) {
  ActivationSpec spec;
  spec.num_layers = 2;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 32;
  spec.tokens = 96;
  ActivationDump dump{2, 4, 2, 32, 96, "test", GenerateActivations(spec)};
  const std::string path = ::testing::TempDir() + "/dump.safetensors";
  ASSERT_TRUE(WriteActivationDump(dump, path).ok());
  auto back = LoadActivationDump(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tokens, 96);
  EXPECT_EQ(back->source, "test");
  EXPECT_EQ(back->layers[1].k, dump.layers[1].k);

  CalibrationOptions opt;
  opt.search_clip = true;
  auto layers = Calibrate(*back, opt);
  ASSERT_TRUE(layers.ok()) << layers.status();
  ASSERT_EQ(layers->size(), 2u);
  for (const auto& c : *layers) {
    EXPECT_LT(c.orthogonality_k, 1e-5);
    EXPECT_LT(c.orthogonality_v, 1e-5);
    EXPECT_GE(c.spread_k, 1.0);
  }
  auto file = SafetensorsFile::Parse(CodecFile(*layers, 32, path).Serialize());
  ASSERT_TRUE(file.ok());
  auto codec = CodecProfile::FromSafetensors(*file, 2, 32, "calibrated");
  ASSERT_TRUE(codec.ok()) << codec.status();
  EXPECT_EQ(codec->RhoK(1), (*layers)[1].codec.rho_k[0]);
  EXPECT_EQ(std::vector<float>(codec->RV(0), codec->RV(0) + 32 * 32), (*layers)[0].codec.r_v);
  // A round trip of the codec profile itself.
  auto again = SafetensorsFile::Parse(codec->ToSafetensors().Serialize());
  ASSERT_TRUE(again.ok());
  auto codec2 = CodecProfile::FromSafetensors(*again, 2, 32, "again");
  ASSERT_TRUE(codec2.ok());
  EXPECT_EQ(std::vector<float>(codec2->RK(1), codec2->RK(1) + 32 * 32),
            std::vector<float>(codec->RK(1), codec->RK(1) + 32 * 32));
  std::remove(path.c_str());
}

TEST(ActivationDumpTest, MalformedDumpsAreRejected) {
  SafetensorsWriter w;
  w.AddF32("layers.0.q", {1, 1, 8}, std::vector<float>(8, 1.0f));
  const std::string path = ::testing::TempDir() + "/bad.safetensors";
  ASSERT_TRUE(w.WriteFile(path).ok());
  EXPECT_EQ(LoadActivationDump(path).status().code(), absl::StatusCode::kInvalidArgument);
  w.SetMetadata("kvcd.dump", "1");
  w.SetMetadata("num_layers", "1");
  w.SetMetadata("num_q_heads", "1");
  w.SetMetadata("num_kv_heads", "1");
  w.SetMetadata("head_dim", "8");
  w.SetMetadata("tokens", "1");
  ASSERT_TRUE(w.WriteFile(path).ok());
  EXPECT_EQ(LoadActivationDump(path).status().code(), absl::StatusCode::kNotFound);  // no k
  EXPECT_EQ(LoadActivationDump("/nonexistent").status().code(), absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

}  // namespace activation_dump_test
}  // namespace kvcd
